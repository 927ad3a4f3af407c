"""The KV block pool: plain-Python bookkeeping, no tensors.

Each sequence owns a block table (a list of physical block ids); token i of a
sequence lives in slot ``block_table[i // block_size] * block_size + i % block_size``.

Prefix caching: a full block is keyed by a hash chained over (parent hash, its
token ids, extra keys), so equal keys mean equal token prefixes. Freed blocks keep
their key and stay in the free queue, where a later request can still hit them.
The free queue is in least-recently-freed order: allocation evicts from its
front; a hit "touches" a free block and removes it from the queue in O(1)
(an OrderedDict is a doubly linked list with a hash index). Sequences free their
blocks tail first, so among blocks freed together the chain tail is evicted first.

Holds (prefill/decode disaggregation): ``hold`` keeps blocks referenced past their
sequence (a prefill engine's lease, a decode engine's imported prefix until its request
is scheduled); every hold is undone by exactly one ``unhold``.

Sliding windows (``sliding_window``, set only when every layer is windowed): a block
whose every token is before the window of the sequence's next query can never be read
again, so it is released (``free_outside_window``) and its block-table entry becomes
``DROPPED``. Entries stay in place, so index i is still tokens [i*bs, (i+1)*bs). Dropped
entries are always a prefix of the table; they hold no reference, are skipped by every
release, fork and swap, and the model runner reads them as block 0 (never attended).

Block operations (swap-out, swap-in, copy-on-write copy) are not performed here:
they are appended to ``ops``, the step's log, in the order the decisions were
taken, and the KV cache applies them in that order before the forward (see
``kv_cache.py``). So any sequence of decisions in one step is safe: a block freed
by one op and reused by a later one is read before it is overwritten.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import NamedTuple

from llmserve.core.request import Sequence
from llmserve.utils import cdiv

NO_HASH = b""
DROPPED = -1  # block-table entry of a block that fell out of the sliding window
_ROOT_HASH = hashlib.blake2b(b"llmserve-prefix-root", digest_size=16).digest()


def hash_block(parent: bytes, token_ids, extra: bytes = b"") -> bytes:
    """Key of one full block. Chained through ``parent`` so a block only matches
    when every block before it matched too."""
    h = hashlib.blake2b(parent or _ROOT_HASH, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def prefix_hashes(token_ids, num_full_blocks: int, block_size: int,
                  extra: bytes = b"") -> list[bytes]:
    """The chained keys of the first ``num_full_blocks`` blocks of ``token_ids``."""
    hashes, parent = [], NO_HASH
    for i in range(num_full_blocks):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


class BlockOp(NamedTuple):
    """One block move: ``swap_out`` (device -> CPU), ``swap_in`` (CPU -> device) or
    ``copy`` (device -> device, copy-on-write)."""
    kind: str
    src: int
    dst: int


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash = NO_HASH

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={bool(self.block_hash)})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark: float = 0.01, num_cpu_blocks: int = 0,
                 sliding_window: int | None = None):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block id -> None, in eviction order (front is evicted first)
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        # CPU swap space: plain free list, no caching.
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.ops: list[BlockOp] = []  # this step's block moves, in decision order
        # Counters (tokens), read by the metrics endpoint.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # --- figures -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free counts as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs for its first ``num_tokens`` tokens to have slots,
        counting the copy of a shared block it is about to write into."""
        grow = max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))
        return grow + (1 if self._shared_write_block(seq) is not None else 0)

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index in the block table of the block the next write lands in, if that
        block is shared with another sequence (copy-on-write needed)."""
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None

    def can_allocate(self, num_blocks: int, use_watermark: bool) -> bool:
        reserve = self.watermark_blocks if use_watermark else 0
        return self.num_free_blocks - num_blocks >= reserve

    # --- prefix cache ------------------------------------------------------
    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Chained keys of ``seq``'s first ``num_full_blocks`` blocks, extended lazily:
        a block's key depends only on the tokens, never on where it is stored."""
        bs, hashes = self.block_size, seq.block_hashes
        parent = hashes[-1] if hashes else NO_HASH
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs],
                                seq.request.cache_salt)
            hashes.append(parent)
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``. At least one token is
        always left to compute, because the model must run to produce logits. None
        for a request that wants its prompt's logprobs: they come from the prompt's
        logits, which a cached block does not keep."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, num_full)[:num_full]
        if self.sliding_window is not None:
            return self._window_hits(hashes)
        hits = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _window_hits(self, hashes: list[bytes]) -> list[int]:
        """The longest prefix whose window is cached: a key is chained over every token
        before it, so the blocks the next query sees vouch for the whole prefix. The
        blocks before that window are not needed (``DROPPED``)."""
        end = len(hashes)  # candidate prefix: blocks [0, end)
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] not in self.cached:
                end = i
            elif i <= max(0, end * self.block_size - self.sliding_window + 1) // self.block_size:
                return [DROPPED] * i + [self.cached[h] for h in hashes[i:end]]
        return []

    def num_free_among(self, block_ids: list[int]) -> int:
        return sum(1 for b in block_ids if b != DROPPED and self.blocks[b].ref_count == 0)

    def take_prefix(self, seq: Sequence, block_ids: list[int]) -> None:
        """Give a new sequence the cached blocks ``match_prefix`` found."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block_id in block_ids:
            if block_id != DROPPED:
                self._acquire(block_id)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = len(block_ids) * self.block_size
        seq.num_cached_blocks = len(block_ids)
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that became full and computed, so later
        requests can hit them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            if seq.block_table[i] == DROPPED:  # re-registering after a swap-in
                continue
            block = self.blocks[seq.block_table[i]]
            if not block.block_hash and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                self.cached[hashes[i]] = block.block_id
        seq.num_cached_blocks = num_full

    def free_outside_window(self, seq: Sequence) -> None:
        """Release the blocks no later query of ``seq`` can see: the next one, at
        position ``num_computed_tokens``, sees keys from ``num_computed_tokens -
        sliding_window + 1`` on. Call after ``cache_full_blocks``, so they stay
        hittable in the prefix cache."""
        if self.sliding_window is None:
            return
        first_seen = seq.num_computed_tokens - self.sliding_window + 1
        table = seq.block_table
        for i in range(min(max(0, first_seen) // self.block_size, len(table))):
            if table[i] != DROPPED:
                self._release(table[i])
                table[i] = DROPPED

    def blocks_at_once(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of ``num_tokens`` holds at one time, computing at
        most ``chunk`` tokens a step: all of them, or in a window, the window's blocks
        plus a chunk's (and one more where the window straddles a block boundary)."""
        every = cdiv(num_tokens, self.block_size)
        if self.sliding_window is None:
            return every
        return min(every, cdiv(self.sliding_window + chunk, self.block_size) + 1)

    def num_held(self, table: list[int]) -> int:
        """Blocks a (device or CPU) block table really holds."""
        return sum(1 for b in table if b != DROPPED)

    # --- holds and imported prefixes (P/D) -----------------------------------
    def hold(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self._acquire(block_id)

    def unhold(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):  # tail first, as a sequence frees
            self._release(block_id)

    def reserve_import(self, hashes: list[bytes]) -> tuple[list[int], int]:
        """For a prefix whose KV another engine computed: hold its cached leading blocks
        and take fresh blocks for as many of the rest as fit above the watermark.
        Returns (held block ids, index of the first fresh one); the caller fills the
        fresh ones and calls ``commit_import`` (or ``unhold`` to give up)."""
        held = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            self._acquire(block_id)
            held.append(block_id)
        first_new = len(held)
        room = self.num_free_blocks - self.watermark_blocks
        for _ in range(max(0, min(len(hashes) - first_new, room))):
            held.append(self._take_free_block())
        return held, first_new

    def commit_import(self, block_ids: list[int], hashes: list[bytes], first_new: int,
                      filled: bool) -> list[int]:
        """Register the fresh blocks under their keys once ``filled``; otherwise give them
        back. Returns the blocks still held (the caller ``unhold``s them later)."""
        if not filled:
            self.unhold(block_ids[first_new:])
            return block_ids[:first_new]
        for block_id, h in zip(block_ids[first_new:], hashes[first_new:]):
            if h not in self.cached:  # else an equal block arrived meanwhile: ours stays anonymous
                self.blocks[block_id].block_hash = h
                self.cached[h] = block_id
        return block_ids

    # --- allocation --------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq``'s first ``num_tokens`` tokens writable: copy the shared
        block the next write lands in (copy-on-write), then grow the table.
        The caller checked can_allocate."""
        i = self._shared_write_block(seq)
        if i is not None:
            src = seq.block_table[i]
            dst = self._take_free_block()
            self.ops.append(BlockOp("copy", src, dst))
            self._release(src)
            seq.block_table[i] = dst
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take_free_block())

    def truncate(self, seq: Sequence) -> None:
        """Speculative decoding's rollback: release the blocks past the ones holding
        ``seq``'s ``num_computed_tokens`` tokens (a rejected draft's slots), tail first.
        They were taken in the step that wrote the draft, so none is shared, cached or
        ``DROPPED`` (those are a prefix)."""
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        assert seq.num_cached_blocks <= keep
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def take_ops(self) -> list[BlockOp]:
        """Hand the step's block moves to the caller, which must apply them in order."""
        ops, self.ops = self.ops, []
        return ops

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` starts as a copy of ``parent`` sharing every block (n > 1)."""
        for block_id in parent.block_table:
            if block_id != DROPPED:
                self._acquire(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks

    # --- swap ----------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(self.free_cpu_blocks) >= self.num_held(seq.block_table)

    def swap_out(self, seq: Sequence) -> None:
        """Move ``seq``'s blocks to CPU (each block gets its own CPU copy, even one
        shared with a sibling sample)."""
        seq.cpu_block_table = [b if b == DROPPED else self.free_cpu_blocks.pop()
                               for b in seq.block_table]
        self.ops += [BlockOp("swap_out", b, c)
                     for b, c in zip(seq.block_table, seq.cpu_block_table) if b != DROPPED]
        self.free(seq)

    def swap_in(self, seq: Sequence) -> None:
        """Bring ``seq``'s blocks back into new device blocks."""
        seq.block_table = [c if c == DROPPED else self._take_free_block()
                           for c in seq.cpu_block_table]
        self.ops += [BlockOp("swap_in", c, b)
                     for c, b in zip(seq.cpu_block_table, seq.block_table) if c != DROPPED]
        self.free_swapped(seq)
        seq.num_cached_blocks = 0  # new block ids: register them again as they qualify

    def free_swapped(self, seq: Sequence) -> None:
        """Give back the CPU blocks of a swapped-out sequence."""
        self.free_cpu_blocks.extend(c for c in reversed(seq.cpu_block_table) if c != DROPPED)
        seq.cpu_block_table = []

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``, tail first (see the module docstring)."""
        for block_id in reversed(seq.block_table):
            if block_id != DROPPED:
                self._release(block_id)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash:  # evict: this block's contents are about to change
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = NO_HASH
        block.ref_count = 1
        return block_id

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]  # touch: a hit takes it out of eviction order
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"double free of block {block_id}"
        if block.ref_count == 0:
            if block.block_hash:
                self.free_queue[block_id] = None
            else:
                # Nothing to hit in an uncached block: evict it before cached ones.
                self.free_queue[block_id] = None
                self.free_queue.move_to_end(block_id, last=False)

    def check_all_free(self) -> None:
        """Invariant for tests: nothing is held once every sequence is gone."""
        held = [b for b in self.blocks if b.ref_count != 0]
        assert not held, f"blocks still referenced: {held[:8]}"
        assert len(self.free_queue) == self.num_blocks
        assert len(self.free_cpu_blocks) == self.num_cpu_blocks, "swap blocks leaked"
