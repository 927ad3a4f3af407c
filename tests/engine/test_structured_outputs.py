"""Structured outputs and tool calls through the OpenAI API, with the official client,
on a random tiny model (near-uniform next-token distributions: the hardest case for
a grammar) and on the built-in model. Sampling at temperature 1.0 with seeds, so a
failure reproduces."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from llmserve import LLM, SamplingParams
from llmserve.core.sampling_params import StructuredOutputsParams
from llmserve.entrypoints.openai.tool_calls import (
    ToolCallStream,
    messages_for_template,
    parse_tool_choice,
)
from tests.engine.test_prefix_preemption import BLOCK_BYTES_TINY
from tests.server_proc import ServerProcess

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 12},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 50},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["id", "customer", "items"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object",
                       "properties": {"zone": {"type": "string", "maxLength": 8}},
                       "required": ["zone"], "additionalProperties": False},
    },
}
ARGS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    proc = ServerProcess(str(tiny_llama), host="127.0.0.31",
                         extra=["--served-model-name", "tiny"])
    yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def builtin():
    proc = ServerProcess("smollm2-135m-instruct", host="127.0.0.32")
    yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    assert proc.stop() == 0


def chat(client, content="Give me an order.", **kw):
    return client.chat.completions.create(
        model=kw.pop("model", "tiny"), messages=[{"role": "user", "content": content}],
        temperature=1.0, seed=kw.pop("seed", 7), max_tokens=kw.pop("max_tokens", 300), **kw)


# --- JSON schema, regex, choice, grammar on the random model -------------------------------
def test_nested_schema_every_sample_validates(tiny):
    resp = chat(tiny, n=8, response_format={
        "type": "json_schema", "json_schema": {"name": "order", "schema": ORDER,
                                               "strict": True}})
    assert len(resp.choices) == 8
    for c in resp.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), ORDER)
    assert len({c.message.content for c in resp.choices}) > 1  # really sampled


def test_free_requests_in_the_same_batch_stay_free(tiny):
    # Constrained and unconstrained requests interleave in one engine batch.
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(4) as pool:
        free = [pool.submit(chat, tiny, max_tokens=40, seed=s) for s in range(2)]
        bound = [pool.submit(chat, tiny, seed=s, extra_body={"guided_json": ORDER})
                 for s in range(2)]
        for f in bound:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), ORDER)
        texts = [f.result().choices[0].message.content for f in free]
    assert not all(t.lstrip().startswith("{") for t in texts)


def test_regex_on_completions(tiny):
    pattern = r"[A-Z][a-z]{2,6} [0-9]{2,4}(-[a-z]{1,3})?"
    resp = tiny.completions.create(model="tiny", prompt="Code:", n=8, temperature=1.0, seed=1,
                                   max_tokens=40,
                                   extra_body={"structured_outputs": {"regex": pattern}})
    for c in resp.choices:
        assert re.fullmatch(pattern, c.text), c.text


def test_choice_and_its_older_spelling(tiny):
    options = ["red", "green", "deep blue"]
    for extra in ({"structured_outputs": {"choice": options}}, {"guided_choice": options}):
        resp = chat(tiny, n=6, max_tokens=10, extra_body=extra)
        assert {c.message.content for c in resp.choices} <= set(options)


def test_lark_grammar(tiny):
    grammar = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]{1,3}/'
    resp = tiny.completions.create(model="tiny", prompt="Sum:", n=6, temperature=1.0, seed=3,
                                   max_tokens=60, extra_body={"guided_grammar": grammar})
    for c in resp.choices:
        if c.finish_reason == "stop":
            text = c.text
            while re.search(r"\([0-9]+[+*][0-9]+\)", text):  # reduce innermost pairs
                text = re.sub(r"\([0-9]+[+*][0-9]+\)", "0", text)
            assert re.fullmatch(r"[0-9]{1,3}", text), c.text
    assert any(c.finish_reason == "stop" for c in resp.choices)


def test_streamed_json_is_the_same_as_unstreamed(tiny):
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}
    whole = chat(tiny, response_format=fmt, seed=11).choices[0].message.content
    stream = chat(tiny, response_format=fmt, seed=11, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole), ORDER)


def test_logprobs_and_stop_strings_work_with_a_schema(tiny):
    resp = chat(tiny, n=2, logprobs=True, top_logprobs=3, stop=['"customer"'],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "o", "schema": ORDER}})
    for c in resp.choices:
        assert c.logprobs.content and all(lp.logprob <= 0 for lp in c.logprobs.content)
        # "customer" is a required key, so every output reaches the stop string.
        assert c.finish_reason == "stop" and '"customer"' not in c.message.content
        assert c.message.content.startswith("{")
        assert c.model_extra["stop_reason"] == '"customer"'


# --- tools ------------------------------------------------------------------------------
def test_named_tool_call_validates(tiny):
    resp = chat(tiny, "Weather in Paris?", n=4, tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for c in resp.choices:
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), ARGS["get_weather"])


def test_required_tool_calls_validate_and_stream(tiny):
    resp = chat(tiny, "Weather and time?", n=4, tools=[WEATHER, TIME], tool_choice="required")
    for c in resp.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), ARGS[call.function.name])
    # The same request streamed: deltas assemble into the same calls.
    stream = chat(tiny, "Weather and time?", tools=[WEATHER, TIME], tool_choice="required",
                  stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), ARGS[call["name"]])


def test_named_tool_call_streams_its_arguments(tiny):
    kw = dict(tools=[WEATHER], seed=5,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = chat(tiny, "Weather?", **kw).choices[0].message.tool_calls[0].function.arguments
    deltas = [d for chunk in chat(tiny, "Weather?", stream=True, **kw) for ch in chunk.choices
              for d in ch.delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert len(deltas) > 2  # arguments arrive as they are generated
    assert "".join(d.function.arguments or "" for d in deltas) == whole


# --- tool_choice "auto": the model's own <tool_call> blocks -------------------------------
def test_auto_parses_hermes_blocks_and_keeps_the_rest():
    tools = parse_tool_choice({"tools": [WEATHER, TIME]})
    assert tools.mode == "auto"
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>\n<tool_call>{"name": '
            '"get_time", "arguments": {"zone": "CET"}}')  # the last one left unclosed
    content, calls = tools.extract(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    # Unknown tools and broken JSON stay content: nothing the model wrote is lost.
    for bad in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                '<tool_call>{"name": "get_time", "argu</tool_call>', "plain text"):
        assert tools.extract(bad) == (bad, [])


def test_auto_streaming_holds_back_a_tag_and_sends_calls_at_the_end():
    tools = parse_tool_choice({"tools": [TIME], "tool_choice": "auto"})
    stream = ToolCallStream(tools)
    full = 'Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    sent = []
    for end in range(1, len(full) + 1):
        sent += stream.update(full[:end], finished=False)
    sent += stream.update(full, finished=True)
    content = "".join(d.get("content", "") for d in sent)
    assert content == "Sure. "  # no half tag ever streamed as content
    (call,) = [d["tool_calls"][0] for d in sent if "tool_calls" in d]
    assert call["function"]["name"] == "get_time" and call["index"] == 0


def test_the_model_sees_its_tools_and_earlier_calls():
    tools = parse_tool_choice({"tools": [WEATHER]})

    class NoToolTemplate:
        chat_template = "{{ messages }}"
    history = [{"role": "user", "content": "Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "content": "-3 C"}]
    messages, extra = messages_for_template(history, tools, NoToolTemplate())
    assert extra == {} and messages[0]["role"] == "system"
    assert "get_weather" in messages[0]["content"] and "<tools>" in messages[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in (
        messages[2]["content"])
    none = parse_tool_choice({"tools": [WEATHER], "tool_choice": "none"})
    assert messages_for_template(history[:1], none, NoToolTemplate())[0] == history[:1]


# --- bad requests: 400s that name the problem ---------------------------------------------
@pytest.mark.parametrize("extra, needle", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "frobnicate"),
    ({"guided_regex": "(unclosed"}, "regex"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "at most one"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_grammar": "start: undefined_rule"}, "grammar"),
    ({"guided_choice": []}, "choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "no-such-format"}}}},
     "no-such-format"),
    # A keyword the library does not implement is refused, never silently ignored.
    ({"guided_json": {"type": "object", "if": {"required": ["a"]}, "then": {}}}, "if"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "must be an object"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
     "tool_choice"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
])
def test_bad_constraints_are_400s_naming_the_problem(tiny, extra, needle):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with pytest.raises(openai.BadRequestError) as err:
        tiny.chat.completions.create(**body, extra_body=extra)
    assert needle in err.value.message, err.value.message
    # And the server still serves.
    assert tiny.chat.completions.create(**body).choices[0].message.content is not None


# --- the built-in model -------------------------------------------------------------------
class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: float = pydantic.Field(ge=0, le=50)
    landmarks: list[str] = pydantic.Field(max_length=3)


@pytest.mark.slow
def test_openai_parse_with_a_pydantic_model(builtin):
    resp = builtin.beta.chat.completions.parse(
        model="smollm2-135m-instruct", temperature=1.0, seed=3, max_tokens=200,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City)
    city = resp.choices[0].message.parsed
    assert isinstance(city, City) and city.name


@pytest.mark.slow
def test_builtin_model_json_object_and_named_tool(builtin):
    resp = builtin.chat.completions.create(
        model="smollm2-135m-instruct", temperature=1.0, seed=1, max_tokens=150, n=3,
        messages=[{"role": "user", "content": "A JSON object about a cat, please."}],
        response_format={"type": "json_object"})
    for c in resp.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    assert any(c.finish_reason == "stop" for c in resp.choices)
    resp = builtin.chat.completions.create(
        model="smollm2-135m-instruct", temperature=1.0, seed=2, max_tokens=80,
        messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = resp.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), ARGS["get_weather"])


# --- the engine: preemption keeps the parser in step ---------------------------------------
@pytest.mark.slow
def test_constrained_outputs_survive_swap_and_recompute(tiny_llama):
    spec = StructuredOutputsParams(json=ORDER)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured_outputs=spec)
              for s in range(12)]
    prompts = [f"order {i}: " + "word " * (i * 7) for i in range(12)]
    ample = LLM(str(tiny_llama), kv_cache_memory=64 << 20).generate(prompts, params)
    ref = [o.outputs[0].text for o in ample]
    for text in ref:
        jsonschema.validate(json.loads(text), ORDER)
    for mode in ("swap", "recompute"):
        tight = LLM(str(tiny_llama), kv_cache_memory=48 * BLOCK_BYTES_TINY,
                    swap_space=400 * BLOCK_BYTES_TINY, preemption_mode=mode,
                    max_num_batched_tokens=64, watermark=0.0)
        outs = tight.generate(prompts, params)
        assert tight.engine.scheduler.num_preemptions > 0, mode
        assert [o.outputs[0].text for o in outs] == ref, mode


@pytest.mark.slow
def test_aborting_a_constrained_request_frees_everything(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory=64 << 20)
    engine = llm.engine
    spec = StructuredOutputsParams(json=ORDER)
    req = engine.add_request("order:", SamplingParams(temperature=1.0, seed=0, max_tokens=300,
                                                      n=3, structured_outputs=spec))
    for _ in range(5):
        engine.step()
    assert engine.abort(req.request_id)
    engine.block_manager.check_all_free()
    out = llm.generate(["order:"], SamplingParams(temperature=1.0, seed=0, max_tokens=300,
                                                  structured_outputs=spec))
    jsonschema.validate(json.loads(out[0].outputs[0].text), ORDER)


def test_streamed_named_calls_of_parallel_samples_reassemble(tiny):
    kw = dict(tools=[WEATHER], n=2, seed=8,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args: dict[int, str] = {}
    for chunk in chat(tiny, "Weather?", stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                args[ch.index] = args.get(ch.index, "") + (d.function.arguments or "")
    assert sorted(args) == [0, 1]
    for text in args.values():
        jsonschema.validate(json.loads(text), ARGS["get_weather"])
