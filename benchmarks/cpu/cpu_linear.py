"""bf16 linears on the CPU: ``F.linear`` on the plain weight versus oneDNN's linear
on a weight packed once (``kernels/cpu_linear.PackedLinear``) and, where it is built
(AVX512-BF16), our own GEMM on its packed layout (``NativeLinear``, ``gemm.c``; on
AMX CPUs both with VDPBF16PS and with AMX tiles); same run, alternating. Ratios are
against the plain ``F.linear``.

``--quantized``: the weight-only projections instead (int4, and the int8 LM head of
both quantised modes), ATen's kernels (what the engine uses below the dispatch
table's quant_gemm row, ``kernels/cpu/dispatch.py``) versus ``gemm.c``'s quant_gemm
(dequantised per group of panels into the bf16 tiles; on AMX CPUs both with
AVX512-BF16 dot products and with AMX tiles), ratios against ATen. On a CPU without
bf16 arithmetic (no quant_gemm) ATen's versus the int4 weight dequantised for the
float32 GEMM (``kernels/cpu/dequant.py``) and the float32 GEMM of the float32 weight
(the float32 model's product).

Each shape is timed over as many distinct weights as the built-in model has layers,
so that the weights come from memory as they do in a decode step, not from a cache
that one weight timed in a loop would sit in.

    python benchmarks/cpu/cpu_linear.py [--rows 1 8 32 64 128] [--repeats 7] [--quantized]
"""

from __future__ import annotations

import argparse
import time

import torch

from llmserve.kernels.cpu.decoder import q4_matmul
from llmserve.kernels.cpu.dequant import int4_runs_in_float32, q4_dequant_mm
from llmserve.kernels.cpu.dispatch import DEQUANT_MIN_ROWS
from llmserve.kernels.cpu.gemm import (
    amx_tiles,
    native_gemm_available,
    packing_available,
    quant_gemm,
    quant_tiled_available,
    rounds_x_to_int8,
)
from llmserve.model_executor.layers.cpu_linear import NativeLinear, PackedLinear
from llmserve.model_executor.layers.quantization import QuantizedLinear, weight_only_mm

# (name, out_features, in_features, copies): the built-in model's projections.
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30),
          ("down", 576, 1536, 30), ("lm_head", 49152, 576, 1)]


def seconds_per_step(modules, x) -> float:
    """Time to apply every one of ``modules`` to ``x``."""
    t0 = time.perf_counter()
    for m in modules:
        m(x)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantized", action="store_true",
                    help="int4 projections and int8 LM head: ATen's kernels vs quant_gemm")
    args = ap.parse_args()
    if not packing_available():
        raise SystemExit("oneDNN has no bf16 kernels on this CPU: nothing to compare")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quantized and not quant_tiled_available(4):
        # No bf16 arithmetic: ATen's int4 kernel against the dequantised float32 GEMM
        # (dequant.c; the int8 LM head has no such path and stays on ATen's), and the
        # float32 GEMM of the float weight (what the float32 model computes).
        if not int4_runs_in_float32():
            raise SystemExit("neither quant_gemm nor the float32 int4 path runs here")
        kinds = {"aten": lambda lin: aten_quantized(quantize(lin)),
                 "dequant f32": lambda lin: dequantised(quantize(lin)),
                 "float32": lambda lin: lin.float()}
    elif args.quantized:
        kinds = {"aten": lambda lin: aten_quantized(quantize(lin)),
                 "quant_gemm": lambda lin: tiled_quantized(quantize(lin))}
        if amx_tiles():  # both ways of multiplying the dequantised tiles
            kinds = {"aten": kinds["aten"],
                     "quant_gemm avx512": lambda lin: tiled_quantized(quantize(lin), False),
                     "quant_gemm amx": lambda lin: tiled_quantized(quantize(lin), True)}
    else:
        kinds = {"plain": lambda lin: lin, "onednn": PackedLinear}
        if native_gemm_available():
            kinds["native"] = NativeLinear
        if native_gemm_available() and amx_tiles():  # gemm.c both ways, as quant_gemm
            del kinds["native"]
            kinds["native avx512"] = lambda lin: with_tiles(NativeLinear(lin), False)
            kinds["native amx"] = lambda lin: with_tiles(NativeLinear(lin), True)
    print(f"threads {torch.get_num_threads()}; best time per step of each projection "
          f"(all layers) over {args.repeats} alternating repeats: "
          + " | ".join(kinds) + f" (speed-up over {next(iter(kinds))})")
    totals = {m: dict.fromkeys(kinds, 0.0) for m in args.rows}
    for name, n, k, copies in SHAPES:
        linears = [torch.nn.Linear(k, n, bias=False).to(torch.bfloat16) for _ in range(copies)]
        modules = {kind: [make(lin) for lin in linears] for kind, make in kinds.items()}
        cells = []
        for m in args.rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            inputs = {kind: x.float() if kind == "float32" else x for kind in kinds}
            best = dict.fromkeys(kinds, float("inf"))
            for _ in range(args.repeats + 1):  # the first is a warm-up
                for kind, mods in modules.items():
                    best[kind] = min(best[kind], seconds_per_step(mods, inputs[kind]))
            for kind in kinds:
                totals[m][kind] += best[kind]
            cells.append(f"M={m}: " + format_cell(best))
        print(f"{name:8s} " + " | ".join(cells), flush=True)
    print("all      " + " | ".join(f"M={m}: " + format_cell(t) for m, t in totals.items()))


def quantize(lin: torch.nn.Linear) -> QuantizedLinear:
    """As the engine's int4 mode does: int4 projections, an int8 LM head."""
    return QuantizedLinear(lin.float(), 8 if lin.out_features == SHAPES[-1][1] else 4)


def aten_quantized(q: QuantizedLinear):
    return lambda x: weight_only_mm(x, q.qweight, q.scales, q.bits)


def dequantised(q: QuantizedLinear):
    """The C kernel's product (x rounded to int8 where it is here), or from
    DEQUANT_MIN_ROWS rows the float32 copy and MKL."""
    if q.bits != 4:
        return aten_quantized(q)
    int8_x = rounds_x_to_int8()
    return lambda x: (q4_matmul(x, q, int8_x=int8_x)
                      if int8_x or x.shape[0] < DEQUANT_MIN_ROWS else q4_dequant_mm(x, q))


def tiled_quantized(q: QuantizedLinear, amx: bool | None = None):
    def run(x):
        if amx is not None:
            amx_tiles(amx)
        return quant_gemm(x, q)
    return run


def with_tiles(linear, amx: bool):
    def run(x):
        amx_tiles(amx)
        return linear(x)
    return run


def format_cell(seconds: dict) -> str:
    base = next(iter(seconds.values()))
    return " -> ".join(f"{s * 1e3:.2f}" + ("" if i == 0 else f" ({base / s:.2f}x)")
                       for i, s in enumerate(seconds.values())) + " ms"


if __name__ == "__main__":
    main()
