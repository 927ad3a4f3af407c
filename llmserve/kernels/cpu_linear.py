"""Dense bf16 linears on the CPU with their weights packed once, at load time.

``F.linear`` on a bf16 CPU tensor gives oneDNN the checkpoint's plain ``[N, K]``
weight, which oneDNN copies into its own blocked layout on every call. At decode
batch sizes that copy, a pass over every weight of the model per step, costs about
as much as the product itself. Reordering each weight once (what ``torch.compile``'s
freezing and IPEX do) and calling oneDNN's linear on the packed weight gives the same
results (bit-identical on a Zen 4, within bf16 rounding wherever oneDNN picks another
kernel), 1.04x faster at 1 row, 1.6x at 8, 1.25x at 64 and 1.14x at 128 for the
built-in model's shapes (``benchmarks/cpu_linear.py``).

The packed weight is an opaque oneDNN tensor: it replaces the plain one (no second
copy), except where the LM head shares its weight with the token embedding, whose
lookups still need the plain rows.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

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


def pack_linears(model: nn.Module) -> int:
    """Replace every dense ``nn.Linear`` of ``model`` (quantised ones are left as
    they are) by a ``PackedLinear``. Returns how many were packed."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
