"""Prompt log-probabilities: how likely the model found each prompt token given the
tokens before it (vLLM's ``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``).
The raw model's log-softmax, as transformers computes it: no temperature, penalties
or token controls, which shape sampling, not the prompt."""

from __future__ import annotations

import torch

from llmserve.core.request import Logprob


@torch.inference_mode()
def score_tokens(logits: torch.Tensor, targets: list[int], num_top: int,
                 vocab_size: int) -> list[Logprob]:
    """Row i of ``logits`` scores ``targets[i]``: its logprob, its rank (1 = the
    likeliest token) and the ``num_top`` likeliest alternatives."""
    logprobs = torch.log_softmax(logits[:, :vocab_size].float(), dim=-1)
    index = torch.tensor(targets, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, index)[:, 0]
    ranks = ((logprobs > chosen[:, None]).sum(dim=1) + 1).tolist()
    top_ids, top_values = [[] for _ in targets], [[] for _ in targets]
    if num_top:
        top = logprobs.topk(num_top, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [Logprob(t, lp, list(zip(ids, values)), rank)
            for t, lp, ids, values, rank in zip(targets, chosen.tolist(), top_ids,
                                                top_values, ranks)]
