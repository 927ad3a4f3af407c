"""int4 products of many rows on CPUs without bf16 arithmetic (``dequant.c``).

Where neither AVX512-BF16 nor AMX is there (Ice Lake and older Xeons, AVX2-only CPUs),
gemm.c's quant_gemm does not run, and ATen's weight-only int4 kernel re-reads and
re-dequantises the weight for each small tile of rows. From a few rows the C kernel
(decoder.c's q4_matmul) runs the product as a GEMM over panels of the weight
dequantised to float32 in L1, each once for all the rows; for long prefill chunks it is
cheaper still to write the weight out once in float32 (into a scratch reused from call
to call) and let MKL's float32 GEMM multiply (``q4_dequant_mm``). Either way the
weight is still stored, and streamed by decode steps, in int4. Which rows take which is
the dispatch table's (``dispatch.py``).

Where the CPU has AVX-512 VNNI or only AVX2, x is rounded to int8 instead
(``gemm.rounds_x_to_int8``, ``panel_int8.h``), and the C kernel's int8 panels take
every product of a few rows and more, long prefill chunks included.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from llmserve.kernels.cpu.decoder import int4_pack_block_n, q4_struct
from llmserve.kernels.cpu.native import cpu_library, panel_gemms_built
from llmserve.platforms.cpu import cpu_features

# The float32 copy is at most this big (a larger weight goes in chunks of columns): it
# is memory the KV budget does not know of (an 8B model's gate_up whole is several
# times this).
MAX_SCRATCH_BYTES = 64 << 20

_local = threading.local()  # each thread's scratch (tensor-parallel ranks may be threads)


def _scratch(k: int, n: int) -> torch.Tensor:
    """A [k, n] float32 buffer, reused: allocating it per call would page-fault it in
    again each time."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < k * n:
        buf = _local.buf = torch.empty(k * n, dtype=torch.float32)
    return buf[:k * n].view(k, n)


# ATen's int4 pack block on each ISA it vectorises for, which the C decoder stack, its
# panel GEMM and dequant.c read (their panels are half a block: panel.h's PANEL_COLS).
PACK_BLOCK_BY_ISA = {"AVX512": 64, "AVX2": 32}


@functools.cache
def int4_runs_in_float32() -> bool:
    """Whether an int4 model runs at full speed here although the CPU has no bf16
    arithmetic: on AVX-512 (Ice Lake, Cascade Lake, Skylake-X Xeons) and AVX2 (AMD Zen
    2/3, Haswell to Broadwell Xeons), where ATen packs int4 in the block the C decoder
    stack, its panel GEMM and dequant.c read (``PACK_BLOCK_BY_ISA``), with the kernels
    built for it (``panel_gemms_built``). All compute in float32; bf16 is only the
    storage of activations and the KV cache. Asked once."""
    features = cpu_features()
    block_n = PACK_BLOCK_BY_ISA.get(features.aten_isa)
    return (not features.native_bf16 and block_n is not None
            and int4_pack_block_n() == block_n and panel_gemms_built())


def q4_weight_f32(linear, c0: int = 0, c1: int | None = None) -> torch.Tensor:
    """Columns [c0, c1) of W^T, [K, c1 - c0] float32, of an int4 ``QuantizedLinear``
    (all of them by default), in the calling thread's scratch (valid until its next
    call)."""
    k, n = linear.in_features, linear.out_features
    c1 = n if c1 is None else c1
    out = _scratch(k, c1 - c0)
    lin = q4_struct(linear)
    rc = cpu_library().q4_dequant_f32(torch.get_num_threads(), ctypes.byref(lin),
                                      int4_pack_block_n(), c0, c1, out.data_ptr())
    if rc == -1:
        raise MemoryError("q4_dequant_f32: out of memory for its scale scratch")
    if rc != 0:
        raise ValueError(f"q4_dequant_f32: shape unsupported ({rc})")
    return out


def column_step(k: int, n: int) -> int:
    """Columns dequantised at a time: all of them, unless their float32 copy would
    pass MAX_SCRATCH_BYTES; whole pack blocks."""
    block_n = int4_pack_block_n()
    return min(n, max(block_n, MAX_SCRATCH_BYTES // (4 * k) // block_n * block_n))


def q4_dequant_mm(x: torch.Tensor, linear) -> torch.Tensor:
    """``linear(x)`` of an int4 ``QuantizedLinear`` (bf16 ``x [..., K]``, rounded to bf16
    as the other kernels return it): the weight dequantised to float32, then the float32
    GEMM (plus the bias). A weight too big for the scratch goes a chunk of columns at a
    time (for small ones one whole GEMM measured faster than chunks sized for L2: many
    narrow GEMMs)."""
    k, n = linear.in_features, linear.out_features
    rows = x.reshape(-1, k).float()
    step = column_step(k, n)
    if step == n:
        y = torch.mm(rows, q4_weight_f32(linear))
    else:
        y = torch.empty(rows.shape[0], n, dtype=torch.float32)
        for c0 in range(0, n, step):
            c1 = min(n, c0 + step)
            y[:, c0:c1] = torch.mm(rows, q4_weight_f32(linear, c0, c1))
    if linear.bias is not None:
        y += linear.bias
    return y.to(torch.bfloat16).view(*x.shape[:-1], n)
