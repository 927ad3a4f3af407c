"""KV cache storage: device blocks of every layer, the CPU swap space, and the
application of a step's block moves.

Storage is one tensor ``[layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]``:
a block move covers all layers in one indexed copy (dimension 2), and each layer's
cache ``storage[i]`` is contiguous, so the CPU attention gathers a block's K and V
rows in one ``index_select``.

Invariant of a step's block ops (the block manager logs them in decision order):
they are applied in that order. Consecutive ops of one kind are batched into one
gather-then-scatter only while no block in the run is written twice or read after
being written; a gather reads every source before the scatter writes, so a run that
reads a block and later overwrites it (write after read) is safe in one batch.
With that, a block freed by one decision and reused by a later one in the same step
always has its old contents read before they are overwritten.

``check_integrity`` (a debug flag, off by default) hashes each CPU block when a
swap-out writes it and checks the hash when the swap-in reads it back.
"""

from __future__ import annotations

import hashlib
import mmap

import torch

from llmserve.core.block_manager import BlockOp

# kind -> (space read, space written)
_SPACES = {"swap_out": ("device", "cpu"), "swap_in": ("cpu", "device"),
           "copy": ("device", "device")}


class KVIntegrityError(RuntimeError):
    """KV contents changed where the engine's bookkeeping says they could not."""


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 num_cpu_blocks: int = 0, check_integrity: bool = False):
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.storage = _zeroed(shape, dtype, device)
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_storage = None
        if num_cpu_blocks:
            # torch.empty: pages are committed only when a block is swapped out.
            self.cpu_storage = torch.empty((*shape[:2], num_cpu_blocks, *shape[3:]),
                                           dtype=dtype, pin_memory=device.type == "cuda")
        self.check_integrity = check_integrity
        self._cpu_digests: dict[int, bytes] = {}

    @torch.inference_mode()
    def apply(self, ops: list[BlockOp]) -> None:
        for kind, pairs in coalesce(ops):
            if kind == "swap_in" and self.check_integrity:
                self._check_swapped(pairs)
            src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
            dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
            if kind == "swap_out":
                self.cpu_storage[:, :, dst] = self.storage[:, :, src.to(self.storage.device)].cpu()
            elif kind == "swap_in":
                dev = self.storage.device
                self.storage[:, :, dst.to(dev)] = self.cpu_storage[:, :, src].to(dev)
            else:
                dev = self.storage.device
                self.storage[:, :, dst.to(dev)] = self.storage[:, :, src.to(dev)]
            if kind == "swap_out" and self.check_integrity:
                for _, cpu_block in pairs:
                    self._cpu_digests[cpu_block] = digest(self.cpu_storage[:, :, cpu_block])

    def _check_swapped(self, pairs: list[tuple[int, int]]) -> None:
        for cpu_block, device_block in pairs:
            want = self._cpu_digests.pop(cpu_block, None)
            if want is not None and digest(self.cpu_storage[:, :, cpu_block]) != want:
                raise KVIntegrityError(
                    f"CPU block {cpu_block} changed between its swap-out and the swap-in "
                    f"into device block {device_block}")

    def block_digest(self, block_id: int, num_slots: int) -> bytes:
        """Hash of the first ``num_slots`` slots of a device block, all layers."""
        return digest(self.storage[:, :, block_id, :num_slots])


# From this size on, a CPU KV storage is its own anonymous mapping.
_FRESH_MAPPING_BYTES = 64 << 20


def _zeroed(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero KV storage. On a CPU a big one is a fresh anonymous mapping, whose pages
    the kernel hands out zero-filled when first touched, so only blocks that are ever
    written count in the process's memory (an idle engine with a 1 GiB cache does not
    hold 1 GiB). Padding reads of never-written blocks see zeros. (Not ``torch.empty``:
    malloc may serve even a large request from memory the process freed, e.g. an
    earlier engine's weights, whose bytes read as NaN would poison attention through
    the padding rows.)"""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if device.type == "cpu" and nbytes >= _FRESH_MAPPING_BYTES:
        # The tensor keeps the mapping alive; it is unmapped when the tensor is freed.
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


def digest(t: torch.Tensor) -> bytes:
    data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def coalesce(ops: list[BlockOp]) -> list[tuple[str, list[tuple[int, int]]]]:
    """Split the ordered ops into runs of one kind that are safe to run as one
    batched copy: no block of the run is read or written after the run wrote it."""
    runs: list[tuple[str, list[tuple[int, int]]]] = []
    written: set[tuple[str, int]] = set()
    for op in ops:
        read_space, write_space = _SPACES[op.kind]
        src, dst = (read_space, op.src), (write_space, op.dst)
        if not runs or runs[-1][0] != op.kind or src in written or dst in written:
            runs.append((op.kind, []))
            written = set()
        runs[-1][1].append((op.src, op.dst))
        written.add(dst)
    return runs
