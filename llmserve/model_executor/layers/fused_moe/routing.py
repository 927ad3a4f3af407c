"""Which experts each token goes to, and with what weight.

``softmax_top_k`` is the router of Mixtral and the Qwen MoE models: a softmax over
every expert's logit (in float32), the top k, renormalised to sum to one where the
model says so (Mixtral always; Qwen3-MoE by ``norm_topk_prob``). ``top_k_softmax``
is gpt-oss's: the top k logits first, then a softmax over those k only (so the
weights always sum to one, and an unchosen expert's logit never matters). Both are
computed as transformers does, so the choice among near-equal experts is the same.
"""

from __future__ import annotations

import torch


def softmax_top_k(router_logits: torch.Tensor, top_k: int,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [tokens, experts]`` -> (weights [tokens, k] in the logits' dtype,
    expert ids [tokens, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def top_k_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor,
                                                                     torch.Tensor]:
    """gpt-oss's router: ``router_logits [tokens, experts]`` -> (softmax over the k
    largest logits [tokens, k] in the logits' dtype, their expert ids [tokens, k]).
    transformers takes the softmax in the logits' dtype; float32 here (equal in
    float32, and no coarser in bf16)."""
    logits, experts = torch.topk(router_logits, top_k, dim=-1)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return weights.to(router_logits.dtype), experts
