"""LoRA on the model's projections: ``LoRALinear`` wraps a (fused, maybe quantised or
packed) projection and adds, to the rows of each sequence that runs under an adapter,
that adapter's low-rank product. Every adapter in the batch is applied in the same
forward: the step's ``LoRAStep`` says which rows run under which slot.

Layout of a wrapped projection with ``n`` output slices (q/k/v fused: 3; gate/up: 2;
o and down: 1), for ``S`` slots and the largest rank ``R``:

- ``a`` ``[S, n * R, in]``: slot s's A matrices, slice after slice;
- ``b[i]`` ``[S, out_i, R]``: slot s's B of slice i (its scale folded in).

A slot of rank r keeps slice i's A in rows ``i * R : i * R + r`` and its B in columns
``:r``; rows and columns past a slot's rank are zero. The CPU path reads only the ranks
the step's adapters have; the Triton kernels take the fixed stride (one launch for
every slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmserve.kernels.cpu.lora import CPULoRAPlan, lora_add


@dataclass
class LoRAStep:
    """Which rows of this step's flat batch run under which slot.

    ``cpu`` (CPU): the rows grouped by slot. ``seg_starts``/``seg_slots``/``max_seg_len``
    (Triton): the batch's sequences as segments and each one's slot (-1: the base
    model)."""
    cpu: CPULoRAPlan | None = None
    seg_starts: torch.Tensor | None = None
    seg_slots: torch.Tensor | None = None
    max_seg_len: int = 0


class LoRAState:
    """Shared by every wrapped projection of a model: the current step's LoRAStep (None:
    no adapter in this step, so the projections cost nothing extra)."""

    def __init__(self, use_triton: bool):
        self.use_triton = use_triton
        self.step: LoRAStep | None = None


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, out_sizes: list[int],
                 num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 state: LoRAState):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, sum(out_sizes)
        self.max_rank = max_rank
        self.state = state
        n = len(out_sizes)
        self.a = torch.zeros(num_slots, n * max_rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(num_slots, size, max_rank, dtype=dtype, device=device)
                  for size in out_sizes]
        self.out_offsets = [sum(out_sizes[:i]) for i in range(n)]
        self.gathered: dict = {}  # the CPU path's weights of the slots in use (lora_add)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.state.step
        if step is None:
            return y
        if self.state.use_triton:
            self._add_triton(y, x, step)
        else:
            lora_add(y, x, self.a, self.b, step.cpu, self.gathered)
        return y

    def _add_triton(self, y: torch.Tensor, x: torch.Tensor, step: LoRAStep) -> None:
        from llmserve.kernels.triton.lora import lora_expand, lora_shrink
        xa = lora_shrink(x, self.a, step.seg_starts, step.seg_slots, step.max_seg_len)
        for i, (b, offset) in enumerate(zip(self.b, self.out_offsets)):
            lora_expand(y, xa, b, step.seg_starts, step.seg_slots, step.max_seg_len,
                        i * self.max_rank, offset)

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None],
                 rank: int) -> None:
        """Slot ``slot`` holds ``parts`` (per slice: (A ``[r_i, in]``, B ``[out_i, r_i]``)
        or None where the adapter leaves that slice alone), ``rank`` their largest r."""
        stride = self.max_rank
        self.gathered.clear()
        self.a[slot].zero_()
        for i, (part, b) in enumerate(zip(parts, self.b)):
            b[slot].zero_()
            if part is None:
                continue
            a_i, b_i = part
            r = a_i.shape[0]
            self.a[slot, i * stride:i * stride + r].copy_(a_i)
            b[slot, :, :r].copy_(b_i)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, slots={self.a.shape[0]}, "
                f"max_rank={self.max_rank}")
