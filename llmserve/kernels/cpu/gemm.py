"""Our bf16 GEMM (``gemm.c``) and the choice of who computes dense bf16 linears on
this CPU: oneDNN on a packed weight, or ``gemm.c`` (``gemm_backend``). Where our GEMM
runs, int4 and int8 products of many rows go through it too (``quant_tiled``). The
layers that use them are ``model_executor/layers/cpu_linear.py``.
"""

from __future__ import annotations

import functools

import torch

from llmserve import envs
from llmserve.kernels.cpu.decoder import int4_pack_block_n, int8_activations
from llmserve.kernels.cpu.native import decode_kernel, panel_gemms_built
from llmserve.platforms.cpu import cpu_features


@functools.cache
def packing_available() -> bool:
    """oneDNN with bf16 kernels for this CPU (AVX-512 BF16, AMX, or its AVX-512
    emulation): the same condition under which torch computes bf16 linears in it."""
    mkldnn = torch.backends.mkldnn
    return mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and packing_available()


def bf16_gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (bf16, contiguous) in ``bf16_gemm``'s layout: a plain bf16
    tensor of the same size, packed once at load."""
    n, k = weight.shape
    packed = torch.empty_like(weight)
    _check(decode_kernel().bf16_gemm_pack(torch.get_num_threads(), weight.data_ptr(), n, k,
                                          packed.data_ptr()))
    return packed


def bf16_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` in bf16 with float32 accumulation, ``W [N, K]`` given
    as ``bf16_gemm_pack(W)``; ``bias`` float32 or None, added before the one rounding."""
    n, k = packed.shape
    rows = _kernel_rows(x, k)
    y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    if rows.shape[0]:
        _check(decode_kernel().bf16_gemm(
            torch.get_num_threads(), rows.data_ptr(), rows.shape[0], rows.stride(0),
            packed.data_ptr(), n, k, None if bias is None else bias.data_ptr(),
            y.data_ptr(), n))
    return y.view(*x.shape[:-1], n)


def _kernel_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` as rows of ``k`` the C kernels read in place (unit column stride, rows
    apart by at least ``k``), copied only where a view cannot be."""
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    return rows


def _check(rc: int) -> None:
    if rc != 0:  # the callers check shapes and availability first: never expected
        raise RuntimeError(f"gemm.c failed with code {rc}")


def native_takes(out_features: int, in_features: int) -> bool:
    """The kernel's grid: whole 16-column panels, whole k pairs."""
    return out_features % 16 == 0 and in_features % 2 == 0


# Where the kernel was measured to beat oneDNN (2 cores, in_features up to 1536): a
# group of 4 panels (128 x in_features bytes) well inside a Zen 4 core's 1 MB L2, and
# a whole group per thread (a thread with one panel has no next group to prefetch).
# Outside it (a 70B model's 28672-wide down_proj, 64 threads on a 576-column output)
# the choice is oneDNN's until a machine there measures otherwise.
MAX_NATIVE_IN_FEATURES = 4096
MIN_PANELS_PER_THREAD = 4


def native_measured(out_features: int, in_features: int, threads: int) -> bool:
    return (in_features <= MAX_NATIVE_IN_FEATURES
            and out_features // 16 >= MIN_PANELS_PER_THREAD * threads)


@functools.cache
def native_gemm_available() -> bool:
    """``gemm.c`` built with its AVX512-BF16 kernel (not the stub)."""
    lib = decode_kernel()
    return lib is not None and lib.bf16_gemm_available() == 1


def forced_backend() -> str:
    forced = envs.LLMSERVE_BF16_GEMM
    if forced not in ("auto", "native", "onednn"):
        raise ValueError(f"LLMSERVE_BF16_GEMM={forced!r}: one of auto, native, onednn")
    return forced


def gemm_backend() -> str:
    """Who computes packed bf16 linears here: "native" (``gemm.c``) on AVX512-BF16
    without AMX, and on AMX CPUs where Linux grants the tiles (``gemm.c`` multiplies
    through them from 2 rows); "onednn" on an AMX CPU without the grant, where
    ``gemm.c``'s VDPBF16PS tiles lose to oneDNN's AMX kernels past a few rows.
    ``LLMSERVE_BF16_GEMM`` forces one ("native" only where the kernel is built).
    Measured on the Sapphire Rapids Xeon, all the built-in model's projections for
    one step, ``gemm.c`` over oneDNN (``benchmarks/cpu/cpu_linear.py``): 1.54x at 1 row
    (VDPBF16PS), with AMX 1.36x at 8, 1.37x at 32, even at 64 and 128."""
    forced = forced_backend()
    if forced == "onednn" or not native_gemm_available():
        return "onednn"
    if forced == "native":
        return "native"
    return "onednn" if cpu_features().amx_bf16 and not amx_tiles() else "native"


def rounds_x_to_int8() -> bool:
    """Whether int4 products of 3 rows and more (1 and more in an AVX2 build:
    ``dequant.int8_min_rows``; the int8 LM head's of 4 and more) round x to int8 here
    now: where the library has the int8 panels
    (``decoder.int8_activations``: AVX-512 VNNI or AVX2) and AMX tiles are not in use.
    Where they are, every product keeps x in bf16: quant_gemm's tiles are faster from
    24 rows (32 for the LM head) and the int8 panels below, but a switch between the two
    at some row count makes a prompt's logits depend on how many of its tokens the step
    computes (a prefix-cache hit leaves a few), and a greedy answer near a tie flipped
    with it in the e2e tests, for 4 % more throughput (docs/benchmarks.md, "int8
    products on CPUs with bf16 arithmetic"). Without the tiles (Zen 4) the int8 panels
    win at every row count and take them all, as on Ice Lake."""
    amx = _amx_in_use if _amx_in_use is not None else amx_tiles()
    return not amx and int8_activations()


def quant_tiled_min_rows(int8_x: bool | None = None) -> int | None:
    """Weight-only products of at least this many rows go through gemm.c's quant_gemm
    (each group of panels dequantised once to bf16, then the bf16 tiles), or None: none
    do, where x is rounded to int8 (``int8_x``, default ``rounds_x_to_int8()``: the int8
    panels take them all, 2.6-3.2x faster than quant_gemm's VDPBF16PS for int4, 2.3-4.4x
    for the LM head). Fewer rows stay on ATen's kernels, which read the packed bytes.
    Crossovers over
    ATen measured with benchmarks/cpu/cpu_linear.py --quantized, 2 threads, all the
    built-in model's projections:
    - Zen 4 (AVX512-BF16, no AMX): between 4 and 8 rows (at 32 rows 1.9x for int4,
      3.1x for the int8 LM head);
    - AMX Xeon with AMX tiles: between 4 and 8 (1.33x at 8, 3.9x at 32, 8.2x at 128);
    - the same Xeon with AVX512-BF16 dot products only (AMX not granted, or switched
      off): between 16 and 24 (0.98x at 16, 1.13x at 32, 1.25x at 128)."""
    if rounds_x_to_int8() if int8_x is None else int8_x:
        return None
    amx = _amx_in_use if _amx_in_use is not None else amx_tiles()
    return 24 if cpu_features().amx_bf16 and not amx else 8


@functools.cache
def quant_tiled_available(bits: int) -> bool:
    """quant_gemm runs wherever our GEMM is built (AVX512-BF16), whoever computes the
    dense bf16 linears (oneDNN on AMX); not when ``LLMSERVE_BF16_GEMM=onednn`` keeps
    gemm.c out. For int4 it also needs ATen's int4 pack as its AVX-512 builds lay it
    out (64-column blocks). Decided once per process (the variable read at the first
    call)."""
    if not native_gemm_available() or forced_backend() == "onednn":
        return False
    if bits == 8:
        return True
    return int4_pack_block_n() == 64


_amx_in_use: bool | None = None  # what amx_tiles last found (None: not asked yet)


@functools.cache
def _min_rows_while(amx_in_use: bool | None, int8_x: bool) -> int | None:
    """quant_tiled_min_rows, once per AMX state and int8 choice: it reads the CPU's
    features (~6 us), and quant_tiled asks on every quantised linear of every step."""
    return quant_tiled_min_rows(int8_x)


def quant_tiled_rows() -> int:
    """From how many rows quant_tiled takes an int4 product now (for the AMX state
    last asked), 0 for none: what the C decoder stack follows for its own int4
    products."""
    return _min_rows_while(_amx_in_use, rounds_x_to_int8()) or 0


def amx_tiles(want: bool | None = None) -> bool:
    """Whether quant_gemm multiplies with AMX tiles (TDPBF16PS) rather than AVX512-BF16
    dot products: where ``gemm.c`` was built for an AMX CPU and Linux grants the tile
    state. ``want`` switches them on or off for the process (tests and benchmarks
    compare both); None only asks."""
    global _amx_in_use
    lib = decode_kernel()
    _amx_in_use = lib is not None and lib.gemm_use_amx(-1 if want is None else int(want)) == 1
    return _amx_in_use


def int8_grid(k: int, n: int, bits: int) -> bool:
    """Whether the int8 panels take a product of this shape where x is rounded (int4:
    every shape quant_gemm takes; int8, ``q8_rows.c``: k a multiple of 64, n of 32).
    Elsewhere quant_gemm keeps the crossover it has over the float32 kernels."""
    return bits == 4 or (k % 64 == 0 and n % 32 == 0)


def quant_tiled(x: torch.Tensor, linear) -> torch.Tensor | None:
    """``linear(x)`` of a weight-only ``QuantizedLinear`` by quant_gemm (bf16 CPU
    ``x``), or None where it does not apply and ATen's kernel should run: under
    torch.compile, too few rows, a shape off the kernel's grid or outside where it was
    measured (``native_measured``, unless forced), another device or dtype."""
    if torch.compiler.is_compiling():
        return None
    k, n, bits = linear.in_features, linear.out_features, linear.bits
    least = _min_rows_while(_amx_in_use, rounds_x_to_int8() and int8_grid(k, n, bits))
    if (least is None or x.device.type != "cpu" or x.dtype != torch.bfloat16
            or x.shape[-1] != k or x.numel() < least * k
            or k % 32 or n % (64 if bits == 4 else 16) or not quant_tiled_available(bits)):
        return None
    if forced_backend() != "native" and not native_measured(n, k, torch.get_num_threads()):
        return None
    return quant_gemm(x, linear)


def quant_gemm(x: torch.Tensor, linear) -> torch.Tensor:
    """``linear(x)`` by quant_gemm whatever the row count (a ``QuantizedLinear``, bf16
    ``x [..., K]``; ``quant_tiled_available`` and the shape checked by the caller)."""
    k, n = linear.in_features, linear.out_features
    rows = _kernel_rows(x, k)
    bias = None if linear.bias is None else linear.bias.float()
    y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    if rows.shape[0]:
        rc = decode_kernel().quant_gemm(
            torch.get_num_threads(), rows.data_ptr(), rows.shape[0], rows.stride(0),
            linear.qweight.data_ptr(), linear.scales.data_ptr(), linear.bits, n, k,
            None if bias is None else bias.data_ptr(), y.data_ptr(), n)
        if rc == -1:
            raise MemoryError("quant_gemm: out of memory for its dequantisation scratch")
        _check(rc)
    return y.view(*x.shape[:-1], n)


# At most this many rows go through q8_rows.c where it is built without panel.h's GEMM
# (more: ATen's kernel). With it (AVX-512, AVX2) it takes any number: from 12 rows as a
# GEMM over converted panels of the weight (2.0x ATen's kernel at 32 rows on an Ice Lake
# Xeon, 1.6x in its AVX2 build; docs/benchmarks.md), from 4 with x rounded to int8 over
# int8 panels (AVX-512 VNNI; AVX2 over two int4 panels of the codes' nibbles). Where
# quant_gemm runs it takes the rows from quant_tiled_min_rows() first: 8 on AMX Xeons
# using their tiles, none on Zen 4 (where x is rounded; 8 with
# LLMSERVE_CPU_INT8_ACTIVATIONS=0).
Q8_ROWS_MAX = 8


def q8_rows_max() -> int | None:
    """The most rows q8_rows takes: no limit where the library has the panel GEMMs and
    either no bf16 arithmetic (Ice Lake, AVX2) or x is rounded to int8 (Zen 4);
    Q8_ROWS_MAX elsewhere (as on AMX Xeons using their tiles, where more rows than
    quant_gemm takes stay on ATen's kernel, as measured there)."""
    if panel_gemms_built() and (rounds_x_to_int8() or not native_gemm_available()):
        return None
    return Q8_ROWS_MAX


# From this many rows q8_rows rounds x to int8 where asked and built (q8_rows.c's
# Q8_INT8_ROWS; the int4 products from dequant.INT8_MIN_ROWS, 3): at 3 the LM head's
# float32 tiles and the int8 panels are even.
Q8_INT8_MIN_ROWS = 4


def q8_rows(x: torch.Tensor, linear, int8_x: bool | None = None) -> torch.Tensor | None:
    """``linear(x)`` of an int8 weight-only ``QuantizedLinear`` for a few rows of bf16
    CPU ``x`` by ``q8_rows.c`` (a decode step's LM head: 28 MB streamed at ~18.6 GB/s on
    a 2-core Xeon, ATen's one-row kernel ~12; docs/benchmarks.md), or None where it does not
    apply: other bits, more rows than q8_rows_max() (as the layers route; with
    ``int8_x`` given, as many as the build's kernels take), a width off its grid, under
    torch.compile, no kernel. From Q8_INT8_MIN_ROWS rows x is rounded to int8 where
    ``int8_x`` (default: ``rounds_x_to_int8()``) and the library has that path
    (``native.q8_rows_int8_built()``: AVX-512 VNNI and AVX2 builds)."""
    k, n = linear.in_features, linear.out_features
    if (linear.bits != 8 or x.device.type != "cpu" or x.dtype != torch.bfloat16
            or x.shape[-1] != k or k % 16 or torch.compiler.is_compiling()):
        return None
    if int8_x is None:
        limit, int8_x = q8_rows_max(), rounds_x_to_int8()
    else:
        limit = None if panel_gemms_built() else Q8_ROWS_MAX
    if limit is not None and x.numel() > limit * k:
        return None
    lib = decode_kernel()
    if lib is None:
        return None
    rows = _kernel_rows(x, k)
    bias = None if linear.bias is None else linear.bias.float()
    y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    if rows.shape[0]:
        rc = lib.q8_rows_bf16(torch.get_num_threads(), rows.data_ptr(), rows.shape[0],
                              rows.stride(0), linear.qweight.data_ptr(),
                              linear.scales.data_ptr(), n, k,
                              None if bias is None else bias.data_ptr(), y.data_ptr(), n,
                              int(int8_x))
        if rc == -1:
            raise MemoryError("q8_rows: out of memory for its copy of x")
        if rc != 0:  # shapes checked above: never expected
            raise RuntimeError(f"q8_rows.c failed with code {rc}")
    return y.view(*x.shape[:-1], n)
