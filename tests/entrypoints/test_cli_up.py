"""`llmserve up` (what `make run` starts): its engines get exactly the engine flags it
was given (the overload ones included, named as under `serve`), its gateway the
tenants file, and the whole thing comes up, serves through its gateway and stops
cleanly."""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from llmserve.entrypoints.cli import (
    ENGINE_KEYS,
    add_engine_args,
    add_up_parser,
    engine_argv,
    engine_config,
    engine_kwargs,
    gateway_config,
    main,
)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(argv)


def test_engine_flags_round_trip_through_the_engine_command_line():
    for argv in ([], ["--compile", "--check-kv-integrity", "--quantization", "int8",
                      "--no-prefix-caching", "--no-chunked-prefill", "--max-num-seqs", "7",
                      "--dtype", "float32", "--kv-cache-memory", "12345",
                      "--tensor-parallel-size", "3", "--max-waiting", "2",
                      "--cuda-graphs", "--cuda-graph-sizes", "1,2"],
                 ["--enable-lora", "--lora-modules", "a=/x", "b=hf://o/r", "--max-loras", "2"]):
        given = parse(argv)
        again = parse(engine_argv(given))
        assert engine_kwargs(again) == engine_kwargs(given), argv
        assert set(engine_kwargs(given)) == set(ENGINE_KEYS)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_up(host: str, port: int, model, extra: list[str]) -> subprocess.Popen:
    """A real `llmserve up`, once its gateway answers /health."""
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", "up", "--model",
                             str(model), "--served-model-name", "tiny", "--host", host,
                             "--port", str(port), "--kv-cache-memory", str(32 << 20),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2):
                return proc
        except OSError:
            if time.monotonic() > deadline:
                stop(proc)
                raise AssertionError("llmserve up never became ready") from None
            time.sleep(0.3)


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


def test_up_serves_through_its_gateway_and_stops_cleanly(tiny_llama):
    host = "127.0.0.41"
    port = free_port(host)
    proc = start_up(host, port, tiny_llama, ["--check-kv-integrity"])  # a switch to pass on
    try:
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0)
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                        temperature=0)
        assert out.usage.completion_tokens == 5
    finally:
        assert stop(proc) == 0


def parse_up(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_up_parser(parser.add_subparsers())
    return parser.parse_args(["up", *argv])


def test_up_help_lists_the_overload_flags_and_the_tenants_file(capsys):
    with pytest.raises(SystemExit) as e:
        main(["up", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--max-waiting N", "--max-queue-delay S", "--tenants FILE",
                 "--gateway-max-waiting"):
        assert flag in text, flag


def test_up_overload_flags_go_to_the_engines_and_the_spill_over_to_the_gateway():
    args = parse_up(["--device", "cpu", "--max-waiting", "3", "--max-queue-delay", "2.5",
                     "--gateway-max-waiting", "5"])
    argv = engine_argv(args)  # what `up` starts its engines with
    assert argv[argv.index("--max-waiting") + 1] == "3"
    assert argv[argv.index("--max-queue-delay") + 1] == "2.5"
    config = engine_config(parse(argv))
    assert (config.max_waiting, config.max_queue_delay) == (3, 2.5)
    assert gateway_config(args, []).max_waiting == 5
    assert gateway_config(parse_up([]), []).max_waiting == 16  # the gateway's default


def test_up_refuses_a_bad_tenants_file_before_starting_engines(tmp_path, capsys,
                                                               monkeypatch):
    from llmserve.entrypoints import launcher

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started before the arguments were checked")
    monkeypatch.setattr(launcher, "ServerProcess", no_engine)
    monkeypatch.delenv("LLMSERVE_API_KEYS", raising=False)
    bad = tmp_path / "tenants.yaml"
    bad.write_text("classes: []\ntenants: []\n")
    assert main(["up", "--tenants", str(bad)]) == 2
    assert "classes must be a non-empty list" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text(TENANTS)
    keys = tmp_path / "keys"
    keys.write_text("k\n")
    for other_keys in (["--api-key", "k"], ["--api-key-file", str(keys)]):
        assert main(["up", "--tenants", str(good), *other_keys]) == 2
        assert "API keys come from the tenants file only" in capsys.readouterr().err
    monkeypatch.setenv("LLMSERVE_API_KEYS", "k")
    assert main(["up", "--tenants", str(good)]) == 2
    assert "API keys come from the tenants file only" in capsys.readouterr().err


TENANTS = """\
classes:
  - {name: interactive, priority: 0}
tenants:
  - name: acme
    apiKeys: ["sk-acme"]
  - name: trial
    apiKeys: ["sk-trial"]
    limits: {rpm: 1}
"""


def test_up_applies_the_tenants_file_and_the_engines_overload_bound(tiny_llama, tmp_path):
    """One sequence slot and --max-waiting 1: of a burst of long requests, one runs,
    one waits and the engine refuses the rest with 503 server_overloaded (unbounded,
    the default, it would queue them all). The tenants file: unknown keys are 401,
    a tenant's rpm limit is a 429."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    host = "127.0.0.42"
    port = free_port(host)
    # --max-in-flight 0: with a tenants file the gateway would otherwise hold the burst
    # in its own fair queue (one request per engine slot), and the engine's bound,
    # what this test is about, would never be reached.
    proc = start_up(host, port, tiny_llama, ["--max-num-seqs", "1", "--max-waiting", "1",
                                             "--tenants", str(tenants),
                                             "--max-in-flight", "0"])
    url = f"http://{host}:{port}/v1"
    try:
        def client(key):
            return openai.OpenAI(base_url=url, api_key=key, max_retries=0)

        with pytest.raises(openai.AuthenticationError):
            client("sk-unknown").completions.create(model="tiny", prompt="Hi", max_tokens=2)
        client("sk-trial").completions.create(model="tiny", prompt="Hi", max_tokens=2)
        with pytest.raises(openai.RateLimitError):
            client("sk-trial").completions.create(model="tiny", prompt="Hi", max_tokens=2)
        outcomes = asyncio.run(burst(url, "sk-acme", 12))
        served = [o for o in outcomes if not isinstance(o, Exception)]
        refused = [o for o in outcomes if isinstance(o, openai.APIStatusError)]
        assert len(served) + len(refused) == 12, outcomes
        assert served and all(o.usage.completion_tokens == 200 for o in served)
        assert refused, "--max-waiting 1 never refused a request"
        for e in refused:
            assert e.status_code == 503 and e.response.headers.get("retry-after")
            assert e.body["type"] == "server_overloaded", e.body
    finally:
        assert stop(proc) == 0


async def burst(url: str, key: str, n: int) -> list:
    client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
    async with client:
        return await asyncio.gather(*[
            client.completions.create(model="tiny", prompt=f"burst {i}", max_tokens=200,
                                      temperature=0, extra_body={"ignore_eos": True})
            for i in range(n)], return_exceptions=True)


def test_overload_flags_reach_the_engine_config():
    from llmserve.entrypoints.cli import engine_config
    given = parse(["--max-waiting", "3", "--max-queue-delay", "2.5", "--device", "cpu"])
    assert parse(engine_argv(given)).engine_max_waiting == 3
    config = engine_config(given)
    assert (config.max_waiting, config.max_queue_delay) == (3, 2.5)
    assert engine_config(parse(["--device", "cpu"])).max_waiting is None


def test_up_gives_its_api_key_to_the_gateway_not_to_the_environment(monkeypatch, capsys):
    """`up --api-key K`: the gateway accepts K because its config says so; nothing is
    written to os.environ, so the engines it starts inherit no key."""
    import os

    import llmserve.gateway.server as server
    from llmserve.entrypoints import launcher
    started, served = [], []

    class Engine:
        url = "http://127.0.0.1:1"

        def __init__(self, args, host, **kwargs):
            started.append((args, kwargs.get("env")))

        def stop(self):
            return 0

    async def gateway(config, host, port, ready=None):
        served.append(config)

    monkeypatch.setattr(launcher, "ServerProcess", Engine)
    monkeypatch.setattr(server, "serve_gateway", gateway)
    monkeypatch.delenv("LLMSERVE_API_KEYS", raising=False)
    assert main(["up", "--api-key", "sk-up", "--engines", "2"]) == 0
    assert "LLMSERVE_API_KEYS" not in os.environ
    [config] = served
    keys = server.ApiKeys(config.api_key_file, server.listed_keys(config))
    assert keys.check("Bearer sk-up") and not keys.check("Bearer other")
    assert len(started) == 2
    assert all("sk-up" not in args and env is None for args, env in started)
    assert "Authorization: Bearer sk-up" in capsys.readouterr().out
    monkeypatch.setenv("LLMSERVE_API_KEYS", "sk-env")  # without --api-key: the environment's
    assert server.listed_keys(gateway_config(parse_up([]), [])) == "sk-env"
