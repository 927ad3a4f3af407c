"""The OpenAI-compatible server, through real processes and the official client."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import aiohttp
import openai
import pytest

from llmserve import LLM, SamplingParams
from tests.server_proc import ServerProcess, scrape


@pytest.fixture(scope="module")
def server(tiny_llama):
    proc = ServerProcess(str(tiny_llama), extra=["--served-model-name", "tiny"])
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory=64 << 20)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def text_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "the a cache block token engine model gateway stream batch prefix kernel".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(n)]


def test_completion_matches_offline_greedy(client, offline):
    prompt = text_prompts(1)[0]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert r.choices[0].text == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("length", "stop")


def test_chat_streaming_equals_non_streaming(client, offline):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=15,
                                          temperature=0)
    ref = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=15))[0]
    assert full.choices[0].message.content == ref.outputs[0].text
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=15,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for ev in stream:
        if ev.usage:
            usage = ev.usage
        for ch in ev.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == ref.outputs[0].text
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert usage.prompt_tokens == len(ref.prompt_token_ids)


def test_completion_stream_and_n2_with_seed(client):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=8, n=2, seed=5,
                                  temperature=1.0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 16
    texts = {}
    for ev in client.completions.create(model="tiny", prompt="hello", max_tokens=8, n=2, seed=5,
                                        temperature=1.0, stream=True):
        for ch in ev.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {c.index: c.text for c in r.choices}


def test_logprobs_chat_and_completion(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.logprob <= 0 and abs(tok.logprob - tok.top_logprobs[0].logprob) < 1e-5
    c = client.completions.create(model="tiny", prompt="x y z", max_tokens=4, temperature=0,
                                  logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == 4
    assert all(len(t) <= 2 for t in c.choices[0].logprobs.top_logprobs)


def test_stop_string(client, offline):
    prompt = text_prompts(1, seed=3)[0]
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=20,
                                                    ignore_eos=True))[0].outputs[0].text
    stop = ref[len(ref) // 2: len(ref) // 2 + 2]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref[:ref.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(ev.choices[0].text for ev in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if ev.choices)
    assert streamed == r.choices[0].text


def test_models_health_version_tokenize(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    for path in ("/health", "/version", "/openapi.json"):
        with urllib.request.urlopen(server.url + path) as r:
            assert r.status == 200
            json.loads(r.read())
    req = urllib.request.Request(server.url + "/tokenize", data=b'{"prompt": "hello world"}',
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        toks = json.loads(r.read())["tokens"]
    req = urllib.request.Request(server.url + "/detokenize",
                                 data=json.dumps({"tokens": toks}).encode())
    with urllib.request.urlopen(req) as r:
        assert json.loads(r.read())["prompt"] == "hello world"


def test_32_concurrent_streams_all_complete(server, offline):
    prompts = text_prompts(32, seed=1)
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=24))

    async def one(c, p):
        out = ""
        async for ev in await c.completions.create(model="tiny", prompt=p, max_tokens=24,
                                                   temperature=0, stream=True):
            out += "".join(ch.text for ch in ev.choices)
        return out

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(one(c, p) for p in prompts))

    outs = asyncio.run(main())
    assert outs == [r.outputs[0].text for r in refs]


@pytest.mark.parametrize("prompts", [1, 3])
def test_closing_a_stream_closes_its_requests_at_once(prompts):
    """A response that stops reading (an error mid-stream, a client gone) closes the
    outputs it reads, and with them every engine request's generator, whose cleanup
    aborts it: then, not when the garbage collector gets to them. A single prompt is
    read without a pump task (serving_engine.interleave), and must close as promptly."""
    from llmserve.entrypoints.openai.serving_engine import interleave
    closed = []

    async def request(i):
        try:
            for n in range(100):
                yield n
                await asyncio.sleep(0)
        finally:
            closed.append(i)

    async def main():
        outputs = interleave([request(i) for i in range(prompts)])
        async for _, n in outputs:
            if n == 2:
                break
        await outputs.aclose()
        return sorted(closed)

    assert asyncio.run(main()) == list(range(prompts))


def test_disconnects_abort_and_free_blocks(server):
    idle = scrape(server.url)["vllm:kv_cache_usage_perc"]

    async def stream(session, i, leave_early):
        body = {"model": "tiny", "prompt": f"request {i} " * 20, "max_tokens": 200,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        chunks, completion_tokens = 0, None
        async with session.post(server.url + "/v1/completions", json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    chunks += 1
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        completion_tokens = event["usage"]["completion_tokens"]
                if leave_early and chunks == 3:
                    return "left"
        return completion_tokens

    async def main():
        async with aiohttp.ClientSession() as s:
            results = await asyncio.gather(*(stream(s, i, i % 2 == 0) for i in range(32)))
        return results

    results = asyncio.run(main())
    assert results.count("left") == 16
    assert all(r == 200 for r in results if r != "left")
    metrics = scrape(server.url)
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:num_requests_waiting"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == idle
    assert metrics['vllm:request_success_total{finished_reason="abort",model_name="tiny"}'] >= 16


def test_metrics_use_vllm_names(server, client):
    client.completions.create(model="tiny", prompt="metrics please", max_tokens=3)
    m = scrape(server.url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count"):
        assert name in m, name
    assert m['vllm:num_requests_running{model_name="tiny"}'] == 0
    assert m["vllm:generation_tokens_total"] >= 3
