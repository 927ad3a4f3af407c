"""Prefill/decode disaggregation at the gateway (gateway/disagg.py): the two legs.

Recording stand-ins for engines show what each leg carries (the contract's shapes,
client params stripped, every fallback); real engine processes behind a real gateway,
driven by the official openai client, show that requests succeed whatever the prefill
pool does, and (once engines take --kv-role) that P/D output equals a direct engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from dataclasses import fields

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmserve.entrypoints.launcher import ServerProcess, scrape_metrics
from llmserve.gateway.disagg import leg1_body, prompt_size, strip_client_params
from llmserve.gateway.server import Gateway, GatewayConfig, build_app
from tests.server_proc import ServerProcess as EngineProcess

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
          "remote_host": "127.0.0.1", "remote_port": 5600, "remote_lease_id": "lease-1",
          "remote_block_ids": [3, 4, 5], "num_tokens": 40, "expires_at": 2e9, "model": "tiny"}
# vLLM's NixlConnector answer: no lease (a decode engine of ours would answer 400).
VLLM_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "v",
               "remote_block_ids": [1, 2], "remote_host": "10.0.0.1", "remote_port": 5600,
               "tp_size": 1}
LONG = "the quick brown fox jumps over the lazy dog " * 80  # ~3.5 kB: > 256 tokens for sure
SHORT = "hello there"


# --- pure parts ------------------------------------------------------------------------
def test_leg1_body_is_the_contracts_shape():
    client = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
              "stream_options": {"include_usage": True}, "n": 3, "best_of": 3,
              "max_completion_tokens": 50, "min_tokens": 5, "seed": 7, "priority": 2}
    leg1 = json.loads(leg1_body(client))
    assert leg1 == {"model": "m", "messages": client["messages"], "stream": False, "n": 1,
                    "max_tokens": 1, "max_completion_tokens": 1, "seed": 7, "priority": 2,
                    "kv_transfer_params": {"do_remote_decode": True}}
    assert client["stream"] is True and client["n"] == 3  # the client's body is untouched


def test_client_params_are_stripped_and_prompts_sized():
    body = {"prompt": "x", "kv_transfer_params": None}
    assert strip_client_params(body) and body == {"prompt": "x"}
    assert not strip_client_params(body)
    ids = prompt_size({"prompt": list(range(300))}, chat=False)
    assert ids.low == ids.high == 300  # token ids: exact
    text = prompt_size({"prompt": LONG}, chat=False)
    assert text.low >= 256 and text.high >= len(LONG.encode())
    chat = prompt_size({"messages": [{"role": "user", "content": SHORT}]}, chat=True)
    assert chat.high < 256  # certainly short: no /tokenize needed


def test_the_gateway_still_runs_without_torch():
    """disagg.py checks a prefill engine's params with the engines' own parser
    (distributed/kv_transfer/params.py), which must stay free of torch."""
    code = ("import sys; import llmserve.gateway.server, llmserve.gateway.disagg; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- recording stand-ins ---------------------------------------------------------------
class Stub:
    """A fake engine: records each body it is sent; ``answer`` says how leg 1 ends."""

    def __init__(self):
        self.bodies: list[tuple[str, dict]] = []
        self.answer = "params"  # params | null | 500 | 400 | overloaded | hang
        self.token_count = 1000
        self.cancelled = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/health", self.empty)
        app.router.add_get("/metrics", self.empty)
        return app

    async def empty(self, request):
        return web.Response(text="")

    async def tokenize(self, request):
        self.bodies.append((request.path, await request.json()))
        return web.json_response({"count": self.token_count})

    async def generate(self, request):
        body = await request.json()
        self.bodies.append((request.path, body))
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return await self.prefill()
        usage = {"prompt_tokens": 900, "completion_tokens": 2, "total_tokens": 902}
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "ok", "index": 0}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "ok", "index": 0}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def prefill(self):
        if self.answer == "hang":
            try:
                await asyncio.sleep(60)
            finally:
                self.cancelled.set()
        if self.answer in ("500", "400"):
            return web.json_response({"error": {"message": "no"}}, status=int(self.answer))
        if self.answer == "overloaded":
            return web.json_response({"error": {"type": "server_overloaded"}}, status=503)
        params = {"params": PARAMS, "vllm": VLLM_PARAMS}.get(self.answer)
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})

    def sent(self, path_end="completions") -> list[dict]:
        return [b for p, b in self.bodies if p.endswith(path_end)]


@pytest.fixture
async def stubs():
    prefill, decode = Stub(), Stub()
    servers = [TestServer(s.app(), handler_cancellation=True) for s in (prefill, decode)]
    for s in servers:
        await s.start_server()
    prefill.url, decode.url = (str(s.make_url("")).rstrip("/") for s in servers)
    yield prefill, decode
    for s in servers:
        await s.close()


@contextlib.asynccontextmanager
async def gateway_client(decode, prefill_urls, **config):
    """A gateway in front of ``decode`` (and the prefill pool), and a client of it."""
    gw = Gateway(GatewayConfig(backends=[decode.url], prefill_backends=prefill_urls,
                               scrape_interval=0.2, **config))
    await gw.start()
    client = TestClient(TestServer(build_app(gw), handler_cancellation=True))
    await client.start_server()
    try:
        yield gw, client
    finally:
        await client.close()
        await gw.close()


def pd_count(gw, mode, reason="") -> float:
    return gw.metrics.pd_requests.labels(mode, reason)._value.get()


async def test_the_two_legs_carry_what_the_contract_says(stubs):
    prefill, decode = stubs
    async with gateway_client(decode, [prefill.url]) as (gw, client):
        sent = {"model": "tiny", "prompt": LONG, "max_tokens": 20, "stream": True,
                "kv_transfer_params": {"remote_host": "evil", "do_remote_prefill": True}}
        r = await client.post("/v1/completions", json=sent)
        assert r.status == 200 and b"[DONE]" in await r.read()
        [leg1] = prefill.sent()
        assert leg1["max_tokens"] == 1 and leg1["stream"] is False and leg1["n"] == 1
        assert leg1["kv_transfer_params"] == {"do_remote_decode": True}  # not the client's
        [leg2] = decode.sent()
        client_body = {k: v for k, v in sent.items() if k != "kv_transfer_params"}
        assert leg2 == {**client_body, "kv_transfer_params": PARAMS}
        assert pd_count(gw, "disaggregated") == 1
        assert gw.metrics.pd_prefill_latency._sum.get() > 0


async def test_client_params_never_reach_an_engine(stubs):
    prefill, decode = stubs
    async with gateway_client(decode, [prefill.url]) as (gw, client):
        bogus = {"remote_host": "10.0.0.9", "remote_lease_id": "someone-elses"}
        for prompt in (SHORT, LONG):
            prefill.answer = "null"  # a fallback: leg 2 must carry nothing either
            r = await client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 2, "kv_transfer_params": bogus})
            assert r.status == 200
        for body in decode.sent():
            assert "kv_transfer_params" not in body
        assert all(b["kv_transfer_params"] == {"do_remote_decode": True}
                   for b in prefill.sent())
    async with gateway_client(decode, []) as (gw, client):  # no prefill pool at all: stripped too
        r = await client.post("/v1/completions", json={
            "prompt": LONG, "max_tokens": 2, "kv_transfer_params": bogus})
        assert r.status == 200 and "kv_transfer_params" not in decode.sent()[-1]


async def test_what_pd_cannot_help_goes_direct(stubs):
    prefill, decode = stubs
    async with gateway_client(decode, [prefill.url]) as (gw, client):
        cases = [({"prompt": SHORT}, "short_prompt"),
                 ({"prompt": LONG, "echo": True, "logprobs": 1}, "echo"),
                 ({"prompt": LONG, "prompt_logprobs": 0}, "prompt_logprobs"),
                 ({"prompt": LONG, "use_beam_search": True, "n": 2}, "beam_search"),
                 ({"prompt": [LONG, LONG]}, "batch")]
        for body, reason in cases:
            r = await client.post("/v1/completions", json={**body, "max_tokens": 2})
            assert r.status == 200, reason
            assert pd_count(gw, "direct", reason) == 1, reason
        assert prefill.bodies == [] and len(decode.sent()) == len(cases)


async def test_prompts_near_the_threshold_are_counted_by_the_prefill_engine(stubs):
    prefill, decode = stubs
    async with gateway_client(decode, [prefill.url]) as (gw, client):
        middling = "word " * 200  # 1000 bytes: 125 to 1002 tokens, the bytes cannot tell
        for count, mode in ((100, "direct"), (300, "disaggregated")):
            prefill.token_count = count
            messages = [{"role": "user", "content": middling}]
            r = await client.post("/v1/chat/completions", json={"messages": messages,
                                                                "model": "tiny"})
            assert r.status == 200
            assert prefill.bodies[-1 if mode == "direct" else -2] == (
                "/tokenize", {"messages": messages, "model": "tiny"})
            assert pd_count(gw, mode, "short_prompt" if mode == "direct" else "") == 1


@pytest.mark.parametrize("answer,reason,ejected", [
    ("null", "no_params", False), ("500", "status", True), ("400", "rejected", False),
    ("overloaded", "overloaded", False), ("hang", "timeout", True),
    ("vllm", "bad_params", False)])
async def test_a_failed_prefill_leg_falls_back_to_the_decode_pool(stubs, answer, reason,
                                                                  ejected):
    prefill, decode = stubs
    prefill.answer = answer
    async with gateway_client(decode, [prefill.url], pd_prefill_timeout=0.5) as (gw, client):
        r = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": LONG}]})
        assert r.status == 200 and (await r.json())["usage"]["total_tokens"] == 902
        assert "kv_transfer_params" not in decode.sent()[-1]
        assert pd_count(gw, "fallback", reason) == 1
        assert gw.disagg.pool.endpoints[prefill.url].ejected is ejected
        if ejected:  # the next request does not wait on it again
            r = await client.post("/v1/completions", json={"prompt": LONG})
            assert r.status == 200 and pd_count(gw, "fallback", "no_endpoint") == 1


async def test_a_client_gone_during_the_prefill_leg_cancels_it(stubs):
    prefill, decode = stubs
    prefill.answer = "hang"
    async with gateway_client(decode, [prefill.url]) as (gw, client):
        request = asyncio.create_task(client.post("/v1/completions", json={"prompt": LONG}))
        for _ in range(100):
            if prefill.sent():
                break
            await asyncio.sleep(0.05)
        request.cancel()
        await asyncio.wait_for(prefill.cancelled.wait(), 10)  # leg 1's connection closed
        await asyncio.sleep(0.2)
        assert decode.sent() == [] and gw.disagg.pending() == 0
        assert gw.disagg.pool.endpoints[prefill.url].in_flight == 0


async def test_tenants_see_one_request_and_its_decode_usage(stubs, tmp_path):
    prefill, decode = stubs
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("classes:\n  - {name: interactive, priority: 3}\n"
                       "defaultClass: interactive\n"
                       "tenants:\n  - name: acme\n    apiKeys: [k-acme]\n")
    async with gateway_client(decode, [prefill.url], tenants_file=str(tenants),
                              max_in_flight=4) as (gw, client):
        r = await client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2},
                              headers={"Authorization": "Bearer k-acme"})
        assert r.status == 200
        assert gw.metrics.tenant_tokens.labels("acme")._value.get() == 902  # decode's usage
        [leg1], [leg2] = prefill.sent(), decode.sent()
        assert leg1["priority"] == leg2["priority"] == 3  # the class rides both legs
        requests = gw.metrics.requests.labels("/v1/completions", "200", "acme", "interactive",
                                              "ok", "", "")._value.get()  # no model named
        assert requests == 1


# --- real engines behind a real gateway ----------------------------------------------
def start_gateway(decode, prefill_urls, host, extra=()) -> ServerProcess:
    args = ["gateway", "--scrape-interval", "0.3", "--log-level", "WARNING",
            "--backend", decode.url, *extra]
    for url in prefill_urls:
        args += ["--prefill-backend", url]
    return ServerProcess(args, host)


def kv_roles_supported() -> bool:
    from llmserve.config import EngineConfig
    return any(f.name == "kv_role" for f in fields(EngineConfig))


@pytest.fixture(scope="module")
def decode_engine(tiny_llama):
    proc = EngineProcess(str(tiny_llama), host="127.0.0.61",
                         extra=["--served-model-name", "tiny", "--dtype", "float32"])
    yield proc
    proc.stop()


def pd_modes(gw) -> dict[str, float]:
    m = scrape_metrics(gw.url)
    return {k.split("{", 1)[1].rstrip("}"): v for k, v in m.items()
            if k.startswith("llmserve_gateway_pd_requests_total{")}


def test_a_dead_prefill_port_fails_no_request(decode_engine):
    gw = start_gateway(decode_engine, ["http://127.0.0.63:9"], "127.0.0.60")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    try:
        for i in range(3):
            out = client.completions.create(model="tiny", prompt=f"{i} {LONG}", max_tokens=3)
            assert out.usage.completion_tokens == 3
        stream = client.chat.completions.create(
            model="tiny", max_tokens=3, stream=True,
            messages=[{"role": "user", "content": f"streamed {LONG}"}])
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        # Refused once, then ejected: the rest do not knock again.
        assert pd_modes(gw) == {'mode="fallback",reason="connection"': 1.0,
                                'mode="fallback",reason="no_endpoint"': 3.0}
    finally:
        gw.stop()


def test_a_stopped_then_killed_prefill_engine_fails_no_request(tiny_llama, decode_engine):
    prefill = EngineProcess(str(tiny_llama), host="127.0.0.62",
                            extra=["--served-model-name", "tiny"])
    gw = start_gateway(decode_engine, [prefill.url], "127.0.0.60",
                       extra=["--pd-prefill-timeout", "3"])
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    try:
        # Until engines hold KV (--kv-role prefill), a prefill engine answers null params.
        out = client.completions.create(model="tiny", prompt=f"live {LONG}", max_tokens=3)
        assert out.usage.completion_tokens == 3
        prefill.proc.send_signal(signal.SIGSTOP)  # hung: leg 1 times out, then skipped
        for i in range(2):
            chat = client.chat.completions.create(
                model="tiny", max_tokens=3,
                messages=[{"role": "user", "content": f"stopped {i} {LONG}"}])
            assert chat.usage.completion_tokens == 3
        prefill.proc.send_signal(signal.SIGKILL)  # gone for good
        stream = client.completions.create(model="tiny", prompt=f"gone {LONG}",
                                           max_tokens=3, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices)
        modes = pd_modes(gw)
        assert modes.get('mode="fallback",reason="timeout"') == 1
        assert sum(modes.values()) == 4
    finally:
        prefill.proc.send_signal(signal.SIGCONT)
        gw.stop()
        prefill.stop()


def test_short_prompts_and_client_params_through_real_engines(decode_engine):
    gw = start_gateway(decode_engine, ["http://127.0.0.65:9"], "127.0.0.64")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    try:
        out = client.completions.create(model="tiny", prompt=SHORT, max_tokens=2)
        assert out.usage.completion_tokens == 2
        assert pd_modes(gw) == {'mode="direct",reason="short_prompt"': 1.0}
        # Malformed params (an engine that reads them answers 400): stripped, so served.
        out = client.completions.create(model="tiny", prompt=SHORT, max_tokens=2,
                                        extra_body={"kv_transfer_params": "not an object"})
        assert out.usage.completion_tokens == 2
    finally:
        gw.stop()


@pytest.mark.skipif(not kv_roles_supported(), reason="engines do not take --kv-role yet")
def test_prefill_and_decode_engines_equal_a_direct_one(tiny_llama, decode_engine):
    """1 prefill + 1 decode engine behind the gateway answer as one colocated engine
    (``decode_engine``, --kv-role both) does, streamed and not; a conversation's second
    turn moves only the blocks its decode engine lacks."""
    # The transport is the engines' tests' subject (tests/worker/test_kv_transport.py); here the
    # plain TCP one keeps the legs' test independent of NIXL on a loaded CPU machine.
    roles = {role: EngineProcess(str(tiny_llama), host=host, extra=[
        "--served-model-name", "tiny", "--dtype", "float32", "--kv-role", role,
        "--kv-transfer-backend", "tcp", "--kv-transfer-port", "0",
        "--kv-transfer-host", host]) for role, host in (
            ("prefill", "127.0.0.67"), ("decode", "127.0.0.68"))}
    gw = start_gateway(roles["decode"], [roles["prefill"].url], "127.0.0.66")
    via = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    direct = openai.OpenAI(base_url=decode_engine.url + "/v1", api_key="x", max_retries=0)
    try:
        for stream in (False, True):
            prompt = f"stream={stream} {LONG}"
            before = kv_tokens(roles["prefill"], "sent")
            got, want = (complete(c, prompt, stream) for c in (via, direct))
            assert got == want and len(want) > 0
            assert kv_tokens(roles["prefill"], "sent") > before
        messages = [{"role": "system", "content": LONG},
                    {"role": "user", "content": "and then?"}]
        moved = []
        for _ in range(2):  # two turns
            before = kv_tokens(roles["decode"], "received")
            got, want = (chat(c, messages) for c in (via, direct))
            assert got[0] == want[0]
            moved.append((kv_tokens(roles["decode"], "received") - before, got[1]))
            messages += [{"role": "assistant", "content": got[0]},
                         {"role": "user", "content": "go on"}]
        (first, prompt1), (second, prompt2) = moved
        assert first > 0 and 0 <= second <= prompt2 - prompt1 + 16  # one block of slack
        assert pd_modes(gw).get('mode="disaggregated",reason=""') == 4
    finally:
        gw.stop()
        for p in roles.values():
            p.stop()


def kv_tokens(engine, direction: str) -> float:
    return sum(v for k, v in scrape_metrics(engine.url).items() if k.startswith(
        f'llmserve:kv_transfer_tokens_total{{direction="{direction}"'))


def complete(client, prompt, stream) -> str:
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                    temperature=0, stream=stream)
    if not stream:
        return out.choices[0].text
    return "".join(c.choices[0].text for c in out if c.choices)


def chat(client, messages) -> tuple[str, int]:
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                         temperature=0)
    return out.choices[0].message.content, out.usage.prompt_tokens


def test_gateway_flags_reach_the_config(monkeypatch, capsys):
    import llmserve.gateway.server as server
    from llmserve.entrypoints import cli
    parser_args = ["gateway", "--backend", "http://d:8000", "--prefill-backend", "http://p:1",
                   "--prefill-backend", "http://p:2", "--pd-min-prompt-tokens", "512",
                   "--prefill-k8s-service", "ns/pre"]
    captured = {}

    def fake_serve(config, host, port):
        captured["config"] = config
        return asyncio.sleep(0)

    monkeypatch.setattr(server, "serve_gateway", fake_serve)
    assert cli.main(parser_args) == 0
    config = captured["config"]
    assert config.prefill_backends == ["http://p:1", "http://p:2"]
    assert config.prefill_k8s_service == "ns/pre" and config.pd_min_prompt_tokens == 512
    assert cli.main(["gateway", "--backend", "http://d:8000",
                     "--prefill-k8s-service", "pre"]) != 0
    assert "--prefill-k8s-service must be NAMESPACE/NAME" in capsys.readouterr().err

