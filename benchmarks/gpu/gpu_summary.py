"""Merge the steps of ``gpu_check.sh`` into one ``summary.json`` (standard library only).

``gpu_check.sh`` keeps its working files in a scratch folder, not under ``$OUT`` (the
device tool returns at most 8 files): ``steps.tsv`` (one line per finished step: name,
exit code, seconds, limit, note), ``NAME.json`` (a step's own results) and ``NAME.log``
(its output). After every step this rewrites ``summary.json``, so a run stopped at
any point still returns what was measured before:

    {"mode": "gpu" | "dry-run", "ok": ..., "elapsed_s": ..., "budget_s": ...,
     "env": {...}, "steps": [{"name", "rc", "status", "seconds", "limit_s", ...}],
     "results": {"NAME": <NAME.json>, ...}}

A failed or timed-out step carries the last lines of its output (``tail``); pytest's
closing line is kept as ``summary`` (``pytest_*`` steps).

    python benchmarks/gpu/gpu_summary.py SCRATCH OUT/summary.json --mode gpu --budget 400
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

TAIL_LINES = 25


def read_steps(scratch: Path) -> list[dict]:
    steps = []
    path = scratch / "steps.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, rc, seconds, limit, note = (line.split("\t") + [""] * 5)[:5]
        rc_int = int(rc) if rc.lstrip("-").isdigit() else None
        status = ("skipped" if rc == "skipped" else "ok" if rc_int == 0 else
                  "timed out" if rc_int in (124, 137) else "failed")
        step = {"name": name, "rc": rc_int, "status": status, "seconds": float(seconds or 0),
                "limit_s": int(limit) if limit.isdigit() else None}
        if note:
            step["note"] = note
        steps.append(step)
    return steps


def last_lines(path: Path, n: int) -> list[str]:
    if not path.exists():
        return []
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-n:]


def summarize(scratch: Path, mode: str, budget: int, started: float) -> dict:
    steps = read_steps(scratch)
    results, env = {}, {}
    for step in steps:
        part = scratch / f"{step['name']}.json"
        if part.exists():
            try:
                results[step["name"]] = json.loads(part.read_text())
            except json.JSONDecodeError as e:  # a step killed while writing it
                results[step["name"]] = {"unreadable": str(e)}
        log = scratch / f"{step['name']}.log"
        if step["name"].startswith("pytest"):
            step["summary"] = (last_lines(log, 1) or [""])[0]
        if step["status"] in ("failed", "timed out"):
            step["tail"] = last_lines(log, TAIL_LINES)
    env = results.pop("env", env)
    return {"mode": mode, "ok": bool(steps) and all(s["status"] in ("ok", "skipped")
                                                    for s in steps),
            "elapsed_s": round(time.time() - started, 1), "budget_s": budget,
            "env": env, "steps": steps, "results": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scratch", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--mode", choices=("gpu", "dry-run"), required=True)
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--started", type=float, default=time.time(),
                    help="the check's start (seconds since the epoch)")
    ap.add_argument("--error", help="why the check stopped before its steps")
    args = ap.parse_args()
    summary = summarize(args.scratch, args.mode, args.budget, args.started)
    if args.error:
        summary.update(ok=False, error=args.error)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    tmp.replace(args.out)  # never a half-written summary.json
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
