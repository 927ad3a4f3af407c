"""Host memory: give freed memory back to the operating system, and back the weights
with huge pages.

glibc's allocator keeps memory that Python and PyTorch free (the checkpoint's fp32
tensors read at load, a burst of requests' temporaries) in its heaps, where it still
counts as the process's resident memory: ~100 MB with the built-in model after its
start-up. ``malloc_trim`` returns the free pages. It walks the heap, so the engine
calls it at start-up and once when it has gone idle after work, never per step.

Importing torch and loading a model touch far more library code than serving runs:
PyPI's torch for Linux is a CUDA build whose CUDA libraries (cuBLASLt, nvJitLink,
NVRTC, libtorch_cuda, ...: ~170 MB of pages) a process serving on the CPU never runs
again, and libtorch_cpu's static initialisers alone touch ~65 MB of it.
``page_out_libraries`` hands those clean, file-backed pages back (``MADV_PAGEOUT``),
once, after loading and before the warm-up, which brings back what a step runs.

``advise_huge_pages`` asks for 2 MB pages, which ``worker/weight_arena.py`` puts the
CPU weights on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import linecache
import logging
import os
import re

from llmserve import envs

log = logging.getLogger(__name__)


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim"):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    if all(hasattr(libc, f) for f in ("mallopt", "malloc", "free")):  # (glibc has them)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        libc.free.restype = None
    return libc


def release_freed_memory(after_start_up: bool = False) -> bool:
    """Return freed heap pages to the OS; False where the C library has no
    ``malloc_trim`` (musl, macOS). ``after_start_up`` also drops the whole source files
    that imports read through linecache (warnings and inspect do: ~70 of torch's, ~2.6
    MB with the built-in model), once, before other threads format tracebacks."""
    if after_start_up:
        linecache.clearcache()
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    _trim_thread_arena_top(libc)
    return True


# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# What glibc's own thresholds rise to as large blocks are freed (64-bit): blocks below
# 32 MB come from the heaps, and a heap keeps up to 64 MB free at its top while serving,
# so that steps do not hand their temporaries back and fault them in again.
MMAP_THRESHOLD = 32 << 20
SERVING_TRIM_THRESHOLD = 2 * MMAP_THRESHOLD


def _trim_thread_arena_top(libc) -> None:
    """Hand back the free top of the calling thread's glibc arena. ``malloc_trim``
    returns the free pages in every arena's bins and at the main arena's top, but
    another thread's arena gives its top back only in ``free()``, once the top passes
    M_TRIM_THRESHOLD, which glibc raises (to 64 MB) as large blocks are freed. The
    engine thread's arena kept 15-50 MB there after start-up, run to run (the server's
    idle RSS read 572-621 MiB on the same build). So one ``free()`` of a block big enough
    to consolidate (64 KB and up) runs here with the threshold at 0, and the thresholds
    are then pinned where glibc's own would have risen to (after loading they have:
    the checkpoint's large blocks were freed), for the whole process: tops of up to 64
    MB stay between idle trims, as they did."""
    if not hasattr(libc, "mallopt"):
        return
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, 0)
    block = libc.malloc(128 << 10)
    libc.free(block)
    libc.mallopt(M_TRIM_THRESHOLD, SERVING_TRIM_THRESHOLD)


MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the range's pages (clean file pages are dropped)
# A shared library's path: libtorch_cpu.so, libcublasLt.so.13, _C.cpython-311-....so.
# Only libraries: a checkpoint served from an mmap (its weights) must stay resident.
SHARED_LIBRARY = re.compile(r"\.so(\.\d+)*$")


def library_ranges(maps_text: str) -> list[tuple[int, int]]:
    """(start, length) of each mapping of a shared library file in a /proc/PID/maps
    text."""
    ranges = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and SHARED_LIBRARY.search(fields[5]):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end - start))
    return ranges


def page_out_libraries() -> int:
    """Ask Linux to reclaim the shared libraries' pages in this process, which serves
    on the CPU (the caller's check), before its warm-up; returns how many ranges it
    accepted: 0 where CUDA was initialised here after all, or the kernel or C library
    has no MADV_PAGEOUT. Nothing is lost: a clean page comes back from the file when
    it is touched (the warm-up brings back what a step runs, the first request what
    serving HTTP runs), and a written one (relocated data) is kept where there is no
    swap."""
    import torch  # noqa: PLC0415 - loaded already by the engine; kept out of imports
    if torch.cuda.is_initialized():
        return 0
    libc = _libc()
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            ranges = library_ranges(f.read())
    except OSError:
        return 0
    if libc is None or not hasattr(libc, "madvise"):
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    # Linux takes only pages this process may write to the file of, or owns: a server
    # whose venv another user owns gets 0 back (and nothing is paged out).
    accepted = sum(libc.madvise(start, length, MADV_PAGEOUT) == 0 for start, length in ranges)
    log.debug("paged out %d of %d library mappings", accepted, len(ranges))
    return accepted


MADV_HUGEPAGE = 14  # let khugepaged collapse the range later (any THP mode but "never")
MADV_COLLAPSE = 25  # Linux 6.1+: collapse the range's pages into huge ones now
HUGE_PAGE = 2 << 20


def huge_pages_wanted() -> bool:
    """Whether the CPU weights go on huge pages (``LLMSERVE_CPU_HUGE_PAGES=0``: kept on 4
    KB pages, to measure against)."""
    return envs.LLMSERVE_CPU_HUGE_PAGES


def advise_huge_pages(start: int, length: int, collapse: bool) -> bool:
    """Ask Linux to back [start, start + length) (2 MB-aligned) with huge pages: before
    it is touched, so that its page faults take them (``MADV_HUGEPAGE``), or, with
    ``collapse``, now, for pages already there (``MADV_COLLAPSE``, Linux 6.1+, whatever
    the THP mode). True if Linux took the advice; False where it did not (an older
    kernel, THP off, no C library): the memory then stays on 4 KB pages, as before."""
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise"):
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise(start, length, MADV_COLLAPSE if collapse else MADV_HUGEPAGE) == 0
