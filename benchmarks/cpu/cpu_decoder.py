"""The C decoder stack against the op-by-op path, in one run.

Two sections, each a ratio against a baseline measured in the same run (machines here
are noisy: compare ratios, not absolute times):

1. The int4 matmul: ATen's ``_weight_int4pack_mm_for_cpu`` vs the C kernel on the same
   packed weights, the built-in model's projection shapes, 1-16 tokens (the kernel's
   tiles are 8 tokens on AVX-512: 9 is a full tile and one more).
2. Decode steps of the built-in model (bf16 + int4, eager; or bf16 alone with
   ``--quantization none``): the engine's step with the layers in C (``NativeDecoder``)
   vs op by op, same engine, per batch size. For int4 the crossover sets
   ``native_decoder.MAX_NATIVE_TOKENS``.

    python benchmarks/cpu/cpu_decoder.py
    python benchmarks/cpu/cpu_decoder.py --batches 1,4,8,16,32 --threads 2
    python benchmarks/cpu/cpu_decoder.py --quantization none --skip-matmul --batches 1,8,32,64,128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.args import add_threads, apply_threads, int_list
from benchmarks.lib.decode_step import step_time
from benchmarks.lib.paths import RESULTS
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.kernels.cpu.decoder import q4_matmul
from llmserve.model_executor.layers.quantization import QuantizedLinear
from llmserve.model_executor.models import native_decoder

SHAPES = [(960, 576, "qkv"), (576, 576, "o"), (3072, 576, "gate_up"), (576, 1536, "down")]


def best_us(fn, reps: int = 20, inner: int = 20) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best * 1e6


def matmul_section(tokens: list[int]) -> dict:
    print("int4 matmul, us (best of 20 x 20): ATen vs C, ratio = ATen / C (> 1: C faster)")
    out = {}
    for n, k, name in SHAPES:
        torch.manual_seed(0)
        lin = QuantizedLinear(torch.nn.Linear(k, n, bias=False), 4)
        for m in tokens:
            x = torch.randn(m, k).to(torch.bfloat16)
            aten = best_us(lambda lin=lin, x=x: lin(x))
            native = best_us(lambda lin=lin, x=x: q4_matmul(x, lin))
            out[f"{name}/{m}"] = {"aten_us": aten, "c_us": native}
            print(f"  {name:8s} [{m:2d} x {k}] x [{k} x {n}]  ATen {aten:7.1f}  C {native:7.1f}"
                  f"  ratio {aten / native:5.2f}")
    return out


def step_section(batches: list[int], context: int, steps: int, quantization: str) -> dict:
    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", dtype="bfloat16",
                                    quantization=quantization))
    engine.warm_up()
    model = engine.runner.model.model
    native = model.native_decoder
    if native is None:
        print("the C decoder stack does not apply on this machine")
        return {}
    # measure past the engine's limits
    native_decoder.MAX_NATIVE_TOKENS = native_decoder.MAX_NATIVE_TOKENS_AVX2 = max(batches)
    native_decoder.MAX_NATIVE_TOKENS_WITHOUT_BF16 = max(batches)
    native_decoder.MAX_NATIVE_TOKENS_AVX2_PANELS = max(batches)
    native_decoder.MAX_NATIVE_TOKENS_TILES_ONLY = max(batches)
    native_decoder.MAX_NATIVE_TOKENS_INT8_X = max(batches)
    print(f"decode step of the built-in model (bf16, quantization {quantization}, "
          f"context {context}), ms: "
          f"op by op vs C, ratio = op by op / C (> 1: C faster)")
    out = {}
    for batch in batches:
        # Unmeasured: the first run of a batch's prompts prefills them over many steps,
        # and those prefilled first finish (steps + 8 tokens) before the timed steps,
        # which then have fewer rows. Later runs find them cached.
        step_time(engine, batch, context, 2)
        times = {}
        for label, decoder in (("ops", None), ("c", native), ("ops2", None), ("c2", native)):
            model.native_decoder = decoder
            times[label] = step_time(engine, batch, context, steps) * 1e3
        ops, c = min(times["ops"], times["ops2"]), min(times["c"], times["c2"])
        out[batch] = {"ops_ms": ops, "c_ms": c}
        print(f"  batch {batch:3d}: op by op {ops:7.2f}  C {c:7.2f}  ratio {ops / c:5.2f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int_list, default="1,2,4,5,8,9,16")  # 5: a decode + 4 drafts
    ap.add_argument("--batches", type=int_list, default="1,2,4,8,12,16")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20)
    add_threads(ap)
    ap.add_argument("--quantization", default="int4",
                    help="the steps' model: int4, or none (bf16 projections in gemm.c)")
    ap.add_argument("--skip-matmul", action="store_true", help="the decode steps only")
    ap.add_argument("--out", default=str(RESULTS / "cpu_decoder.json"))
    args = ap.parse_args()
    apply_threads(args)
    results = {"threads": torch.get_num_threads(),
               "matmul": {} if args.skip_matmul else matmul_section(args.tokens),
               "steps": step_section(args.batches, args.context, args.steps,
                                     args.quantization)}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
