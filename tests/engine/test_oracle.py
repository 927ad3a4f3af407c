"""Greedy tokens equal transformers' on the same weights, whatever the batching."""

from __future__ import annotations

import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from tests.oracle import compare_greedy, hf_greedy, load_hf

PROMPT_LENS = [1, 3, 16, 17, 40, 129, 300, 600]
NEW_TOKENS = 10
# (max_num_batched_tokens, enable_chunked_prefill)
BUDGETS = {"chunk16": (16, True), "chunk64": (64, True), "unchunked": (2048, False)}


def random_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in PROMPT_LENS]


_oracle_cache: dict = {}


def oracle_runs(path, prompts):
    key = (str(path), tuple(map(tuple, prompts)))
    if key not in _oracle_cache:
        hf = load_hf(path)
        _oracle_cache[key] = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return _oracle_cache[key]


def check_all(outputs, runs) -> int:
    verdicts = [compare_greedy(o.outputs[0].token_ids, r) for o, r in zip(outputs, runs)]
    ties = verdicts.count("tie")
    print(f"{len(verdicts)} prompts compared, {ties} diverged at a near-tie")
    assert ties <= 1, "more near-ties than chance explains"
    return ties


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2"])
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_tiny_models_match_transformers(tiny_models, kind, budget):
    path = tiny_models[kind]
    prompts = random_prompts(seed=len(kind))
    tokens, chunked = BUDGETS[budget]
    llm = LLM(str(path), max_num_batched_tokens=tokens, enable_chunked_prefill=chunked,
              kv_cache_memory=64 << 20)
    check_all(llm.generate(prompts, GREEDY), oracle_runs(path, prompts))
    llm.engine.block_manager.check_all_free()


def test_requests_joining_a_running_batch(tiny_llama):
    """Half the prompts start; the rest arrive while the first half is decoding."""
    prompts = random_prompts(seed=7)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_batched_tokens=48,
                                    kv_cache_memory=64 << 20))
    done = {}
    first, later = prompts[::2], prompts[1::2]
    ids = [engine.add_request(p, SamplingParams(**vars(GREEDY))).request_id for p in first]
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 4:  # the first wave is part-way through prefill and decode
            assert any(s.num_output_tokens > 0 for s in engine.scheduler.running)
            ids += [engine.add_request(p, SamplingParams(**vars(GREEDY))).request_id
                    for p in later]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    outputs = [done[i] for i in ids]
    check_all(outputs, oracle_runs(tiny_llama, first + later))
    engine.block_manager.check_all_free()


@pytest.mark.slow
def test_builtin_model_matches_transformers(builtin_path):
    rng = random.Random(3)
    text = ("The history of the city begins with a small settlement on the river. "
            "Over the centuries it grew into a centre of trade and learning. ")
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 17, 200)]
    llm = LLM("smollm2-135m-instruct", max_num_batched_tokens=64, kv_cache_memory=256 << 20)
    tok = llm.tokenizer
    prompts += [tok.encode("What is the capital of France?"),
                tok.encode(text * 6)[:600]]
    check_all(llm.generate(prompts, GREEDY), oracle_runs(builtin_path, prompts))
