"""bf16 linears on the CPU: ``F.linear`` on the plain weight versus oneDNN's linear
on a weight packed once (``kernels/cpu_linear.PackedLinear``), same run.

Each shape is timed over as many distinct weights as the built-in model has layers,
so that the weights come from memory as they do in a decode step, not from a cache
that one weight timed in a loop would sit in.

    python benchmarks/cpu_linear.py [--rows 1 8 32 64 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from llmserve.kernels.cpu_linear import PackedLinear, packing_available

# (name, out_features, in_features, copies): the built-in model's projections.
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30),
          ("down", 576, 1536, 30), ("lm_head", 49152, 576, 1)]


def seconds_per_step(modules, x, repeats: int) -> float:
    """Best time to apply every one of ``modules`` to ``x``."""
    for m in modules:  # warm up
        m(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for m in modules:
            m(x)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if not packing_available():
        raise SystemExit("oneDNN has no bf16 kernels on this CPU: nothing to compare")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}; time per step of each projection "
          f"(all layers), plain -> packed (speed-up)")
    totals = {m: [0.0, 0.0] for m in args.rows}
    for name, n, k, copies in SHAPES:
        linears = [torch.nn.Linear(k, n, bias=False).to(torch.bfloat16) for _ in range(copies)]
        packed = [PackedLinear(lin) for lin in linears]
        cells = []
        for m in args.rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            plain = seconds_per_step(linears, x, args.repeats)  # F.linear, plain weight
            fast = seconds_per_step(packed, x, args.repeats)
            totals[m][0] += plain
            totals[m][1] += fast
            cells.append(f"M={m}: {plain * 1e3:6.2f} -> {fast * 1e3:6.2f} ms "
                         f"({plain / fast:4.2f}x)")
        print(f"{name:8s} " + " | ".join(cells), flush=True)
    print("all      " + " | ".join(f"M={m}: {p * 1e3:6.2f} -> {f * 1e3:6.2f} ms ({p / f:4.2f}x)"
                                   for m, (p, f) in totals.items()))


if __name__ == "__main__":
    main()
