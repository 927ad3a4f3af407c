"""Sampling parameters: validation, seeds, stops, logprobs, penalties."""

from __future__ import annotations

import math
import random

import pytest
import torch

from llmserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory=64 << 20, max_num_batched_tokens=256)


def prompts(n, seed=0, length=12):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(temperature=2.5), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-3), dict(min_p=1.5), dict(n=0), dict(n=100), dict(max_tokens=0),
    dict(max_tokens=-1), dict(min_tokens=5, max_tokens=2), dict(logprobs=50),
    dict(presence_penalty=3.0), dict(repetition_penalty=0.0), dict(stop=[""]),
    dict(seed="x"), dict(temperature=float("nan")), dict(stop_token_ids=[-1]),
    dict(seed=2 ** 63), dict(seed=-2 ** 63 - 1),
])
def test_invalid_params_raise_value_error(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_top_k_beyond_int64_is_no_top_k(llm):
    """Any positive top_k is valid (above the vocabulary it keeps every token), even one
    no int64 holds: the fuzzer's 2**70 used to kill the engine loop."""
    base = dict(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    huge = llm.generate(prompts(1), SamplingParams(top_k=2 ** 70, **base))[0].outputs[0]
    none = llm.generate(prompts(1), SamplingParams(**base))[0].outputs[0]
    assert huge.token_ids == none.token_ids


def test_seeded_request_is_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompts(1), params)[0].outputs[0].token_ids
    crowd = prompts(40, seed=9)
    mixed = [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)] * 20 + [params] \
        + [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 20
    outs = llm.generate(crowd[:20] + prompts(1) + crowd[20:], mixed)
    assert outs[20].outputs[0].token_ids == alone
    other_seed = llm.generate(prompts(1), SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                         max_tokens=16, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_parallel_samples_follow_seed_plus_index(llm):
    base = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
    out = llm.generate(prompts(1), SamplingParams(n=3, seed=40, **base))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for i, sample in enumerate(out.outputs):
        single = llm.generate(prompts(1), SamplingParams(seed=40 + i, **base))[0].outputs[0]
        assert sample.token_ids == single.token_ids


def test_max_tokens_and_min_tokens(llm):
    out = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 7
    assert out[0].outputs[0].finish_reason == "length"
    # With the greedy token banned as a stop token, min_tokens still forces output.
    first = out[0].outputs[0].token_ids[0]
    out = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=7, min_tokens=3,
                                                  stop_token_ids=[first]))
    toks = out[0].outputs[0].token_ids
    assert len(toks) >= 3 and first not in toks[:3]


def test_stop_token_ids_and_stop_strings(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate(prompts(1), greedy)[0].outputs[0]
    stop_tok = full.token_ids[4]
    out = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:full.token_ids.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    out = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]


def test_logprobs_are_log_softmax_of_the_logits(llm, tiny_llama):
    from tests.oracle import load_hf
    p = prompts(1)[0]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=3, logprobs=5,
                                           ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 3
    hf = load_hf(tiny_llama)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] == int(ref.argmax())
    assert math.isclose(first.logprob, float(ref.max()), abs_tol=1e-4)
    top_ids = [t for t, _ in first.top]
    assert top_ids == ref.topk(5).indices.tolist()
    assert all(a >= b for (_, a), (_, b) in zip(first.top, first.top[1:]))


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(prompts(3), SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True))
    topk = llm.generate(prompts(3), SamplingParams(temperature=1.5, top_k=1, max_tokens=8,
                                                   ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk]


def test_repetition_penalty_matches_transformers(llm, tiny_llama):
    from tests.oracle import load_hf
    p = prompts(1, seed=5)[0]
    ours = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                            repetition_penalty=1.5))[0].outputs[0].token_ids
    hf = load_hf(tiny_llama)
    ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                      repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
    assert ours == ref[0, len(p):].tolist()


def test_frequency_penalty_reduces_repeats(llm):
    p = prompts(4, seed=11)
    plain = llm.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    penal = llm.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                           frequency_penalty=2.0))
    distinct = lambda outs: sum(len(set(o.outputs[0].token_ids)) for o in outs)
    assert distinct(penal) > distinct(plain)


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hello"}],
                   SamplingParams(temperature=0, max_tokens=3))[0]
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert "<|im_start|>user\nhello<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
