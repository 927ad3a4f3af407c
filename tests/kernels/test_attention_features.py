"""Attention sinks (gpt-oss) and logit soft-capping (Gemma 2) in every attention path.

A sink is a learned logit per query head that joins the softmax's maximum and
denominator and owns no value row; soft-capping turns each scaled score s into
``cap * tanh(s / cap)`` before masking. Each path (the C kernel, its torch fallback,
the Triton kernels in the interpreter) is compared with the dense reference
(``kernel_reference.dense_reference``) over mixed batches of decodes and prefill
chunks, with and without a sliding window, under GQA; then the split-KV decode, whose
reduce must add a head's sink once, not once per split.
"""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels.cpu.attention import make_cpu_plan, paged_attention_cpu
from llmserve.kernels.cpu.native import cpu_library
from llmserve.kernels.triton.attention import unified_attention
from tests.kernel_reference import dense_reference, paged_batch

BLOCK = 16
CAP = 1.5  # below the scores' spread (about N(0, 1) here): the cap bites

# (query lengths, context lengths): decodes, then prefill chunks with and without a
# cached prefix mixed with decodes, at contexts shorter than and far past the window.
BATCHES = {
    "decodes": ([1, 1, 1], [5, 40, 300]),
    "mixed": ([1, 40, 1, 7], [90, 40, 3, 130]),
}
# Nine decodes: with kv_heads > 1 and few threads the C kernel takes whole sequences
# per thread (its other schedule).
MANY_DECODES = ([1] * 9, [20 + 37 * i for i in range(9)])


def sinks_for(heads: int, seed: int = 1) -> torch.Tensor:
    """Sinks across the scores' range, one far above it (that head's weights shrink
    to almost nothing: the maximum must include the sink)."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[-1] = 12.0
    return sinks


def starts_of(query_lens):
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


def run_path(path, q, cache, tables, query_lens, seq_lens, scale, window, sinks, softcap,
             num_splits=None):
    starts = starts_of(query_lens)
    if path == "triton":
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        out = torch.empty_like(q)
        return unified_attention(q, cache[0], cache[1], out,
                                 query_start_loc=torch.tensor(starts, dtype=torch.int32),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                 block_tables=table, max_query_len=max(query_lens),
                                 max_seq_len=max(seq_lens), scale=scale,
                                 num_splits=num_splits, window=window, sinks=sinks,
                                 softcap=softcap)
    plan = make_cpu_plan(starts, seq_lens, tables, BLOCK, cache.shape[1],
                         native=path == "native")
    return paged_attention_cpu(q, cache, plan, scale, window, sinks, softcap)


def skip_without_c(path):
    if path == "native" and cpu_library() is None:
        pytest.skip("the C kernels are not built here (no compiler)")


VARIANTS = {"sinks": (True, None), "softcap": (False, CAP), "both": (True, CAP)}


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("path", ["native", "torch", "triton"])
def test_each_path_equals_the_reference(path, batch, variant, window):
    skip_without_c(path)
    query_lens, seq_lens = BATCHES[batch]
    q, cache, tables, ks, vs = paged_batch(query_lens, seq_lens, heads=6, kv_heads=2)
    use_sinks, softcap = VARIANTS[variant]
    sinks = sinks_for(6) if use_sinks else None
    scale = 32 ** -0.5
    got = run_path(path, q, cache, tables, query_lens, seq_lens, scale, window, sinks,
                   softcap)
    want = dense_reference(q, ks, vs, query_lens, seq_lens, window, scale, sinks, softcap)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the variant changes the output: a path that ignored it would fail above
    plain = dense_reference(q, ks, vs, query_lens, seq_lens, window, scale)
    assert (want - plain).abs().max() > 1e-2


@pytest.mark.parametrize("head_dim,heads", [(64, 8), (128, 4), (32, 6)])
@pytest.mark.parametrize("batch", ["many_decodes", "mixed"])
def test_the_c_kernel_in_each_of_its_variants(head_dim, heads, batch):
    """head_dim 64 and 128 take the C kernel's tiled path (GQA 4 and 2), others its
    plain one; nine decodes its whole-sequence schedule."""
    skip_without_c("native")
    query_lens, seq_lens = MANY_DECODES if batch == "many_decodes" else BATCHES[batch]
    q, cache, tables, ks, vs = paged_batch(query_lens, seq_lens, heads=heads, kv_heads=2,
                                           head_dim=head_dim, seed=head_dim)
    sinks, scale = sinks_for(heads), head_dim ** -0.5
    for window in (None, 24):
        got = run_path("native", q, cache, tables, query_lens, seq_lens, scale, window,
                       sinks, CAP)
        want = dense_reference(q, ks, vs, query_lens, seq_lens, window, scale, sinks, CAP)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_c_kernel_in_bfloat16():
    """The engine's CPU dtype: q and the cache in bf16, the softmax in float32."""
    skip_without_c("native")
    query_lens, seq_lens = BATCHES["mixed"]
    q, cache, tables, ks, vs = paged_batch(query_lens, seq_lens, heads=8, kv_heads=2,
                                           head_dim=64)
    q, cache = q.bfloat16(), cache.bfloat16()
    ks, vs = [k.bfloat16().float() for k in ks], [v.bfloat16().float() for v in vs]
    sinks = sinks_for(8)
    got = run_path("native", q, cache, tables, query_lens, seq_lens, 0.125, None, sinks, CAP)
    want = dense_reference(q.float(), ks, vs, query_lens, seq_lens, None, 0.125, sinks, CAP)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("num_splits", [1, 4, 8])
def test_split_kv_decode_adds_each_sink_once(num_splits):
    """Long decodes split 4 or 8 ways: each split's partial softmax holds no sink, and
    the reduce adds it once. A sink added per split would count exp(sink) 4 or 8 times
    in the denominator, which the sinks here (near the scores' maximum) make visible."""
    query_lens, seq_lens = [1, 1, 1], [700, 260, 64]
    q, cache, tables, ks, vs = paged_batch(query_lens, seq_lens, heads=6, kv_heads=2, seed=3)
    sinks = sinks_for(6)
    sinks[-1] = 3.0
    scale = 32 ** -0.5
    for window, softcap in ((None, None), (200, CAP)):
        got = run_path("triton", q, cache, tables, query_lens, seq_lens, scale, window,
                       sinks, softcap, num_splits=num_splits)
        want = dense_reference(q, ks, vs, query_lens, seq_lens, window, scale, sinks, softcap)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # The sink's weight, exp(sink - m) / denominator, is large enough to matter: counted
    # num_splits times it would move the output by more than the tolerance above.
    twice = dense_reference(q, ks, vs, query_lens, seq_lens, None, scale,
                            sinks + torch.log(torch.tensor(2.0)), None)
    assert (twice - dense_reference(q, ks, vs, query_lens, seq_lens, None, scale, sinks)
            ).abs().max() > 1e-2


def test_the_custom_op_carries_sinks_and_softcap():
    """``llmserve::paged_attention`` (what a torch.compile'd layer calls) takes the
    sinks and the cap as arguments of its schema and hands them to the kernel."""
    from llmserve.model_executor.layers.attention import AttentionMetadata, forward_context
    query_lens, seq_lens = BATCHES["mixed"]
    q, cache, tables, ks, vs = paged_batch(query_lens, seq_lens, heads=6, kv_heads=2)
    slots, new_k, new_v = [], [], []
    for table, k, v, n, length in zip(tables, ks, vs, query_lens, seq_lens):
        positions = range(length - n, length)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]
        new_k.append(k[length - n:])
        new_v.append(v[length - n:])
    starts = starts_of(query_lens)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        plan=make_cpu_plan(starts, seq_lens, tables, BLOCK, cache.shape[1]))
    sinks, scale = sinks_for(6), 32 ** -0.5
    with forward_context(meta):
        got = torch.ops.llmserve.paged_attention(q, torch.cat(new_k), torch.cat(new_v), cache,
                                                 scale, 24, sinks, CAP)
    want = dense_reference(q, ks, vs, query_lens, seq_lens, 24, scale, sinks, CAP)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_rank_loads_the_sinks_of_its_own_heads():
    """Under tensor parallelism each rank attends with its slice of the query heads, so
    it must hold those heads' sinks: rank 1 of 2 holds heads 4..7 of 8."""
    from types import SimpleNamespace

    from llmserve.distributed.shapes import rank_shape
    from llmserve.model_executor.model_loader.shards import shard_of
    config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, vocab_size=64,
                             intermediate_size=32, hidden_size=64, model_type="gpt_oss")
    sinks = torch.arange(8.0)
    for rank in (0, 1):
        got = shard_of(sinks, rank_shape(config, rank, 2), 8, "model.layers.3.self_attn.sinks")
        assert got.tolist() == list(range(4 * rank, 4 * rank + 4))


def test_the_warm_up_compiles_the_variants_with_sinks_and_softcap():
    """Both are compile-time switches of the Triton kernels: a model with them (gpt-oss,
    Gemma 2) warmed up with them launches no variant the warm-up did not compile."""
    from llmserve.kernels.triton import attention as ta
    from tests.engine.test_warm_up import _variant
    kernels = [ta._unified_attention_kernel, ta._split_decode_kernel]
    seen: dict[str, set] = {"warm_up": set(), "serving": set()}
    phase = ["warm_up"]

    def recorder(kernel):
        unspecialised = (set(kernel.kwargs.get("do_not_specialize") or ()) if ta.INTERPRETED
                         else {p.name for p in kernel.params if p.do_not_specialize})
        return lambda *a, **kw: seen[phase[0]].add(_variant(kernel, a, kw, unspecialised))

    hooks = [(k, recorder(k)) for k in kernels]
    for kernel, hook in hooks:
        kernel.add_pre_run_hook(hook)
    try:
        ta.warm_up(num_heads=6, num_kv_heads=2, head_dim=32, block_size=BLOCK,
                   dtype=torch.float32, device=torch.device("cpu"), max_seq_len=256,
                   max_num_seqs=2, sinks=True, softcap=True)
        phase[0] = "serving"
        for query_lens, seq_lens in BATCHES.values():
            q, cache, tables, _, _ = paged_batch(query_lens, seq_lens, heads=6, kv_heads=2)
            run_path("triton", q, cache, tables, query_lens, seq_lens, 0.2, 24, sinks_for(6),
                     CAP)
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)
    assert seen["serving"] and seen["serving"] <= seen["warm_up"], seen
