"""Hugging Face transformers as the correctness oracle.

Greedy decoding is compared token by token. A divergence is accepted only at a
near-tie: where the oracle's top-2 logits differ by less than TIE_GAP at the first
differing position, as vLLM's check_logprobs_close does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

TIE_GAP = 1e-4


@dataclass
class OracleRun:
    tokens: list[int]
    gaps: list[float]  # top-1 minus top-2 logit at each generated position


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> OracleRun:
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1].float()
    tokens, gaps = [], []
    for _ in range(max_new_tokens):
        top = logits.topk(2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
    return OracleRun(tokens, gaps)


def compare_greedy(ours: list[int], oracle: OracleRun) -> str:
    """'match', 'tie' (diverged at a near-tie) or raises AssertionError."""
    for i, (a, b) in enumerate(zip(ours, oracle.tokens)):
        if a != b:
            assert oracle.gaps[i] < TIE_GAP, (
                f"diverged at token {i}: ours {a}, transformers {b}, "
                f"top-2 gap {oracle.gaps[i]:.3g} is no tie\nours   {ours}\noracle {oracle.tokens}")
            return "tie"
    assert len(ours) == len(oracle.tokens), (len(ours), len(oracle.tokens))
    return "match"


def load_hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# --- a checkpoint's greedy tokens against ours (the model-family tests) ---------------
GREEDY_TOKENS = 8
_greedy_runs: dict = {}


def random_prompts(seed: int, lengths) -> list[list[int]]:
    """Random token ids of the built-in tokenizer's vocabulary, one prompt per length."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def cached_greedy(path, prompts: list[list[int]]) -> list[OracleRun]:
    """transformers' greedy runs of ``prompts`` on the checkpoint at ``path``, computed
    once per session (several tests compare different engine settings on them)."""
    key = (str(path), tuple(map(tuple, prompts)))
    if key not in _greedy_runs:
        hf = load_hf(path)
        _greedy_runs[key] = [hf_greedy(hf, p, GREEDY_TOKENS) for p in prompts]
    return _greedy_runs[key]


def assert_greedy_matches(llm, path, prompts: list[list[int]],
                          min_distinct_tokens: int = 0) -> None:
    """``llm``'s greedy tokens equal transformers' on the checkpoint at ``path``: at most
    one prompt diverges, and only at a near-tie (more ties than chance explains is a bug).
    ``min_distinct_tokens``: the outputs must not be degenerate."""
    from llmserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    verdicts = [compare_greedy(o, r) for o, r in zip(outs, cached_greedy(path, prompts))]
    assert verdicts.count("tie") <= 1, verdicts
    assert len({t for o in outs for t in o}) >= min_distinct_tokens, outs
