"""Iteration-level scheduler: one batch per engine step.

Each step spends a token budget (``max_num_batched_tokens``) over at most
``max_num_seqs`` running sequences:

1. running sequences that decode (one new token each), most urgent first;
2. running sequences still prefilling a long prompt, one chunk each;
3. waiting sequences, in order, each admitted with a first prefill chunk when
   its blocks fit above the watermark; the first that does not fit stops
   admission, so a big request is not starved by small ones behind it.

When a running sequence cannot get a block, the least urgent running sequence
(lowest priority, then latest arrival) is preempted — swapped to CPU or dropped
for recompute, per ``preemption_mode`` — and no new request is admitted in that
step. Swapped sequences come back, most urgent first, before any waiting request
is admitted. Under the ``priority`` policy a waiting request that does not fit
may preempt running ones that are less urgent than itself.
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
    # Block moves the model runner performs before the forward, in this order.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def has_block_ops(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copies)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_new: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)

    def remove(self, seq: Sequence) -> int:
        i = self.seqs.index(seq)
        self.seqs.pop(i)
        return self.num_new_tokens.pop(i)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: list[Sequence] = []  # kept sorted by urgency
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # kept sorted by urgency
        self.num_preemptions = 0
        self.num_swapped_out = 0

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
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

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
            batch.copies += self.bm.allocate(seq, seq.num_computed_tokens + num_new)
            batch.add(seq, num_new)
            budget -= num_new
        if not batch.preempted:
            budget = self._swap_in(batch, budget)
            if not self.swapped:
                self._admit_waiting(batch, budget)
        return batch

    def _make_room(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Preempt the least urgent running sequences until ``seq`` can grow by
        ``num_new`` tokens. False if ``seq`` itself had to go."""
        while not self.bm.can_allocate(
                self.bm.blocks_needed(seq, seq.num_computed_tokens + num_new), False):
            victim = max((s for s in self.running if s not in batch.seqs), key=self.urgency)
            self.preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _swap_in(self, batch: ScheduledBatch, budget: int) -> int:
        """Bring swapped sequences back, most urgent first, while they fit."""
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            need = max(len(seq.cpu_block_table),
                       -(-(seq.num_computed_tokens + num_new) // self.bm.block_size))
            if not self.bm.can_allocate(need, use_watermark=True):
                break
            self.swapped.pop(0)
            batch.swap_in += self.bm.swap_in(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.copies += self.bm.allocate(seq, seq.num_computed_tokens + num_new)
            batch.add(seq, num_new)
            budget -= num_new
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self._has_seq_slots(seq):
                break
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
                if self._preempt_for(seq, batch):
                    budget = self.config.max_num_batched_tokens - batch.num_tokens
                    continue  # something less urgent made room: try again
                break
            self.waiting.pop(0)
            self.bm.take_prefix(seq, hits)  # also counts the lookup for the metrics
            batch.copies += self.bm.allocate(seq, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new

    def fork_children(self, parent: Sequence) -> list[Sequence]:
        """Parallel samples (n > 1): once the first sample has prefilled the prompt
        and is about to sample its first token, its siblings start from it, sharing
        every block (copy-on-write). Returns the siblings, which sample now too."""
        req = parent.request
        if parent.index != 0 or parent.num_output_tokens or len(req.sequences) == 1:
            return []
        children = req.sequences[1:]
        for child in children:
            self.bm.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        return children

    def _has_seq_slots(self, seq: Sequence) -> bool:
        """Room under max_num_seqs for ``seq`` and, if it is an unforked first
        sample, for the siblings that will fork from it. A request with more
        samples than the cap still runs when nothing else does."""
        def slots(s: Sequence) -> int:
            unforked = s.index == 0 and s.num_output_tokens == 0
            return len(s.request.sequences) if unforked else 1

        used = sum(slots(s) for s in self.running)
        return used + slots(seq) <= self.config.max_num_seqs or not self.running

    def _preempt_for(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Priority policy: preempt the least urgent running sequence if it is less
        urgent than the waiting ``seq``. True if one was preempted."""
        if self.config.scheduling_policy != "priority" or not self.running:
            return False
        victim = max(self.running, key=self.urgency)
        if victim.priority <= seq.priority:
            return False
        if victim in batch.seqs:
            batch.remove(victim)
        self.preempt(victim, batch)
        return True

    # --- preemption and finishing ------------------------------------------------
    def preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Swap ``seq`` to CPU, or drop its KV cache for recompute (also the
        fallback when the swap space is full). Recomputed sequences keep their
        tokens, and the freed blocks keep their prefix-cache keys, so the
        re-prefill mostly hits the cache and the output does not change."""
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        batch.preempted.append(seq)
        if self.config.preemption_mode == "swap" and self.bm.can_swap_out(seq):
            batch.swap_out += self.bm.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.num_swapped_out += 1
            bisect.insort(self.swapped, seq, key=self.urgency)
            return
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.add(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Leave the batch now and give back the blocks at once."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        if seq.status is SequenceStatus.SWAPPED:
            self.bm.free_cpu_blocks.extend(reversed(seq.cpu_block_table))
            seq.cpu_block_table = []
        seq.status = status
        self.bm.free(seq)
