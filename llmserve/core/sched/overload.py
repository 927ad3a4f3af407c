"""Overload control: a bounded waiting queue and a bounded queueing delay.

Without them an engine under more load than it can serve queues without limit:
every request's time to first token grows until clients time out, while the
engine keeps spending its steps on requests nobody waits for any more. With
``max_waiting`` a new request is refused at once while that many requests wait
unscheduled; with ``max_queue_delay`` a request that has not been scheduled within
that many seconds leaves the queue. Both are answered HTTP 503 with
``{"error": {"type": "server_overloaded"}}`` and ``Retry-After``, which the gateway
retries on another engine without ejecting this one.

Only requests that never ran are refused or expired: a request preempted for
recompute is back in the waiting queue but has already streamed tokens.
"""

from __future__ import annotations

import math

from llmserve.core.request import Request
from llmserve.core.sched.request_queue import RequestQueue


class OverloadedError(RuntimeError):
    """The engine refused or dropped a request that had not started (HTTP 503)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))


def waiting_requests(waiting: RequestQueue) -> list[Request]:
    """Distinct requests in the scheduler's waiting queue that never ran, in no
    particular order (counted on every engine step: the queue is not sorted for it)."""
    return list({seq.request.request_id: seq.request for seq in waiting.members
                 if seq.request.first_scheduled_time is None}.values())


def queue_full(n: int, max_waiting: int, max_queue_delay: float | None) -> OverloadedError:
    return OverloadedError(
        f"the engine is overloaded: {n} requests are already waiting "
        f"(max_waiting={max_waiting}); retry later or elsewhere",
        retry_after=max_queue_delay or 1.0)


def check_admission(max_waiting: int | None, max_queue_delay: float | None,
                    waiting: RequestQueue, free_slots: int = 0) -> None:
    """Raise OverloadedError when one more request would leave more than
    ``max_waiting`` waiting once the next step has filled the ``free_slots`` sequence
    slots (a burst into an idle engine is not refused for want of a queue it does
    not need)."""
    if max_waiting is None:
        return
    n = len(waiting_requests(waiting))
    if n >= max_waiting + free_slots:
        raise queue_full(n, max_waiting, max_queue_delay)


def expired(max_queue_delay: float | None, waiting: RequestQueue, now: float) -> list[Request]:
    """Requests that have waited unscheduled longer than ``max_queue_delay``, in the
    queue's order (only they are sorted)."""
    if max_queue_delay is None:
        return []
    late = [seq for seq in waiting.members if seq.request.first_scheduled_time is None
            and now - seq.request.arrival_time > max_queue_delay]
    late.sort(key=waiting.key)
    return list({seq.request.request_id: seq.request for seq in late}.values())
