"""Batching modes (``batching``): which queued sequence may join the running batch.

- ``continuous``: whatever the policy puts next, in any step with room, except after
  a preemption in the step (``SchedulingPolicy.admits_after_preemption``).
- ``static`` (the A/B baseline for continuous batching): a batch of up to
  ``max_num_seqs`` waiting requests is formed when nothing runs, with KV blocks for
  each member's prompt plus ``max_tokens`` known to fit, and nothing else is admitted
  until its last member finishes. A member preempted for recompute (or a beam of one
  queued again) is still a member.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.core.request import Sequence
from llmserve.core.sched.policy import SchedulingPolicy
from llmserve.core.sched.step import Step
from llmserve.utils import cdiv

if TYPE_CHECKING:  # the scheduler holds its batching mode
    from llmserve.core.sched.scheduler import Scheduler


class ContinuousBatching:
    # Whether admitted sequences' blocks were reserved when their batch formed (else
    # the watermark applies while anything runs).
    reserves_blocks = False

    def start_step(self, sched: Scheduler) -> None:
        """Before a schedule() pass places anything."""

    def next_candidate(self, sched: Scheduler, step: Step) -> Sequence | None:
        """The swapped or waiting sequence the pass tries to admit next, or None."""
        head = sched.policy.next_queued(sched.swapped, sched.waiting, step.lora_blocked)
        if head is None or (step.most_urgent_victim is not None and not
                            sched.policy.admits_after_preemption(head,
                                                                 step.most_urgent_victim)):
            return None
        return head

    def admitted(self, seq: Sequence) -> None:
        """``seq`` left the waiting queue for the running batch."""

    def requeued(self, seq: Sequence) -> None:
        """``seq``, queued again, belongs to the batch it ran in: preempted for
        recompute, or a beam of a running request (resumed, or forked from a parent
        preempted meanwhile)."""

    def finished(self, seq: Sequence) -> None:
        """``seq`` ended, wherever it was."""


class StaticBatching(ContinuousBatching):
    reserves_blocks = True

    def __init__(self, policy: SchedulingPolicy):
        # The batch's members not yet admitted, in the policy's order: each is waiting.
        self.members = policy.new_queue()

    def start_step(self, sched: Scheduler) -> None:
        if not (sched.running or sched.swapped or self.members):
            self._form_batch(sched)

    def _form_batch(self, sched: Scheduler) -> None:
        """The next batch: the most urgent waiting requests whose prompts plus
        max_tokens fit the free KV blocks together (at least one)."""
        bm = sched.bm
        free, slots = bm.num_free_blocks, sched.config.max_num_seqs
        for seq in sched.waiting:
            n = seq.params.n
            need = n * cdiv(seq.num_tokens + seq.params.max_tokens, bm.block_size)
            if self.members and (need > free or n > slots):
                break
            self.members.add(seq)
            free, slots = free - need, slots - n

    def next_candidate(self, sched: Scheduler, step: Step) -> Sequence | None:
        # Members only: the swapped-out ones first, then those waiting, in order.
        return sched.swapped.head() if sched.swapped else self.members.head()

    def admitted(self, seq: Sequence) -> None:
        self.finished(seq)

    def requeued(self, seq: Sequence) -> None:
        if seq not in self.members:
            self.members.add(seq)

    def finished(self, seq: Sequence) -> None:
        if seq in self.members:  # an aborted member ends the batch's wait for it too
            self.members.remove(seq)


def batching_for(mode: str, policy: SchedulingPolicy) -> ContinuousBatching:
    return StaticBatching(policy) if mode == "static" else ContinuousBatching()
