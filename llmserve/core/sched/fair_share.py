"""Fair order among tenants in the engine's waiting queue.

Each gateway replica keeps tenants fair in its own queue; the engine, which all
replicas feed, keeps them fair again where their requests meet, so fairness holds
across replicas without a shared store. It uses the same rule as the gateway
(``gateway/fairness.py``): a virtual token counter per tenant, charged every token
the engine computes for it divided by the tenant's weight; among waiting requests
of equal priority, the tenant with the smallest counter goes first (oldest request
first within a tenant). A tenant that arrives with nothing in the engine has its
counter lifted to the smallest counter of the tenants that do, so idling banks no
credit. Requests without a tenant share the tenant "".
"""

from __future__ import annotations

from llmserve.core.request import Request

MAX_METRIC_TENANTS = 1000  # label values beyond this are reported as "other"


class TenantShares:
    def __init__(self):
        self.counters: dict[str, float] = {}
        self.active: dict[str, int] = {}  # tenant -> unfinished requests
        self._requests: set[str] = set()  # request ids counted in ``active``
        self.last_served = 0.0
        self.tokens_served: dict[str, int] = {}  # for llmserve:tenant_tokens_total

    @property
    def contended(self) -> bool:
        return len(self.active) > 1

    def arrive(self, req: Request) -> None:
        if req.request_id in self._requests:
            return  # a recomputed sequence coming back
        self._requests.add(req.request_id)
        t = req.tenant
        if not self.active.get(t):
            others = [self.counters[o] for o in self.active]
            floor = min(others) if others else self.last_served
            self.counters[t] = max(self.counters.get(t, 0.0), floor)
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
        self.counters[t] = self.counters.get(t, 0.0) + tokens / req.tenant_weight
        self.last_served = self.counters[t]
        label = t if t in self.tokens_served or len(self.tokens_served) < MAX_METRIC_TENANTS \
            else "other"
        self.tokens_served[label] = self.tokens_served.get(label, 0) + tokens

    def virtual(self, req: Request) -> float:
        return self.counters.get(req.tenant, 0.0)
