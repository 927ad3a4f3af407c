"""The scheduler's request queues: sequences waiting (or swapped out) for the batch.

Every queue has the same interface (``RequestQueue``): ``add`` and ``remove`` in
O(log n), membership, ``len`` and what it holds (``tally``: requests, prompt tokens,
adapters) in O(1), ``head(skip)`` (the most urgent sequence
not in ``skip``, O(1) when nothing is skipped) and iteration most urgent first. The
order is a key each queue is built with, smallest first; two sequences never tie,
since every key ends with the sequence id.

- ``FCFSQueue``: by arrival (a sequence preempted for recompute keeps its place).
- ``PriorityQueue``: by priority number, then arrival.
- ``TenantFairQueue``: either order across tenants, except that the head is chosen
  among each tenant's first sequence of the head's priority by fair share
  (``fair_share.py``): the tenant served least goes next.

The two ordered queues are binary heaps with lazy deletion: ``remove`` forgets the
entry, which stays in the heap until it reaches the top or the heap is rebuilt (once
dead entries outnumber live ones, so the heap stays within twice the queue).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING

from llmserve.core.sched.tally import SequenceTally

if TYPE_CHECKING:  # typing only: importing core.request would load torch
    from llmserve.core.request import Sequence
    from llmserve.core.sched.fair_share import TenantShares

Key = Callable[["Sequence"], tuple]
_NO_SKIP: frozenset[int] = frozenset()


def fcfs_key(seq: Sequence) -> tuple:
    return (seq.arrival_time, seq.seq_id)


def priority_key(seq: Sequence) -> tuple:
    return (seq.priority, seq.arrival_time, seq.seq_id)


class RequestQueue(ABC):
    """Sequences in urgency order. ``skip``: seq ids the caller passes over."""

    key: Key  # the order: smallest first

    @abstractmethod
    def add(self, seq: Sequence) -> None: ...

    @abstractmethod
    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out (KeyError if it is not queued)."""

    @abstractmethod
    def head(self, skip: set[int] | frozenset[int] = _NO_SKIP) -> Sequence | None:
        """The sequence to serve next, of those not in ``skip`` (None if none is)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Sequence]:
        """Most urgent first (sorted once per change of the queue); the queue may
        change while this runs."""

    @property
    @abstractmethod
    def members(self) -> Collection[Sequence]:
        """Every queued sequence in no particular order, without sorting them (for
        counting: the overload checks run every step)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, seq: object) -> bool: ...

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RequestQueue, list)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # mutable, compared by contents

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class UrgencyQueue(RequestQueue):
    """A binary heap of ``(key(seq), seq)`` entries, smallest key first (``key``: a
    subclass's order)."""

    def __init__(self):
        self._heap: list[tuple[tuple, Sequence]] = []
        self._live: dict[Sequence, tuple[tuple, Sequence]] = {}  # seq -> its heap entry
        self._order: list[Sequence] | None = None  # the iteration order, until a change
        self.tally = SequenceTally()

    def add(self, seq: Sequence) -> None:
        if seq in self._live:
            raise ValueError(f"{seq} is already queued")
        entry = (self.key(seq), seq)
        self._live[seq] = entry
        heapq.heappush(self._heap, entry)
        self._order = None
        self.tally.add(seq)

    def remove(self, seq: Sequence) -> None:
        del self._live[seq]
        self._order = None
        self.tally.remove(seq)
        if len(self._heap) > 2 * len(self._live) + 16:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def head(self, skip: set[int] | frozenset[int] = _NO_SKIP) -> Sequence | None:
        heap = self._heap
        while heap and self._live.get(heap[0][1]) is not heap[0]:
            heapq.heappop(heap)  # removed earlier: dropped once it surfaces
        if not heap:
            return None
        if heap[0][1].seq_id not in skip:
            return heap[0][1]
        return next((s for s in self._in_heap_order() if s.seq_id not in skip), None)

    def _in_heap_order(self) -> Iterator[Sequence]:
        """The live entries smallest first, reading the heap without changing it:
        a frontier of heap positions, each popped entry adding its two children, so
        the first k cost O(k log k) (``head`` with a few skipped)."""
        heap, live = self._heap, self._live
        frontier = [(heap[0][0], 0)] if heap else []
        while frontier:
            _, i = heapq.heappop(frontier)
            entry = heap[i]
            if live.get(entry[1]) is entry:
                yield entry[1]
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child][0], child))

    def __iter__(self) -> Iterator[Sequence]:
        if self._order is None:
            self._order = [seq for _, seq in sorted(self._live.values())]
        return iter(self._order)

    @property
    def members(self) -> Collection[Sequence]:
        return self._live.keys()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, seq: object) -> bool:
        return seq in self._live


class FCFSQueue(UrgencyQueue):
    """Oldest first."""

    key = staticmethod(fcfs_key)


class PriorityQueue(UrgencyQueue):
    """Smallest priority number first, then oldest."""

    key = staticmethod(priority_key)


class TenantFairQueue(RequestQueue):
    """One ordered queue of everything (``make_queue()``) and one per tenant.

    Its head, while more than one tenant has unfinished requests (``shares``): of
    each tenant's most urgent sequence, those of the same ``tier`` (the priority,
    under the priority policy) as the most urgent of all, taken most urgent first
    and at most one per tenant with unfinished requests, the one whose tenant has
    been served least (``TenantShares.fairest``; the most urgent on a tie)."""

    def __init__(self, make_queue: Callable[[], UrgencyQueue], shares: TenantShares,
                 tier: Callable[[Sequence], object]):
        self._make_queue = make_queue
        self._all = make_queue()
        self.key = self._all.key
        self._tenants: dict[str, UrgencyQueue] = {}
        self.shares = shares
        self.tier = tier

    def add(self, seq: Sequence) -> None:
        self._all.add(seq)
        tenant = seq.request.tenant
        queue = self._tenants.get(tenant)
        if queue is None:
            queue = self._tenants[tenant] = self._make_queue()
        queue.add(seq)

    def remove(self, seq: Sequence) -> None:
        self._all.remove(seq)
        tenant = seq.request.tenant
        queue = self._tenants[tenant]
        queue.remove(seq)
        if not queue:
            del self._tenants[tenant]

    def head(self, skip: set[int] | frozenset[int] = _NO_SKIP) -> Sequence | None:
        first = self._all.head(skip)
        if first is None or not self.shares.contended:
            return first
        tier = self.tier(first)
        heads = [h for h in (q.head(skip) for q in self._tenants.values())
                 if h is not None and self.tier(h) == tier]
        heads.sort(key=self.key)
        return self.shares.fairest(heads[:len(self.shares.active)])

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._all)

    @property
    def members(self) -> Collection[Sequence]:
        return self._all.members

    @property
    def tally(self) -> SequenceTally:
        return self._all.tally

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, seq: object) -> bool:
        return seq in self._all
