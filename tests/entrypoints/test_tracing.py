"""OpenTelemetry tracing (--otlp-traces-endpoint) across real gateway and engine
processes: each exports OTLP/HTTP to a small collector this test runs, which decodes
the spans with opentelemetry-proto."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from llmserve.entrypoints.launcher import ServerProcess
from llmserve.tracing import traces_url
from llmserve.utils import free_port
from tests.server_proc import ServerProcess as EngineProcess

# Export within 50 ms instead of the batch processor's default 5 s.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
KIND_SERVER, KIND_CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
STATUS_ERROR = 2  # Status.StatusCode


@dataclass
class Span:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    start: int  # epoch ns
    end: int
    attributes: dict
    status: int  # 0 unset, 1 ok, 2 error


def value_of(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value_of(x) for x in v.array_value.values]
    return getattr(v, kind)


class Collector:
    """An OTLP/HTTP trace receiver: POST /v1/traces with an ExportTraceServiceRequest."""

    def __init__(self, host: str = "127.0.0.83"):
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces":
                    collector.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, free_port(host)), Handler)
        self.url = f"http://{host}:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, req: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in req.resource_spans:
            service = {a.key: value_of(a.value) for a in rs.resource.attributes}["service.name"]
            for ss in rs.scope_spans:
                spans += [Span(service, s.name, s.kind, s.trace_id.hex(), s.span_id.hex(),
                               s.parent_span_id.hex(), s.start_time_unix_nano,
                               s.end_time_unix_nano,
                               {a.key: value_of(a.value) for a in s.attributes},
                               s.status.code) for s in ss.spans]
        with self.lock:
            self.spans += spans

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[tuple[str, str]],
                 timeout: float = 30.0) -> dict[tuple[str, str], Span]:
        """The trace's spans by (service, name), once all of ``names`` have arrived."""
        def arrived():
            by_name = {(s.service, s.name): s for s in self.trace(trace_id)}
            return by_name if names <= set(by_name) else None
        return poll(arrived, timeout, lambda: f"{names} of {self.trace(trace_id)}")

    def roots(self, name: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.name == name and not s.parent_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def poll(fn, timeout: float, what):
    deadline = time.monotonic() + timeout
    while (found := fn()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"never arrived: {what()}")
        time.sleep(0.05)
    return found


ENGINE = "llmserve-engine"
GATEWAY = "llmserve-gateway"
ENGINE_SPANS = {(ENGINE, n) for n in ("llm_request", "queue", "prefill", "decode")}


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.close()


@pytest.fixture(scope="module")
def traced(tiny_llama, collector):
    """A traced engine behind a traced gateway."""
    flag = ["--otlp-traces-endpoint", collector.url]
    engine = EngineProcess(str(tiny_llama), host="127.0.0.81",
                           extra=["--served-model-name", "tiny", *flag], env=FAST_EXPORT)
    gateway = ServerProcess(["gateway", "--backend", engine.url, "--log-level", "WARNING",
                             *flag], "127.0.0.82", env=FAST_EXPORT)
    yield engine, gateway
    assert gateway.stop() == 0
    engine.stop()


def new_traceparent() -> tuple[str, str, str]:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent}-01", trace_id, parent


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def check_engine_spans(spans: dict, parent_id: str, usage, max_tokens: int) -> Span:
    """The engine's request span and its phases: where they hang, their order, their
    attributes."""
    req = spans[(ENGINE, "llm_request")]
    assert req.kind == KIND_SERVER and req.parent_id == parent_id
    queue, prefill, decode = (spans[(ENGINE, n)] for n in ("queue", "prefill", "decode"))
    for s in (queue, prefill, decode):
        assert s.parent_id == req.span_id
        assert req.start <= s.start <= s.end <= req.end
    # Back to back: queued until first scheduled, prefill until the first token, decode.
    assert req.start == queue.start and queue.end == prefill.start
    assert prefill.end == decode.start and decode.end == req.end
    a = req.attributes
    assert a["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == usage.completion_tokens
    assert a["gen_ai.request.max_tokens"] == max_tokens
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.request.n"] == 1 and a["gen_ai.request.id"]
    assert {"gen_ai.request.temperature", "gen_ai.request.top_p"} <= set(a)
    seconds = (req.end - req.start) / 1e9
    assert a["gen_ai.latency.e2e"] == pytest.approx(seconds, abs=1e-3)
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(
        (queue.end - queue.start) / 1e9, abs=1e-3)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(
        (prefill.end - req.start) / 1e9, abs=1e-3)
    assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(
        (prefill.end - prefill.start) / 1e9, abs=1e-3)
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(
        (decode.end - decode.start) / 1e9, abs=1e-3)
    assert req.status != STATUS_ERROR
    return req


def test_one_trace_from_the_client_through_gateway_and_engine(traced, collector):
    _, gateway = traced
    traceparent, trace_id, client_span = new_traceparent()
    r = client(gateway.url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "trace me"}], max_tokens=8,
        temperature=0, extra_headers={"traceparent": traceparent})
    spans = collector.wait_for(trace_id, {(GATEWAY, "POST /v1/chat/completions"),
                                          (GATEWAY, "route"), *ENGINE_SPANS})
    server, route = spans[(GATEWAY, "POST /v1/chat/completions")], spans[(GATEWAY, "route")]
    # Both processes' spans are in the client's trace, the gateway's span its child.
    assert server.kind == KIND_SERVER and server.parent_id == client_span
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.request.model"] == "tiny"
    assert route.kind == KIND_CLIENT and route.parent_id == server.span_id
    assert route.attributes["llmserve.endpoint"] == traced[0].url
    assert server.start <= route.start <= route.end <= server.end
    # The engine's span is the route's child, inside it in time.
    req = check_engine_spans(spans, route.span_id, r.usage, max_tokens=8)
    assert route.start <= req.start and req.end <= route.end
    assert req.attributes["gen_ai.response.finish_reasons"] == [r.choices[0].finish_reason]


def test_a_streamed_completion_starts_a_trace_at_the_gateway(traced, collector):
    _, gateway = traced
    stream = client(gateway.url).completions.create(
        model="tiny", prompt="count with me:", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None][-1]
    # No traceparent: the gateway's span is the root of a new trace.
    roots = poll(lambda: collector.roots("POST /v1/completions") or None, 30, lambda: "")
    assert len(roots) == 1
    spans = collector.wait_for(roots[0].trace_id, {(GATEWAY, "route"), *ENGINE_SPANS})
    check_engine_spans(spans, spans[(GATEWAY, "route")].span_id, usage, max_tokens=12)


def test_a_cancelled_stream_ends_its_spans_with_an_error(traced, collector):
    _, gateway = traced
    traceparent, trace_id, _ = new_traceparent()
    stream = client(gateway.url).completions.create(
        model="tiny", prompt="go on and on", max_tokens=1500, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, extra_headers={"traceparent": traceparent})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client leaves mid-stream
    spans = collector.wait_for(trace_id, {(GATEWAY, "route"), *ENGINE_SPANS})
    req = spans[(ENGINE, "llm_request")]
    assert req.status == STATUS_ERROR
    assert 3 <= req.attributes["gen_ai.usage.completion_tokens"] < 1500
    assert spans[(ENGINE, "decode")].end == req.end
    assert spans[(GATEWAY, "route")].status == STATUS_ERROR


def test_without_the_flag_nothing_is_exported(tiny_llama, collector):
    """Processes without --otlp-traces-endpoint export nothing, even with the SDK's
    environment pointing at a collector."""
    env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url + "/v1/traces",
           "OTEL_TRACES_EXPORTER": "otlp"}
    engine = EngineProcess(str(tiny_llama), host="127.0.0.84",
                           extra=["--served-model-name", "tiny"], env=env)
    gateway = ServerProcess(["gateway", "--backend", engine.url, "--log-level", "WARNING"],
                            "127.0.0.85", env=env)
    traceparent, trace_id, _ = new_traceparent()
    try:
        r = client(gateway.url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={"traceparent": traceparent})
        assert r.usage.completion_tokens >= 1
    finally:
        assert gateway.stop() == 0
        engine.stop()  # a provider, had there been one, would flush now
    time.sleep(0.5)
    assert collector.trace(trace_id) == []


def test_tracing_off_loads_no_sdk():
    """Off costs nothing: the gateway builds with a no-op tracer and no SDK."""
    code = ("import sys\n"
            "from llmserve.gateway.server import Gateway, GatewayConfig, build_app\n"
            "gw = Gateway(GatewayConfig(backends=[]))\n"
            "app = build_app(gw)\n"
            "assert not gw.tracing.enabled and len(app.middlewares) == 2\n"
            "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')]\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ},
                   timeout=60)


def test_the_endpoint_must_be_an_http_url():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("https://c:4318/") == "https://c:4318/v1/traces"
    assert traces_url("http://c:4318/custom/path") == "http://c:4318/custom/path"
    for bad in ("localhost:4317", "grpc://c:4317", "collector"):
        with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
            traces_url(bad)
    from llmserve.config import EngineConfig
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        EngineConfig(device="cpu", otlp_traces_endpoint="localhost:4317")


def test_up_hands_the_endpoint_to_its_engines_and_gateway(capsys):
    import argparse

    from llmserve.entrypoints.cli import add_up_parser, engine_argv, gateway_config, main
    parser = argparse.ArgumentParser()
    add_up_parser(parser.add_subparsers())
    args = parser.parse_args(["up", "--otlp-traces-endpoint", "http://c:4318"])
    argv = engine_argv(args)  # what `up` starts its engines with
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://c:4318"
    assert gateway_config(args, []).otlp_traces_endpoint == "http://c:4318"
    # A bad URL is refused before any engine starts (their stderr is not shown).
    assert main(["up", "--otlp-traces-endpoint", "localhost:4317"]) == 2
    assert "--otlp-traces-endpoint must be" in capsys.readouterr().err
