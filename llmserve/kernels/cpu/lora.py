"""Batched LoRA on the CPU: the adapters' low-rank products of a mixed batch, one group
of rows per adapter (punica's SGMV, as grouped matmuls).

A group is ``(slot, rank, rows)``: the rows of the flat batch that run under the
adapter in ``slot``, whose rank is ``rank``. The stacked weights keep each slot's
slices compactly: slice ``i`` of ``a[slot]`` is rows ``i*rank:(i+1)*rank``, and
``b[i][slot, :, :rank]`` is slice ``i``'s B (scale folded in). Rows of no group (the
base model's) are untouched, and each adapter's weights are read once per call, however
many of its sequences the batch holds.
"""

from __future__ import annotations

import torch


def lora_add_grouped(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor,
                     b: list[torch.Tensor], out_offsets: list[int],
                     groups: list[tuple[int, int, slice | torch.Tensor]]) -> None:
    """``y[rows, slice i] += (x[rows] @ A_i.T) @ B_i.T`` for every group and slice, in
    place (``out_offsets[i]``: slice i's first column of ``y``)."""
    n = len(b)
    for slot, rank, rows in groups:
        xa = x[rows] @ a[slot, :n * rank].T  # [m, n * rank]: one shrink for all slices
        for i, (bi, offset) in enumerate(zip(b, out_offsets)):
            delta = xa[:, i * rank:(i + 1) * rank] @ bi[slot, :, :rank].T
            width = bi.shape[1]
            if isinstance(rows, slice):
                y[rows, offset:offset + width] += delta
            else:
                y[:, offset:offset + width].index_add_(0, rows, delta)
