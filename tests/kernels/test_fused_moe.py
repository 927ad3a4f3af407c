"""The Triton grouped-GEMM mixture of experts (kernels/triton/fused_moe.py) against the
per-expert loop it replaces, in Triton's interpreter in float32 (issue 31)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmserve.kernels.triton.fused_moe import BLOCK_M, align_by_expert, fused_moe
from llmserve.model_executor.layers.fused_moe.layer import SparseMoeBlock
from llmserve.model_executor.layers.fused_moe.routing import softmax_top_k


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (37, 8, 2), (20, 4, 3)])
def test_alignment_puts_every_pair_once_in_its_experts_blocks(tokens, experts, top_k):
    gen = torch.Generator().manual_seed(tokens)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                          for _ in range(tokens)])
    pairs, block_expert = align_by_expert(chosen, experts)
    real = pairs[pairs >= 0]
    assert sorted(real.tolist()) == list(range(tokens * top_k))  # each pair exactly once
    for b, expert in enumerate(block_expert.tolist()):
        rows = pairs[b * BLOCK_M:(b + 1) * BLOCK_M]
        rows = rows[rows >= 0]
        if expert < 0:  # past the last expert's run: nothing to compute
            assert rows.numel() == 0
        else:
            assert (chosen.flatten()[rows] == expert).all()
    used = block_expert[block_expert >= 0]
    assert (used.diff() >= 0).all()  # experts in order, each run whole blocks


def test_alignment_needs_no_values_on_the_host():
    """On meta tensors (shapes, no values) the alignment runs only if no step reads a
    value back, as a CUDA graph's capture requires (torch.bincount would: it sizes its
    output by the largest id)."""
    chosen = torch.zeros(5, 2, dtype=torch.int64, device="meta")
    pairs, block_expert = align_by_expert(chosen, 8)
    capacity = (10 + 8 * (BLOCK_M - 1) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    assert pairs.shape == (capacity,) and pairs.device.type == "meta"
    assert block_expert.shape == (pairs.shape[0] // BLOCK_M,)


def per_expert_block(hidden, inter, experts, top_k, renormalize, seed):
    torch.manual_seed(seed)

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
            self.down_proj = nn.Linear(inter, hidden, bias=False)

        def forward(self, x):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(nn.functional.silu(gate) * up)

    return SparseMoeBlock(hidden, experts, top_k, renormalize, make_expert=Expert)


@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("hidden, inter, experts, top_k", [(64, 32, 8, 2), (48, 40, 6, 3)])
def test_the_grouped_kernel_equals_the_per_expert_loop(tokens, hidden, inter, experts, top_k):
    """Widths off the tile grid too (48, 40: masked K and N tails)."""
    block = per_expert_block(hidden, inter, experts, top_k, True, seed=tokens)
    x = torch.randn(tokens, hidden)
    with torch.no_grad():
        want = block(x)
        assert block.use_triton_kernel() and len(block.experts) == 0
        got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_token_on_the_same_two_experts_and_six_unchosen():
    block = per_expert_block(64, 32, 8, 2, False, seed=3)
    x = torch.rand(24, 64) + 0.1  # positive: the logits below order the experts 5, 2, rest
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[5] = 1.0
        block.gate.weight[2] = 0.5
        weights, chosen = softmax_top_k(block.gate(x), 2, False)
        want = block(x)
        block.use_triton_kernel()
        got = fused_moe(x, block.w13, block.w2, weights, chosen)
    assert (chosen == torch.tensor([5, 2])).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_quantised_experts_keep_the_loop():
    from llmserve.model_executor.layers.quantization import QuantizedLinear
    block = per_expert_block(64, 32, 4, 2, True, seed=4)
    block.experts[1].down_proj = QuantizedLinear(block.experts[1].down_proj, 8)
    assert not block.use_triton_kernel() and block.w13 is None and len(block.experts) == 4
