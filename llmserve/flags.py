"""``flag()``: a field of a config dataclass that is also a command-line flag.

EngineConfig's and GatewayConfig's fields say here, once, what their flag shows: its
help, its choices and argparse's extras; ``entrypoints/config_flags.py`` turns them into
the ``llmserve`` command's flags. Shared by the engine's config and the gateway's (which
runs without torch), so it imports nothing of llmserve.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def flag(default: Any, help: str = "", *, choices: tuple[str, ...] | None = None,
         **argparse_extras: Any) -> Any:
    """A field that is also a flag: its default, its help and its choices (EngineConfig
    checks them in ``__post_init__`` too). ``argparse_extras``: what else the flag shows

    - ``metavar``, ``nargs`` (as argparse's), ``aliases`` (more option strings);
    - ``group``: the help section's title (None: the command's own options; unset: the
      config's section, e.g. "engine");
    - ``option``: the flag's name where it is not the field's (``--tenants`` for
      ``tenants_file``); ``action="append"``: repeatable, a list;
    - ``env``: an ``envs.py`` variable whose value is the flag's default.
    """
    return field(default=default, metadata={"help": help, "choices": choices,
                                            **argparse_extras})
