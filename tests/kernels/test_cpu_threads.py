"""The engine's default thread count is the CPUs the process may use, also where
OpenMP binding (OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY) has pinned the main thread
to one CPU, and no more than the binding names (platforms/threads.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# In a fresh interpreter: take the CPUs named by argv[1] ("all": every CPU the machine
# grants, which widens an xdist worker's share; "first": one), then load torch (and so
# OpenMP, which binds here if the environment asks) and report the CPUs granted, the
# main thread's mask and the engine's default thread count.
PROBE = """
import json, os, sys
first = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, range(os.cpu_count()) if sys.argv[1] == "all" else {first})
granted = len(os.sched_getaffinity(0))
import torch
from llmserve.config import EngineConfig
from llmserve.platforms.threads import loaded_openmp
print(json.dumps({"granted": granted, "mask": len(os.sched_getaffinity(0)),
                  "openmp": loaded_openmp() is not None,
                  "num_threads": EngineConfig(model="none", device="cpu").num_threads}))
"""
# SMT-safe: one place per hardware thread
BOUND = {"OMP_PROC_BIND": "close", "OMP_PLACES": "threads"}


def probe(cpus: str, **env: str) -> dict:
    """PROBE on ``cpus`` with only ``env`` of OpenMP's variables (this process's are
    left out, so a CI that exports some cannot change the outcome)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", PROBE, cpus], env={**clean, **env},
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def machine() -> dict:
    """The unbound run: every CPU granted, no binding."""
    seen = probe("all")
    assert seen["openmp"], "torch's OpenMP runtime was not found among the loaded libraries"
    return seen


def test_unbound_default_is_the_affinity_mask(machine):
    assert machine["num_threads"] == machine["mask"] == machine["granted"]


@pytest.mark.parametrize("env", [BOUND, {"GOMP_CPU_AFFINITY": "0-1023"}],
                         ids=["OMP_PROC_BIND", "GOMP_CPU_AFFINITY"])
def test_openmp_binding_keeps_every_cpu(machine, env):
    if machine["granted"] < 2:
        pytest.skip("one CPU: a thread bound to one CPU has them all")
    seen = probe("all", **env)
    assert seen["mask"] == 1  # the trap: OpenMP bound the main thread to one CPU
    assert seen["num_threads"] == machine["granted"]


def test_openmp_binding_to_fewer_cpus_is_honoured(machine):
    """Places that name fewer CPUs than the process has: that many threads."""
    if machine["granted"] < 2:
        pytest.skip("one CPU: nothing fewer to name")
    first = "{" + str(min(os.sched_getaffinity(0))) + "}"
    assert probe("all", OMP_PROC_BIND="true", OMP_PLACES=first)["num_threads"] == 1


@pytest.mark.parametrize("env", [{}, BOUND], ids=["unbound", "bound"])
def test_a_narrower_cpuset_is_honoured(env):
    """A process granted fewer CPUs (taskset, a cpuset) gets no more threads than
    that, bound or not."""
    assert probe("first", **env)["num_threads"] == 1
