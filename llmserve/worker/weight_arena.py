"""The CPU weights moved into a few large blocks of memory on 2 MB pages.

A decode step on the CPU streams every weight once (~100 MB for the built-in model). On
4 KB pages that is 25,000 pages a step, each a TLB entry: the stream sweeps the TLB,
the hardware prefetcher stops at every page boundary, and whatever runs after a kernel,
the interpreter between two C calls included, pays page walks (a pure-Python check took
44 us right after the C decoder stack, 2 us when run again). On 2 MB pages the same
weights are ~60 entries. The weights loaded are many tensors scattered over the heap
(109 runs for the built-in model, most under 2 MB), so they are copied, in the order
the model holds them, into blocks whose memory Linux backs with huge pages
(``platforms/memory.py``), and each parameter and buffer becomes a view of its block,
with its own dtype, shape and values. One stream's decode step on the AMX Xeon: 1.2x
faster (docs/benchmarks.md, "Huge pages for the weights").

Invariants:
- Only what the model registers moves (parameters and buffers: contiguous, strided, on
  the CPU); a tensor registered twice (tied weights) moves once, and both names see the
  copy. Distinct tensors that share a storage (views of one another) stay where they
  are: copied apart, a write through one would no longer show in the other. Anything
  else keeps its memory.
- Nothing may hold a raw pointer into a weight before the move (``pack_weights`` runs
  before the native decoder, LoRA slots and the KV cache are built).
- A block holds at most ``BLOCK_BYTES``: the copy needs that much more memory at a time,
  not a second model.
- Where Linux gives no huge pages (THP off, an old kernel), the blocks are plain
  memory: the same values, the old speed.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.platforms.memory import HUGE_PAGE, advise_huge_pages

ALIGN = 64  # each tensor starts on its own cache line
BLOCK_BYTES = 256 << 20


def _movable(t: torch.Tensor | None) -> bool:
    return (t is not None and t.device.type == "cpu" and t.layout == torch.strided
            and t.is_contiguous() and t.numel() > 0)


def _registered(model: nn.Module):
    """(the module's table, name, tensor) of every movable parameter and buffer."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):  # noqa: SLF001
            for name, t in table.items():
                if _movable(t):
                    yield table, name, t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def huge_page_block(nbytes: int) -> tuple[torch.Tensor, bool]:
    """A uint8 tensor of ``nbytes`` starting on a 2 MB boundary, its memory asked onto
    huge pages before anything touches it (and whether Linux took the advice). Also
    ``benchmarks/cpu/stream_limit.py``'s read probe: the bandwidth the weights can have."""
    raw = torch.empty(nbytes + 2 * HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # whole pages, within raw's slack
    advised = advise_huge_pages(raw.data_ptr() + skip, span, collapse=False)
    return raw[skip:skip + nbytes], advised


def _fill(tensors: list[torch.Tensor]) -> tuple[dict[int, torch.Tensor], int]:
    """One block holding copies of ``tensors``: their new tensors by the old ones' id,
    and the bytes on huge pages."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end = -(-(end + _nbytes(t)) // ALIGN) * ALIGN
    block, advised = huge_page_block(end)
    moved = {}
    for t, offset in zip(tensors, offsets):
        part = block[offset:offset + _nbytes(t)]
        part.copy_(t.reshape(-1).view(torch.uint8))
        moved[id(t)] = part.view(t.dtype).view(t.shape)
    # Pages faulted before the advice held, or by a THP mode that defers: collapse them.
    span = -(-end // HUGE_PAGE) * HUGE_PAGE
    collapsed = advise_huge_pages(block.data_ptr(), span, collapse=True)
    return moved, span if (advised or collapsed) else 0


def _shared_storages(model: nn.Module) -> set[int]:
    """The storages that more than one distinct registered tensor views."""
    owners: dict[int, set[int]] = {}
    for _, _, t in _registered(model):
        owners.setdefault(t.untyped_storage().data_ptr(), set()).add(id(t))
    return {storage for storage, ids in owners.items() if len(ids) > 1}


def _next_group(model: nn.Module, blocks: list[tuple[int, int]],
                shared: set[int]) -> list[torch.Tensor]:
    """The next tensors to move, in the model's order, at most BLOCK_BYTES (or one
    larger tensor): those not in a block already, each once, none of a shared storage."""
    group, seen, size = [], set(), 0
    for _, _, t in _registered(model):
        if (id(t) in seen or t.untyped_storage().data_ptr() in shared
                or any(start <= t.data_ptr() < end for start, end in blocks)):
            continue
        if group and size + _nbytes(t) > BLOCK_BYTES:
            break
        seen.add(id(t))
        group.append(t)
        size += _nbytes(t)
    return group


def pack_weights(model: nn.Module) -> int:
    """Move the model's CPU parameters and buffers into blocks on huge pages (see the
    module's invariants), a block at a time; returns the bytes Linux put on huge
    pages."""
    blocks, on_huge_pages, shared = [], 0, _shared_storages(model)
    while group := _next_group(model, blocks, shared):
        moved, huge = _fill(group)
        on_huge_pages += huge
        first = min(t.data_ptr() for t in moved.values())
        blocks.append((first, max(t.data_ptr() + _nbytes(t) for t in moved.values())))
        with torch.no_grad():
            for table, name, t in list(_registered(model)):
                if id(t) in moved:
                    _replace(table, name, t, moved[id(t)])
        del group, moved  # the old copies go as the last references do
    return on_huge_pages


def _replace(table: dict, name: str, old: torch.Tensor, new: torch.Tensor) -> None:
    """A Parameter keeps its identity (optimisers, tied modules and hooks see the same
    object) and takes the new storage; a buffer is the new tensor."""
    if isinstance(old, nn.Parameter):
        old.data = new
    else:
        table[name] = new
