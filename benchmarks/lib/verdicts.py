"""A GPU check's results file, one entry per case with its verdict, rewritten after each
case so that a run cut short keeps what it measured."""

from __future__ import annotations

import json
from pathlib import Path


def record(results: dict, failed: list, name: str, res: dict, problem: str | None,
           out: Path) -> None:
    """Keep ``name``'s result with its verdict, print it and rewrite ``out`` (a run cut
    short keeps what it measured)."""
    res["verdict"] = problem or "ok"
    if problem:
        failed.append(name)
    results[name] = res
    print(name, json.dumps(res), flush=True)
    out.write_text(json.dumps(results, indent=2))
