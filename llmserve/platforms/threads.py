"""How many CPUs the engine's threads may use.

Normally that is the calling thread's affinity mask: the cores that a container's
cpuset, or ``taskset``, grants. CPU tuning guides also advise binding OpenMP's threads
(``OMP_PROC_BIND``, ``OMP_PLACES``, ``GOMP_CPU_AFFINITY``). With any of these set, GNU
OpenMP binds the process's initial thread to its first place as soon as it is loaded,
which happens when torch is imported. That thread's mask then names a single CPU.
Counting it would run the whole engine on one thread: 1.7-1.8x slower on 2 cores
(docs/benchmarks.md, issue 30's eleventh slice). Where OpenMP binds, its places are
the CPUs it may use, so the count is theirs: every CPU some place holds, but no more
than OpenMP found when it loaded (``omp_get_num_procs``).
"""

from __future__ import annotations

import ctypes
import os

# OpenMP runtimes a CPU build of torch may have loaded, by file name: GNU's (PyPI's
# Linux wheels; some builds rename it libgomp-<hash>.so.1), LLVM's, Intel's.
OPENMP_PREFIXES = ("libgomp", "libomp", "libiomp")


def loaded_openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (found in /proc/self/maps and opened
    with RTLD_NOLOAD, so never loaded here), or None: torch not imported yet, or built
    without OpenMP, or no /proc."""
    try:
        with open("/proc/self/maps") as f:
            fields = [line.split(maxsplit=5) for line in f]
    except OSError:
        return None
    paths = {f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/")}
    for path in sorted(paths):
        name = os.path.basename(path)
        if name.startswith(OPENMP_PREFIXES) and ".so" in name:
            try:
                return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                continue
    return None


def openmp_place_cpus() -> int | None:
    """How many CPUs OpenMP's places hold, where it binds threads to places; None where
    it does not bind (no places) or no OpenMP runtime is loaded."""
    lib = loaded_openmp()
    if lib is None or not hasattr(lib, "omp_get_num_places"):
        return None
    lib.omp_get_num_places.restype = ctypes.c_int
    lib.omp_get_place_num_procs.restype = ctypes.c_int
    lib.omp_get_num_procs.restype = ctypes.c_int
    cpus: set[int] = set()
    for place in range(lib.omp_get_num_places()):
        ids = (ctypes.c_int * max(1, lib.omp_get_place_num_procs(place)))()
        lib.omp_get_place_proc_ids(place, ids)
        cpus.update(ids)
    if not cpus:
        return None
    return min(len(cpus), lib.omp_get_num_procs())


def usable_cpu_count() -> int:
    """The CPUs the engine's threads may run on: those of OpenMP's places where it binds
    threads, else the calling thread's affinity mask."""
    places = openmp_place_cpus()
    return places if places is not None else len(os.sched_getaffinity(0))
