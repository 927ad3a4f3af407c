"""Prefill/decode disaggregation at the gateway: one client request, two legs.

With a prefill pool (``--prefill-backend`` / ``--prefill-k8s-service``), a completion or
chat request whose prompt is long enough goes first to a prefill engine (leg 1: the
body with ``max_tokens: 1``, not streamed, asking ``kv_transfer_params:
{"do_remote_decode": true}``). That engine computes the prompt's KV, holds it under a
lease and answers where to read it (``kv_transfer_params``). Leg 2 is the client's own
body plus those params, routed to the decode pool exactly as a request without P/D is
(same prefix key, same retries, streamed back unchanged): the decode engine reads the
blocks its prefix cache lacks and decodes. The prefill engine is picked on its own
ring by the same prefix key, so a conversation's turns meet their KV on both sides.

Leg 1 is an optimisation, never a dependency: when it cannot run or fails (no healthy
prefill endpoint, connection error, 5xx, timeout, no or malformed params), the
original body goes to the decode pool, which prefills itself. Tenancy, admission and
usage wrap the client's request once (server.py); leg 1 is invisible to them except
that, while it runs, it holds the decode place it will need (``pending``).

A client that leaves during leg 1 cancels the handler, which closes leg 1's connection
(the prefill engine aborts it); one that leaves after it leaves a lease that the
prefill engine frees when it expires.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import aiohttp

from llmserve.distributed.kv_transfer.params import RemotePrefill, parse_kv_transfer_params
from llmserve.gateway.endpoints import EndpointPool
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.prefix import message_text
from llmserve.gateway.routing import make_policy

log = logging.getLogger(__name__)

KV_PARAMS = "kv_transfer_params"
PD_PATHS = ("/v1/completions", "/v1/chat/completions")
# Leg 1 computes the prompt and samples one token that nobody reads: these would make
# it refuse that (min_tokens > 1, best_of > n) or stream.
LEG1_DROPPED = ("stream_options", "best_of", "min_tokens", KV_PARAMS)

# Counting prompt tokens without the tokenizer: a token is at least one byte of UTF-8
# (byte-level BPE; SentencePiece with byte fallback), so a prompt of b bytes has at most
# b tokens plus what its template adds; and tokens average 3-5 bytes of prose or code,
# rarely over 8. Only between those bounds does the prefill engine's /tokenize decide.
MAX_BYTES_PER_TOKEN = 8
TEMPLATE_TOKENS_PER_MESSAGE = 8  # role markers and separators, generously
BYTES_PER_TOKEN_ESTIMATE = 4  # when /tokenize does not answer
TOKENIZE_TIMEOUT = 2.0


# --- what the client sent -----------------------------------------------------------
def strip_client_params(payload: dict) -> bool:
    """Drop ``kv_transfer_params`` a client sent (True if it did): only the gateway may
    name a lease, or a client could point a decode engine at another tenant's KV."""
    if KV_PARAMS not in payload:
        return False
    del payload[KV_PARAMS]
    return True


def batch_of_prompts(prompt) -> bool:
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


def cannot_help(payload: dict) -> str | None:
    """Why leg 1 would be wasted on this request (None: it would not). The prompt's
    logits (echo with logprobs, prompt_logprobs) are only computed where it is
    prefilled; beam search and batches of prompts are not what one lease describes."""
    if payload.get("echo"):
        return "echo"
    if payload.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if payload.get("use_beam_search"):
        return "beam_search"
    if batch_of_prompts(payload.get("prompt")):
        return "batch"
    return None


@dataclass
class PromptSize:
    """Bounds on a prompt's tokens (equal when the client sent token ids)."""
    low: int
    high: int
    estimate: int


def prompt_size(payload: dict, chat: bool) -> PromptSize:
    if chat:
        messages = payload.get("messages")
        messages = [m for m in messages if isinstance(m, dict)] if isinstance(
            messages, list) else []
        text = sum(len(message_text(m).encode()) for m in messages)
        # Everything the template may render (tool calls, tools) bounds it from above.
        rendered = len(json.dumps([messages, payload.get("tools")], ensure_ascii=False).encode())
        return PromptSize(text // MAX_BYTES_PER_TOKEN,
                          rendered + TEMPLATE_TOKENS_PER_MESSAGE * (len(messages) + 1),
                          text // BYTES_PER_TOKEN_ESTIMATE)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, list):  # token ids: exact
        return PromptSize(len(prompt), len(prompt), len(prompt))
    size = len(prompt.encode()) if isinstance(prompt, str) else 0
    return PromptSize(size // MAX_BYTES_PER_TOKEN, size + 2,  # + BOS (and one spare)
                      size // BYTES_PER_TOKEN_ESTIMATE)


# --- the two legs' bodies -------------------------------------------------------------
def leg1_body(payload: dict) -> bytes:
    """The client's body, cut to a prefill (the contract's shape)."""
    body = {k: v for k, v in payload.items() if k not in LEG1_DROPPED}
    body.update(max_tokens=1, stream=False, n=1)
    if "max_completion_tokens" in payload:
        body["max_completion_tokens"] = 1
    body[KV_PARAMS] = {"do_remote_decode": True}
    return json.dumps(body).encode()


def leg1_headers(headers: dict) -> dict:
    """The request's upstream headers for a body the gateway reads itself: JSON, and
    not compressed (the gateway's session passes bytes through undecoded)."""
    kept = {k: v for k, v in headers.items()
            if k.lower() not in ("content-type", "accept-encoding")}
    return {**kept, "Content-Type": "application/json"}


def leg2_body(payload: dict, params: dict) -> bytes:
    return json.dumps({**payload, KV_PARAMS: params}).encode()


def usable_params(params) -> bool:
    """Whether a decode engine would take these params (the engine's own parser, which
    imports no torch): any other answer would get leg 2 a 400, so it is not sent on."""
    try:
        return isinstance(parse_kv_transfer_params(params), RemotePrefill)
    except ValueError:
        return False


def overloaded_answer(data: bytes) -> bool:
    try:
        return json.loads(data)["error"]["type"] == "server_overloaded"
    except (ValueError, KeyError, TypeError):
        return False


class LegFailed(Exception):
    """Leg 1 gave nothing usable; ``reason`` labels the fallback."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# --- orchestration ----------------------------------------------------------------------
class Disaggregation:
    """The prefill pool (its endpoints, ring and scrapes) and leg 1."""

    def __init__(self, config, metrics: GatewayMetrics):
        self.config = config
        self.metrics = metrics
        self.enabled = bool(config.prefill_backends or config.prefill_k8s_service)
        # No in-flight cap here: fairness caps the request once, at the decode pool.
        self.pool = EndpointPool(config.max_waiting, config.max_kv_usage,
                                 config.eject_seconds, 0)
        self.policy = make_policy(config.policy, config.load_factor)
        self._pending: dict[int | None, int] = {}  # requests in leg 1, by class priority

    def start(self, session: aiohttp.ClientSession) -> list[asyncio.Task]:
        if not self.enabled:
            return []
        tasks = []
        if self.config.prefill_backends:
            self.pool.set_urls(self.config.prefill_backends)
        if self.config.prefill_k8s_service:
            from llmserve.gateway.discovery import watch_endpoint_slices
            namespace, name = self.config.prefill_k8s_service.split("/", 1)
            tasks.append(asyncio.create_task(watch_endpoint_slices(
                namespace, name, self.pool.set_urls, self.config.k8s_port_name)))
        tasks.append(asyncio.create_task(
            self.pool.scrape_forever(session, self.config.scrape_interval)))
        return tasks

    def pending(self, priority: int | None = None) -> int:
        """Requests in leg 1 of this class or more urgent ones (all, for None)."""
        return sum(n for p, n in self._pending.items()
                   if priority is None or p is None or p <= priority)

    async def kv_params(self, session: aiohttp.ClientSession, path: str, headers: dict,
                        payload: dict, key: str, priority: int | None = None) -> dict | None:
        """Run leg 1 when it can help: the params leg 2 carries, or None (send the
        client's body as it is). Counts the request's P/D path."""
        chat = path.endswith("/chat/completions")
        headers = leg1_headers(headers)
        reason = cannot_help(payload)
        size = prompt_size(payload, chat)
        if reason is None and size.high < self.config.pd_min_prompt_tokens:
            reason = "short_prompt"
        if reason is not None:
            return self._counted("direct", reason)
        candidates = self.pool.candidates(model=payload.get("model"))  # adapters' holders
        if not candidates:
            return self._counted("fallback", "no_endpoint")
        decision = self.policy.choose(candidates, key)
        if size.low < self.config.pd_min_prompt_tokens and not await self._long_enough(
                session, decision.url, headers, payload, chat, size):
            return self._counted("direct", "short_prompt")
        self.metrics.decisions.labels(decision.url, decision.reason).inc()
        try:
            params = await self._leg1(session, decision.url, path, headers, payload, priority)
        except LegFailed as e:
            log.info("prefill leg on %s gave nothing (%s): the decode engine prefills",
                     decision.url, e)
            return self._counted("fallback", e.reason)
        return self._counted("disaggregated", "", params)

    def _counted(self, mode: str, reason: str, params: dict | None = None) -> dict | None:
        self.metrics.pd_requests.labels(mode, reason).inc()
        return params

    async def _long_enough(self, session, url, headers, payload, chat, size) -> bool:
        """Whether the prompt has pd_min_prompt_tokens tokens: the prefill engine's
        /tokenize counts them, or (no answer) the estimate from its bytes."""
        count = await self._count_tokens(session, url, headers, payload, chat)
        return (size.estimate if count is None else count) >= self.config.pd_min_prompt_tokens

    async def _count_tokens(self, session, url, headers, payload, chat) -> int | None:
        body = {"messages": payload.get("messages")} if chat else {
            "prompt": prompt_text(payload.get("prompt"))}
        if isinstance(payload.get("model"), str):
            body["model"] = payload["model"]
        try:
            async with asyncio.timeout(TOKENIZE_TIMEOUT):
                async with session.post(url + "/tokenize", data=json.dumps(body).encode(),
                                        headers=headers) as r:
                    count = (await r.json()).get("count") if r.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, AttributeError):
            return None
        return count if isinstance(count, int) else None

    async def _leg1(self, session, url, path, headers, payload, priority) -> dict:
        """Leg 1 on ``url``: its kv_transfer_params, or LegFailed. Holds a place in the
        endpoint's in-flight count (its ring's bound) and in ``pending``."""
        ep = self.pool.endpoints.get(url)
        if ep is None:
            raise LegFailed("no_endpoint")
        ep.in_flight += 1
        self._pending[priority] = self._pending.get(priority, 0) + 1
        gauge = self.metrics.in_flight.labels(url)
        gauge.inc()
        t0 = time.perf_counter()
        try:
            status, data = await self._post(session, url, path, headers, leg1_body(payload))
            return self._params_of(url, status, data)
        finally:
            self.metrics.pd_prefill_latency.observe(time.perf_counter() - t0)
            ep.in_flight -= 1
            self._pending[priority] -= 1
            gauge.dec()

    async def _post(self, session, url, path, headers, body) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(self.config.pd_prefill_timeout):
                async with session.post(url + path, data=body, headers=headers) as r:
                    return r.status, await r.read()
        except TimeoutError as e:  # hung or buried: the decode engine is as quick
            self._failed(url, "timeout")
            raise LegFailed("timeout", url) from e
        except (aiohttp.ClientError, OSError) as e:
            self._failed(url, "connection")
            raise LegFailed("connection", f"{url}: {e!r}") from e

    def _params_of(self, url: str, status: int, data: bytes) -> dict:
        if status == 503 and overloaded_answer(data):  # busy, not broken: keep it
            self.metrics.upstream_overloaded.labels(url).inc()
            raise LegFailed("overloaded", url)
        if status >= 500:
            self._failed(url, "status")
            raise LegFailed("status", f"{url}: HTTP {status}")
        if status != 200:  # the decode engine will give the client the same answer
            raise LegFailed("rejected", f"{url}: HTTP {status}")
        self.pool.succeeded(url)
        try:
            params = json.loads(data).get(KV_PARAMS)
        except (ValueError, AttributeError) as e:
            raise LegFailed("bad_params", f"{url}: not a JSON object") from e
        if params is None:
            raise LegFailed("no_params", url)
        if not usable_params(params):
            raise LegFailed("bad_params", f"{url}: {str(params)[:200]}")
        return params

    def _failed(self, url: str, reason: str) -> None:
        self.metrics.upstream_errors.labels(url, reason).inc()
        self.pool.failed(url)


def prompt_text(prompt):
    """A completions prompt as /tokenize takes it (a string), or as sent."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return prompt
