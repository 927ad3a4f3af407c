"""The CPU decode-attention kernel (``cpu_decode.c``), compiled for this machine.

Compiled once with the system C compiler (``cc``, ~1 s) for the CPU it runs on
(``-march=native``, or AVX2 when ``ATEN_CPU_CAPABILITY=avx2`` asks torch to act as an
AVX2 machine), cached under the llmserve cache folder keyed by the source, the
compiler and the CPU, and called through ctypes (which releases the GIL). OpenMP
threads come from the runtime torch already loaded (same ``libgomp.so.1``), so the
kernel shares torch's thread pool and thread count.

Where no compiler is found or the build fails, ``decode_kernel()`` returns None and
the engine keeps the pure-torch path (``cpu_attention.py``), with one warning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
# Reassociation lets the compiler vectorise the dot products and sums; no
# finite-math: softmax inputs are finite here, but the flag would change too much.
CFLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _march() -> str:
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default"):
        return "-march=haswell"  # AVX2 + FMA, what torch's AVX2 kernels assume
    return "-march=native"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build_dir() -> Path:
    from llmserve.engine.models.loader import cache_root
    root = cache_root() / "kernels"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "llmserve-kernels"  # read-only cache (images)


def _compile(compiler: str, flags: list[str]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, *flags,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    out_dir = _build_dir() / key
    target = out_dir / "cpu_decode.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: concurrent engines never load half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def decode_kernel():
    """The compiled ``paged_decode`` function, or None (the torch path is used)."""
    if os.environ.get("LLMSERVE_CPU_KERNELS", "native") == "torch":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention uses the slower torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_compile(compiler, [*CFLAGS, _march()])))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("building the CPU decode kernel failed (%s): using the torch path",
                    detail)
        return None
    fn = lib.paged_decode
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i32, ptr, i32, i64, i32, i32, i32, i32,
                   ctypes.c_float, i32]
    fn.restype = i32
    return fn


def paged_decode(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                 q_rows: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> None:
    """``out[q_rows[i]]`` = sequence i's new token attending over its cached context.
    ``q`` may be a view whose token rows are strided (the split of a fused QKV), but
    each head's ``head_dim`` values contiguous; ``out``, ``kv_cache`` (one layer:
    ``[2, blocks, block_size, kv_heads, head_dim]``), and the int32 ``q_rows``,
    ``tables`` ``[seqs, max_blocks]`` and ``seq_lens`` contiguous."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.is_contiguous()
    rc = decode_kernel()(q.data_ptr(), q.stride(0), out.data_ptr(), kv_cache.data_ptr(),
                         q_rows.data_ptr(), tables.data_ptr(), tables.shape[1],
                         seq_lens.data_ptr(), seq_lens.shape[0], num_blocks, block_size,
                         num_heads, kv_heads, head_dim, scale, DTYPE_CODES[q.dtype])
    if rc != 0:
        raise MemoryError("paged_decode: out of memory for its scratch buffers")
