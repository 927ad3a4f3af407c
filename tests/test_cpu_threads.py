"""The engine's default thread count is the CPUs the process may use, also where
OpenMP binding (OMP_PROC_BIND / OMP_PLACES) has pinned the main thread to one CPU
(platforms/threads.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmserve.config import EngineConfig
from llmserve.platforms.threads import openmp_num_procs, usable_cpu_count

# Run after torch (and so OpenMP) is loaded, as in the engine's processes: the main
# thread's own mask, OpenMP's count and the engine's default thread count.
PROBE = """
import json, os
import torch
from llmserve.config import EngineConfig
print(json.dumps({"mask": len(os.sched_getaffinity(0)),
                  "num_threads": EngineConfig(model="none", device="cpu").num_threads,
                  "torch_threads": torch.get_num_threads()}))
"""
BOUND = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}


def probe(env: dict[str, str], cpus: set[int] | None = None) -> dict:
    """PROBE in a fresh interpreter with ``env`` added, on ``cpus`` (default: ours)."""
    def restrict():
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env},
                         capture_output=True, text=True, check=True, timeout=300,
                         preexec_fn=restrict)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_unbound_default_is_the_affinity_mask():
    assert usable_cpu_count() == len(os.sched_getaffinity(0))
    assert EngineConfig(model="none", device="cpu").num_threads == usable_cpu_count()
    import torch  # noqa: F401 - loads OpenMP, which then counts the same CPUs
    assert openmp_num_procs() in (None, len(os.sched_getaffinity(0)))


def test_openmp_binding_keeps_every_cpu():
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("one CPU: a thread bound to one CPU has them all")
    seen = probe(BOUND)
    if seen["mask"] == cpus:
        pytest.skip("this OpenMP runtime did not bind the main thread")
    assert seen["mask"] == 1  # the trap: the main thread's mask names one CPU
    assert seen["num_threads"] == cpus


def test_openmp_binding_within_a_narrower_cpuset():
    """A process granted fewer CPUs (taskset, a cpuset) gets no more threads than
    that, bound or not."""
    first = min(os.sched_getaffinity(0))
    for env in ({}, BOUND):
        assert probe(env, {first})["num_threads"] == 1
