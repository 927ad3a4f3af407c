"""CPU decode attention: the C kernel (``decode.c``'s ``paged_decode``) against the
torch path (gather + SDPA, ``cpu_attention.py``), one layer, both measured in the same
run (machines here are noisy and shared: compare ratios, not absolute times).

The shape is the built-in model's (9 query heads over 3 KV heads of 64, bf16 cache,
blocks of 16), each sequence's blocks scattered over the cache as the engine leaves
them. Printed per (batch, context): ms per layer (best of several repetitions), GB/s
of K/V read (each context's K and V once) and the ratio torch / C (> 1: C faster).

    python benchmarks/cpu/cpu_attention.py
    python benchmarks/cpu/cpu_attention.py --batches 64 --contexts 256 --skip-torch
    python benchmarks/cpu/cpu_attention.py --threads 1 --cpu-time   # on a busy machine
    python benchmarks/cpu/cpu_attention.py --skip-torch --layers 30 # caches past the L3
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.args import add_threads, apply_threads, int_list
from llmserve.kernels.cpu.attention import make_cpu_plan, paged_attention_cpu
from llmserve.kernels.cpu.native import cpu_library, paged_decode

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


CLOCK = time.perf_counter


def best_ms(fn, budget_s: float = 0.5, reps: int = 9) -> float:
    """Best over ``reps`` repetitions of an inner loop sized to ~budget_s / reps."""
    fn()
    t0 = CLOCK()
    fn()
    once = max(CLOCK() - t0, 1e-6)
    inner = max(1, int(budget_s / reps / once))
    best = float("inf")
    for _ in range(reps):
        t0 = CLOCK()
        for _ in range(inner):
            fn()
        best = min(best, (CLOCK() - t0) / inner)
    return best * 1e3


def make_batch(batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype):
    """q, the layer cache and per-sequence block tables, blocks scattered over a pool;
    lengths jitter a little below ``context`` (sequences of one batch differ)."""
    rng = random.Random(batch * 7919 + context)
    lens = [max(1, context - rng.randrange(16)) for _ in range(batch)]
    per_seq = -(-context // block_size)
    pool = list(range(batch * per_seq + 8))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-n // block_size))] for n in lens]
    torch.manual_seed(batch + context)
    cache = torch.randn(2, batch * per_seq + 8, block_size, kv_heads, head_dim).to(dtype)
    q = torch.randn(batch, heads, head_dim).to(dtype)
    return q, cache, tables, lens


def measure(batch: int, context: int, args, dtype: torch.dtype) -> dict:
    q, cache, tables, lens = make_batch(batch, context, args.heads, args.kv_heads,
                                        args.head_dim, args.block_size, dtype)
    starts = list(range(batch + 1))
    blocks = cache.shape[1]
    scale = args.head_dim ** -0.5
    native = make_cpu_plan(starts, lens, tables, args.block_size, blocks, native=True)
    out = torch.empty_like(q)
    # --layers: one cache per layer, as the engine has, so the K/V come from memory
    layer_caches = [cache] + [cache.clone() for _ in range(args.layers - 1)]

    def c_call():
        for layer_cache in layer_caches:
            paged_decode(q, out, layer_cache, native.decode_q_rows, native.decode_tables,
                         native.decode_seq_lens, scale)

    kv_bytes = 2 * sum(lens) * args.kv_heads * args.head_dim * cache.element_size()
    row = {"batch": batch, "context": context, "c_ms": best_ms(c_call) / args.layers}
    row["c_gbs"] = kv_bytes / row["c_ms"] / 1e6
    if not args.skip_torch:
        plain = make_cpu_plan(starts, lens, tables, args.block_size, blocks, native=False)
        row["torch_ms"] = best_ms(lambda: paged_attention_cpu(q, cache, plain, scale))
        row["torch_gbs"] = kv_bytes / row["torch_ms"] / 1e6
        row["ratio"] = row["torch_ms"] / row["c_ms"]
        # the two paths agree (a benchmark of a wrong kernel measures nothing)
        c_call()
        want = paged_attention_cpu(q, cache, plain, scale)
        row["max_diff"] = (out.float() - want.float()).abs().max().item()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int_list, default="1,8,32,64")
    ap.add_argument("--contexts", type=int_list, default="256,1024")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    add_threads(ap)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with this thread's CPU clock (needs --threads 1): steadier "
                         "than the wall clock on a machine shared with other work")
    ap.add_argument("--skip-torch", action="store_true", help="time the C kernel only")
    ap.add_argument("--layers", type=int, default=1,
                    help="time the C kernel over this many layers' caches (30: past the L3, "
                         "as in the engine) and report per layer")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    apply_threads(args)
    if args.cpu_time:
        if torch.get_num_threads() != 1:
            ap.error("--cpu-time counts this thread only: add --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    if cpu_library() is None:
        print("the C kernel did not build on this machine")
        return 1
    dtype = DTYPES[args.dtype]
    if args.layers < 1:
        ap.error("--layers must be at least 1")
    print(f"decode attention, one layer of {args.layers}: {args.heads} heads / "
          f"{args.kv_heads} KV heads x {args.head_dim}, {args.dtype}, blocks of {args.block_size}, "
          f"{torch.get_num_threads()} threads; ratio = torch / C (> 1: C faster)")
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            row = measure(batch, context, args, dtype)
            rows.append(row)
            line = (f"  batch {batch:3d} context {context:5d}: C {row['c_ms']:7.3f} ms "
                    f"{row['c_gbs']:6.1f} GB/s")
            if "torch_ms" in row:
                line += (f"   torch {row['torch_ms']:7.3f} ms {row['torch_gbs']:6.1f} GB/s"
                         f"   ratio {row['ratio']:5.2f}   max diff {row['max_diff']:.1e}")
            print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "dtype": args.dtype, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
