"""Dense bf16 linears on the CPU with their weights packed once, at load time: in
oneDNN's layout (``PackedLinear``), or, on AVX512-BF16 CPUs without AMX, in the layout
of our own GEMM (``NativeLinear``, ``cpu_gemm.c``), whichever this CPU runs faster.
Where our GEMM runs, int4 and int8 linears of many rows go through it too
(``quant_tiled``).

``F.linear`` on a bf16 CPU tensor gives oneDNN the checkpoint's plain ``[N, K]``
weight, which oneDNN copies into its own blocked layout on every call. At decode
batch sizes that copy, a pass over every weight of the model per step, costs about
as much as the product itself. Reordering each weight once (what ``torch.compile``'s
freezing and IPEX do) and calling oneDNN's linear on the packed weight gives the same
results (bit-identical on a Zen 4, within bf16 rounding wherever oneDNN picks another
kernel), 1.04x faster at 1 row, 1.6x at 8, 1.25x at 64 and 1.14x at 128 for the
built-in model's shapes (``benchmarks/cpu_linear.py``).

On a Zen 4 (AVX512-BF16, no AMX), oneDNN reaches 63 % of the bf16 peak at 32 rows
and ~18 GB/s of weights below 16, where our kernel reaches ~90 % and ~30 GB/s: a whole
decode step's linears 1.4-1.6x faster than oneDNN's at 1 row, 1.2-1.3x at 32,
1.15-1.2x at 64, 1.0-1.05x at 512 (``benchmarks/cpu_linear.py``, several runs).
With AMX, oneDNN's tile kernels are another class of fast, and it keeps them.
``LLMSERVE_BF16_GEMM=onednn|native`` forces the choice.

The packed weight replaces the plain one (no second copy), except where the LM head
shares its weight with the token embedding, whose lookups still need the plain rows.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from llmserve.kernels.cpu_decoder import int4_pack_block_n
from llmserve.kernels.cpu_native import decode_kernel
from llmserve.platforms.cpu import cpu_features

# oneDNN picks the packed layout for a batch of this many rows; the packed weight
# serves any row count. 64 measured as fast as 256 and faster than 1 (a hint of 1
# keeps the plain layout) from 1 to 128 rows, the decode range.
PACK_BATCH_HINT = 64


@functools.cache
def packing_available() -> bool:
    """oneDNN with bf16 kernels for this CPU (AVX-512 BF16, AMX, or its AVX-512
    emulation): the same condition under which torch computes bf16 linears in it."""
    mkldnn = torch.backends.mkldnn
    return mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and packing_available()


class PackedLinear(nn.Module):
    """``linear``'s product on a oneDNN-packed copy of its weight. The packed
    tensor is a plain attribute, not a parameter: state dicts and ``.to()`` cannot
    handle oneDNN's opaque tensors, and a loaded model is never moved again."""

    def __init__(self, linear: nn.Linear, batch_hint: int = PACK_BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed=oneDNN")


class NativeLinear(nn.Module):
    """``linear``'s product by ``cpu_gemm.c`` on its weight packed in that kernel's
    layout (a plain bf16 tensor of the weight's size); bias kept in float32, added
    before the one rounding to bf16, as oneDNN does."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if not native_gemm_available():
            raise RuntimeError("cpu_gemm.c is not built for AVX512-BF16 on this machine")
        if not native_takes(self.out_features, self.in_features):
            raise ValueError(f"bf16_gemm takes out_features % 16 == 0 and even "
                             f"in_features, not {self.out_features} x {self.in_features}")
        weight = linear.weight.detach().to(torch.bfloat16).contiguous()
        self.packed = torch.empty_like(weight)
        _check(decode_kernel().bf16_gemm_pack(torch.get_num_threads(), weight.data_ptr(),
                                              self.out_features, self.in_features,
                                              self.packed.data_ptr()))
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"NativeLinear takes bf16 inputs, not {x.dtype}")
        k, n = self.in_features, self.out_features
        if x.shape[-1] != k:
            raise ValueError(f"NativeLinear: input of {x.shape[-1]} features, weight of {k}")
        rows = _kernel_rows(x, k)
        y = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
        if rows.shape[0]:
            _check(decode_kernel().bf16_gemm(
                torch.get_num_threads(), rows.data_ptr(), rows.shape[0], rows.stride(0),
                self.packed.data_ptr(), n, k,
                None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), n))
        return y.view(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed=cpu_gemm")


def _kernel_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` as rows of ``k`` the C kernels read in place (unit column stride, rows
    apart by at least ``k``), copied only where a view cannot be."""
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    return rows


def _check(rc: int) -> None:
    if rc != 0:  # the callers check shapes and availability first: never expected
        raise RuntimeError(f"cpu_gemm.c failed with code {rc}")


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
    """``cpu_gemm.c`` built with its AVX512-BF16 kernel (not the stub)."""
    lib = decode_kernel()
    return lib is not None and lib.bf16_gemm_available() == 1


def _forced_backend() -> str:
    forced = os.environ.get("LLMSERVE_BF16_GEMM", "auto")
    if forced not in ("auto", "native", "onednn"):
        raise ValueError(f"LLMSERVE_BF16_GEMM={forced!r}: one of auto, native, onednn")
    return forced


def gemm_backend() -> str:
    """Who computes packed bf16 linears here: "native" (``cpu_gemm.c``) on AVX512-BF16
    without AMX, else "onednn"; ``LLMSERVE_BF16_GEMM`` forces one ("native" only
    where the kernel is built)."""
    forced = _forced_backend()
    if forced == "onednn" or not native_gemm_available():
        return "onednn"
    if forced == "native":
        return "native"
    return "onednn" if cpu_features().amx_bf16 else "native"


def pack_linears(model: nn.Module) -> int:
    """Replace every dense ``nn.Linear`` of ``model`` (quantised ones are left as
    they are) by a ``NativeLinear`` or a ``PackedLinear``: native where
    ``gemm_backend`` says so and the shape is on its grid and, unless forced, within
    what was measured (``native_measured``); oneDNN otherwise. Returns how many were
    packed. Each original is dropped as soon as it is replaced, so that loading never
    holds two copies of all the weights."""
    native = gemm_backend() == "native"
    forced = native and _forced_backend() == "native"
    threads = torch.get_num_threads()
    targets = [(parent, name) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name in targets:
        child = getattr(parent, name)
        out_f, in_f = child.out_features, child.in_features
        use_native = native and native_takes(out_f, in_f) and (
            forced or native_measured(out_f, in_f, threads))
        setattr(parent, name, NativeLinear(child) if use_native else PackedLinear(child))
        del child
    return len(targets)


# Weight-only products of at least this many rows go through cpu_gemm.c's quant_gemm
# (each group of panels dequantised once to bf16, then the bf16 tiles); fewer rows stay
# on ATen's kernels, which read the packed bytes directly. Crossovers measured with
# benchmarks/cpu_linear.py --quantized: between 4 and 8 rows for the int4 projections
# and for the int8 LM head of both quantised modes (at 32 rows: 1.9x and 3.1x).
QUANT_TILED_MIN_ROWS = 8


@functools.cache
def quant_tiled_available(bits: int) -> bool:
    """quant_gemm runs where our bf16 GEMM does; for int4 it also needs ATen's int4 pack
    as its AVX-512 builds lay it out (64-column blocks). Decided once per process, like
    ``native_gemm_available`` (``LLMSERVE_BF16_GEMM`` read at the first call)."""
    if gemm_backend() != "native":
        return False
    if bits == 8:
        return True
    return int4_pack_block_n() == 64


def quant_tiled(x: torch.Tensor, linear) -> torch.Tensor | None:
    """``linear(x)`` of a weight-only ``QuantizedLinear`` by quant_gemm (bf16 CPU
    ``x``), or None where it does not apply and ATen's kernel should run: under
    torch.compile, too few rows, a shape off the kernel's grid or outside where it was
    measured (``native_measured``, unless forced), another device or dtype."""
    if torch.compiler.is_compiling():
        return None
    k, n, bits = linear.in_features, linear.out_features, linear.bits
    if (x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.shape[-1] != k
            or x.numel() < QUANT_TILED_MIN_ROWS * k
            or k % 32 or n % (64 if bits == 4 else 16) or not quant_tiled_available(bits)):
        return None
    if _forced_backend() != "native" and not native_measured(n, k, torch.get_num_threads()):
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
