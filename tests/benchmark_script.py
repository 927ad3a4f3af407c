"""A ``benchmarks/`` script imported by its path (``name``: "serving/disaggregation"), for
tests of its pure functions: under a module name of its own, registered while in use
(dataclasses look their module up) and removed after."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def benchmark_script(name: str):
    module = "bench_" + name.replace("/", "_")
    spec = importlib.util.spec_from_file_location(module, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)
