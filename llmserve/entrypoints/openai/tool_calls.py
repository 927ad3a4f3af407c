"""Tool calling on /v1/chat/completions: OpenAI's `tools` and `tool_choice`.

The model sees the tools through its chat template when the template takes a
`tools` argument; otherwise a system preamble lists them and asks for Hermes-style
calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format most
open models are tuned on.

- `none`: tools are not shown, the output is plain content;
- `auto`: free generation; `<tool_call>` blocks in the output become tool calls;
- a named function: the output is constrained to that function's `arguments`
  (its parameter schema), so the call always validates;
- `required`: the output is constrained to a JSON array of one or more calls, each
  an object `{"name": <one of the tools>, "arguments": <its schema>}`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from llmserve.core.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolChoice:
    tools: dict[str, dict]  # name -> {"name", "description", "parameters"}
    mode: str  # none | auto | required | named
    name: str | None = None  # the named function

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=self.tools[self.name]["parameters"])
        if self.mode == "required":
            calls = [{"type": "object", "additionalProperties": False,
                      "properties": {"name": {"const": name}, "arguments": t["parameters"]},
                      "required": ["name", "arguments"]} for name, t in self.tools.items()]
            return StructuredOutputsParams(json={
                "type": "array", "minItems": 1,
                "items": calls[0] if len(calls) == 1 else {"anyOf": calls}})
        return None

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a finished output."""
        if self.mode == "named":
            return None, [make_call(self.name, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens or a stop string
                return text, []
            return None, [make_call(c["name"], json.dumps(c["arguments"])) for c in calls]
        if self.mode == "auto":
            return parse_hermes_calls(text, self.tools)
        return text, []


def make_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|\Z)", re.S)


def parse_hermes_calls(text: str, tools: dict[str, dict]) -> tuple[str | None, list[dict]]:
    """`<tool_call>` blocks naming a known tool become calls; anything that does not
    parse stays in the content, so nothing the model wrote is lost."""
    calls, kept, last = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _as_call(m.group(1), tools)
        if call is None:
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _as_call(raw: str, tools: dict[str, dict]) -> dict | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
            and obj["name"] in tools):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return make_call(obj["name"], args)
    return make_call(obj["name"], json.dumps(args))


# --- request parsing ---------------------------------------------------------------------
def parse_tool_choice(body: dict) -> ToolChoice | None:
    """``tools`` / ``tool_choice`` of a request whose shapes protocol.py validated (the
    names' form too); None when the request has no tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    by_name: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool["function"]
        name = fn["name"]
        if name in by_name:
            raise ToolError(f"tools: the function name {name!r} appears twice", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object",
                            "tools")
        by_name[name] = {"name": name, "description": fn.get("description") or "",
                         "parameters": params}
    if choice is None or choice in ("none", "auto", "required"):
        return ToolChoice(by_name, choice or "auto")
    name = choice["function"]["name"]
    if name not in by_name:
        raise ToolError(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")
    return ToolChoice(by_name, "named", name)


# --- prompts ------------------------------------------------------------------------------
def template_takes_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def as_template_tools(choice: ToolChoice) -> list[dict]:
    return [{"type": "function", "function": t} for t in choice.tools.values()]


def preamble(choice: ToolChoice) -> str:
    lines = "\n".join(json.dumps({"type": "function", "function": t})
                      for t in choice.tools.values())
    return ("You can call functions. Their signatures, one JSON object per line:\n"
            f"<tools>\n{lines}\n</tools>\n"
            "To call one, write a JSON object with the function's name and its arguments "
            f"between {OPEN} and {CLOSE} tags:\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{...}}}}\n{CLOSE}')


def messages_for_template(messages: list[dict], choice: ToolChoice | None,
                          tokenizer) -> tuple[list[dict], dict]:
    """Messages (and extra template arguments) that show the model its tools and the
    calls and results so far, whether or not its template knows about tools."""
    native = template_takes_tools(tokenizer)
    out = [_message_for_template(m, native) for m in messages]
    if choice is None or choice.mode == "none":
        return out, {}
    if native:
        return out, {"tools": as_template_tools(choice)}
    text = preamble(choice)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, {}


def _message_for_template(m: dict, native: bool) -> dict:
    calls = m.get("tool_calls")
    if not calls:
        keep = ("tool_call_id", "name") if native else ()  # what tool templates read
        return {"role": m["role"], "content": m["content"],
                **{k: m[k] for k in keep if k in m}}
    if native:  # templates expect arguments as objects
        return {"role": m["role"], "content": m["content"], "tool_calls": [
            {"type": "function", "function": {"name": c["function"]["name"],
                                              "arguments": _loads_or_raw(c)}}
            for c in calls]}
    written = "\n".join(f'{OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": _loads_or_raw(c)})}\n{CLOSE}'  # noqa: E501
                        for c in calls)
    return {"role": m["role"], "content": "\n".join(x for x in (m["content"], written) if x)}


def _loads_or_raw(call: dict):
    args = call["function"].get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


# --- streaming ----------------------------------------------------------------------------
class ToolCallStream:
    """The chat deltas of one streamed choice when tools are in play.

    A named call streams its arguments as they are generated, as OpenAI does. In
    `auto`, content streams until a `<tool_call>` tag may be starting (the last few
    characters wait until they cannot be one); the calls are sent whole when the
    output ends, as are `required`'s, whose array is only known to parse then."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.text = ""  # what ``feed`` was given so far
        self.sent = 0
        self.calls: list[dict] = []

    def feed(self, new_text: str, finished: bool) -> list[dict]:
        """``update`` with the choice's text so far being what was fed, plus ``new_text``."""
        self.text += new_text
        return self.update(self.text, finished)

    def update(self, text: str, finished: bool) -> list[dict]:
        if self.choice.mode == "named":
            return self._named(text)
        if not finished:
            if self.choice.mode != "auto":
                return []
            at = text.find(OPEN, self.sent)
            safe = at if at >= 0 else len(text) - (len(OPEN) - 1)
            return self._content(text, safe)
        content, calls = self.choice.extract(text)
        if not calls:
            return self._content(text, len(text))
        self.calls = calls
        return [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(calls)]

    def _named(self, text: str) -> list[dict]:
        deltas = []
        if not self.calls:
            self.calls = [make_call(self.choice.name, "")]
            deltas.append({"tool_calls": [{"index": 0, **self.calls[0]}]})
        new = text[self.sent:]
        self.sent = len(text)
        if new:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": new}}]})
        return deltas

    def _content(self, text: str, upto: int) -> list[dict]:
        if upto <= self.sent:
            return []
        new, self.sent = text[self.sent:upto], upto
        return [{"content": new}]
