"""A script's folder is first on its ``sys.path``: a ``benchmarks/`` or ``tests/`` file
named like an installed package shadows it for everything the script imports.
(``benchmarks/kernels.py`` once did: transformers imports Hugging Face's ``kernels``,
which a fresh install of its dependencies brought in, and every benchmark that loaded
a Llama config failed.)"""

from __future__ import annotations

import sys
from importlib.machinery import PathFinder
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def subfolders(top: str) -> list[str]:
    """benchmarks/ holds its scripts in one folder per topic, tests/ its tests in one
    folder per layer: each of those is first on the path of the scripts it holds."""
    return sorted(f"{top}/{p.name}" for p in (ROOT / top).iterdir() if p.is_dir())


FOLDERS = ("tests", "e2e", *subfolders("tests"), *subfolders("benchmarks"))


def script_names() -> list[str]:
    return sorted(p.stem for folder in FOLDERS
                  for p in (ROOT / folder).glob("*.py") if p.stem != "__init__")


def test_no_script_shadows_an_installed_module():
    ours = {str(ROOT / folder) for folder in FOLDERS} | {"", str(ROOT)}
    path = [p for p in sys.path if p not in ours]
    names = script_names()
    assert "vs_llamacpp" in names  # the glob found the scripts
    # PathFinder searches the folders only (find_spec would answer from sys.modules)
    shadowed = {name: spec.origin for name in names
                if (spec := PathFinder.find_spec(name, path)) is not None}
    assert not shadowed, f"rename these scripts: {shadowed}"


@pytest.mark.parametrize("name", ["kernels", "triton_kernels"])
def test_known_package_names_are_not_used(name):
    """Names transformers may import (its hub kernels, gpt-oss's MXFP4 kernels), even
    where this install lacks them."""
    assert name not in script_names()
