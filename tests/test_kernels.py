"""Triton kernels against their PyTorch references, run on CPU by Triton's
interpreter (fp32 and fp16; the interpreter's bf16 arithmetic is wrong)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from llmserve.kernels.reference import unified_attention_ref, write_kv_cache_ref  # noqa: E402

triton_attention = pytest.importorskip("llmserve.kernels.triton_attention")

MIXED = [(1, 1328), (5, 18), (129, 463)]
DECODE = [(1, 523), (1, 37), (1, 2011)]
TOL = {torch.float32: 2e-4, torch.float16: 2e-2}


def make_batch(shapes, num_heads, num_kv_heads, head_dim, block_size, dtype,
               num_blocks=None, seed=0):
    """Random queries and caches; each sequence's blocks are a random,
    non-contiguous draw from the pool."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for _, s in shapes)
    total = sum(-(-s // block_size) for _, s in shapes)
    num_blocks = num_blocks or total + 7
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(shapes), max_blocks, dtype=torch.int32)
    used = 0
    for i, (_, s) in enumerate(shapes):
        n = -(-s // block_size)
        tables[i, :n] = perm[used:used + n]
        used += n
    qsl = [0]
    for q, _ in shapes:
        qsl.append(qsl[-1] + q)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=g).to(dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache,
                query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                seq_lens=torch.tensor([s for _, s in shapes], dtype=torch.int32),
                block_tables=tables, max_query_len=max(q for q, _ in shapes),
                max_seq_len=max(s for _, s in shapes), scale=head_dim ** -0.5)


def check(batch, dtype, ref_batch=None, **kw):
    ref_batch = ref_batch or batch
    ref = unified_attention_ref(out=torch.empty_like(ref_batch["q"], dtype=torch.float32),
                                **{**ref_batch, "q": ref_batch["q"].float(),
                                   "k_cache": ref_batch["k_cache"].float(),
                                   "v_cache": ref_batch["v_cache"].float()})
    out = torch.full_like(batch["q"], float("nan"))
    triton_attention.unified_attention(out=out, **batch, **kw)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1), (9, 3)])
def test_mixed_batch_all_head_configs(heads, dtype):
    check(make_batch(MIXED, *heads, head_dim=64, block_size=16, dtype=dtype), dtype)


@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (64, 32), (128, 32)])
def test_mixed_batch_head_dims_and_block_sizes(head_dim, block_size):
    check(make_batch(MIXED, 8, 2, head_dim, block_size, torch.float32), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1), (9, 3)])
def test_decode_only_single_pass_and_split_kv(heads, num_splits):
    batch = make_batch(DECODE, *heads, head_dim=64, block_size=16, dtype=torch.float16)
    check(batch, torch.float16, num_splits=num_splits)


def test_split_kv_with_head_dim_128_and_block_32():
    batch = make_batch(DECODE, 8, 2, 128, 32, torch.float32)
    check(batch, torch.float32, num_splits=8)


def test_large_block_pool_no_int32_overflow():
    """Offsets past 2**31 elements: a wrong int32 product would read elsewhere."""
    head_dim, kv_heads, block_size = 64, 2, 16
    elems_per_block = block_size * kv_heads * head_dim
    num_blocks = 2 ** 31 // elems_per_block + 64  # the last blocks lie beyond 2**31 elements
    k_cache = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=torch.float16)
    v_cache = torch.empty_like(k_cache)
    g = torch.Generator().manual_seed(1)
    high = torch.arange(num_blocks - 40, num_blocks)
    k_cache[high] = torch.randn(40, block_size, kv_heads, head_dim, generator=g).half()
    v_cache[high] = torch.randn(40, block_size, kv_heads, head_dim, generator=g).half()
    shapes = [(3, 300), (1, 250)]
    tables = torch.zeros(2, 19, dtype=torch.int32)
    tables[0, :19] = high[:19].int()
    tables[1, :16] = high[20:36].int()
    q = torch.randn(4, 4, head_dim, generator=g).half()
    batch = dict(q=q, k_cache=k_cache, v_cache=v_cache,
                 query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
                 seq_lens=torch.tensor([s for _, s in shapes], dtype=torch.int32),
                 block_tables=tables, max_query_len=3, max_seq_len=300, scale=0.125)
    # The reference reads a compact copy of the 40 blocks in use (same contents).
    compact = dict(batch, k_cache=k_cache[high].clone(), v_cache=v_cache[high].clone(),
                   block_tables=(tables - (num_blocks - 40)).clamp(min=0).int())
    check(batch, torch.float16, ref_batch=compact)


def test_fully_masked_padding_rows_stay_finite():
    """A group size that is not a power of two pads rows that see no keys."""
    check(make_batch([(7, 7), (1, 1)], 6, 2, 64, 16, torch.float32), torch.float32)


def test_write_kv_cache_skips_negative_slots():
    g = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(8, 16, 2, 64)
    v_cache = torch.zeros(8, 16, 2, 64)
    key = torch.randn(6, 2, 64, generator=g)
    value = torch.randn(6, 2, 64, generator=g)
    slots = torch.tensor([5, -1, 17, 127, -1, 40])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, ref_k, ref_v, slots)
    triton_attention.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    flat = k_cache.view(-1, 2, 64)
    assert torch.equal(flat[17], key[2]) and torch.equal(flat[127], key[3])
    assert flat.abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == [5, 17, 40, 127]


def test_reference_write_matches_manual_indexing():
    k_cache = torch.zeros(4, 4, 1, 2)
    v_cache = torch.zeros(4, 4, 1, 2)
    key = torch.arange(6.0).view(3, 1, 2)
    write_kv_cache_ref(key, -key, k_cache, v_cache, torch.tensor([1, -1, 14]))
    assert k_cache[0, 1, 0].tolist() == [0.0, 1.0]
    assert k_cache[3, 2, 0].tolist() == [4.0, 5.0]
    assert v_cache[3, 2, 0].tolist() == [-4.0, -5.0]


def test_engine_greedy_output_same_with_triton_and_reference(tiny_llama):
    from llmserve import LLM, SamplingParams
    prompts = [[7, 99, 1234, 5, 6], list(range(300, 341)), [42]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama), attention_backend=backend, kv_cache_memory=8 << 20,
                  max_num_batched_tokens=32)
        assert llm.engine.runner.use_triton == (backend == "triton")
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]
