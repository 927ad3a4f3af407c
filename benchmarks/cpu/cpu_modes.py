"""Decode step time of the CPU engine in each mode, in one run, against fp32 eager.

For each mode (dtype x quantisation x compile) and batch size: build the built-in
model, prefill `batch` sequences of `--context` tokens, then time `--steps` decode
steps (one token per sequence each). Prints ms per step, tokens/s and the ratio to the
fp32 eager baseline measured in the same run; machines here are noisy, so compare
ratios, not absolute times.

    python benchmarks/cpu/cpu_modes.py                       # the default matrix
    python benchmarks/cpu/cpu_modes.py --modes bf16,bf16+int4+compile --batches 1,32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.args import int_list
from benchmarks.lib.decode_step import step_time
from benchmarks.lib.paths import RESULTS
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine

DEFAULT_MODES = "fp32,bf16,bf16+int8,bf16+int4,bf16+compile,bf16+int4+compile"


def parse_mode(mode: str) -> dict:
    parts = mode.split("+")
    return dict(dtype={"fp32": "float32", "bf16": "bfloat16"}[parts[0]],
                quantization=next((p for p in parts if p.startswith("int")), "none"),
                compile="compile" in parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--modes", default=DEFAULT_MODES)
    ap.add_argument("--batches", type=int_list, default="1,32")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS / "cpu_modes.json"))
    args = ap.parse_args()
    batches = args.batches
    modes = ["fp32"] + [m for m in args.modes.split(",") if m != "fp32"]
    results = {}
    for mode in modes:
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", **parse_mode(mode)))
        engine.warm_up()
        startup = time.perf_counter() - t0
        results[mode] = {"startup_s": round(startup, 1)}
        for batch in batches:
            ms = step_time(engine, batch, args.context, args.steps) * 1e3
            results[mode][batch] = ms
        del engine
    print(f"decode step time, built-in model, context {args.context} tokens "
          f"(ratio: fp32 eager time / mode time, > 1 is faster)")
    print(f"{'mode':24s} {'start-up s':>10s} " + " ".join(
        f"{'batch ' + str(b) + ' ms':>14s} {'tok/s':>7s} {'ratio':>6s}" for b in batches))
    for mode, r in results.items():
        cells = []
        for b in batches:
            cells.append(f"{r[b]:14.1f} {b / r[b] * 1e3:7.1f} {results['fp32'][b] / r[b]:6.2f}")
        print(f"{mode:24s} {r['startup_s']:10.1f} " + " ".join(cells))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
