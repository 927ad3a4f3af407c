"""Iteration-level scheduler: one batch per engine step.

Each step spends a token budget (``max_num_batched_tokens``) over at most
``max_num_seqs`` running sequences:

1. running sequences that decode (one new token each), most urgent first;
2. running sequences still prefilling a long prompt, one chunk each;
3. waiting sequences, in order, each admitted with a first prefill chunk when
   its blocks fit above the watermark; the first that does not fit stops
   admission, so a big request is not starved by small ones behind it.

When a running sequence cannot get a block, the least urgent running sequence
(lowest priority, then latest arrival) is preempted; no new request is admitted
in a step that preempted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.config import EngineConfig
from llmserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_new: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: list[Sequence] = []  # kept sorted by urgency
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- queue order ---------------------------------------------------------
    def urgency(self, seq: Sequence) -> tuple:
        """Sort key: smaller is more urgent."""
        if self.config.scheduling_policy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self.urgency)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step ------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=self.urgency)
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_new, batch):
                continue
            self.bm.allocate(seq, seq.num_computed_tokens + num_new)
            batch.add(seq, num_new)
            budget -= num_new
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _make_room(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Preempt the least urgent running sequences until ``seq`` can grow by
        ``num_new`` tokens. False if ``seq`` itself had to go."""
        while not self.bm.can_allocate(
                self.bm.blocks_needed(seq, seq.num_computed_tokens + num_new), False):
            victim = max((s for s in self.running if s not in batch.seqs), key=self.urgency)
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.match_prefix(seq)
            num_computed = len(hits) * self.bm.block_size
            num_new = seq.num_tokens - num_computed
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            need = (-(-(num_computed + num_new) // self.bm.block_size) - len(hits)
                    + self.bm.num_free_among(hits))
            if not self.bm.can_allocate(need, use_watermark=True):
                break
            self.waiting.pop(0)
            if hits:
                self.bm.take_prefix(seq, hits)
            self.bm.allocate(seq, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new

    # --- after the step -------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Recompute-mode preemption: drop the KV cache, requeue. The freed blocks
        keep their prefix-cache keys, so the re-prefill mostly hits the cache."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.num_preemptions += 1
        self.add(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Leave the batch now and give back the blocks at once."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
