"""Hung engines: the upstream waits the gateway watches, and the /health probe that
judges an engine that sent nothing past its timeout (server.py's docstring tells the
whole policy). An engine that answers the probe is busy and its requests wait on; one
that does not is hung: ejected, and every request waiting on it ends at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from llmserve.gateway.metrics import GatewayMetrics

log = logging.getLogger("llmserve.gateway")

PROBE_TIMEOUT = 10.0  # the most a hung-engine /health probe waits (see HangWatch._probe)
PROBE_FLOOR = 3.0  # and the least, whatever the timeouts (a busy engine answers late)


class UpstreamHung(Exception):
    """The engine sent nothing for a timeout and did not answer its /health."""


class UpstreamWatch:
    """One forwarded request's waits on its engine, as the gateway's sweeper sees
    them: ``since`` is when the current wait began (0 while the request is not
    waiting on the engine, e.g. while it writes to a slow client), ``timeout`` how long
    it may last before the engine is probed, ``abort`` ends it with UpstreamHung."""

    __slots__ = ("url", "timeout", "since", "abort", "hung")

    def __init__(self, url: str):
        self.url = url
        self.timeout = self.since = 0.0
        self.abort = None
        self.hung: UpstreamHung | None = None

    async def head(self, response, timeout: float) -> aiohttp.ClientResponse:
        """Await the response head. In a task of its own: a probe that finds the
        engine hung cancels it, and the request can be retried elsewhere."""
        if timeout <= 0:
            return await response
        task = asyncio.ensure_future(response)
        self.timeout, self.since, self.abort = timeout, time.monotonic(), \
            lambda _: task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.hung is None or getattr(current, "cancelling", lambda: 0)():
                raise  # this handler was cancelled (the client left), not the engine hung
            raise self.hung from None
        finally:
            self.since, self.abort = 0.0, None

    async def read(self, content: aiohttp.StreamReader, timeout: float) -> bytes:
        """The body's next bytes (b"" at its end). A probe that finds the engine hung
        sets UpstreamHung on the stream, which this raises (the buffer is empty while
        the watch waits, so nothing already received is lost)."""
        if timeout > 0:
            self.timeout, self.since, self.abort = timeout, time.monotonic(), \
                content.set_exception
        try:
            return await content.readany()
        finally:
            self.since, self.abort = 0.0, None


class HangWatch:
    """Each forwarded request's watch, per endpoint (what the sweeper checks for waits
    past their timeout), and the /health probe running per endpoint (one at a time,
    however many of its requests are late). ``failed(url, reason)`` ejects an
    endpoint (the gateway's own bookkeeping of failures)."""

    def __init__(self, metrics: GatewayMetrics, failed: Callable[[str, str], None]):
        self.metrics = metrics
        self.failed = failed
        self.watches: dict[str, set[UpstreamWatch]] = {}
        self.probes: dict[str, asyncio.Task] = {}

    def watch(self, url: str) -> UpstreamWatch:
        watch = UpstreamWatch(url)
        self.watches.setdefault(url, set()).add(watch)
        return watch

    def unwatch(self, watch: UpstreamWatch) -> None:
        watches = self.watches.get(watch.url)
        if watches is not None:
            watches.discard(watch)
            if not watches:
                del self.watches[watch.url]

    async def sweep_forever(self, session: aiohttp.ClientSession, tick: float) -> None:
        """Probe the endpoints with a wait past its timeout (one probe per endpoint)."""
        while True:
            await asyncio.sleep(tick)
            try:
                now = time.monotonic()
                for url, watches in list(self.watches.items()):
                    late = [(w, w.since) for w in watches
                            if w.since and now - w.since > w.timeout]
                    if late and url not in self.probes:
                        self.probes[url] = asyncio.create_task(
                            self._probe(session, url, late))
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad state
                log.exception("checking upstream waits failed")

    async def _probe(self, session: aiohttp.ClientSession, url: str,
                     late: list[tuple[UpstreamWatch, float]]) -> None:
        """Ask a silent engine's /health. Any answer (a draining engine's 503 too) means
        busy, not hung: the late waits get another full period. None means hung."""
        # At most 10 s, and no longer than the silence that prompted it, but never under
        # PROBE_FLOOR: a starved event loop (a loaded CPU) can take seconds to answer and
        # a wrong verdict ends every request on the engine, while a real hang is rare and
        # waits only this much more.
        limit = max(PROBE_FLOOR, min(PROBE_TIMEOUT, *(w.timeout for w, _ in late)))
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=limit)):
                pass
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._declare_hung(url, e)
        else:
            now = time.monotonic()
            for w, since in late:
                if w.since == since:  # still the same wait
                    w.since = now
                    self.metrics.upstream_stalls.labels(url, "busy").inc()
        finally:
            self.probes.pop(url, None)

    def _declare_hung(self, url: str, e: BaseException) -> None:
        """Eject the endpoint like a dead one and end every wait on it now: their
        requests are retried elsewhere (no byte sent yet) or end as broken streams."""
        log.warning("upstream %s is hung: a request waited past its timeout and /health "
                    "did not answer (%r); ejecting it and ending its requests", url, e)
        self.failed(url, "timeout")
        for w in list(self.watches.get(url, ())):
            if w.since and w.abort is not None:
                self.metrics.upstream_stalls.labels(url, "hung").inc()
                w.hung = UpstreamHung("it sent nothing past its timeout and did not "
                                      "answer its /health")
                w.since = 0.0  # the sweeper must not probe for it again
                w.abort(w.hung)
