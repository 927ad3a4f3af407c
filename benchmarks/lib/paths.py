"""Where benchmarks read and write, whichever folder a script sits in."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"  # git-ignored: every script's default output
DATA = BENCHMARKS / "data"  # inputs that ship with the repository
FIGURES = ROOT / "docs" / "figures"  # plots the docs show
