"""Log-probabilities of a given text under the engine's model (teacher forcing),
through the same paged KV path and chunked prefill as serving. Used to measure what
a faster mode (bf16, int8, int4) costs in quality: perplexity on a fixed text."""

from __future__ import annotations

import math

import torch

from llmserve.core.request import Request
from llmserve.core.sampling_params import SamplingParams
from llmserve.core.sched.output import ScheduledBatch
from llmserve.utils import cdiv


@torch.inference_mode()
def token_logprobs(engine, token_ids: list[int], chunk: int = 256) -> list[float]:
    """log p(token_ids[i] | token_ids[:i]) for i >= 1. The engine must be idle."""
    assert not engine.has_unfinished(), "score on an idle engine"
    if engine.config.tensor_parallel_size > 1:
        raise ValueError("scoring runs on one rank; use --tensor-parallel-size 1")
    seq = Request("score", None, list(token_ids), SamplingParams(max_tokens=1)).sequences[0]
    bm, runner = engine.block_manager, engine.runner
    need = cdiv(len(token_ids), bm.block_size)
    if not bm.can_allocate(need, use_watermark=False):
        raise ValueError(f"{len(token_ids)} tokens need {need} KV blocks; "
                         f"{bm.num_free_blocks} are free")
    bm.allocate(seq, len(token_ids))
    out: list[float] = []
    try:
        while seq.num_computed_tokens < len(token_ids) - 1:
            start = seq.num_computed_tokens
            n = min(chunk, len(token_ids) - 1 - start)
            batch = ScheduledBatch()
            batch.add(seq, n)
            ids, pos, meta, _, _ = runner.prepare(batch)
            hidden = runner.forward(ids, pos, meta)
            logprobs = torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1)
            targets = torch.tensor(token_ids[start + 1:start + n + 1])
            out += logprobs[torch.arange(n), targets].tolist()
            seq.num_computed_tokens += n
    finally:
        bm.free(seq)
    return out


def perplexity(engine, text: str) -> float:
    ids = engine.tokenizer.encode(text)
    lps = token_logprobs(engine, ids)
    return math.exp(-sum(lps) / len(lps))
