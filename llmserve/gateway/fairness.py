"""The gateway's admission queue: per-class queues, fair shares within a class, and
dispatch only while an engine has room.

Between classes: strict priority (lower number first), except that a backlogged
class whose share of recent dispatches is below its ``minShare`` goes first, so
batch work is never starved outright.

Within a class: weighted fair sharing by tokens served, by the same virtual token
counters as the engine's waiting queue (``core/sched/fair_share.py`` holds the rule:
the backlogged tenant with the smallest counter goes next). A request is charged its
estimate (prompt + max_tokens) when dispatched and corrected to its real usage when
it ends. A tenant that comes back from idle has its counter lifted to the smallest
counter among the backlogged tenants (or to the last one served), so idling banks
no credit. Idle means nothing queued and nothing in flight: a client that sends its
next request as soon as the last one ends is not idle in between (lifting it then
would take away the share its weight gives it).

A full class queue sheds the newest request of the least urgent class first, then
of the tenant with the most queued requests in the class; a request waiting past
its class's ``queueTimeoutSeconds`` is answered 503, and one whose client went away
simply leaves its queue.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from llmserve.core.sched.fair_share import VirtualTokenCounters
from llmserve.errors import APIError
from llmserve.gateway.tenants import TrafficClass

RECENT_DISPATCHES = 200  # the window over which class shares are measured


@dataclass(eq=False)
class Waiter:
    tenant: str
    weight: float
    cls: TrafficClass
    cost: float  # estimated tokens, charged at dispatch
    enqueued: float = field(default_factory=time.monotonic)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                   .create_future())
    charged: float = 0.0


def overloaded(message: str, retry_after: float) -> APIError:
    retry_after = max(1.0, retry_after)
    return APIError(503, message, "server_overloaded", code="server_overloaded",
                    headers={"Retry-After": str(math.ceil(retry_after)),
                             "retry-after-ms": str(math.ceil(retry_after * 1000))})


class ClassQueue:
    """One class's waiting requests, per tenant, with the tenants' virtual counters."""

    def __init__(self, cls: TrafficClass):
        self.cls = cls
        self.queues: dict[str, deque[Waiter]] = {}  # backlogged tenants only
        self.vtc = VirtualTokenCounters()  # charged an estimate at dispatch, then corrected
        self.in_flight: dict[str, int] = {}  # dispatched, not yet finished
        self.size = 0

    @property
    def counters(self) -> dict[str, float]:
        return self.vtc.counters

    def push(self, w: Waiter) -> None:
        if w.tenant not in self.queues and not self.in_flight.get(w.tenant):
            self.vtc.catch_up(w.tenant, busy=self.queues)  # back from idle
        self.queues.setdefault(w.tenant, deque()).append(w)
        self.size += 1

    def remove(self, w: Waiter) -> bool:
        q = self.queues.get(w.tenant)
        if q is None or w not in q:
            return False
        q.remove(w)
        self._drop_if_empty(w.tenant)
        self.size -= 1
        return True

    def _drop_if_empty(self, tenant: str) -> None:
        if not self.queues[tenant]:
            del self.queues[tenant]

    def pop_fairest(self) -> Waiter:
        heads = sorted((q[0] for q in self.queues.values()), key=lambda head: head.enqueued)
        tenant = self.vtc.fairest(heads, lambda head: head.tenant).tenant
        w = self.queues[tenant].popleft()
        self._drop_if_empty(tenant)
        self.size -= 1
        self.vtc.served(tenant)  # before the charge: its virtual time at dispatch
        self.charge(w, w.cost)
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        return w

    def finished(self, w: Waiter, used_tokens: float) -> None:
        """A dispatched request ended: charge what it used instead of the estimate."""
        self.charge(w, used_tokens - w.charged)
        left = self.in_flight.get(w.tenant, 1) - 1
        if left > 0:
            self.in_flight[w.tenant] = left
        else:
            self.in_flight.pop(w.tenant, None)

    def charge(self, w: Waiter, tokens: float) -> None:
        """Add ``tokens`` (negative to correct an estimate) to ``w``'s tenant."""
        w.charged += tokens
        self.vtc.charge(w.tenant, tokens, w.weight)

    def newest_of(self, tenant: str) -> Waiter:
        return self.queues[tenant][-1]


class FairQueue:
    def __init__(self, classes: list[TrafficClass], free_slots: Callable[[int], float]):
        self.free_slots = free_slots  # engines' room for a class of this priority now
        self.queues: dict[str, ClassQueue] = {}
        # Dispatched, not yet counted in the engines' in-flight, per class priority.
        self.reserved: dict[int, int] = {}
        self.recent: deque[str] = deque(maxlen=RECENT_DISPATCHES)
        self.dispatch_times: deque[float] = deque(maxlen=RECENT_DISPATCHES)
        self.update_classes(classes)

    def update_classes(self, classes: list[TrafficClass]) -> None:
        """A reloaded tenants file: keep the queues of classes that remain."""
        new = {}
        for c in classes:
            q = self.queues.get(c.name) or ClassQueue(c)
            q.cls = c
            new[c.name] = q
        for name, q in self.queues.items():
            if name not in new:  # a removed class: its waiters are told to come back
                for tq in list(q.queues.values()):
                    for w in list(tq):
                        self._fail(q, w, overloaded(f"class {name!r} was removed", 1))
        self.queues = new

    @property
    def size(self) -> int:
        return sum(q.size for q in self.queues.values())

    def by_urgency(self) -> list[ClassQueue]:
        return sorted(self.queues.values(), key=lambda q: q.cls.priority)

    # --- admission -----------------------------------------------------------------
    def submit(self, w: Waiter) -> None:
        """Queue ``w`` (shedding another request if its queue is full) or raise 503."""
        q = self.queues[w.cls.name]
        if q.size >= q.cls.max_queued:
            victim = self._victim_for(w)
            if victim is None:
                raise overloaded(f"the {w.cls.name!r} queue is full "
                                 f"({q.cls.max_queued} requests)", self.expected_wait(q))
            vq = self.queues[victim.cls.name]
            self._fail(vq, victim, overloaded(
                f"shed from the full {w.cls.name!r} queue for more urgent or fairer work",
                self.expected_wait(vq)))
        q.push(w)
        try:
            self.dispatch()
        except Exception:
            q.remove(w)  # never leave a waiter nobody waits for
            raise

    def _victim_for(self, w: Waiter) -> Waiter | None:
        """Less urgent classes are shed first; then the tenant queueing the most."""
        for q in reversed(self.by_urgency()):
            if q.cls.priority <= w.cls.priority:
                break
            if q.size:
                return q.newest_of(max(q.queues, key=lambda t: len(q.queues[t])))
        q = self.queues[w.cls.name]
        heaviest = max(q.queues, key=lambda t: len(q.queues[t]), default=None)
        mine = len(q.queues.get(w.tenant, ()))
        if heaviest is not None and heaviest != w.tenant and len(q.queues[heaviest]) > mine + 1:
            return q.newest_of(heaviest)
        return None

    async def wait(self, w: Waiter) -> None:
        """Until ``w`` is dispatched; 503 after its class's queue timeout. A cancelled
        wait (the client went away) leaves the queue."""
        q = self.queues[w.cls.name]
        try:
            await asyncio.wait_for(asyncio.shield(w.future), w.cls.queue_timeout_s)
        except asyncio.TimeoutError:
            if q.remove(w):
                raise overloaded(f"waited {w.cls.queue_timeout_s:g} s in the {w.cls.name!r} "
                                 f"queue without an engine free", self.expected_wait(q)
                                 ) from None
            await w.future  # dispatched at the last moment
        except asyncio.CancelledError:
            if not q.remove(w) and w.future.done() and not w.future.exception():
                self.started(w)  # dispatched but never forwarded: give the slot back
                q.finished(w, 0)
                self.dispatch()
            raise

    def _fail(self, q: ClassQueue, w: Waiter, error: APIError) -> None:
        if q.remove(w) and not w.future.done():
            w.future.set_exception(error)

    def expected_wait(self, q: ClassQueue) -> float:
        """Seconds until a request at the back of ``q`` would be dispatched, from the
        recent dispatch rate (its timeout when nothing was dispatched lately)."""
        times = self.dispatch_times
        if len(times) < 2 or times[-1] <= times[0]:
            return q.cls.queue_timeout_s
        rate = (len(times) - 1) / (times[-1] - times[0])
        ahead = sum(o.size for o in self.queues.values() if o.cls.priority <= q.cls.priority)
        return min(q.cls.queue_timeout_s, ahead / rate)

    # --- dispatch ------------------------------------------------------------------
    def started(self, w: Waiter) -> None:
        """A dispatched request is now counted by the engines (or gave up its turn)."""
        self.reserved[w.cls.priority] = max(0, self.reserved.get(w.cls.priority, 0) - 1)

    def room(self, priority: int) -> float:
        reserved = sum(n for p, n in self.reserved.items() if p <= priority)
        return self.free_slots(priority) - reserved

    def dispatch(self) -> None:
        """Hand out as many turns as the engines have room for."""
        while True:
            q = self._next_class()
            if q is None:
                return
            w = q.pop_fairest()
            self.reserved[w.cls.priority] = self.reserved.get(w.cls.priority, 0) + 1
            self.recent.append(q.cls.name)
            self.dispatch_times.append(time.monotonic())
            w.future.set_result(None)

    def _next_class(self) -> ClassQueue | None:
        """The class to dispatch from: a backlogged one below its minShare, else the
        most urgent backlogged one; only classes the engines have room for."""
        backlogged = [q for q in self.by_urgency() if q.size and self.room(q.cls.priority) > 0]
        if not backlogged:
            return None
        n = max(len(self.recent), 1)
        for q in backlogged[1:]:
            if q.cls.min_share and self.recent.count(q.cls.name) / n < q.cls.min_share:
                return q
        return backlogged[0]

    def finished(self, w: Waiter, used_tokens: int) -> None:
        """A request that was dispatched ended, having used ``used_tokens``."""
        q = self.queues.get(w.cls.name)
        if q is not None:
            q.finished(w, used_tokens)
