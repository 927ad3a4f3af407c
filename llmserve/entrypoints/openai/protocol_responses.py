"""POST /v1/responses (OpenAI's Responses API): the request body as pydantic models,
its translation to a chat request (so rendering, tools, structured outputs and
sampling are the chat path's, checked in one place), and the shapes of its answer
(the response object, its output items, usage).

Unlike chat, unknown fields are a 400: the Responses API has many fields that change
what a response is (built-in tools, reasoning, background runs, truncation), and one
this server cannot honour must never be dropped silently. Fields it knows but does
not implement are accepted only at their "off" values and are otherwise a 400 naming
them. Every rejection is an APIError in OpenAI's shape naming the field.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmserve.entrypoints.openai.protocol import APIError, bad_request, validation_error

MAX_METADATA_KEYS = 16  # OpenAI's


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# --- input items ----------------------------------------------------------------------------
class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):  # an earlier answer's text, sent back as input
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


Parts = list[InputText | OutputText]


class MessageItem(_Strict):
    type: Literal["message"] | None = None  # absent in the "easy" form
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Parts
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: None = None  # only gpt-5's; accepted as null, as the client may echo it

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    name: str | None = None
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(
            p.text for p in self.output)


ITEM_MODELS = {"message": MessageItem, "function_call": FunctionCallItem,
               "function_call_output": FunctionCallOutputItem}


# --- tools, tool choice, text format --------------------------------------------------------
class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    # Enforced (the output is constrained to the schema) when tool_choice is "required" or
    # names the function; under "auto" the model writes calls freely, as chat's auto does.
    strict: bool | None = None
    description: str | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: None = None  # gpt-5's; only null (unset)


class StreamOptions(_Strict):
    include_usage: bool | None = None  # usage is always in the final event; the gateway sets it
    include_obfuscation: Literal[False] | None = None  # no padding is added


# --- the request ------------------------------------------------------------------------------
class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]  # items are checked one by one (errors name input[i])
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None  # checked one by one, as input is
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # identifiers for abuse tracking: echoed, never used
    safety_identifier: str | None = None
    priority: int | None = None  # vLLM's; a tenanted gateway sets it from the class
    # OpenAI's, accepted only at their "off" values (UNSUPPORTED says which).
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    context_management: Any = None
    background_options: Any = None
    image: Any = None
    moderation: Any = None
    access_programs: Any = None


def _off(value) -> bool:
    return value is None or value is False or value == [] or value == {}


# field -> (is the value one this server honours, what to say when not)
UNSUPPORTED = {
    "background": (_off, "background responses are not supported"),
    "include": (_off, "no 'include' values are supported"),
    "reasoning": (lambda v: _off(v) or all(x is None for x in v.values()),
                  "reasoning options are not supported"),
    "truncation": (lambda v: v in (None, "disabled"),
                   "only 'disabled' truncation is supported (too long an input is a 400)"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only the default tier exists"),
    "top_logprobs": (lambda v: v in (None, 0), "logprobs are not supported on /v1/responses"),
    "parallel_tool_calls": (lambda v: v is not False, "false is not supported"),
    **{name: (_off, "not supported by this server") for name in (
        "max_tool_calls", "conversation", "prompt", "prompt_cache_key", "prompt_cache_retention",
        "prompt_cache_options", "context_management", "background_options", "image",
        "moderation", "access_programs")},
}


# --- parsing --------------------------------------------------------------------------------
def parse_request(body) -> ResponsesRequest:
    """The body as a ResponsesRequest, its items and tools checked; 400 otherwise."""
    if isinstance(body, dict) and "input" in body and not isinstance(body["input"], (str, list)):
        raise bad_request("'input' must be a string or an array of input items", "input")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(ResponsesRequest, e) from None
    for name, (ok, why) in UNSUPPORTED.items():
        if not ok(getattr(req, name)):
            raise bad_request(f"'{name}': {why}", name)
    if req.metadata is not None and len(req.metadata) > MAX_METADATA_KEYS:
        raise bad_request(f"'metadata' may have at most {MAX_METADATA_KEYS} keys", "metadata")
    if isinstance(req.input, list) and not req.input:
        raise bad_request("'input' must not be empty", "input")
    if req.text and req.text.format and req.text.format.type == "json_schema" \
            and req.text.format.schema_ is None:
        raise bad_request("'text.format.schema' is required for a json_schema format", "text")
    return req


def input_items(req: ResponsesRequest) -> list[BaseModel]:
    """``input`` as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    return [_item(i, raw) for i, raw in enumerate(req.input)]


def _item(i: int, raw: dict) -> BaseModel:
    kind = raw.get("type", "message")
    model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise bad_request(f"'input[{i}].type' {kind!r} is not supported; input items may be "
                          f"{', '.join(ITEM_MODELS)}", "input")
    parts = raw.get("content") if model is MessageItem else None
    for j, part in enumerate(parts if isinstance(parts, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text"):
            raise bad_request(f"'input[{i}].content[{j}].type' {kind!r} is not supported; "
                              "content parts may be input_text or output_text", "input")
    return _nested(model, raw, f"input[{i}]", "input")


def function_tools(req: ResponsesRequest) -> list[FunctionTool]:
    tools = []
    for i, raw in enumerate(req.tools or []):
        kind = raw.get("type")
        if kind != "function":
            raise bad_request(f"'tools[{i}]': the tool type {kind!r} is not supported; only "
                              "function tools are (no built-in tools)", "tools")
        tools.append(_nested(FunctionTool, raw, f"tools[{i}]", "tools"))
    return tools


def _nested(model: type[BaseModel], raw: dict, where: str, field: str) -> BaseModel:
    """``raw`` as ``model``; a 400 whose message names the path inside the request."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = validation_error(model, e)
        inner = err.message[1:] if err.message.startswith("'") else f"': {err.message}"
        raise bad_request(f"'{where}.{inner}", field) from None


# --- translation to chat --------------------------------------------------------------------
def history_messages(items: list[BaseModel], earlier: list[dict]) -> list[dict]:
    """Input items as chat messages (ChatCompletionRequest's shape), after ``earlier``
    ones: function calls become an assistant's tool_calls, their outputs tool messages
    (whose call must come before them, as OpenAI requires)."""
    calls = {c["id"]: c["function"]["name"] for m in earlier for c in m.get("tool_calls") or ()}
    out: list[dict] = []
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            calls[item.call_id] = item.name
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one turn, several calls
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if item.call_id not in calls:
                raise bad_request(f"'input[{i}].call_id': no function_call with call_id "
                                  f"{item.call_id!r} comes before this output", "input")
            out.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id,
                        "name": item.name or calls[item.call_id]})
    return out


def chat_body(req: ResponsesRequest, tools: list[FunctionTool], messages: list[dict]) -> dict:
    """The chat completion request that asks the engine for this response."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"messages": system + messages, "stream": bool(req.stream)}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"),
                         ("temperature", "temperature"), ("top_p", "top_p"),
                         ("priority", "priority")):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    if tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            include={"name", "description", "parameters"}, exclude_none=True)} for t in tools]
    if isinstance(req.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.schema_}}
    return body


# The chat request's fields as the Responses request names them, for its errors.
_CHAT_NAMES = {"messages": "input", "prompt": "input", "max_completion_tokens":
               "max_output_tokens", "max_tokens": "max_output_tokens", "response_format": "text"}


@contextlib.contextmanager
def responses_names():
    """A 400 from the chat path names the Responses request's field, not chat's."""
    try:
        yield
    except APIError as e:
        if e.param in _CHAT_NAMES:
            new = _CHAT_NAMES[e.param]
            e.message = e.message.replace(e.param, new).replace("max_tokens",
                                                                "max_output_tokens")
            e.param = new
        raise


# --- the answer's shapes --------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_body(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def response_body(rid: str, created: float, model: str, req: ResponsesRequest,
                  tools: list[FunctionTool], status: str, output: list[dict],
                  usage: dict | None) -> dict:
    """The response object, as OpenAI returns it (and the client's Response parses it)."""
    choice = req.tool_choice
    fmt = req.text.format if req.text and req.text.format else TextFormat(type="text")
    return {
        "id": rid, "object": "response", "created_at": created, "model": model,
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "output": output, "parallel_tool_calls": True,
        "previous_response_id": req.previous_response_id,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else (
            choice or "auto"),
        "tools": [t.model_dump() for t in tools],
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        "truncation": "disabled", "store": req.store is not False, "background": False,
        "user": req.user, "safety_identifier": req.safety_identifier,
        "usage": usage,
    }
