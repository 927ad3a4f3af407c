"""The OpenAPI 3 document served at /openapi.json (used by clients and by the fuzz tests)."""

from __future__ import annotations

from llmserve import __version__

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "integer", "null"]}}}}}

_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 16},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer"}},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object",
                       "properties": {"include_usage": {"type": "boolean"}}},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "ignore_eos": {"type": "boolean"},
    "min_tokens": {"type": "integer", "minimum": 0},
    "priority": {"type": "integer"},
    "cache_salt": {"type": "string"},
    # Structured outputs (at most one of these per request).
    "response_format": {"oneOf": [
        {"type": "object", "required": ["type"],
         "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
                "name": {"type": "string"}, "schema": {"type": "object"},
                "strict": {"type": "boolean"}}}}}]},
    "structured_outputs": {"type": "object", "properties": {
        "json": {"type": "object"}, "regex": {"type": "string"},
        "choice": {"type": "array", "items": {"type": "string"}},
        "grammar": {"type": "string"}, "json_object": {"type": "boolean"}}},
    "guided_json": {"type": "object"},
    "guided_regex": {"type": "string"},
    "guided_choice": {"type": "array", "items": {"type": "string"}},
    "guided_grammar": {"type": "string"},
}

_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}}}

_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}}}


def _json_body(schema: dict) -> dict:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _responses(ok: str, *errors: int) -> dict:
    out = {"200": {"description": ok, "content": {"application/json": {"schema": {
        "type": "object"}}}}}
    for code in errors:
        out[str(code)] = {"description": "error",
                          "content": {"application/json": {"schema": _ERROR}}}
    return out


def openapi_document() -> dict:
    completion = {"type": "object", "required": ["prompt"], "properties": dict(
        _SAMPLING,
        prompt={"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                          {"type": "array", "items": {"type": "integer"}}]},
        logprobs={"type": ["integer", "null"], "minimum": 0, "maximum": 20})}
    chat = {"type": "object", "required": ["messages"], "properties": dict(
        _SAMPLING, messages={"type": "array", "minItems": 1, "items": _MESSAGE},
        max_completion_tokens={"type": ["integer", "null"], "minimum": 1},
        logprobs={"type": "boolean"},
        top_logprobs={"type": "integer", "minimum": 0, "maximum": 20},
        tools={"type": "array", "items": _TOOL},
        tool_choice={"oneOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "required": ["name"],
                             "properties": {"name": {"type": "string"}}}}}]})}
    tokenize = {"type": "object", "properties": {"prompt": {"type": "string"},
                                                 "model": {"type": "string"}}}
    detokenize = {"type": "object", "required": ["tokens"], "properties": {
        "tokens": {"type": "array", "items": {"type": "integer"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmserve OpenAI-compatible API", "version": __version__},
        "paths": {
            "/v1/completions": {"post": {"operationId": "createCompletion",
                                         "requestBody": _json_body(completion),
                                         "responses": _responses("completion", 400, 404)}},
            "/v1/chat/completions": {"post": {"operationId": "createChatCompletion",
                                              "requestBody": _json_body(chat),
                                              "responses": _responses("chat", 400, 404)}},
            "/v1/models": {"get": {"operationId": "listModels",
                                   "responses": _responses("models")}},
            "/tokenize": {"post": {"operationId": "tokenize", "requestBody": _json_body(tokenize),
                                   "responses": _responses("tokens", 400)}},
            "/detokenize": {"post": {"operationId": "detokenize",
                                     "requestBody": _json_body(detokenize),
                                     "responses": _responses("text", 400)}},
            "/health": {"get": {"operationId": "health", "responses": {
                "200": {"description": "engine alive"},
                "503": {"description": "engine dead or draining"}}}},
            "/version": {"get": {"operationId": "version", "responses": _responses("version")}},
        },
    }
