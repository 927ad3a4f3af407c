"""Overload without collapse: a bounded waiting queue and queueing delay answered 503
with Retry-After, a full swap space falling back to recompute, and KV memory that
never exceeds what was configured."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.core.sched.overload import OverloadedError
from llmserve.engine.llm_engine import LLMEngine
from tests.engine.test_prefix_preemption import BLOCK_BYTES_TINY, GREEDY
from tests.server_proc import ServerProcess, scrape


# --- in process -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=64 << 20,
                                  max_num_seqs=1, max_waiting=2, max_queue_delay=5.0))


def drain(engine):
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.check_all_free()


def test_max_waiting_refuses_only_new_requests(engine):
    params = SamplingParams(max_tokens=4, **GREEDY)
    # Idle, one free slot (max_num_seqs=1): one request will run, two may wait.
    for i in range(3):
        engine.add_request([5, 6, i], params)
    with pytest.raises(OverloadedError) as e:
        engine.add_request([5, 6, 9], params)
    assert e.value.retry_after_header == "5"
    assert len(engine.requests) == 3, "a refused request leaves nothing behind"
    engine.step()  # one runs, two wait: full
    with pytest.raises(OverloadedError):
        engine.add_request([5, 6, 10], params)
    drain(engine)
    assert not engine.requests
    engine.add_request([5, 6, 11], params)  # room again
    drain(engine)


def test_max_queue_delay_expires_only_requests_that_never_ran(engine):
    params = SamplingParams(max_tokens=30, **GREEDY)
    running = engine.add_request([9, 8, 7], params)
    engine.step()
    waiting = engine.add_request([9, 8, 6], params)
    assert running.first_scheduled_time is not None and waiting.first_scheduled_time is None
    assert engine.expire_waiting(now=time.monotonic() + 1) == []
    gone = engine.expire_waiting(now=time.monotonic() + 6)
    assert gone == [waiting.request_id]
    assert waiting.request_id not in engine.requests
    assert running.request_id in engine.requests, "a running request is never expired"
    drain(engine)


def test_full_swap_space_falls_back_to_recompute_and_outputs_hold(tiny_llama):
    """Swap space for only a few blocks: some preemptions swap, the rest must recompute
    (never fail, never wait for swap room), the outputs equal an unconstrained run's,
    and the KV memory allocated never exceeds what was configured."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(20, 90))] for _ in range(10)]
    params = SamplingParams(max_tokens=40, **GREEDY)
    free = [o.outputs[0].token_ids for o in
            LLM(str(tiny_llama), kv_cache_memory=64 << 20).generate(prompts, params)]
    kv_bytes, swap_bytes = 40 * BLOCK_BYTES_TINY, 8 * BLOCK_BYTES_TINY
    llm = LLM(str(tiny_llama), kv_cache_memory=kv_bytes, preemption_mode="swap",
              swap_space=swap_bytes, max_num_batched_tokens=64, watermark=0.0)
    tight = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    sched, kv = llm.engine.scheduler, llm.engine.runner.kv_cache
    assert tight == free
    assert sched.num_swapped_out > 0, "some preemptions did swap"
    assert sched.num_preemptions > sched.num_swapped_out, "a full swap space recomputed"
    assert kv.storage.nbytes <= kv_bytes
    assert kv.cpu_storage.nbytes <= swap_bytes
    llm.engine.block_manager.check_all_free()


# --- a real server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def overloaded(tiny_llama):
    proc = ServerProcess(str(tiny_llama), host="127.0.0.7", extra=[
        "--served-model-name", "tiny", "--max-num-seqs", "1", "--max-waiting", "2",
        "--max-queue-delay", "1.5", "--header-timeout", "1", "--body-timeout", "1"])
    yield proc
    assert proc.stop() == 0


async def stream(session, url, max_tokens, events: list):
    body = {"model": "tiny", "prompt": "hold the line", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return r.status, r.headers.get("Retry-After"), await r.json()
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(line)
        return r.status, None, events[-1]


def test_overloaded_server_answers_503_with_retry_after(overloaded):
    async def main():
        async with aiohttp.ClientSession() as s:
            first: list = []
            long = asyncio.create_task(stream(s, overloaded.url, 1500, first))
            while not first:  # the long request is running: max_num_seqs=1 is taken
                await asyncio.sleep(0.02)
            queued = [asyncio.create_task(stream(s, overloaded.url, 4, [])) for _ in range(2)]
            await asyncio.sleep(0.3)
            refused = await stream(s, overloaded.url, 4, [])  # a third would wait: refused
            expired = await asyncio.gather(*queued)  # waited > 1.5 s unscheduled
            long.cancel()
            return refused, expired

    refused, expired = asyncio.run(main())
    for status, retry_after, body in [refused, *expired]:
        assert status == 503 and retry_after and int(retry_after) >= 1, (status, body)
        assert body["error"]["type"] == "server_overloaded"
    assert "max_waiting" in refused[2]["error"]["message"]
    assert all("max_queue_delay" in b["error"]["message"] for _, _, b in expired)
    m = scrape(overloaded.url)
    assert m['llmserve:overload_rejections_total{model_name="tiny",reason="queue_full"}'] == 1
    assert m['llmserve:overload_rejections_total{model_name="tiny",reason="queue_delay"}'] == 2
    for _ in range(50):  # the cancelled stream is aborted; nothing is left behind
        m = scrape(overloaded.url)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.1)
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    ok = asyncio.run(_one(overloaded.url))
    assert ok["usage"]["completion_tokens"] == 3


async def _one(url):
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": "after", "max_tokens": 3, "ignore_eos": True}) as r:
        return json.loads(await r.read())


def test_a_started_stream_that_loses_a_prompt_ends_with_an_error_event(overloaded):
    """Two prompts in one streamed request, one sequence slot: the first streams, the
    second expires in the queue. The stream has started, so no HTTP error is
    possible any more: it ends with an OpenAI error event and [DONE]."""
    async def main():
        async with aiohttp.ClientSession() as s, s.post(
                overloaded.url + "/v1/completions", json={
                    # as long as the model allows: the first must outlast the second's
                    # queue delay, on a fast machine too
                    "model": "tiny", "prompt": ["first", "second"], "max_tokens": 2040,
                    "stream": True, "ignore_eos": True}) as r:
            assert r.status == 200
            return [line[6:].strip() async for line in r.content
                    if line.startswith(b"data: ")]

    events = asyncio.run(main())
    assert events[-1] == b"[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_overloaded" and "max_queue_delay" in err["message"]
    assert len(events) > 3, "tokens of the first prompt were streamed before"


def test_slow_clients_are_cut_off_by_the_engine_too(overloaded):
    from tests.gateway.test_gateway_faults import raw_exchange
    head = [b"POST /v1/completions HTTP/1.1\r\n"] + [b"X-Slow: y\r\n"] * 40
    got, took = raw_exchange(overloaded.host, overloaded.port, head, 0.2, 15)
    assert got == b"" and took < 5, (got, took)
    body_head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n"
                 b"Content-Type: application/json\r\n\r\n{")
    got, took = raw_exchange(overloaded.host, overloaded.port, [body_head] + [b" "] * 40,
                             0.2, 15)
    assert got.startswith(b"HTTP/1.1 408") and took < 5, (got, took)
    assert asyncio.run(_one(overloaded.url))["usage"]["completion_tokens"] == 3
