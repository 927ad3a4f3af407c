"""The gateway's own Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    return {429: "rate_limited", 503: "overloaded", 499: "cancelled"}.get(
        status, "rejected" if status < 500 else "error")


class GatewayMetrics:
    """Collectors grouped by what they measure, registered in this order (the order
    /metrics lists them in)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self._request_metrics()
        self._upstream_health_metrics()
        self._routing_metrics()
        self._disaggregation_metrics()
        self._tenant_metrics()

    def _request_metrics(self) -> None:
        # model / adapter: a request's base model and LoRA adapter ("" for the base
        # model itself); names no engine lists are "unknown" (models.labels_for).
        self.requests = Counter("llmserve_gateway_requests",
                                "Requests answered, by base model and LoRA adapter too.",
                                ["path", "code", "tenant", "class", "outcome", "model",
                                 "adapter"], registry=self.registry)

    def _upstream_health_metrics(self) -> None:
        """How engines failed, stalled or pushed back, and what the gateway did about it."""
        r = self.registry
        self.upstream_errors = Counter(
            "llmserve_gateway_upstream_errors",
            "Upstream failures, each of which ejects the endpoint, by reason: connection "
            "(error before the response head), status (5xx), broken (failed mid-body), "
            "timeout (hung: silent past --upstream-first-byte-timeout or "
            "--upstream-idle-timeout and /health unanswered).",
            ["endpoint", "reason"], registry=r)
        self.upstream_stalls = Counter(
            "llmserve_gateway_upstream_stalls",
            "Waits on an upstream that outlasted their timeout, by verdict: busy (its "
            "/health answered; the wait went on) or hung (the request was ended: retried "
            "elsewhere before its first byte, else ended as a broken stream).",
            ["endpoint", "verdict"], registry=r)
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

    def _routing_metrics(self) -> None:
        """Where requests went, what each endpoint holds, and how fast it answers."""
        r = self.registry
        self.decisions = Counter("llmserve_gateway_routing_decisions",
                                 "Routing decisions by endpoint and reason.",
                                 ["endpoint", "reason"], registry=r)
        self.in_flight = Gauge("llmserve_gateway_in_flight", "In-flight requests per endpoint.",
                               ["endpoint"], registry=r)
        self.queued = Gauge("llmserve_gateway_queued_requests",
                            "Requests waiting for an engine: for one to exist (scale from "
                            "zero) or, with tenants, for a turn in their class queue.",
                            registry=r)
        self.endpoints = Gauge("llmserve_gateway_endpoints", "Known endpoints by state.",
                               ["state"], registry=r)
        self.upstream_latency = Histogram(
            "llmserve_gateway_upstream_latency_seconds",
            "Time from forwarding a request to the upstream's response headers, by base "
            "model and LoRA adapter.", ["model", "adapter"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r)

    def _disaggregation_metrics(self) -> None:
        """Prefill/decode disaggregation, with a prefill pool (disagg.py)."""
        r = self.registry
        self.pd_requests = Counter(
            "llmserve_gateway_pd_requests",
            "Completions and chat requests by prefill/decode mode: disaggregated (leg 1 on "
            "a prefill engine, leg 2 with its KV on a decode engine); direct (P/D could not "
            "help; reason short_prompt, echo, prompt_logprobs, beam_search, batch); fallback "
            "(leg 1 could not run or gave nothing, the decode engine prefilled; reason "
            "no_endpoint, connection, timeout, status, overloaded, rejected, no_params, "
            "bad_params). Counted only with a prefill pool.",
            ["mode", "reason"], registry=r)
        self.pd_prefill_latency = Histogram(
            "llmserve_gateway_pd_prefill_seconds",
            "Leg 1 of a disaggregated request: from sending it to a prefill engine to its "
            "answer (or failure).", buckets=WAIT_BUCKETS, registry=r)
        self.prefill_endpoints = Gauge("llmserve_gateway_prefill_endpoints",
                                       "Known prefill endpoints by state.", ["state"],
                                       registry=r)

    def _tenant_metrics(self) -> None:
        """Class queues, limits and the replicas sharing them (with --tenants), and the
        time to first byte per class."""
        r = self.registry
        self.queue_depth = Gauge("llmserve_gateway_queue_depth",
                                 "Requests waiting in a class queue, per tenant.",
                                 ["class", "tenant"], registry=r)
        self.queue_wait = Histogram("llmserve_gateway_queue_wait_seconds",
                                    "Time from arrival to dispatch, per class and tenant.",
                                    ["class", "tenant"], buckets=WAIT_BUCKETS, registry=r)
        self.tenant_tokens = Counter("llmserve_gateway_tenant_tokens",
                                     "Tokens (prompt + completion) served per tenant.",
                                     ["tenant"], registry=r)
        self.ratelimit_remaining = Gauge(
            "llmserve_gateway_ratelimit_remaining",
            "What is left of this replica's share of a tenant's limit this minute.",
            ["tenant", "kind"], registry=r)
        self.peers = Gauge("llmserve_gateway_peers",
                           "Other gateway replicas sharing the limits, by whether their "
                           "counters are fresh (stale: this replica uses limit / replicas).",
                           ["state"], registry=r)
        self.ttft = Histogram("llmserve_gateway_ttft_seconds",
                              "Time from arrival to the first byte of the response, per "
                              "class, base model and LoRA adapter.",
                              ["class", "model", "adapter"], buckets=WAIT_BUCKETS, registry=r)
