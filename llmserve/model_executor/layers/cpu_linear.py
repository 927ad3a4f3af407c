"""Dense bf16 linears on the CPU with their weights packed once, at load time: in
oneDNN's layout (``PackedLinear``), or, on AVX512-BF16 CPUs, in the layout of our own
GEMM (``NativeLinear``, ``gemm.c``), whichever this CPU runs faster
(``dispatch.gemm_backend``).

``F.linear`` on a bf16 CPU tensor gives oneDNN the checkpoint's plain ``[N, K]``
weight, which oneDNN copies into its own blocked layout on every call. At decode
batch sizes that copy, a pass over every weight of the model per step, costs about
as much as the product itself. Reordering each weight once (what ``torch.compile``'s
freezing and IPEX do) and calling oneDNN's linear on the packed weight gives the same
results (bit-identical on a Zen 4, within bf16 rounding wherever oneDNN picks another
kernel), faster at every decode batch size (``benchmarks/cpu/cpu_linear.py``; the figures
are in docs/benchmarks.md).

On a Zen 4 (AVX512-BF16, no AMX), our kernel reaches a larger share of the bf16 peak
and of the memory bandwidth than oneDNN does at decode sizes, and is no slower for
long prefills. With AMX, oneDNN's tile kernels are another class of fast, and it keeps
them where Linux does not grant our kernel the tiles. ``LLMSERVE_BF16_GEMM=onednn|native``
forces the choice.

The packed weight replaces the plain one (no second copy), except where the LM head
shares its weight with the token embedding, whose lookups still need the plain rows.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.kernels.cpu import dispatch, gemm

# oneDNN picks the packed layout for a batch of this many rows; the packed weight
# serves any row count. 64 measured as fast as larger hints and faster than 1 (a hint
# of 1 keeps the plain layout) over the decode range.
PACK_BATCH_HINT = 64


class PackedLinear(nn.Module):
    """``linear``'s product on a oneDNN-packed copy of its weight. The packed
    tensor is a plain attribute, not a parameter: state dicts and ``.to()`` cannot
    handle oneDNN's opaque tensors, and a loaded model is never moved again."""

    def __init__(self, linear: nn.Linear, batch_hint: int = PACK_BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)  # noqa: SLF001
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # oneDNN's own error names no sizes
            raise ValueError(f"PackedLinear: input of {x.shape[-1]} features, weight of "
                             f"{self.in_features}")
        # oneDNN's prepacked linear (no public name)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # noqa: SLF001

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed=oneDNN")


class NativeLinear(nn.Module):
    """``linear``'s product by ``gemm.c`` on its weight packed in that kernel's
    layout (a plain bf16 tensor of the weight's size); bias kept in float32, added
    before the one rounding to bf16, as oneDNN does. Both are buffers (not saved in
    state dicts), so that the weights' move onto huge pages (``worker/weight_arena.py``)
    takes them."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if not gemm.native_gemm_available():
            raise RuntimeError("gemm.c is not built for AVX512-BF16 on this machine")
        if not gemm.native_takes(self.out_features, self.in_features):
            raise ValueError(f"bf16_gemm takes out_features % 16 == 0 and even "
                             f"in_features, not {self.out_features} x {self.in_features}")
        weight = linear.weight.detach().to(torch.bfloat16).contiguous()
        self.register_buffer("packed", gemm.bf16_gemm_pack(weight), persistent=False)
        self.register_buffer("bias", None if linear.bias is None
                             else linear.bias.detach().float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"NativeLinear takes bf16 inputs, not {x.dtype}")
        k = self.in_features
        if x.shape[-1] != k:
            raise ValueError(f"NativeLinear: input of {x.shape[-1]} features, weight of {k}")
        return gemm.bf16_gemm(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed=cpu_gemm")


def pack_linears(model: nn.Module) -> int:
    """Replace every dense ``nn.Linear`` of ``model`` (quantised ones are left as
    they are) by a ``NativeLinear`` or a ``PackedLinear``: native where
    ``dispatch.gemm_backend`` says so and the shape is on its grid and, unless forced, within
    what was measured (``native_measured``); oneDNN otherwise. Returns how many were
    packed. Each original is dropped as soon as it is replaced, so that loading never
    holds two copies of all the weights."""
    native = dispatch.gemm_backend() == "native"
    forced = native and gemm.forced_backend() == "native"
    threads = torch.get_num_threads()
    targets = [(parent, name) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name in targets:
        child = getattr(parent, name)
        out_f, in_f = child.out_features, child.in_features
        use_native = native and gemm.native_takes(out_f, in_f) and (
            forced or gemm.native_measured(out_f, in_f, threads))
        setattr(parent, name, NativeLinear(child) if use_native else PackedLinear(child))
        del child
    return len(targets)
