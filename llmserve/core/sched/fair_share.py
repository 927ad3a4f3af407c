"""Weighted fair sharing by tokens served: the rule, and the engine's use of it.

The rule is the Virtual Token Counter of "Fairness in Serving Large Language
Models" (Sheng et al., OSDI'24), written once here (``VirtualTokenCounters``) for
both queues that order tenants: the gateway's admission queue
(``gateway/fairness.py``) and the engine's waiting queue (``TenantShares``). Each
tenant has a counter of the tokens it was served divided by its weight; among
the tenants with a request waiting, the one with the smallest counter goes next
(the oldest request on a tie). A tenant that comes back from idle has its counter
lifted to the smallest counter of the busy tenants (or to the last one served), so
idling banks no credit.

Each gateway replica keeps tenants fair in its own queue; the engine, which all
replicas feed, keeps them fair again where their requests meet, so fairness holds
across replicas without a shared store. The engine charges every token it computes
for a tenant; requests without a tenant share the tenant "".

This module imports nothing that pulls in torch: the gateway, which runs without
it, imports it (``tests/core/test_fair_share.py`` checks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # typing only: importing core.request would load torch
    from llmserve.core.request import Request, Sequence

MAX_METRIC_TENANTS = 1000  # label values beyond this are reported as "other"

T = TypeVar("T")


class VirtualTokenCounters:
    """Each tenant's virtual token counter, and who goes next by them."""

    def __init__(self):
        self.counters: dict[str, float] = {}
        self.last_served = 0.0  # the virtual time of the latest tenant served

    def virtual(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def catch_up(self, tenant: str, busy: Iterable[str]) -> None:
        """``tenant`` comes back from idle: lift its counter to the smallest counter of
        the ``busy`` tenants (the last served when none is), so idling banks no credit."""
        floor = min((self.counters[t] for t in busy), default=self.last_served)
        self.counters[tenant] = max(self.virtual(tenant), floor)

    def charge(self, tenant: str, tokens: float, weight: float) -> None:
        """Add ``tokens`` (negative to correct an estimate) served to ``tenant``."""
        self.counters[tenant] = self.virtual(tenant) + tokens / weight

    def served(self, tenant: str) -> None:
        """``tenant`` was just served: its counter is the floor a returning tenant is
        lifted to while no tenant is busy."""
        self.last_served = self.counters[tenant]

    def fairest(self, heads: Iterable[T], tenant_of: Callable[[T], str]) -> T:
        """Who goes next: of ``heads``, each tenant's oldest request given oldest first,
        the one whose tenant's counter is smallest (the first given on a tie)."""
        return min(heads, key=lambda head: self.virtual(tenant_of(head)))


class TenantShares:
    """The engine's tenants: which have unfinished requests, their counters, and the
    tokens served to each (for ``llmserve:tenant_tokens_total``)."""

    def __init__(self):
        self.vtc = VirtualTokenCounters()
        self.active: dict[str, int] = {}  # tenant -> unfinished requests
        self._requests: set[str] = set()  # request ids counted in ``active``
        self.tokens_served: dict[str, int] = {}

    @property
    def contended(self) -> bool:
        return len(self.active) > 1

    def arrive(self, req: Request) -> None:
        if req.request_id in self._requests:
            return  # a recomputed sequence coming back
        self._requests.add(req.request_id)
        t = req.tenant
        if not self.active.get(t):
            self.vtc.catch_up(t, busy=self.active)
        self.active[t] = self.active.get(t, 0) + 1

    def leave(self, req: Request) -> None:
        if req.request_id not in self._requests:
            return
        self._requests.discard(req.request_id)
        t = req.tenant
        self.active[t] -= 1
        if not self.active[t]:
            del self.active[t]

    def charge(self, req: Request, tokens: int) -> None:
        t = req.tenant
        self.vtc.charge(t, tokens, req.tenant_weight)
        self.vtc.served(t)
        label = t if t in self.tokens_served or len(self.tokens_served) < MAX_METRIC_TENANTS \
            else "other"
        self.tokens_served[label] = self.tokens_served.get(label, 0) + tokens

    def fairest(self, heads: Iterable[Sequence]) -> Sequence:
        """Of ``heads`` (each tenant's first waiting sequence, in queue order), the one
        to admit next."""
        return self.vtc.fairest(heads, lambda seq: seq.request.tenant)
