"""The offline engine timed on a workload of random token prompts: what
``engine/offline_throughput.py`` measures, and the scripts that take its workload
apart (``engine/step_split.py``, ``serving/server_gap.py``) reuse."""

from __future__ import annotations

import random
import time

from llmserve import LLM, SamplingParams


def make_workload(n: int, lo: int, hi: int, prompt_lo: int, prompt_hi: int, seed: int):
    """``n`` prompts of random token ids (``prompt_lo``..``prompt_hi`` long) and an
    output length in ``lo``..``hi`` for each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(prompt_lo, prompt_hi))]
               for _ in range(n)]
    outs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outs


def make_llm(model: str, max_num_seqs: int, dtype: str, engine_args: dict) -> LLM:
    llm = LLM(model, max_num_seqs=max_num_seqs, dtype=dtype, **engine_args)
    # Warm up on a prompt of no round (a cached prefix would shorten the first one).
    llm.generate([list(range(50, 66))], SamplingParams(max_tokens=4, ignore_eos=True))
    return llm


def run_llmserve(llm: LLM, prompts, outs) -> dict:
    """Greedy, ``ignore_eos``: tokens/s and where the engine's step time went."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outs]
    stats = llm.engine.stats
    stats.__init__()
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    assert generated == sum(outs)
    return {"tokens_per_s": generated / wall, "wall_s": wall, "steps": stats.steps,
            "schedule_s": stats.schedule_s, "forward_s": stats.forward_s,
            "postprocess_s": stats.post_s,
            "other_s": wall - stats.schedule_s - stats.forward_s - stats.post_s,
            "model_path": str(llm.engine.model_path), "dtype": llm.engine.config.dtype}
