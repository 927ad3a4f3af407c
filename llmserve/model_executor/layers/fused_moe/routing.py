"""Which experts each token goes to, and with what weight.

``softmax_top_k`` is the router of Mixtral and the Qwen MoE models: a softmax over
every expert's logit (in float32), the top k, renormalised to sum to one where the
model says so (Mixtral always; Qwen3-MoE by ``norm_topk_prob``). Computed as
transformers does, so the choice among near-equal experts is the same.
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
