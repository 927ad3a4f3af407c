"""One schedule() pass's ledger: what it has placed and spent, and whom it may preempt.

Counted once when the pass starts, from the running sequences as it finds them, and
kept as it places, admits and preempts, so that no decision rescans the batch:

- the token budget and, with a latency target, the predicted seconds;
- the sequence slots in use under ``max_num_seqs`` (``seq_slots``: an unforked first
  sample holds places for its siblings; that changes when it samples, outside the
  scheduler, so it is counted anew each pass);
- whom a preemption picks (``Victims``): every victim is a running sequence the pass
  has not scheduled, and admitted ones are scheduled at once, so the candidates are
  the pass's starting order less those scheduled or gone.
"""

from __future__ import annotations

from llmserve.core.request import Sequence
from llmserve.core.sched.cost_model import StepCostModel
from llmserve.core.sched.output import ScheduledBatch


def seq_slots(seq: Sequence) -> int:
    """Places under max_num_seqs ``seq`` takes: with its siblings still to fork from
    it, its n (the beam width in beam search); else one."""
    unforked = seq.index == 0 and seq.num_output_tokens == 0
    return seq.params.n if unforked else 1


class Step:
    """What one schedule() pass has spent so far: tokens, sequence slots and, with a
    latency target, predicted seconds."""

    def __init__(self, budget: int, running: list[Sequence], cost: StepCostModel | None,
                 target_s: float | None):
        self.batch = ScheduledBatch()
        self.budget = budget
        self.scheduled: set[int] = set()  # seq ids in the batch
        self.order = running  # the running sequences, most urgent first, at the start
        self.seq_slots = sum(seq_slots(s) for s in running)
        self.victims = Victims(running, self.scheduled)
        self.most_urgent_victim: int | None = None  # the smallest priority preempted
        # Running decodes not yet placed: a prefill chunk leaves one token for each.
        decodes = [s for s in running if s.num_uncomputed_tokens == 1]
        self.decodes_left = len(decodes)
        self.admitting = True
        self.num_admitted = 0
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
    def candidate_state(self) -> tuple:
        """What the next queued candidate depends on within the pass (each part only
        grows, or turns off): admissions, preemptions, candidates passed over."""
        return (self.admitting, self.num_admitted, len(self.batch.preempted),
                len(self.lora_blocked))

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

    def admitted(self, seq: Sequence, num_new: int) -> None:
        """``seq`` came into the running batch with ``num_new`` tokens to compute."""
        self.seq_slots += seq_slots(seq)
        self.num_admitted += 1
        self.add(seq, num_new)

    def preempted(self, seq: Sequence) -> None:
        """``seq`` left the running batch (before its KV cache is dropped)."""
        if seq.num_uncomputed_tokens == 1:
            self.decodes_left -= 1
        self.seq_slots -= seq_slots(seq)
        self.batch.preempted.append(seq)
        if self.most_urgent_victim is None or seq.priority < self.most_urgent_victim:
            self.most_urgent_victim = seq.priority
        self.victims.gone(seq)


class Victims:
    """Whom a pass preempts first, from its starting order (most urgent first)."""

    def __init__(self, order: list[Sequence], scheduled: set[int]):
        self._order = order
        self._scheduled = scheduled
        self._gone: set[int] = set()  # seq ids preempted in the pass
        self._tail = len(order)  # order[_tail:] are all scheduled or gone
        # Beams that offered their next tokens and wait for their siblings: nothing
        # to compute, so never scheduled in the pass. All of them, and per request.
        self._parked: dict[Sequence, None] = {}
        self._parked_of: dict[int, dict[Sequence, None]] = {}
        for seq in order:
            if seq.num_uncomputed_tokens == 0:
                self._parked[seq] = None
                self._parked_of.setdefault(id(seq.request), {})[seq] = None

    def least_urgent_unscheduled(self) -> Sequence | None:
        """The least urgent running sequence not scheduled in the pass. The order's
        tail only ever loses candidates (a sequence the pass schedules or preempts
        stays so; a preempted one it takes back is scheduled), so a cursor from the
        end finds each in O(1) amortized."""
        while self._tail:
            seq = self._order[self._tail - 1]
            if seq.seq_id not in self._scheduled and seq.seq_id not in self._gone:
                return seq
            self._tail -= 1
        return None

    def parked_beam(self, seq: Sequence) -> Sequence | None:
        """The last (least urgent) parked beam other than ``seq``: of ``seq``'s own
        request if it has one, else of any."""
        own = self._parked_of.get(id(seq.request), {})
        return _last_other(own, seq) or _last_other(self._parked, seq)

    def gone(self, seq: Sequence) -> None:
        self._gone.add(seq.seq_id)
        if seq in self._parked:
            del self._parked[seq]
            del self._parked_of[id(seq.request)][seq]


def _last_other(seqs: dict[Sequence, None], seq: Sequence) -> Sequence | None:
    return next((s for s in reversed(seqs) if s is not seq), None)
