"""POST /tokenize and /detokenize (vLLM's extensions): a prompt or chat as the model's
token ids, and back."""

from __future__ import annotations

from aiohttp import web

from llmserve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    validate,
)
from llmserve.entrypoints.openai.serving_chat import render
from llmserve.entrypoints.openai.serving_engine import ENGINE, check_model, read_json


async def tokenize(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_model(request, body)
    req: TokenizeRequest = validate(TokenizeRequest, body)
    engine = request.app[ENGINE]
    if "messages" in req.model_fields_set:
        if req.messages is None:
            raise bad_request("'messages' must be a non-empty array", "messages")
        text = render(engine.tokenizer, [m.for_template() for m in req.messages])
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
    elif req.prompt is not None:
        ids = engine.tokenizer.encode(req.prompt)
    else:
        raise bad_request("give 'prompt' (a string) or 'messages'", "prompt")
    return web.json_response({"tokens": ids, "count": len(ids),
                              "max_model_len": engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    body = await read_json(request)
    check_model(request, body)
    req: DetokenizeRequest = validate(DetokenizeRequest, body)
    engine = request.app[ENGINE]
    vocab = engine.vocab_size
    if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= vocab):
        raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
    return web.json_response({"prompt": engine.tokenizer.decode(req.tokens)})
