"""A hung engine behind the gateway, with real processes on loopback: an engine stopped
by SIGSTOP still accepts connections (the kernel does) but never answers. The gateway
finds it by its first-byte and idle timeouts plus a /health probe, ejects it, retries
what had not started elsewhere, ends started streams with an error event and [DONE],
answers 504 when no other engine is left, and re-admits it after SIGCONT. An engine
that is only slow (a long non-streamed answer: no head until the last token) answers
the probe and is left alone. A few edges in process, with test_gateway_faults' fakes."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from contextlib import contextmanager

import aiohttp
import pytest
from aiohttp import web

from llmserve.entrypoints.launcher import scrape_metrics
from tests.gateway import test_gateway_faults
from tests.gateway.test_gateway import start_gateway
from tests.gateway.test_gateway_faults import BODY, FakeEngine, fleet  # noqa: F401 - the fixture
from tests.server_proc import ServerProcess as EngineProcess

TIMEOUT = 2.0  # --upstream-first-byte-timeout and --upstream-idle-timeout here
HANG = 60  # a client read this long without a byte: the gateway hung with the engine


@pytest.fixture(scope="module")
def engines(tiny_llama):
    procs = [EngineProcess(str(tiny_llama), host=f"127.0.0.{71 + i}",
                           extra=["--served-model-name", "tiny", "--num-threads", "1"])
             for i in range(2)]
    yield procs
    for p in procs:
        p.proc.send_signal(signal.SIGCONT)  # should a test have failed while it was stopped
        p.stop()


def gateway(engines, host: str, timeout: float = TIMEOUT):
    return start_gateway(engines, host=host, extra=[
        "--policy", "round-robin", "--upstream-first-byte-timeout", str(timeout),
        "--upstream-idle-timeout", str(timeout)])


@contextmanager
def stopped(engine):
    engine.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        engine.proc.send_signal(signal.SIGCONT)


def metric(gw, name: str, **labels) -> float:
    """The sum of ``name`` over the label sets that include ``labels``."""
    samples = scrape_metrics(gw.url)
    if not labels:
        return samples.get(name, 0.0)  # the bare name: already the sum over label sets
    want = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for key, value in samples.items():
        if key.startswith(name + "{") and want <= set(key[len(name) + 1:-1].split(",")):
            total += value
    return total


def wait_until(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


async def complete(session, url: str, i: int, stream: bool, max_tokens: int = 8) -> dict:
    """One completion read raw: its status, and its SSE events or JSON body."""
    body = {"model": "tiny", "prompt": f"hung {i}", "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True}
    out = {"status": None, "events": [], "body": None, "started": False}
    async with session.post(url + "/v1/completions", json=body) as r:
        out["status"] = r.status
        if r.status != 200 or not stream:
            out["body"] = await r.json()
            return out
        async for line in r.content:
            if line.startswith(b"data: "):
                out["events"].append(line[6:].strip())
    return out


def finished_ok(r: dict, stream: bool) -> bool:
    if r["status"] != 200:
        return False
    if not stream:
        return bool(r["body"]["choices"][0]["text"])
    return r["events"][-1] == b"[DONE]" and all(
        "error" not in json.loads(e) for e in r["events"][:-1])


def client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=HANG))


def test_requests_sent_to_a_stopped_engine_are_retried_and_it_returns_after_sigcont(engines):
    victim, healthy = engines
    gw = gateway(engines, "127.0.0.70")
    modes = [False, True] * 3  # round-robin: the victim gets streamed and non-streamed

    async def batch(first: int):
        async with client_session() as s:
            return await asyncio.gather(*(complete(s, gw.url, first + i, stream)
                                          for i, stream in enumerate(modes)))

    try:
        with stopped(victim):
            t0 = time.monotonic()
            results = asyncio.run(batch(0))
            took = time.monotonic() - t0
            bad = [r for r, stream in zip(results, modes) if not finished_ok(r, stream)]
            assert not bad, f"a request that had not started was not retried: {bad}"
            # Each of the victim's waits: TIMEOUT, the sweeper's tick, the probe's TIMEOUT,
            # then the healthy engine. Generous: a bound against a hang, not a benchmark.
            assert took < 8 * TIMEOUT + 10, took
            assert metric(gw, "llmserve_gateway_upstream_errors_total", endpoint=victim.url,
                          reason="timeout") >= 1
            assert metric(gw, "llmserve_gateway_upstream_stalls_total", endpoint=victim.url,
                          verdict="hung") >= 1
            assert metric(gw, "llmserve_gateway_retries_total") >= 1
            assert metric(gw, "llmserve_gateway_endpoints", state="ejected") == 1
            assert metric(gw, "llmserve_gateway_upstream_errors_total",
                          endpoint=healthy.url) == 0
            print(f"\n[hung] engine SIGSTOPped: {len(modes)} requests (half streamed), "
                  f"{metric(gw, 'llmserve_gateway_upstream_stalls_total', verdict='hung'):.0f}"
                  f" on the stopped engine, all completed in {took:.1f} s (timeouts "
                  f"{TIMEOUT:g} s); retries {metric(gw, 'llmserve_gateway_retries_total'):.0f}")

            # Ejected: later requests go to the healthy engine only, none waits on the
            # victim (its /health still fails, so the ejection is renewed).
            decisions = metric(gw, "llmserve_gateway_routing_decisions_total",
                               endpoint=victim.url)
            served = scrape_metrics(healthy.url)["vllm:request_success_total"]
            results = asyncio.run(batch(100))
            assert all(finished_ok(r, stream) for r, stream in zip(results, modes)), results
            assert metric(gw, "llmserve_gateway_routing_decisions_total",
                          endpoint=victim.url) == decisions
            assert scrape_metrics(healthy.url)["vllm:request_success_total"] == \
                served + len(modes)

        # SIGCONT: the health checks re-admit it and routing reaches it again.
        wait_until(lambda: metric(gw, "llmserve_gateway_endpoints", state="ejected") == 0,
                   "the engine was not re-admitted after SIGCONT")
        served = scrape_metrics(victim.url).get("vllm:request_success_total", 0.0)
        results = asyncio.run(batch(200))
        assert all(finished_ok(r, stream) for r, stream in zip(results, modes)), results
        assert scrape_metrics(victim.url)["vllm:request_success_total"] > served
        print(f"[hung] while stopped: {len(modes)} more requests, none routed to it; "
              f"SIGCONT: re-admitted, served again")
    finally:
        assert gw.stop() == 0


def test_a_stream_on_an_engine_that_hangs_ends_with_an_error_event_and_done(engines):
    """One engine only: its started stream cannot be retried (error event + [DONE]);
    requests that had not started have nowhere else to go (504, OpenAI-shaped)."""
    victim = engines[0]
    gw = gateway([victim], "127.0.0.73")

    async def main():
        async with client_session() as s:
            body = {"model": "tiny", "prompt": "a long one", "max_tokens": 1500,
                    "stream": True, "ignore_eos": True}
            events = []
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    events.append(line[6:].strip())
                    if len(events) == 3:
                        victim.proc.send_signal(signal.SIGSTOP)
                        # Sent while it is stopped: nothing of these reaches the client.
                        waiting = asyncio.gather(complete(s, gw.url, 1, stream=False),
                                                 complete(s, gw.url, 2, stream=True))
                        await asyncio.sleep(0.2)  # they are on their way to the victim
            return events, await waiting

    async def after():
        async with client_session() as s:
            return await complete(s, gw.url, 3, stream=True)

    try:
        t0 = time.monotonic()
        events, (plain, streamed) = asyncio.run(main())
        took = time.monotonic() - t0
        assert took < 4 * TIMEOUT + 20, took
        assert events[-1] == b"[DONE]"
        data = [json.loads(e) for e in events[:-1]]  # every event is whole JSON
        assert all("choices" in d for d in data[:-1]) and len(data) >= 4
        err = data[-1]["error"]
        assert err["code"] == "upstream_timeout" and err["type"] == "server_error"
        assert set(err) == {"message", "type", "param", "code"}
        for r in (plain, streamed):  # not SSE: the stream never started
            assert r["status"] == 504, r
            assert r["body"]["error"]["code"] == "upstream_timeout"
            assert set(r["body"]["error"]) == {"message", "type", "param", "code"}
        assert metric(gw, "llmserve_gateway_broken_streams_total") == 1
        # One probe found it hung; it ended all three waits on it at once.
        assert metric(gw, "llmserve_gateway_upstream_errors_total", reason="timeout") == 1
        assert metric(gw, "llmserve_gateway_upstream_stalls_total", verdict="hung") == 3
        assert metric(gw, "llmserve_gateway_requests_total", code="504") == 2
        print(f"\n[hung] lone engine SIGSTOPped mid-stream: the stream ended with "
              f"{len(data) - 1} events + error event + [DONE], 2 requests not started got "
              f"504; {took:.1f} s from the request to the end (timeouts {TIMEOUT:g} s)")

        victim.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: metric(gw, "llmserve_gateway_endpoints", state="ejected") == 0,
                   "the engine was not re-admitted after SIGCONT")
        assert finished_ok(asyncio.run(after()), stream=True)
        # What the gateway gave up on was aborted on the engine once it ran again.
        wait_until(lambda: idle(scrape_metrics(victim.url)),
                   "the engine kept requests the gateway had given up on")
    finally:
        victim.proc.send_signal(signal.SIGCONT)
        assert gw.stop() == 0


def idle(m: dict) -> bool:
    return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


def test_a_busy_engine_answers_the_probe_and_is_not_ejected(engines):
    """A non-streamed answer sends no head until its last token: far past a 1 s
    first-byte timeout here. The engine answers /health, so the request waits on."""
    engine = engines[1]
    gw = gateway([engine], "127.0.0.74", timeout=1.0)
    try:
        async def main():
            async with client_session() as s:
                return await complete(s, gw.url, 0, stream=False, max_tokens=1500)

        t0 = time.monotonic()
        r = asyncio.run(main())
        took = time.monotonic() - t0
        assert r["status"] == 200 and r["body"]["usage"]["completion_tokens"] == 1500, r
        assert took > 1.0, "too fast to test anything: raise max_tokens"
        assert metric(gw, "llmserve_gateway_upstream_stalls_total", verdict="busy") >= 1
        assert metric(gw, "llmserve_gateway_upstream_errors_total") == 0
        assert metric(gw, "llmserve_gateway_endpoints", state="ejected") == 0
        print(f"\n[hung] busy engine: a {took:.1f} s non-streamed answer past a 1 s "
              f"first-byte timeout: "
              f"{metric(gw, 'llmserve_gateway_upstream_stalls_total', verdict='busy'):.0f} "
              f"probes answered, not ejected, completed")
    finally:
        assert gw.stop() == 0


# --- in process: test_gateway_faults' fake engines, plus hanging ones ----------------------
class HangingEngine(FakeEngine):
    """Also hang_head (never answers) and hang_json (half a JSON body, then nothing);
    their /health hangs too, as a stopped process's does."""

    async def health(self, request):
        if self.mode.startswith("hang"):
            await asyncio.Event().wait()
        return await super().health(request)

    async def completions(self, request):
        if not self.mode.startswith("hang"):
            return await super().completions(request)
        self.hits += 1
        if self.mode == "hang_json":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(b'{"choices": [{"text": "par')
        await asyncio.Event().wait()


@pytest.fixture
def hanging(fleet, monkeypatch):  # noqa: F811 - the fixture imported above
    monkeypatch.setattr(test_gateway_faults, "FakeEngine", HangingEngine)
    return fleet


async def test_a_non_sse_body_that_hangs_is_cut_off_not_left_hanging(hanging):
    gw, client, engines = await hanging("hang_json", upstream_first_byte_timeout=0.3,
                                        upstream_idle_timeout=0.3)
    r = await client.post("/v1/completions", json={**BODY, "stream": False})
    assert r.status == 200  # the head went out before the engine stopped
    with pytest.raises(aiohttp.ClientPayloadError):
        await asyncio.wait_for(r.read(), 10)  # an error, not a short body or a hang
    assert gw.pool.endpoints[engines["hang_json"].url].ejected
    metrics = await (await client.get("/metrics")).text()
    assert 'reason="timeout"} 1.0' in metrics


async def test_a_client_leaving_a_hung_wait_leaves_nothing_behind(hanging):
    gw, client, engines = await hanging("hang_head", upstream_first_byte_timeout=30)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(client.post("/v1/completions", json=BODY), 0.5)
    for _ in range(50):  # the handler is cancelled as the connection closes
        if not gw.hangs.watches:
            break
        await asyncio.sleep(0.05)
    assert not gw.hangs.watches and not gw.hangs.probes
    assert not gw.pool.endpoints[engines["hang_head"].url].ejected  # nothing was judged


async def test_zero_timeouts_never_probe(hanging):
    gw, client, engines = await hanging("hang_head", upstream_first_byte_timeout=0,
                                        upstream_idle_timeout=0)
    pending = asyncio.create_task(client.post("/v1/completions", json=BODY))
    await asyncio.sleep(1.0)
    assert not pending.done() and not gw.hangs.probes
    assert not gw.pool.endpoints[engines["hang_head"].url].ejected
    pending.cancel()
