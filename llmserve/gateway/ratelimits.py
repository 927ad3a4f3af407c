"""Per-tenant rate limits over a sliding minute: requests (rpm), tokens (tpm) and
concurrency, with exact retry times.

Each admitted request is recorded with its time; a limit holds when what was
admitted in the last 60 seconds plus the new request fits this replica's quota, so
the time until a rejected request would fit is known exactly: when enough old
entries leave the window. Tokens are charged at admission with an estimate
(prompt + max_tokens) and corrected from the real usage when the request ends.

Several gateway replicas share one limit: ``quota_share`` (from ``peers.py``) is
this replica's part of it, so the parts of all replicas add up to the limit.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from llmserve.errors import APIError
from llmserve.gateway.tenants import Tenant

WINDOW_S = 60.0


class Window:
    """Amounts recorded in the last WINDOW_S seconds."""

    def __init__(self, span: float = WINDOW_S):
        self.span = span
        self.entries: deque[list] = deque()  # [time, amount], oldest first
        self._total = 0.0

    def _expire(self, now: float) -> None:
        while self.entries and self.entries[0][0] <= now - self.span:
            self._total -= self.entries.popleft()[1]

    def total(self, now: float) -> float:
        self._expire(now)
        return max(self._total, 0.0)

    def add(self, now: float, amount: float) -> list:
        entry = [now, amount]
        self.entries.append(entry)
        self._total += amount
        return entry

    def correct(self, entry: list, amount: float, now: float) -> None:
        """Change a recorded amount (still in the window or not)."""
        if entry[0] > now - self.span:
            self._total += amount - entry[1]
        entry[1] = amount

    def wait_for_room(self, now: float, amount: float, quota: float) -> float:
        """Seconds until ``amount`` more fits under ``quota`` (0 if it does now)."""
        total = self.total(now)
        if total + amount <= quota:
            return 0.0
        for t, a in self.entries:
            total -= a
            if total + amount <= quota:
                return t + self.span - now
        return self.span  # only once everything has left (quota < amount is refused)


@dataclass
class TenantUsage:
    requests: Window = field(default_factory=Window)
    tokens: Window = field(default_factory=Window)
    # Demand (admitted and refused), which sets each replica's share of a limit.
    demand_requests: Window = field(default_factory=Window)
    demand_tokens: Window = field(default_factory=Window)
    in_flight: int = 0


@dataclass
class Admission:
    """An admitted request's charge, corrected or released when it ends."""
    tenant: str
    request_entry: list
    token_entry: list
    headers: dict[str, str]


def duration(seconds: float) -> str:
    """OpenAI's reset format: 1s, 6m0s, 0.5s."""
    if seconds < 60:
        return f"{seconds:.3g}s"
    return f"{int(seconds // 60)}m{seconds % 60:.0f}s"


class RateLimiter:
    def __init__(self):
        self.usage: dict[str, TenantUsage] = {}
        # tenant -> (requests share, tokens share) of each limit this replica may use
        self.quota_share = lambda tenant, kind: 1.0
        # How soon a zero share may change (peers publish demand every interval).
        self.share_refresh_s = WINDOW_S

    def of(self, tenant: str) -> TenantUsage:
        return self.usage.setdefault(tenant, TenantUsage())

    def _quota(self, tenant: str, kind: str, limit: int) -> float:
        return limit * self.quota_share(tenant, kind)

    def admit(self, tenant: Tenant, est_tokens: int, now: float | None = None) -> Admission:
        """Charge one request of ``est_tokens`` to ``tenant`` or raise a 429 with the
        exact time after which it would be admitted."""
        now = time.monotonic() if now is None else now
        u, lim = self.of(tenant.name), tenant.limits
        u.demand_requests.add(now, 1)
        u.demand_tokens.add(now, est_tokens)
        if lim.tpm is not None and est_tokens > lim.tpm:
            raise APIError(400, f"this request may use {est_tokens} tokens (prompt estimate "
                           f"+ max_tokens), more than tenant {tenant.name!r}'s limit of "
                           f"{lim.tpm} tokens per minute; lower max_tokens",
                           param="max_tokens", code="request_too_large")
        headers = self._headers(tenant, now, est_tokens)
        if lim.max_concurrency is not None and u.in_flight >= lim.max_concurrency:
            raise self._too_many(tenant, f"{lim.max_concurrency} concurrent requests", 1.0,
                                 headers)
        waits = []
        for kind, limit, window, asked, what in (
                ("requests", lim.rpm, u.requests, 1, "requests per minute"),
                ("tokens", lim.tpm, u.tokens, est_tokens, "tokens per minute")):
            if limit is None:
                continue
            quota = self._quota(tenant.name, kind, limit)
            wait = (window.wait_for_room(now, asked, quota) if quota >= asked
                    else self.share_refresh_s)  # this replica's share is still too small
            # With peers, this replica's share may grow before its own entries expire.
            waits.append((min(wait, self.share_refresh_s), f"{limit} {what}"))
        wait, what = max(waits, default=(0.0, ""))
        if wait > 0:
            raise self._too_many(tenant, what, wait, headers)
        request_entry = u.requests.add(now, 1)
        token_entry = u.tokens.add(now, est_tokens)
        u.in_flight += 1
        return Admission(tenant.name, request_entry, token_entry,
                         self._headers(tenant, now, 0))

    def release(self, admission: Admission, used_tokens: int | None, served: bool,
                now: float | None = None) -> None:
        """The request ended: free its concurrency slot and charge what it used
        (``None``: keep the estimate). One never served (shed, timed out in the
        queue, client gone) is refunded entirely."""
        u = self.of(admission.tenant)
        now = time.monotonic() if now is None else now
        u.in_flight -= 1
        if not served:
            u.requests.correct(admission.request_entry, 0, now)
            used_tokens = 0
        if used_tokens is not None:
            u.tokens.correct(admission.token_entry, used_tokens, now)

    def _too_many(self, tenant: Tenant, what: str, wait: float, headers: dict) -> APIError:
        wait = max(wait, 0.001)
        return APIError(
            429, f"tenant {tenant.name!r} is over its limit of {what}; retry after "
            f"{wait:.3f} s", "rate_limit_exceeded", code="rate_limit_exceeded",
            headers={**headers, "Retry-After": str(math.ceil(wait)),
                     "retry-after-ms": str(math.ceil(wait * 1000))})

    def _headers(self, tenant: Tenant, now: float, tokens_asked: int) -> dict[str, str]:
        """x-ratelimit-{limit,remaining,reset}-{requests,tokens}, as OpenAI sends them."""
        u, lim, out = self.of(tenant.name), tenant.limits, {}
        for kind, limit, window, asked in (("requests", lim.rpm, u.requests, 1),
                                           ("tokens", lim.tpm, u.tokens, tokens_asked)):
            if limit is None:
                continue
            quota = self._quota(tenant.name, kind, limit)
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(quota - window.total(now))))
            reset = window.wait_for_room(now, max(asked, 1), quota)
            out[f"x-ratelimit-reset-{kind}"] = duration(reset)
        return out

    def counts(self, now: float | None = None) -> dict[str, dict[str, float]]:
        """This replica's window totals per tenant, for its peers."""
        now = time.monotonic() if now is None else now
        return {name: {"requests": u.requests.total(now), "tokens": u.tokens.total(now),
                       "demand_requests": u.demand_requests.total(now),
                       "demand_tokens": u.demand_tokens.total(now)}
                for name, u in self.usage.items()}
