"""Our bf16 GEMM (``gemm.c``), its weight-only products (``quant_gemm``), the int8
LM head's kernel (``q8_rows.c``), and the facts of this build that the dispatch table
(``dispatch.py``) reads: whether gemm.c is built, whether it multiplies through AMX
tiles, whether x is rounded to int8. The layers that use them are
``model_executor/layers/cpu_linear.py`` and ``quantization.py``.
"""

from __future__ import annotations

import functools

import torch

from llmserve import envs
from llmserve.kernels.cpu.decoder import int4_pack_block_n, rounds_x_to_int8

# gemm.c's AMX switch is the library's state (native.py); its callers ask it here.
from llmserve.kernels.cpu.native import amx_tiles, cpu_library  # noqa: F401


@functools.cache
def packing_available() -> bool:
    """oneDNN with bf16 kernels for this CPU (AVX-512 BF16, AMX, or its AVX-512
    emulation): the same condition under which torch computes bf16 linears in it."""
    mkldnn = torch.backends.mkldnn
    return mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()  # noqa: SLF001


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and packing_available()


def bf16_gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (bf16, contiguous) in ``bf16_gemm``'s layout: a plain bf16
    tensor of the same size, packed once at load."""
    n, k = weight.shape
    packed = torch.empty_like(weight)
    _check(cpu_library().bf16_gemm_pack(torch.get_num_threads(), weight.data_ptr(), n, k,
                                        packed.data_ptr()))
    return packed


def bf16_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` in bf16 with float32 accumulation, ``W [N, K]`` given
    as ``bf16_gemm_pack(W)``; ``bias`` float32 or None, added before the one rounding."""
    n, k = packed.shape
    rows = _kernel_rows(x, k)
    y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    if rows.shape[0]:
        _check(cpu_library().bf16_gemm(
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


# Where gemm.c was measured to beat oneDNN (in_features up to 1536, docs/benchmarks.md):
# a group of 4 panels (128 x in_features bytes) well inside a Zen 4 core's L2, and a
# whole group per thread (a thread with one panel has no next group to prefetch).
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
    lib = cpu_library()
    return lib is not None and lib.bf16_gemm_available() == 1


def forced_backend() -> str:
    forced = envs.LLMSERVE_BF16_GEMM
    if forced not in ("auto", "native", "onednn"):
        raise ValueError(f"LLMSERVE_BF16_GEMM={forced!r}: one of auto, native, onednn")
    return forced


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


def quant_gemm(x: torch.Tensor, linear) -> torch.Tensor:
    """``linear(x)`` by quant_gemm whatever the row count (a ``QuantizedLinear``, bf16
    ``x [..., K]``; ``quant_tiled_available`` and the shape checked by the caller)."""
    k, n = linear.in_features, linear.out_features
    rows = _kernel_rows(x, k)
    bias = None if linear.bias is None else linear.bias.float()
    y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    if rows.shape[0]:
        rc = cpu_library().quant_gemm(
            torch.get_num_threads(), rows.data_ptr(), rows.shape[0], rows.stride(0),
            linear.qweight.data_ptr(), linear.scales.data_ptr(), linear.bits, n, k,
            None if bias is None else bias.data_ptr(), y.data_ptr(), n)
        if rc == -1:
            raise MemoryError("quant_gemm: out of memory for its dequantisation scratch")
        _check(rc)
    return y.view(*x.shape[:-1], n)


# From this many rows q8_rows rounds x to int8 where asked and built (q8_rows.c's
# Q8_INT8_ROWS; a test holds the two equal): at 3 the LM head's float32 tiles and the
# int8 panels are even.
Q8_INT8_MIN_ROWS = 4


def q8_rows(x: torch.Tensor, linear, int8_x: bool | None = None) -> torch.Tensor | None:
    """``linear(x)`` of an int8 weight-only ``QuantizedLinear`` for bf16 CPU ``x`` by
    ``q8_rows.c`` (any number of rows: a few streamed once, more as a GEMM over panels
    where built), or None outside its domain: other bits, a width off its grid (k % 16),
    under torch.compile, no kernel. From Q8_INT8_MIN_ROWS rows x is rounded to int8
    where ``int8_x`` (default: ``rounds_x_to_int8()``) and the library has that path
    (``native.q8_rows_int8_built()``). How many rows it takes in a layer is the dispatch
    table's (``dispatch.py``)."""
    k, n = linear.in_features, linear.out_features
    lib = cpu_library()
    if (linear.bits != 8 or x.device.type != "cpu" or x.dtype != torch.bfloat16
            or x.shape[-1] != k or k % 16 or torch.compiler.is_compiling() or lib is None):
        return None
    if int8_x is None:
        int8_x = rounds_x_to_int8()
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
