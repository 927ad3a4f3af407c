"""The bodies of answers: one choice (whole, or one streamed delta of it) in OpenAI's
completion or chat shape, usage, and the non-streamed response."""

from __future__ import annotations

import contextlib

from aiohttp import web

from llmserve.distributed.kv_transfer.params import RemoteDecode
from llmserve.engine.output import CompletionOutput, RequestOutput
from llmserve.entrypoints.openai.prompt_echo import (
    echo_choice,
    prompt_logprobs_body,
    text_offsets,
)
from llmserve.entrypoints.openai.protocol import ParsedRequest


async def full_response(rid: str, created: int, model: str, parsed: ParsedRequest, outputs,
                        prompt_ids: list[list[int]], chat: bool, tok) -> web.Response:
    """The whole answer once every prompt's request has finished."""
    n = parsed.params.n
    finals: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(outputs):
        async for i, out in outputs:
            if out.finished:
                finals[i] = out
    done = [c for i in range(len(prompt_ids)) for c in finals[i].outputs]
    choices = [with_prompt(tok, parsed, chat, choice_body(tok, parsed, chat, i * n + c.index,
                                                          c, None), finals[i])
               for i in range(len(prompt_ids)) for c in finals[i].outputs]
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices,
            "usage": usage([len(p) for p in prompt_ids], done)}
    if chat and parsed.show_prompt_logprobs:  # vLLM's place for it in chat answers
        body["prompt_logprobs"] = prompt_logprobs_body(tok, finals[0])
    if isinstance(parsed.kv_transfer, RemoteDecode):  # P/D leg 1: where the KV is held
        body["kv_transfer_params"] = finals[0].kv_transfer_params
    return web.json_response(body)


def with_prompt(tok, parsed: ParsedRequest, chat: bool, choice: dict,
                out: RequestOutput) -> dict:
    """A completion choice's prompt parts: the echo and vLLM's prompt_logprobs."""
    if parsed.echo:
        echo_choice(tok, parsed, choice, out)
    if parsed.show_prompt_logprobs and not chat:
        choice["prompt_logprobs"] = prompt_logprobs_body(tok, out)
    return choice


def usage(prompt_lens: list[int], outputs: list[CompletionOutput]) -> dict:
    return usage_counts(prompt_lens, sum(len(o.token_ids) for o in outputs))


def usage_counts(prompt_lens: list[int], completion_tokens: int) -> dict:
    p, c = sum(prompt_lens), completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def choice_body(tok, parsed: ParsedRequest, chat: bool, index: int, c: CompletionOutput,
                lp_range: tuple[int, int] | None, delta: str | None = None,
                text_start: int = 0) -> dict:
    """One choice: whole (``delta`` None) or one streamed update of it, with the
    logprobs of its tokens in ``lp_range`` (all of them when None); ``text_start``: the
    text offset of the first of them (a stream's earlier chunks')."""
    start, end = lp_range or (0, len(c.token_ids))
    body = {"index": index,
            "logprobs": logprobs_body(tok, parsed, c, start, end, text_start),
            "finish_reason": c.finish_reason}
    if c.finish_reason == "stop" and c.stop_reason is not None:
        body["stop_reason"] = c.stop_reason
    if not chat:
        body["text"] = c.text if delta is None else delta
    elif delta is not None:
        body["delta"] = {"content": delta} if delta or c.finish_reason is None else {}
    elif parsed.tools is not None:
        content, calls = parsed.tools.extract(c.text)
        body["message"] = {"role": "assistant", "content": content}
        if calls:
            body["message"]["tool_calls"] = calls
            if c.finish_reason == "stop":
                body["finish_reason"] = "tool_calls"
    else:
        body["message"] = {"role": "assistant", "content": c.text}
    return body


def logprobs_body(tok, parsed: ParsedRequest, c: CompletionOutput, start: int,
                  end: int, text_start: int = 0) -> dict | None:
    lps = (c.logprobs or [])[start:end]
    if parsed.logprobs_style == "chat":
        return {"content": [
            {"token": (t := tok.decode([lp.token_id])), "logprob": lp.logprob,
             "bytes": list(t.encode()),
             "top_logprobs": [{"token": (a := tok.decode([tid])), "logprob": v,
                               "bytes": list(a.encode())} for tid, v in lp.top]}
            for lp in lps]}
    if parsed.logprobs_style == "completion":
        tokens = [tok.decode([lp.token_id]) for lp in lps]
        return {"tokens": tokens,
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{tok.decode([t]): v for t, v in lp.top} for lp in lps],
                "text_offset": text_offsets(tokens, text_start)}
    return None
