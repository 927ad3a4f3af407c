"""Prefix caching and preemption, measured in one process, one run.

1. TTFT of requests that share a ~2,000-token system prompt: cold (first request
   on an empty cache) versus warm (the prompt's blocks are cached), and the ratio.
2. Throughput under memory pressure (a KV budget far below the working set):
   swap versus recompute preemption, same workload.

    python benchmarks/engine/prefix_cache.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import RESULTS
from llmserve import LLM, SamplingParams
from llmserve.engine.llm_engine import LLMEngine


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from submission until the first output token, alone on the engine."""
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def prefix_ttft(args, rng) -> dict:
    llm = LLM(args.model)
    engine = llm.engine
    cold, warm = [], []
    for _ in range(args.rounds):
        system = [rng.randrange(100, 40000) for _ in range(args.system_len)]
        question = lambda: [rng.randrange(100, 40000) for _ in range(args.question_len)]
        cold.append(ttft(engine, system + question()))  # a new system prompt: all cold
        warm += [ttft(engine, system + question()) for _ in range(args.warm_per_round)]
    hits = engine.block_manager.prefix_hits / max(engine.block_manager.prefix_queries, 1)
    result = {"cold_ttft_ms": 1000 * statistics.mean(cold),
              "warm_ttft_ms": 1000 * statistics.mean(warm),
              "ratio_warm_over_cold": statistics.mean(warm) / statistics.mean(cold),
              "token_hit_rate": hits}
    print(f"\nTTFT with a {args.system_len}-token shared system prompt "
          f"(+{args.question_len} new tokens):")
    print(f"  cold {result['cold_ttft_ms']:8.1f} ms   warm {result['warm_ttft_ms']:8.1f} ms   "
          f"warm/cold {result['ratio_warm_over_cold']:.3f}   token hit rate {hits:.2f}")
    return result


def block_bytes(model: str, block_size: int = 16) -> int:
    """fp32 bytes of one KV block of ``model``."""
    from llmserve.model_executor.model_loader.sources import load_config, resolve_model
    from llmserve.worker.kv_sizing import kv_block_bytes
    return kv_block_bytes(load_config(resolve_model(model)), block_size, 4)


def pressure_throughput(args, rng) -> dict:
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(100, 300))]
               for _ in range(args.pressure_requests)]
    params = SamplingParams(max_tokens=args.pressure_output, temperature=0, ignore_eos=True)
    out = {}
    reference = None
    for mode in ("recompute", "swap"):
        llm = LLM(args.model, kv_cache_memory=args.pressure_kv_blocks * block_bytes(args.model),
                  preemption_mode=mode, watermark=0.0)
        llm.generate([prompts[0]], SamplingParams(max_tokens=2))  # warm up
        t0 = time.perf_counter()
        results = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        tokens = [r.outputs[0].token_ids for r in results]
        reference = reference or tokens
        sched = llm.engine.scheduler
        out[mode] = {"tokens_per_s": sum(map(len, tokens)) / wall, "wall_s": wall,
                     "preemptions": sched.num_preemptions,
                     "swapped_out": sched.num_swapped_out,
                     "kv_blocks": llm.engine.block_manager.num_blocks,
                     "same_outputs_as_recompute": tokens == reference}
        print(f"\n{mode:9}: {out[mode]['tokens_per_s']:7.1f} tokens/s  "
              f"preemptions {sched.num_preemptions}  swapped out {sched.num_swapped_out}  "
              f"same outputs {tokens == reference}")
    out["ratio_swap_over_recompute"] = (out["swap"]["tokens_per_s"]
                                        / out["recompute"]["tokens_per_s"])
    print(f"swap / recompute throughput: {out['ratio_swap_over_recompute']:.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-per-round", type=int, default=3)
    ap.add_argument("--pressure-requests", type=int, default=24)
    ap.add_argument("--pressure-output", type=int, default=150)
    ap.add_argument("--pressure-kv-blocks", type=int, default=160,
                    help="KV blocks under memory pressure (the workload needs ~500)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(RESULTS / "prefix_cache.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    report = {"prefix_ttft": prefix_ttft(args, rng), "pressure": pressure_throughput(args, rng)}
    Path(args.json).parent.mkdir(exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
