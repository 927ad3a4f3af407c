"""POST /v1/responses: OpenAI's Responses API as a translation onto the chat path.

The request becomes a chat request (protocol_responses.py): instructions a system
message, a stored conversation (``previous_response_id``) and the input items its
messages, function tools chat's tools, ``text.format`` its response_format. From there
it is chat's: the chat template renders it, tool_calls.py shows the tools and enforces
a named or required choice, the grammar is compiled before anything is queued, and the
engine runs it under the request's tenant. What comes back is turned into output items
(a message, function calls) whole or as the API's semantic stream events.

A stored response is answered with the header ``x-llmserve-response-id``, so a gateway
can send its follow-ups to this engine, the only one that has it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time

from aiohttp import web

from llmserve.core.request import Tenancy
from llmserve.engine.async_llm import AsyncLLMEngine
from llmserve.engine.output import CompletionOutput
from llmserve.entrypoints.openai.protocol import APIError, ParsedRequest, parse_chat
from llmserve.entrypoints.openai.protocol_responses import (
    FunctionTool,
    ResponsesRequest,
    chat_body,
    function_tools,
    history_messages,
    input_items,
    new_id,
    parse_request,
    response_body,
    responses_names,
    usage_body,
)
from llmserve.entrypoints.openai.request_spans import RequestTrace, request_trace
from llmserve.entrypoints.openai.response_store import ResponseStore
from llmserve.entrypoints.openai.serving_chat import parse_tools, render
from llmserve.entrypoints.openai.serving_engine import (
    ENGINE,
    check_admitting,
    check_model,
    compile_constraint,
    interleave,
    read_json,
    start_requests,
    tenancy_of,
)
from llmserve.entrypoints.openai.streaming import fail_as_event
from llmserve.entrypoints.openai.tool_calls import ToolCallStream, messages_for_template

STORE = web.AppKey("responses_store", ResponseStore)
# The gateway reads this header (gateway/response_affinity.py; it cannot import us).
RESPONSE_ID_HEADER = "x-llmserve-response-id"


def add_routes(app: web.Application) -> None:
    app[STORE] = ResponseStore.from_env()
    app.router.add_post("/v1/responses", create_response)


async def create_response(request: web.Request) -> web.StreamResponse:
    check_admitting(request)
    body = await read_json(request)
    model = check_model(request, body)
    req = parse_request(body)
    tenant = tenancy_of(request)
    engine = request.app[ENGINE]
    messages = conversation(request.app[STORE], req, tenant)
    tools = function_tools(req)
    with responses_names():
        parsed, prompt_len, gens = await start(engine, req, tools, messages, tenant,
                                               request_trace(request, model), request["lora"])
    answer = Answer(new_id("resp"), model, req, tools, prompt_len, messages)
    store = request.app[STORE] if req.store is not False else None
    headers = {RESPONSE_ID_HEADER: answer.rid} if store is not None else {}
    outputs = interleave(gens)
    if req.stream:
        return await stream_answer(request, answer, parsed, outputs, store, tenant, headers)
    final = await last_output(outputs)
    answer.finish(final.finish_reason, len(final.token_ids), whole_deltas(parsed, final))
    answer.keep(store, tenant)
    return web.json_response(answer.body(), headers=headers)


def conversation(store: ResponseStore, req: ResponsesRequest,
                 tenant: Tenancy | None) -> list[dict]:
    """The chat messages so far: the stored ones, then the input's."""
    earlier: list[dict] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id, tenant.name if tenant else None)
        if found is None:  # unknown, expired, evicted, another tenant's, or never stored
            raise APIError(404, f"previous response with id '{req.previous_response_id}' "
                                "not found", "invalid_request_error", "previous_response_id",
                           "previous_response_not_found")
        earlier = found
    return earlier + history_messages(input_items(req), earlier)


async def start(engine: AsyncLLMEngine, req: ResponsesRequest, tools: list[FunctionTool],
                messages: list[dict], tenant: Tenancy | None, rt: RequestTrace | None = None,
                lora=None):
    """The chat path up to a running engine request: (ParsedRequest, prompt tokens,
    the engine's generators)."""
    chat_req, parsed = parse_chat(chat_body(req, tools, messages))
    parsed.tenant, parsed.lora = tenant, lora
    choice = parse_tools(chat_req, parsed)
    shown, template_args = messages_for_template(chat_req.template_messages(), choice,
                                                 engine.tokenizer)
    text = render(engine.tokenizer, shown, **template_args)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    await compile_constraint(engine, parsed, "tools" if choice and choice.constrained
                             else "text")
    return parsed, len(ids), start_requests(engine, [ids], [text], parsed, rt,
                                            stream=bool(req.stream))


async def last_output(outputs) -> CompletionOutput:
    final = None
    async with contextlib.aclosing(outputs):
        async for _, out in outputs:
            final = out.outputs[0]
    return final


# --- output items ---------------------------------------------------------------------------
def event(type_: str, **fields) -> dict:
    return {"type": type_, **fields}


class OutputItems:
    """The response's output items built from chat-style deltas (``{"content": str}`` or
    ``{"tool_calls": [...]}``, as tool_calls.ToolCallStream makes them). Each step returns
    the stream events it makes; a whole response uses the items and drops the events."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None

    def feed(self, delta: dict) -> list[dict]:
        events = self._text(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a new call
                events += self._call(call["id"], call["function"]["name"],
                                     call["function"].get("arguments", ""))
            else:
                events += self._arguments(call["function"]["arguments"])
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the last item (an empty message when nothing was written)."""
        events = [] if self.items else self._text("")
        return events + self._close(status)

    def _open(self, item: dict) -> list[dict]:
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        return events + [event("response.output_item.added", output_index=len(self.items) - 1,
                               item=copy.deepcopy(item))]

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _text(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._open({"id": new_id("msg"), "type": "message", "role": "assistant",
                                  "status": "in_progress", "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.open["content"].append(part)
            events.append(event("response.content_part.added", **self._where(),
                                content_index=0, part=dict(part)))
        self.open["content"][0]["text"] += text
        if text:
            events.append(event("response.output_text.delta", **self._where(),
                                content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        events = self._open({"id": new_id("fc"), "type": "function_call",
                             "status": "in_progress", "call_id": call_id, "name": name,
                             "arguments": ""})
        return events + self._arguments(arguments)

    def _arguments(self, delta: str) -> list[dict]:
        if not delta:
            return []
        self.open["arguments"] += delta
        return [event("response.function_call_arguments.delta", **self._where(), delta=delta)]

    def _close(self, status: str) -> list[dict]:
        item, events = self.open, []
        if item is None:
            return []
        where = self._where()
        self.open = None
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events += [event("response.output_text.done", **where, content_index=0,
                             text=part["text"], logprobs=[]),
                       event("response.content_part.done", **where, content_index=0,
                             part=dict(part))]
        else:
            events.append(event("response.function_call_arguments.done", **where,
                                arguments=item["arguments"]))
        return events + [event("response.output_item.done",
                               output_index=where["output_index"], item=copy.deepcopy(item))]

    def as_message(self) -> dict:
        """The output as the assistant's chat message, for the stored conversation."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        return {"role": "assistant", "content": text or None, **(
            {"tool_calls": calls} if calls else {})}


def whole_deltas(parsed: ParsedRequest, c: CompletionOutput) -> list[dict]:
    """A finished output as deltas: its content, then each tool call."""
    content, calls = parsed.tools.extract(c.text) if parsed.tools is not None else (c.text, [])
    return ([{"content": content}] if content else []) + [
        {"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]


def stream_deltas(parsed: ParsedRequest):
    """A function from each output delta to the answer's deltas: content as it comes,
    tool calls as chat streams them (a named call's arguments as generated, others
    whole at the end)."""
    if parsed.tools is not None:
        tools = ToolCallStream(parsed.tools)
        return lambda c: tools.feed(c.text, c.finish_reason is not None)
    return lambda c: [{"content": c.text}] if c.text else []


# --- the answer -----------------------------------------------------------------------------
class Answer:
    """One response being made: its items, status and usage, and its stored conversation."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest, tools: list[FunctionTool],
                 prompt_len: int, messages: list[dict]):
        self.rid, self.model, self.req, self.tools = rid, model, req, tools
        self.created = int(time.time())
        self.prompt_len, self.messages = prompt_len, messages
        self.items = OutputItems()
        self.status = "in_progress"
        self.output_tokens = 0

    def finish(self, finish_reason: str, output_tokens: int, deltas: list[dict]) -> list[dict]:
        """The last deltas of the output; returns their events, the items' closing ones."""
        self.status = "incomplete" if finish_reason == "length" else "completed"
        self.output_tokens = output_tokens
        events = [e for d in deltas for e in self.items.feed(d)]
        return events + self.items.finish(self.status)

    def body(self) -> dict:
        done = self.status != "in_progress"
        return response_body(self.rid, self.created, self.model, self.req, self.tools,
                             self.status, self.items.items if done else [],
                             usage_body(self.prompt_len, self.output_tokens) if done else None)

    def keep(self, store: ResponseStore | None, tenant: Tenancy | None) -> None:
        if store is not None:
            store.put(self.rid, tenant.name if tenant else None,
                      [*self.messages, self.items.as_message()])


class EventSink:
    """SSE events with OpenAI's ``event:`` lines and consecutive sequence numbers."""

    def __init__(self, resp: web.StreamResponse):
        self.resp = resp
        self.seq = 0

    async def send(self, events: list[dict]) -> None:
        for e in events:
            data = {"type": e["type"], "sequence_number": self.seq, **e}
            self.seq += 1
            await self.resp.write(f"event: {e['type']}\ndata: "
                                  f"{json.dumps(data, ensure_ascii=False)}\n\n".encode())


async def stream_answer(request: web.Request, answer: Answer, parsed: ParsedRequest, outputs,
                        store: ResponseStore | None, tenant: Tenancy | None,
                        headers: dict) -> web.StreamResponse:
    """The response as the API's events. The head goes out with the first output, so
    an engine that fails before it is an HTTP error, as on chat; one that fails after it
    ends the stream with ``error`` and ``response.failed``."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", **headers})
    deltas = stream_deltas(parsed)
    sink: EventSink | None = None
    output_tokens = 0
    async with contextlib.aclosing(fail_as_event(outputs)) as events:
        async for i, out in events:
            if sink is None:
                await resp.prepare(request)
                sink = EventSink(resp)
                await sink.send([event("response.created", response=answer.body()),
                                 event("response.in_progress", response=answer.body())])
            if i < 0:
                await sink.send(failed(answer, out))
                await resp.write_eof()
                return resp
            c = out.outputs[0]
            output_tokens += len(c.token_ids)
            if c.finish_reason is None:
                await sink.send([e for d in deltas(c) for e in answer.items.feed(d)])
            else:
                await sink.send(answer.finish(c.finish_reason, output_tokens, deltas(c)))
    if sink is None:  # no output at all (not expected): still a well-formed stream
        await resp.prepare(request)
        sink = EventSink(resp)
    last = "response.incomplete" if answer.status == "incomplete" else "response.completed"
    await sink.send([event(last, response=answer.body())])
    answer.keep(store, tenant)
    await resp.write_eof()
    return resp


def failed(answer: Answer, e: BaseException) -> list[dict]:
    answer.status = "failed"
    body = {**answer.body(), "output": answer.items.items,
            "error": {"code": "server_error", "message": str(e)}}
    return [event("error", code="server_error", message=str(e), param=None),
            event("response.failed", response=body)]
