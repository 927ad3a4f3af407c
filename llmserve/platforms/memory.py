"""Give freed host memory back to the operating system.

glibc's allocator keeps memory that Python and PyTorch free (the checkpoint's fp32
tensors read at load, a burst of requests' temporaries) in its heaps, where it still
counts as the process's resident memory: ~100 MB with the built-in model after its
start-up. ``malloc_trim`` returns the free pages. It walks the heap, so the engine
calls it at start-up and once when it has gone idle after work, never per step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import linecache


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
    return True
