"""OpenTelemetry tracing for the engine server and the gateway (``--otlp-traces-endpoint``).

Off by default, and then free: no provider, a no-op tracer, nothing imported but the
API. On, spans go to an OTLP/HTTP collector through a batching processor (a thread
that exports every few seconds; the provider's shutdown flushes it). The W3C
``traceparent`` header carries a trace from the client through the gateway to the
engine. Attribute names are vLLM's (its ``vllm/tracing.py``), so what reads vLLM's
traces reads ours.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmserve import envs

TRACE_HEADERS = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()


class SpanAttributes:
    """vLLM's span attribute names: the OpenTelemetry GenAI conventions' and its own."""
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP URL to post spans to: a collector's base URL
    (``http://collector:4318``) gets the standard path ``/v1/traces``; a URL with a path
    is taken as it is."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be the http(s) URL of an OTLP/HTTP "
                         f"collector, e.g. http://localhost:4318; got {endpoint!r}")
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


class Tracing:
    """A process's tracer: a no-op one without ``endpoint``, else one whose spans are
    exported to it under ``service_name`` ($OTEL_SERVICE_NAME overrides, e.g. to tell
    a prefill pool from a decode pool)."""

    def __init__(self, service_name: str, endpoint: str | None = None):
        self.provider = None
        self.tracer: Tracer = trace.NoOpTracer()
        if endpoint:
            self.provider = _provider(envs.OTEL_SERVICE_NAME or service_name,
                                      traces_url(endpoint))
            self.tracer = self.provider.get_tracer("llmserve")

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def shutdown(self) -> None:
        """Export what is still batched (blocks up to the exporter's timeout)."""
        if self.provider is not None:
            self.provider.shutdown()


def _provider(service_name: str, url: str):
    # The SDK and exporter load only when tracing is on.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    return provider


def extract_context(headers: Mapping[str, str]) -> Context:
    """The caller's trace context from its ``traceparent`` / ``tracestate`` headers; an
    empty one (so a new trace) when they are absent or malformed."""
    return _PROPAGATOR.extract(headers)


def inject_context(headers: MutableMapping[str, str]) -> None:
    """Put the current span's context into outgoing ``headers``, replacing any the
    caller sent (the next hop's spans are then children of ours)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return
    for name in [k for k in headers if k.lower() in TRACE_HEADERS]:
        del headers[name]
    _PROPAGATOR.inject(headers)


@contextmanager
def current_span(tracer: Tracer, name: str, **kwargs) -> Iterator[Span]:
    """``tracer.start_as_current_span``, which also marks a cancelled span as an error
    (the API records only ``Exception``s; a client that leaves cancels the handler)."""
    with tracer.start_as_current_span(name, **kwargs) as span:
        try:
            yield span
        except BaseException as e:
            if not isinstance(e, Exception):
                span.set_status(Status(StatusCode.ERROR, "cancelled"))
            raise


def set_error(span: Span, error: BaseException | None) -> None:
    """Mark ``span`` as failed by ``error``, or as cancelled when it is not an
    ``Exception`` (a CancelledError, a closed generator)."""
    if isinstance(error, Exception):
        span.set_attribute("error.type", type(error).__qualname__)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    else:
        span.set_status(Status(StatusCode.ERROR, "cancelled"))


class WallClock:
    """``time.monotonic()`` readings (what the engine stamps requests with) as the
    epoch nanoseconds spans are timed in."""

    def __init__(self):
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(self, t: float) -> int:
        return round(t * 1e9) + self.offset_ns
