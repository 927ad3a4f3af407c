"""The OpenAI request models (protocol.py) and the /openapi.json generated from them,
without a server: what is accepted, the one-line 400 naming the field for what is not,
and a schema that agrees with the models."""

from __future__ import annotations

import jsonschema
import pytest

from llmserve.entrypoints.openai.openapi import openapi_document
from llmserve.entrypoints.openai.protocol import APIError, parse_chat, parse_completion

USER = [{"role": "user", "content": "hi"}]


def error_of(parse, body) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("body,param,needle", [
    ({"prompt": "x", "temperature": True}, "temperature", "'temperature' must be a number"),
    ({"prompt": "x", "stop": [1, 2]}, "stop", "a string or an array of strings"),
    ({"prompt": [[1, 2], "a", [True]]}, "prompt", "an array of token ids"),
    ({"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids", "'stop_token_ids[0]'"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "at most 20"),
    ({"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     "structural_tag"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format",
     "response_format.type"),
    ({"prompt": "x", "echo": "yes"}, "echo", "must be a boolean"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "0 only with 'echo'"),
    ({"prompt": ["a"] * 20, "n": 16}, "prompt", "too many completions"),
    ([1, 2], None, "JSON object"),
])
def test_completion_errors_name_the_field_in_one_line(body, param, needle):
    err = error_of(parse_completion, body)
    assert err.param == param and needle in err.message, err.message
    # pydantic's own dump (its URLs, its "validation error for" header) never leaks
    assert "\n" not in err.message and "pydantic" not in err.message


@pytest.mark.parametrize("body,param,needle", [
    ({"messages": []}, "messages", "'messages' must not be empty"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "'messages[0].role'"),
    ({"messages": [{"role": "user"}]}, "messages", "content"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_tokens", "max_tokens"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "needs 'logprobs'"),
    ({"messages": USER, "tool_choice": {"type": "function", "function": "f"}}, "tool_choice",
     "'tool_choice' must be 'none', 'auto', 'required' or"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools", "'tools[0].function.name'"),
])
def test_chat_errors_name_the_field_in_one_line(body, param, needle):
    err = error_of(parse_chat, body)
    assert err.param == param and needle in err.message, err.message


def test_null_means_the_default_and_unknown_fields_are_ignored():
    _, parsed = parse_completion({"prompt": [1, 2], "temperature": None, "n": None,
                                  "stream": None, "whatever": {"x": 1}})
    assert parsed.params.temperature == 1.0 and parsed.params.n == 1
    assert parsed.params.max_tokens == 16  # OpenAI's completions default when absent
    _, parsed = parse_completion({"prompt": "x", "max_tokens": None})
    assert parsed.params.max_tokens is None  # explicit null: up to the model's length
    req, parsed = parse_chat({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}],
        "logprobs": True, "max_completion_tokens": 5})
    assert req.template_messages() == [
        {"role": "system", "content": "ab"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},  # replayed as sent
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert parsed.logprobs_style == "chat" and parsed.params.logprobs == 0
    assert parsed.params.max_tokens == 5


def test_the_openapi_schema_agrees_with_the_models():
    doc = openapi_document()
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/responses",
                                 "/v1/models", "/tokenize", "/detokenize", "/health",
                                 "/version"}
    registry = {"components": doc["components"]}

    def schema_of(path):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        return {**registry, **ref["schema"]}

    good = {"prompt": [[1, 2], "x"], "temperature": 0.5, "stop": "\n",
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": {"type": "object"}}}}
    jsonschema.validate(good, schema_of("/v1/completions"))
    parse_completion(good)
    chat = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto"}
    jsonschema.validate(chat, schema_of("/v1/chat/completions"))
    parse_chat(chat)
    for bad in ({"messages": [{"role": "user", "content": None}]},  # only an assistant's
                {"messages": [{"role": "user", "content": "x"}], "n": "2"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema_of("/v1/chat/completions"))
        error_of(parse_chat, bad)
