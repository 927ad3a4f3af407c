"""Scheduling policies: what makes one sequence more urgent than another, and what
that urgency may overrule (``scheduling_policy``).

- ``fcfs``: oldest first. Running sequences go before swapped-out ones, which go
  before waiting ones; nothing waiting comes in while something is swapped out, and
  no candidate preempts a running sequence.
- ``priority``: smallest priority number first, then oldest. Running, swapped and
  waiting sequences merge by urgency, so urgent work is placed before less urgent
  work, and a candidate may preempt running sequences of a strictly less urgent
  priority (interactive work does not wait for a batch of batch work to finish).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from llmserve.core.sched.request_queue import (
    FCFSQueue,
    PriorityQueue,
    RequestQueue,
    UrgencyQueue,
    fcfs_key,
    priority_key,
)

if TYPE_CHECKING:  # typing only: importing core.request would load torch
    from llmserve.core.request import Sequence


class SchedulingPolicy(ABC):
    """The order of the queues, and what a more urgent candidate may do."""

    name: str
    # Whether a queued candidate more urgent than the next running sequence is placed
    # before it (else every running sequence is placed first).
    merges_by_urgency: bool

    @staticmethod
    @abstractmethod
    def urgency(seq: Sequence) -> tuple:
        """Sort key: smaller is more urgent."""

    @abstractmethod
    def new_queue(self) -> UrgencyQueue:
        """An empty queue in this policy's order."""

    @abstractmethod
    def tier(self, seq: Sequence) -> object:
        """The class of urgency within which fair share orders tenants."""

    @abstractmethod
    def next_queued(self, swapped: RequestQueue, waiting: RequestQueue,
                    skip: set[int]) -> Sequence | None:
        """The swapped or waiting sequence to try next (``skip``: seq ids passed over
        in this step), or None."""

    @abstractmethod
    def may_preempt(self, candidate: Sequence, victim: Sequence) -> bool:
        """Whether the queued ``candidate`` may take running ``victim``'s place."""

    @abstractmethod
    def admits_after_preemption(self, candidate: Sequence, most_urgent_victim: int) -> bool:
        """Whether ``candidate`` is admitted in a step that preempted (the most urgent
        of its victims has priority ``most_urgent_victim``)."""


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"
    merges_by_urgency = False
    urgency = staticmethod(fcfs_key)

    def new_queue(self) -> UrgencyQueue:
        return FCFSQueue()

    def tier(self, seq: Sequence) -> object:
        return None  # one class: tenants are ordered among all waiting sequences

    def next_queued(self, swapped: RequestQueue, waiting: RequestQueue,
                    skip: set[int]) -> Sequence | None:
        # Swapped ones in order, and nothing waiting while one is out, even when the
        # swapped head waits for an adapter slot.
        if swapped:
            head = swapped.head()
            return None if head.seq_id in skip else head
        return waiting.head(skip)

    def may_preempt(self, candidate: Sequence, victim: Sequence) -> bool:
        return False

    def admits_after_preemption(self, candidate: Sequence, most_urgent_victim: int) -> bool:
        return False  # as vLLM: the room a preemption made goes to those that needed it


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    merges_by_urgency = True
    urgency = staticmethod(priority_key)

    def new_queue(self) -> UrgencyQueue:
        return PriorityQueue()

    def tier(self, seq: Sequence) -> object:
        return seq.priority

    def next_queued(self, swapped: RequestQueue, waiting: RequestQueue,
                    skip: set[int]) -> Sequence | None:
        heads = [s for s in (swapped.head(skip), waiting.head(skip)) if s is not None]
        return min(heads, key=priority_key, default=None)

    def may_preempt(self, candidate: Sequence, victim: Sequence) -> bool:
        return victim.priority > candidate.priority

    def admits_after_preemption(self, candidate: Sequence, most_urgent_victim: int) -> bool:
        # A candidate more urgent than every victim still comes in: that is what
        # priority is for.
        return candidate.priority < most_urgent_victim


POLICIES: dict[str, type[SchedulingPolicy]] = {p.name: p for p in (FCFSPolicy, PriorityPolicy)}
