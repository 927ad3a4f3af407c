"""Triton mixture-of-experts: every expert's tokens in one grouped GEMM launch (issue 31).

The per-expert loop of ``SparseMoeBlock`` launches a handful of kernels per chosen
expert and syncs the host for the counts; on a GPU a layer's experts then cost tens of
launches. Here, as vLLM's fused_moe does (without its tuned configurations):

1. ``align_by_expert`` sorts the (token, choice) pairs by expert and pads each
   expert's run to a multiple of BLOCK_M, so that every block of BLOCK_M sorted rows
   belongs to one expert (``block_expert``; -1 for the blocks past the end). Sizes
   are bounded from the shapes alone, so nothing is read back to the host.
2. ``_grouped_gemm_kernel``: program (row block, column block) gathers its rows of
   the input and multiplies them by its expert's weight ``w[expert] [N, K]``, fp32
   accumulation, optionally scaling each row by its routing weight, and writes each
   row to its pair's row of the output.

A block runs gate/up over the tokens (one row per pair), SiLU x up, down over the pairs
(weighted), and sums each token's top-k rows. The experts' weights are stacked once
(``[experts, 2I, H]`` and ``[experts, H, I]``). PyTorch's reference is the per-expert
loop it replaces (tests/kernels/test_fused_moe.py, in the interpreter in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16  # rows of one expert per program (tl.dot wants >= 16)
BLOCK_N = 64
BLOCK_K = 32


def align_by_expert(chosen: torch.Tensor, num_experts: int,
                    block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """``chosen [tokens, k]`` expert ids -> (``pairs``: the flat pair index of each
    sorted row, -1 for padding; ``block_expert``: each row block's expert, -1 past the
    last). Every expert's run starts at a multiple of ``block_m``."""
    flat = chosen.flatten()
    num_pairs = flat.numel()
    # Not torch.bincount: on CUDA it reads the largest id back to size its output, a
    # host sync that a CUDA graph's capture forbids.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = flat.argsort(stable=True)
    expert_of = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - first_of_expert[expert_of]
    capacity = num_pairs + num_experts * (block_m - 1)  # the padded total can't exceed it
    capacity = (capacity + block_m - 1) // block_m * block_m
    pairs = torch.full((capacity,), -1, dtype=torch.int64, device=flat.device)
    pairs[starts[expert_of] + rank] = order
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return pairs, block_expert.to(torch.int64)


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, scale_ptr,
                         N, K, stride_am, stride_we, stride_wn, stride_om,
                         TOP_K: tl.constexpr, ROWS_ARE_PAIRS: tl.constexpr,
                         SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair] = a[row of pair] @ w[expert].T (x scale[pair]) for this block's pairs;
    the input row is the pair's token (gate/up) or the pair itself (down)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    valid = pair >= 0
    pair = tl.where(valid, pair, 0)
    row = pair if ROWS_ARE_PAIRS else pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + row[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w)
    if SCALE_ROWS:
        acc *= tl.load(scale_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pairs: torch.Tensor,
                  block_expert: torch.Tensor, top_k: int, rows_are_pairs: bool,
                  scale: torch.Tensor | None = None) -> None:
    n, k = w.shape[1], w.shape[2]
    assert a.stride(1) == 1 and w.is_contiguous() and out.stride(1) == 1
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](a, w, out, pairs, block_expert,
                               scale if scale is not None else out, n, k, a.stride(0),
                               w.stride(0), w.stride(1), out.stride(0), TOP_K=top_k,
                               ROWS_ARE_PAIRS=rows_are_pairs, SCALE_ROWS=scale is not None,
                               BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              chosen: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum for each token of ``x [tokens, hidden]``: ``w13
    [experts, 2I, hidden]`` (gate rows, then up), ``w2 [experts, hidden, I]``,
    ``weights``/``chosen [tokens, k]`` from the router."""
    tokens, hidden = x.shape
    top_k = chosen.shape[1]
    inter = w2.shape[2]
    pairs, block_expert = align_by_expert(chosen, w13.shape[0])
    gate_up = torch.empty((tokens * top_k, 2 * inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x.contiguous(), w13, gate_up, pairs, block_expert, top_k, False)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    out = torch.empty((tokens * top_k, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, out, pairs, block_expert, top_k, True,
                  weights.flatten().contiguous())
    return out.view(tokens, top_k, hidden).sum(dim=1)
