"""/v1/responses in the gateway's own parts: the admission estimate of a Responses body
(it has no prompt or messages), the usage read from its stream (events with an
``event:`` line, the usage inside the final response), the OpenAPI paths it serves,
and, through a real tenanted gateway and engine, that a response (streamed or not)
charges its tenant exactly the tokens it used."""

from __future__ import annotations

import json
import time

import openai
import pytest

from llmserve.entrypoints.launcher import ServerProcess as Process
from llmserve.entrypoints.launcher import scrape_metrics
from llmserve.entrypoints.openai.openapi import openapi_document
from llmserve.gateway.admission import CHARS_PER_TOKEN, estimate_tokens
from llmserve.gateway.openapi import cut_to_gateway
from llmserve.gateway.usage import UsageTap, ask_for_usage
from tests.server_proc import ServerProcess

TPM = 1_000_000  # never reached: the gauge of what is left shows what was charged


# --- the estimate -----------------------------------------------------------------------------
def test_the_estimate_counts_instructions_input_text_and_max_output_tokens():
    body = {"instructions": "i" * 40, "max_output_tokens": 7, "input": [
        {"role": "user", "content": "u" * 80},
        {"role": "user", "content": [{"type": "input_text", "text": "p" * 20},
                                     {"type": "input_text", "text": "q" * 20}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "a" * 16},
        {"type": "function_call_output", "call_id": "c", "output": "o" * 24}]}
    assert estimate_tokens(body, "responses") == (40 + 80 + 40 + 16 + 24) // CHARS_PER_TOKEN + 7
    text = {"input": "x" * 400, "max_output_tokens": 3}
    assert estimate_tokens(text, "responses") == 100 + 3
    # A chat-only field does not set a Responses body's length.
    assert estimate_tokens({**text, "max_tokens": 5000}, "responses") == 103


def test_the_estimate_of_odd_responses_bodies_is_bounded_and_never_fails():
    no_length = estimate_tokens({"input": "hi"}, "responses")
    assert 1 <= no_length <= 300  # a default length, as chat gets
    for odd in ({}, {"input": None}, {"input": 5}, {"input": [1, None, {"content": 3}]},
                {"input": [{"content": [None, {"text": 9}]}], "max_output_tokens": "9"},
                {"input": "x", "max_output_tokens": True, "instructions": ["a"]}):
        assert 0 < estimate_tokens(odd, "responses") <= no_length


# --- the usage in the stream ------------------------------------------------------------------
def sse(kind: str, **data) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def usage(total: int) -> dict:
    return {"input_tokens": total - 2, "output_tokens": 2, "total_tokens": total}


@pytest.mark.parametrize("last", ["response.completed", "response.incomplete",
                                  "response.failed"])
def test_the_tap_reads_the_usage_of_the_final_response_event(last):
    payload = {"stream": True, "input": "hi"}
    assert not ask_for_usage(payload, "responses") and "stream_options" not in payload
    tap = UsageTap(stream=True, drop_usage_chunk=False)
    stream = (sse("response.created", response={"usage": None})
              + sse("response.output_text.delta", delta='"usage": {"total_tokens": 99}')
              + sse(last, response={"status": "x", "usage": usage(17)}))
    out = b"".join(tap.feed(stream[i:i + 5]) for i in range(0, len(stream), 5)) + tap.finish()
    assert out == stream  # every event passes, whole
    assert tap.total_tokens == 17


def test_the_tap_reads_a_whole_response_body():
    tap = UsageTap(stream=False, drop_usage_chunk=False)
    body = json.dumps({"object": "response", "usage": usage(23)}).encode()
    assert tap.feed(body) == body and tap.finish() == b""
    assert tap.total_tokens == 23


# --- the OpenAPI paths --------------------------------------------------------------------------
def test_the_gateway_document_keeps_the_responses_operation():
    doc = cut_to_gateway(openapi_document())
    assert doc["paths"]["/v1/responses"]["post"]["operationId"] == "createResponse"


# --- through a real tenanted gateway ------------------------------------------------------------
TENANTS = f"""
classes:
  - {{name: interactive, priority: 0, queueTimeoutSeconds: 60, maxQueued: 8}}
defaultClass: interactive
tenants:
  - {{name: streamer, apiKeys: ["sk-stream"], limits: {{tpm: {TPM}}}}}
  - {{name: whole, apiKeys: ["sk-whole"], limits: {{tpm: {TPM}}}}}
"""


@pytest.fixture(scope="module")
def gateway(tiny_llama, tmp_path_factory):
    engine = ServerProcess(str(tiny_llama), host="127.0.0.65",
                           extra=["--served-model-name", "tiny"])
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(TENANTS)
    gw = Process(["gateway", "--backend", engine.url, "--scrape-interval", "0.3",
                  "--log-level", "WARNING", "--tenants", str(path)], "127.0.0.66")
    yield gw
    assert gw.stop() == 0
    assert engine.stop() == 0


def charged(gw, tenant: str, expected: int) -> tuple[float, float]:
    """(tokens the gateway counted for the tenant, tokens its tpm window holds), once
    the count is ``expected`` or after a few seconds: the gateway accounts for a request
    just after its last byte went out, so a scrape can come a moment before."""
    deadline = time.monotonic() + 10
    while True:
        m = scrape_metrics(gw.url)
        left = m[f'llmserve_gateway_ratelimit_remaining{{kind="tokens",tenant="{tenant}"}}']
        got = m.get(f'llmserve_gateway_tenant_tokens_total{{tenant="{tenant}"}}', 0.0)
        if got == expected or time.monotonic() > deadline:
            return got, TPM - left
        time.sleep(0.05)


VERDICT = {"type": "json_schema", "name": "verdict", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["ok"],
    "properties": {"ok": {"type": "boolean"}}}}


def test_a_streamed_response_charges_its_real_usage(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-stream", max_retries=0)
    total = 0
    # One cut short by its length, one that ends by itself (its format closes it).
    for last, kw in (("response.incomplete", {"max_output_tokens": 5}),
                     ("response.completed", {"max_output_tokens": 40,
                                             "text": {"format": VERDICT}})):
        events = list(client.responses.create(
            model="tiny", instructions="Answer in JSON.", input="Is the sky blue?",
            temperature=0, stream=True, **kw))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == last
        total += events[-1].response.usage.total_tokens
        assert charged(gateway, "streamer", total) == (total, total)


def test_a_whole_response_charges_its_real_usage(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-whole", max_retries=0)
    r = client.responses.create(model="tiny", input="Hello " * 30, max_output_tokens=4,
                                temperature=0)
    assert charged(gateway, "whole", r.usage.total_tokens) == (r.usage.total_tokens,
                                                          r.usage.total_tokens)
