"""Products of many rows on a CPU without bf16 tiles: the panel GEMMs against what they
replaced, in one run (machines here are noisy: each pair alternates, compare ratios).

1. The int8 LM head ([49152 x 576], the built-in model's): ATen's
   ``_weight_int8pack_mm`` vs ``q8_rows`` (from 12 rows, AVX-512 builds: a GEMM over
   converted panels).
2. The int4 projections of a layer (qkv, o, gate_up, down; 8 layers' weights in turn,
   so they stream from L3): the weight dequantised to float32 + MKL (``dequant.c``) vs
   the C panel GEMM (``decoder.c``), and ATen's int4 kernel.

    python benchmarks/cpu/cpu_many_rows.py [--rows 16,32,64,128,256,512] [--repeats 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.args import add_threads, apply_threads, int_list
from llmserve.kernels.cpu import dispatch
from llmserve.kernels.cpu.decoder import q4_matmul
from llmserve.kernels.cpu.dequant import q4_weight_f32
from llmserve.kernels.cpu.gemm import q8_rows
from llmserve.model_executor.layers.quantization import QuantizedLinear, weight_only_mm

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down


def alternate(fns: dict, repeats: int) -> dict:
    """Median ms of each function, the functions called in turn ``repeats`` times."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def dequant_mkl(x: torch.Tensor, lin) -> torch.Tensor:
    """The float32 copy + MKL (what the dispatch table takes from DEQUANT_MIN_ROWS)."""
    return torch.mm(x.float(), q4_weight_f32(lin)).to(x.dtype)


def lm_head(rows: list[int], repeats: int) -> None:
    torch.manual_seed(0)
    lin = QuantizedLinear(torch.nn.Linear(576, 49152, bias=False), 8)
    print("int8 LM head [49152 x 576], ms (median): ATen vs q8_rows")
    limit = dispatch.route(8, (dispatch.Q8_ROWS, dispatch.Q8_ROWS_INT8X)).last
    if limit is not None:
        print(f"  (q8_rows takes at most {limit} rows on this build: skipped)")
        return
    for m in rows:
        x = torch.randn(m, 576).to(torch.bfloat16)
        t = alternate({"aten": lambda x=x: weight_only_mm(x, lin.qweight, lin.scales, 8),
                       "q8_rows": lambda x=x: q8_rows(x, lin)}, repeats)
        print(f"  {m:4d} rows: ATen {t['aten']:7.2f}  q8_rows {t['q8_rows']:7.2f}"
              f"  ratio {t['aten'] / t['q8_rows']:5.2f}")


def int4_layer(rows: list[int], repeats: int) -> None:
    torch.manual_seed(0)
    lins = [QuantizedLinear(torch.nn.Linear(k, n, bias=False), 4) for n, k in LAYER] * 8
    print("int4 projections of a layer, ms per layer (median): dequantised + MKL, "
          "C panels, ATen; ratios over the panels")
    for m in rows:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for _, k in LAYER}

        def each(fn, xs=xs):
            return lambda: [fn(xs[lin.in_features], lin) for lin in lins]
        t = alternate({"dequant": each(dequant_mkl), "panels": each(q4_matmul),
                       "aten": each(lambda x, lin: weight_only_mm(x, lin.qweight,
                                                                  lin.scales, 4))}, repeats)
        d, p, a = (t[k] / 8 for k in ("dequant", "panels", "aten"))
        print(f"  {m:4d} rows: dequant+MKL {d:6.2f}  panels {p:6.2f}  ATen {a:6.2f}"
              f"  dequant/panels {d / p:5.2f}  ATen/panels {a / p:5.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int_list, default="16,32,64,128,256,512")
    ap.add_argument("--repeats", type=int, default=6)
    add_threads(ap)
    args = ap.parse_args()
    apply_threads(args)
    lm_head(args.rows, args.repeats)
    int4_layer(args.rows, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
