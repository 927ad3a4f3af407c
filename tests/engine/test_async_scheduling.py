"""Async scheduling (engine/overlap.py): step k launched before step k-1's tokens are
read back gives exactly the outputs of the synchronous engine, under memory pressure,
preemption (recompute and swap), prefix caching, aborts, and every sampling feature
that reads the tokens (penalties, min_tokens, stop strings, logprobs, grammars, beam
search, prompt logprobs)."""

from __future__ import annotations

import os
import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.core.beam_search import BeamSearchParams
from llmserve.core.sampling_params import StructuredOutputsParams
from llmserve.engine.llm_engine import LLMEngine
from tests.differential import (
    BLOCK,
    TINY_BLOCK_BYTES,
    Differential,
    random_workload,
    spec_pool,
    with_stop_strings,
)

NUM_WORKLOADS = int(os.environ.get("LLMSERVE_ASYNC_FUZZ_WORKLOADS", "24"))


def _engine(tiny_llama, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=256 * TINY_BLOCK_BYTES,
                                  preemption_mode="swap", swap_space=128 * TINY_BLOCK_BYTES,
                                  **overrides))


class _PendingRowsSeen:
    """Counts the input rows the runner took from the device (the overlap at work)."""

    def __init__(self, engine: LLMEngine):
        self.rows = 0
        flatten = engine.runner.flatten

        def counting(batch, pending_row_of=None):
            inputs, due = flatten(batch, pending_row_of)
            self.rows += len(inputs.pending_rows)
            return inputs, due

        engine.runner.flatten = counting


def test_random_workloads_match_the_synchronous_engine(tiny_llama):
    sync = Differential(_engine(tiny_llama), ample_blocks=256)
    overlapped = Differential(_engine(tiny_llama, async_scheduling=True), ample_blocks=256)
    overlapped.reference = sync.reference  # the synchronous engine's run alone
    seen = _PendingRowsSeen(overlapped.engine)
    rng = random.Random(os.environ.get("LLMSERVE_FUZZ_SEED", "5"))
    vocab = sync.engine.hf_config.vocab_size
    pool = with_stop_strings(sync, spec_pool(rng, vocab, size=40), rng)
    preemptions = swaps = 0
    for _ in range(NUM_WORKLOADS):
        overlapped.run(random_workload(rng, pool, BLOCK, max_blocks=256, max_cpu_blocks=128))
        preemptions += overlapped.engine.scheduler.num_preemptions
        swaps += overlapped.engine.scheduler.num_swapped_out
    assert overlapped.num_compared > NUM_WORKLOADS
    # It overlapped (most decode inputs came from the device) under real pressure.
    assert seen.rows > overlapped.num_compared and preemptions > 0 and swaps > 0


@pytest.fixture(scope="module")
def pair(tiny_llama):
    kw = dict(kv_cache_memory=64 << 20, max_num_batched_tokens=64)
    return LLM(str(tiny_llama), **kw), LLM(str(tiny_llama), async_scheduling=True, **kw)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def _same(a, b):
    assert [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs]
            for o in a] == [[(c.token_ids, c.text, c.finish_reason, c.logprobs)
                             for c in o.outputs] for o in b]


def test_token_reading_features_match(pair):
    """Every feature that reads a sequence's tokens while sampling sees the real ones
    (the placeholder is never visible): same tokens, text, logprobs and stops."""
    sync, overlapped = pair
    prompts = _prompts(8)
    params = [
        SamplingParams(temperature=0, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=14, n=3),
        SamplingParams(temperature=1.0, seed=5, max_tokens=16, repetition_penalty=1.3,
                       presence_penalty=0.8, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=[7, 8]),
        SamplingParams(temperature=0.7, seed=11, top_k=20, min_p=0.05, max_tokens=9,
                       logprobs=2, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.8, seed=2, max_tokens=20, bad_words=["the"],
                       logit_bias={100: 5.0}),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    ]
    a = sync.generate(prompts, params)
    b = overlapped.generate(prompts, params)
    _same(a, b)
    assert [o.prompt_logprobs for o in a] == [o.prompt_logprobs for o in b]
    # A stop string cut at the same place: take one from the greedy text.
    text = a[7].outputs[0].text
    stop = SamplingParams(temperature=0, max_tokens=20, stop=[text[5:8]])
    _same(sync.generate([prompts[7]], stop), overlapped.generate([prompts[7]], stop))
    overlapped.engine.block_manager.check_all_free()


def test_grammar_and_beam_search_match(pair):
    sync, overlapped = pair
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = SamplingParams(temperature=0.8, seed=1, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(json=schema))
    prompts = _prompts(3, seed=1)
    _same(sync.generate(prompts, grammar), overlapped.generate(prompts, grammar))
    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    got = overlapped.beam_search(prompts[:2], beams)
    want = sync.beam_search(prompts[:2], beams)
    assert [[s.tokens for s in o.sequences] for o in got] == \
        [[s.tokens for s in o.sequences] for o in want]
    overlapped.engine.block_manager.check_all_free()


def test_abort_with_a_token_in_flight_frees_everything(pair):
    _, overlapped = pair
    engine = overlapped.engine
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=30,
                                                 ignore_eos=True))
            for p in _prompts(4, seed=2)]
    for _ in range(5):
        engine.step()
    assert engine.core.batch_queue  # tokens of the last step are still on the device
    for req in reqs[:2]:
        engine.abort(req.request_id)
    while engine.has_unfinished():
        engine.step()
    assert all(len(r.sequences[0].output_token_ids) == 30 for r in reqs[2:])
    assert 0 not in [len(r.sequences[0].output_token_ids) for r in reqs[:2]]
    engine.block_manager.check_all_free()


def test_refused_where_it_cannot_work(tiny_llama):
    with pytest.raises(ValueError, match="tensor-parallel"):
        EngineConfig(model=str(tiny_llama), async_scheduling=True, tensor_parallel_size=2,
                     device="cpu")
    with pytest.raises(ValueError, match="check-kv-integrity"):
        EngineConfig(model=str(tiny_llama), async_scheduling=True, check_kv_integrity=True)


def test_with_staged_inputs_and_device_block_tables(tiny_llama, pair):
    """The GPU fast path's step builder takes the pending rows in its one staged copy
    (attached directly: the flags themselves are CUDA-only)."""
    from llmserve.worker.step_buffers import enable_fast_path
    sync, _ = pair
    staged = LLM(str(tiny_llama), kv_cache_memory=64 << 20, max_num_batched_tokens=64,
                 async_scheduling=True)
    enable_fast_path(staged.engine.runner, staged.engine.max_model_len, pinned_staging=True,
                     device_block_tables=True)
    seen = _PendingRowsSeen(staged.engine)
    prompts = _prompts(6, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.9, seed=8, max_tokens=15, n=2)] * 3
    _same(sync.generate(prompts, params), staged.generate(prompts, params))
    assert seen.rows > 0


TRITON_WORKLOADS = int(os.environ.get("LLMSERVE_TRITON_FUZZ_WORKLOADS", "2"))


def test_triton_fused_and_async_match_the_default_engine(tiny_llama):
    """The whole decode-step work together, through Triton's interpreter: the Triton
    attention (occupancy split rule, one-row decode tile), the fused kernels and async
    scheduling under the differential harness, against the default synchronous engine
    on the torch backend (float32: only near-ties may differ, which the harness
    allows). More workloads: LLMSERVE_TRITON_FUZZ_WORKLOADS."""
    sync = Differential(_engine(tiny_llama), ample_blocks=256)
    fast = Differential(_engine(tiny_llama, async_scheduling=True, attention_backend="triton",
                                fused_kernels=True), ample_blocks=256)
    fast.reference = sync.reference
    rng = random.Random(os.environ.get("LLMSERVE_FUZZ_SEED", "3"))
    pool = spec_pool(rng, sync.engine.hf_config.vocab_size, size=12, prefix_len=20)
    for _ in range(TRITON_WORKLOADS):
        fast.run(random_workload(rng, pool, BLOCK, max_blocks=256, max_cpu_blocks=128))
    assert fast.num_compared >= TRITON_WORKLOADS


def test_a_request_its_last_token_ends_takes_no_more_room(tiny_llama):
    """A sequence whose token in flight ends it for certain (max_tokens) is not
    scheduled again: no discarded row that would take a block and preempt another
    request the synchronous engine leaves alone."""
    from tests.differential import drain, reconfigure
    counts = {}
    for overlap in (False, True):
        engine = _engine(tiny_llama, async_scheduling=overlap)
        reconfigure(engine, 4, 0, preemption_mode="recompute", watermark=0.0)
        # A's prompt fills one block exactly: a row for its (discarded) next token would
        # need a second block per sample, which only preempting B could give.
        a = engine.add_request(list(range(100, 116)),
                               SamplingParams(temperature=0, n=2, max_tokens=1))
        b = engine.add_request(list(range(200, 230)), SamplingParams(temperature=0,
                                                                     max_tokens=20))
        drain(engine)
        engine.block_manager.check_all_free()
        counts[overlap] = (engine.scheduler.num_preemptions,
                           [s.output_token_ids for s in a.sequences + b.sequences])
    assert counts[True] == counts[False] and counts[True][0] == 0
