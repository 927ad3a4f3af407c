"""OpenAI request parsing and validation: JSON bodies -> prompts + SamplingParams.

Every rejection is an APIError carrying OpenAI's error shape; nothing here
touches the engine, so a bad request changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.core.request import Tenancy
from llmserve.core.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from llmserve.errors import APIError, bad_request  # noqa: F401 - re-exported


# --- typed field access ------------------------------------------------------------------
def _get(body: dict, name: str, kinds, default=None, *, nullable: bool = True):
    value = body.get(name, default)
    if value is None:
        if name in body and not nullable:
            raise bad_request(f"'{name}' must not be null", name)
        return default
    if kinds is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kinds is int and isinstance(value, bool) or not isinstance(value, kinds):
        names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
                 list: "an array", dict: "an object"}
        raise bad_request(f"'{name}' must be {names.get(kinds, str(kinds))}, "
                          f"got {type(value).__name__}", name)
    return value


def _is_token_list(x) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


@dataclass
class ParsedRequest:
    prompts: list[str | list[int]]  # one entry per prompt (completions may batch several)
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    logprobs_style: str | None  # "completion" | "chat" | None
    cache_salt: str | None = None
    tools: object | None = None  # tool_calls.ToolChoice when tools are in play (chat)
    tenant: Tenancy | None = None  # from the gateway's headers, not the body


def parse_sampling(body: dict, *, chat: bool) -> tuple[SamplingParams, str | None]:
    max_tokens = _get(body, "max_tokens", int)
    if chat:
        max_tokens = _get(body, "max_completion_tokens", int, max_tokens)
    elif "max_tokens" not in body:
        max_tokens = 16  # OpenAI's completions default
    if max_tokens is not None and max_tokens < 1:
        raise bad_request("'max_tokens' must be at least 1", "max_tokens")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    logprobs, style = None, None
    if chat:
        if _get(body, "logprobs", bool, False):
            logprobs, style = _get(body, "top_logprobs", int, 0), "chat"
        elif body.get("top_logprobs") is not None:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        logprobs = _get(body, "logprobs", int)
        style = "completion" if logprobs is not None else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}]",
                          "top_logprobs" if chat else "logprobs")
    n = _get(body, "n", int, 1)
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' other than n is not supported", "best_of")
    if _get(body, "echo", bool, False):
        raise bad_request("'echo' is not supported", "echo")
    if _get(body, "logit_bias", dict):
        raise bad_request("'logit_bias' is not supported", "logit_bias")
    if _get(body, "suffix", str):
        raise bad_request("'suffix' is not supported", "suffix")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not (
            isinstance(stop_token_ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids)):
        raise bad_request("'stop_token_ids' must be an array of integers", "stop_token_ids")
    kwargs = dict(
        n=n,
        temperature=_get(body, "temperature", float, 1.0),
        top_p=_get(body, "top_p", float, 1.0),
        top_k=_get(body, "top_k", int, -1),
        min_p=_get(body, "min_p", float, 0.0),
        seed=_get(body, "seed", int),
        max_tokens=max_tokens,
        min_tokens=_get(body, "min_tokens", int, 0),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=_get(body, "ignore_eos", bool, False),
        logprobs=logprobs,
        presence_penalty=_get(body, "presence_penalty", float, 0.0),
        frequency_penalty=_get(body, "frequency_penalty", float, 0.0),
        repetition_penalty=_get(body, "repetition_penalty", float, 1.0),
        skip_special_tokens=_get(body, "skip_special_tokens", bool, True),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
        structured_outputs=parse_structured_outputs(body),
    )
    try:
        return SamplingParams(**kwargs), style
    except ValueError as e:
        raise bad_request(str(e), str(e).split(" ")[0]) from e


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def parse_structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """OpenAI's response_format, vLLM's structured_outputs object, or the older
    guided_* fields (at most one of them); None for free text."""
    found: list[tuple[str, dict]] = []
    fmt = _get(body, "response_format", dict)
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    so = _get(body, "structured_outputs", dict)
    if so is not None:
        unknown = sorted(set(so) - set(STRUCTURED_KEYS))
        if unknown:
            raise bad_request(f"structured_outputs: unsupported field(s) {unknown}; "
                              f"supported: {list(STRUCTURED_KEYS)}", "structured_outputs")
        found.append(("structured_outputs", {k: v for k, v in so.items() if v is not None}))
    for field_name, kind in GUIDED_FIELDS.items():
        if body.get(field_name) is not None:
            found.append((field_name, {kind: body[field_name]}))
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


def _response_format(fmt: dict) -> dict | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not (isinstance(js, dict) and isinstance(js.get("schema"), dict)):
            raise bad_request("response_format.json_schema must be an object with a "
                              "'schema' object", "response_format")
        return {"json": js["schema"]}
    raise bad_request("response_format.type must be 'text', 'json_object' or 'json_schema'",
                      "response_format")


def parse_common(body, *, chat: bool) -> tuple:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    params, style = parse_sampling(body, chat=chat)
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict)
    include_usage = False
    if options is not None:
        include_usage = _get(options, "include_usage", bool, False)
    priority = _get(body, "priority", int, 0)
    cache_salt = _get(body, "cache_salt", str)
    return params, style, stream, include_usage, priority, cache_salt


def parse_completion(body) -> ParsedRequest:
    params, style, stream, usage, priority, salt = parse_common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request("'prompt' must be a string, an array of strings, an array of "
                          "token ids or an array of such arrays", "prompt")
    if len(prompts) * params.n > 256:
        raise bad_request("too many completions in one request (prompts x n > 256)", "prompt")
    return ParsedRequest(prompts, params, stream, usage, priority, style, salt)


CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


def parse_messages(body) -> list[dict]:
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise bad_request(f"messages[{i}] must be an object with a 'role' in "
                              f"{sorted(CHAT_ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad_request(f"messages[{i}].content: only text parts are supported",
                                      "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or text parts",
                              "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        message = {"role": role, "content": content}
        if m["role"] == "tool":
            message.update({k: m[k] for k in ("tool_call_id", "name")
                            if isinstance(m.get(k), str)})
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _parse_message_tool_calls(m["tool_calls"], i)
        clean.append(message)
    return clean


def _parse_message_tool_calls(calls, i: int) -> list[dict]:
    """An earlier assistant turn's calls, replayed to the model."""
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), str) for c in calls)
    if not ok:
        raise bad_request(f"messages[{i}].tool_calls must be an array of "
                          "{'function': {'name': str, 'arguments': str}}", "messages")
    return calls


def parse_chat(body) -> tuple[ParsedRequest, list[dict]]:
    params, style, stream, usage, priority, salt = parse_common(body, chat=True)
    messages = parse_messages(body)
    return ParsedRequest([], params, stream, usage, priority, style, salt), messages
