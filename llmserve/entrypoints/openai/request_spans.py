"""The engine's spans of one request (``--otlp-traces-endpoint``), made as vLLM makes
them: once the request has ended, an ``llm_request`` span from its arrival to its end,
a child of the caller's trace context (the gateway's route span), with children for
the time it spent queued, prefilling and decoding. They are built from the timestamps
the engine recorded (those the Prometheus latency histograms are computed from), so
tracing adds nothing to the engine's loop. A request that fails or is cancelled still
gets its spans, with an error status.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Tracer

from llmserve.core.sampling_params import SamplingParams
from llmserve.engine.output import RequestOutput
from llmserve.tracing import SpanAttributes as A
from llmserve.tracing import Tracing, WallClock, extract_context, set_error

TRACING = web.AppKey("tracing", Tracing)


@dataclass
class RequestTrace:
    """What a request's spans need from its HTTP request."""
    tracer: Tracer
    parent: Context  # the caller's trace context
    model: str


def request_trace(request: web.Request, model: str) -> RequestTrace | None:
    """None when tracing is off: the engine's requests then go untouched."""
    tracing = request.app[TRACING]
    if not tracing.enabled:
        return None
    return RequestTrace(tracing.tracer, extract_context(request.headers), model)


async def traced(outputs: AsyncIterator[RequestOutput], rt: RequestTrace, request_id: str,
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
    """One engine request's ``outputs`` (deltas, or one final output), passed through;
    when they end (finished, failed, or closed early by a client that left) the
    request's spans are made."""
    created = time.monotonic()
    usage = Usage()
    error: BaseException | None = None
    try:
        async with contextlib.aclosing(outputs):  # closing us aborts the request
            async for out in outputs:
                usage.add(out)
                yield out
    except BaseException as e:
        error = e
        raise
    finally:
        record(rt, request_id, params, usage, created, error)


class Usage:
    """What a request's outputs added up to."""

    def __init__(self):
        self.last: RequestOutput | None = None
        self.completion_tokens = 0
        self.finish_reasons: dict[int, str] = {}  # by choice index

    def add(self, out: RequestOutput) -> None:
        self.last = out
        for c in out.outputs:
            self.completion_tokens += len(c.token_ids)
            if c.finish_reason:
                self.finish_reasons[c.index] = c.finish_reason


def record(rt: RequestTrace, request_id: str, params: SamplingParams, usage: Usage,
           created: float, error: BaseException | None) -> None:
    end, clock = time.monotonic(), WallClock()
    last = usage.last
    stamps = last.metrics if last is not None else {}
    arrival = stamps.get("arrival_time") or created  # no output: failed before the queue
    span = rt.tracer.start_span(
        "llm_request", context=rt.parent, kind=SpanKind.SERVER, start_time=clock.ns(arrival),
        attributes=request_attributes(rt.model, request_id, params))
    marks = (("queue", arrival), ("prefill", stamps.get("first_scheduled_time")),
             ("decode", stamps.get("first_token_time")))
    inside = trace.set_span_in_context(span)
    for name, start, stop in phases(marks, end) if last is not None else ():
        rt.tracer.start_span(name, context=inside, start_time=clock.ns(start)).end(
            end_time=clock.ns(stop))
    span.set_attributes(latency_attributes(arrival, stamps, end))
    if last is not None:
        span.set_attributes(usage_attributes(last, usage))
    if last is None or not last.finished:  # failed, or cancelled (error None or not)
        set_error(span, error)
    span.end(end_time=clock.ns(end))


def phases(marks, end: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of each phase the request reached: queued from its arrival
    until first scheduled, prefilling until its first token, decoding until the end."""
    reached = [(name, t) for name, t in marks if t is not None]
    ends = [t for _, t in reached[1:]] + [end]
    return [(name, t, stop) for (name, t), stop in zip(reached, ends)]


def request_attributes(model: str, request_id: str, params: SamplingParams) -> dict:
    attrs = {A.GEN_AI_REQUEST_ID: request_id, A.GEN_AI_REQUEST_MODEL: model,
             A.GEN_AI_RESPONSE_MODEL: model, A.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
             A.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
             A.GEN_AI_REQUEST_TOP_P: params.top_p, A.GEN_AI_REQUEST_N: params.n}
    return {k: v for k, v in attrs.items() if v is not None}


def latency_attributes(arrival: float, stamps: dict, end: float) -> dict:
    """Seconds, as vLLM reports them; a phase the request never reached is left out."""
    scheduled, first = stamps.get("first_scheduled_time"), stamps.get("first_token_time")
    attrs = {A.GEN_AI_LATENCY_E2E: end - arrival}
    if scheduled is not None:
        attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE] = scheduled - arrival
    if first is not None:
        attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first - arrival
        attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = end - first
        if scheduled is not None:
            attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first - scheduled
    return attrs


def usage_attributes(out: RequestOutput, usage: Usage) -> dict:
    reasons = [usage.finish_reasons[i] for i in sorted(usage.finish_reasons)]
    attrs = {A.GEN_AI_USAGE_PROMPT_TOKENS: len(out.prompt_token_ids),
             A.GEN_AI_USAGE_COMPLETION_TOKENS: usage.completion_tokens}
    if reasons:
        attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = reasons
    return attrs
