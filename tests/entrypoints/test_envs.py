"""llmserve/envs.py declares every environment variable llmserve reads, and nothing else
reads the environment: checked on the source, both ways."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from llmserve import envs

PACKAGE = Path(envs.__file__).parent
SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if p != Path(envs.__file__))


def parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def environment_reads(path: Path) -> list[str]:
    """Where ``path`` reads the environment itself: ``os.environ`` (other than spread
    whole into a child process's environment, ``{**os.environ, ...}``), ``os.getenv``,
    or either imported from ``os``."""
    tree = ast.parse(path.read_text())
    up = parents(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{path.name}:{node.lineno}: from os import {a.name}"
                      for a in node.names if a.name in ("environ", "getenv")]
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            parent = up[node]
            spread = isinstance(parent, ast.Dict) and any(
                key is None and value is node for key, value in zip(parent.keys,
                                                                    parent.values))
            if not spread:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: os.{node.attr}")
    return found


def variables_read(path: Path) -> set[str]:
    """The NAMEs of every ``envs.NAME`` in ``path``, and of every ``flag(..., env=NAME)``
    (a flag whose default is that variable's value)."""
    tree = ast.parse(path.read_text())
    attributes = {node.attr for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "envs"}
    flag_defaults = {k.value.value for node in ast.walk(tree)
                     if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "flag"
                     for k in node.keywords
                     if k.arg == "env" and isinstance(k.value, ast.Constant)}
    return attributes | flag_defaults


def test_only_envs_reads_the_environment():
    found = [where for path in SOURCES for where in environment_reads(path)]
    assert not found, "read through llmserve/envs.py instead: " + ", ".join(found)


def test_every_variable_read_is_declared_and_every_declared_one_is_read():
    read = set().union(*(variables_read(path) for path in SOURCES))
    functions = {name for name, value in vars(envs).items() if callable(value)}
    assert read - functions - set(envs.VARIABLES) == set()
    internal = {"LLMSERVE_CACHE", "LLMSERVE_KV_TRANSFER_SECRET"}  # read by envs.py's own
    assert set(envs.VARIABLES) - read == internal  # cache_root, kv_transfer_secret


def test_each_variable_is_documented():
    for name, var in envs.VARIABLES.items():
        assert name.isupper() and var.doc.strip(), name
        assert var.default is None or isinstance(var.default, (str, int, float, bool)), name


@pytest.mark.parametrize("name,text,value", [
    ("LLMSERVE_RESPONSES_STORE_MAX", "7", 7),
    ("LLMSERVE_TP_TIMEOUT_S", "1.5", 1.5),
    ("LLMSERVE_CPU_HUGE_PAGES", "0", False),
    ("LLMSERVE_CPU_HUGE_PAGES", "yes", True),
    ("LLMSERVE_CPU_KERNELS", "torch", "torch"),
    ("LLMSERVE_API_KEYS", "", ""),  # set but empty is not unset
])
def test_a_set_variable_is_its_text_converted_and_an_unset_one_its_default(
        monkeypatch, name, text, value):
    monkeypatch.delenv(name, raising=False)
    assert getattr(envs, name) == envs.VARIABLES[name].default
    monkeypatch.setenv(name, text)  # read at each access, never cached
    assert getattr(envs, name) == value
    assert type(getattr(envs, name)) is type(value)


def test_an_undeclared_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="LLMSERVE_NOPE"):
        envs.LLMSERVE_NOPE  # noqa: B018
