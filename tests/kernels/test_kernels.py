"""Triton kernels against their PyTorch references. Without CUDA they run on CPU
in Triton's interpreter (fp32 and fp16; the interpreter's bf16 arithmetic is
wrong); with CUDA (and TRITON_INTERPRET unset) they run on the GPU, bf16 included."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import pytest  # noqa: E402

from tests.benchmark_script import benchmark_script  # noqa: E402
from tests.kernel_reference import unified_attention_ref, write_kv_cache_ref  # noqa: E402

triton_attention = pytest.importorskip("llmserve.kernels.triton.attention")
with benchmark_script("gpu/bench_kernels") as _bench:  # the rule before issue 27, compared there
    legacy_splits = _bench.legacy_splits

INTERPRETED = triton_attention.INTERPRETED
DEVICE = "cpu" if INTERPRETED else "cuda"
on_gpu_only = pytest.mark.skipif(INTERPRETED, reason="the interpreter computes bf16 wrongly")

# (query tokens, context) per sequence. Triton's interpreter runs the programs one by one
# on a CPU, at a cost that grows with the key blocks each visits: there the mixed batch is
# cut to what still spans many key blocks (a decode over 19 blocks of 16), several query
# tiles and a cached prefix that ends mid-block (67 keys); 33 query tokens, like the GPU's
# 129, leave a last tile of one row at every tile height (16, 8, 4, 2). On a GPU the full
# one runs.
MIXED = ([(1, 300), (5, 18), (33, 100)] if INTERPRETED
         else [(1, 1328), (5, 18), (129, 463)])
# Forced split counts (1, 4 at 16-token blocks, 8 at 32): lengths not multiples of the
# block, splitting unevenly, 37 (3 or 2 blocks) leaving the last splits empty and one
# sequence filling the last split too. That one is 2011 on a GPU (126 or 63 blocks) and
# 230 in the interpreter (15 blocks: 4, 4, 4, 3; or 8: one a split), an eighth the blocks.
DECODE = [(1, 523), (1, 37), (1, 230 if INTERPRETED else 2011)]
# On a GPU, fp32 tl.dot rounds its inputs to TF32 (an fp16-sized mantissa).
TOL = {torch.float32: 2e-4 if INTERPRETED else 2e-2, torch.float16: 2e-2,
       torch.bfloat16: 3e-2}


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
    return dict(q=q.to(DEVICE), k_cache=k_cache.to(DEVICE), v_cache=v_cache.to(DEVICE),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor([s for _, s in shapes], dtype=torch.int32,
                                      device=DEVICE),
                block_tables=tables.to(DEVICE), max_query_len=max(q for q, _ in shapes),
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


# (query heads, KV heads): GQA 1, 4, 6 and 3 (SmolLM2-135M's 9/3); the interpreter's
# GQA 1 has 2 KV heads, not 4 (its cost grows with them).
HEAD_CONFIGS = [(2, 2) if INTERPRETED else (4, 4), (8, 2), (6, 1), (9, 3)]
# Every head config in fp32 and fp16 on a GPU. In the interpreter a dtype changes only
# the loads and stores, so fp16 runs once, on a grouped config (the grid's cost there
# is minutes of CI).
HEADS_AND_DTYPES = ([(h, torch.float32) for h in HEAD_CONFIGS]
                    + [(h, torch.float16) for h in (HEAD_CONFIGS[1:2] if INTERPRETED
                                                    else HEAD_CONFIGS)])


@pytest.mark.parametrize("heads,dtype", HEADS_AND_DTYPES)
def test_mixed_batch_all_head_configs(heads, dtype):
    check(make_batch(MIXED, *heads, head_dim=64, block_size=16, dtype=dtype), dtype)


@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (64, 32), (128, 32)])
def test_mixed_batch_head_dims_and_block_sizes(head_dim, block_size):
    check(make_batch(MIXED, 8, 2, head_dim, block_size, torch.float32), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
def test_decode_only_single_pass_and_split_kv(heads, num_splits):
    batch = make_batch(DECODE, *heads, head_dim=64, block_size=16, dtype=torch.float16)
    check(batch, torch.float16, num_splits=num_splits)


def test_split_kv_with_head_dim_128_and_block_32():
    batch = make_batch(DECODE, 8, 2, 128, 32, torch.float32)
    check(batch, torch.float32, num_splits=8)


# --- the default path: num_splits=None, chosen by the kernel wrapper -----------------------
def test_issue_18_llama3_8b_decode_576_tokens_default_splits():
    """Issue #18: one decode of 576 tokens, 32 query / 8 KV heads, head_dim 128,
    block 16. The split choice was min(32, 32, 576 // 64) = 9 splits, not a power of
    two, and _split_decode asserted; now 8."""
    check(make_batch([(1, 576)], 32, 8, 128, 16, torch.float32), torch.float32)


def _on_cpu(case, shapes=None, heads=None):
    """``case`` in the interpreter with fewer programs (sequences x KV heads x splits) or
    key blocks, each run one by one there: ``heads`` (query, KV) of the same group size,
    or ``shapes`` crossing the same block boundaries. The split count and path stay
    those of ``case``, which a GPU runs as it is."""
    if not INTERPRETED:
        return case
    old_shapes, old_heads, old_kv, *rest = case
    return (shapes or old_shapes, *(heads or (old_heads, old_kv)), *rest)


# (shapes, query heads, KV heads, head_dim, block_size, dtype): few query heads per KV
# head, since the interpreter's cost grows with (sequences x KV heads x key blocks).
# The comment gives the path chosen today (split count, or single pass).
DEFAULT_DECODE = [
    ([(1, 2100)], 2, 1, 64, 16, torch.float32),  # 32 splits (the cap)
    ([(1, 1000)], 12, 4, 64, 32, torch.float32),  # 4: 1000 // 128 = 7 rounded down
    ([(1, 17)], 4, 2, 80, 16, torch.float32),  # short context: single pass
    ([(1, 1)], 2, 1, 128, 32, torch.float32),  # one key: single pass
    ([(1, 1), (1, 2100)], 4, 2, 80, 32, torch.float32),  # 16
    # CPU: 2 KV heads (8 run in issue 18's default split)
    _on_cpu(([(1, 576), (1, 17)], 16, 8, 64, 32, torch.float32), heads=(4, 2)),  # 4
    # CPU: 2 KV heads, without 300 and 1 (one block a split, then empty ones, as 17)
    _on_cpu(([(1, 1), (1, 17), (1, 576), (1, 2100), (1, 300)], 4, 4, 128, 16,
             torch.float16), shapes=[(1, 17), (1, 576), (1, 2100)], heads=(2, 2)),  # 32
    _on_cpu(([(1, 576), (1, 1), (1, 17), (1, 33), (1, 700)], 24, 8, 80, 16, torch.float32),
            heads=(6, 2)),  # 8
]
DEFAULT_MIXED = [
    # CPU: a shorter decode (308 keys, 4 in its last block as 2100) and cached prefix
    # (255, ending at a block's last slot as 543; 288 keys, whole blocks as 576)
    _on_cpu(([(1, 2100), (17, 17), (33, 576), (1, 1)], 4, 2, 80, 16, torch.float32),
            shapes=[(1, 308), (17, 17), (33, 288), (1, 1)]),
    _on_cpu(([(1, 576), (5, 2100), (17, 17)], 8, 8, 128, 32, torch.float16), heads=(2, 2)),
]


def _case_id(case):
    shapes, heads, kv_heads, head_dim, block_size, dtype = case
    ctx = ",".join(str(s) for _, s in shapes)
    return f"seqs{len(shapes)}-ctx{ctx}-h{heads}kv{kv_heads}-d{head_dim}-b{block_size}"


@pytest.mark.parametrize("case", DEFAULT_DECODE + DEFAULT_MIXED, ids=_case_id)
def test_default_path_decode_and_mixed(case):
    shapes, heads, kv_heads, head_dim, block_size, dtype = case
    check(make_batch(shapes, heads, kv_heads, head_dim, block_size, dtype), dtype)


@on_gpu_only
@pytest.mark.parametrize("case", DEFAULT_DECODE + DEFAULT_MIXED, ids=_case_id)
def test_default_path_bf16(case):
    shapes, heads, kv_heads, head_dim, block_size, _ = case
    dtype = torch.bfloat16
    check(make_batch(shapes, heads, kv_heads, head_dim, block_size, dtype), dtype)


def test_choose_splits_is_a_supported_power_of_two():
    """Whatever the batch, the split count is a power of two in [1, MAX_SPLITS] (the
    reduce kernel's tl.arange length) and leaves every split >= 4 blocks."""
    choose, max_splits = triton_attention._choose_splits, triton_attention.MAX_SPLITS
    lengths = [*range(1, 70000, 97), 511, 512, 576, 1000, 2100, 1 << 17]
    for block_size in (16, 32, 64, 128):
        for num_seqs in (1, 2, 3, 5, 7, 13, 31, 64, 127, 128, 300):
            for kv_heads in (1, 2, 4, 8, 16):
                for max_seq_len in lengths:
                    n = choose(num_seqs, kv_heads, max_seq_len, block_size)
                    assert 1 <= n <= max_splits and n & (n - 1) == 0, n
                    assert n == 1 or max_seq_len // block_size >= 4 * n
    assert choose(1, 8, 576, 16) == 8  # the issue #18 shape
    assert choose(128, 8, 4096, 16) == 1  # enough programs already


# --- issue 27: splits chosen by occupancy, and a decode tile without padding rows --------
def test_choose_splits_fills_the_sms_where_the_legacy_rule_stopped():
    """The occupancy rule on an H200 (132 SMs), 8 KV heads, 16-token blocks: batch 32 at
    2k was 256 programs (under two per SM) and the legacy rule did not split it."""
    choose, legacy = triton_attention.choose_splits, legacy_splits
    assert legacy(32, 8, 2048, 16) == 1
    assert choose(32, 8, 2048, 16, sms=132) == 4  # 1024 programs >= 4 x 132
    assert choose(16, 8, 2048, 16, sms=132) == 8
    assert choose(32, 8, 8192, 16, sms=132) == 4
    assert choose(128, 8, 2048, 16, sms=132) == 1  # 1024 programs already
    assert choose(1, 8, 2048, 16, sms=132) == 32  # the cap, 4 blocks a split
    assert choose(1, 8, 600, 16, sms=132) == 8  # 37 blocks: no more than 4-block splits
    assert choose(1, 8, 600, 32, sms=132) == 4
    assert choose(1, 8, 511, 16, sms=132) == 1  # short: launch-bound, never split
    # More SMs want more programs; fewer want fewer.
    assert choose(32, 8, 2048, 16, sms=264) == 8
    assert choose(32, 8, 2048, 16, sms=16) == 1


def test_choose_splits_occupancy_rule_and_warm_up_coverage():
    """For any GPU, batch and context: the smallest power of two that reaches
    PROGRAMS_PER_SM x SMs programs, unless the cap or the minimum split length stops it
    first; and always one of ``reachable_splits`` at any longer context limit."""
    ta = triton_attention
    for sms in (16, 78, 108, 132, 170):
        target = ta.PROGRAMS_PER_SM * sms
        for block_size in (16, 32, 128):
            for kv_heads in (1, 2, 8, 16):
                reach = {L: set(ta.reachable_splits(kv_heads, L, block_size, sms))
                         for L in (4096, 131072)}
                for num_seqs in (1, 2, 3, 5, 16, 31, 64, 128, 300):
                    programs = num_seqs * kv_heads
                    for length in (1, 100, 511, 512, 576, 1000, 2100, 4096, 131072):
                        n = ta.choose_splits(num_seqs, kv_heads, length, block_size, sms)
                        assert 1 <= n <= ta.MAX_SPLITS and n & (n - 1) == 0, n
                        assert n == 1 or length // block_size >= ta.MIN_SPLIT_BLOCKS * n
                        assert n == 1 or programs * n // 2 < target  # never more than needed
                        longer = 2 * n <= ta.MAX_SPLITS and length >= ta.MIN_SPLIT_CONTEXT \
                            and length // block_size >= ta.MIN_SPLIT_BLOCKS * 2 * n
                        assert programs * n >= target or not longer, (programs, n, length)
                        for limit, splits in reach.items():
                            assert length > limit or n in splits, (limit, n, splits)


# Decode batches of (sequences x KV heads) >= 128 at long context, lengths not multiples
# of the block: the legacy rule ran them in one pass per (sequence, KV head). In the
# interpreter a quarter of them are long (397 to 593 keys: 7 to 10 blocks, several a
# split) and the rest short (1 to 156 keys, 1 to 3 blocks: the second split empty or of
# one block), with the same longest (593) and split choice at half the blocks.
MANY_DECODES = ([(1, 600 - 7 * i) if i % 4 == 1 else (1, 1 + 5 * i) for i in range(32)]
                if INTERPRETED else
                [(1, 600 - 7 * i) if i % 4 else (1, 1 + 13 * i) for i in range(32)])


def test_many_decodes_at_long_context_now_split():
    """32 sequences x 4 KV heads; 64-token blocks keep it to 2 splits of >= 4 blocks
    (the interpreter's cost grows with the programs)."""
    batch = make_batch(MANY_DECODES, 4, 4, 64, 64, torch.float16)
    assert batch["max_seq_len"] == 593
    assert legacy_splits(32, 4, 593, 64) == 1
    assert triton_attention._choose_splits(32, 4, 593, 64) == 2
    check(batch, torch.float16)  # the default path: 2 splits


# The long decode (700 keys on a GPU) is there for the default to split it: 8 ways at
# 16-token blocks, 4 at 32. The interpreter's is 562 (36 blocks of 16: 5 a split and 1 in
# the last, as 700's 44 leave it 2); where nothing splits it adds only blocks, so the
# interpreter leaves it out of the one-pass decode and has 129 in the mixed batch.
GQA_LONG = 562 if INTERPRETED else 700
GQA_DECODE = [(1, 37), (1, GQA_LONG), (1, 129), (1, 1)]
GQA_ONE_PASS = [(1, 37), (1, 129), (1, 1)] if INTERPRETED else GQA_DECODE
GQA_MIXED = [(5, 40), (1, 129 if INTERPRETED else GQA_LONG), (1, 33), (17, 17), (1, 1)]


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_gqa_ratios_decode_and_mixed(group, head_dim, block_size):
    """Default path: decode-only (split, and the decode kernel in one pass) and mixed
    prefill + decode, at GQA 1/3/4/8 with 2 KV heads."""
    for shapes in (GQA_DECODE, GQA_MIXED):
        batch = make_batch(shapes, 2 * group, 2, head_dim, block_size, torch.float32,
                           seed=group)
        check(batch, torch.float32)
    if block_size == 16:
        check(make_batch(GQA_ONE_PASS, 2 * group, 2, head_dim, block_size, torch.float32),
              torch.float32, num_splits=1)


def _launches(fn) -> list[tuple[str, dict]]:
    """(kernel name, its compile-time constants) of every attention launch ``fn`` makes."""
    kernels = [triton_attention._unified_attention_kernel,
               triton_attention._split_decode_kernel, triton_attention._split_reduce_kernel]
    seen = []
    hooks = [(k, lambda *a, k=k, **kw: seen.append((k.fn.__name__, kw))) for k in kernels]
    for kernel, hook in hooks:
        kernel.add_pre_run_hook(hook)
    try:
        fn()
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)
    return seen


@pytest.mark.parametrize("heads,rows", [((8, 2), 4), ((6, 2), 4), ((2, 2), 1)])
def test_decode_tile_rows_are_the_group_only(heads, rows):
    """A decode-only batch runs the decode kernel with BLOCK_M = the padded group (the
    interpreter's and Triton >= 3.2's tl.dot take any M), where the mixed-batch tile had
    16 rows: at GQA 4, BLOCK_Q = 4 query slots of which a decode fills one. The padded
    tile of before, kept for the benchmark, gives the same output."""
    batch = make_batch([(1, 40), (1, 100)], *heads, 64, 16, torch.float32)
    out = torch.empty_like(batch["q"])
    for splits in (1, 4):
        launched = _launches(lambda s=splits: triton_attention.unified_attention(
            out=out, num_splits=s, **batch))
        decode = [kw for name, kw in launched if name == "_split_decode_kernel"]
        assert [kw["BLOCK_M"] for kw in decode] == [
            max(rows, triton_attention._min_dot_rows())]
        assert "_unified_attention_kernel" not in {name for name, _ in launched}
        fit = out.clone()
        padded = _launches(lambda s=splits: triton_attention.unified_attention(
            out=out, num_splits=s, decode_tile="padded", **batch))
        assert padded[0][1]["BLOCK_M"] == 16
        torch.testing.assert_close(out, fit, atol=1e-5, rtol=1e-5)
    check(batch, torch.float32)


def test_decode_rows_rule():
    rows = triton_attention._decode_rows
    floor = triton_attention._min_dot_rows()
    assert floor in (1, 16)
    for group_p in (1, 2, 4, 8, 16, 32):
        assert rows(group_p) == max(group_p, floor)
        assert rows(group_p, "padded") == max(16, group_p)


def test_unified_attention_rejects_unknown_rules():
    batch = make_batch([(1, 100)], 4, 2, 64, 16, torch.float32)
    out = torch.empty_like(batch["q"])
    with pytest.raises(TypeError, match="split_rule"):  # the split rule is the kernel's own
        triton_attention.unified_attention(out=out, **batch, split_rule="greedy")
    with pytest.raises(ValueError, match="decode_tile"):
        triton_attention.unified_attention(out=out, **batch, decode_tile="wide")


@pytest.mark.parametrize("num_splits", [None, 4])
def test_split_kv_skips_sequences_without_a_query(num_splits):
    """A sequence with no new token (padding) in a decode-only batch: its
    query_start_loc is the next sequence's row (or one past the end), which the split
    path must not write. Before the guard the trailing case wrote past ``out``."""
    batch = make_batch([(1, 600), (0, 16), (1, 300), (0, 0)], 4, 2, 64, 16, torch.float32)
    check(batch, torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("kw,match", [
    (dict(block_size=8), "block_size must be a power of two >= 16"),
    (dict(block_size=48), "block_size must be a power of two >= 16"),
    (dict(head_dim=8), "head_dim must be in"),
    (dict(head_dim=512), "head_dim must be in"),
    (dict(num_heads=6, num_kv_heads=4), "must be a positive multiple of num_kv_heads"),
    (dict(dtype=torch.float64), "dtype must be"),
])
def test_check_supported_rejects_with_a_clear_message(kw, match):
    args = dict(block_size=16, head_dim=128, num_heads=32, num_kv_heads=8) | kw
    with pytest.raises(ValueError, match=match):
        triton_attention.check_supported(**args)


@pytest.mark.parametrize("block_size,head_dim,heads", [
    (16, 128, (32, 8)), (32, 80, (6, 2)), (128, 256, (8, 1)), (16, 16, (9, 3))])
def test_check_supported_accepts(block_size, head_dim, heads):
    for dtype in (None, torch.float16, torch.float32):
        triton_attention.check_supported(block_size=block_size, head_dim=head_dim,
                                         num_heads=heads[0], num_kv_heads=heads[1],
                                         dtype=dtype)
    triton_attention.check_supported(block_size=block_size)  # the rest unchecked
    if INTERPRETED:
        with pytest.raises(ValueError, match="bfloat16"):
            triton_attention.check_supported(block_size=16, dtype=torch.bfloat16)


def test_unified_attention_rejects_unsupported_num_splits_and_block_size():
    batch = make_batch([(1, 100)], 4, 2, 64, 16, torch.float32)
    out = torch.empty_like(batch["q"])
    for bad in (3, 0, 64):
        with pytest.raises(ValueError, match="num_splits must be a power of two"):
            triton_attention.unified_attention(out=out, **batch, num_splits=bad)
    small = make_batch([(1, 100)], 4, 2, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="block_size"):
        triton_attention.unified_attention(out=torch.empty_like(small["q"]), **small)


def test_large_block_pool_no_int32_overflow():
    """Offsets past 2**31 elements: a wrong int32 product would read elsewhere."""
    head_dim, kv_heads, block_size = 64, 2, 16
    elems_per_block = block_size * kv_heads * head_dim
    num_blocks = 2 ** 31 // elems_per_block + 64  # the last blocks lie beyond 2**31 elements
    k_cache = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=torch.float16,
                          device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    g = torch.Generator().manual_seed(1)
    high = torch.arange(num_blocks - 40, num_blocks, device=DEVICE)
    k_cache[high] = torch.randn(40, block_size, kv_heads, head_dim, generator=g).half().to(DEVICE)
    v_cache[high] = torch.randn(40, block_size, kv_heads, head_dim, generator=g).half().to(DEVICE)
    shapes = [(3, 300), (1, 250)]
    tables = torch.zeros(2, 19, dtype=torch.int32, device=DEVICE)
    tables[0, :19] = high[:19].int()
    tables[1, :16] = high[20:36].int()
    q = torch.randn(4, 4, head_dim, generator=g).half().to(DEVICE)
    batch = dict(q=q, k_cache=k_cache, v_cache=v_cache,
                 query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32, device=DEVICE),
                 seq_lens=torch.tensor([s for _, s in shapes], dtype=torch.int32,
                                       device=DEVICE),
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
    k_cache = torch.zeros(8, 16, 2, 64, device=DEVICE)
    v_cache = torch.zeros(8, 16, 2, 64, device=DEVICE)
    key = torch.randn(6, 2, 64, generator=g).to(DEVICE)
    value = torch.randn(6, 2, 64, generator=g).to(DEVICE)
    slots = torch.tensor([5, -1, 17, 127, -1, 40], device=DEVICE)
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
        # float32: on a GPU the default bf16 could flip a greedy token between backends
        llm = LLM(str(tiny_llama), attention_backend=backend, kv_cache_memory=8 << 20,
                  max_num_batched_tokens=32, dtype="float32")
        assert llm.engine.runner.use_triton == (backend == "triton")
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


def test_reachable_splits_cover_every_default_choice():
    """The warm-up compiles these; a split count the engine can choose but the warm-up
    skipped would compile (or fail) at a user's first long request."""
    from llmserve.kernels.triton.attention import _choose_splits, reachable_splits
    for kv_heads in (1, 2, 3, 4, 8, 16, 64):
        for block_size in (16, 32, 128):
            for max_len in (256, 600, 2048, 8192, 131072):
                reach = set(reachable_splits(kv_heads, max_len, block_size))
                chosen = {_choose_splits(n, kv_heads, length, block_size)
                          for n in (1, 2, 3, 5, 16, 64, 256)
                          for length in range(1, max_len + 1, max(1, max_len // 97))}
                assert chosen <= reach, (kv_heads, block_size, max_len, chosen - reach)


def test_warm_up_launches_every_variant():
    from llmserve.kernels.triton.attention import reachable_splits, warm_up
    launches = warm_up(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                       dtype=torch.float32, device=torch.device(DEVICE), max_seq_len=1024,
                       max_num_seqs=2)
    splits = reachable_splits(2, 1024, 16)
    assert splits == [1, 2, 4, 8, 16]
    assert launches == 2 * (len(splits) + 1)  # batch sizes 1 and 2: decode splits + prefill


def test_engine_config_refuses_blocks_the_kernels_cannot_tile():
    from llmserve.config import EngineConfig
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16"):
        EngineConfig(model="none", device="cpu", attention_backend="triton", block_size=8)
    EngineConfig(model="none", device="cpu", attention_backend="torch", block_size=8)


def _unspecialised(kernel) -> set[str]:
    """The arguments a kernel was declared not to specialise on (``do_not_specialize``),
    whether Triton built it for the GPU or for its interpreter."""
    if INTERPRETED:
        return set(kernel.kwargs.get("do_not_specialize") or ())
    return {p.name for p in kernel.params if p.do_not_specialize}


def _specialisation(value: int) -> str:
    """The classes Triton compiles a separate variant for."""
    return "one" if value == 1 else "multiple of 16" if value % 16 == 0 else "other"


def test_no_kernel_specialises_on_what_changes_between_batches():
    """Every kernel the engine launches, over batches of 1, 3, 16 and 17 sequences with
    block tables 1 to 16 blocks wide, decode-only (one pass and split-KV) and mixed:
    an integer argument whose specialisation class differs between those launches
    would compile a new variant at a user's request, after the warm-up. Each must be
    declared ``do_not_specialize`` (issue 27: num_seqs and the tables' row stride)."""
    import inspect
    kernels = [triton_attention._write_kv_kernel, triton_attention._unified_attention_kernel,
               triton_attention._split_decode_kernel, triton_attention._split_reduce_kernel]
    seen: dict[tuple[str, str], set[str]] = {}

    def recorder(kernel):
        params = inspect.signature(kernel.fn).parameters

        def hook(*args, **kwargs):  # positional: runtime arguments; keywords: constexprs
            for name, value in zip(params, args):
                if isinstance(value, int) and not isinstance(value, bool):
                    seen.setdefault((kernel.fn.__name__, name), set()).add(
                        _specialisation(value))
        return hook

    hooks = [(k, recorder(k)) for k in kernels]
    for kernel, hook in hooks:
        kernel.add_pre_run_hook(hook)
    try:
        for num_seqs, context in ((1, 16), (3, 40), (16, 256), (17, 20)):
            # decode-only, then mixed: both with num_seqs sequences, the first setting
            # the tables' width (the others' keys cost interpreter time, nothing else)
            for shapes in ([(1, context)] + [(1, 1)] * (num_seqs - 1),
                           [(3, context)] + [(1, 1)] * (num_seqs - 1)):
                batch = make_batch(shapes, 2, 1, 16, 16, torch.float32, seed=num_seqs)
                # decode-only: the default (one pass at these contexts) and 2 splits
                assert triton_attention._choose_splits(num_seqs, 1, context, 16) == 1
                for splits in ((None, 2) if shapes[0][0] == 1 else (None,)):
                    out = torch.empty_like(batch["q"])
                    triton_attention.unified_attention(out=out, num_splits=splits, **batch)
                kv = torch.zeros(len(shapes), 1, 16, device=DEVICE)
                triton_attention.write_kv_cache(kv, kv, batch["k_cache"], batch["v_cache"],
                                                torch.arange(len(shapes), device=DEVICE))
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)
    assert {k for k, _ in seen} == {k.fn.__name__ for k in kernels}
    varying = {(k, name) for (k, name), classes in seen.items() if len(classes) > 1}
    assert {name for _, name in varying} == {"num_seqs", "stride_bt"}
    by_name = {k.fn.__name__: k for k in kernels}
    for kernel, name in sorted(varying):
        assert name in _unspecialised(by_name[kernel]), \
            f"{kernel} specialises on {name}, which changes between batches"
