"""Every subcommand's flags are pinned in cli_flags.json (next to this file), so a flag
lost or renamed while the flags are generated from EngineConfig's and GatewayConfig's
fields fails here. A flag added or removed on purpose is added to or removed from the
list in the same commit."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from llmserve.entrypoints.cli import build_parser

PINNED = json.loads(Path(__file__).with_name("cli_flags.json").read_text())


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(s for action in parser._actions for s in action.option_strings)


def test_every_subcommand_is_pinned():
    assert sorted(subcommands()) == sorted(PINNED)


@pytest.mark.parametrize("command", sorted(PINNED))
def test_the_flags_are_the_pinned_ones(command):
    parser = subcommands()[command]
    got = option_strings(parser)
    missing = sorted(set(PINNED[command]) - set(got))
    added = sorted(set(got) - set(PINNED[command]))
    assert not missing and not added, (
        f"llmserve {command}: flags lost {missing}, flags added {added} "
        f"(update tests/entrypoints/cli_flags.json only if that is intended)")
    assert got == PINNED[command]  # and none twice


@pytest.mark.parametrize("command", sorted(PINNED))
def test_help_lists_every_flag(command):
    text = subcommands()[command].format_help()
    hidden = [f for f in PINNED[command]
              if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    assert not hidden, f"llmserve {command} --help does not list {hidden}"
