"""Server-sent events for stream=true: the chunks of every choice as the engine
produces them, and engine failures after the first byte ending the stream with an
error event and [DONE], never cut short.

The engine's outputs are deltas (``RequestOutputKind.DELTA``): each carries a choice's
new tokens and text, the text already held back where it could still be the start of
a stop string (output_processor.py), so a chunk is written as it comes."""

from __future__ import annotations

import contextlib
import json

from aiohttp import web

from llmserve.core.sched.overload import OverloadedError
from llmserve.engine.async_llm import EngineDeadError
from llmserve.engine.output import CompletionOutput, RequestOutput
from llmserve.entrypoints.openai.protocol import APIError, ParsedRequest
from llmserve.entrypoints.openai.responses import choice_body, usage_counts, with_prompt
from llmserve.entrypoints.openai.tool_calls import ToolCallStream


async def fail_as_event(gen):
    """``gen``'s items; an engine-side failure before the first item propagates (the
    client gets an HTTP error), one after it becomes a final ``(-1, error)`` item, so
    a stream that has started ends with an error event and [DONE], never cut short."""
    started = False
    async with contextlib.aclosing(gen):
        try:
            async for item in gen:
                started = True
                yield item
        except (OverloadedError, EngineDeadError) as e:
            if not started:
                raise
            yield -1, e


def sse_error(e: BaseException) -> bytes:
    type_ = "server_overloaded" if isinstance(e, OverloadedError) else "service_unavailable"
    return sse(APIError(503, str(e), type_).body())


def sse(data) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def chunk(rid: str, obj: str, created: int, model: str, choice: dict) -> bytes:
    return sse({"id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice]})


class ChoiceStream:
    """What one streamed choice has sent so far."""

    def __init__(self, parsed: ParsedRequest):
        self.num_tokens = 0
        self.text_offset = 0  # completions' logprobs: where the next token's text starts
        self.echoed = False  # the first chunk carries the prompt's parts
        self.tools = ToolCallStream(parsed.tools) if parsed.tools is not None else None


async def stream_response(request, rid, created, model, parsed: ParsedRequest, gen,
                          prompt_ids, chat: bool, tok) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    n, obj = parsed.params.n, "chat.completion.chunk" if chat else "text_completion"
    choices: dict[int, ChoiceStream] = {}
    started = False
    async with contextlib.aclosing(fail_as_event(gen)) as events:
        async for i, out in events:
            if i < 0:  # the engine failed mid-stream
                await resp.write(sse_error(out))
                break
            if not started:  # errors before the first output still become JSON errors
                await resp.prepare(request)
                started = True
                if chat:
                    for idx in range(len(prompt_ids) * n):
                        await resp.write(chunk(rid, obj, created, model, {
                            "index": idx, "logprobs": None, "finish_reason": None,
                            "delta": {"role": "assistant", "content": ""}}))
            for c in out.outputs:
                idx = i * n + c.index
                stream = choices.setdefault(idx, ChoiceStream(parsed))
                stream.num_tokens += len(c.token_ids)
                for choice in choice_chunks(tok, parsed, chat, idx, c, out, stream):
                    await resp.write(chunk(rid, obj, created, model, choice))
    if not started:
        await resp.prepare(request)
    if parsed.include_usage:
        completion = sum(s.num_tokens for s in choices.values())
        await resp.write(sse({"id": rid, "object": obj, "created": created, "model": model,
                              "choices": [],
                              "usage": usage_counts([len(p) for p in prompt_ids], completion)}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def choice_chunks(tok, parsed: ParsedRequest, chat: bool, idx: int, c: CompletionOutput,
                  out: RequestOutput, stream: ChoiceStream) -> list[dict]:
    """The choice bodies one delta of a choice makes (none while its text is held
    back)."""
    if stream.tools is not None:
        return tool_choice_deltas(tok, parsed, idx, c, stream.tools)
    if not c.text and c.finish_reason is None and parsed.logprobs_style is None:
        return []  # held back (a partial character or a possible stop string)
    choice = choice_body(tok, parsed, chat, idx, c, None, delta=c.text,
                         text_start=stream.text_offset)
    if not stream.echoed:  # the choice's first chunk carries the prompt parts
        stream.echoed = True
        with_prompt(tok, parsed, chat, choice, out)
    lps = choice["logprobs"]
    if lps and lps.get("text_offset"):  # completions: the next chunk's start
        stream.text_offset = lps["text_offset"][-1] + len(lps["tokens"][-1])
    return [choice]


def tool_choice_deltas(tok, parsed: ParsedRequest, idx: int, c: CompletionOutput,
                       ts: ToolCallStream) -> list[dict]:
    """Stream choices for one delta of a chat choice with tools in play: content or
    tool-call deltas, the finish reason on the last (tool_calls when calls were made)."""
    deltas = ts.feed(c.text, c.finish_reason is not None) or [{}]
    base = choice_body(tok, parsed, True, idx, c, None, delta="")
    choices = []
    for k, delta in enumerate(deltas):
        last = k == len(deltas) - 1
        finish = c.finish_reason if last else None
        if finish == "stop" and ts.calls:
            finish = "tool_calls"
        if not delta and finish is None and base["logprobs"] is None:
            continue
        choices.append({**base, "delta": delta, "finish_reason": finish,
                        "logprobs": base["logprobs"] if k == 0 else None})
    return choices
