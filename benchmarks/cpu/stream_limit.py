"""One stream's decode step against this machine's weight-streaming limit, in one run.

A decode step of one sequence reads every weight once, plus the sequence's KV, so on a
CPU its floor is those bytes over the memory bandwidth the engine's threads can pull.
Each round measures, in turn (machines here are noisy: the ratio is what counts):

1. a STREAM-like read probe: torch's float32 sum over a 512 MB array on the engine's
   threads (read-only, as weight streaming is), best of 5, on 4 KB pages and on 2 MB
   pages (where Linux gives them: the engine's weights are on them,
   ``worker/weight_arena.py``); the limit is the faster of the two;
2. the engine's decode step at batch 1, context ``--context`` (default config: on a
   bf16 CPU the built-in model serves int4 with an int8 LM head), mean of ``--steps``.

The bytes a step reads are counted from the model: every tensor of the decoder layers
and the LM head, one row of the embedding, and the context's KV. Prints the floor
(bytes / bandwidth), the step and the fraction of the limit reached, median over the
rounds (the target: at least 50 %).

    .venv/bin/python benchmarks/cpu/stream_limit.py
    .venv/bin/python benchmarks/cpu/stream_limit.py --rounds 5 --context 500
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.decode_step import step_time
from benchmarks.lib.paths import RESULTS
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.worker.weight_arena import huge_page_block

PROBE_BYTES = 512 << 20


def read_bandwidth(probe: torch.Tensor, reps: int = 5) -> float:
    """Bytes per second that ``probe.sum()`` reads, best of ``reps``."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        probe.sum()
        best = min(best, time.perf_counter() - t0)
    return probe.numel() * probe.element_size() / best


def step_bytes(model, context: int) -> int:
    """What one decode step of one sequence reads: each distinct tensor of the layers
    and the LM head, an embedding row, and ``context`` tokens of KV."""
    seen, total = set(), 0
    modules = [*model.model.layers, model.model.norm, model.lm_head]
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            if t.data_ptr() in seen:  # a tied or shared tensor counts once
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    # one row of the embedding, dense or as Q8_0 blocks (its codes and scales)
    embed = model.model.embed_tokens
    for t in [*embed.parameters(), *embed.buffers()]:
        total += t[0].numel() * t.element_size()
    kv_per_token = 0
    for layer in model.model.layers:
        cache = layer.self_attn.kv_cache  # [2, blocks, block_size, kv_heads, head_dim]
        kv_per_token += 2 * cache.shape[-2] * cache.shape[-1] * cache.element_size()
    return total + context * kv_per_token


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=RESULTS / "stream_limit.json")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct"))
    engine.warm_up()
    model = engine.runner.model
    nbytes = step_bytes(model, args.context)
    probe = torch.ones(PROBE_BYTES // 4, dtype=torch.float32)
    huge_probe = huge_page_block(PROBE_BYTES)[0].view(torch.float32).fill_(1.0)
    bandwidths, small_pages, steps = [], [], []
    for r in range(args.rounds):
        small_pages.append(read_bandwidth(probe))
        bandwidths.append(max(small_pages[-1], read_bandwidth(huge_probe)))
        steps.append(step_time(engine, 1, args.context, args.steps))
        print(f"round {r + 1}: read {bandwidths[-1] / 1e9:.1f} GB/s (4 KB pages "
              f"{small_pages[-1] / 1e9:.1f}), step {steps[-1] * 1e3:.2f} ms, "
              f"{nbytes / bandwidths[-1] / steps[-1]:.0%} of the limit")
    bandwidth, step = statistics.median(bandwidths), statistics.median(steps)
    floor = nbytes / bandwidth
    result = {"threads": torch.get_num_threads(), "context": args.context,
              "step_mb": nbytes / 1e6, "read_gb_s": bandwidth / 1e9, "floor_ms": floor * 1e3,
              "step_ms": step * 1e3, "fraction_of_limit": floor / step,
              "read_gb_s_4k_pages": statistics.median(small_pages) / 1e9,
              "rounds": [{"read_gb_s": b / 1e9, "step_ms": s * 1e3}
                         for b, s in zip(bandwidths, steps)]}
    proj = model.model.layers[0].mlp.gate_up_proj
    print(f"one stream, built-in model (projections: {proj.extra_repr() or type(proj).__name__}; "
          f"LM head: {model.lm_head.extra_repr()}), {torch.get_num_threads()} threads, "
          f"context {args.context}:")
    print(f"  a decode step reads {nbytes / 1e6:.1f} MB; the read probe pulls "
          f"{bandwidth / 1e9:.1f} GB/s (on 4 KB pages "
          f"{statistics.median(small_pages) / 1e9:.1f}) -> floor {floor * 1e3:.2f} ms")
    print(f"  decode step {step * 1e3:.2f} ms = {floor / step:.0%} of the weight-streaming "
          f"limit (target >= 50 %)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
