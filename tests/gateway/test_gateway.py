"""The gateway with real engine processes on loopback addresses."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from llmserve.entrypoints.launcher import ServerProcess, scrape_metrics
from tests.server_proc import ServerProcess as EngineProcess


def start_gateway(backends, host="127.0.0.20", extra=(), env=None) -> ServerProcess:
    args = ["gateway", "--scrape-interval", "0.3", "--log-level", "WARNING", *extra]
    for b in backends:
        args += ["--backend", b.url]
    return ServerProcess(args, host, env=env)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    procs = [EngineProcess(str(tiny_llama), host=f"127.0.0.{11 + i}",
                           extra=["--served-model-name", "tiny"]) for i in range(3)]
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def gateway(engines):
    gw = start_gateway(engines)
    yield gw
    assert gw.stop() == 0


def post(url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def hits(engines):
    return [scrape_metrics(e.url).get("vllm:prefix_cache_hits_total", 0.0) for e in engines]


def test_shared_prefixes_stick_to_one_engine(gateway, engines):
    rng = random.Random(0)
    words = "alpha beta gamma delta kernel cache block router engine stream".split()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    for tenant in range(3):
        system = f"tenant {tenant}: " + " ".join(rng.choice(words) for _ in range(300))
        before = hits(engines)
        for q in range(4):
            client.chat.completions.create(
                model="tiny", max_tokens=2,
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": f"question {q} {rng.random()}"}])
        gained = [a - b for a, b in zip(hits(engines), before)]
        assert sum(1 for g in gained if g > 0) == 1, f"tenant {tenant} spread: {gained}"
        assert max(gained) >= 3 * 256, "three warm requests reuse the system prompt"


def test_streaming_through_the_gateway_equals_direct(gateway, engines):
    body = {"model": "tiny", "prompt": "stream me something", "max_tokens": 24,
            "temperature": 0, "stream": True}

    async def collect(url):
        text = []
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions",
                                                         json=body) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                if line.startswith(b"data: {"):
                    text += [c["text"] for c in json.loads(line[6:])["choices"]]
        return "".join(text), len(text)

    via, n_via = asyncio.run(collect(gateway.url))
    direct, n_direct = asyncio.run(collect(engines[0].url))
    assert via == direct and n_via == n_direct and n_via > 1


def test_structured_outputs_and_tools_pass_through(gateway, engines):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "pick"}],
            "temperature": 1.0, "seed": 4, "max_tokens": 12}
    status, body = post(gateway.url + "/v1/chat/completions",
                        {**base, "guided_choice": ["alpha", "beta"]})
    assert status == 200 and body["choices"][0]["message"]["content"] in ("alpha", "beta")
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}}
    status, body = post(gateway.url + "/v1/chat/completions", {
        **base, "max_tokens": 20, "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls"
    call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "f" and json.loads(call["arguments"])["x"] in (1, 2)
    status, body = post(gateway.url + "/v1/chat/completions", {**base, "guided_regex": "("})
    assert status == 400 and "regex" in body["error"]["message"]


def test_bad_json_is_400_and_unknown_path_404(gateway):
    status, body = post(gateway.url + "/v1/completions", b"{nope")
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = post(gateway.url + "/v1/nothing", {})
    assert status == 404
    status, body = post(gateway.url + "/v1/completions", {"prompt": "x", "max_tokens": -1})
    assert status == 400 and body["error"]["param"] == "max_tokens"  # the engine's 400 passes


def test_models_health_and_metrics(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with urllib.request.urlopen(gateway.url + "/health") as r:
        assert json.loads(r.read())["endpoints"] == 3
    m = scrape_metrics(gateway.url)
    assert m["llmserve_gateway_routing_decisions_total"] > 0
    assert m["llmserve_gateway_requests_total"] > 0
    assert "llmserve_gateway_upstream_latency_seconds_count" in m


def test_client_disconnect_aborts_on_the_engine(gateway, engines):
    body = {"model": "tiny", "prompt": "long one", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}

    async def leave_early():
        async with aiohttp.ClientSession() as s, s.post(gateway.url + "/v1/completions",
                                                         json=body) as r:
            n = 0
            async for line in r.content:
                n += line.startswith(b"data: {")
                if n == 3:
                    return

    asyncio.run(leave_early())

    async def settle():
        for _ in range(50):
            if all(scrape_metrics(e.url)["vllm:num_requests_running"] == 0 for e in engines):
                return True
            await asyncio.sleep(0.1)
        return False

    assert asyncio.run(settle()), "the engine kept generating for a departed client"


def test_api_keys(engines, tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("k-one\nk-two\n")
    gw = start_gateway(engines, host="127.0.0.21", extra=["--api-key-file", str(keyfile)],
                       env={"LLMSERVE_API_KEYS": "k-env"})
    try:
        status, body = post(gw.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 401 and body["error"]["type"] == "authentication_error"
        status, _ = post(gw.url + "/v1/completions", {"prompt": "x", "max_tokens": 1},
                         {"Authorization": "Bearer wrong"})
        assert status == 401
        for key in ("k-one", "k-two", "k-env"):
            status, _ = post(gw.url + "/v1/completions", {"prompt": "x", "max_tokens": 1},
                             {"Authorization": f"Bearer {key}"})
            assert status == 200, key
        keyfile.write_text("k-three\n")  # a rotated Secret is picked up
        os.utime(keyfile, ns=(1, 10 ** 18))
        status, _ = post(gw.url + "/v1/completions", {"prompt": "x", "max_tokens": 1},
                         {"Authorization": "Bearer k-one"})
        assert status == 401
        with urllib.request.urlopen(gw.url + "/health") as r:
            assert r.status == 200
    finally:
        gw.stop()


def test_killed_backend_fails_no_request_that_had_not_started(tiny_llama):
    victims = [EngineProcess(str(tiny_llama), host=f"127.0.0.{31 + i}") for i in range(2)]
    gw = start_gateway(victims, host="127.0.0.30", extra=["--policy", "round-robin"])
    body = {"prompt": "under load", "max_tokens": 40, "stream": True, "ignore_eos": True}

    async def one(session, i):
        started = False
        try:
            async with session.post(gw.url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    return ("failed", started)
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        started = True
                    if line.startswith(b"data: [DONE]"):
                        return ("ok", started)
            return ("truncated", started)
        except aiohttp.ClientError:
            return ("error", started)

    async def main():
        async with aiohttp.ClientSession() as s:
            first = [asyncio.create_task(one(s, i)) for i in range(12)]
            await asyncio.sleep(0.5)
            victims[0].proc.send_signal(signal.SIGKILL)
            later = [asyncio.create_task(one(s, i)) for i in range(12)]
            return await asyncio.gather(*first, *later)

    try:
        results = asyncio.run(main())
        retries = scrape_metrics(gw.url).get("llmserve_gateway_retries_total", 0)
    finally:
        gw.stop()
        for v in victims:
            v.stop()
    assert retries > 0, "requests sent to the dead engine were retried elsewhere"
    not_ok = [r for r in results if r[0] != "ok"]
    assert all(started for _, started in not_ok), f"a request failed before streaming: {not_ok}"
    assert sum(r[0] == "ok" for r in results) >= 12


async def test_requests_wait_for_an_endpoint_at_zero_replicas(engines):
    """Scale from zero: with no endpoint the gateway holds the request (and says so
    in its metrics) until discovery brings one."""
    from aiohttp.test_utils import TestClient, TestServer

    from llmserve.gateway.server import Gateway, GatewayConfig, build_app
    gw = Gateway(GatewayConfig(backends=[], no_endpoint_wait=30, scrape_interval=0.2))
    await gw.start()
    client = TestClient(TestServer(build_app(gw)))
    await client.start_server()
    try:
        pending = asyncio.create_task(client.post("/v1/completions", json={
            "model": "tiny", "prompt": "wake up", "max_tokens": 2}))
        await asyncio.sleep(0.5)
        assert not pending.done()
        metrics = await (await client.get("/metrics")).text()
        assert "llmserve_gateway_queued_requests 1.0" in metrics
        gw.pool.set_urls([engines[0].url])  # what EndpointSlice discovery does
        resp = await asyncio.wait_for(pending, 30)
        assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] >= 1
        gw.config.no_endpoint_wait = 0.3
        gw.pool.set_urls([])
        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert resp.status == 503
    finally:
        await client.close()
        await gw.close()
