"""The CPU paged-attention path against the plain reference, on random block tables,
mixed prefill + decode batches, GQA groups and fp32/bf16 caches."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.kernels.cpu_attention import make_cpu_plan, paged_attention_cpu
from llmserve.kernels.reference import unified_attention_ref


def random_batch(rng, seqs, heads, kv_heads, head_dim, block_size, dtype):
    """seqs: (query_len, seq_len) pairs. Blocks are scattered over a bigger pool."""
    num_blocks = sum(-(-s // block_size) for _, s in seqs) + 7
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables, starts = [], [0]
    for q_len, seq_len in seqs:
        n = -(-seq_len // block_size)
        tables.append([pool.pop() for _ in range(n)])
        starts.append(starts[-1] + q_len)
    torch.manual_seed(rng.randrange(1 << 30))
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    q = torch.randn(starts[-1], heads, head_dim).to(dtype)
    return q, k_cache, v_cache, tables, starts, [s for _, s in seqs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (9, 3), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batches_match_the_reference(dtype, heads, kv_heads, block_size):
    rng = random.Random(heads * 100 + kv_heads + block_size)
    seqs = [(1, 37), (12, 12), (1, 1), (5, 70), (1, 523), (30, 95), (1, 16)]
    q, k_cache, v_cache, tables, starts, lens = random_batch(
        rng, seqs, heads, kv_heads, 32, block_size, dtype)
    plan = make_cpu_plan(starts, lens, tables, block_size, k_cache.shape[0])
    got = paged_attention_cpu(q, torch.stack([k_cache, v_cache]), plan, scale=32 ** -0.5)
    width = max(map(len, tables))
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    want = unified_attention_ref(q.float(), k_cache.float(), v_cache.float(),
                                 torch.empty_like(q, dtype=torch.float32),
                                 query_start_loc=torch.tensor(starts),
                                 seq_lens=torch.tensor(lens), block_tables=table_tensor,
                                 max_query_len=30, max_seq_len=523, scale=32 ** -0.5)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_decode_only_and_prefill_only_batches():
    rng = random.Random(3)
    for seqs in ([(1, 5), (1, 300)], [(7, 7), (3, 40)]):
        q, k_cache, v_cache, tables, starts, lens = random_batch(rng, seqs, 4, 2, 16, 16,
                                                                 torch.float32)
        plan = make_cpu_plan(starts, lens, tables, 16, k_cache.shape[0])
        assert plan.decode_only == all(n == 1 for n, _ in seqs)
        got = paged_attention_cpu(q, torch.stack([k_cache, v_cache]), plan, scale=0.25)
        width = max(map(len, tables))
        want = unified_attention_ref(
            q, k_cache, v_cache, torch.empty_like(q), query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(lens),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            max_query_len=7, max_seq_len=300, scale=0.25)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
