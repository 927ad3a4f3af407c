"""Tenant admission for one gateway: who is asking, may they, and when it is their turn.

A request from a tenant goes through, in order: its API key names the tenant; its
``x-priority-class`` header (or the default) picks the class; its tenant's rate
limits admit it or answer 429; its class queue holds it until the fair queue
dispatches it (or answers 503); the engine then sees the class's priority in the
body and the tenant and weight in headers, which the gateway strips from clients.
When it ends, its real token usage replaces the estimate it was charged.
"""

from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web
from opentelemetry.trace import NoOpTracer, Tracer

from llmserve import envs
from llmserve.errors import APIError
from llmserve.gateway.fairness import FairQueue, Waiter
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.models import MODEL_LABELS
from llmserve.gateway.peers import TOKEN_HEADER, PeerCounters
from llmserve.gateway.ratelimits import RateLimiter
from llmserve.gateway.response_affinity import RESPONSES_PATH
from llmserve.gateway.tenants import CLASS_HEADER, Tenant, TenantsFile, TrafficClass
from llmserve.gateway.usage import UsageTap, ask_for_usage
from llmserve.tracing import current_span
from llmserve.utils import cdiv

# Headers the gateway sets for the engines (and removes from what clients send).
TENANT_HEADER = "x-llmserve-tenant"
WEIGHT_HEADER = "x-llmserve-tenant-weight"
INTERNAL_HEADERS = {TENANT_HEADER, WEIGHT_HEADER, TOKEN_HEADER}

CHARS_PER_TOKEN = 4  # the estimate a gateway without the tokenizer can make
# Bounds on what one request may claim; the engine refuses beyond its context anyway.
MAX_TOKENS_ESTIMATE = 1 << 24
MAX_N = 1024
# chat and responses run to the context when unbounded; the estimate assumes this much.
DEFAULT_MAX_TOKENS = {"chat": 256, "completions": 16, "responses": 256}
# Where each kind of body says how much it may generate (first given wins).
LENGTH_FIELDS = {"chat": ("max_completion_tokens", "max_tokens"),
                 "completions": ("max_completion_tokens", "max_tokens"),
                 "responses": ("max_output_tokens",)}
# The strings a Responses input item puts into the prompt (content parts have "text").
ITEM_TEXT_FIELDS = ("content", "text", "arguments", "output")


def request_kind(path: str, chat: bool) -> str:
    if path == RESPONSES_PATH:
        return "responses"
    return "chat" if chat else "completions"


def estimate_tokens(payload: dict, kind: str) -> int:
    """Prompt tokens (from its characters) plus what the request may generate."""
    chars, prompts = prompt_chars(payload, kind)
    max_tokens = next((payload[f] for f in LENGTH_FIELDS[kind] if payload.get(f)), None)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        max_tokens = DEFAULT_MAX_TOKENS[kind]
    n = payload.get("n") if kind != "responses" and isinstance(payload.get("n"), int) else 1
    n = min(max(n, 1), MAX_N)
    estimate = cdiv(chars, CHARS_PER_TOKEN) + prompts * n * min(max_tokens, MAX_TOKENS_ESTIMATE)
    return min(estimate, MAX_TOKENS_ESTIMATE)


def prompt_chars(payload: dict, kind: str) -> tuple[int, int]:
    """(characters of the prompt, how many prompts the body holds)."""
    if kind == "responses":
        return responses_chars(payload), 1
    text = payload.get("messages") if kind == "chat" else payload.get("prompt")
    chars = len(json.dumps(text, ensure_ascii=False)) if text is not None else 0
    prompts = len(text) if kind == "completions" and isinstance(text, list) and text and \
        not isinstance(text[0], int) else 1
    return chars, prompts


def responses_chars(payload: dict) -> int:
    """A Responses body's prompt: its instructions and its input, a string or items
    whose text is in content (a string or parts), arguments or output. A conversation
    continued by previous_response_id is not counted (only its engine has it): the
    real usage corrects the charge when the response ends."""
    chars = _text_chars(payload.get("instructions"))
    given = payload.get("input")
    for item in given if isinstance(given, list) else [given]:
        if isinstance(item, dict):
            chars += sum(_text_chars(item.get(f)) for f in ITEM_TEXT_FIELDS)
        else:
            chars += _text_chars(item)
    return chars


def _text_chars(value, depth: int = 0) -> int:
    """Characters of the strings in ``value``: itself, or the text of its parts."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list) and depth == 0:
        return sum(_text_chars(p.get("text"), 1) for p in value if isinstance(p, dict))
    return 0


@dataclass
class Turn:
    """An admitted, dispatched request: what to forward and how to account for it."""
    tenant: Tenant
    cls: TrafficClass
    body: bytes
    headers: dict[str, str]  # to add upstream
    response_headers: dict[str, str]  # rate-limit headers for the client
    tap: UsageTap
    status: int | None = None  # the response's, once known


class TenantAdmission:
    def __init__(self, path: str, free_slots, metrics: GatewayMetrics,
                 peer_interval: float = 1.0, tracer: Tracer | None = None):
        self.file = TenantsFile(path)
        self.tracer = tracer or NoOpTracer()  # the queue span
        self.metrics = metrics
        self.limiter = RateLimiter()
        self.fair = FairQueue(self.file.config.classes_by_urgency, free_slots)
        self.peers = PeerCounters(self.limiter, lambda: self.file.digest, peer_interval,
                                  own_host=envs.POD_IP)

    def refresh(self) -> None:
        """Pick up an edited tenants file."""
        before = self.file.config
        if self.file.current() is not before:
            self.fair.update_classes(self.file.config.classes_by_urgency)

    def tenant_of(self, authorization: str) -> Tenant:
        self.refresh()
        token = authorization[7:].strip() if authorization.startswith("Bearer ") else ""
        tenant = self.file.config.tenant_for_key(token) if token else None
        if tenant is None:
            raise APIError(401, "invalid or missing API key", "authentication_error",
                           code="invalid_api_key")
        return tenant

    @asynccontextmanager
    async def turn(self, request: web.Request, payload: dict, chat: bool):
        """Admit, queue and dispatch the request; yields its Turn; accounts on exit."""
        tenant: Tenant = request["tenant"]
        cls = self.file.config.class_for(tenant, request.headers.get(CLASS_HEADER))
        kind = request_kind(request.path, chat)
        est = estimate_tokens(payload, kind)
        arrived = time.monotonic()
        request["class"] = cls.name  # for the request counter
        admission = self.limiter.admit(tenant, est)
        waiter = Waiter(tenant.name, tenant.weight, cls, est)
        turn: Turn | None = None
        try:
            with current_span(self.tracer, "queue", attributes={
                    "llmserve.queue": "tenants", "llmserve.tenant": tenant.name,
                    "llmserve.class": cls.name}):
                self.fair.submit(waiter)
                await self.fair.wait(waiter)
                self.fair.started(waiter)
            self.metrics.queue_wait.labels(cls.name, tenant.name).observe(
                time.monotonic() - arrived)
            payload["priority"] = cls.priority
            tap = UsageTap(bool(payload.get("stream")), ask_for_usage(payload, kind))
            turn = Turn(tenant, cls, json.dumps(payload).encode(),
                        {TENANT_HEADER: tenant.name, WEIGHT_HEADER: f"{tenant.weight:g}"},
                        admission.headers, tap)
            yield turn
        finally:
            served = turn is not None
            used = self.used_tokens(turn) if served else 0
            self.limiter.release(admission, used, served)
            if served:
                self.fair.finished(waiter, used if used is not None else est)
                if used:
                    self.metrics.tenant_tokens.labels(tenant.name).inc(used)
                if turn.tap.first_byte_at is not None:
                    labels = request.get(MODEL_LABELS, ("", ""))  # set by server.generate
                    self.metrics.ttft.labels(cls.name, *labels).observe(
                        turn.tap.first_byte_at - arrived)
            self.fair.dispatch()

    @staticmethod
    def used_tokens(turn: Turn) -> int | None:
        """Tokens the request used: its reported usage; none when no engine answered
        or the answer was an error; None (keep the estimate) when a response was
        cut short (client gone) before its usage."""
        if turn.tap.total_tokens is not None:
            return turn.tap.total_tokens
        if turn.status is None or turn.status >= 400:
            return 0
        return None

    def observe(self) -> None:
        """Gauges that are read at scrape time: queue depths, limits left."""
        m = self.metrics
        m.queue_depth.clear()
        for q in self.fair.queues.values():
            for tenant, waiters in q.queues.items():
                m.queue_depth.labels(q.cls.name, tenant).set(len(waiters))
        m.peers.labels("fresh").set(self.peers.fresh_peers())
        m.peers.labels("stale").set(len(self.peers.urls) - self.peers.fresh_peers())
        now = time.monotonic()
        for tenant in self.file.config.tenants.values():
            for kind, limit in (("requests", tenant.limits.rpm), ("tokens", tenant.limits.tpm)):
                if limit is None:
                    continue
                window = getattr(self.limiter.of(tenant.name), kind)
                quota = limit * self.limiter.quota_share(tenant.name, kind)
                m.ratelimit_remaining.labels(tenant.name, kind).set(
                    max(0.0, quota - window.total(now)))

    def usage_report(self, request: web.Request) -> web.Response:
        """This replica's counters, for its peers."""
        if not self.peers.authorized(request.headers.get(TOKEN_HEADER, "")):
            raise APIError(403, "peer token mismatch", "permission_error")
        return web.json_response({"tenants": self.peers.published_with_fractions(
            self.file.config.tenants)})
