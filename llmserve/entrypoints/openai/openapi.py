"""The OpenAPI 3.1 document served at /openapi.json (used by clients, by the fuzz tests
and, cut to its paths, by the gateway). Request schemas are generated from the pydantic
models that validate the requests (protocol.py), so the document cannot drift from
what the server accepts."""

from __future__ import annotations

from functools import cache

from pydantic.json_schema import models_json_schema

from llmserve import __version__
from llmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from llmserve.entrypoints.openai.protocol_responses import ResponsesRequest

REF = "#/components/schemas/{model}"

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "integer", "null"]}}}}}


def _json_body(model) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {
        "$ref": REF.format(model=model.__name__)}}}}


def _responses(ok: str, *errors: int) -> dict:
    out = {"200": {"description": ok, "content": {"application/json": {"schema": {
        "type": "object"}}}}}
    for code in errors:
        out[str(code)] = {"description": "error",
                          "content": {"application/json": {"schema": _ERROR}}}
    return out


def _post(operation: str, model, ok: str, *errors: int) -> dict:
    return {"post": {"operationId": operation, "requestBody": _json_body(model),
                     "responses": _responses(ok, *errors)}}


@cache
def openapi_document() -> dict:
    """Built once per process (the models do not change); callers must not mutate it."""
    models = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest,
              DetokenizeRequest)
    _, schemas = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmserve OpenAI-compatible API", "version": __version__},
        "paths": {
            "/v1/completions": _post("createCompletion", CompletionRequest, "completion",
                                     400, 404),
            "/v1/chat/completions": _post("createChatCompletion", ChatCompletionRequest,
                                          "chat", 400, 404),
            # 404: a previous_response_id that is not (or no longer) stored.
            "/v1/responses": _post("createResponse", ResponsesRequest, "response", 400, 404),
            "/v1/models": {"get": {"operationId": "listModels",
                                   "responses": _responses("models")}},
            "/tokenize": _post("tokenize", TokenizeRequest, "tokens", 400),
            "/detokenize": _post("detokenize", DetokenizeRequest, "text", 400),
            "/health": {"get": {"operationId": "health", "responses": {
                "200": {"description": "engine alive"},
                "503": {"description": "engine dead or draining"}}}},
            "/version": {"get": {"operationId": "version", "responses": _responses("version")}},
        },
        "components": {"schemas": schemas.get("$defs", {})},
    }
