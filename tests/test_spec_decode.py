"""Speculative decoding (spec_decode/): n-gram drafts verified exactly. Greedy and
seeded outputs equal the engine's without speculation (under memory pressure, both
preemption modes, prefix caching, chunked prefill, n > 1, logprobs, stop strings and
max_tokens), sampling follows the target model's distribution (chi-square against
transformers' probabilities), rejected slots are rolled back and every block is free
at the end."""

from __future__ import annotations

import argparse
import json
import os
import random

import pytest
import torch
from prometheus_client import generate_latest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.core.request import Request
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.metrics import EngineMetrics
from llmserve.entrypoints.cli import add_engine_args, engine_kwargs
from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.spec_decode.ngram_proposer import NgramProposer
from llmserve.spec_decode.speculator import Speculator
from tests.differential import (
    BLOCK,
    TINY_BLOCK_BYTES,
    Differential,
    Spec,
    random_workload,
    spec_pool,
    with_stop_strings,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
NUM_WORKLOADS = int(os.environ.get("LLMSERVE_SPEC_FUZZ_WORKLOADS", "2"))


# --- configuration ----------------------------------------------------------------------
def test_config_takes_vllms_shape_and_defaults():
    c = SpeculativeConfig.parse(json.dumps(NGRAM))
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min,
            c.disable_by_batch_size) == (4, 3, 1, None)
    # vLLM's defaults: both 5; one given sets the other.
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).prompt_lookup_min == 5
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value, named", [
    ({"model": "some/draft", "num_speculative_tokens": 4}, "only n-gram"),
    ({"method": "eagle", "num_speculative_tokens": 4}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "typo": 1}, "typo"),
    ("{not json", "JSON"),
])
def test_config_refuses_bad_values_by_name(value, named):
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.parse(value)


def test_engine_config_refuses_what_speculation_cannot_do_yet():
    with pytest.raises(ValueError) as e:
        EngineConfig(device="cpu", speculative_config=NGRAM, async_scheduling=True,
                     check_kv_integrity=False, kv_role="prefill")
    assert "--async-scheduling" in str(e.value) and "--kv-role" in str(e.value)
    assert EngineConfig(device="cpu").speculative is None


def test_cli_flag_reaches_the_engine_config():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-config", json.dumps(NGRAM)])
    config = EngineConfig(**dict(engine_kwargs(args), device="cpu"))
    assert config.speculative.num_speculative_tokens == 4


# --- the proposer -----------------------------------------------------------------------
def test_ngram_proposer_copies_what_followed_the_latest_occurrence():
    p = NgramProposer(3, prompt_lookup_max=3, prompt_lookup_min=1)
    # The last 3 tokens (1 2 3) occurred twice: the latest occurrence wins.
    assert p.propose([1, 2, 3, 7, 8, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]) == [4, 5, 6]
    # No 3- or 2-gram match: the 1-gram (9) does.
    assert p.propose([9, 5, 6, 0, 4, 9]) == [5, 6, 0]
    assert p.propose([1, 2, 3, 4]) == []  # nothing recurs
    assert p.propose([5, 1, 2, 1, 2]) == [1, 2]  # the draft stops at the end
    assert p.propose([1, 2, 1, 2], limit=1) == [1]
    assert p.propose([1, 2, 1, 2], limit=0) == []
    # The longest n first: 2-gram (3 4) -> 9, though the 1-gram (4) recurs later too.
    longest = NgramProposer(1, prompt_lookup_max=2, prompt_lookup_min=1)
    assert longest.propose([3, 4, 9, 8, 4, 7, 3, 4]) == [9]
    assert NgramProposer(2, 3, 2).propose([1, 2, 5, 2]) == []  # under prompt_lookup_min


def _decoding(tokens: list[int], max_tokens: int = 50):
    req = Request("r", None, tokens[:2], SamplingParams(max_tokens=max_tokens))
    seq = req.sequences[0]
    seq.token_ids = list(tokens)
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def test_speculator_drafts_decodes_within_limits():
    repeating = [5, 6, 7, 5, 6, 7, 5, 6]
    config = SpeculativeConfig(4, 2, 1, disable_by_batch_size=2)
    spec = Speculator(config, max_model_len=100)
    a, b, c = (_decoding(repeating) for _ in range(3))
    spec.propose([a, b])
    assert a.spec_token_ids == [7, 5, 6]
    spec.propose([a, b, c])  # above disable_by_batch_size: none
    assert a.spec_token_ids == b.spec_token_ids == c.spec_token_ids == []
    short = _decoding(repeating, max_tokens=8)  # 6 out: 2 more, so a 1-token draft
    spec.propose([short])
    assert short.spec_token_ids == [7]
    prefilling = _decoding(repeating)
    prefilling.num_computed_tokens = 3
    spec.propose([prefilling])
    assert prefilling.spec_token_ids == []


# --- the engine ---------------------------------------------------------------------------
def _llm(tiny_llama, spec: dict | None, **kw) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory=64 << 20,
               max_num_batched_tokens=64, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def pair(tiny_llama):
    return _llm(tiny_llama, None), _llm(tiny_llama, NGRAM)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Half repeat a short piece (drafts are proposed and accepted), half do not."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append([rng.randrange(3, 49152) for _ in range(rng.randint(2, 9))] * 4)
        else:
            out.append([rng.randrange(3, 49152) for _ in range(rng.randint(4, 40))])
    return out


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_greedy_outputs_are_unchanged_and_drafts_accepted(pair):
    base, spec = pair
    prompts = _prompts(12)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    before = spec.engine.spec.num_accepted_tokens
    assert _tokens(spec.generate(prompts, params)) == _tokens(base.generate(prompts, params))
    s = spec.engine.spec
    assert s.num_accepted_tokens - before > 40  # the speculation did something
    assert s.num_accepted_tokens < s.num_draft_tokens  # and some drafts were rejected
    spec.engine.block_manager.check_all_free()


def test_logprobs_n_seeds_stops_and_max_tokens_are_unchanged(pair):
    base, spec = pair
    prompts = _prompts(4, seed=1)
    ref = base.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    # A stop string taken from each reference text, and max_tokens ending mid-draft.
    stops = [[o.outputs[0].text[10:12]] if len(o.outputs[0].text) > 12 else [] for o in ref]
    cases = [SamplingParams(temperature=0, max_tokens=m, logprobs=3, stop=s, ignore_eos=True)
             for m, s in zip([7, 13, 30, 11], stops)]
    # (top_k: the sampler's cheap path; a seeded full-vocabulary draw costs ~50 ms here)
    cases += [SamplingParams(temperature=0.8, top_k=20, n=2, seed=i, max_tokens=16,
                             logprobs=2, presence_penalty=0.5, ignore_eos=True)
              for i in range(len(prompts))]
    prompts = prompts + prompts
    want, got = base.generate(prompts, cases), spec.generate(prompts, cases)
    assert _tokens(got) == _tokens(want)
    for g, w in zip(got, want):
        for gc, wc in zip(g.outputs, w.outputs):
            assert (gc.text, gc.finish_reason) == (wc.text, wc.finish_reason)
            for a, b in zip(gc.logprobs, wc.logprobs):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob,
                                                                                abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    spec.engine.block_manager.check_all_free()


def test_metrics_count_drafts_and_accepted_tokens(pair):
    _, spec = pair
    metrics = EngineMetrics("m")
    spec.generate(_prompts(2), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    metrics.observe_engine(spec.engine)
    text = generate_latest(metrics.registry).decode()
    s = spec.engine.spec
    for name, value in (("drafts", s.num_drafts), ("draft_tokens", s.num_draft_tokens),
                        ("accepted_tokens", s.num_accepted_tokens)):
        assert value > 0
        assert f'vllm:spec_decode_num_{name}_total{{model_name="m"}} {float(value)}' in text


def _engine(tiny_llama, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32",
                                  kv_cache_memory=256 * TINY_BLOCK_BYTES,
                                  preemption_mode="swap", swap_space=128 * TINY_BLOCK_BYTES,
                                  **overrides))


def test_random_workloads_under_memory_pressure_match_decoding_without_drafts(tiny_llama):
    """The fuzz harness (tests/differential.py): priorities, aborts, recompute and swap
    preemption, prefix caching, chunked prefill, n > 1, seeds, stop strings; every
    block free after each workload (``Differential.run``)."""
    plain = Differential(_engine(tiny_llama), ample_blocks=256)
    drafted = Differential(_engine(tiny_llama, speculative_config=NGRAM), ample_blocks=256)
    drafted.reference = plain.reference  # decoding without speculation, alone
    rng = random.Random(os.environ.get("LLMSERVE_FUZZ_SEED", "7"))
    vocab = plain.engine.hf_config.vocab_size
    pool = spec_pool(rng, vocab, size=8)
    pool += [Spec(tuple(_prompts(1, seed=i)[0]), rng.randint(8, 40), rng.choice([1, 2]),
                  rng.choice([None, None, i])) for i in range(8)]
    pool = with_stop_strings(plain, pool, rng)
    preemptions = swaps = 0
    for i in range(NUM_WORKLOADS):
        w = random_workload(rng, pool, BLOCK, max_blocks=256, max_cpu_blocks=128)
        swap = i % 2 == 1  # both preemption modes, whatever the draw
        w.config["preemption_mode"] = "swap" if swap else "recompute"
        w.num_cpu_blocks = 128 if swap else w.num_cpu_blocks
        w.num_blocks = min(w.num_blocks, 12)  # tight: preemption is certain
        drafted.run(w)
        preemptions += drafted.engine.scheduler.num_preemptions
        swaps += drafted.engine.scheduler.num_swapped_out
    spec = drafted.engine.spec
    assert drafted.num_compared > NUM_WORKLOADS
    assert preemptions > 0 and swaps > 0 and spec.num_accepted_tokens > 0


# --- sampling: the target's distribution ---------------------------------------------------
CHI2_15_AT_1E_3 = 37.70  # chi-square critical value, 15 degrees of freedom, p = 0.001
ALLOWED = [100, 200, 300, 400]


def _exact_joint(tiny_llama, prompt: list[int]) -> torch.Tensor:
    """P(first token, second token) over ALLOWED at temperature 1, by transformers."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)

    def probs(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1, ALLOWED]
        return torch.softmax(logits.double(), dim=-1)

    first = probs(prompt)
    return torch.stack([first[i] * probs(prompt + [t]) for i, t in enumerate(ALLOWED)])


def test_sampled_tokens_follow_the_target_distribution(tiny_llama, pair):
    """Every request's second token is drafted (the prompt repeats the allowed tokens,
    so any first token recurs in it) and verified by rejection sampling; the joint
    counts of (first, second) token over many seeds must fit the model's exact
    probabilities. An acceptance rule that is wrong (always accept: the second token
    is the draft) fails this by orders of magnitude."""
    _, spec = pair
    prompt = ALLOWED * 3
    num_draws = 1000
    before = spec.engine.spec.num_drafts
    outs = spec.generate([prompt] * num_draws, [
        # (top_k=4 changes nothing but takes the sampler's cheap path)
        SamplingParams(temperature=1.0, seed=i, max_tokens=3, allowed_token_ids=ALLOWED,
                       top_k=4, ignore_eos=True) for i in range(num_draws)])
    assert spec.engine.spec.num_drafts - before == num_draws  # every second token drafted
    counts = torch.zeros(4, 4, dtype=torch.float64)
    for o in outs:
        first, second = o.outputs[0].token_ids[:2]
        counts[ALLOWED.index(first), ALLOWED.index(second)] += 1
    expected = num_draws * _exact_joint(tiny_llama, prompt)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_15_AT_1E_3, (chi2, counts, expected)


def test_sliding_window_blocks_are_dropped_and_drafts_rolled_back(tmp_path, builtin_path):
    """Every layer windowed: blocks out of the window become DROPPED entries (a prefix
    of the table) while drafts are rolled back at its tail; recompute preemption and
    prefix hits included. Outputs equal decoding without speculation."""
    from tests.conftest import write_tiny_checkpoint
    from tests.differential import reconfigure
    path = write_tiny_checkpoint(tmp_path / "mistral", builtin_path, "mistral", seed=2,
                                 sliding_window=24)
    prompts = [p * 2 for p in _prompts(6, seed=3)]  # long enough to leave the window
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = []
    for spec in (None, NGRAM):
        llm = LLM(str(path), dtype="float32", kv_cache_memory=16 << 20,
                  max_num_batched_tokens=32, speculative_config=spec)
        assert llm.engine.block_manager.sliding_window == 24
        reconfigure(llm.engine, 14, 0, preemption_mode="recompute", watermark=0.0)
        outputs.append(_tokens(llm.generate(prompts, params)))
        assert llm.engine.scheduler.num_preemptions > 0
        llm.engine.block_manager.check_all_free()
    assert outputs[0] == outputs[1]
    assert llm.engine.spec.num_accepted_tokens > 0
