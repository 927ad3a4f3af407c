"""A sparse mixture-of-experts MLP block: a router picks ``top_k`` of ``num_experts``
expert MLPs per token, and the block's output is their weighted sum.

Each expert runs on the tokens routed to it only, as one batched call per expert:
the tokens are sorted by expert (a stable argsort of the flat routing table), each
expert's contiguous run is gathered, computed, weighted and scattered back with
``index_add_``. The work follows the active parameters (top_k experts a token), never
the total, and an expert no token chose is skipped. Experts are ordinary ``MLP``
modules, so they are fused, quantised (bf16/int8/int4) and sharded like the dense
layers: with tensor parallelism each rank holds every expert's rows
``[r * I/N, (r + 1) * I/N)`` (vLLM's layout without expert parallelism), the router
is replicated, and the block's summed output is reduced over the ranks once.

With the Triton backend (``use_triton_kernel``, on CUDA) the experts' dense weights
are stacked and every expert runs in one grouped GEMM launch instead
(``kernels/triton/fused_moe.py``): no per-expert launches, no host sync.

gpt-oss (``models/gpt_oss.py``) routes with a biased router and softmax after top-k
(``route``), and its experts have biases and ``clamped_swiglu``: they stay on the
per-expert path, since the grouped kernel computes neither.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.distributed import comm
from llmserve.model_executor.layers.fused_moe.routing import softmax_top_k


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                   limit: float) -> torch.Tensor:
    """gpt-oss's expert activation, as transformers computes it: the gate clamped
    above at ``limit``, the up projection to [-limit, limit], then
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SparseMoeBlock(nn.Module):
    """``gate``: the router (a Linear to one logit per expert, with a bias where
    ``router_bias``); ``experts``: a ModuleList of MLPs built by ``make_expert()``
    (whose outputs are not reduced), or, with ``make_expert=None``, filled by the family
    after loading (gpt-oss builds them from its checkpoint's fused tensors)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 make_expert, tp_size: int = 1, router_bias: bool = False):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {num_experts}]")
        self.gate = nn.Linear(hidden_size, num_experts, bias=router_bias)
        self.experts = nn.ModuleList(make_expert() for _ in range(num_experts)
                                     if make_expert is not None)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp_size = tp_size
        self.w13: torch.Tensor | None = None  # stacked [experts, 2I, H] (Triton path)
        self.w2: torch.Tensor | None = None  # stacked [experts, H, I]

    def fuse(self) -> None:
        for expert in self.experts:
            expert.fuse()

    def use_triton_kernel(self) -> bool:
        """Stack the (fused, dense) experts' weights for the grouped Triton kernel and
        drop the per-expert modules. False, changing nothing, where an expert is not a
        plain Linear (quantised or packed for a CPU)."""
        projections = [p for e in self.experts for p in (e.gate_up_proj, e.down_proj)]
        if any(type(p) is not nn.Linear or p.bias is not None for p in projections):
            return False
        with torch.no_grad():
            self.w13 = torch.stack([e.gate_up_proj.weight for e in self.experts])
            self.w2 = torch.stack([e.down_proj.weight for e in self.experts])
        self.experts = nn.ModuleList()
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k], expert ids [tokens, k]) of ``x``'s rows."""
        return softmax_top_k(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        if self.w13 is not None:
            from llmserve.kernels.triton.fused_moe import fused_moe
            out = fused_moe(x, self.w13, self.w2, weights, chosen)
            return comm.all_reduce(out) if self.tp_size > 1 else out
        out = torch.zeros_like(x)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        token_of = order // self.top_k  # row of x for each (token, choice), by expert
        weight_of = weights.flatten()[order].unsqueeze(-1)
        # One host sync a layer for the per-expert counts: the loop needs them.
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = token_of[start:start + count]
                y = expert(x[rows]) * weight_of[start:start + count]
                out.index_add_(0, rows, y)
                start += count
        return comm.all_reduce(out) if self.tp_size > 1 else out
