"""Prefix caching, copy-on-write samples, swap/recompute preemption, priorities and
admission control, end to end through the engine with a real (tiny) model."""

from __future__ import annotations

import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine

GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCK_BYTES_TINY = 2 * 2 * 16 * 2 * 16 * 4  # K+V x layers x block x kv heads x head dim x fp32


def shared_prefix_prompts(n=12, prefix_len=120, seed=0):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 49152) for _ in range(prefix_len)] for _ in range(3)]
    return [prefixes[i % 3] + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 30))]
            for i in range(n)]


def run(path, prompts, params, **engine_args):
    llm = LLM(str(path), **engine_args)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.block_manager.check_all_free()
    return outs, llm.engine


def test_prefix_caching_gives_identical_greedy_outputs_and_hits(tiny_llama):
    prompts = shared_prefix_prompts()
    params = SamplingParams(max_tokens=12, **GREEDY)
    kv = dict(kv_cache_memory=256 * BLOCK_BYTES_TINY, max_num_batched_tokens=128)
    off, e_off = run(tiny_llama, prompts, params, enable_prefix_caching=False, **kv)
    # Warm: the first three requests (one per prefix) run first, the rest hit.
    llm = LLM(str(tiny_llama), enable_prefix_caching=True, **kv)
    on = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params)]
    on += [o.outputs[0].token_ids for o in llm.generate(prompts[3:], params)]
    assert on == off
    bm = llm.engine.block_manager
    assert e_off.block_manager.prefix_hits == 0
    # Nine warm requests each reuse the 7 full blocks (112 tokens) of their prefix.
    assert bm.prefix_hits >= 9 * 112
    assert bm.prefix_queries == sum(len(p) for p in prompts)
    bm.check_all_free()


def test_cache_salt_isolates_prefixes(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=64 << 20))
    prompt = shared_prefix_prompts(1)[0]

    def go(salt):
        req = engine.add_request(prompt, SamplingParams(max_tokens=2, **GREEDY))
        req.cache_salt = salt
        while engine.has_unfinished():
            engine.step()

    go(b"tenant-a")
    hits = engine.block_manager.prefix_hits
    go(b"tenant-b")
    assert engine.block_manager.prefix_hits == hits, "another tenant's salt must not hit"
    go(b"tenant-a")
    assert engine.block_manager.prefix_hits > hits


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tiny_kv_budget_keeps_outputs(tiny_llama, mode):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(20, 90))] for _ in range(10)]
    params = SamplingParams(max_tokens=40, **GREEDY)
    free, _ = run(tiny_llama, prompts, params, kv_cache_memory=64 << 20)
    tight, engine = run(tiny_llama, prompts, params, kv_cache_memory=40 * BLOCK_BYTES_TINY,
                        preemption_mode=mode, swap_space=200 * BLOCK_BYTES_TINY,
                        max_num_batched_tokens=64, watermark=0.0)
    assert engine.block_manager.num_blocks == 40
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine.scheduler.num_swapped_out > 0
    assert tight == free


def test_parallel_samples_share_blocks_and_never_write_shared(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=64 << 20))
    bm, runner = engine.block_manager, engine.runner
    original_flatten = runner.flatten  # where the runner reads each step's batch
    writes_checked = []

    def checked_flatten(batch, pending_row_of=None):
        bs = bm.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = bm.blocks[seq.block_table[pos // bs]]
                assert block.ref_count == 1, f"write into shared {block}"
                writes_checked.append(pos)
        return original_flatten(batch, pending_row_of)

    runner.flatten = checked_flatten
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks + a shared partial one
    req = engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20,
                                                    ignore_eos=True))
    while req.sequences[0].num_output_tokens == 0:
        engine.step()
    tables = [s.block_table for s in req.sequences]
    assert all(t == tables[0] for t in tables), "samples start on the same physical blocks"
    assert [bm.blocks[b].ref_count for b in tables[0]] == [4, 4, 4, 4]
    engine.step()
    assert all(s.block_table[:3] == tables[0][:3] for s in req.sequences)
    assert len({s.block_table[3] for s in req.sequences}) == 4, "tail block copied on write"
    while engine.has_unfinished():
        engine.step()
    assert writes_checked
    outs = [s.output_token_ids for s in req.sequences]
    assert len({tuple(o) for o in outs}) == 4
    single = LLM(str(tiny_llama), kv_cache_memory=64 << 20)
    for i, out in enumerate(outs):
        ref = single.generate([prompt], SamplingParams(temperature=1.0, seed=3 + i,
                                                       max_tokens=20, ignore_eos=True))
        assert ref[0].outputs[0].token_ids == out
    bm.check_all_free()


def finish_order(tiny_llama, policy):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=16 * BLOCK_BYTES_TINY,
                                    scheduling_policy=policy, watermark=0.0,
                                    max_num_batched_tokens=64))
    rng = random.Random(2)
    lows = [engine.add_request([rng.randrange(3, 49152) for _ in range(100)],
                               SamplingParams(max_tokens=120, **GREEDY), priority=5)
            for _ in range(2)]
    for _ in range(6):
        engine.step()
    urgent = engine.add_request([rng.randrange(3, 49152) for _ in range(100)],
                                SamplingParams(max_tokens=10, **GREEDY), priority=-1)
    order = []
    while engine.has_unfinished():
        order += [out.request_id for out in engine.step() if out.finished]
    assert all(len(r.sequences[0].output_token_ids) == 120 for r in lows)
    engine.block_manager.check_all_free()
    return order.index(urgent.request_id)


def test_priority_request_preempts_and_finishes_first(tiny_llama):
    assert finish_order(tiny_llama, "priority") == 0
    assert finish_order(tiny_llama, "fcfs") > 0  # without priorities it waits its turn


def test_admission_control_rejects_what_can_never_fit(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=10 * BLOCK_BYTES_TINY))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(list(range(3, 103)), SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request(list(range(3, 103)), SamplingParams(max_tokens=5000))
    assert not engine.has_unfinished()
    engine.add_request(list(range(3, 63)), SamplingParams(max_tokens=60))  # 8 blocks: waits
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.check_all_free()
