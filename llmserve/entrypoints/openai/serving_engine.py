"""What /v1/completions and /v1/chat/completions share: the request's checks (model,
draining, tenant), running its prompts on the engine, and answering (whole or
streamed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from aiohttp import web

from llmserve.core.request import Tenancy
from llmserve.core.sampling_params import GrammarError, RequestOutputKind
from llmserve.distributed.kv_transfer.params import RemoteDecode
from llmserve.engine.async_llm import AsyncLLMEngine
from llmserve.entrypoints.openai.prompt_echo import hide_generated
from llmserve.entrypoints.openai.protocol import APIError, ParsedRequest, bad_request
from llmserve.entrypoints.openai.request_spans import RequestTrace, request_trace, traced
from llmserve.entrypoints.openai.responses import full_response
from llmserve.entrypoints.openai.streaming import stream_response

ENGINE = web.AppKey("engine", AsyncLLMEngine)
STATE = web.AppKey("state", dict)


# --- checks before parsing --------------------------------------------------------------
async def read_json(request: web.Request):
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"invalid JSON body: {e}") from e


def check_model(request: web.Request, body) -> str:
    """The model the request names: the served model (also when it names none) or one
    of its LoRA adapters, whose LoRARequest it leaves in ``request["lora"]``; 404 for
    any other model (before the body's other fields are looked at, as OpenAI does)."""
    engine = request.app[ENGINE]
    served = engine.model_name
    model = body.get("model") if isinstance(body, dict) else None
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    request["lora"] = None
    if not model or model == served:
        return served
    lora = engine.lora(model)
    if lora is None:
        adapters = [a.lora_name for a in engine.loras()]
        also = f" and the adapters {', '.join(map(repr, adapters))}" if adapters else ""
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                            f"'{served}'{also}", "not_found_error", "model", "model_not_found")
    request["lora"] = lora
    return model


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


async def accept_generation(request: web.Request, parse):
    """What every generation request does first: refuse while draining, read the JSON
    body, check the model name, ``parse`` the body into (protocol request, ParsedRequest)
    and attach the tenant. Returns (engine, model, protocol request, parsed)."""
    check_admitting(request)
    body = await read_json(request)
    model = check_model(request, body)
    req, parsed = parse(body)
    parsed.tenant = tenancy_of(request)
    parsed.lora = request["lora"]
    return request.app[ENGINE], model, req, parsed


async def compile_constraint(engine: AsyncLLMEngine, parsed: ParsedRequest,
                             param: str) -> None:
    """Compile the request's grammar, so a bad schema, regex or grammar is a 400 before
    anything is queued."""
    spec = parsed.params.structured_outputs
    if spec is None:
        return
    try:
        await engine.compile_grammar(spec)
    except GrammarError as e:
        raise bad_request(str(e), param) from e


# --- generation -------------------------------------------------------------------------
async def respond(request: web.Request, model: str, parsed: ParsedRequest, prompts,
                  prompt_ids: list[list[int]], chat: bool) -> web.StreamResponse:
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    gens = start_requests(request.app[ENGINE], prompt_ids, prompts, parsed,
                          request_trace(request, model))
    outputs = interleave(gens)
    if parsed.echo_only:
        outputs = hide_generated(outputs)
    tok = request.app[ENGINE].tokenizer
    if not parsed.stream:
        return await full_response(rid, created, model, parsed, outputs, prompt_ids, chat, tok)
    return await stream_response(request, rid, created, model, parsed, outputs, prompt_ids,
                                 chat, tok)


def start_requests(engine: AsyncLLMEngine, prompt_ids: list[list[int]], prompts,
                   parsed: ParsedRequest, rt: RequestTrace | None = None,
                   stream: bool | None = None) -> list:
    """One engine request per prompt, each checked before any is started (a bad second
    prompt is a 400, not a half-answered request); each traced when ``rt`` is given.
    Streamed (``stream``, else ``parsed.stream``), the outputs are deltas; else one,
    when the request finishes."""
    base = uuid.uuid4().hex[:16]
    stream = parsed.stream if stream is None else stream
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    gens = []
    for i, ids in enumerate(prompt_ids):
        request_id = f"{base}-{i}"
        params = parsed.params.copy()
        params.output_kind = kind
        try:
            gen = engine.generate(ids, params, request_id,
                                  prompts[i] if isinstance(prompts[i], str) else None,
                                  parsed.priority, parsed.cache_salt, parsed.tenant,
                                  kv_leg(parsed), parsed.lora)
        except ValueError as e:  # a ParamError names its field (e.g. logit_bias)
            raise bad_request(str(e), getattr(e, "param", None) or (
                "messages" if parsed.logprobs_style == "chat" else "prompt")) from e
        gens.append(gen if rt is None else traced(gen, rt, request_id, parsed.params))
    return gens


def kv_leg(parsed: ParsedRequest):
    """The P/D leg to run: leg 1's lease comes back only in a whole (non-streamed)
    answer, so a streamed leg 1 holds nothing."""
    if isinstance(parsed.kv_transfer, RemoteDecode) and parsed.stream:
        return None
    return parsed.kv_transfer


async def interleave(gens: list):
    """(prompt index, RequestOutput) as outputs arrive, from all prompts interleaved.
    Closing this generator aborts the requests."""
    if len(gens) == 1:
        # One prompt (most requests): read in the caller's task, without a pump task and
        # a second queue, whose extra wake-up per token costs the HTTP thread CPU time
        # that the engine's threads, sharing the cores, then lose too. Closing us
        # closes it, which aborts.
        async with contextlib.aclosing(gens[0]) as gen:
            try:
                async for out in gen:
                    yield 0, out
            except ValueError as e:
                raise bad_request(str(e)) from e
        return
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
