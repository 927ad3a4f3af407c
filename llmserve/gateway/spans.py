"""The gateway's spans (``--otlp-traces-endpoint``): a server span per API request, a
child of the client's ``traceparent`` when it sent one. Inside it, ``queue`` (the
tenants' admission and fair queue, or the wait for an endpoint to exist) and ``route``
(the choice of engine and the upstream call, whose context the engine receives in
``traceparent``, so its spans are the route's children) are made where they happen
(admission.py, server.py)."""

from __future__ import annotations

from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from llmserve.tracing import current_span, extract_context


def server_span_middleware(tracer: Tracer):
    """Outermost, so it sees the status the other middlewares answer with. Probes and
    scrapes (/health, /metrics) are not traced."""
    @web.middleware
    async def trace_request(request: web.Request, handler):
        if not request.path.startswith("/v1/"):
            return await handler(request)
        with current_span(tracer, f"{request.method} {request.path}",
                          context=extract_context(request.headers), kind=SpanKind.SERVER,
                          attributes={"http.request.method": request.method,
                                      "url.path": request.path}) as span:
            resp = await handler(request)
            span.set_attribute("http.response.status_code", resp.status)
            if resp.status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {resp.status}"))
            return resp
    return trace_request
