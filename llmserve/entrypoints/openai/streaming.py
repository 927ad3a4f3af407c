"""Server-sent events for stream=true: the chunks of every choice as the engine
produces them, with stop strings never half-sent and engine failures after the first
byte ending the stream with an error event and [DONE], never cut short."""

from __future__ import annotations

import contextlib
import json

from aiohttp import web

from llmserve.core.sched.overload import OverloadedError
from llmserve.engine.async_llm import EngineDeadError
from llmserve.engine.output import CompletionOutput, RequestOutput
from llmserve.entrypoints.openai.prompt_echo import prompt_logprobs_body
from llmserve.entrypoints.openai.protocol import APIError, ParsedRequest
from llmserve.entrypoints.openai.responses import choice_body, usage, with_prompt
from llmserve.entrypoints.openai.tool_calls import ToolCallStream


class StreamText:
    """Text deltas of one choice. With stop strings, the last characters that could
    still turn out to be the start of a stop string are held back until the next
    token or the end, so a stop string is never half-sent."""

    def __init__(self, stops: list[str], include_stop: bool):
        self.sent = 0
        self.hold = 0 if include_stop or not stops else max(map(len, stops)) - 1

    def delta(self, out: CompletionOutput) -> str:
        end = len(out.text) if out.finish_reason else max(self.sent, len(out.text) - self.hold)
        d = out.text[self.sent:end]
        self.sent = end
        return d


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


async def stream_response(request, rid, created, model, parsed: ParsedRequest, gen,
                          prompt_ids, chat: bool, tok) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    n, obj = parsed.params.n, "chat.completion.chunk" if chat else "text_completion"
    texts: dict[int, StreamText] = {}
    tool_streams: dict[int, ToolCallStream] = {}
    tokens_sent: dict[int, int] = {}
    done: set[int] = set()
    echoed: set[int] = set()
    next_offset: dict[int, int] = {}  # completions' logprobs: the next token's text_offset
    last: dict[int, RequestOutput] = {}
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
            last[i] = out
            for c in out.outputs:
                idx = i * n + c.index
                prev = tokens_sent.get(idx, 0)
                if idx in done or (c.finish_reason is None and len(c.token_ids) == prev):
                    continue  # nothing new for this choice in this output
                if parsed.tools is not None:
                    ts = tool_streams.setdefault(idx, ToolCallStream(parsed.tools))
                    tokens_sent[idx] = len(c.token_ids)
                    if c.finish_reason is not None:
                        done.add(idx)
                    for choice in tool_choice_deltas(tok, parsed, idx, c, prev, ts):
                        await resp.write(chunk(rid, obj, created, model, choice))
                    continue
                st = texts.setdefault(idx, StreamText(parsed.params.stop,
                                                      parsed.params.include_stop_str_in_output))
                delta = st.delta(c)
                tokens_sent[idx] = len(c.token_ids)
                if c.finish_reason is not None:
                    done.add(idx)
                elif not delta and parsed.logprobs_style is None:
                    continue  # held back (partial character or possible stop string)
                choice = choice_body(tok, parsed, chat, idx, c, (prev, len(c.token_ids)),
                                     delta=delta, text_start=next_offset.get(idx, 0))
                if idx not in echoed:  # the choice's first chunk carries the prompt parts
                    echoed.add(idx)
                    with_prompt(tok, parsed, chat, choice, out)
                lps = choice["logprobs"]
                if lps and lps.get("text_offset"):  # completions: the next chunk's start
                    next_offset[idx] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                    if chat and parsed.show_prompt_logprobs:
                        await resp.write(sse({"id": rid, "object": obj, "created": created,
                                              "model": model, "choices": [choice],
                                              "prompt_logprobs": prompt_logprobs_body(tok, out)}))
                        continue
                await resp.write(chunk(rid, obj, created, model, choice))
    if not started:
        await resp.prepare(request)
    if parsed.include_usage:
        outputs = [c for o in last.values() for c in o.outputs]
        await resp.write(sse({"id": rid, "object": obj, "created": created, "model": model,
                              "choices": [],
                              "usage": usage([len(p) for p in prompt_ids], outputs)}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def tool_choice_deltas(tok, parsed: ParsedRequest, idx: int, c: CompletionOutput,
                       prev: int, ts: ToolCallStream) -> list[dict]:
    """Stream choices for one update of a chat choice with tools in play: content or
    tool-call deltas, the finish reason on the last (tool_calls when calls were made)."""
    deltas = ts.update(c.text, c.finish_reason is not None) or [{}]
    base = choice_body(tok, parsed, True, idx, c, (prev, len(c.token_ids)), delta="")
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
