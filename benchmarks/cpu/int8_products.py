"""The int4 and int8 products of many rows with x rounded to int8 (``panel_int8.h``)
against the same products with x in float32, and, where gemm.c's quant_gemm runs (CPUs
with bf16 arithmetic), against quant_gemm with and without AMX tiles; same process,
alternating.

For each row count: four int4 projections shaped as a layer of the built-in model's,
but with a full-width qkv ([1728, 3072, 576, 576] outputs x [576, 576, 576, 1536]
inputs, random weights; the model's own qkv is 960 wide, its 3 KV heads of 64, so
this layer has 3.98 M multiply-adds a row against its 3.54 M) through the C
kernel with x in float32 (its tiles below 16 rows, float32 panels above) and rounded to
int8, plus, from the float32 copy of the weight, MKL's float32 GEMM (what long prefill
chunks took before); and the int8 LM head [49152 x 576] through q8_rows both ways.
Where quant_gemm is built: the same products through it (bf16 x; AMX tiles where
granted, VDPBF16PS dot products as on Zen 4), which is why ``gemm.rounds_x_to_int8``
leaves quant_gemm no product without AMX tiles. Prints best-of times and the ratios
(>1: int8 faster).
Needs a build with the int8 panels: AVX-512 VNNI, or AVX2 (there the int4 layer only:
both LM head columns are its float32 path). Elsewhere both columns are the float32 path.

    python benchmarks/cpu/int8_products.py --rows 3,16,32,96,512
    python benchmarks/cpu/int8_products.py --rows 8,16,24,32,48,512 --quant-gemm  # AMX, Zen 4
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/cpu/int8_products.py   # as an AVX2-only CPU
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
from llmserve.kernels.cpu import gemm
from llmserve.kernels.cpu.decoder import q4_matmul
from llmserve.kernels.cpu.dequant import q4_weight_f32
from llmserve.kernels.cpu.gemm import q8_rows
from llmserve.kernels.cpu.native import panel_int8_built
from llmserve.model_executor.layers.quantization import QuantizedLinear

# (out, in) of qkv, gate_up, o, down; qkv as if every head had its own K and V (kept so
# that the numbers in docs/benchmarks.md stay comparable)
LAYER = [(1728, 576), (3072, 576), (576, 576), (576, 1536)]
LM_HEAD = (49152, 576)


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def sides(xs, xh, layer, head, repeats: int) -> dict[str, float]:
    """One best-of time for each side, in turn."""
    return {name: best(fn, repeats) for name, fn in {
        "f32": lambda: [q4_matmul(x, lin, int8_x=False) for x, lin in zip(xs, layer)],
        "int8": lambda: [q4_matmul(x, lin, int8_x=True) for x, lin in zip(xs, layer)],
        "mkl": lambda: [torch.mm(x.float(), q4_weight_f32(lin)) for x, lin in zip(xs, layer)],
        "head_f32": lambda: q8_rows(xh, head, int8_x=False),
        "head_int8": lambda: q8_rows(xh, head, int8_x=True),
    }.items()}


def quant_gemm_sides(xs, xh, layer, head, repeats: int) -> dict[str, float]:
    """quant_gemm's best-of times, with AMX tiles where granted and without (the
    tiles' previous state restored)."""
    kinds = ["amx", "dot"] if gemm.amx_tiles() else ["dot"]
    was, t = gemm.amx_tiles(), {}
    try:
        for kind in kinds:
            gemm.amx_tiles(kind == "amx")
            t[kind] = best(lambda: [gemm.quant_gemm(x, lin) for x, lin in zip(xs, layer)],
                           repeats)
            t[f"head_{kind}"] = best(lambda: gemm.quant_gemm(xh, head), repeats)
    finally:
        gemm.amx_tiles(was)
    return t


def quant_gemm_row(m: int, t: dict[str, float]) -> str:
    cells = [f"{m}"]
    for kind in ("amx", "dot"):
        if kind in t:
            cells += [f"{kind} {t[kind] * 1e3:.3f} ms ({t[kind] / t['int8']:.2f}x)",
                      f"head {t[f'head_{kind}'] * 1e3:.2f} ms "
                      f"({t[f'head_{kind}'] / t['head_int8']:.2f}x)"]
    return " | ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int_list, default="3,6,16,32,96,512")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quant-gemm", action="store_true",
                    help="also quant_gemm, with AMX tiles and without (where built)")
    args = ap.parse_args()
    quant_gemm_rows = []
    if not panel_int8_built():
        print("note: no int8 panels in this build: both columns are the float32 path")
    torch.manual_seed(0)
    layer = [QuantizedLinear(torch.nn.Linear(k, n, bias=False), 4) for n, k in LAYER]
    head = QuantizedLinear(torch.nn.Linear(LM_HEAD[1], LM_HEAD[0], bias=False), 8)
    print("rows | layer float32 x | int8 x | MKL copy | float32/int8 | MKL/int8 "
          "| LM head float32 x | int8 x | float32/int8")
    for m in args.rows:
        xs = [torch.randn(m, lin.in_features).to(torch.bfloat16) for lin in layer]
        xh = torch.randn(m, LM_HEAD[1]).to(torch.bfloat16)
        t = {}
        for _ in range(2):  # alternate the sides, keep each side's best
            times = sides(xs, xh, layer, head, args.repeats)
            if args.quant_gemm and gemm.quant_tiled_available(4):
                times |= quant_gemm_sides(xs, xh, layer, head, args.repeats)
            for name, seconds in times.items():
                t[name] = min(t.get(name, 1e9), seconds)
        if "dot" in t:
            quant_gemm_rows.append(quant_gemm_row(m, t))
        print(f"{m} | {t['f32'] * 1e3:.2f} ms | {t['int8'] * 1e3:.2f} | {t['mkl'] * 1e3:.2f} "
              f"| {t['f32'] / t['int8']:.2f}x | {t['mkl'] / t['int8']:.2f}x "
              f"| {t['head_f32'] * 1e3:.2f} ms | {t['head_int8'] * 1e3:.2f} "
              f"| {t['head_f32'] / t['head_int8']:.2f}x")
    if quant_gemm_rows:
        print("\nquant_gemm (bf16 x) over the int8 panels, layer and LM head "
              "(>1: int8 faster)\nrows | AMX tiles | LM head | dot products | LM head")
        print("\n".join(quant_gemm_rows))
    elif args.quant_gemm:
        print("note: quant_gemm is not built here (no bf16 arithmetic)")


if __name__ == "__main__":
    main()
