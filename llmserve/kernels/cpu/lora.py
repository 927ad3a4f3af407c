"""Batched LoRA on the CPU: the adapters' low-rank products of a mixed batch (punica's
SGMV, as batched matmuls).

Weights are stacked per slot as the Triton kernels take them: ``a [S, n*R, K]`` with
slice i's A in rows ``i*R : i*R + rank`` (zero past the slot's rank), and one
``b[i] [S, N_i, R]`` per output slice. A step's ``CPULoRAPlan`` (built once per step,
for every layer) groups the batch's rows by slot.

Where the CPU kernels are built (``native.cpu_library``), one call of ``lora.c`` does
a projection's whole LoRA: every group's rows are read and written in place (whatever
their number, order or size), shrunk and expanded slice by slice in float32 sums, and
added to y rounded once. Its weights are gathered once (``gather_native_weights``) per set of
slots, cut to their largest rank r, in their own dtype (bf16 weights are exact in bf16,
and half the bytes of float32): A ``[G, n*r, K]`` and B transposed over the slices,
``[G, r, N]``. Decode steps keep the same adapters for many steps, so the gathered copy
is reused until the set of slots changes. A decode step's projection costs several
small torch ops on the path below, and one ctypes call on this one.

Without the kernels (no C compiler, torch.compile'd layers, other layouts), torch
ops: the weights gathered in float32 (the CPU's small matmuls are far faster in
float32 than in bf16 at these shapes), with B block-diagonal over the slices so that
one matmul expands every slice and writes whole rows of y. Then:

- groups of few rows (decodes: one row per sequence) run together: their rows form a
  ``[G, m, K]`` block (read in place when the groups are back to back and of one size,
  as the scheduler lays a batch out, else gathered and padded) and go through one
  ``torch.bmm`` shrink and one expand, whatever the number of adapters;
- a group of many rows (a prefill chunk) runs on its own, so padding never multiplies
  a long prompt's work (unless every group has the same rows back to back: then all
  run together with no padding at all).

Rows of no group (the base model's) are untouched.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from llmserve.kernels.cpu import native

# Groups of more rows than this run alone (no padding to their size).
BATCHED_MAX_ROWS = 16


@dataclass
class CPULoRAPlan:
    """A step's rows by slot.

    ``slots``: every group's slot, the small groups first; ``rank``: their largest.
    Small groups: ``num_small`` of them, ``m`` rows each after padding; ``rows``
    ``[num_small * m]`` (padding points at row 0) with ``keep`` ``[num_small, m, 1]`` (0 on
    padding; None without), or ``span``, the one block of rows they fill back to back.
    ``single``: ``(index into slots, rows)`` of each large group. ``group_rows``
    (int64) and ``group_starts`` (int32 ``[len(slots) + 1]``): every group's rows in
    the order of ``slots``, for the C kernel."""
    slots: list[int] = field(default_factory=list)
    rank: int = 0
    num_small: int = 0
    m: int = 0
    rows: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    span: slice | None = None
    single: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    group_rows: torch.Tensor | None = None
    group_starts: torch.Tensor | None = None
    _rows_args: tuple[int, int, int] | None = None

    def rows_args(self) -> tuple[int, int, int]:
        """``group_rows`` and ``group_starts`` as the C kernel takes them (once a step)."""
        if self._rows_args is None:
            self._rows_args = native.lora_rows_args(self.group_rows, self.group_starts)
        return self._rows_args

    @classmethod
    def build(cls, groups: dict[int, list[int]], rank_of_slot: list[int]) -> CPULoRAPlan:
        """``groups``: slot -> its rows, in order."""
        # Groups of one size back to back (a batch the scheduler laid out by adapter)
        # all run together, however many rows each has: no padding, no gathering.
        uniform = _span(list(groups.values()), len(next(iter(groups.values()))))
        small = {s: r for s, r in groups.items()
                 if uniform is not None or len(r) <= BATCHED_MAX_ROWS}
        large = {s: r for s, r in groups.items() if s not in small}
        plan = cls(slots=[*small, *large], rank=max(rank_of_slot[s] for s in groups),
                   num_small=len(small))
        for i, rows in enumerate(large.values()):
            contiguous = rows[-1] - rows[0] + 1 == len(rows)
            index = slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows)
            plan.single.append((len(small) + i, index))
        ordered = [groups[s] for s in plan.slots]
        plan.group_rows = torch.tensor([r for rows in ordered for r in rows], dtype=torch.int64)
        plan.group_starts = torch.tensor([0, *itertools.accumulate(map(len, ordered))],
                                         dtype=torch.int32)
        if small:
            plan.m = max(len(r) for r in small.values())
            plan.span = _span(list(small.values()), plan.m)
            if plan.span is None:
                padded = [r + [0] * (plan.m - len(r)) for r in small.values()]
                plan.rows = torch.tensor(padded).view(-1)
                if any(len(r) < plan.m for r in small.values()):
                    plan.keep = torch.tensor([[1.0] * len(r) + [0.0] * (plan.m - len(r))
                                              for r in small.values()]).unsqueeze(-1)
        return plan


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: list[torch.Tensor],
             plan: CPULoRAPlan, cache: dict | None = None) -> None:
    """``y[rows, slice i] += (x[rows] @ A_i.T) @ B_i.T`` for every group of ``plan`` and
    every slice, in place (the slices cover y's columns in order). ``cache``: the
    caller's, for ``gather_weights``' result (valid until a slot's weights change)."""
    use_native = _native_applies(y, x, a)
    key = (tuple(plan.slots), plan.rank, use_native)
    weights = cache.get(key) if cache is not None else None
    if weights is None:
        weights = (gather_native_weights if use_native else gather_weights)(a, b, plan)
        if cache is not None:
            cache.clear()  # one set of slots at a time
            cache[key] = weights
    if use_native:
        native.lora_add_rows(y, x, plan.rows_args(), weights[-1])
        return
    ag, bg = weights
    if plan.num_small:
        _add_small(y, x, ag[:plan.num_small], bg[:plan.num_small], plan)
    for j, rows in plan.single:
        delta = (x[rows].float() @ ag[j].T) @ bg[j].T
        if isinstance(rows, slice):
            y[rows] += delta.to(y.dtype)
        else:
            y.index_add_(0, rows, delta.to(y.dtype))


def gather_weights(a: torch.Tensor, b: list[torch.Tensor], plan: CPULoRAPlan
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's slots' A ``[G, n*r, K]`` and block-diagonal B ``[G, N, n*r]``, cut to
    rank r, in float32."""
    r, n, stride = plan.rank, len(b), b[0].shape[2]
    slots = torch.tensor(plan.slots)
    ranks = (torch.arange(n)[:, None] * stride + torch.arange(r)[None, :]).reshape(-1)
    ag = a[slots[:, None], ranks[None, :]].float()
    if n == 1:
        return ag, b[0][slots, :, :r].float()
    widths = [bi.shape[1] for bi in b]
    bg = torch.zeros(len(plan.slots), sum(widths), n * r, dtype=torch.float32)
    start = 0
    for i, bi in enumerate(b):
        bg[:, start:start + widths[i], i * r:(i + 1) * r] = bi[slots, :, :r]
        start += widths[i]
    return ag, bg


def gather_native_weights(a: torch.Tensor, b: list[torch.Tensor], plan: CPULoRAPlan,
                          dtype: torch.dtype | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """The C kernel's weights of the plan's slots, cut to rank r, in ``dtype`` (a's by
    default): A ``[G, n*r, K]``, B transposed over the slices ``[G, r, N]`` (column c of
    slice i: that slice's B row, its r ranks down the column), each slice's end column
    (int64 ``[n]``), and the three as the kernel takes them."""
    r, n, stride = plan.rank, len(b), b[0].shape[2]
    dtype = dtype or a.dtype
    slots = torch.tensor(plan.slots)
    ranks = (torch.arange(n)[:, None] * stride + torch.arange(r)[None, :]).reshape(-1)
    ag = a[slots[:, None], ranks[None, :]].to(dtype).contiguous()
    widths = [bi.shape[1] for bi in b]
    bt = torch.empty(len(plan.slots), r, sum(widths), dtype=dtype)
    start = 0
    for bi, width in zip(b, widths):
        bt[:, :, start:start + width] = bi[slots, :, :r].transpose(1, 2)
        start += width
    ends = torch.tensor(list(itertools.accumulate(widths)), dtype=torch.int64)
    return ag, bt, ends, native.lora_weights_args(ag, bt, ends)


def _native_applies(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> bool:
    """The C kernel's domain: 2-D CPU rows of one dtype (float32 or bf16) with
    contiguous columns, eager, the kernels built."""
    return (x.dim() == 2 and y.dim() == 2 and x.dtype == y.dtype
            and x.dtype in native.DTYPE_CODES and a.dtype in native.DTYPE_CODES
            and x.is_cpu and y.is_cpu and x.stride(1) == 1 and y.stride(1) == 1
            and not torch.compiler.is_compiling() and native.cpu_library() is not None)


def _add_small(y, x, ag, bg, plan: CPULoRAPlan) -> None:
    g, m, span = plan.num_small, plan.m, plan.span
    xg = (x[span] if span is not None else x.index_select(0, plan.rows)).float()
    xa = torch.bmm(xg.view(g, m, -1), ag.transpose(1, 2))  # [G, m, n*r]
    if plan.keep is not None:
        xa *= plan.keep  # padding rows (copies of row 0) add nothing
    delta = torch.bmm(xa, bg.transpose(1, 2)).view(g * m, -1).to(y.dtype)  # every slice
    if span is not None:
        y[span] += delta
    else:  # whole rows of y (a column slice of y is much slower to scatter into)
        y.index_add_(0, plan.rows, delta)


def _span(groups: list[list[int]], m: int) -> slice | None:
    """The rows of ``groups`` as one slice, if each is ``m`` consecutive rows and each
    starts where the one before ends."""
    start = groups[0][0]
    for i, rows in enumerate(groups):
        if len(rows) != m or rows[0] != start + i * m or rows[-1] != rows[0] + m - 1:
            return None
    return slice(start, start + len(groups) * m)
