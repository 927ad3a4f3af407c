"""Every file path and link in README.md and docs/*.md names something in the tree.

Docs outlive the code they describe: a module renamed or moved leaves its old path in
the prose, and nothing else notices. Checked here:
- paths under a top-level folder (``llmserve/...``, ``benchmarks/...``, ``tests/...``,
  ...), globs and brace lists included;
- backticked source paths relative to the package (``core/block_manager.py``) or bare
  file names (``decoder.c``), which must be the tail of some file in the tree;
- relative Markdown links, and the heading each ``#anchor`` names (GitHub's slugs).
"""

from __future__ import annotations

import re
from itertools import product
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_FOLDERS = ("llmserve", "benchmarks", "tests", "e2e", "charts", "crds", "examples",
               "docker", "docs")
SEARCHED = ("llmserve", "benchmarks", "tests", "e2e")
# Written by the benchmark scripts and ignored by git, so absent from a clean clone.
OUTPUTS = ("benchmarks/results/",)
TOP_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP_FOLDERS) + r")/[\w.*/{},-]*[\w*}])")
SOURCE_PATH = re.compile(r"`([\w./-]+\.(?:py|c|h))`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def expand_braces(path: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py`` (shell-style, not nested)."""
    pieces = re.split(r"\{([^{}]*)\}", path)
    choices = [[piece] if i % 2 == 0 else piece.split(",") for i, piece in enumerate(pieces)]
    return ["".join(parts) for parts in product(*choices)]


def exists(path: str) -> bool:
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def tree_files() -> list[str]:
    return [p.relative_to(ROOT).as_posix() for folder in SEARCHED
            for p in (ROOT / folder).rglob("*") if p.is_file()]


def top_paths(text: str) -> set[str]:
    found = {p for match in TOP_PATH.findall(text) for p in expand_braces(match)}
    return {p for p in found if not p.startswith(OUTPUTS)}


def source_paths(text: str) -> set[str]:
    found = set(SOURCE_PATH.findall(text))
    return {p for p in found if not p.startswith(TOP_FOLDERS)}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    result = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_link(doc: Path, target: str) -> str | None:
    file_part, _, anchor = target.partition("#")
    linked = (doc.parent / file_part).resolve() if file_part else doc
    if not linked.exists():
        return f"{target}: no such file"
    if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
        return f"{target}: no heading with that anchor"
    return None


def doc_id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_paths_under_top_folders_exist(doc):
    missing = sorted(p for p in top_paths(doc.read_text()) if not exists(p))
    assert not missing, f"{doc_id(doc)} names paths that are not in the tree: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_relative_source_paths_name_a_file(doc):
    files = tree_files()
    missing = sorted(p for p in source_paths(doc.read_text())
                     if not any(f == p or f.endswith("/" + p) for f in files))
    assert not missing, f"{doc_id(doc)} names files that no folder holds: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_links_reach_a_file_and_heading(doc):
    targets = [t for t in LINK.findall(FENCE.sub("", doc.read_text()))
               if not re.match(r"[a-z]+:", t)]
    broken = [problem for t in targets if (problem := broken_link(doc, t))]
    assert not broken, f"{doc_id(doc)}: {broken}"


def test_the_checks_see_what_they_check():
    """A regex that matched nothing would pass every doc."""
    readme = (ROOT / "README.md").read_text()
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    assert "charts/llmserve" in top_paths(readme)
    assert "tests/kernel_reference.py" in top_paths(architecture)
    assert "core/block_manager.py" in source_paths((ROOT / "docs" / "scheduling.md").read_text())
    assert expand_braces("a/{b,c}.py") == ["a/b.py", "a/c.py"]
    assert slug("Block manager (`core/block_manager.py`)") == "block-manager-coreblock_managerpy"
    assert slug("`--compile`") == "--compile"
    scheduling = ROOT / "docs" / "scheduling.md"
    assert broken_link(scheduling, "architecture.md#the-layer-map") is None
    assert broken_link(scheduling, "architecture.md#no-such-heading") is not None
    assert broken_link(scheduling, "no-such-file.md") is not None
