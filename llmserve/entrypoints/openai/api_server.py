"""OpenAI-compatible HTTP server (aiohttp) over the async engine: the app, its
middlewares, the small endpoints and startup. The generation endpoints are in
serving_completion.py and serving_chat.py, what they share in serving_engine.py.

Routes: /v1/completions, /v1/chat/completions (SSE when stream=true), /v1/models,
/health, /metrics, /tokenize, /detokenize, /version, /openapi.json.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmserve import __version__
from llmserve.config import EngineConfig
from llmserve.core.sched.overload import OverloadedError
from llmserve.engine.async_llm import AsyncLLMEngine, EngineDeadError
from llmserve.entrypoints.openai.openapi import openapi_document
from llmserve.entrypoints.openai.protocol import APIError
from llmserve.entrypoints.openai.request_spans import TRACING
from llmserve.entrypoints.openai.serving_chat import chat_completions
from llmserve.entrypoints.openai.serving_completion import completions
from llmserve.entrypoints.openai.serving_engine import ENGINE, STATE
from llmserve.entrypoints.openai.serving_lora import adapter_entries
from llmserve.entrypoints.openai.serving_lora import add_routes as add_lora_routes
from llmserve.entrypoints.openai.serving_responses import add_routes as add_responses_routes
from llmserve.entrypoints.openai.serving_tokenization import detokenize, tokenize
from llmserve.http_serving import (
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    http_error_response,
    read_body_middleware,
    serve_until_signal,
)
from llmserve.tracing import Tracing

log = logging.getLogger("llmserve.server")


# --- middlewares --------------------------------------------
@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return http_error_response(e)
    except EngineDeadError as e:
        return web.json_response(APIError(503, str(e), "service_unavailable").body(),
                                 status=503)
    except OverloadedError as e:
        return web.json_response(APIError(503, str(e), "server_overloaded").body(),
                                 status=503, headers={"Retry-After": e.retry_after_header})


def auth_middleware(api_key: str | None):
    @web.middleware
    async def check(request: web.Request, handler):
        if api_key and request.path.startswith("/v1/"):
            header = request.headers.get("Authorization", "")
            token = header[7:] if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                raise APIError(401, "invalid or missing API key", "authentication_error",
                               code="invalid_api_key")
        return await handler(request)
    return check


# --- the small endpoints --------------------------------------------
async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response({"object": "list", "data": [{
        "id": engine.model_name, "object": "model", "created": request.app[STATE]["started"],
        "owned_by": "llmserve", "root": str(engine.config.model),
        "max_model_len": engine.max_model_len},
        *adapter_entries(request, request.app[STATE]["started"])]})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if request.app[STATE]["draining"]:
        return web.json_response({"status": "draining"}, status=503)
    if not engine.alive:
        return web.json_response({"status": "engine dead"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = generate_latest(engine.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


# --- app --------------------------------------------
def build_app(engine: AsyncLLMEngine, api_key: str | None = None,
              max_body_bytes: int = 4 << 20,
              body_timeout: float = BODY_TIMEOUT,
              tracing: Tracing | None = None) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[errors_middleware, auth_middleware(api_key),
                                       read_body_middleware(body_timeout)])
    app[ENGINE] = engine
    app[STATE] = {"draining": False, "started": int(time.time())}
    app[TRACING] = tracing or Tracing("llmserve-engine")  # off unless given one
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    add_responses_routes(app)  # POST /v1/responses and its store
    add_lora_routes(app, engine)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/openapi.json", openapi)
    return app


async def serve(config: EngineConfig, host: str, port: int, api_key: str | None = None,
                drain_timeout: float = 30.0, ready: asyncio.Event | None = None,
                header_timeout: float = HEADER_TIMEOUT,
                body_timeout: float = BODY_TIMEOUT) -> None:
    """Serve until SIGTERM/SIGINT, then drain: refuse new requests (503), let
    in-flight ones finish up to ``drain_timeout`` seconds, and return."""
    front = AsyncLLMEngine(config)
    await front.start()
    tracing = Tracing("llmserve-engine", config.otlp_traces_endpoint)
    app = build_app(front, api_key, body_timeout=body_timeout, tracing=tracing)
    log.info("serving %s on http://%s:%d", front.model_name, host, port)
    stop = asyncio.Event()
    watcher = asyncio.create_task(_stop_when_dead(front, stop))
    try:
        await serve_until_signal(app, host, port, ready=ready, drain_timeout=drain_timeout,
                                 header_timeout=header_timeout,
                                 start_draining=lambda: app[STATE].update(draining=True),
                                 in_flight=lambda: front.num_in_flight, stop=stop)
    finally:
        watcher.cancel()
        front.shutdown()
        tracing.shutdown()  # exports the spans still batched
    if front.error is not None:
        raise EngineDeadError(f"the engine died: {front.error}")


# How long a dead engine's server still answers (503) before it exits: in-flight
# requests get their error, a probe or a client sees 503 rather than a refused connection.
DEAD_ENGINE_GRACE_S = 2.0


async def _stop_when_dead(front: AsyncLLMEngine, stop: asyncio.Event) -> None:
    """A dead engine (its loop failed, or a tensor-parallel worker died) cannot recover
    in this process: stop serving, so the process exits non-zero and the pod restarts."""
    while front.alive:
        await asyncio.sleep(0.25)
    log.error("the engine is dead (%s); exiting in %.0f s", front.error, DEAD_ENGINE_GRACE_S)
    await asyncio.sleep(DEAD_ENGINE_GRACE_S)
    stop.set()
