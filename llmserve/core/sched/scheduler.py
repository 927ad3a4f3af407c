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

- ``batching="static"`` (the A/B baseline for continuous batching): a batch of up to
  ``max_num_seqs`` waiting requests is formed when nothing runs, with KV blocks for
  each member's prompt plus ``max_tokens`` known to fit, and nothing else is admitted
  until its last member finishes.
- ``target_itl_ms``: each step's predicted duration (``cost_model.py``, fitted online)
  is kept at or below the target: prefill chunks shrink to the time left after the
  decodes, and decodes that do not fit wait a step, least urgent first. A step always
  holds at least its most urgent piece of work, so nothing starves when even that
  alone exceeds the target.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from llmserve.config import EngineConfig
from llmserve.core.block_manager import BlockManager
from llmserve.core.request import Sequence, SequenceStatus
from llmserve.core.sched.cost_model import StepCostModel
from llmserve.core.sched.fair_share import TenantShares
from llmserve.core.sched.output import ScheduledBatch
from llmserve.utils import cdiv


class _Step:
    """What one schedule() pass has spent so far: tokens and, with a latency target,
    predicted seconds."""

    def __init__(self, budget: int, running: list[Sequence], cost: StepCostModel | None,
                 target_s: float | None):
        self.batch = ScheduledBatch()
        self.budget = budget
        self.scheduled: set[int] = set()  # seq ids in the batch
        # Running decodes not yet placed: a prefill chunk leaves one token for each.
        decodes = [s for s in running if s.num_uncomputed_tokens == 1]
        self.decodes_left = len(decodes)
        self.admitting = True
        # Multi-LoRA: candidates passed over because their adapter has no slot; once
        # one is, every later adapter candidate waits too (base-model ones go on).
        self.lora_blocked: set[int] = set()
        self.cost = cost if target_s is not None and cost is not None and cost.ready else None
        if self.cost is not None:
            # Plan under the target by the model's recent error, so that the steps
            # actually measured stay under it, not only the predictions.
            self.time_left = target_s / self.cost.margin - self.cost.fixed
            # ... of which prefill chunks leave this much for the decodes not yet placed.
            self.decode_reserve = sum(self.decode_cost(s) for s in decodes)

    @property
    def prefill_budget(self) -> int:
        return max(0, self.budget - self.decodes_left)

    def decode_cost(self, seq: Sequence) -> float:
        return self.cost.seq_cost(1, seq.num_tokens)

    def decode_fits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s decode fits the time left (always, with no target or an
        empty batch: the most urgent work always runs)."""
        if self.cost is None:
            return True
        cost = self.decode_cost(seq)
        self.decode_reserve -= cost
        return not self.batch.seqs or cost <= self.time_left

    def chunk_limit(self, num_computed: int) -> int:
        """Most tokens a prefill chunk over ``num_computed`` cached tokens may have."""
        if self.cost is None:
            return self.prefill_budget
        tokens = self.cost.max_tokens_within(self.time_left - self.decode_reserve,
                                             num_computed)
        if tokens == 0 and not self.batch.seqs and self.decode_reserve <= 0:
            tokens = 1  # nothing else runs: make progress even over the target
        return min(self.prefill_budget, tokens)

    def add(self, seq: Sequence, num_new: int) -> None:
        self.batch.add(seq, num_new)
        self.scheduled.add(seq.seq_id)
        self.budget -= num_new
        if self.cost is not None:
            self.time_left -= self.cost.seq_cost(num_new, seq.num_computed_tokens + num_new)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: list[Sequence] = []  # kept sorted by urgency
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # kept sorted by urgency
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.cost_model = StepCostModel()  # fitted by the engine from measured steps
        self.static = config.batching == "static"
        self.static_members: set[int] = set()  # static: the batch's members not yet admitted
        self.shares = TenantShares()  # fair order of tenants among equals in ``waiting``

    # --- queue order ---------------------------------------------------------
    def urgency(self, seq: Sequence) -> tuple:
        """Sort key: smaller is more urgent."""
        if self.config.scheduling_policy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (seq.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.shares.arrive(seq.request)
        bisect.insort(self.waiting, seq, key=self.urgency)

    def waiting_head(self, skip: set[int] | None = None) -> Sequence | None:
        """The next waiting sequence to admit: the most urgent; among those of its
        priority, the one whose tenant has been served least (``fair_share.py``).
        ``skip``: seq ids passed over in this step."""
        queue = [s for s in self.waiting if s.seq_id not in skip] if skip else self.waiting
        if not queue or not self.shares.contended:
            return queue[0] if queue else None
        return self.shares.fairest(self._tenant_heads(queue))

    def _tenant_heads(self, queue: list[Sequence]) -> Iterator[Sequence]:
        """Each tenant's first waiting sequence of the head's priority, in queue order
        (so oldest first); it stops once every tenant with work has been seen."""
        head = queue[0]
        ranked = self.config.scheduling_policy == "priority"
        seen: set[str] = set()
        for seq in queue:
            if ranked and seq.priority != head.priority:
                break
            if seq.request.tenant in seen:
                continue
            seen.add(seq.request.tenant)
            yield seq
            if len(seen) == len(self.shares.active):
                break

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # --- the step ------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        self.running.sort(key=self.urgency)
        target = self.config.target_itl_ms
        step = _Step(self.config.max_num_batched_tokens, self.running, self.cost_model,
                     None if target is None else target / 1000)
        if self.static and not (self.running or self.swapped or self.static_members):
            self._form_static_batch()
        merged = self.config.scheduling_policy == "priority"
        to_run = iter(list(self.running))
        seq = next(to_run, None)
        while True:
            while seq is not None and seq.status is not SequenceStatus.RUNNING:
                seq = next(to_run, None)  # preempted earlier in this step
            candidate = self._next_candidate(step)
            if candidate is not None and (seq is None or (
                    merged and self.urgency(candidate) < self.urgency(seq))):
                if not self._admit(candidate, step):
                    step.admitting = False
            elif seq is not None:
                self._schedule_running(seq, step)
                seq = next(to_run, None)
            else:
                break
        step.batch.block_ops = self.bm.take_ops()
        if self.config.enable_lora:
            step.batch.group_by_adapter()
        for seq, n in zip(step.batch.seqs, step.batch.num_new_tokens):
            self.shares.charge(seq.request, seq.first_time_tokens(n))
        if self.cost_model.ready and step.batch.seqs:
            step.batch.predicted_s = self.cost_model.predict(
                step.batch.num_tokens, step.batch.kv_tokens, len(step.batch.seqs))
        return step.batch

    def _form_static_batch(self) -> None:
        """Static batching: the next batch is the most urgent waiting requests whose
        prompts plus max_tokens fit the free KV blocks together (at least one)."""
        free, slots = self.bm.num_free_blocks, self.config.max_num_seqs
        for seq in self.waiting:
            n = seq.params.n
            need = n * cdiv(seq.num_tokens + seq.params.max_tokens, self.bm.block_size)
            if self.static_members and (need > free or n > slots):
                break
            self.static_members.add(seq.seq_id)
            free, slots = free - need, slots - n

    def _next_candidate(self, step: _Step) -> Sequence | None:
        """The swapped or waiting sequence to try next, or None."""
        if not step.admitting:
            return None
        if self.static:  # members only, in urgency order
            return next((s for s in self.swapped + self.waiting
                         if s.seq_id in self.static_members
                         or s.status is SequenceStatus.SWAPPED), None)
        waiting = self.waiting_head(step.lora_blocked)
        swapped = next((s for s in self.swapped if s.seq_id not in step.lora_blocked), None)
        if self.config.scheduling_policy == "fcfs":
            # Nothing waiting comes in while something is swapped out (fcfs), even when
            # the swapped head waits for an adapter slot.
            head = (swapped if self.swapped and swapped is self.swapped[0]
                    else None if self.swapped else waiting)
        else:
            heads = [s for s in (swapped, waiting) if s]
            head = min(heads, key=self.urgency) if heads else None
        if head is None or not self._may_admit_after_preemption(head, step):
            return None
        return head

    def _may_admit_after_preemption(self, seq: Sequence, step: _Step) -> bool:
        """As vLLM: a step that preempted admits nothing, so the room it made goes to
        the sequences that needed it. Under ``priority``, a candidate more urgent than
        every victim of the step may still come in (that is what priority is for)."""
        victims = step.batch.preempted
        if not victims:
            return True
        if self.config.scheduling_policy != "priority":
            return False
        return seq.priority < min(v.priority for v in victims)

    def _schedule_running(self, seq: Sequence, step: _Step) -> None:
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

    def _fit_draft(self, seq: Sequence, step: _Step) -> int:
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

    def _make_room(self, seq: Sequence, num_new: int, step: _Step) -> bool:
        """Preempt the least urgent unscheduled running sequences until ``seq`` can
        grow by ``num_new`` tokens. False if ``seq`` itself had to go."""
        while not self.bm.can_allocate(
                self.bm.blocks_needed(seq, seq.num_computed_tokens + num_new), False):
            # A beam idle until its siblings offer goes before anything that has work
            # (else a sibling's chunked re-prefill could preempt itself for ever).
            victim = self._parked_beam(seq, step) or self._least_urgent_unscheduled(step)
            self.preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _least_urgent_unscheduled(self, step: _Step) -> Sequence | None:
        return max((s for s in self.running if s.seq_id not in step.scheduled),
                   key=self.urgency, default=None)

    def _admit(self, seq: Sequence, step: _Step) -> bool:
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
                if not self._has_seq_slots(seq) and self._preempt_for(seq, step):
                    continue
                return False
            num_new, need, hits = plan
            # The watermark keeps room for running sequences to grow; with none
            # running it would only stop a request that fits from ever starting.
            # Static batches reserved their blocks when they formed.
            if self.bm.can_allocate(need, use_watermark=bool(self.running) and not self.static):
                break
            if not self._preempt_for(seq, step):
                return False
        seq.spec_token_ids = []  # admitted with its own tokens only
        if swapped:
            self.swapped.remove(seq)
            self.bm.swap_in(seq)
        else:
            self.waiting.remove(seq)
            self.static_members.discard(seq.seq_id)
            self.bm.take_prefix(seq, hits)  # also counts the lookup for the metrics
        self.bm.allocate(seq, seq.num_computed_tokens + num_new)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        step.add(seq, num_new)
        return True

    def _admission_plan(self, seq: Sequence, step: _Step, swapped: bool):
        """(tokens to compute, blocks to take, prefix hits) for admitting ``seq`` now,
        or None if the sequence cap or the budget does not allow it."""
        bs = self.bm.block_size
        if swapped:
            # Not len(running): unforked first samples hold places for their siblings.
            if not self._has_seq_slots(seq):
                return None
            num_new = min(seq.num_uncomputed_tokens, step.chunk_limit(seq.num_computed_tokens))
            if num_new == 0:
                return None
            table = seq.cpu_block_table  # its blocks come back, then it grows
            grow = max(0, cdiv(seq.num_computed_tokens + num_new, bs) - len(table))
            need = self.bm.num_held(table) + grow
            return num_new, need, []
        if not self._has_seq_slots(seq):
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
            self.add(seq)
            if self.static:  # a member of the batch it was running in
                self.static_members.add(seq.seq_id)

    def fork_beam(self, parent: Sequence, child: Sequence) -> None:
        """Beam search chose ``parent`` twice: ``child`` shares its blocks (copy-on-write,
        so only a partial last block is ever copied). A parent preempted meanwhile has
        no blocks on the device: the child is prefilled like it."""
        if parent.status is SequenceStatus.RUNNING:
            self.bm.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            self.add(child)
            if self.static:
                self.static_members.add(child.seq_id)

    def _has_lora_slot(self, seq: Sequence) -> bool:
        """Multi-LoRA: at most ``max_loras`` distinct adapters run at once (a step
        applies each from a slot of its own); a request for an adapter that is already
        running, or for the base model, always has one."""
        lora = seq.request.lora
        if lora is None or not self.running:
            return True
        running = {s.request.lora.lora_int_id for s in self.running if s.request.lora}
        return lora.lora_int_id in running or len(running) < self.config.max_loras

    def _has_seq_slots(self, seq: Sequence) -> bool:
        """Room under max_num_seqs for ``seq`` and, if it is an unforked first
        sample, for the siblings that will fork from it. A request with more
        samples than the cap still runs when nothing else does."""
        def slots(s: Sequence) -> int:
            unforked = s.index == 0 and s.num_output_tokens == 0
            return s.params.n if unforked else 1  # (n: the beam width in beam search)

        used = sum(slots(s) for s in self.running)
        return used + slots(seq) <= self.config.max_num_seqs or not self.running

    def _parked_beam(self, seq: Sequence, step: _Step) -> Sequence | None:
        """A running beam that has offered its next tokens and waits for its siblings
        (unscheduled in this step): ``seq``'s own first, else any request's. Idle until
        its search moves, it holds blocks others may need: preempting it loses nothing
        (its offer stands), and keeping it could block the queue's head for ever. (A
        sequence whose final token is in flight under async scheduling is idle the
        same way, and ends when that token is read.)"""
        parked = [s for s in self.running if s.num_uncomputed_tokens == 0
                  and s.seq_id not in step.scheduled and s is not seq]
        own = [s for s in parked if s.request is seq.request]
        return (own or parked or [None])[-1]

    def _preempt_for(self, seq: Sequence, step: _Step) -> bool:
        """Make room for the candidate ``seq``: a beam that is only waiting for its
        siblings goes first (under any policy; ``_parked_beam``). Then,
        under the priority policy, the least urgent unscheduled running sequence if
        its priority is strictly less urgent than the candidate's. True if one was."""
        parked = self._parked_beam(seq, step)
        if parked is not None:
            self.preempt(parked, step)
            return True
        if self.config.scheduling_policy != "priority":
            return False
        victim = self._least_urgent_unscheduled(step)
        if victim is None or victim.priority <= seq.priority:
            return False
        self.preempt(victim, step)
        return True

    # --- preemption and finishing ------------------------------------------------
    def preempt(self, seq: Sequence, step: _Step) -> None:
        """Swap ``seq`` to CPU, or drop its KV cache for recompute (also the
        fallback when the swap space is full). Recomputed sequences keep their
        tokens, and the freed blocks keep their prefix-cache keys, so the
        re-prefill mostly hits the cache and the output does not change."""
        assert seq.seq_id not in step.scheduled, "a step never undoes its own decisions"
        self.running.remove(seq)
        seq.spec_token_ids = []
        if seq.num_uncomputed_tokens == 1:
            step.decodes_left -= 1
        self.num_preemptions += 1
        seq.num_preemptions += 1
        step.batch.preempted.append(seq)
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
            bisect.insort(self.swapped, seq, key=self.urgency)
            return
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.add(seq)
        if self.static:  # still a member of the batch it was running in
            self.static_members.add(seq.seq_id)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Leave the batch now and give back the blocks at once."""
        self.static_members.discard(seq.seq_id)  # an aborted member ends its wait too
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
