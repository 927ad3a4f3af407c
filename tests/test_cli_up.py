"""`llmserve up` (what `make run` starts): its engines get exactly the engine flags it
was given, and the whole thing comes up, serves through its gateway and stops cleanly."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai

from llmserve.cli import ENGINE_KEYS, add_engine_args, engine_argv


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(argv)


def test_engine_flags_round_trip_through_the_engine_command_line():
    for argv in ([], ["--compile", "--check-kv-integrity", "--quantization", "int8",
                      "--no-prefix-caching", "--no-chunked-prefill", "--max-num-seqs", "7",
                      "--dtype", "float32", "--kv-cache-memory", "12345",
                      "--tensor-parallel-size", "3"]):
        given = parse(argv)
        again = parse(engine_argv(given))
        assert {k: getattr(again, k) for k in ENGINE_KEYS} == {
            k: getattr(given, k) for k in ENGINE_KEYS}, argv


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def test_up_serves_through_its_gateway_and_stops_cleanly(tiny_llama):
    host = "127.0.0.41"
    port = free_port(host)
    proc = subprocess.Popen([sys.executable, "-m", "llmserve.cli", "up", "--model",
                             str(tiny_llama), "--served-model-name", "tiny", "--host", host,
                             "--port", str(port), "--kv-cache-memory", str(32 << 20),
                             "--check-kv-integrity"],  # a switch `up` must pass on
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "llmserve up never became ready"
                time.sleep(0.3)
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="x", max_retries=0)
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                        temperature=0)
        assert out.usage.completion_tokens == 5
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_overload_flags_reach_the_engine_config():
    from llmserve.cli import engine_config
    given = parse(["--max-waiting", "3", "--max-queue-delay", "2.5", "--device", "cpu"])
    assert parse(engine_argv(given)).engine_max_waiting == 3
    config = engine_config(given)
    assert (config.max_waiting, config.max_queue_delay) == (3, 2.5)
    assert engine_config(parse(["--device", "cpu"])).max_waiting is None
