"""How many CPUs the engine's threads may use.

Normally that is the calling thread's affinity mask: the cores that a container's
cpuset, or ``taskset``, grants. CPU tuning guides also advise binding OpenMP's threads
(``OMP_PROC_BIND``, ``OMP_PLACES``). With either set, GNU OpenMP binds the process's
initial thread to its first place as soon as it is loaded, which happens when torch is
imported. That thread's mask then names a single CPU. Counting it would run the whole
engine on one thread: 1.7-1.8x slower on 2 cores (docs/benchmarks.md, issue 30's eleventh
slice). OpenMP's own count, taken before it bound anything (``omp_get_num_procs``),
is the number in that case.
"""

from __future__ import annotations

import ctypes
import os

# OpenMP runtimes a CPU build of torch may have loaded: GNU's (PyPI's Linux wheels),
# LLVM's, Intel's. Only an already-loaded one is asked (RTLD_NOLOAD).
OPENMP_LIBRARIES = ("libgomp.so.1", "libomp.so", "libiomp5.so")


def openmp_num_procs() -> int | None:
    """``omp_get_num_procs()`` of the OpenMP runtime this process has loaded, or None
    where none is loaded (torch not imported yet, or built without OpenMP)."""
    for name in OPENMP_LIBRARIES:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        num_procs = getattr(lib, "omp_get_num_procs", None)
        if num_procs is not None:
            num_procs.restype = ctypes.c_int
            return num_procs()
    return None


def usable_cpu_count() -> int:
    """The CPUs the engine's threads may run on: the calling thread's mask, or OpenMP's
    count where OpenMP has bound this thread to fewer (both are the cpuset's
    otherwise)."""
    return max(len(os.sched_getaffinity(0)), openmp_num_procs() or 0)
