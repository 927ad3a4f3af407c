"""OpenAI-compatible HTTP server (aiohttp) over the async engine.

Routes: /v1/completions, /v1/chat/completions (SSE when stream=true), /v1/models,
/health, /metrics, /tokenize, /detokenize, /version, /openapi.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmserve import __version__
from llmserve.config import EngineConfig
from llmserve.core.request import Tenancy
from llmserve.core.sampling_params import GrammarError
from llmserve.core.sched.overload import OverloadedError
from llmserve.engine.async_llm import AsyncLLMEngine, EngineDeadError
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.output import CompletionOutput, RequestOutput
from llmserve.entrypoints.llm import render_chat
from llmserve.entrypoints.openai.openapi import openapi_document
from llmserve.entrypoints.openai.protocol import (
    APIError,
    ParsedRequest,
    bad_request,
    parse_chat,
    parse_completion,
)
from llmserve.entrypoints.openai.tool_calls import (
    ToolCallStream,
    ToolChoice,
    ToolError,
    messages_for_template,
    parse_tool_choice,
)
from llmserve.http_serving import (
    BODY_TIMEOUT,
    HEADER_TIMEOUT,
    http_error_response,
    read_body_middleware,
    serve_until_signal,
)

log = logging.getLogger("llmserve.server")

ENGINE = web.AppKey("engine", AsyncLLMEngine)
STATE = web.AppKey("state", dict)


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


# --- helpers --------------------------------------------
async def read_json(request: web.Request):
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"invalid JSON body: {e}") from e


def check_model(request: web.Request, body) -> str:
    engine = request.app[ENGINE].engine
    model = body.get("model") if isinstance(body, dict) else None
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model and model != engine.model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                            f"'{engine.model_name}'", "not_found_error", "model",
                       "model_not_found")
    return engine.model_name


def check_admitting(request: web.Request) -> None:
    if request.app[STATE]["draining"]:
        raise APIError(503, "the server is shutting down", "service_unavailable")


def tenancy_of(request: web.Request) -> Tenancy | None:
    """The tenant the gateway vouches for (it strips these headers from clients)."""
    name = request.headers.get("x-llmserve-tenant", "").strip()
    if not name:
        return None
    if len(name) > 63:
        raise bad_request("x-llmserve-tenant must be at most 63 characters")
    try:
        weight = float(request.headers.get("x-llmserve-tenant-weight", "1"))
    except ValueError:
        weight = -1.0
    if not 0 < weight <= 1000:
        raise bad_request("x-llmserve-tenant-weight must be a number in (0, 1000]")
    return Tenancy(name, weight)


def tokenize_prompt(engine: LLMEngine, prompt) -> list[int]:
    ids = engine.tokenize(prompt)
    vocab = engine.hf_config.vocab_size
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise bad_request(f"token ids must be in [0, {vocab})", "prompt")
    return ids


def usage(prompt_lens: list[int], outputs: list[CompletionOutput]) -> dict:
    p, c = sum(prompt_lens), sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# --- generation driving --------------------------------------------
async def run_requests(app: web.Application, prompt_ids: list[list[int]], prompts,
                       parsed: ParsedRequest):
    """Start one engine request per prompt and yield (prompt index, RequestOutput) as
    outputs arrive, from all prompts interleaved. Closing this generator aborts them."""
    engine = app[ENGINE]
    base = f"{uuid.uuid4().hex[:16]}"
    gens = []
    for i, ids in enumerate(prompt_ids):
        try:
            engine.engine.validate_prompt(ids, parsed.params)
        except ValueError as e:
            raise bad_request(str(e), "messages" if parsed.logprobs_style == "chat"
                              else "prompt") from e
        gens.append(engine.generate(ids, parsed.params.copy(), f"{base}-{i}",
                                    prompts[i] if isinstance(prompts[i], str) else None,
                                    parsed.priority, parsed.cache_salt, parsed.tenant))
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async for out in gen:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                if isinstance(item, ValueError):
                    raise bad_request(str(item))
                raise item
            else:
                yield i, item
    finally:
        # Cancelling a pump raises inside its generator, whose cleanup aborts the request.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class StreamText:
    """Text deltas of one choice. With stop strings, the last characters that could
    still turn out to be the start of a stop string are held back until the next
    token or the end, so a stop string is never half-sent."""

    def __init__(self, stops: list[str], include_stop: bool):
        self.sent = 0
        self.hold = 0 if include_stop or not stops else max(map(len, stops)) - 1

    def delta(self, out: CompletionOutput) -> str:
        end = len(out.text) if out.finish_reason else max(self.sent, len(out.text) - self.hold)
        d = out.text[self.sent:end]
        self.sent = end
        return d


async def fail_as_event(gen):
    """``gen``'s items; an engine-side failure before the first item propagates (the
    client gets an HTTP error), one after it becomes a final ``(-1, error)`` item, so
    a stream that has started ends with an error event and [DONE], never cut short."""
    started = False
    async with contextlib.aclosing(gen):
        try:
            async for item in gen:
                started = True
                yield item
        except (OverloadedError, EngineDeadError) as e:
            if not started:
                raise
            yield -1, e


def sse_error(e: BaseException) -> bytes:
    type_ = "server_overloaded" if isinstance(e, OverloadedError) else "service_unavailable"
    return sse(APIError(503, str(e), type_).body())


def sse(data) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def chunk(rid: str, obj: str, created: int, model: str, choice: dict) -> bytes:
    return sse({"id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice]})


# --- /v1/completions and /v1/chat/completions --------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    check_admitting(request)
    body = await read_json(request)
    model = check_model(request, body)
    parsed = parse_completion(body)
    parsed.tenant = tenancy_of(request)
    engine = request.app[ENGINE].engine
    prompt_ids = [tokenize_prompt(engine, p) for p in parsed.prompts]
    await compile_constraint(engine, parsed, "response_format")
    return await respond(request, model, parsed, parsed.prompts, prompt_ids, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    check_admitting(request)
    body = await read_json(request)
    model = check_model(request, body)
    parsed, messages = parse_chat(body)
    parsed.tenant = tenancy_of(request)
    engine = request.app[ENGINE].engine
    tools = parse_tools(body, parsed)
    messages, template_args = messages_for_template(messages, tools, engine.tokenizer)
    try:
        text = render_chat(engine.tokenizer, messages, **template_args)
    except Exception as e:  # noqa: BLE001 - template errors are the request's fault
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from e
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    await compile_constraint(engine, parsed,
                             "tools" if tools and tools.constrained else "response_format")
    return await respond(request, model, parsed, [text], [ids], chat=True)


def parse_tools(body: dict, parsed: ParsedRequest) -> ToolChoice | None:
    """tools / tool_choice; a named or required choice becomes the output constraint."""
    try:
        tools = parse_tool_choice(body)
    except ToolError as e:
        raise bad_request(str(e), e.param) from e
    if tools is not None and tools.constrained:
        if parsed.params.structured_outputs is not None:
            raise bad_request("a named or 'required' tool_choice already constrains the "
                              "output; drop response_format / structured_outputs",
                              "tool_choice")
        try:
            parsed.params.structured_outputs = tools.constraint()
        except ValueError as e:
            raise bad_request(str(e), "tools") from e
    parsed.tools = tools if tools is not None and tools.mode != "none" else None
    return tools


async def compile_constraint(engine: LLMEngine, parsed: ParsedRequest, param: str) -> None:
    """Compile (or find cached) the request's grammar off the event loop, so a bad
    schema, regex or grammar is a 400 before anything is queued."""
    spec = parsed.params.structured_outputs
    if spec is None:
        return
    try:
        # structured_outputs() wraps the tokenizer on first use (~0.3 s): off the loop too.
        await asyncio.to_thread(lambda: engine.structured_outputs().compile(spec))
    except GrammarError as e:
        raise bad_request(str(e), param) from e


async def respond(request, model, parsed: ParsedRequest, prompts, prompt_ids, chat: bool):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    n = parsed.params.n
    gen = run_requests(request.app, prompt_ids, prompts, parsed)
    if not parsed.stream:
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(gen):
            async for i, out in gen:
                if out.finished:
                    finals[i] = out
        outputs = [c for i in range(len(prompt_ids)) for c in finals[i].outputs]
        choices = [choice_body(request, parsed, chat, i * n + c.index, c, None)
                   for i in range(len(prompt_ids)) for c in finals[i].outputs]
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices,
            "usage": usage([len(p) for p in prompt_ids], outputs)})
    return await stream_response(request, rid, created, model, parsed, gen, prompt_ids, chat)


async def stream_response(request, rid, created, model, parsed, gen, prompt_ids, chat):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    n, obj = parsed.params.n, "chat.completion.chunk" if chat else "text_completion"
    texts: dict[int, StreamText] = {}
    tool_streams: dict[int, ToolCallStream] = {}
    tokens_sent: dict[int, int] = {}
    done: set[int] = set()
    last: dict[int, RequestOutput] = {}
    started = False
    async with contextlib.aclosing(fail_as_event(gen)) as events:
        async for i, out in events:
            if i < 0:  # the engine failed mid-stream
                await resp.write(sse_error(out))
                break
            if not started:  # errors before the first output still become JSON errors
                await resp.prepare(request)
                started = True
                if chat:
                    for idx in range(len(prompt_ids) * n):
                        await resp.write(chunk(rid, obj, created, model, {
                            "index": idx, "logprobs": None, "finish_reason": None,
                            "delta": {"role": "assistant", "content": ""}}))
            last[i] = out
            for c in out.outputs:
                idx = i * n + c.index
                prev = tokens_sent.get(idx, 0)
                if idx in done or (c.finish_reason is None and len(c.token_ids) == prev):
                    continue  # nothing new for this choice in this output
                if parsed.tools is not None:
                    ts = tool_streams.setdefault(idx, ToolCallStream(parsed.tools))
                    tokens_sent[idx] = len(c.token_ids)
                    if c.finish_reason is not None:
                        done.add(idx)
                    for choice in tool_choice_deltas(request, parsed, idx, c, prev, ts):
                        await resp.write(chunk(rid, obj, created, model, choice))
                    continue
                st = texts.setdefault(idx, StreamText(parsed.params.stop,
                                                      parsed.params.include_stop_str_in_output))
                delta = st.delta(c)
                tokens_sent[idx] = len(c.token_ids)
                if c.finish_reason is not None:
                    done.add(idx)
                elif not delta and parsed.logprobs_style is None:
                    continue  # held back (partial character or possible stop string)
                choice = choice_body(request, parsed, chat, idx, c, (prev, len(c.token_ids)),
                                     delta=delta)
                await resp.write(chunk(rid, obj, created, model, choice))
    if not started:
        await resp.prepare(request)
    if parsed.include_usage:
        outputs = [c for o in last.values() for c in o.outputs]
        await resp.write(sse({"id": rid, "object": obj, "created": created, "model": model,
                              "choices": [],
                              "usage": usage([len(p) for p in prompt_ids], outputs)}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def tool_choice_deltas(request, parsed: ParsedRequest, idx: int, c: CompletionOutput,
                       prev: int, ts: ToolCallStream) -> list[dict]:
    """Stream choices for one update of a chat choice with tools in play: content or
    tool-call deltas, the finish reason on the last (tool_calls when calls were made)."""
    deltas = ts.update(c.text, c.finish_reason is not None) or [{}]
    base = choice_body(request, parsed, True, idx, c, (prev, len(c.token_ids)), delta="")
    choices = []
    for k, delta in enumerate(deltas):
        last = k == len(deltas) - 1
        finish = c.finish_reason if last else None
        if finish == "stop" and ts.calls:
            finish = "tool_calls"
        if not delta and finish is None and base["logprobs"] is None:
            continue
        choices.append({**base, "delta": delta, "finish_reason": finish,
                        "logprobs": base["logprobs"] if k == 0 else None})
    return choices


def choice_body(request, parsed: ParsedRequest, chat: bool, index: int, c: CompletionOutput,
                lp_range: tuple[int, int] | None, delta: str | None = None) -> dict:
    tok = request.app[ENGINE].engine.tokenizer
    start, end = lp_range or (0, len(c.token_ids))
    logprobs = None
    if parsed.logprobs_style == "chat":
        logprobs = {"content": [
            {"token": (t := tok.decode([lp.token_id])), "logprob": lp.logprob,
             "bytes": list(t.encode()),
             "top_logprobs": [{"token": (a := tok.decode([tid])), "logprob": v,
                               "bytes": list(a.encode())} for tid, v in lp.top]}
            for lp in (c.logprobs or [])[start:end]]}
    elif parsed.logprobs_style == "completion":
        lps = (c.logprobs or [])[start:end]
        logprobs = {"tokens": [tok.decode([lp.token_id]) for lp in lps],
                    "token_logprobs": [lp.logprob for lp in lps],
                    "top_logprobs": [{tok.decode([t]): v for t, v in lp.top} for lp in lps],
                    "text_offset": []}
    body = {"index": index, "logprobs": logprobs, "finish_reason": c.finish_reason}
    if c.finish_reason == "stop" and c.stop_reason is not None:
        body["stop_reason"] = c.stop_reason
    if chat:
        if delta is None and parsed.tools is not None:
            content, calls = parsed.tools.extract(c.text)
            body["message"] = {"role": "assistant", "content": content}
            if calls:
                body["message"]["tool_calls"] = calls
                if c.finish_reason == "stop":
                    body["finish_reason"] = "tool_calls"
        elif delta is None:
            body["message"] = {"role": "assistant", "content": c.text}
        else:
            body["delta"] = {"content": delta} if delta or c.finish_reason is None else {}
    else:
        body["text"] = c.text if delta is None else delta
    return body


# --- the small endpoints --------------------------------------------
async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE].engine
    return web.json_response({"object": "list", "data": [{
        "id": engine.model_name, "object": "model", "created": request.app[STATE]["started"],
        "owned_by": "llmserve", "root": str(engine.config.model),
        "max_model_len": engine.max_model_len}]})


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


async def tokenize(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_model(request, body)
    engine = request.app[ENGINE].engine
    if isinstance(body, dict) and "messages" in body:
        from llmserve.entrypoints.openai.protocol import parse_messages
        text = render_chat(engine.tokenizer, parse_messages(body))
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
        ids = engine.tokenizer.encode(body["prompt"])
    else:
        raise bad_request("give 'prompt' (a string) or 'messages'", "prompt")
    return web.json_response({"tokens": ids, "count": len(ids),
                              "max_model_len": engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_model(request, body)
    engine = request.app[ENGINE].engine
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be an array of integers", "tokens")
    tokenize_prompt(engine, tokens)
    return web.json_response({"prompt": engine.tokenizer.decode(tokens)})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


# --- app --------------------------------------------
def build_app(engine: AsyncLLMEngine, api_key: str | None = None,
              max_body_bytes: int = 4 << 20,
              body_timeout: float = BODY_TIMEOUT) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[errors_middleware, auth_middleware(api_key),
                                       read_body_middleware(body_timeout)])
    app[ENGINE] = engine
    app[STATE] = {"draining": False, "started": int(time.time())}
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
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
    engine = front.engine
    app = build_app(front, api_key, body_timeout=body_timeout)
    log.info("serving %s on http://%s:%d", engine.model_name, host, port)
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
