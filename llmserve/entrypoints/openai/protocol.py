"""The OpenAI protocol: request bodies as pydantic models (as vLLM and the openai SDK
define them), their conversion to the engine's SamplingParams, and the JSON schemas
/openapi.json is generated from.

The models check types, strictly (JSON's ``true`` is no integer, ``"1"`` no number);
ranges and the rules between fields are SamplingParams's (one place, shared with the
offline API), which the schema only documents. Unknown fields are ignored, as OpenAI
does, except inside ``structured_outputs``, where a misspelt key would silently drop a
constraint. ``null`` means "the default" for every optional field. Every rejection is
an APIError in OpenAI's shape naming the field; nothing here touches the engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.json_schema import SkipJsonSchema

from llmserve.core.beam_search import BeamSearchParams
from llmserve.core.request import Tenancy
from llmserve.core.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    SamplingParams,
    StructuredOutputsParams,
    beam_sampling_params,
)
from llmserve.distributed.kv_transfer.params import (
    RemoteDecode,
    RemotePrefill,
    parse_kv_transfer_params,
)
from llmserve.errors import APIError, bad_request  # noqa: F401 - re-exported

# A prompt given as token ids; never empty (an empty prompt cannot run). The upper bound
# is the model's vocabulary, which the engine checks.
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
MAX_COMPLETIONS = 256  # prompts x n in one request
_DIGITS = re.compile(r"^[0-9]{1,18}$")  # a token id as a logit_bias key (fits int64)


def documented(**schema) -> Any:
    """A range the schema shows and SamplingParams enforces (see the module docstring)."""
    return Field(None, json_schema_extra=schema)


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# --- chat messages -----------------------------------------------------------------------
class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    model_config = ConfigDict(extra="allow")  # replayed to the template as sent
    name: str
    arguments: str = ""


class ToolCall(_Model):
    model_config = ConfigDict(extra="allow")
    function: FunctionCall


ROLES = ("system", "developer", "user", "assistant", "tool")


def _content_by_role(schema: dict) -> None:
    """The schema says what _content_present checks: only an assistant's message (one
    that made tool calls) may have no content."""
    props = schema["properties"]
    content = {"anyOf": [s for s in props["content"]["anyOf"] if s.get("type") != "null"],
               "description": props["content"].get("description")}
    others = {**schema, "required": ["role", "content"], "properties": {
        **props, "role": {"enum": [r for r in ROLES if r != "assistant"]}, "content": content}}
    assistant = {**schema, "properties": {**props, "role": {"const": "assistant"}}}
    schema.clear()
    schema.update({"title": others.pop("title", "ChatMessage"), "oneOf": [others, assistant]})


class ChatMessage(_Model):
    model_config = ConfigDict(json_schema_extra=_content_by_role)
    role: Literal[ROLES]
    content: str | list[TextPart] | None = Field(
        None, description="a string or an array of text parts")
    name: str | None = None  # a tool message's function
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # an earlier assistant turn's calls

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError("content must be a string or an array of text parts")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it (text parts joined, developer as
        system, an assistant's calls replayed as they were sent)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        message = {"role": "system" if self.role == "developer" else self.role,
                   "content": content or ""}
        if self.role == "tool":
            message.update({k: v for k in ("tool_call_id", "name")
                            if (v := getattr(self, k)) is not None})
        if self.role == "assistant" and self.tool_calls:
            message["tool_calls"] = [c.model_dump(exclude_unset=True) for c in self.tool_calls]
        return message


# --- tools ---------------------------------------------------------------------------------
class FunctionDef(_Model):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no parameters


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


# --- structured outputs --------------------------------------------------------------------
class JsonSchemaFormat(_Model):
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema must be an object with a 'schema' object")
        return self

    def spec(self) -> dict | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"json_object": True}
        return {"json": self.json_schema.schema_}


class StructuredOutputsSpec(_Model):
    """vLLM's structured_outputs object: exactly one of these (StructuredOutputsParams)."""
    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="a JSON schema (an object or its text)")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Model):
    include_usage: bool | None = None


# Fields that shape sampling or stream tokens, which beam search does not do.
BEAM_INCOMPATIBLE = (
    "stream", "logprobs", "top_logprobs", "echo", "prompt_logprobs", "top_p", "top_k", "min_p",
    "seed", "min_tokens", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "tools", "tool_choice")

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


# --- requests ------------------------------------------------------------------------------
class _GenerationRequest(_Model):
    """What /v1/completions and /v1/chat/completions share. Field order is the order
    errors are reported in."""
    model: str | None = None
    max_tokens: int | None = documented(minimum=1)
    stop: str | list[str] | None = Field(None, description="a string or an array of strings")
    n: int | None = documented(minimum=1, maximum=MAX_N)
    # OpenAI's, accepted only as their no-op values: not advertised in the schema.
    best_of: SkipJsonSchema[int | None] = None  # only equal to n
    suffix: SkipJsonSchema[str | None] = None  # only empty
    # Token ids as JSON object keys (OpenAI's shape); SamplingParams checks the values.
    logit_bias: Annotated[dict[str, float], Field(json_schema_extra={
        "propertyNames": {"pattern": _DIGITS.pattern}, "additionalProperties": {
            "type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}})
    ] | None = None
    stop_token_ids: list[TokenId] | None = None
    # vLLM's: the prompt tokens' log-probabilities (and this many alternatives each).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[str] | None = None
    temperature: float | None = documented(minimum=0, maximum=2)
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = None  # -1 or 0: off
    min_p: float | None = documented(minimum=0, maximum=1)
    seed: int | None = None
    min_tokens: int | None = documented(minimum=0)
    ignore_eos: bool | None = None
    presence_penalty: float | None = documented(minimum=-2, maximum=2)
    frequency_penalty: float | None = documented(minimum=-2, maximum=2)
    repetition_penalty: float | None = documented(exclusiveMinimum=0, maximum=2)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Structured outputs: at most one of these per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: dict[str, Any] | str | None = Field(
        None, description="a JSON schema (an object or its text)")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam search: n beams, returned best first (beam_search.py).
    use_beam_search: bool | None = None
    length_penalty: float | None = documented(minimum=-10, maximum=10)
    early_stopping: bool | Literal["never"] | None = Field(
        None, description="true, false or \"never\"")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    priority: int | None = None  # lower runs first
    cache_salt: str | None = None  # isolates this request's prefix-cache entries
    # P/D's two legs (vLLM's shape; distributed/kv_transfer/params.py). The gateway
    # strips clients' and sets its own.
    kv_transfer_params: dict[str, Any] | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.best_of is not None and self.best_of != _or(self.n, 1):
            raise bad_request("'best_of' other than n is not supported", "best_of")
        self.refuse_unsupported()
        if self.use_beam_search:
            return self.beam_search_params(max_tokens)
        for name in ("length_penalty", "early_stopping"):
            if getattr(self, name) is not None:
                raise bad_request(f"'{name}' needs 'use_beam_search': true", name)
        try:
            return SamplingParams(
                n=_or(self.n, 1), temperature=_or(self.temperature, 1.0),
                top_p=_or(self.top_p, 1.0), top_k=_or(self.top_k, -1),
                min_p=_or(self.min_p, 0.0), seed=self.seed, max_tokens=max_tokens,
                min_tokens=_or(self.min_tokens, 0), stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=bool(self.ignore_eos),
                logprobs=logprobs, prompt_logprobs=self.wanted_prompt_logprobs(),
                presence_penalty=_or(self.presence_penalty, 0.0),
                frequency_penalty=_or(self.frequency_penalty, 0.0),
                repetition_penalty=_or(self.repetition_penalty, 1.0),
                skip_special_tokens=_or(self.skip_special_tokens, True),
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                structured_outputs=self.structured_outputs_params(),
                logit_bias=self.logit_bias_by_id(), allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words)
        except ValueError as e:  # "<field> must ..."
            raise bad_request(str(e), str(e).split(" ")[0]) from e

    def beam_search_params(self, max_tokens: int | None) -> SamplingParams:
        """Beam search: only what it uses may be set; anything that shapes sampling
        or streams tokens is a 400 naming it."""
        for name in BEAM_INCOMPATIBLE:
            value = getattr(self, name, None)
            if value is not None and value is not False:  # (logprobs 0 counts)
                raise bad_request(f"'{name}' cannot be combined with 'use_beam_search'", name)
        try:
            return beam_sampling_params(BeamSearchParams(
                beam_width=_or(self.n, 1), max_tokens=max_tokens,
                ignore_eos=bool(self.ignore_eos), temperature=_or(self.temperature, 0.0),
                length_penalty=_or(self.length_penalty, 1.0),
                early_stopping=_or(self.early_stopping, False)))
        except ValueError as e:  # "<field> must ..."
            name = str(e).split(" ")[0]
            raise bad_request(str(e), "n" if name == "beam_width" else name) from e

    def refuse_unsupported(self) -> None:
        if self.suffix:
            raise bad_request("'suffix' is not supported", "suffix")

    def wanted_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def logit_bias_by_id(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bad = next((k for k in self.logit_bias if not _DIGITS.match(k)), None)
        if bad is not None:
            raise bad_request(f"logit_bias keys must be token ids (non-negative integers "
                              f"as strings); got {bad!r}", "logit_bias")
        return {int(k): v for k, v in self.logit_bias.items()}

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """response_format, structured_outputs or a guided_* field (at most one of
        them) as the engine's constraint; None for free text."""
        found: list[tuple[str, dict]] = []
        if self.response_format is not None and self.response_format.spec() is not None:
            found.append(("response_format", self.response_format.spec()))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.model_dump(
                by_alias=True, exclude_none=True)))
        for field_name, kind in GUIDED_FIELDS.items():
            if getattr(self, field_name) is not None:
                found.append((field_name, {kind: getattr(self, field_name)}))
        if not found:
            return None
        if len(found) > 1:
            raise bad_request("give at most one of response_format, structured_outputs and "
                              f"guided_*; got {[name for name, _ in found]}", found[1][0])
        name, spec = found[0]
        try:
            return StructuredOutputsParams(**spec)
        except (TypeError, ValueError) as e:
            raise bad_request(f"{name}: {e}", name) from e


class CompletionRequest(_GenerationRequest):
    prompt: str | TokenIds | Annotated[list[str | TokenIds], Field(min_length=1)] = Field(
        description="a string, an array of strings, an array of token ids or an array of "
                    "such arrays")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI's: the prompt is repeated before the completion (with its logprobs when
    # ``logprobs`` is set); with max_tokens 0, only the prompt comes back.
    echo: bool | None = None
    max_tokens: int | None = documented(minimum=0)

    def wanted_prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, _or(self.prompt_logprobs, 0))
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = documented(minimum=1)  # max_tokens' new name
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: SkipJsonSchema[bool | None] = None  # vLLM's chat echo: not supported
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}")

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise bad_request("'echo' is not supported on chat completions", "echo")

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


def _or(value, default):
    return default if value is None else value


# --- parsing ----------------------------------------------------------------------------
@dataclass
class ParsedRequest:
    prompts: list[str | list[int]]  # one entry per prompt (completions may batch several)
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    logprobs_style: str | None  # "completion" | "chat" | None
    cache_salt: str | None = None
    echo: bool = False  # completions: the prompt comes back before the completion
    echo_only: bool = False  # max_tokens 0: the engine's one token is not shown
    show_prompt_logprobs: bool = False  # the body asked for vLLM's prompt_logprobs
    tools: object | None = None  # tool_calls.ToolChoice when tools are in play (chat)
    tenant: Tenancy | None = None  # from the gateway's headers, not the body
    lora: object | None = None  # core.lora_request.LoRARequest: the adapter "model" names
    kv_transfer: RemoteDecode | RemotePrefill | None = None  # a P/D leg


def validate(model: type[_Model], body) -> _Model:
    """``body`` (parsed JSON) as ``model``; a 400 naming the first bad field if not."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(model, e) from None


def parse_completion(body) -> tuple[CompletionRequest, ParsedRequest]:
    req: CompletionRequest = validate(CompletionRequest, body)
    max_tokens = req.max_tokens if "max_tokens" in req.model_fields_set else 16  # OpenAI's
    echo_only = max_tokens == 0
    if echo_only and not req.echo:
        raise bad_request("'max_tokens' must be at least 1 (0 only with 'echo': true, which "
                          "returns the prompt alone)", "max_tokens")
    # The engine always samples; with max_tokens 0 its one token is dropped (as vLLM).
    params = req.sampling_params(1 if echo_only else max_tokens, req.logprobs)
    prompts = req.prompts()
    if len(prompts) * params.n > MAX_COMPLETIONS:
        raise bad_request(f"too many completions in one request (prompts x n > "
                          f"{MAX_COMPLETIONS})", "prompt")
    style = "completion" if req.logprobs is not None else None
    parsed = _parsed(req, prompts, params, style)
    parsed.echo, parsed.echo_only = bool(req.echo), echo_only
    return req, parsed


def parse_chat(body) -> tuple[ChatCompletionRequest, ParsedRequest]:
    req: ChatCompletionRequest = validate(ChatCompletionRequest, body)
    logprobs, style = None, None
    if req.logprobs:
        logprobs, style = _or(req.top_logprobs, 0), "chat"
    elif req.top_logprobs is not None:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    params = req.sampling_params(_or(req.max_completion_tokens, req.max_tokens), logprobs)
    return req, _parsed(req, [], params, style)


def _parsed(req: _GenerationRequest, prompts, params, style) -> ParsedRequest:
    usage = req.stream_options is not None and bool(req.stream_options.include_usage)
    try:
        kv_transfer = parse_kv_transfer_params(req.kv_transfer_params)
    except ValueError as e:
        raise bad_request(str(e), "kv_transfer_params") from e
    if kv_transfer is not None and len(prompts) > 1:
        raise bad_request("kv_transfer_params needs a single prompt", "kv_transfer_params")
    return ParsedRequest(prompts, params, bool(req.stream), usage, _or(req.priority, 0),
                         style, req.cache_salt,
                         show_prompt_logprobs=req.prompt_logprobs is not None,
                         kv_transfer=kv_transfer)


# --- errors: one clear line naming the field, never pydantic's dump -------------------------
_PHRASES = {
    "missing": "is required", "int_type": "must be an integer", "float_type": "must be a number",
    "bool_type": "must be a boolean", "string_type": "must be a string",
    "list_type": "must be an array", "dict_type": "must be an object",
    "model_type": "must be an object", "model_attributes_type": "must be an object",
    "too_short": "must not be empty", "extra_forbidden": "is not a supported field",
}
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_error(model: type[_Model], e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    path, cut = _path(err["loc"])
    if not path:
        return bad_request("the request body must be a JSON object")
    field = path[0] if isinstance(path[0], str) else None
    name = _dotted(path)
    form = _FORMS.get(path[-1]) if isinstance(path[-1], str) else None
    if form is not None and (cut or err["type"] in ("missing", "model_type")):
        return bad_request(f"'{name}' must be {form}", field)
    if err["type"] == "value_error":
        return bad_request(f"'{name}': {err['ctx']['error']}", field)
    if err["type"] == "literal_error":
        return bad_request(f"'{name}' must be {err['ctx']['expected']}", field)
    if err["type"] in ("greater_than_equal", "less_than_equal"):
        bound = err["ctx"].get("ge", err["ctx"].get("le"))
        side = "at least" if err["type"] == "greater_than_equal" else "at most"
        return bad_request(f"'{name}' must be {side} {bound}", field)
    if err["type"] == "string_pattern_mismatch":
        return bad_request(f"'{name}' must match {err['ctx']['pattern']}", field)
    got = f", got {type(err['input']).__name__}" if err["type"].endswith("_type") else ""
    phrase = _PHRASES.get(err["type"], "is not valid")
    return bad_request(f"'{name}' {phrase}{got}", field)


def _path(loc: tuple) -> tuple[tuple, bool]:
    """The field path of an error's location, cut before the first union member tag
    pydantic inserts ("str", "list[int]", "NamedToolChoice"); and whether it was cut."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and (not _FIELD.match(part) or part in _TYPE_TAGS):
            return loc[:i], True
    return loc, False


def _dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
# A union field's error names the forms it accepts (its schema description), not
# pydantic's one error per form. Keyed by the name the field has in JSON.
_FORMS = {(f.alias or name): f.description
          for m in (*MODELS, ChatMessage, StructuredOutputsSpec)
          for name, f in m.model_fields.items() if f.description}
