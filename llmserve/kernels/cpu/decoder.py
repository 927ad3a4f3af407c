"""The C decoder stack's interface (``decoder.c``): the structures it reads (a
projection int4 in ATen's pack, or dense bf16 in ``gemm.c``'s panels), ATen's int4 pack
layout, and its int4 product (``q4_matmul``), which the layers take too.

A kernel knows tensors, not models: ``model_executor/models/native_decoder.py`` fills
these structures from a model's layers. Their C side is declared in ``kernels.h``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from llmserve import envs
from llmserve.kernels.cpu.native import amx_tiles, cpu_library, panel_int8_block_n

LINEAR_INT4, LINEAR_BF16 = 0, 1  # kernels.h: a projection's format


class StackLinear(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scale_zero", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("bias_f32", ctypes.c_void_p), ("format", ctypes.c_int)]


class StackLayer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", StackLinear), ("o", StackLinear), ("gate_up", StackLinear),
                ("down", StackLinear), ("kv_cache", ctypes.c_void_p)]


class StackDims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int), ("num_heads", ctypes.c_int),
                ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("intermediate", ctypes.c_int), ("block_n", ctypes.c_int),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("num_cache_blocks", ctypes.c_int64), ("block_size", ctypes.c_int),
                ("int8_x", ctypes.c_int), ("quant_gemm_rows", ctypes.c_int)]


@functools.cache
def int4_pack_block_n() -> int | None:
    """The column block of ATen's CPU int4 pack on this build and machine (64 for its
    AVX-512 kernels, 32 for AVX2), checked by packing known codes; None for a layout
    the C kernel does not read (ATen's scalar build, a future change)."""
    n, k = 128, 64
    codes = torch.arange(n * k, dtype=torch.int32).view(n, k) * 7 % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2).view(-1)  # noqa: SLF001
    for block_n in (64, 32):
        blocks = codes.view(n // block_n, block_n, k).transpose(1, 2)  # [nb, k, block_n]
        half = block_n // 2
        expected = blocks[..., :half] | (blocks[..., half:] << 4)
        if torch.equal(packed, expected.to(torch.uint8).reshape(-1)):
            return block_n
    return None


def q4_struct(linear) -> StackLinear:
    """An int4 linear (``qweight``, ``scales``, ``bias``, ``in/out_features``, as
    ``QuantizedLinear`` holds them) as the C side reads it."""
    bias = linear.bias.data_ptr() if linear.bias is not None else None
    return StackLinear(linear.qweight.data_ptr(), linear.scales.data_ptr(), bias,
                    linear.out_features, linear.in_features, None, LINEAR_INT4)


def bf16_struct(linear) -> StackLinear:
    """A dense bf16 linear packed for ``gemm.c`` (``packed``, a float32 ``bias``,
    ``in/out_features``, as ``cpu_linear.NativeLinear`` holds them) as the C side reads
    it: the stack calls the same kernel on it."""
    bias = linear.bias.data_ptr() if linear.bias is not None else None
    return StackLinear(linear.packed.data_ptr(), None, None, linear.out_features,
                    linear.in_features, bias, LINEAR_BF16)


def int8_activations() -> bool:
    """Whether int4 products (and the int8 LM head's, where built) may round x to int8
    per group of 32, as llama.cpp does for its Q4 models (``panel_int8.h``: 2-4x the
    float32 panel GEMM's multiplies per instruction, 2x bf16 dot products'): wherever
    the library has that kernel (AVX-512 VNNI: Ice Lake and Cascade Lake Xeons, Zen 4,
    AMX Xeons; and AVX2) and ATen packs int4 in the column blocks it reads (64 and 32:
    an AVX-512 build under a forced AVX2 ATen does not match, and the products keep
    their other routes), unless ``LLMSERVE_CPU_INT8_ACTIVATIONS=0``. Whether they do
    is ``rounds_x_to_int8`` (not while AMX tiles are in use)."""
    return (envs.LLMSERVE_CPU_INT8_ACTIVATIONS
            and panel_int8_block_n() > 0 and int4_pack_block_n() == panel_int8_block_n())


def rounds_x_to_int8() -> bool:
    """Whether int4 products (and the int8 LM head's) round x to int8 here now: where
    the library has the int8 panels (``int8_activations``: AVX-512 VNNI or
    AVX2) and AMX tiles are not in use. Where they are, every product keeps x in bf16:
    quant_gemm's tiles are faster from 24 rows and the int8 panels below, but a switch
    between the two at some row count would make a prompt's logits depend on how many
    of its tokens a step computes (a prefix-cache hit leaves a few), and a greedy answer
    near a tie flipped with it in the e2e tests (docs/benchmarks.md, "int8 products on
    CPUs with bf16 arithmetic"). Without the tiles (Zen 4) the int8 panels win at every
    row count and take them all, as on Ice Lake."""
    return int8_activations() and not amx_tiles()


def q4_matmul(x: torch.Tensor, linear, int8_x: bool | None = None) -> torch.Tensor:
    """``linear(x)`` by the C kernel (bf16 ``x [..., K]``): its tiles, or from 16 rows its
    panel GEMM where built, with x rounded to int8 where ``int8_x`` (default:
    ``rounds_x_to_int8()``, as the layers bind) and built."""
    if int8_x is None:
        int8_x = rounds_x_to_int8()
    block_n = int4_pack_block_n()
    if block_n is None or cpu_library() is None:
        raise RuntimeError("the C int4 kernel is not available here")
    k, n = linear.in_features, linear.out_features
    rows = x.reshape(-1, k).to(torch.bfloat16).contiguous()
    y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    lin = q4_struct(linear)
    rc = cpu_library().q4_linear_bf16(torch.get_num_threads(), ctypes.byref(lin), block_n,
                                      rows.data_ptr(), rows.shape[0], y.data_ptr(),
                                      int(int8_x))
    if rc == -1:
        raise MemoryError("q4_linear_bf16: out of memory for its copy of x")
    if rc != 0:
        raise ValueError(f"q4_linear_bf16: shapes unsupported ({rc})")
    return y.view(*x.shape[:-1], n)
