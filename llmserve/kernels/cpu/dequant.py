"""int4 products of many rows that gemm.c's quant_gemm does not take (``dequant.c``).

Where neither AVX512-BF16 nor AMX is there (Ice Lake and older Xeons, AVX2-only CPUs), gemm.c's
quant_gemm does not run, and ATen's weight-only int4 kernel re-reads and
re-dequantises the weight for each small tile of rows. From ``PANEL_MIN_ROWS`` rows the
C kernel (decoder.c's q4_matmul) runs the product as a GEMM over panels of the weight
dequantised to float32 in L1, each once for all the rows; from ``DEQUANT_MIN_ROWS``
(long prefill chunks) it is cheaper still to write the weight out once in float32 (into
a scratch reused from call to call) and let MKL's float32 GEMM multiply. Either way the
weight is still stored, and streamed by decode steps, in int4. Fewer rows keep the
kernels that read the packed bytes (the C decoder stack, ATen).

Where the CPU has AVX-512 VNNI (Ice Lake, Cascade Lake; and Zen 4, which has bf16
arithmetic too, but not AMX Xeons using their tiles) or only AVX2 (Zen 2/3, Haswell to
Broadwell), x is rounded to int8 instead (``gemm.rounds_x_to_int8``, ``panel_int8.h``),
and the C kernel's int8 panels take every product from ``INT8_MIN_ROWS`` rows, long
prefill chunks included.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from llmserve.kernels.cpu.decoder import int4_pack_block_n, q4_matmul, q4_struct
from llmserve.kernels.cpu.gemm import rounds_x_to_int8
from llmserve.kernels.cpu.native import decode_kernel, panel_gemms_built, q4_int8_min_rows
from llmserve.platforms.cpu import cpu_features

# The int4 products of many rows, by row count: from PANEL_MIN_ROWS the C panel GEMM,
# from DEQUANT_MIN_ROWS the float32 copy and MKL. Ice Lake Xeon, 2 threads, the built-in
# model's four projections of a layer from L3, alternating (docs/benchmarks.md, "The
# LM head and int4 products of many rows"), dequantised + MKL over the panel GEMM: 1.84x
# at 32 rows, 2.0x at 64, 1.27x at 128, 1.10x at 256, 0.92x at 512; ATen's int4 kernel
# over the panel GEMM: ~1.2x at 16 rows, 1.5x at 32.
PANEL_MIN_ROWS = 16
DEQUANT_MIN_ROWS = 384
# Where x is rounded to int8 (gemm.rounds_x_to_int8), the C kernel's int8 panels take
# every product from this many rows on AVX-512 VNNI (decoder.c's Q4_INT8_ROWS): the same
# layers, 2 threads, over the float32 panels 2.2-2.9x at 16-512 rows, over the float32
# copy and MKL 2.3x at 512; over ATen's and the C tiles 1.3x at 3 rows, 1.8-3.5x at 4-14.
# AVX2 builds round from 1 row (int8_min_rows()).
INT8_MIN_ROWS = 3


def int8_min_rows() -> int:
    """The fewest rows whose int4 products round x to int8 where x is rounded: the
    build's (``native.q4_int8_min_rows``), so that a torch layer rounds from the same row
    count as the C decoder stack does."""
    return q4_int8_min_rows() or INT8_MIN_ROWS

# The float32 copy is at most this big (a larger weight goes in chunks of columns): it
# is memory the KV budget does not know of. The built-in model's largest, gate_up, is
# 7 MB; an 8B model's would be 470 MB whole.
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
    storage of activations and the KV cache. Asked once (every int4 product of many
    rows asks)."""
    features = cpu_features()
    block_n = PACK_BLOCK_BY_ISA.get(features.aten_isa)
    return (not features.native_bf16 and block_n is not None
            and int4_pack_block_n() == block_n and panel_gemms_built())


def dequant_applies(x: torch.Tensor, linear) -> bool:
    """``quant_dense_f32``'s domain: an eager int4 CPU product, a shape on ATen's pack
    grid, of at least int8_min_rows() rows where x is rounded to int8 (AVX-512 VNNI or
    AVX2 builds, AMX tiles not in use: ``gemm.rounds_x_to_int8``), else of at least
    PANEL_MIN_ROWS where ``int4_runs_in_float32`` (AVX-512 without bf16 arithmetic,
    AVX2)."""
    k, n = linear.in_features, linear.out_features
    if (linear.bits != 4 or x.device.type != "cpu" or x.shape[-1] != k
            or x.numel() < int8_min_rows() * k or torch.compiler.is_compiling()):
        return False
    if rounds_x_to_int8():
        return n % int4_pack_block_n() == 0 and k % 32 == 0
    if x.numel() < PANEL_MIN_ROWS * k or not int4_runs_in_float32():
        return False
    return n % int4_pack_block_n() == 0 and k % 32 == 0


def q4_weight_f32(linear, c0: int = 0, c1: int | None = None) -> torch.Tensor:
    """Columns [c0, c1) of W^T, [K, c1 - c0] float32, of an int4 ``QuantizedLinear``
    (all of them by default), in the calling thread's scratch (valid until its next
    call)."""
    k, n = linear.in_features, linear.out_features
    c1 = n if c1 is None else c1
    out = _scratch(k, c1 - c0)
    lin = q4_struct(linear)
    rc = decode_kernel().q4_dequant_f32(torch.get_num_threads(), ctypes.byref(lin),
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


def quant_dense_f32(x: torch.Tensor, linear) -> torch.Tensor:
    """``linear(x)`` in ``x``'s dtype, ``dequant_applies`` checked by the caller: the C
    kernel's int8 panels where x is rounded to int8 (``rounds_x_to_int8``), else below
    DEQUANT_MIN_ROWS rows its float32 panel GEMM; from there the weight dequantised to
    float32, then the float32 GEMM (plus the bias). A weight too big for the scratch
    goes a chunk of columns at a time (for small ones one whole GEMM measured faster
    than chunks sized for L2: many narrow GEMMs)."""
    k, n = linear.in_features, linear.out_features
    int8_x = rounds_x_to_int8()
    if x.numel() < DEQUANT_MIN_ROWS * k or int8_x:
        y = q4_matmul(x.reshape(-1, k), linear, int8_x=int8_x)
        return y.to(x.dtype).view(*x.shape[:-1], n)
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
    return y.to(x.dtype).view(*x.shape[:-1], n)
