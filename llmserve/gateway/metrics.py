"""The gateway's own Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("llmserve_gateway_requests", "Requests answered.",
                                ["path", "code"], registry=r)
        self.upstream_errors = Counter("llmserve_gateway_upstream_errors",
                                       "Upstream failures (connection errors, 5xx).",
                                       ["endpoint"], registry=r)
        self.upstream_overloaded = Counter(
            "llmserve_gateway_upstream_overloaded",
            "Upstream 503 server_overloaded answers (retried elsewhere, not ejected).",
            ["endpoint"], registry=r)
        self.broken_streams = Counter(
            "llmserve_gateway_broken_streams",
            "Responses whose upstream failed after the first byte (SSE: ended with an "
            "error event and [DONE]).", registry=r)
        self.retries = Counter("llmserve_gateway_retries",
                               "Requests retried on another endpoint.", registry=r)
        self.decisions = Counter("llmserve_gateway_routing_decisions",
                                 "Routing decisions by endpoint and reason.",
                                 ["endpoint", "reason"], registry=r)
        self.in_flight = Gauge("llmserve_gateway_in_flight", "In-flight requests per endpoint.",
                               ["endpoint"], registry=r)
        self.queued = Gauge("llmserve_gateway_queued_requests",
                            "Requests waiting for any endpoint to exist (scale from zero).",
                            registry=r)
        self.endpoints = Gauge("llmserve_gateway_endpoints", "Known endpoints by state.",
                               ["state"], registry=r)
        self.upstream_latency = Histogram(
            "llmserve_gateway_upstream_latency_seconds",
            "Time from forwarding a request to the upstream's response headers.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r)
