"""Debug check of KV contents per sequence (``EngineConfig.check_kv_integrity``).

After each forward, the blocks a sequence wrote are hashed (only the slots it has
computed). Before its next forward, every hashed block in its block table must still
hash the same: whatever happened in between (swap-out and swap-in into other
blocks, a copy-on-write fork and the sibling's writes into its own copy, other
sequences reusing freed blocks), the sequence must find its KV as it left it.
Blocks taken from the prefix cache are not hashed (another sequence computed them).
A mismatch raises ``KVIntegrityError`` naming the sequence and the block.
"""

from __future__ import annotations

import weakref

from llmserve.core.block_manager import DROPPED
from llmserve.core.request import Sequence, SequenceStatus
from llmserve.core.sched.output import ScheduledBatch
from llmserve.utils import cdiv
from llmserve.worker.kv_cache import KVCache, KVIntegrityError


class SequenceKVCheck:
    def __init__(self, kv_cache: KVCache, block_size: int):
        self.kv = kv_cache
        self.block_size = block_size
        # sequence -> digest per block index (None: not hashed)
        self.digests: weakref.WeakKeyDictionary[Sequence, list[bytes | None]] = (
            weakref.WeakKeyDictionary())

    def before_forward(self, batch: ScheduledBatch) -> None:
        for seq in batch.preempted:
            if seq.status is SequenceStatus.WAITING:  # recompute: its KV is gone
                self.digests.pop(seq, None)
        for seq in batch.seqs:
            known = self.digests.get(seq, [])
            for i, want in enumerate(known[:self._num_blocks(seq.num_computed_tokens)]):
                if want is not None and seq.block_table[i] != DROPPED and \
                        self._digest(seq, i) != want:
                    raise KVIntegrityError(
                        f"{seq}: block {i} (physical {seq.block_table[i]}) changed since "
                        f"the sequence last wrote it (preemptions: {seq.num_preemptions})")

    def after_forward(self, batch: ScheduledBatch) -> None:
        """Call once ``num_computed_tokens`` includes the step's tokens."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            first = (seq.num_computed_tokens - n) // self.block_size
            known = self.digests.setdefault(seq, [])
            last = self._num_blocks(seq.num_computed_tokens)
            known += [None] * (last - len(known))
            for i in range(first, last):
                known[i] = self._digest(seq, i)

    def forked(self, parent: Sequence, child: Sequence) -> None:
        self.digests[child] = list(self.digests.get(parent, []))

    def _num_blocks(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _digest(self, seq: Sequence, i: int) -> bytes | None:
        if seq.block_table[i] == DROPPED:  # out of the sliding window: never read again
            return None
        slots = min(self.block_size, seq.num_computed_tokens - i * self.block_size)
        return self.kv.block_digest(seq.block_table[i], slots)
