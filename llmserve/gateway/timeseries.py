"""The gateway's recent history for its dashboard: per-second buckets over the last
few minutes of the requests it answered (their latencies, outcomes, tenants) and of
its engines' load as scraped. Pure bookkeeping: the caller passes the time, so it is
tested without sleeping.

Invariants: buckets are keyed by whole seconds (``int(now)``), kept in ascending
order, and a bucket older than ``window_s`` seconds before the latest ``now`` seen
is gone. Each bucket keeps at most ``max_values`` latencies of each kind (a uniform
sample of that second's, by reservoir sampling with a fixed seed), so memory stays
bounded under any load while the percentiles stay unbiased.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], p: float) -> float | None:
    """The nearest-rank ``p``-th percentile (the smallest value at or above p % of
    them); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class TenantTally:
    requests: int = 0
    throttled: int = 0  # answered 429 (its rate limits)
    tokens: int = 0  # prompt + completion, as the engines reported them


@dataclass
class EngineSample:
    """The engines' load at one moment, summed over engines (KV: their mean), with the
    prefix cache's counters' growth since the previous sample."""
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0


@dataclass
class Bucket:
    second: int
    requests: int = 0
    errors: int = 0  # 5xx
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    seen: dict[str, int] = field(default_factory=lambda: {"ttft": 0, "itl": 0})
    tenants: dict[str, TenantTally] = field(default_factory=dict)
    engines: EngineSample | None = None  # the second's last sample
    prefix_hits: float = 0.0  # the second's samples' growth, summed
    prefix_queries: float = 0.0


class SecondBuckets:
    def __init__(self, window_s: int = 300, max_values: int = 1000, seed: int = 0):
        self.window_s = window_s
        self.max_values = max_values
        self.buckets: deque[Bucket] = deque()
        self._random = random.Random(seed)

    # --- recording -----------------------------------------------------------------
    def bucket(self, now: float) -> Bucket:
        """The bucket of ``now``'s second (a late ``now`` lands in the newest)."""
        second = int(now)
        if not self.buckets or self.buckets[-1].second < second:
            self.buckets.append(Bucket(second))
        self.expire(now)
        return self.buckets[-1]

    def expire(self, now: float) -> None:
        oldest = int(now) - self.window_s
        while self.buckets and self.buckets[0].second <= oldest:
            self.buckets.popleft()

    def add_request(self, now: float, status: int, ttft: float | None = None,
                    itl: list[float] = (), tenant: str = "", tokens: int | None = None
                    ) -> None:
        """A request answered at ``now``: its status, its time to first byte and the
        gaps between its streamed chunks (a streamed response's; else None and none),
        and its tenant and tokens (with tenants)."""
        b = self.bucket(now)
        b.requests += 1
        b.errors += status >= 500
        if ttft is not None:
            self._keep(b, "ttft", ttft)
        for gap in itl:
            self._keep(b, "itl", gap)
        if tenant:
            tally = b.tenants.setdefault(tenant, TenantTally())
            tally.requests += 1
            tally.throttled += status == 429
            tally.tokens += tokens or 0

    def _keep(self, b: Bucket, kind: str, value: float) -> None:
        values: list[float] = getattr(b, kind)
        b.seen[kind] += 1
        if len(values) < self.max_values:
            values.append(value)
        else:  # reservoir sampling: each value seen stays with equal probability
            slot = self._random.randrange(b.seen[kind])
            if slot < self.max_values:
                values[slot] = value

    def add_engines(self, now: float, sample: EngineSample) -> None:
        b = self.bucket(now)
        b.engines = sample
        b.prefix_hits += sample.prefix_hits
        b.prefix_queries += sample.prefix_queries

    # --- reading -------------------------------------------------------------------
    def recent(self, now: float, seconds: float) -> list[Bucket]:
        """The buckets of the last ``seconds`` seconds up to ``now`` (its own included)."""
        self.expire(now)
        oldest = int(now) - seconds
        return [b for b in self.buckets if oldest < b.second <= int(now)]

    def summary(self, now: float, seconds: int) -> dict:
        """Totals and percentiles over the last ``seconds``: rates are per second of
        that span (or of the history kept, when it is shorter)."""
        buckets = self.recent(now, seconds)
        span = max(1, min(seconds, int(now) - buckets[0].second + 1)) if buckets else seconds
        requests = sum(b.requests for b in buckets)
        hits = sum(b.prefix_hits for b in buckets)
        queries = sum(b.prefix_queries for b in buckets)
        return {
            "seconds": seconds,
            "requests": requests,
            "requests_per_s": requests / span,
            "errors": sum(b.errors for b in buckets),
            "ttft": percentiles([v for b in buckets for v in b.ttft]),
            "itl": percentiles([v for b in buckets for v in b.itl]),
            "prefix_cache_hit_rate": hits / queries if queries else None,
        }

    def tenants(self, now: float, seconds: int) -> dict[str, TenantTally]:
        """Each tenant's totals over the last ``seconds``."""
        out: dict[str, TenantTally] = {}
        for b in self.recent(now, seconds):
            for name, t in b.tenants.items():
                total = out.setdefault(name, TenantTally())
                total.requests += t.requests
                total.throttled += t.throttled
                total.tokens += t.tokens
        return out

    def series(self, now: float, seconds: int, step: int) -> dict[str, list]:
        """Columns of ``step``-second points over the last ``seconds``, one per step
        that has any bucket, keyed by the step's first second. Rates are per second of
        the step, or of its elapsed part for the step ``now`` is in; latencies are the
        step's percentiles; engine gauges are the step's last sample (None: none)."""
        groups: dict[int, list[Bucket]] = {}
        for b in self.recent(now, seconds):
            groups.setdefault(b.second - b.second % step, []).append(b)
        columns: dict[str, list] = {name: [] for name in SERIES_COLUMNS}
        for start, buckets in groups.items():
            span = min(step, int(now) - start + 1)
            row = series_row(start, buckets, span)
            for name in SERIES_COLUMNS:
                columns[name].append(row[name])
        return columns


SERIES_COLUMNS = ("t", "requests_per_s", "errors_per_s",
                  *(f"{kind}_p{p}" for kind in ("ttft", "itl") for p in PERCENTILES),
                  "running", "waiting", "kv_usage", "prefix_cache_hit_rate")


def percentiles(values: list[float]) -> dict[str, float | None]:
    return {f"p{p}": percentile(values, p) for p in PERCENTILES}


def series_row(start: int, buckets: list[Bucket], span: int) -> dict:
    row: dict = {"t": start,
                 "requests_per_s": sum(b.requests for b in buckets) / span,
                 "errors_per_s": sum(b.errors for b in buckets) / span}
    for kind in ("ttft", "itl"):
        for name, value in percentiles([v for b in buckets for v in getattr(b, kind)]).items():
            row[f"{kind}_{name}"] = value
    last = next((b.engines for b in reversed(buckets) if b.engines is not None), None)
    row["running"] = last.running if last else None
    row["waiting"] = last.waiting if last else None
    row["kv_usage"] = last.kv_usage if last else None
    queries = sum(b.prefix_queries for b in buckets)
    row["prefix_cache_hit_rate"] = (sum(b.prefix_hits for b in buckets) / queries
                                    if queries else None)
    return row
