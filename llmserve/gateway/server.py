"""The gateway's HTTP side: authenticate, pick an endpoint, proxy, stream back.

A request is retried on another endpoint when the chosen one fails before the
first byte reached the client (connection error, 5xx, or a hang); after that the
bytes pass through unchanged, chunk by chunk. A client that goes away cancels the
handler, which closes the upstream connection, and the engine aborts the request.

A hung engine (alive, accepting connections, never answering: SIGSTOP, a frozen
host, a blocked event loop) is found by two timers, one for the response head
(``upstream_first_byte_timeout``) and one between body chunks
(``upstream_idle_timeout``). A timer that expires is a suspicion, not a verdict:
the gateway then asks the engine's /health, and only an engine that does not answer
it at all is hung. It is ejected like a dead one, and every request waiting on it
ends at once: retried elsewhere when nothing reached the client yet, otherwise an
SSE error event and ``[DONE]`` (a non-SSE body is cut off). An engine that answers is
busy, not hung (a long prefill in a deep queue, a long non-streamed generation, which
sends nothing until it is complete), and the request keeps waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmserve import envs
from llmserve.errors import APIError
from llmserve.gateway import dashboard
from llmserve.gateway.admission import INTERNAL_HEADERS, TenantAdmission, Turn
from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.disagg import PD_PATHS, Disaggregation, leg2_body, strip_client_params
from llmserve.gateway.endpoints import EndpointPool
from llmserve.gateway.metrics import GatewayMetrics, outcome_of
from llmserve.gateway.models import MODEL_LABELS, labels_for, merge_model_lists, parse_model_list
from llmserve.gateway.openapi import UpstreamOpenAPI
from llmserve.gateway.peers import USAGE_PATH
from llmserve.gateway.prefix import prefix_key
from llmserve.gateway.response_affinity import RESPONSES_PATH, ResponseAffinity, responses_key
from llmserve.gateway.routing import Decision, make_policy
from llmserve.gateway.spans import server_span_middleware
from llmserve.gateway.upstream_watch import HangWatch, UpstreamHung
from llmserve.http_serving import (
    http_error_response,
    read_body_middleware,
    serve_until_signal,
)
from llmserve.tracing import SpanAttributes, Tracing, current_span, inject_context

log = logging.getLogger("llmserve.gateway")

GATEWAY = web.AppKey("gateway", object)
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
               "content-encoding", "authorization", *INTERNAL_HEADERS}


def listed_keys(config: GatewayConfig) -> str | None:
    """The comma-separated keys a gateway of ``config`` accepts besides its key file's."""
    return config.api_keys if config.api_keys is not None else envs.LLMSERVE_API_KEYS


def check_tenant_keys(tenants_file: str | None, keys: ApiKeys) -> None:
    """With a tenants file, its keys are the only ones (each names its tenant): a
    second source of keys would let requests in under no tenant."""
    if tenants_file and keys.enabled:
        raise ValueError("with --tenants, API keys come from the tenants file only: "
                         "drop --api-key / --api-key-file / LLMSERVE_API_KEYS")


class ApiKeys:
    """Keys from a file (one per line; re-read when it changes, as a mounted Secret
    does) and from a comma-separated list (``listed_keys``). None configured = open."""

    def __init__(self, path: str | None, listed: str | None):
        self.path = Path(path) if path else None
        self.listed = {k.strip() for k in (listed or "").split(",") if k.strip()}
        self._file_keys: set[str] = set()
        self._mtime = None

    def keys(self) -> set[str]:
        if self.path is not None:
            mtime = self.path.stat().st_mtime_ns if self.path.exists() else None
            if mtime != self._mtime:
                self._mtime = mtime
                text = self.path.read_text() if mtime is not None else ""
                self._file_keys = {k.strip() for k in text.splitlines() if k.strip()}
        return self.listed | self._file_keys

    @property
    def enabled(self) -> bool:
        return self.path is not None or bool(self.listed)

    def check(self, header: str) -> bool:
        token = header[7:].strip() if header.startswith("Bearer ") else ""
        return any(hmac.compare_digest(token.encode(), k.encode()) for k in self.keys())


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.tracing = Tracing("llmserve-gateway", config.otlp_traces_endpoint)
        self.tracer = self.tracing.tracer
        cap = config.max_in_flight
        if cap is None and not config.tenants_file:
            cap = 0
        probe_headers = ({"Authorization": f"Bearer {config.upstream_api_key}"}
                         if config.upstream_api_key else {})
        self.pool = EndpointPool(config.max_waiting, config.max_kv_usage, config.eject_seconds,
                                 cap, probe_headers)
        self.policy = make_policy(config.policy, config.load_factor)
        self.metrics = GatewayMetrics()
        self.disagg = Disaggregation(config, self.metrics)
        self.disagg.pool.probe_headers = probe_headers  # its /v1/models probes, too
        self.keys = ApiKeys(config.api_key_file, listed_keys(config))
        check_tenant_keys(config.tenants_file, self.keys)
        self.tenants = None
        if config.tenants_file:
            self.tenants = TenantAdmission(config.tenants_file, self.free_slots,
                                           self.metrics, config.peer_interval, self.tracer)
        self.waiting_for_endpoint = 0
        self.metrics.queued.set_function(lambda: self.waiting_for_endpoint + (
            self.tenants.fair.size if self.tenants else 0))
        self.session: aiohttp.ClientSession | None = None
        self.draining = False
        self.in_flight = 0
        self._tasks: list[asyncio.Task] = []
        self.hangs = HangWatch(self.metrics, self._failed)  # hung engines
        self.openapi = UpstreamOpenAPI()
        self.affinity = ResponseAffinity()  # stored responses -> the engine that has them
        self.dashboard = dashboard.Dashboard(self)

    def free_slots(self, priority: int | None = None) -> float:
        """Room in the (decode) pool for a class, less the requests of that class or
        more urgent ones now in their prefill leg: each needs a decode place next."""
        return max(0.0, self.pool.free_slots(priority) - self.disagg.pending(priority))

    # --- lifecycle --------------------------------------------
    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False)
        if self.config.backends:
            self.pool.set_urls(self.config.backends)
        if self.config.k8s_service:
            from llmserve.gateway.discovery import watch_endpoint_slices
            namespace, name = self.config.k8s_service.split("/", 1)
            self._tasks.append(asyncio.create_task(watch_endpoint_slices(
                namespace, name, self.pool.set_urls, self.config.k8s_port_name)))
        self._tasks.append(asyncio.create_task(
            self.pool.scrape_forever(self.session, self.config.scrape_interval)))
        self._tasks += self.disagg.start(self.session)
        self._tasks.append(asyncio.create_task(self.dashboard.sample_forever()))
        timeouts = [t for t in (self.config.upstream_first_byte_timeout,
                                self.config.upstream_idle_timeout) if t > 0]
        if timeouts:  # a hang is seen within a quarter of the timeout (1 s at most)
            self._tasks.append(asyncio.create_task(
                self.hangs.sweep_forever(self.session,
                                         max(0.05, min(1.0, min(timeouts) / 4)))))
        if self.tenants:
            self._start_tenants()

    def _start_tenants(self) -> None:
        peers = self.tenants.peers
        if self.config.peers:
            peers.set_urls(self.config.peers)
        if self.config.peer_service:
            from llmserve.gateway.discovery import watch_endpoint_slices
            namespace, name = self.config.peer_service.split("/", 1)
            self._tasks.append(asyncio.create_task(watch_endpoint_slices(
                namespace, name, peers.set_urls, "http")))
        self._tasks.append(asyncio.create_task(peers.exchange_forever(self.session)))
        self._tasks.append(asyncio.create_task(self._dispatch_forever()))

    async def _dispatch_forever(self, interval: float = 0.1) -> None:
        """Engines gain room between requests too (scrapes, ejections ending)."""
        while True:
            try:
                self.tenants.refresh()
                self.tenants.fair.dispatch()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad request
                log.exception("dispatching queued requests failed")
            await asyncio.sleep(interval)

    async def close(self) -> None:
        tasks = [*self._tasks, *self.hangs.probes.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session:
            await self.session.close()
        self.tracing.shutdown()  # exports the spans still batched

    # --- proxying --------------------------------------------
    async def serve(self, request: web.Request, body: bytes, payload: dict, key: str,
                    pinned: str | None = None) -> web.StreamResponse:
        """Proxy the request, first through a prefill engine when a prefill pool can
        take its prompt (``payload`` is what ``body`` says). Both legs are in the
        ``route`` span, which the engines' spans are children of."""
        with current_span(self.tracer, "route", kind=SpanKind.CLIENT):
            return await self._serve(request, body, payload, key, pinned)

    async def _serve(self, request: web.Request, body: bytes, payload: dict, key: str,
                     pinned: str | None) -> web.StreamResponse:
        if self.disagg.enabled and request.path in PD_PATHS:
            turn: Turn | None = request.get("turn")
            params = await self.disagg.kv_params(
                self.session, request.path, self.upstream_headers(request), payload, key,
                turn.cls.priority if turn is not None else None)
            if params is not None:
                body = leg2_body(payload, params)
        return await self.proxy(request, body, key, pinned, payload.get("model"))

    def upstream_headers(self, request: web.Request) -> dict:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if self.config.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        turn: Turn | None = request.get("turn")
        if turn is not None:
            headers.update(turn.headers)
        if self.tracing.enabled:  # off, a client's traceparent passes through as it is
            inject_context(headers)
        return headers

    async def wait_for_endpoint(self) -> None:
        """Hold the request while no endpoint exists (e.g. scaled to zero); the
        operator reads llmserve_gateway_queued_requests and scales up."""
        if self.pool.candidates() or self.config.no_endpoint_wait <= 0:
            return
        self.waiting_for_endpoint += 1
        try:
            with current_span(self.tracer, "queue", attributes={"llmserve.queue": "endpoint"}):
                deadline = time.monotonic() + self.config.no_endpoint_wait
                while not self.pool.candidates() and time.monotonic() < deadline:
                    await asyncio.sleep(0.25)
        finally:
            self.waiting_for_endpoint -= 1

    async def proxy(self, request: web.Request, body: bytes | None, key: str,
                    pinned: str | None = None, model=None) -> web.StreamResponse:
        """``pinned``: the endpoint to try first while it is in the pool (the one that
        has the state this request needs: a stored response). ``model``: the body's;
        an adapter's requests go to the engines that hold it (EndpointPool.candidates)."""
        await self.wait_for_endpoint()
        tried: set[str] = set()
        last_error = "no endpoint is available"
        for attempt in range(self.config.max_attempts):
            candidates = self.pool.candidates(exclude=tried, model=model)
            if not candidates:
                break
            if pinned is not None and any(c.url == pinned for c in candidates):
                decision = Decision(pinned, "pinned")
            else:
                decision = self.policy.choose(candidates, key)
            url = decision.url
            tried.add(url)
            if attempt:
                self.metrics.retries.inc()
            self.metrics.decisions.labels(url, decision.reason).inc()
            span = trace.get_current_span()  # the route span (a no-op one when off)
            span.set_attributes({"llmserve.endpoint": url, "llmserve.route.reason":
                                 decision.reason, "llmserve.route.attempts": attempt + 1})
            result = await self._forward(request, body, url)
            if isinstance(result, web.StreamResponse):
                return result
            span.add_event("upstream_failed", {"llmserve.endpoint": url, "reason": result})
            last_error = result
        if OVERLOADED in request:  # engines were overloaded: say so, and when to retry
            return overloaded_response(request[OVERLOADED], last_error)
        if HUNG in request:  # an engine took the request and never answered
            raise APIError(504, f"no engine answered in time: {request[HUNG]}",
                           "server_error", code="upstream_timeout")
        raise APIError(503, f"no engine could serve the request: {last_error}",
                       "service_unavailable")

    async def _forward(self, request: web.Request, body: bytes | None, url: str):
        """The streamed response, or an error string when the endpoint failed before
        anything was sent to the client (so another endpoint may be tried)."""
        ep = self.pool.endpoints.get(url)
        if ep is None:
            return "endpoint left"
        with self._counted_in_flight(ep, url, request):
            watch = self.hangs.watch(url)
            try:
                return await self._exchange(request, body, url, watch)
            finally:
                self.hangs.unwatch(watch)

    @contextlib.contextmanager
    def _counted_in_flight(self, ep, url: str, request: web.Request):
        """Count the request on its endpoint (by its class's priority too, with tenants)
        and in the in-flight gauge while it is there."""
        turn: Turn | None = request.get("turn")
        priority = turn.cls.priority if turn is not None else None
        ep.in_flight += 1
        if priority is not None:
            ep.by_priority[priority] = ep.by_priority.get(priority, 0) + 1
        gauge = self.metrics.in_flight.labels(url)
        gauge.inc()
        try:
            yield
        finally:
            ep.in_flight -= 1
            if priority is not None:
                ep.by_priority[priority] -= 1
            gauge.dec()

    async def _exchange(self, request: web.Request, body: bytes | None, url: str, watch):
        """Send the request to ``url`` and act on its answer (``_answer``)."""
        upstream = await self._send(request, body, url, watch)
        if isinstance(upstream, str):
            return upstream
        done = False
        try:
            result, done = await self._answer(request, url, upstream, watch)
            return result
        finally:
            # Reuse the connection only when the response was read to the end; closing
            # it otherwise also tells the engine to abort (client gone, error).
            upstream.release() if done else upstream.close()

    async def _send(self, request: web.Request, body: bytes | None, url: str, watch
                    ) -> aiohttp.ClientResponse | str:
        """The upstream's response head, or an error string when none came: the
        endpoint hung (the watch ejected it already) or the connection failed (ejected
        here). Nothing has reached the client either way."""
        t0 = time.perf_counter()
        try:
            upstream = await watch.head(self.session.request(
                request.method, url + request.rel_url.path_qs, data=body,
                headers=self.upstream_headers(request)),
                self.config.upstream_first_byte_timeout)
        except UpstreamHung as e:
            request[HUNG] = f"{url}: {e}"
            return request[HUNG]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._failed(url, "connection")
            return f"{url}: {e!r}"
        self.metrics.upstream_latency.labels(*request.get(MODEL_LABELS, ("", ""))).observe(
            time.perf_counter() - t0)
        return upstream

    async def _answer(self, request: web.Request, url: str, upstream, watch
                      ) -> tuple[web.StreamResponse | str, bool]:
        """(the response streamed back to the client, or an error string when the
        engine is busy or failed, so another endpoint may be tried; whether the upstream
        body was read to its end)."""
        if upstream.status == 503 and await overloaded(upstream):
            # Busy, not broken: try another endpoint, but do not eject this one.
            self.metrics.upstream_overloaded.labels(url).inc()
            request[OVERLOADED] = upstream.headers.get("Retry-After", "1")
            return f"{url}: overloaded", upstream.content.at_eof()
        if upstream.status >= 500:
            self._failed(url, "status")
            return f"{url}: HTTP {upstream.status}", False
        self.pool.succeeded(url)
        self.affinity.remember(upstream.headers, url)
        response = await self._stream_back(request, upstream, watch)
        return response, upstream.content.at_eof()

    async def read_model_lists(self) -> list[dict[str, dict] | None]:
        """Each live endpoint's /v1/models now (URL order), or its last known list."""
        live = sorted(c.url for c in self.pool.candidates())

        async def read(url: str) -> dict[str, dict] | None:
            ep = self.pool.endpoints.get(url)
            try:
                async with self.session.get(url + "/v1/models", headers=self.pool.probe_headers,
                                            timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        models = parse_model_list(await r.json(content_type=None))
                        if ep is not None:
                            ep.models = models
                        return models
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass
            return ep.models if ep is not None else None

        return list(await asyncio.gather(*(read(url) for url in live)))

    def _failed(self, url: str, reason: str) -> None:
        self.metrics.upstream_errors.labels(url, reason).inc()
        self.pool.failed(url)

    async def _stream_back(self, request, upstream, watch) -> web.StreamResponse:
        """Pass the upstream response through. SSE is forwarded whole events at a time,
        so when the engine dies mid-stream (nothing can be retried once bytes went out)
        the client gets a well-formed OpenAI error event and ``[DONE]``, never a cut
        event or a hang; any other body is cut off by closing the connection, so the
        client sees an error instead of a silently short body."""
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        turn: Turn | None = request.get("turn")
        if turn is not None:
            headers.update(turn.response_headers)
            turn.status = upstream.status
        resp = web.StreamResponse(status=upstream.status, headers=headers)
        try:
            return await self._pass_through(request, resp, upstream, watch)
        except ConnectionResetError as e:
            # The client left while we wrote to it (a race with handler cancellation):
            # not a server error; closing the upstream (in _forward) aborts the request.
            raise asyncio.CancelledError from e

    async def _pass_through(self, request, resp, upstream, watch) -> web.StreamResponse:
        await resp.prepare(request)
        events = SSEFramer() if is_sse(upstream) else None
        turn: Turn | None = request.get("turn")
        tap = (lambda chunk: chunk) if turn is None else turn.tap.feed  # usage, tenants
        timer = request.get(TIMER)
        while True:
            try:  # only reading the upstream is guarded: a client that left is not
                chunk = await watch.read(upstream.content,  # the engine's failure
                                         self.config.upstream_idle_timeout)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError,
                    asyncio.TimeoutError, UpstreamHung) as e:
                return await self._upstream_broke(request, resp, watch.url, events, e)
            if not chunk:
                break
            if events is not None:
                chunk = events.feed(chunk)
            chunk = tap(chunk) if chunk else chunk
            if chunk:
                await resp.write(chunk)
                if timer is not None:
                    timer.wrote(events is not None)
        rest = events.pending if events is not None else b""
        if turn is not None:
            rest = (tap(rest) if rest else b"") + turn.tap.finish()
        if rest:
            await resp.write(rest)
        await resp.write_eof()
        return resp

    async def _upstream_broke(self, request, resp, url, events, e) -> web.StreamResponse:
        """The engine failed (or hung) after the response started: eject it, and end the
        client's response as well-formed as can be (SSE) or visibly broken (anything
        else)."""
        hung = isinstance(e, UpstreamHung)
        if not hung:  # a hung one was ejected when it was found so
            log.warning("upstream %s broke mid-stream: %r", url, e)
            self._failed(url, "broken")  # it died: eject it now, not at the next failure
        self.metrics.broken_streams.inc()
        if events is None:
            resp.force_close()
            if request.transport is not None:
                request.transport.close()
            return resp
        if not events.done:
            await resp.write(sse_error_event(
                f"the engine serving this stream stopped answering ({e}); the output is "
                "incomplete", "upstream_timeout") if hung else sse_error_event(
                "the engine serving this stream failed mid-response; the output is "
                "incomplete", "upstream_failed"))
        await resp.write_eof()
        return resp


# --- reliability helpers --------------------------------------------
OVERLOADED = web.RequestKey("overloaded", str)  # Retry-After of an overloaded engine
HUNG = web.RequestKey("hung", str)  # an engine tried for this request hung
TIMER = web.RequestKey("timer", dashboard.RequestTimer)  # a generation request's timings


async def overloaded(upstream: aiohttp.ClientResponse) -> bool:
    """Whether a 503 is an engine's ``server_overloaded`` (busy, retry elsewhere, keep
    it in the pool) rather than a failure (eject it)."""
    if (upstream.content_length or 0) > 64 << 10:
        return False
    try:
        body = json.loads(await upstream.read())
        return body["error"]["type"] == "server_overloaded"
    except (ValueError, KeyError, TypeError, aiohttp.ClientError, asyncio.TimeoutError):
        return False


def overloaded_response(retry_after: str, detail: str) -> web.Response:
    err = APIError(503, f"every engine is overloaded ({detail}); retry later",
                   "server_overloaded")
    return web.json_response(err.body(), status=503, headers={"Retry-After": retry_after})


def is_sse(upstream: aiohttp.ClientResponse) -> bool:
    return upstream.headers.get("Content-Type", "").startswith("text/event-stream")


def sse_error_event(message: str, code: str) -> bytes:
    err = APIError(502, message, "server_error", code=code).body()
    return b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"


class SSEFramer:
    """Cuts a byte stream at SSE event boundaries (a blank line): ``feed`` returns the
    complete events so far and holds back a partial one."""

    def __init__(self):
        self.pending = b""
        self.done = False  # [DONE] went out

    def feed(self, chunk: bytes) -> bytes:
        data = self.pending + chunk
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            self.pending = data
            return b""
        self.pending = data[cut:]
        out = data[:cut]
        if out.endswith(b"data: [DONE]\n\n"):
            self.done = True
        return out


# --- handlers --------------------------------------------
@web.middleware
async def middleware(request: web.Request, handler):
    gw: Gateway = request.app[GATEWAY]
    status = 499  # the client went away (the handler was cancelled)
    try:
        if request.path.startswith("/v1/"):
            authenticate(gw, request)
        resp = await handler(request)
        status = resp.status
        return resp
    except APIError as e:
        status = e.status
        return web.json_response(e.body(), status=e.status, headers=e.headers)
    except web.HTTPException as e:
        status = e.status
        if e.status < 400:
            raise
        return http_error_response(e)
    except Exception:
        status = 500
        raise
    finally:
        tenant = request.get("tenant")
        turn = request.get("turn")
        gw.dashboard.finished(request.get(TIMER), status, tenant.name if tenant else "",
                              turn.tap.total_tokens if turn is not None else None)
        gw.metrics.requests.labels(
            request.path if request.path.startswith("/v1/") else "other", str(status),
            tenant.name if tenant else "", request.get("class", ""), outcome_of(status),
            *request.get(MODEL_LABELS, ("", ""))).inc()


def authenticate(gw: Gateway, request: web.Request) -> None:
    """401 unless the API key is accepted; with tenants, the key names the tenant."""
    header = request.headers.get("Authorization", "")
    if gw.tenants is not None:
        request["tenant"] = gw.tenants.tenant_of(header)
    elif gw.keys.enabled and not gw.keys.check(header):
        raise APIError(401, "invalid or missing API key", "authentication_error",
                       code="invalid_api_key")


async def generate(request: web.Request) -> web.StreamResponse:
    gw: Gateway = request.app[GATEWAY]
    request[TIMER] = dashboard.RequestTimer()
    if gw.draining:
        raise APIError(503, "the gateway is shutting down", "service_unavailable")
    body = await request.read()
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}") from e
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object")
    if strip_client_params(payload):  # only the gateway names a KV lease
        body = json.dumps(payload).encode()
    request[MODEL_LABELS] = labels_for(payload.get("model"), gw.pool.catalogues())
    if isinstance(payload.get("model"), str):  # the server span's (no-op when off)
        trace.get_current_span().set_attribute(SpanAttributes.GEN_AI_REQUEST_MODEL,
                                               payload["model"])
    key, pinned = prefix_key(payload, gw.config.prefix_chars), None
    if request.path == RESPONSES_PATH:
        key = responses_key(payload, gw.config.prefix_chars)
        pinned = gw.affinity.endpoint_for(payload)
    gw.in_flight += 1
    try:
        if gw.tenants is None:
            return await gw.serve(request, body, payload, key, pinned)
        chat = request.path.endswith("/chat/completions")
        async with gw.tenants.turn(request, payload, chat) as turn:
            request["turn"] = turn
            return await gw.serve(request, turn.body, payload, key, pinned)
    finally:
        gw.in_flight -= 1


async def tenant_usage(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    if gw.tenants is None:
        raise web.HTTPNotFound()
    return gw.tenants.usage_report(request)


async def models(request: web.Request) -> web.StreamResponse:
    """The union of the live engines' model lists (base models, then each adapter
    once with its parent), read now so an adapter loaded a moment ago shows. An
    engine that does not answer counts with what its last probe learned; when no
    engine's list is known at all, one engine answers (its error, if any)."""
    gw: Gateway = request.app[GATEWAY]
    merged = merge_model_lists(await gw.read_model_lists())
    if not merged:
        return await gw.proxy(request, None, "")
    return web.json_response({"object": "list", "data": merged})


async def health(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    live = [e for e in gw.pool.endpoints.values() if not e.ejected]
    if gw.draining or not live:
        return web.json_response({"status": "draining" if gw.draining else "no endpoints",
                                  "endpoints": len(gw.pool.endpoints)}, status=503)
    return web.json_response({"status": "ok", "endpoints": len(live)})


async def metrics(request: web.Request) -> web.Response:
    gw: Gateway = request.app[GATEWAY]
    eps = list(gw.pool.endpoints.values())
    gw.metrics.endpoints.labels("ejected").set(sum(e.ejected for e in eps))
    gw.metrics.endpoints.labels("ready").set(sum(not e.ejected for e in eps))
    if gw.disagg.enabled:
        prefill = list(gw.disagg.pool.endpoints.values())
        gw.metrics.prefill_endpoints.labels("ejected").set(sum(e.ejected for e in prefill))
        gw.metrics.prefill_endpoints.labels("ready").set(sum(not e.ejected for e in prefill))
    if gw.tenants is not None:
        gw.tenants.observe()
    return web.Response(body=generate_latest(gw.metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(gw: Gateway) -> web.Application:
    middlewares = [middleware, read_body_middleware(gw.config.body_timeout)]
    if gw.tracing.enabled:
        middlewares.insert(0, server_span_middleware(gw.tracer))
    app = web.Application(client_max_size=gw.config.max_body_bytes, middlewares=middlewares)
    app[GATEWAY] = gw
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post(RESPONSES_PATH, generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get(USAGE_PATH, tenant_usage)
    app.router.add_get("/openapi.json", openapi)
    dashboard.add_routes(app, lambda request: request.app[GATEWAY].dashboard,
                         lambda request: authenticate(request.app[GATEWAY], request))
    return app


async def openapi(request: web.Request) -> web.Response:
    """An engine's OpenAPI document, cut to the operations the gateway serves."""
    gw: Gateway = request.app[GATEWAY]
    live = [c.url for c in gw.pool.candidates()]
    return web.json_response(await gw.openapi.get(gw.session, live))


async def serve_gateway(config: GatewayConfig, host: str, port: int,
                        ready: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight requests and return."""
    gw = Gateway(config)
    await gw.start()
    log.info("gateway on http://%s:%d (%s)", host, port, config.policy)

    def start_draining() -> None:
        gw.draining = True

    try:
        await serve_until_signal(build_app(gw), host, port, ready=ready,
                                 drain_timeout=config.drain_timeout,
                                 header_timeout=config.header_timeout,
                                 start_draining=start_draining, in_flight=lambda: gw.in_flight)
    finally:
        await gw.close()
