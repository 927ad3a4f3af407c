"""The prompt in an answer: OpenAI's ``echo`` (the prompt's text, and its tokens'
logprobs, before the completion's) and vLLM's ``prompt_logprobs`` (per prompt token,
keyed by token id). With ``max_tokens: 0`` the engine's one sampled token is hidden, so
only the prompt comes back, as evaluation harnesses ask."""

from __future__ import annotations

import contextlib

from llmserve.core.request import Logprob
from llmserve.engine.output import CompletionOutput, RequestOutput
from llmserve.entrypoints.openai.protocol import ParsedRequest


async def hide_generated(outputs):
    """``outputs`` with every choice's generated tokens removed (max_tokens 0): it
    ends as "length" having produced nothing, and usage counts no completion tokens."""
    async with contextlib.aclosing(outputs):
        async for i, out in outputs:
            out.outputs = [CompletionOutput(c.index, "", [], c.finish_reason and "length",
                                            None, [] if c.logprobs is not None else None)
                           for c in out.outputs]
            yield i, out


def prompt_text(tok, out: RequestOutput) -> str:
    """The prompt as sent, or decoded when it was sent as token ids."""
    return out.prompt if out.prompt is not None else tok.decode(out.prompt_token_ids)


def echo_choice(tok, parsed: ParsedRequest, choice: dict, out: RequestOutput) -> dict:
    """``choice`` (a completion's, whole or its first streamed chunk) with the prompt
    before its text and, when logprobs are asked for, the prompt tokens' before its."""
    choice["text"] = prompt_text(tok, out) + choice["text"]
    body = choice.get("logprobs")
    if body is not None:
        lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        num_top = parsed.params.logprobs or 0
        tokens = [tok.decode([t]) for t in out.prompt_token_ids]
        body["tokens"] = tokens + body["tokens"]
        body["token_logprobs"] = [lp and lp.logprob for lp in lps] + body["token_logprobs"]
        body["top_logprobs"] = [lp and _top_by_text(tok, lp, num_top)
                                for lp in lps] + body["top_logprobs"]
        body["text_offset"] = text_offsets(body["tokens"], 0)
    return choice


def text_offsets(tokens: list[str], start: int) -> list[int]:
    """OpenAI's ``text_offset``: where each token's text starts in the choice's text,
    the first at ``start`` (as vLLM counts: each token's decoded text after the one
    before)."""
    offsets = []
    for token in tokens:
        offsets.append(start)
        start += len(token)
    return offsets


def _top_by_text(tok, lp: Logprob, num_top: int) -> dict[str, float]:
    """OpenAI's top_logprobs entry: the alternatives, and the token itself."""
    top = {tok.decode([t]): v for t, v in lp.top[:num_top]}
    top.setdefault(tok.decode([lp.token_id]), lp.logprob)
    return top


def prompt_logprobs_body(tok, out: RequestOutput) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else token id ->
    {logprob, rank, decoded_token} for the token itself and its top alternatives."""
    if out.prompt_logprobs is None:
        return None
    return [None if lp is None else {
        str(t): {"logprob": v, "rank": r, "decoded_token": tok.decode([t])}
        for t, v, r in [(lp.token_id, lp.logprob, lp.rank),
                        *((t, v, k + 1) for k, (t, v) in enumerate(lp.top))]}
        for lp in out.prompt_logprobs]
