"""POST /v1/completions: one or several prompts (text or token ids), n choices each."""

from __future__ import annotations

from aiohttp import web

from llmserve.entrypoints.openai.protocol import parse_completion
from llmserve.entrypoints.openai.serving_engine import (
    ENGINE,
    check_admitting,
    check_model,
    compile_constraint,
    read_json,
    respond,
    tenancy_of,
)


async def completions(request: web.Request) -> web.StreamResponse:
    check_admitting(request)
    body = await read_json(request)
    model = check_model(request, body)
    _, parsed = parse_completion(body)
    parsed.tenant = tenancy_of(request)
    engine = request.app[ENGINE]
    prompt_ids = [engine.tokenize(p) for p in parsed.prompts]
    await compile_constraint(engine, parsed, "response_format")
    return await respond(request, model, parsed, parsed.prompts, prompt_ids, chat=False)
