"""How much of a decode step's products is the weight's stream from memory: the built-in
model's four int4 projections of a layer, for 30 distinct layers after a 400 MB sweep
(their weights out of the caches, as in a step of the C stack) against one layer's 30
times (its weight in the caches), and the int8 LM head [49152 x 576] after the sweep
against right after itself. Random weights, best of 7; each product by
``QuantizedLinear`` itself, so through the kernel the layers route it to on this CPU
(the int8 panels where x is rounded to int8; ``quant_gemm``, AMX tiles included, from
its row threshold; the C kernel's tiles below). Prints ms and cold / hot (1.00x: the
stream is hidden under the compute).

    python benchmarks/cpu/cold_weights.py --rows 4,8,21,32
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python benchmarks/cpu/cold_weights.py                     # as an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.args import int_list
from llmserve.model_executor.layers.quantization import QuantizedLinear

LAYER = [(1728, 576), (3072, 576), (576, 576), (576, 1536)]  # (out, in) of qkv, gate_up, o, down
LM_HEAD = (49152, 576)
LAYERS = 30


def best_ms(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def measure(m: int, layers, head, sweep: torch.Tensor, repeats: int) -> str:
    """One table row: m rows through the layers' products and the LM head, cold and hot."""
    xs = [torch.randn(m, k).to(torch.bfloat16) for _, k in LAYER]
    xh = torch.randn(m, LM_HEAD[1]).to(torch.bfloat16)
    cold = best_ms(lambda: [lin(x) for layer in layers for x, lin in zip(xs, layer)], repeats,
                   lambda: sweep.fill_(1))
    hot = best_ms(lambda: [lin(x) for _ in range(LAYERS) for x, lin in zip(xs, layers[0])],
                  repeats)
    head_cold = best_ms(lambda: head(xh), repeats, lambda: sweep.fill_(1))
    head_hot = best_ms(lambda: head(xh), repeats)
    return (f"{m} | {cold:.2f} ms | {hot:.2f} | {cold / hot:.2f}x | {head_cold:.2f} ms "
            f"| {head_hot:.2f} | {head_cold / head_hot:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int_list, default="4,8,21,32,96")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    layers = [[QuantizedLinear(torch.nn.Linear(k, n, bias=False), 4) for n, k in LAYER]
              for _ in range(LAYERS)]
    head = QuantizedLinear(torch.nn.Linear(LM_HEAD[1], LM_HEAD[0], bias=False), 8)
    sweep = torch.empty(400 << 20, dtype=torch.uint8)
    print(f"rows | {LAYERS} layers, cold | hot | cold/hot | LM head, cold | hot | cold/hot")
    for m in args.rows:
        print(measure(m, layers, head, sweep, args.repeats))


if __name__ == "__main__":
    main()
