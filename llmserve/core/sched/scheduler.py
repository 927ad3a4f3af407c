"""Iteration-level scheduler: one batch per engine step.

Each step spends a token budget (``max_num_batched_tokens``) over at most
``max_num_seqs`` running sequences, in one pass over the candidates in order:

- ``fcfs``: running sequences (oldest first), then swapped-out ones, then waiting
  ones; nothing waiting is admitted while something is swapped out.
- ``priority``: running, swapped and waiting sequences merged by urgency (priority
  number, then arrival), so an urgent request is placed before less urgent work.

Running decodes are served first within the budget: a prefill chunk (of a running
sequence or an admitted one) only gets what is left after one token for every
running decode. A decode with a draft (speculative decoding, ``spec_token_ids``) computes
it too, as a small chunk, in budget and free blocks no other work needs
(``_fit_draft``). A swapped or waiting candidate needs its blocks to fit above a
watermark; the first that does not fit stops admission, so a big request is not
starved by small ones behind it.

Multi-LoRA: at most ``max_loras`` distinct adapters run at once. A candidate whose
adapter would be one too many is passed over for the step, as is every adapter
candidate after it (so it is not overtaken by its own kind and starved); base-model
candidates behind it still come in.

When a running sequence cannot get a block, the least urgent running sequence that
is not yet scheduled in this step is preempted (swapped to CPU or dropped for
recompute, per ``preemption_mode``); that can be the sequence itself. Under
``priority`` an admission candidate may likewise preempt running sequences of a
strictly less urgent priority, for KV blocks or for a place under ``max_num_seqs``
(so interactive work does not wait for a batch of batch work to finish). Because
candidates come in urgency order, every victim is one this step has not scheduled
yet: the scheduler never undoes in a step what it did earlier in it. After a
preemption nothing is admitted, except, under ``priority``, candidates more urgent
than every sequence preempted in the step.

Block moves are logged by the block manager in decision order and applied in that
order (``kv_cache.py``), so a block freed by a move and reused by a later one in the
same step is always read before it is overwritten.

Two knobs change what a step may hold:

- ``batching="static"`` (the A/B baseline for continuous batching, ``batching.py``):
  a batch of up to ``max_num_seqs`` waiting requests is formed when nothing runs, with
  KV blocks for each member's prompt plus ``max_tokens`` known to fit, and nothing
  else is admitted until its last member finishes.
- ``target_itl_ms``: each step's predicted duration (``cost_model.py``, fitted online)
  is kept at or below the target: prefill chunks shrink to the time left after the
  decodes, and decodes that do not fit wait a step, least urgent first. A step always
  holds at least its most urgent piece of work, so nothing starves when even that
  alone exceeds the target.

Where the parts live: the policies' order and rules in ``policy.py``, the waiting and
swapped queues in ``request_queue.py`` (heaps; the waiting one orders tenants by fair
share), the running batch in ``running.py``, and a pass's ledger (budget, sequence
slots, whom it may preempt) in ``step.py``, each kept as decisions are made so that
no step rescans the batch per candidate.
"""

from __future__ import annotations

from llmserve.config import EngineConfig
from llmserve.core.block_manager import BlockManager
from llmserve.core.request import Sequence, SequenceStatus
from llmserve.core.sched.batching import batching_for
from llmserve.core.sched.cost_model import StepCostModel
from llmserve.core.sched.fair_share import TenantShares
from llmserve.core.sched.output import ScheduledBatch
from llmserve.core.sched.policy import POLICIES
from llmserve.core.sched.request_queue import TenantFairQueue
from llmserve.core.sched.running import RunningBatch
from llmserve.core.sched.step import Step, seq_slots
from llmserve.utils import cdiv


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.policy = POLICIES[config.scheduling_policy]()
        self.shares = TenantShares()  # fair order of tenants among equals in ``waiting``
        self.waiting = TenantFairQueue(self.policy.new_queue, self.shares, self.policy.tier)
        self.running = RunningBatch(self.policy.urgency)
        self.swapped = self.policy.new_queue()
        self.batching = batching_for(config.batching, self.policy)
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.cost_model = StepCostModel()  # fitted by the engine from measured steps

    # --- queue order ---------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.shares.arrive(seq.request)
        self.waiting.add(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Queue ``seq`` of a request that has run: it keeps its place in the batch it
        ran in (``batching.py``)."""
        self.add(seq)
        self.batching.requeued(seq)

    def waiting_head(self, skip: set[int] | None = None) -> Sequence | None:
        """The next waiting sequence to admit: the most urgent; among those of its
        priority, the one whose tenant has been served least (``fair_share.py``).
        ``skip``: seq ids passed over in this step."""
        return self.waiting.head(skip or frozenset())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # --- the step ------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        self.running.sort()
        target = self.config.target_itl_ms
        step = Step(self.config.max_num_batched_tokens, list(self.running), self.cost_model,
                    None if target is None else target / 1000)
        self.batching.start_step(self)
        self._place(step)
        step.batch.block_ops = self.bm.take_ops()
        if self.config.enable_lora:
            step.batch.group_by_adapter()
        for seq, n in zip(step.batch.seqs, step.batch.num_new_tokens):
            self.shares.charge(seq.request, seq.first_time_tokens(n))
        if self.cost_model.ready and step.batch.seqs:
            step.batch.predicted_s = self.cost_model.predict(
                step.batch.num_tokens, step.batch.kv_tokens, len(step.batch.seqs))
        return step.batch

    def _place(self, step: Step) -> None:
        """One pass over the running sequences (most urgent first) and the queued
        candidates: under a policy that merges by urgency, a candidate more urgent
        than the next running sequence goes first; else every running one does."""
        merges = self.policy.merges_by_urgency
        to_run = iter(step.order)
        seq = next(to_run, None)
        candidate = candidate_key = known = None
        while True:
            while seq is not None and seq.status is not SequenceStatus.RUNNING:
                seq = next(to_run, None)  # preempted earlier in this step
            if (seq is None or merges) and known != step.candidate_state:
                # Only an admission, a preemption or a candidate passed over changes
                # who is next; placing a running sequence alone does not.
                known = step.candidate_state
                candidate = self._next_candidate(step)
                candidate_key = None if candidate is None else self.policy.urgency(candidate)
            if candidate is not None and (seq is None or (
                    merges and candidate_key < self.running.urgency_of(seq))):
                if not self._admit(candidate, step):
                    step.admitting = False
            elif seq is not None:
                self._schedule_running(seq, step)
                seq = next(to_run, None)
            else:
                break

    def _next_candidate(self, step: Step) -> Sequence | None:
        """The swapped or waiting sequence to try next, or None."""
        if not step.admitting:
            return None
        return self.batching.next_candidate(self, step)

    def _schedule_running(self, seq: Sequence, step: Step) -> None:
        if seq.num_uncomputed_tokens == 0:
            # Nothing to compute: a beam waiting for its siblings' next tokens
            # (beam_search.py), or a sequence whose last token, in flight, ends it
            # (async scheduling, engine/overlap.py).
            return
        decode = seq.num_uncomputed_tokens == 1
        if decode:
            num_new = min(1, step.budget) if step.decode_fits(seq) else 0
            num_new += self._fit_draft(seq, step) if num_new else 0
        else:
            num_new = min(seq.num_uncomputed_tokens, step.chunk_limit(seq.num_computed_tokens))
        if num_new == 0 and step.cost is not None:
            step.admitting = False  # deferred for time: nothing less urgent overtakes it
        if num_new and self._make_room(seq, num_new, step):
            self.bm.allocate(seq, seq.num_computed_tokens + num_new)
            step.add(seq, num_new)
        if decode and seq.status is SequenceStatus.RUNNING:
            step.decodes_left -= 1  # (preempt() counted it if it had to go)

    def _fit_draft(self, seq: Sequence, step: Step) -> int:
        """Speculative decoding: how many of ``seq``'s draft tokens (``spec_token_ids``,
        shortened to that) its decode computes too. A draft only uses budget no later
        decode needs and blocks that are free: it never preempts anything."""
        draft = seq.spec_token_ids
        if draft:
            del draft[max(0, step.budget - step.decodes_left):]
            need = self.bm.blocks_needed(seq, seq.num_computed_tokens + 1 + len(draft))
            if not self.bm.can_allocate(need, False):
                draft.clear()
        return len(draft)

    def _make_room(self, seq: Sequence, num_new: int, step: Step) -> bool:
        """Preempt the least urgent unscheduled running sequences until ``seq`` can
        grow by ``num_new`` tokens. False if ``seq`` itself had to go."""
        while not self.bm.can_allocate(
                self.bm.blocks_needed(seq, seq.num_computed_tokens + num_new), False):
            # A beam idle until its siblings offer goes before anything that has work
            # (else a sibling's chunked re-prefill could preempt itself for ever).
            victim = (step.victims.parked_beam(seq)
                      or step.victims.least_urgent_unscheduled())
            self.preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _admit(self, seq: Sequence, step: Step) -> bool:
        """Swap in or admit the candidate ``seq`` with its next chunk (or pass over it,
        for want of an adapter slot). False stops admission for this step."""
        if seq.request.lora is not None and (step.lora_blocked or not self._has_lora_slot(seq)):
            # Its adapter has no slot (or a more urgent adapter request already waits
            # for one): it is passed over, and base-model requests behind it still
            # come in. Adapter requests behind it wait, so it is not starved.
            step.lora_blocked.add(seq.seq_id)
            return True
        swapped = seq.status is SequenceStatus.SWAPPED
        while True:
            plan = self._admission_plan(seq, step, swapped)
            if plan is None:
                # Under priority, a full batch makes room for more urgent work too.
                if not self._has_seq_slots(seq, step) and self._preempt_for(seq, step):
                    continue
                return False
            num_new, need, hits = plan
            # The watermark keeps room for running sequences to grow; with none
            # running it would only stop a request that fits from ever starting.
            # Static batches reserved their blocks when they formed.
            watermark = bool(self.running) and not self.batching.reserves_blocks
            if self.bm.can_allocate(need, use_watermark=watermark):
                break
            if not self._preempt_for(seq, step):
                return False
        seq.spec_token_ids = []  # admitted with its own tokens only
        if swapped:
            self.swapped.remove(seq)
            self.bm.swap_in(seq)
        else:
            self.waiting.remove(seq)
            self.batching.admitted(seq)
            self.bm.take_prefix(seq, hits)  # also counts the lookup for the metrics
        self.bm.allocate(seq, seq.num_computed_tokens + num_new)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        step.admitted(seq, num_new)
        return True

    def _admission_plan(self, seq: Sequence, step: Step, swapped: bool):
        """(tokens to compute, blocks to take, prefix hits) for admitting ``seq`` now,
        or None if the sequence cap or the budget does not allow it."""
        bs = self.bm.block_size
        if swapped:
            # Not len(running): unforked first samples hold places for their siblings.
            if not self._has_seq_slots(seq, step):
                return None
            num_new = min(seq.num_uncomputed_tokens, step.chunk_limit(seq.num_computed_tokens))
            if num_new == 0:
                return None
            table = seq.cpu_block_table  # its blocks come back, then it grows
            grow = max(0, cdiv(seq.num_computed_tokens + num_new, bs) - len(table))
            need = self.bm.num_held(table) + grow
            return num_new, need, []
        if not self._has_seq_slots(seq, step):
            return None
        hits = self.bm.match_prefix(seq)
        num_computed = len(hits) * bs
        num_new = seq.num_tokens - num_computed
        avail = step.chunk_limit(num_computed)
        if num_new > avail:
            if not self.config.enable_chunked_prefill:
                # A whole prompt or nothing: alone in a step it runs even over the
                # latency target, or it would never run.
                if step.batch.seqs or num_new > step.prefill_budget:
                    return None
            elif avail == 0:
                return None
            else:
                num_new = avail
        need = cdiv(num_computed + num_new, bs) - len(hits) + self.bm.num_free_among(hits)
        return num_new, need, hits

    def fork_children(self, parent: Sequence) -> list[Sequence]:
        """Parallel samples (n > 1): once the first sample has prefilled the prompt
        and is about to sample its first token, its siblings start from it, sharing
        every block (copy-on-write). Returns the siblings, which sample now too."""
        req = parent.request
        if (parent.index != 0 or parent.num_output_tokens or len(req.sequences) == 1
                or req.beams is not None):
            return []
        children = req.sequences[1:]
        for child in children:
            self.bm.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        return children

    def resume(self, seq: Sequence) -> None:
        """A beam the search extended: queued again if it was preempted while waiting
        for its siblings (``preempt``)."""
        if seq.status is SequenceStatus.WAITING and seq not in self.waiting:
            self._requeue(seq)

    def fork_beam(self, parent: Sequence, child: Sequence) -> None:
        """Beam search chose ``parent`` twice: ``child`` shares its blocks (copy-on-write,
        so only a partial last block is ever copied). A parent preempted meanwhile has
        no blocks on the device: the child is prefilled like it."""
        if parent.status is SequenceStatus.RUNNING:
            self.bm.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            self._requeue(child)

    def _has_lora_slot(self, seq: Sequence) -> bool:
        """Multi-LoRA: at most ``max_loras`` distinct adapters run at once (a step
        applies each from a slot of its own); a request for an adapter that is already
        running, or for the base model, always has one."""
        lora = seq.request.lora
        if lora is None or not self.running:
            return True
        return (self.running.runs_adapter(lora.lora_int_id)
                or self.running.num_adapters < self.config.max_loras)

    def _has_seq_slots(self, seq: Sequence, step: Step) -> bool:
        """Room under max_num_seqs for ``seq`` and, if it is an unforked first
        sample, for the siblings that will fork from it. A request with more
        samples than the cap still runs when nothing else does."""
        return step.seq_slots + seq_slots(seq) <= self.config.max_num_seqs or not self.running

    def _preempt_for(self, seq: Sequence, step: Step) -> bool:
        """Make room for the candidate ``seq``: a beam that is only waiting for its
        siblings goes first (under any policy; ``Victims.parked_beam``). Then, if the
        policy lets ``seq`` preempt it, the least urgent unscheduled running
        sequence. True if one was."""
        parked = step.victims.parked_beam(seq)
        if parked is not None:
            self.preempt(parked, step)
            return True
        victim = step.victims.least_urgent_unscheduled()
        if victim is None or not self.policy.may_preempt(seq, victim):
            return False
        self.preempt(victim, step)
        return True

    # --- preemption and finishing ------------------------------------------------
    def preempt(self, seq: Sequence, step: Step) -> None:
        """Swap ``seq`` to CPU, or drop its KV cache for recompute (also the
        fallback when the swap space is full). Recomputed sequences keep their
        tokens, and the freed blocks keep their prefix-cache keys, so the
        re-prefill mostly hits the cache and the output does not change."""
        assert seq.seq_id not in step.scheduled, "a step never undoes its own decisions"
        self.running.remove(seq)
        seq.spec_token_ids = []
        step.preempted(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        if seq.num_uncomputed_tokens == 0:
            # A beam waiting for its siblings: its next tokens are offered, so it has
            # nothing to run until the search picks them. It leaves the device and
            # every queue until ``resume`` (queued now, it would only be admitted to
            # idle, keeping its siblings out).
            self.bm.free(seq)
            seq.reset_for_recompute()
            seq.status = SequenceStatus.WAITING
            return
        if self.config.preemption_mode == "swap" and self.bm.can_swap_out(seq):
            self.bm.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.num_swapped_out += 1
            self.swapped.add(seq)
            return
        self.bm.free(seq)
        seq.reset_for_recompute()
        self._requeue(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Leave the batch now and give back the blocks at once."""
        self.batching.finished(seq)
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        if seq.status is SequenceStatus.SWAPPED:
            self.bm.free_swapped(seq)
        seq.status = status
        self.bm.free(seq)
        if seq.request.finished:
            self.shares.leave(seq.request)
