"""Beam search's memory and time, against the same work done without sharing, in one run.

For one prompt and W beams (default 8) of T tokens:
- the most KV blocks held at once by the beam search, by W parallel samples (n = W,
  sharing the prompt's blocks) and by W independent requests (no prefix cache, nothing
  shared), and the ratios;
- wall time of the beam search against W independent greedy requests batched together
  (the same number of sequences decoding), and the ratio.

    python benchmarks/engine/beam_search.py [--beams 8 --prompt-len 512 --tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time

from llmserve import LLM, BeamSearchParams, SamplingParams


def run(engine, add) -> tuple[int, float]:
    """(most blocks held at once, seconds) while ``add()``'s requests run."""
    t0 = time.perf_counter()
    add()
    peak = 0
    bm = engine.block_manager
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
    bm.check_all_free()
    return peak, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--beams", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(args.model, enable_prefix_caching=False, max_num_seqs=max(8, args.beams))
    engine, w, t = llm.engine, args.beams, args.tokens
    ids = (llm.tokenizer.encode("the cache block is shared by every beam " * 200)
           [:args.prompt_len])
    greedy = SamplingParams(temperature=0, max_tokens=t, ignore_eos=True)
    beams = run(engine, lambda: engine.add_request(ids, SamplingParams(
        n=w, max_tokens=t, beam=BeamSearchParams(w, t, ignore_eos=True))))
    samples = run(engine, lambda: engine.add_request(ids, SamplingParams(
        n=w, max_tokens=t, ignore_eos=True, seed=0)))
    independent = run(engine, lambda: [engine.add_request(ids, greedy) for _ in range(w)])
    result = {
        "beams": w, "prompt_tokens": len(ids), "new_tokens": t,
        "block_size": engine.config.block_size,
        "peak_blocks": {"beam_search": beams[0], "parallel_samples": samples[0],
                        "independent": independent[0]},
        "blocks_beam_vs_independent": round(beams[0] / independent[0], 3),
        "blocks_beam_vs_parallel_samples": round(beams[0] / samples[0], 3),
        "seconds": {"beam_search": round(beams[1], 2), "independent": round(independent[1], 2)},
        "time_beam_vs_independent": round(beams[1] / independent[1], 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
