"""The gateway facing misbehaving upstreams, in process and deterministic: fake engines
that are overloaded, that die mid-stream or mid-body; and slow clients."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmserve.gateway.server import Gateway, GatewayConfig, SSEFramer, build_app
from llmserve.http_serving import runner_options

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True}


class FakeEngine:
    """An upstream whose behaviour a test chooses: ok | overloaded | failing |
    die_mid_sse | die_mid_json."""

    def __init__(self, mode: str):
        self.mode, self.hits = mode, 0
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        self.server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def health(self, request):
        return web.json_response({"status": "ok"})

    async def metrics(self, request):
        return web.Response(text="vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n")

    async def openapi(self, request):
        self.openapi_hits = getattr(self, "openapi_hits", 0) + 1
        if self.mode == "failing":
            return web.json_response({"error": {"message": "boom", "type": "x"}}, status=500)
        return web.json_response({"openapi": "3.1.0", "info": {"title": "engine"}, "paths": {
            p: {"get": {}} for p in ("/v1/completions", "/v1/models", "/health",
                                     "/tokenize", "/version")}})

    async def completions(self, request):
        self.hits += 1
        if self.mode == "overloaded":
            return web.json_response({"error": {
                "message": "busy", "type": "server_overloaded", "param": None, "code": 503}},
                status=503, headers={"Retry-After": "7"})
        if self.mode == "failing":
            return web.json_response({"error": {"message": "boom", "type": "x"}}, status=500)
        if self.mode in ("ok", "die_mid_sse"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                # Events split across writes: the gateway must not cut one in two.
                event = f'data: {{"choices": [{{"text": "t{i}", "index": 0}}]}}\n\n'.encode()
                await resp.write(event[:10])
                await resp.write(event[10:])
            if self.mode == "die_mid_sse":
                await resp.write(b'data: {"choices": [{"te')  # a torn event, then death
                request.transport.abort()
                return resp
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        # die_mid_json: a non-streamed body cut short
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"choices": [{"text": "partial')
        request.transport.abort()
        return resp


@pytest.fixture
async def fleet():
    engines = {}

    async def make(*modes, **config):
        for mode in modes:
            engine = FakeEngine(mode)
            await engine.server.start_server()
            engines[mode] = engine
        gw = Gateway(GatewayConfig(backends=[e.url for e in engines.values()],
                                   policy="round-robin", scrape_interval=0.1, **config))
        await gw.start()
        server = TestServer(build_app(gw))
        options = runner_options(gw.config.header_timeout)
        options.pop("handler_cancellation")  # TestServer sets it itself
        await server.start_server(**options)
        client = TestClient(server)
        await client.start_server()
        fleet.gw, fleet.client = gw, client
        return gw, client, engines

    fleet = type("Fleet", (), {"gw": None, "client": None})
    yield make
    if fleet.client is not None:
        await fleet.client.close()
        await fleet.gw.close()
    for e in engines.values():
        await e.server.close()


async def test_overloaded_engine_is_retried_elsewhere_and_not_ejected(fleet):
    gw, client, engines = await fleet("overloaded", "ok")
    for _ in range(4):
        r = await client.post("/v1/completions", json=BODY)
        assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
    assert engines["overloaded"].hits >= 1
    assert not gw.pool.endpoints[engines["overloaded"].url].ejected, "busy is not broken"
    metrics = await (await client.get("/metrics")).text()
    assert "llmserve_gateway_upstream_overloaded_total" in metrics


async def test_all_overloaded_is_503_server_overloaded_with_retry_after(fleet):
    gw, client, engines = await fleet("overloaded")
    r = await client.post("/v1/completions", json=BODY)
    assert r.status == 503 and r.headers["Retry-After"] == "7"
    assert (await r.json())["error"]["type"] == "server_overloaded"
    assert not gw.pool.endpoints[engines["overloaded"].url].ejected


async def test_failing_engine_is_ejected_and_the_request_retried(fleet):
    gw, client, engines = await fleet("failing", "ok")
    for _ in range(3):
        r = await client.post("/v1/completions", json=BODY)
        assert r.status == 200
    assert gw.pool.endpoints[engines["failing"].url].ejected


async def test_engine_dying_mid_stream_ends_the_sse_with_an_error_and_done(fleet):
    gw, client, engines = await fleet("die_mid_sse")
    r = await asyncio.wait_for(client.post("/v1/completions", json=BODY), 10)
    assert r.status == 200
    raw = await asyncio.wait_for(r.read(), 10)  # never a hang
    events = [e for e in raw.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events)
    data = [json.loads(e[6:]) for e in events[:-1]]  # every event is whole JSON
    assert [d["choices"][0]["text"] for d in data[:3]] == ["t0", "t1", "t2"]
    assert data[3]["error"]["code"] == "upstream_failed"
    assert set(data[3]["error"]) == {"message", "type", "param", "code"}
    assert events[-1] == b"data: [DONE]"
    metrics = await (await client.get("/metrics")).text()
    assert "llmserve_gateway_broken_streams_total 1.0" in metrics


async def test_engine_dying_mid_body_closes_the_connection(fleet):
    gw, client, engines = await fleet("die_mid_json")
    r = await client.post("/v1/completions", json={**BODY, "stream": False})
    with pytest.raises(aiohttp.ClientPayloadError):
        await asyncio.wait_for(r.read(), 10)  # an error, not a silently short body


async def test_openapi_is_an_engines_cut_to_the_gateways_paths_and_cached(fleet):
    gw, client, engines = await fleet("failing", "ok")
    for _ in range(2):
        r = await client.get("/openapi.json")
        assert r.status == 200
        doc = await r.json()
        assert set(doc["paths"]) == {"/v1/completions", "/v1/models", "/health"}
        assert doc["info"]["title"] == "llmserve gateway"
    assert engines["ok"].openapi_hits == 1  # asked once, then kept


async def test_openapi_without_an_engine_is_a_503_openai_error(fleet):
    gw, client, engines = await fleet("failing")
    r = await client.get("/openapi.json")
    assert r.status == 503
    err = (await r.json())["error"]
    assert err["type"] == "service_unavailable" and "OpenAPI" in err["message"]


def test_sse_framer_holds_partial_events():
    f = SSEFramer()
    assert f.feed(b"data: 1\n") == b""
    assert f.feed(b"\ndata: 2") == b"data: 1\n\n"
    assert f.feed(b"\n\ndata: [DONE]\n\n") == b"data: 2\n\ndata: [DONE]\n\n"
    assert f.done and f.pending == b""


# --- slow and hostile clients ----------------------------------------------------------
def raw_exchange(host: str, port: int, parts: list[bytes], pause: float,
                 deadline: float) -> tuple[bytes, float]:
    """Send ``parts`` ``pause`` seconds apart; return what came back before the server
    closed (or ``deadline`` passed) and when that was."""
    t0 = time.monotonic()
    with socket.create_connection((host, port)) as s:
        s.settimeout(0.2)
        got = b""
        queue = list(parts)
        next_send = t0
        while time.monotonic() - t0 < deadline:
            if queue and time.monotonic() >= next_send:
                try:
                    s.sendall(queue.pop(0))
                except OSError:
                    break
                next_send = time.monotonic() + pause
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                return got, time.monotonic() - t0
            got += chunk
        return got, time.monotonic() - t0


@pytest.fixture
async def gateway_only(fleet):
    gw, client, engines = await fleet("ok", header_timeout=1.0, body_timeout=1.0)
    return client


async def test_slow_loris_headers_are_cut_off_and_others_still_served(gateway_only):
    client = gateway_only
    host, port = client.server.host, client.server.port
    head = [b"POST /v1/completions HTTP/1.1\r\n", b"Host: x\r\n"] + \
        [f"X-Slow-{i}: y\r\n".encode() for i in range(40)]
    slow = asyncio.create_task(asyncio.to_thread(raw_exchange, host, port, head, 0.2, 15))
    await asyncio.sleep(0.3)
    r = await client.post("/v1/completions", json=BODY)  # others are served meanwhile
    assert r.status == 200
    got, took = await slow
    assert got == b"" and took < 5, "the slow head was closed after the header timeout"


async def test_slow_body_gets_408_and_close(gateway_only):
    client = gateway_only
    host, port = client.server.host, client.server.port
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n")
    parts = [head] + [b" "] * 40
    got, took = await asyncio.to_thread(raw_exchange, host, port, parts, 0.2, 15)
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert b'"request_timeout"' in got and took < 5


@pytest.mark.parametrize("body,status", [
    (b'{"prompt": "\xff\xfe"}', 400),                      # invalid UTF-8
    (b"[" * 100_000 + b"]" * 100_000, 400),                # deeply nested JSON
    (b'{"prompt": "' + b"x" * (5 << 20) + b'"}', 413),     # over the body limit
])
async def test_bad_bodies_get_a_clear_4xx(gateway_only, body, status):
    r = await gateway_only.post("/v1/completions", data=body,
                                headers={"Content-Type": "application/json"})
    assert r.status == status, await r.text()
    assert set((await r.json())["error"]) == {"message", "type", "param", "code"}
