"""Sharing one rate limit between gateway replicas, without a shared store.

Every replica serves its own counters (admitted and asked-for requests and tokens
per tenant over the sliding minute) at ``/internal/tenant-usage`` and reads its
peers' every ``interval`` seconds. A replica's quota of a tenant's limit is its
share of the tenant's recent demand, ``own / (own + peers')``, where ``own`` is the
snapshot it published, not its live count: every replica then divides the same
numbers, the quotas add up to the limit and follow where the traffic goes. With no
demand published yet, or when any peer has not answered lately, a replica falls
back to ``limit / replicas``, which cannot add up to more than the limit either.
(Demand is a sliding minute, so shares drift little within one interval; that
drift is the only way the replicas together can pass the limit, and only briefly.)

Peers come from a static list (``--peer URL``) or, on Kubernetes, from the
EndpointSlices of the gateway's headless Service (this pod's own address, from
POD_IP, left out). Requests between peers carry a token derived from the shared
tenants file.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from dataclasses import dataclass

import aiohttp

from llmserve.gateway.ratelimits import WINDOW_S, RateLimiter

log = logging.getLogger(__name__)

USAGE_PATH = "/internal/tenant-usage"
TOKEN_HEADER = "x-llmserve-peer-token"


@dataclass
class PeerReport:
    received: float
    tenants: dict[str, dict[str, float]]


def valid_counts(body) -> dict[str, dict[str, float]]:
    """A peer's report, as {tenant: {name: number}}; ValueError if it is not one
    (e.g. a peer of another version): its report is then ignored, never trusted."""
    tenants = body.get("tenants") if isinstance(body, dict) else None
    if not isinstance(tenants, dict):
        raise ValueError("a peer report needs a 'tenants' mapping")
    out = {}
    for name, counts in tenants.items():
        if not isinstance(counts, dict):
            raise ValueError(f"peer counts of {name!r} are not a mapping")
        out[str(name)] = {str(k): float(v) for k, v in counts.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)
                          and math.isfinite(v) and v >= 0}
    return out


class PeerCounters:
    def __init__(self, limiter: RateLimiter, token: callable, interval: float = 1.0,
                 own_host: str | None = None):
        self.limiter = limiter
        self.token = token  # () -> the current shared token
        self.interval = interval
        # A busy peer answers late; only one silent for several intervals is
        # treated as gone (and the fallback split used).
        self.stale_after = max(5.0, 5 * interval)
        self.own_host = own_host
        self.urls: list[str] = []
        self.reports: dict[str, PeerReport] = {}
        self.published: dict[str, dict[str, float]] = {}  # own counts, as peers see them
        limiter.quota_share = self.share

    def set_urls(self, urls: list[str]) -> None:
        """The peers (discovery calls this); this replica's own address is dropped. A
        departed peer's last report is kept for a window: what it admitted still counts."""
        own = f"//{self.own_host}:" if self.own_host else None
        self.urls = sorted(u.rstrip("/") for u in urls if not (own and own in u))
        # With peers, a refused request may fit as soon as the shares next move.
        self.limiter.share_refresh_s = 2 * self.interval if self.urls else WINDOW_S

    @property
    def replicas(self) -> int:
        return len(self.urls) + 1

    def all_fresh(self, now: float) -> bool:
        return all(u in self.reports and now - self.reports[u].received <= self.stale_after
                   for u in self.urls)

    def share(self, tenant: str, kind: str) -> float:
        """This replica's part of ``tenant``'s ``kind`` ("requests"/"tokens") limit:
        its share of the demand, and never more than the peers have left of it."""
        now = time.monotonic()
        # What peers (present or departed) admitted in the window is spent, whatever
        # the shares say: they move as demand moves, and the window remembers.
        self.reports = {u: r for u, r in self.reports.items()
                        if u in self.urls or now - r.received < WINDOW_S}
        limit_used = sum(r.tenants.get(tenant, {}).get(f"{kind}_fraction", 0.0)
                         for r in self.reports.values())
        if not self.urls:
            return max(0.0, 1.0 - limit_used)
        if not self.all_fresh(now):
            return max(0.0, min(1.0 / self.replicas, 1.0 - limit_used))
        key = f"demand_{kind}"
        own = self.published.get(tenant, {}).get(key, 0.0)
        others = sum(r.tenants.get(tenant, {}).get(key, 0.0)
                     for u, r in self.reports.items() if u in self.urls)
        share = own / (own + others) if own + others > 0 else 1.0 / self.replicas
        return max(0.0, min(share, 1.0 - limit_used))

    def authorized(self, header: str) -> bool:
        return hmac.compare_digest(header.encode(), self.token().encode())

    def publish(self) -> None:
        self.published = self.limiter.counts()

    def published_with_fractions(self, tenants: dict) -> dict:
        """The published counts, with what each is of its tenant's limit (peers
        may not know the limits if their tenants file is a version behind)."""
        out = {}
        for name, counts in self.published.items():
            tenant = tenants.get(name)
            limits = (tenant.limits.rpm, tenant.limits.tpm) if tenant else (None, None)
            out[name] = dict(counts)
            for kind, limit in zip(("requests", "tokens"), limits):
                if limit:
                    out[name][f"{kind}_fraction"] = counts[kind] / limit
        return out

    def fresh_peers(self) -> int:
        now = time.monotonic()
        return sum(1 for u in self.urls if u in self.reports
                   and now - self.reports[u].received <= self.stale_after)

    async def exchange_forever(self, session: aiohttp.ClientSession) -> None:
        """Publish, then fetch every peer; a slow peer delays nobody's next round."""
        pending: dict[str, asyncio.Task] = {}
        while True:
            self.publish()
            for u in list(self.urls):
                if u not in pending or pending[u].done():
                    pending[u] = asyncio.create_task(self._fetch(session, u))
            await asyncio.sleep(self.interval)

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.stale_after)
            async with session.get(url + USAGE_PATH, headers={TOKEN_HEADER: self.token()},
                                   timeout=timeout) as r:
                if r.status != 200:
                    log.warning("peer %s answered %d", url, r.status)
                    return
                body = await r.json()
            self.reports[url] = PeerReport(time.monotonic(), valid_counts(body))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            log.debug("peer %s unreachable: %r", url, e)
