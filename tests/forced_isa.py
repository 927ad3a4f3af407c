"""Run a check in a fresh Python whose torch acts as another CPU kind
(``ATEN_CPU_CAPABILITY``): ATen's kernels and pack layouts, and the C kernels' build,
follow it. What the kernel tests use to cover the kinds the machine at hand is not."""

from __future__ import annotations

import os
import subprocess
import sys


def run_as(isa: str, script: str) -> list[str]:
    """``script``'s output lines, run with ``ATEN_CPU_CAPABILITY=isa``; fails the test
    with its stderr if it fails."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=isa)
    env.pop("LLMSERVE_CPU_MARCH", None)  # it would build for that CPU instead
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()
