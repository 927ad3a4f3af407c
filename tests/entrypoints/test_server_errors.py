"""Bad input gets OpenAI-shaped 4xx errors and never disturbs the server."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.server_proc import ServerProcess, scrape


@pytest.fixture(scope="module")
def server(tiny_llama):
    proc = ServerProcess(str(tiny_llama), host="127.0.0.3",
                         extra=["--served-model-name", "tiny", "--max-model-len", "256"])
    yield proc
    assert proc.stop() == 0


def post(url: str, data: bytes | dict, headers: dict | None = None):
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    req = urllib.request.Request(url, data=raw, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_error(status, body, expected_status, param=None):
    assert status == expected_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err


C = "/v1/completions"
CHAT = "/v1/chat/completions"
CASES = [
    (C, b"{not json", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b'{"prompt": "\xff\xfe"}', 400, None),  # invalid UTF-8
    (C, b"[" * 100_000 + b"]" * 100_000, 400, None),  # nested past the parser's recursion
    (C, {"prompt": "x", "n": 10 ** 12}, 400, "n"),
    (C, {"prompt": "x", "max_tokens": 10 ** 30}, 400, "prompt"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 100000}, 400, "prompt"),
    (C, {"prompt": "x", "temperature": 3}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": True}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "x", "n": 99}, 400, "n"),
    (C, {"prompt": "x", "logprobs": 100}, 400, "logprobs"),
    (C, {"prompt": "x", "stop": [1, 2]}, 400, "stop"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": [10 ** 9]}, 400, "prompt"),
    (C, {"prompt": "word " * 400}, 400, "prompt"),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_tokens"),
    ("/tokenize", {"nothing": 1}, 400, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10 ** 7]}, 400, "tokens"),  # outside the vocabulary
]


@pytest.mark.parametrize("path,data,status,param", CASES)
def test_bad_requests_get_openai_errors(server, path, data, status, param):
    got_status, body = post(server.url + path, data)
    assert_error(got_status, body, status, param)


def test_unknown_route_and_oversized_body(server):
    status, body = post(server.url + "/v1/nothing", {})
    assert_error(status, body, 404)
    status, body = post(server.url + C, b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
    assert_error(status, body, 413)


def test_errors_change_nothing(server):
    before = scrape(server.url)
    for path, data, _, _ in CASES:
        post(server.url + path, data)
    after = scrape(server.url)
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["vllm:num_requests_running"] == 0
    assert after.get("vllm:prompt_tokens_total", 0) == before.get("vllm:prompt_tokens_total", 0)
    status, body = post(server.url + C, {"prompt": "still fine", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_api_key(tiny_llama):
    proc = ServerProcess(str(tiny_llama), host="127.0.0.4", env={"LLMSERVE_API_KEY": "s3cret"})
    try:
        status, body = post(proc.url + C, {"prompt": "x", "max_tokens": 2})
        assert_error(status, body, 401)
        status, body = post(proc.url + C, {"prompt": "x", "max_tokens": 2},
                            {"Authorization": "Bearer wrong"})
        assert_error(status, body, 401)
        ok = openai.OpenAI(base_url=proc.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=ok.models.list().data[0].id, prompt="x",
                                     max_tokens=2).usage.completion_tokens >= 1
        bad = openai.OpenAI(base_url=proc.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with urllib.request.urlopen(proc.url + "/health") as r:  # health needs no key
            assert r.status == 200
    finally:
        assert proc.stop() == 0


def test_sigterm_drains_in_flight_streams(tiny_llama):
    proc = ServerProcess(str(tiny_llama), host="127.0.0.5")
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
    result = {}
    streaming = threading.Event()

    def long_stream():
        text, finish = "", None
        for ev in client.completions.create(model=client.models.list().data[0].id,
                                            prompt="drain me", max_tokens=600, stream=True,
                                            extra_body={"ignore_eos": True}):
            streaming.set()
            for ch in ev.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        result["finish"] = finish

    t = threading.Thread(target=long_stream)
    t.start()
    assert streaming.wait(timeout=60)
    proc.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        with urllib.request.urlopen(proc.url + "/health", timeout=5) as r:
            health = r.status
    except urllib.error.HTTPError as e:
        health = e.code
    status, body = post(proc.url + C, {"prompt": "late", "max_tokens": 2})
    t.join(timeout=120)
    assert health == 503
    assert_error(status, body, 503)
    assert result.get("finish") == "length", "the in-flight stream was cut off"
    assert proc.proc.wait(timeout=30) == 0
