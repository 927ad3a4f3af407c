"""Backend endpoints: their set (from discovery), load, scraped metrics and health.

In-flight counts are the gateway's own (exact and immediate); queue depth and KV
usage are scraped from each engine's /metrics under vLLM's names, so real vLLM
pods work too. An endpoint that fails a request before the first byte is ejected
for a while and re-admitted once its /health answers 200.

The cap on in-flight requests per endpoint (``--max-in-flight``) is what keeps
requests queued in the gateway, where the tenants' fair queue orders them; past
it, requests would wait in the engine, whose fair order only sees the requests
the gateway let through. Left unset with tenants, each endpoint's cap is the
``llmserve:max_num_seqs`` it exports (sequences it runs at once): an endpoint is
held back until its first scrape has told, and one that exports no such gauge
(vLLM) is not capped.

Each scrape also reads the engine's ``/v1/models`` (models.py): which base model and
LoRA adapters it serves, kept per endpoint and forgotten with it. A request for an
adapter is routed only among the endpoints that list it, when any live one does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import aiohttp

from llmserve.gateway.models import is_adapter, parse_model_list
from llmserve.gateway.routing import Candidate
from llmserve.metrics_scrape import sum_by_name

log = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
MAX_NUM_SEQS = "llmserve:max_num_seqs"
# Only the dashboard reads these (dashboard.py); routing does not.
RUNNING = "vllm:num_requests_running"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"


@dataclass
class Endpoint:
    url: str
    in_flight: int = 0
    waiting: float | None = None  # scraped; None until the first scrape
    kv_usage: float | None = None
    max_num_seqs: float | None = None  # scraped; None where the engine does not say
    scraped: bool = False  # its /metrics has answered at least once
    running: float | None = None  # scraped, for the dashboard
    prefix_hits: float | None = None  # scraped counters (prompt tokens), for the dashboard
    prefix_queries: float | None = None
    # Its /v1/models as {id: entry} (base model, then adapters); None until it has
    # answered once. A failed read keeps the last answer (the engine may be busy).
    models: dict[str, dict] | None = None
    ejected_until: float = 0.0
    consecutive_failures: int = 0
    # In-flight requests per class priority (tenants only): a class's room counts
    # only its own and more urgent requests, so batch work never crowds out
    # interactive work at the gateway (the engine preempts batch for it).
    by_priority: dict[int, int] = field(default_factory=dict)

    def in_flight_at_or_above(self, priority: int | None) -> int:
        if priority is None:
            return self.in_flight
        return sum(n for p, n in self.by_priority.items() if p <= priority)

    @property
    def ejected(self) -> bool:
        return time.monotonic() < self.ejected_until


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Queue depth, KV usage and sequence capacity from Prometheus text, summed
    over label sets (a pod may export several engines)."""
    return sum_by_name(text, names=(WAITING, KV_USAGE, MAX_NUM_SEQS, RUNNING, PREFIX_HITS,
                                    PREFIX_QUERIES))


class EndpointPool:
    def __init__(self, max_waiting: float = 16, max_kv_usage: float = 0.95,
                 eject_seconds: float = 10.0, max_in_flight: int | None = 0,
                 probe_headers: dict[str, str] | None = None):
        self.endpoints: dict[str, Endpoint] = {}
        # Sent with the /v1/models probe (the upstream API key, where engines need one).
        self.probe_headers = probe_headers or {}
        # Per endpoint; 0 = no cap; None = each engine's reported max_num_seqs.
        self.max_in_flight = max_in_flight
        self.max_waiting = max_waiting
        self.max_kv_usage = max_kv_usage
        self.eject_seconds = eject_seconds
        self.changed = asyncio.Event()
        self._joined = asyncio.Event()  # wakes the scraper: a new endpoint is probed at once

    # --- membership (discovery calls this) --------------------------------------------
    def set_urls(self, urls) -> None:
        urls = {u.rstrip("/") for u in urls}
        for url in list(self.endpoints):
            if url not in urls:
                del self.endpoints[url]
        for url in urls - self.endpoints.keys():
            self.endpoints[url] = Endpoint(url)
            self._joined.set()
        self.changed.set()

    # --- what routing sees ----------------------------------------------------------------
    def cap(self, ep: Endpoint) -> float:
        """Requests ``ep`` may have in flight (inf: no cap)."""
        if self.max_in_flight is not None:
            return self.max_in_flight if self.max_in_flight > 0 else math.inf
        if not ep.scraped:
            return 0  # its capacity is not known yet: the first scrape tells it
        return ep.max_num_seqs if ep.max_num_seqs else math.inf

    def saturated(self, ep: Endpoint) -> bool:
        return ((ep.waiting is not None and ep.waiting > self.max_waiting)
                or (ep.kv_usage is not None and ep.kv_usage > self.max_kv_usage)
                or ep.in_flight >= self.cap(ep))

    def free_slots(self, priority: int | None = None) -> float:
        """Requests of a class of ``priority`` the live endpoints can take now (inf
        with no cap): the cap less what that class and more urgent ones have in
        flight. Scraped saturation (queue, KV) stops every class."""
        free = 0.0
        for ep in self.endpoints.values():
            if ep.ejected or (ep.waiting is not None and ep.waiting > self.max_waiting) or \
                    (ep.kv_usage is not None and ep.kv_usage > self.max_kv_usage):
                continue
            free += max(0, self.cap(ep) - ep.in_flight_at_or_above(priority))
        return free

    def candidates(self, exclude: set[str] = frozenset(), model: str | None = None
                   ) -> list[Candidate]:
        """Live endpoints not in ``exclude``. For an adapter ``model``: only those
        that list it, when any of them does; otherwise all (one may have loaded it
        since its last probe, and an engine that has not answers 404 itself)."""
        live = [e for e in self.endpoints.values() if not e.ejected and e.url not in exclude]
        live = self.holding(live, model) or live
        return [Candidate(e.url, e.in_flight, self.saturated(e)) for e in live]

    @staticmethod
    def holding(endpoints: list[Endpoint], model: str | None) -> list[Endpoint]:
        """The endpoints that list ``model``, if it is an adapter; else none."""
        if not isinstance(model, str) or not is_adapter(model, (e.models for e in endpoints)):
            return []
        return [e for e in endpoints if e.models is not None and model in e.models]

    def catalogues(self) -> list[dict[str, dict] | None]:
        """Every endpoint's model list (None: not known yet), in URL order."""
        return [self.endpoints[url].models for url in sorted(self.endpoints)]

    # --- outcomes -----------------------------------------------------------------------------
    def failed(self, url: str) -> None:
        ep = self.endpoints.get(url)
        if ep is not None:
            ep.consecutive_failures += 1
            ep.ejected_until = time.monotonic() + self.eject_seconds
            log.warning("ejecting %s for %.0f s", url, self.eject_seconds)

    def succeeded(self, url: str) -> None:
        ep = self.endpoints.get(url)
        if ep is not None:
            ep.consecutive_failures = 0

    # --- background scraping --------------------------------------------------------------
    async def scrape_forever(self, session: aiohttp.ClientSession, interval: float) -> None:
        while True:
            self._joined.clear()
            await asyncio.gather(*(self.probe(session, ep) for ep in
                                   list(self.endpoints.values())), return_exceptions=True)
            try:  # the next round comes early when an endpoint joins
                await asyncio.wait_for(self._joined.wait(), interval)
            except asyncio.TimeoutError:
                pass

    async def probe(self, session: aiohttp.ClientSession, ep: Endpoint) -> None:
        """One round for one endpoint: its metrics (and health), and its models."""
        await asyncio.gather(self.scrape(session, ep), self.read_models(session, ep))

    async def read_models(self, session: aiohttp.ClientSession, ep: Endpoint) -> None:
        """Learn the endpoint's model list; on any failure keep what was known."""
        if ep.ejected:
            return  # its /health decides first; nothing routes to it meanwhile
        try:
            async with session.get(ep.url + "/v1/models", headers=self.probe_headers,
                                   timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status != 200:
                    return
                ep.models = parse_model_list(await r.json(content_type=None))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass

    async def scrape(self, session: aiohttp.ClientSession, ep: Endpoint) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        try:
            if ep.ejected_until:  # re-admit once healthy again
                async with session.get(ep.url + "/health", timeout=timeout) as r:
                    if r.status == 200:
                        ep.ejected_until = 0.0
                        log.info("re-admitting %s", ep.url)
                    else:
                        ep.ejected_until = time.monotonic() + self.eject_seconds
                        return
            async with session.get(ep.url + "/metrics", timeout=timeout) as r:
                ep.scraped = True  # it answered: what it did not say, it does not export
                if r.status != 200:
                    return
                values = parse_engine_metrics(await r.text())
            ep.waiting = values.get(WAITING)
            ep.kv_usage = values.get(KV_USAGE)
            ep.max_num_seqs = values.get(MAX_NUM_SEQS)
            ep.running = values.get(RUNNING)
            ep.prefix_hits = values.get(PREFIX_HITS)
            ep.prefix_queries = values.get(PREFIX_QUERIES)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            if ep.ejected_until:
                ep.ejected_until = time.monotonic() + self.eject_seconds
            ep.waiting = ep.kv_usage = None  # unknown: never treat a dead scrape as load
            ep.running = None
