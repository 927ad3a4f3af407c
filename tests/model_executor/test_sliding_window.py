"""Sliding-window attention (issue 31): a layer with a window of W keys attends, from the
query at position p, to the keys in (p - W, p].

Each attention path against a dense reference with the window mask, over mixed batches
whose contexts are shorter than, equal to and far past the window (the C kernel on
CPUs, its torch fallback, and the Triton kernels in the interpreter); then whole
models against transformers, prompts past the window: Mistral (every layer windowed)
and Qwen2 with ``max_window_layers`` (full and windowed layers mixed), with chunked
prefill, prefix caching and recompute preemption.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.kernels.cpu.attention import make_cpu_plan, paged_attention_cpu
from llmserve.kernels.cpu.native import cpu_library
from llmserve.kernels.triton.attention import unified_attention
from tests.conftest import write_tiny_checkpoint
from tests.differential import reconfigure
from tests.kernel_reference import dense_reference as reference
from tests.kernel_reference import paged_batch
from tests.oracle import assert_greedy_matches, compare_greedy, hf_greedy, load_hf, random_prompts

BLOCK = 16


# (query lengths, context lengths): decodes and prefill chunks, before, at and past the
# window, with and without a cached prefix.
BATCHES = {
    "decodes": ([1, 1, 1, 1], [5, 24, 25, 300]),
    "mixed": ([1, 40, 1, 7], [90, 40, 3, 130]),
    "chunk_after_prefix": ([33], [200]),
}


@pytest.mark.parametrize("window", [1, 5, 24, 64])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("path", ["native", "torch", "triton"])
def test_each_path_equals_the_windowed_reference(path, batch, window):
    if path == "native" and cpu_library() is None:
        pytest.skip("the C kernels are not built here (no compiler)")
    query_lens, seq_lens = BATCHES[batch]
    q, cache, tables, ks, vs = paged_batch(query_lens, seq_lens)
    scale = 32 ** -0.5
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    if path == "triton":
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        got = torch.empty_like(q)
        unified_attention(q, cache[0], cache[1], got,
                          query_start_loc=torch.tensor(starts, dtype=torch.int32),
                          seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                          block_tables=table, max_query_len=max(query_lens),
                          max_seq_len=max(seq_lens), scale=scale, window=window)
    else:
        plan = make_cpu_plan(starts, seq_lens, tables, BLOCK, cache.shape[1],
                             native=path == "native")
        got = paged_attention_cpu(q, cache, plan, scale, window)
        # the plan's full-context masks are unchanged by a windowed layer's use of it
        full = paged_attention_cpu(q, cache, plan, scale)
        torch.testing.assert_close(full, reference(q, ks, vs, query_lens, seq_lens, 10**6,
                                                   scale), rtol=1e-4, atol=1e-5)
    want = reference(q, ks, vs, query_lens, seq_lens, window, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# --- whole models against transformers ---------------------------------------------------
WINDOW = 24
MODELS = {
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    # layer 0 full, layer 1 windowed
    "qwen2_mixed": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=1)),
}
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory, builtin_path):
    root = tmp_path_factory.mktemp("windowed")
    return {name: write_tiny_checkpoint(root / name, builtin_path, kind, seed=2, **over)
            for name, (kind, over) in MODELS.items()}


def prompts_of(seed, lengths=(3, 23, 24, 25, 60, 150)):
    return random_prompts(seed, lengths)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("budget", [16, 2048])
def test_models_past_their_window_equal_transformers(windowed_models, model, path, budget):
    llm = LLM(str(windowed_models[model]), kv_cache_memory=16 << 20,
              max_num_batched_tokens=budget, enable_chunked_prefill=budget < 2048)
    llm.engine.runner.c_attention = path == "native"
    assert_greedy_matches(llm, windowed_models[model], prompts_of(1))
    llm.engine.block_manager.check_all_free()


@pytest.mark.parametrize("model", list(MODELS))
def test_triton_in_the_interpreter(windowed_models, model):
    llm = LLM(str(windowed_models[model]), attention_backend="triton",
              kv_cache_memory=16 << 20, max_num_batched_tokens=32)
    assert_greedy_matches(llm, windowed_models[model], prompts_of(2, lengths=(20, 40, 70)))


def test_prefix_hits_and_preemption_keep_the_window(windowed_models):
    path = windowed_models["mistral"]
    rng = random.Random(5)
    shared = [rng.randrange(3, 49152) for _ in range(48)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (5, 30, 50, 70)]
    llm = LLM(str(path), kv_cache_memory=16 << 20, max_num_batched_tokens=32)
    reconfigure(llm.engine, 12, 0, preemption_mode="recompute", watermark=0.0)
    assert_greedy_matches(llm, path, prompts)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits
    llm.engine.block_manager.check_all_free()


# --- memory: blocks outside the window are freed (every layer windowed) ------------------
def held_blocks(llm) -> list[int]:
    bm = llm.engine.block_manager
    return [bm.num_held(s.block_table) for s in llm.engine.scheduler.running]


def test_a_sequence_at_4x_its_window_holds_window_over_block_plus_2(windowed_models):
    """Must-show 3: prefill in chunks of a block and decode to 4x the window; after every
    step no sequence holds more than W/bs + 2 blocks, and the output still equals
    transformers'."""
    path = windowed_models["mistral"]
    llm = LLM(str(path), kv_cache_memory=16 << 20, max_num_batched_tokens=BLOCK,
              enable_chunked_prefill=True)
    assert llm.engine.block_manager.sliding_window == WINDOW
    prompt = prompts_of(7, lengths=(WINDOW * 4 - NEW_TOKENS,))[0]
    llm.engine.add_request(None, GREEDY, prompt_token_ids=prompt)
    peak = 0
    while llm.engine.has_unfinished():
        outs = llm.engine.step()
        peak = max([peak, *held_blocks(llm)])
    assert len(prompt) + NEW_TOKENS == 4 * WINDOW
    assert peak <= WINDOW / BLOCK + 2, peak
    hf = load_hf(path)
    assert compare_greedy(outs[0].outputs[0].token_ids, hf_greedy(hf, prompt, NEW_TOKENS)) \
        in ("match", "tie")
    llm.engine.block_manager.check_all_free()


def test_a_mixed_model_keeps_every_block(windowed_models):
    """A full-attention layer sees the whole context: nothing may be freed."""
    llm = LLM(str(windowed_models["qwen2_mixed"]), kv_cache_memory=16 << 20)
    assert llm.engine.block_manager.sliding_window is None


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sequences_longer_than_the_pool_run_in_a_window(windowed_models, mode):
    """Six blocks (96 slots) serve 150-token prompts, under preemption of either kind,
    with prefix hits and parallel samples sharing blocks: equal to transformers, and
    every block free at the end."""
    path = windowed_models["mistral"]
    llm = LLM(str(path), kv_cache_memory=16 << 20, max_num_batched_tokens=BLOCK,
              swap_space=16 << 20, preemption_mode="swap")
    reconfigure(llm.engine, 6, 8, preemption_mode=mode, watermark=0.0)
    rng = random.Random(9)
    shared = [rng.randrange(3, 49152) for _ in range(120)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (30, 31)]
    prompts.append(prompts_of(3, lengths=(150,))[0])
    assert_greedy_matches(llm, path, prompts)
    pair = llm.generate([prompts[0]], SamplingParams(n=2, temperature=0.0, max_tokens=4,
                                                     ignore_eos=True))
    assert pair[0].outputs[0].token_ids == pair[0].outputs[1].token_ids
    bm = llm.engine.block_manager
    assert bm.prefix_hits and llm.engine.scheduler.num_preemptions > 0
    bm.check_all_free()
