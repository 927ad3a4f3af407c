"""Chaos with real processes on loopback: engines SIGKILLed under load behind a real
gateway, a gateway replica SIGKILLed beside another, slow clients against the real
servers. What must hold: no request that had not started streaming is lost, a
started stream ends with an error event and [DONE] (never a hang), the dead engine
is ejected and re-admitted once it is back."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import openai
import pytest

from llmserve.entrypoints.launcher import scrape_metrics
from tests.gateway.test_gateway import start_gateway
from tests.gateway.test_gateway_faults import raw_exchange
from tests.server_proc import ServerProcess as EngineProcess

HANG = 30  # seconds without a byte: a request that goes quiet this long has hung


@pytest.fixture(scope="module")
def fleet(tiny_llama):
    engines = [EngineProcess(str(tiny_llama), host=f"127.0.0.{41 + i}",
                             extra=["--served-model-name", "tiny", "--num-threads", "1"])
               for i in range(3)]
    # Gateway A also cuts slow clients off after 2 s. (Only A: a header timeout below a
    # client's keep-alive, e.g. httpx's 5 s, races the client reusing an idle connection.)
    gateways = [start_gateway(engines, host="127.0.0.40", extra=[
        "--policy", "round-robin", "--header-timeout", "2", "--body-timeout", "2"]),
        start_gateway(engines, host="127.0.0.44", extra=["--policy", "round-robin"])]
    yield engines, gateways
    for p in gateways + engines:
        p.stop()


async def sse_request(session, url, i, started: asyncio.Event | None = None) -> dict:
    """One streamed completion read raw; what happened to it."""
    body = {"model": "tiny", "prompt": f"chaos {i}", "max_tokens": 80, "stream": True,
            "ignore_eos": True}
    out = {"i": i, "status": None, "events": [], "started": False}
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            out["status"] = r.status
            if r.status != 200:
                out["body"] = await r.text()
                return out
            async for line in r.content:
                if line.startswith(b"data: "):
                    out["events"].append(line[6:].strip())
                    if not out["started"]:
                        out["started"] = True
                        if started is not None:
                            started.set()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out["exc"] = repr(e)  # a timeout here is a hang: HANG s without a byte
    return out


def outcome(r: dict) -> str:
    ev = r["events"]
    if r["status"] != 200 or "exc" in r:
        return "failed"
    if ev and ev[-1] == b"[DONE]":
        # Parsed, not a substring test: a sampled chunk's text can be "error".
        if len(ev) >= 2 and "error" in json.loads(ev[-2]):
            err = json.loads(ev[-2])["error"]
            assert set(err) == {"message", "type", "param", "code"}
            return "broken-with-error-event"
        return "ok"
    return "cut"  # ended with neither [DONE] nor an error event


def test_sigkill_an_engine_under_load_loses_nothing_that_had_not_started(fleet, tiny_llama):
    engines, (gw, _) = fleet
    victim = engines[0]

    async def main():
        timeout = aiohttp.ClientTimeout(total=None, sock_read=HANG)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            first = [asyncio.create_task(sse_request(s, gw.url, i)) for i in range(12)]
            deadline = time.monotonic() + 30
            # Kill once the victim is streaming: round-robin gave it a third of the load.
            while scrape_metrics(victim.url)["vllm:num_requests_running"] < 3:
                assert time.monotonic() < deadline, "the victim never got load"
                await asyncio.sleep(0.05)
            victim.proc.send_signal(signal.SIGKILL)
            later = [asyncio.create_task(sse_request(s, gw.url, 100 + i)) for i in range(9)]
            return await asyncio.gather(*first), await asyncio.gather(*later)

    first, later = asyncio.run(main())
    victim.proc.wait(10)
    kinds = [outcome(r) for r in first]
    assert "cut" not in kinds and "failed" not in kinds, [
        (k, r) for k, r in zip(kinds, first) if k in ("cut", "failed")]
    assert kinds.count("broken-with-error-event") >= 1, "streams on the victim were cut"
    assert all(r["started"] for r, k in zip(first, kinds) if k != "ok")
    # Everything sent after the kill had not started there: all of it completes.
    assert [outcome(r) for r in later] == ["ok"] * len(later), later
    m = scrape_metrics(gw.url)
    assert m.get("llmserve_gateway_retries_total", 0) >= 1, "the victim's share was retried"
    assert m['llmserve_gateway_endpoints{state="ejected"}'] == 1
    print(f"\n[chaos] engine SIGKILL: in flight {len(first)}: "
          f"{kinds.count('ok')} completed, {kinds.count('broken-with-error-event')} started "
          f"streams ended with error event + [DONE], 0 cut, 0 failed before streaming; "
          f"sent after the kill {len(later)}: all completed; gateway retries "
          f"{m.get('llmserve_gateway_retries_total', 0):.0f}, broken streams "
          f"{m.get('llmserve_gateway_broken_streams_total', 0):.0f}")

    # Back on the same address: re-admitted at its first healthy scrape.
    revived = EngineProcess(str(tiny_llama), host=victim.host, port=victim.port,
                            extra=["--served-model-name", "tiny", "--num-threads", "1"])
    engines[0] = revived
    t_revive = time.monotonic()
    deadline = time.monotonic() + 30
    while scrape_metrics(gw.url)['llmserve_gateway_endpoints{state="ejected"}'] != 0:
        assert time.monotonic() < deadline, "the revived engine was not re-admitted"
        time.sleep(0.2)
    print(f"[chaos] revived engine healthy -> re-admitted in "
          f"{time.monotonic() - t_revive:.1f} s")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    for i in range(6):
        client.completions.create(model="tiny", prompt=f"again {i}", max_tokens=2)
    assert scrape_metrics(revived.url).get("vllm:request_success_total", 0) >= 1, \
        "routing reached the revived engine again"
    for e in engines:  # nothing leaked on any engine
        m = scrape_metrics(e.url)
        assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
        assert m["vllm:kv_cache_usage_perc"] == 0.0


def test_slow_clients_against_the_real_servers(fleet):
    engines, (gw, _) = fleet
    head = [b"POST /v1/completions HTTP/1.1\r\n", b"Host: x\r\n"] + \
        [f"X-Slow-{i}: y\r\n".encode() for i in range(60)]
    got, took = raw_exchange(gw.host, gw.port, head, 0.2, 15)
    assert got == b"" and took < 6, (got, took)
    print(f"\n[chaos] slow head closed after {took:.1f} s (--header-timeout 2)")
    body_head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                 b"Content-Type: application/json\r\n\r\n{")
    got, took = raw_exchange(gw.host, gw.port, [body_head] + [b" "] * 60, 0.2, 15)
    assert got.startswith(b"HTTP/1.1 408") and took < 6, (got, took)
    print(f"[chaos] slow body answered 408 and closed after {took:.1f} s (--body-timeout 2)")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices


def test_killing_one_gateway_replica_is_invisible_to_the_others_clients(fleet):
    engines, (gw_a, gw_b) = fleet
    client = openai.AsyncOpenAI(base_url=gw_b.url + "/v1", api_key="x", max_retries=0)

    async def through_b(i):
        stream = await client.completions.create(
            model="tiny", prompt=f"replica {i}", max_tokens=40, stream=True,
            extra_body={"ignore_eos": True})
        n = 0
        async for ev in stream:
            n += sum(1 for c in ev.choices if c.text)
        return n

    async def main():
        async with aiohttp.ClientSession() as s:
            on_a = [asyncio.create_task(sse_request(s, gw_a.url, i)) for i in range(4)]
            on_b = [asyncio.create_task(through_b(i)) for i in range(8)]
            await asyncio.sleep(0.5)
            gw_a.proc.send_signal(signal.SIGKILL)
            more_b = [asyncio.create_task(through_b(100 + i)) for i in range(4)]
            results = await asyncio.gather(*on_b, *more_b)  # raises if any failed
            await asyncio.gather(*on_a)
            return results

    results = asyncio.run(main())
    assert all(n > 0 for n in results) and len(results) == 12
    print(f"\n[chaos] gateway A SIGKILLed: {len(results)}/12 streams through B completed")
    assert gw_a.proc.wait(10) == -signal.SIGKILL
