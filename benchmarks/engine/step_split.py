"""Where a CPU workload's engine time goes, step by step: the forward passes split by
path (the C decoder stack or op by op) and by size, and the LM head apart.

The workload is ``vs_llamacpp.py``'s 32-stream one in-process (64 requests, at most 32
running, prompts of 70-210 random tokens, 20-300 tokens out, ``ignore_eos``), through
``offline_throughput.py``'s functions (``lib/offline_engine.py``), so the HTTP server is
left out. Prints the output tokens/s and, per (path, rows) class, steps, seconds, rows
and ms a step. Run it under ``perf record`` for the kernels' split.

    python benchmarks/engine/step_split.py
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python benchmarks/engine/step_split.py        # as an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.offline_engine import make_llm, make_workload, run_llmserve

SIZES = ((32, "1-32"), (128, "33-128"), (512, "129-512"))


def size_class(rows: int) -> str:
    return next((name for top, name in SIZES if rows <= top), ">512")


def instrument(llm) -> dict:
    """Wrap the runner's forward and the LM head to sum their time per class."""
    runner, model = llm.engine.runner, llm.engine.runner.model
    native = model.model.native_decoder
    totals = collections.defaultdict(lambda: [0, 0.0, 0])  # class -> steps, s, rows
    took_c = {"last": False}

    def record(key, seconds, rows):
        entry = totals[key]
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + seconds, entry[2] + rows

    if native is not None:
        applies = native.applies

        def noting_applies(num_tokens, meta):
            took_c["last"] = applies(num_tokens, meta)
            return took_c["last"]
        native.applies = noting_applies
    forward, logits = runner.forward, model.compute_logits

    def timed_forward(ids, pos, meta):
        took_c["last"] = False
        start = time.perf_counter()
        hidden = forward(ids, pos, meta)
        path = "C stack" if took_c["last"] else "op by op"
        record((path, size_class(ids.shape[0])), time.perf_counter() - start, ids.shape[0])
        return hidden

    def timed_logits(hidden):
        start = time.perf_counter()
        out = logits(hidden)
        record(("LM head", "sampled rows"), time.perf_counter() - start, hidden.shape[0])
        return out
    runner.forward, model.compute_logits = timed_forward, timed_logits
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=100)
    args = ap.parse_args()
    llm = make_llm(args.model, args.max_num_seqs, "auto",
                   {"quantization": args.quantization, "compile": False})
    totals = instrument(llm)
    prompts, outs = make_workload(64, 20, 300, 70, 210, args.seed)
    result = run_llmserve(llm, prompts, outs)
    print(f"{llm.engine.config.quantization}, {llm.engine.config.dtype}: "
          f"{result['tokens_per_s']:.1f} output tokens/s, {result['wall_s']:.2f} s, "
          f"{result['steps']} steps")
    print("| path | rows | steps | seconds | rows in all | ms a step |")
    print("|---|---|---|---|---|---|")
    for (path, rows), (steps, seconds, count) in sorted(totals.items(),
                                                         key=lambda kv: -kv[1][1]):
        print(f"| {path} | {rows} | {steps} | {seconds:.2f} | {count} | "
              f"{1e3 * seconds / steps:.1f} |")


if __name__ == "__main__":
    main()
