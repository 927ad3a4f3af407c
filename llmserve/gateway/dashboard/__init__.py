"""The gateway's live status page: ``GET /dashboard`` (a static page, served from the
package) and ``GET /dashboard/data`` (the JSON it polls; docs/dashboard.md says what
each field means).

Everything shown is what the gateway already knows: its own requests, timed here
(arrival to the first byte of the body; the gaps between a stream's chunks), and the
engines' /metrics as its pool scrapes them, sampled once a second into
``SecondBuckets``. The page and its assets are public (they hold no data); the JSON
sits behind the gateway's API keys when it has any, and the page sends the key it
finds in its URL's fragment (``/dashboard#key=sk-...``), which browsers never send
to the server, so it stays out of access logs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from llmserve.errors import APIError
from llmserve.gateway.endpoints import Endpoint, EndpointPool
from llmserve.gateway.timeseries import EngineSample, SecondBuckets

if TYPE_CHECKING:  # the dashboard reads the gateway; the gateway builds the dashboard
    from llmserve.gateway.server import Gateway

log = logging.getLogger("llmserve.gateway")

PAGE_PATH = "/dashboard"
DATA_PATH = "/dashboard/data"
STATIC_PATH = "/dashboard/static"
STATIC_DIR = Path(str(files("llmserve.gateway.dashboard") / "assets"))
WINDOW_S = 300  # the history kept, and the longest a client may ask for
SUMMARY_S = 60  # the "now" figures: the last minute
DEFAULT_STEP_S = 2


class RequestTimer:
    """One request's timings as its client sees them: when its body's first byte went
    out (TTFT) and, for a stream, the gaps between the chunks that followed (ITL)."""

    __slots__ = ("arrived", "first_byte", "last_write", "gaps", "stream")

    def __init__(self):
        self.arrived = time.perf_counter()
        self.first_byte: float | None = None
        self.last_write = 0.0
        self.gaps: list[float] = []
        self.stream = False

    def wrote(self, stream: bool) -> None:
        now = time.perf_counter()
        if self.first_byte is None:
            self.first_byte, self.stream = now - self.arrived, stream
        elif stream:
            self.gaps.append(now - self.last_write)
        self.last_write = now


class Dashboard:
    """The gateway's recent history and the JSON made of it. Reads the gateway's pools
    (decode, and prefill with disaggregation), its tenants and its own counters."""

    def __init__(self, gateway: Gateway, clock: Callable[[], float] = time.time):
        self.gw = gateway
        self.clock = clock
        self.history = SecondBuckets(WINDOW_S)
        # The prefix-cache counters at the previous sample, per engine URL.
        self._counters: dict[str, tuple[float, float]] = {}

    # --- recording ----------------------------------------------------------------------
    def finished(self, timer: RequestTimer | None, status: int, tenant: str,
                 tokens: int | None) -> None:
        """A generation request was answered (``timer`` None: it never reached the
        handler's timing, e.g. rejected before)."""
        if timer is None:
            return
        streamed = timer.first_byte is not None and timer.stream
        self.history.add_request(self.clock(), status,
                                 timer.first_byte if streamed else None,
                                 timer.gaps, tenant, tokens)

    async def sample_forever(self, interval: float = 1.0) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - the page must not stop the gateway
                log.exception("sampling the engines for the dashboard failed")
            await asyncio.sleep(interval)

    def sample(self) -> None:
        """The engines' load as last scraped, and their prefix caches' growth since the
        previous sample (a counter that fell, a restarted engine, counts from zero)."""
        engines = [ep for ep in self.engines() if not ep.ejected and ep.scraped]
        kv = [ep.kv_usage for ep in engines if ep.kv_usage is not None]
        sample = EngineSample(sum(ep.running or 0.0 for ep in engines),
                              sum(ep.waiting or 0.0 for ep in engines),
                              sum(kv) / len(kv) if kv else None)
        seen = {}
        for ep in engines:
            if ep.prefix_hits is None or ep.prefix_queries is None:
                continue
            hits, queries = self._counters.get(ep.url, (0.0, 0.0))
            if ep.prefix_queries < queries or ep.prefix_hits < hits:
                hits = queries = 0.0
            if ep.url in self._counters:  # its first sample is where counting starts
                sample.prefix_hits += ep.prefix_hits - hits
                sample.prefix_queries += ep.prefix_queries - queries
            seen[ep.url] = (ep.prefix_hits, ep.prefix_queries)
        self._counters = seen
        self.history.add_engines(self.clock(), sample)

    # --- reading ------------------------------------------------------------------------
    def engines(self) -> list[Endpoint]:
        return [ep for _, pool in self.pools() for ep in pool.endpoints.values()]

    def data(self, seconds: int = WINDOW_S, step: int = DEFAULT_STEP_S) -> dict:
        now = self.clock()
        return {
            "time": now,
            "window_s": seconds,
            "step_s": step,
            "gateway": {"in_flight": self.gw.in_flight,
                        "queued": self.gw.waiting_for_endpoint + (
                            self.gw.tenants.fair.size if self.gw.tenants else 0),
                        "draining": self.gw.draining},
            "engines": [self.engine_row(pool.endpoints[url], role)
                        for role, pool in self.pools() for url in sorted(pool.endpoints)],
            "summary": self.history.summary(now, min(SUMMARY_S, seconds)),
            "series": self.history.series(now, seconds, step),
            "tenants": self.tenants(now, seconds),
        }

    def pools(self) -> Iterator[tuple[str, EndpointPool]]:
        """(role, pool): the decode pool, and the prefill pool with disaggregation."""
        yield "decode" if self.gw.disagg.enabled else "engine", self.gw.pool
        if self.gw.disagg.enabled:
            yield "prefill", self.gw.disagg.pool

    @staticmethod
    def engine_row(ep: Endpoint, role: str) -> dict:
        state = "ejected" if ep.ejected else "ready" if ep.scraped else "unscraped"
        return {"url": ep.url, "role": role, "state": state, "in_flight": ep.in_flight,
                "running": ep.running, "waiting": ep.waiting, "kv_usage": ep.kv_usage,
                "max_num_seqs": ep.max_num_seqs,
                "prefix_cache_hit_rate": (ep.prefix_hits / ep.prefix_queries
                                          if ep.prefix_queries else None)}

    def tenants(self, now: float, seconds: int) -> list[dict] | None:
        """Each tenant of the tenants file: its weight's share of all weights, what it
        waits for and runs now, and its share of the tokens served over ``seconds``."""
        admission = self.gw.tenants
        if admission is None:
            return None
        tenants = admission.file.config.tenants
        served = self.history.tenants(now, seconds)
        weights = sum(t.weight for t in tenants.values()) or 1.0
        tokens = sum(t.tokens for t in served.values())
        queues = admission.fair.queues.values()
        rows = []
        for name, tenant in tenants.items():
            tally = served.get(name)
            rows.append({
                "name": name, "weight": tenant.weight, "weight_share": tenant.weight / weights,
                "queued": sum(len(q.queues.get(name, ())) for q in queues),
                "in_flight": sum(q.in_flight.get(name, 0) for q in queues),
                "requests": tally.requests if tally else 0,
                "throttled": tally.throttled if tally else 0,
                "tokens": tally.tokens if tally else 0,
                "token_share": (tally.tokens / tokens) if tally and tokens else None})
        return rows


# --- HTTP ------------------------------------------------------------------------------
def add_routes(app: web.Application, dashboard: Callable[[web.Request], Dashboard],
               authenticate: Callable[[web.Request], None]) -> None:
    """The page, its assets and its JSON; ``authenticate`` raises for a request
    without an accepted API key (the JSON only)."""
    async def page(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html",
                                headers={"Cache-Control": "no-cache"})

    async def data(request: web.Request) -> web.Response:
        authenticate(request)
        seconds = bounded(request.query.get("window"), WINDOW_S, 10, WINDOW_S)
        step = bounded(request.query.get("step"), DEFAULT_STEP_S, 1, 60)
        return web.json_response(dashboard(request).data(seconds, step),
                                 headers={"Cache-Control": "no-store"})

    app.router.add_get(PAGE_PATH, page)
    app.router.add_get(DATA_PATH, data)
    app.router.add_static(STATIC_PATH, STATIC_DIR)


def bounded(value: str | None, default: int, low: int, high: int) -> int:
    """A query parameter as an int clipped to [low, high]; 400 when it is no integer."""
    if value is None:
        return default
    try:
        return min(high, max(low, int(value)))
    except ValueError:
        raise APIError(400, f"expected an integer, not {value!r}") from None
