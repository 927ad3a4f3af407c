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
import re

import pytest
import torch
from prometheus_client import generate_latest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.config.speculative import SpeculativeConfig
from llmserve.core.request import Request
from llmserve.core.sampling_params import StructuredOutputsParams
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.metrics import EngineMetrics
from llmserve.entrypoints.cli import add_engine_args, engine_kwargs
from llmserve.spec_decode.draft_policy import PRIOR_ROW_COST, DraftPolicy
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
    ({"method": "draft_model", "num_speculative_tokens": 4}, "needs 'model'"),
    ({"model": "d", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"model": "d"}, "num_speculative_tokens"),
    ({"method": "ngram", "model": "d", "num_speculative_tokens": 4}, "model"),
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


def test_a_model_makes_it_a_draft_model_as_in_vllm():
    c = SpeculativeConfig.parse({"model": "hf://org/draft", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "hf://org/draft", 3)
    c = SpeculativeConfig.parse({"method": "draft_model", "model": "d",
                                 "num_speculative_tokens": 2, "disable_by_batch_size": 8})
    assert c.disable_by_batch_size == 8


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


def test_the_policy_prices_drafts_by_the_decodes_in_the_step():
    """Prefilling sequences make no decode rows: a draft beside 31 prompts is priced
    as in a one-decode step, not a 32-sequence one."""
    spec = Speculator(SpeculativeConfig(4, 2, 1), max_model_len=100)
    seen = []
    spec.policy.max_draft = lambda seq, batch_size, k: seen.append(batch_size) or k
    prompts = [_decoding([5, 6, 7] * 3) for _ in range(31)]
    for seq in prompts:
        seq.num_computed_tokens = 2
    spec.propose([_decoding([5, 6, 7] * 3), *prompts])
    assert seen == [1]
    spec.propose([_decoding([5, 6, 7] * 3) for _ in range(3)])
    assert seen[1:] == [3, 3, 3]


def test_the_policy_drafts_what_pays_for_its_rows():
    policy = DraftPolicy()
    seq = _decoding([5, 6, 7] * 3)
    assert policy.row_cost(1) == PRIOR_ROW_COST and policy.max_draft(seq, 1, 4) == 4
    # A CPU: a step costs 8 ms + 2 ms a sequence + 1.25 ms a draft token. One stream:
    # a draft token pays if accepted with p > 1.25 / 10.
    for seqs, drafted in ((1, 0), (1, 4), (1, 0), (1, 2), (32, 0), (33, 8), (40, 0), (36, 5)) * 3:
        policy.observe_step(seqs, drafted, 0.008 + 0.002 * seqs + 0.00125 * drafted)
    assert policy.row_cost(4) == PRIOR_ROW_COST  # a range of batch sizes not measured
    assert policy.row_cost(1) == pytest.approx(0.125, rel=1e-3)
    assert policy.max_draft(seq, 1, 4) == 4  # the prior: 0.8 ** 4 > 0.125
    for _ in range(4):
        policy.drafted(seq, 4, 0)  # every draft rejected at its first token
    assert policy.rate(seq) < 0.125 and policy.max_draft(seq, 1, 4) == 0
    # Not drafted, it drifts back to the prior and is tried again.
    steps = 0
    while policy.max_draft(seq, 1, 4) == 0:
        policy.not_drafted(seq)
        steps += 1
    assert 3 < steps < 60
    # 40 % accepted: 0.4 ** 2 > 0.125 > 0.4 ** 3 -> two tokens.
    some = _decoding([1, 2] * 5)
    some.draft_stats = (1.0, 2.5)
    assert policy.max_draft(some, 1, 8) == 2
    # 32 streams: a draft row costs 1.25 ms of a 72 ms step making 32 tokens, 0.56 of
    # a token: only sequences accepting most drafts draft, and briefly.
    assert policy.row_cost(32) == pytest.approx(0.04 / 0.072, rel=1e-3)
    assert policy.max_draft(some, 32, 4) == 0
    copying = _decoding([1, 2] * 5)
    copying.draft_stats = (9.5, 10.0)
    assert policy.max_draft(copying, 32, 4) == 4  # 0.95 ** 4 > 0.56
    copying.draft_stats = (8.5, 10.0)
    assert policy.max_draft(copying, 32, 4) == 3  # 0.85 ** 3 > 0.56 > 0.85 ** 4
    # A GPU: draft rows nearly free, every plausible draft pays.
    gpu = DraftPolicy()
    for seqs, drafted in ((8, 0), (8, 32), (9, 0), (12, 40)):
        gpu.observe_step(seqs, drafted, 0.008 + 0.0001 * seqs + 0.00001 * drafted)
    assert gpu.max_draft(some, 8, 4) == 4


# --- the engine ---------------------------------------------------------------------------
def _llm(tiny_llama, spec: dict | None, policy: bool = False, **kw) -> LLM:
    """An engine; ``policy`` False: every draft the proposer has is verified (as long
    as the step has room), so tests of verification and rollback see many drafts."""
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=64 << 20,
              max_num_batched_tokens=64, speculative_config=spec, **kw)
    if spec is not None and not policy:
        llm.engine.spec.policy = None
    return llm


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
    metrics.record(spec.engine.scheduler_stats())
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
    drafted.engine.spec.policy = None  # every draft verified: how many does not hang on timing
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
    """P(second token, third token) over ALLOWED at temperature 1, by transformers
    (summed over the first token)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)

    def probs(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1, ALLOWED]
        return torch.softmax(logits.double(), dim=-1)

    joint = torch.zeros(4, 4, dtype=torch.float64)
    for i, first in zip(ALLOWED, probs(prompt)):
        for j, second in zip(ALLOWED, probs(prompt + [i])):
            joint[ALLOWED.index(j)] += first * second * probs(prompt + [i, j])
    return joint


def _chi2_of_sampled_pairs(tiny_llama, spec: LLM, num_draws: int = 1000) -> float:
    """Chi-square of the (second, third) token counts over ``num_draws`` seeds against
    the model's exact joint probabilities. The first decode step after the prompt
    drafts a token and samples the second for sure; the third is output in that step
    only where the draft was accepted, else in the next: so the pair's joint depends
    on the acceptance rule being right."""
    prompt = ALLOWED * 3
    before = spec.engine.spec.num_drafts
    accepted = spec.engine.spec.num_accepted_tokens
    outs = spec.generate([prompt] * num_draws, [
        # (top_k=4 changes nothing but takes the sampler's cheap path)
        SamplingParams(temperature=1.0, seed=i, max_tokens=3, allowed_token_ids=ALLOWED,
                       top_k=4, ignore_eos=True) for i in range(num_draws)])
    assert spec.engine.spec.num_drafts - before >= num_draws  # every second token drafted
    # Many drafts accepted too: both branches of the rule are exercised.
    assert spec.engine.spec.num_accepted_tokens - accepted > num_draws // 10
    counts = torch.zeros(4, 4, dtype=torch.float64)
    for o in outs:
        second, third = o.outputs[0].token_ids[1:3]
        counts[ALLOWED.index(second), ALLOWED.index(third)] += 1
    expected = num_draws * _exact_joint(tiny_llama, prompt)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.fixture(scope="module")
def proposers(pair, disagreeing):
    """The engines whose sampled drafts the distribution tests verify: n-gram drafts
    (one-hot), and a draft model that often disagrees drawing coupled drafts."""
    return {"ngram": pair[1], "draft_model": disagreeing}


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_sampled_tokens_follow_the_target_distribution(tiny_llama, proposers, proposer):
    """Every request's first decode is drafted (n-gram: the prompt repeats the allowed
    tokens, so any first token recurs in it; a draft model always guesses) and
    verified; the joint counts of the (second, third) tokens over many seeds must fit
    the model's exact probabilities."""
    chi2 = _chi2_of_sampled_pairs(tiny_llama, proposers[proposer])
    assert chi2 < CHI2_15_AT_1E_3, chi2


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_the_distribution_test_fails_a_wrong_acceptance_rule(tiny_llama, proposers, proposer,
                                                             monkeypatch):
    """The test above can fail: accepting every draft (the third token is then sampled
    after the draft, whatever the second token was) is rejected at the same draws."""
    from llmserve.spec_decode import rejection_sampler
    monkeypatch.setattr(rejection_sampler, "accepted_length", lambda draft, target: len(draft))
    chi2 = _chi2_of_sampled_pairs(tiny_llama, proposers[proposer])
    # (seeded draws, so the same every run: ~200 for n-gram, ~72 for the draft model,
    # whose accepted draws are the near-target model's own)
    assert chi2 > 1.5 * CHI2_15_AT_1E_3, chi2


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
        if spec is not None:
            llm.engine.spec.policy = None  # every draft verified
        reconfigure(llm.engine, 14, 0, preemption_mode="recompute", watermark=0.0)
        outputs.append(_tokens(llm.generate(prompts, params)))
        assert llm.engine.scheduler.num_preemptions > 0
        llm.engine.block_manager.check_all_free()
    assert outputs[0] == outputs[1]
    assert llm.engine.spec.num_accepted_tokens > 0


# --- draft models ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_draft(tmp_path_factory, tiny_llama):
    """The target without its last layer: the residual stream of a small random model
    is mostly its embedding, so the draft often guesses the target's token, and often
    does not."""
    import shutil

    from transformers import AutoModelForCausalLM
    out = tmp_path_factory.mktemp("draft") / "first-layer"
    shutil.copytree(tiny_llama, out)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(out)
    return out


def _draft(model, k: int = 3) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def self_drafted(tiny_llama):
    """The target as its own draft: in float32 its greedy guesses are the target's."""
    return _llm(tiny_llama, _draft(tiny_llama))


def test_a_draft_model_that_agrees_has_every_greedy_draft_accepted(pair, self_drafted):
    base, _ = pair
    prompts = _prompts(6, seed=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    s = self_drafted.engine.spec
    drafted, accepted = s.num_draft_tokens, s.num_accepted_tokens
    assert _tokens(self_drafted.generate(prompts, params)) == _tokens(base.generate(prompts,
                                                                                  params))
    # Every decode after the first is drafted (a draft model always has a guess), and
    # the same model in float32 makes the same guess: all accepted.
    drafted, accepted = s.num_draft_tokens - drafted, s.num_accepted_tokens - accepted
    assert drafted > 6 * 20 and accepted == drafted
    self_drafted.engine.block_manager.check_all_free()


@pytest.fixture(scope="module")
def disagreeing(tiny_llama, small_draft):
    return _llm(tiny_llama, _draft(small_draft, k=4))


def test_a_draft_model_that_agrees_has_every_sampled_draft_accepted(pair, self_drafted):
    """Sampled drafts are drawn with the target's own race keys (a random seed for an
    unseeded request), so a draft model that computes the target's probabilities
    draws the target's very tokens: every draft is accepted, and seeded outputs are
    those without speculation."""
    base, _ = pair
    prompts = _prompts(6, seed=7)
    s = self_drafted.engine.spec
    for seed in (11, None):
        params = [SamplingParams(temperature=1.0, seed=None if seed is None else seed + i,
                                 max_tokens=30, ignore_eos=True, **filters)
                  for i, filters in enumerate([{}, {"top_k": 20}, {"top_p": 0.9},
                                               {"min_p": 0.05}] * 2)][:len(prompts)]
        drafted, accepted = s.num_draft_tokens, s.num_accepted_tokens
        got = self_drafted.generate(prompts, params)
        if seed is not None:
            assert _tokens(got) == _tokens(base.generate(prompts, params))
        drafted, accepted = s.num_draft_tokens - drafted, s.num_accepted_tokens - accepted
        assert drafted > 6 * 20 and accepted == drafted
    self_drafted.engine.block_manager.check_all_free()


def test_a_draft_model_that_disagrees_changes_no_output(pair, disagreeing):
    base, _ = pair
    spec = disagreeing
    prompts = _prompts(8, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=25, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=20, n=2, seed=3, max_tokens=25,
                             ignore_eos=True)] * 4
    want, got = base.generate(prompts, params), spec.generate(prompts, params)
    assert _tokens(got) == _tokens(want)
    for g, w in zip(got[::2], want[::2]):
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    s = spec.engine.spec
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # some taken, many rolled back
    spec.engine.block_manager.check_all_free()


# --- structured outputs ------------------------------------------------------------------
# Pairs of a letter and a digit: what the grammar allows alternates token by token, so
# a draft verified under the first position's mask only would let the model leave it.
PAIRS = StructuredOutputsParams(regex=r"(([abc][123])+ ){6}")
PAIR_PROMPTS = ["a1b2c3a1b2c3a1b2c3 b3c1a2 b3c1a2", "x: c3c3a1 c3c3a1 c3c3a1",
                "b2 b2 b2 a1 a1"]


def test_ngram_drafts_are_cut_where_the_grammar_refuses(pair):
    """The proposer's draft is cut before the first token the grammar does not allow:
    such a token (and all after it) would only be rejected."""
    engine = pair[1].engine
    tokens = engine.tokenizer.encode("a1b2c3a1b2c3a1", add_special_tokens=False)
    assert len(tokens) == 14  # one token a character, as the regexes below assume
    speculator = Speculator(SpeculativeConfig(4, 2, 1), max_model_len=100)
    drafts = []
    # 6 pairs are out (the first is the prompt): a 7th, then a letter or digits.
    for regex in (r"([abc][123])+", r"([abc][123]){7}[0-9]+"):
        seq = _decoding(tokens)
        seq.matcher = engine.structured_outputs().matcher(StructuredOutputsParams(regex=regex))
        assert seq.matcher.consume_tokens(seq.token_ids[2:])
        speculator.propose([seq])
        drafts.append(seq.spec_token_ids)
    # "a1" recurs: "b2c3" followed it; the second grammar takes "b2" and then digits only
    assert drafts == [tokens[2:6], tokens[2:4]]


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_constrained_outputs_are_unchanged_and_drafted(pair, self_drafted, proposer):
    """Grammar-constrained requests are drafted too: each verified position is
    sampled under the grammar's mask after the draft tokens before it, so greedy and
    seeded outputs are exactly those without speculation, and a draft model's tokens
    that the grammar refuses are rejected."""
    base, spec = pair[0], pair[1] if proposer == "ngram" else self_drafted
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=PAIRS),
              SamplingParams(temperature=0.8, seed=1, max_tokens=60, logprobs=2,
                             structured_outputs=PAIRS)]
    s = spec.engine.spec
    for p in params:
        drafted, accepted = s.num_draft_tokens, s.num_accepted_tokens
        want, got = base.generate(PAIR_PROMPTS, p), spec.generate(PAIR_PROMPTS, p)
        assert _tokens(got) == _tokens(want)
        for g, w in zip(got, want):
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
            assert re.fullmatch(r"(([abc][123])+ ?)+", g.outputs[0].text)  # pairs only
        assert s.num_accepted_tokens - accepted > 5  # drafts were verified and taken
        assert s.num_draft_tokens > drafted
    spec.engine.block_manager.check_all_free()


def test_the_policy_drafts_less_where_drafts_fail_and_changes_no_output(pair, tiny_llama,
                                                                       small_draft):
    base, _ = pair
    prompts = _prompts(8, seed=6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _tokens(base.generate(prompts, params))
    rates, drafted = [], []
    for policy in (False, True):
        spec = _llm(tiny_llama, _draft(small_draft, k=4), policy=policy)
        if policy:  # the costs of a CPU, not this machine's timing of the tiny models
            p = spec.engine.spec.policy
            p.row_cost, p.observe_step = (lambda batch_size: 0.2), (lambda *a: None)
        assert _tokens(spec.generate(prompts, params)) == want
        s = spec.engine.spec
        rates.append(s.acceptance_rate)
        drafted.append(s.num_draft_tokens)
        spec.engine.block_manager.check_all_free()
    assert drafted[1] < 0.8 * drafted[0] and rates[1] > rates[0]


def test_a_draft_model_shares_the_kv_budget(tiny_llama, small_draft):
    """The draft's cache has the target's blocks, so one budget holds both: fewer blocks
    than the target alone would get, each costing both models' bytes."""
    alone = _llm(tiny_llama, None).engine.runner
    spec = _llm(tiny_llama, _draft(small_draft)).engine
    draft = spec.draft
    assert draft.runner.num_blocks == spec.runner.num_blocks < alone.num_blocks
    both = spec.runner.kv_bytes_per_block() + draft.runner.kv_bytes_per_block()
    assert spec.runner.num_blocks == (64 << 20) // both
    # On a GPU the budget also leaves room for the draft's weights, which load after
    # it: counted before they load, they are what the loaded draft holds.
    model = draft.runner.model
    loaded = sum(t.numel() * t.element_size()
                 for t in (*model.parameters(), *model.buffers()))
    assert spec.runner.reserved_bytes == draft.weight_bytes() == loaded > 0
    assert alone.reserved_bytes == 0


def test_draft_models_that_cannot_propose_are_refused_by_name(tmp_path, tiny_llama,
                                                              builtin_path):
    from tests.conftest import write_tiny_checkpoint
    other_vocab = write_tiny_checkpoint(tmp_path / "v", builtin_path, "llama", vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens, the target 49152"):
        _llm(tiny_llama, _draft(other_vocab))
    short = write_tiny_checkpoint(tmp_path / "s", builtin_path, "llama",
                                  max_position_embeddings=256)
    with pytest.raises(ValueError, match="--max-model-len 256"):
        _llm(tiny_llama, _draft(short))
    windowed = write_tiny_checkpoint(tmp_path / "w", builtin_path, "mistral", sliding_window=24)
    with pytest.raises(ValueError, match="sliding-window"):
        _llm(tiny_llama, _draft(windowed))


def test_draft_model_workloads_under_memory_pressure_match_decoding_without_drafts(
        tiny_llama, monkeypatch):
    """The fuzz harness with a draft model (the target itself, so its KV is checkable):
    before every draft, the draft KV the catch-up trusts equals the target's KV there,
    through swap and recompute preemption, copy-on-write forks (n > 1), prefix hits
    and rejected drafts (the draft's argmax for sampled requests); outputs equal
    decoding without drafts."""
    plain = Differential(_engine(tiny_llama), ample_blocks=256)
    # Twice the budget: the draft's cache (of the same blocks) takes its share.
    engine = LLMEngine(EngineConfig(
        model=str(tiny_llama), dtype="float32", kv_cache_memory=512 * TINY_BLOCK_BYTES,
        preemption_mode="swap", swap_space=256 * TINY_BLOCK_BYTES,
        speculative_config=_draft(tiny_llama)))
    engine.spec.policy = None  # every draft verified, whatever it costs here
    stale, checked = [], [0]
    propose = type(engine.draft).propose

    def checked_propose(draft, seqs, sampler):
        target, own = engine.runner.kv_cache.storage, draft.runner.kv_cache.storage
        bs = engine.runner.block_size
        for seq in seqs:
            for p in range(min(seq.num_draft_computed, seq.num_tokens - 1)):
                block, slot = seq.block_table[p // bs], p % bs
                checked[0] += 1
                if not torch.allclose(target[:, :, block, slot], own[:, :, block, slot],
                                      atol=1e-4, rtol=1e-3):
                    stale.append((seq.seq_id, p))
                    break
        return propose(draft, seqs, argmax_drafts)

    def argmax_drafts(logits, positions, grammar_rows=None, bitmask=None):
        """The draft's argmax (not the coupled draw, which for the target itself is
        the target's own token): sampled requests then see drafts rejected."""
        return argparse.Namespace(token_ids=logits.argmax(dim=-1).tolist())

    monkeypatch.setattr(type(engine.draft), "propose", checked_propose)
    drafted = Differential(engine, ample_blocks=256)
    drafted.reference = plain.reference
    rng = random.Random(os.environ.get("LLMSERVE_FUZZ_SEED", "11"))
    pool = spec_pool(rng, plain.engine.hf_config.vocab_size, size=10)
    pool = with_stop_strings(plain, pool, rng)
    preemptions = swaps = 0
    for i in range(max(NUM_WORKLOADS, 3)):
        w = random_workload(rng, pool, BLOCK, max_blocks=256, max_cpu_blocks=128)
        swap = i % 2 == 1
        w.config["preemption_mode"] = "swap" if swap else "recompute"
        w.num_cpu_blocks = 128 if swap else w.num_cpu_blocks
        w.num_blocks = min(w.num_blocks, 12)
        drafted.run(w)
        preemptions += engine.scheduler.num_preemptions
        swaps += engine.scheduler.num_swapped_out
    spec = engine.spec
    assert drafted.num_compared > NUM_WORKLOADS and checked[0] > 1000
    assert stale == []
    assert preemptions > 0 and swaps > 0
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # rejections rolled back


def test_a_long_prompt_catches_the_draft_up_over_several_steps(pair, self_drafted,
                                                               monkeypatch):
    """A prompt far longer than a step's catch-up budget is not drafted until the
    draft's KV has caught up, a budget's worth a step; then every greedy draft of the
    self-draft is accepted (its KV is right) and the output is unchanged."""
    from llmserve.spec_decode import speculator
    monkeypatch.setattr(speculator, "CATCH_UP_TOKENS", 40)
    base, _ = pair
    draft = self_drafted.engine.draft
    sizes = []
    execute = draft.runner.execute
    monkeypatch.setattr(draft.runner, "execute",
                        lambda inputs: sizes.append(len(inputs.input_ids)) or execute(inputs))
    prompt = _prompts(1, seed=8)[0] * 8  # 160 tokens
    assert len(prompt) > 3 * 40
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    s = self_drafted.engine.spec
    drafted, accepted = s.num_draft_tokens, s.num_accepted_tokens
    assert _tokens(self_drafted.generate([prompt], params)) == _tokens(base.generate(
        [prompt], params))
    assert max(sizes) <= 40 and len(sizes) > len(prompt) // 40
    drafted, accepted = s.num_draft_tokens - drafted, s.num_accepted_tokens - accepted
    assert drafted > 0 and accepted == drafted
