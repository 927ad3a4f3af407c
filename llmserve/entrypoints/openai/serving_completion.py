"""POST /v1/completions: one or several prompts (text or token ids), n choices each."""

from __future__ import annotations

from aiohttp import web

from llmserve.entrypoints.openai.protocol import parse_completion
from llmserve.entrypoints.openai.serving_engine import (
    accept_generation,
    compile_constraint,
    respond,
)


async def completions(request: web.Request) -> web.StreamResponse:
    engine, model, _, parsed = await accept_generation(request, parse_completion)
    prompt_ids = [engine.tokenize(p) for p in parsed.prompts]
    await compile_constraint(engine, parsed, "response_format")
    return await respond(request, model, parsed, parsed.prompts, prompt_ids, chat=False)
