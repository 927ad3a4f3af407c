"""Why ``llmserve serve`` runs the 32-stream workload slower than the engine in-process:
CPU time that other threads take is lost twice over.

The engine's products split their work over one OpenMP thread per core, in lockstep:
whatever else takes a core (the server's HTTP thread, the benchmark's client, the
host's daemons) stops one of them, and the other then waits for it at the product's
barrier. This runs ``vs_llamacpp.py``'s 32-stream workload (the same prompts, tokenized
as the server does, and output lengths) in-process, alternately alone and beside a
process that takes ``--steal`` of one core in 10 ms periods (about what the server's
HTTP thread, the client and the host take together), and prints the throughput
of each, the loss, and the loss per share of the machine's CPU time taken.

    python benchmarks/serving/server_gap.py [--steal 0.06] [--rounds 2]
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python benchmarks/serving/server_gap.py       # as an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.offline_engine import make_llm, run_llmserve
from benchmarks.lib.word_prompts import workloads

STEALER = """
import sys, time
busy = float(sys.argv[1]) * 0.01
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(0.01 - busy)
"""


def workload(llm) -> tuple[list[list[int]], list[int]]:
    requests = workloads(False, 0)["32 streams"]["requests"]
    prompts = [llm.engine.tokenizer.encode(text)  # as the server does
               for text, _ in requests]
    return prompts, [max_tokens for _, max_tokens in requests]


def run(llm, prompts, outs, steal: float) -> float:
    stealer = subprocess.Popen([sys.executable, "-c", STEALER, str(steal)]) if steal else None
    try:
        time.sleep(0.2 if stealer else 0)
        return run_llmserve(llm, prompts, outs)["tokens_per_s"]
    finally:
        if stealer is not None:
            stealer.kill()
            stealer.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steal", type=float, default=0.06, help="share of one core taken")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    # no prefix caching: every run sends the same prompts
    llm = make_llm(args.model, 32, "auto", {"quantization": "auto", "compile": False,
                                            "enable_prefix_caching": False})
    prompts, outs = workload(llm)
    alone, beside = [], []
    for r in range(args.rounds):
        alone.append(run(llm, prompts, outs, 0.0))
        beside.append(run(llm, prompts, outs, args.steal))
        print(f"round {r + 1}: alone {alone[-1]:.1f} tokens/s, beside the stealer "
              f"{beside[-1]:.1f}", flush=True)
    a, b = statistics.median(alone), statistics.median(beside)
    taken = args.steal / (os.cpu_count() or 1)
    print(f"{sum(map(len, prompts))} prompt tokens, {sum(outs)} out; medians: alone {a:.1f}, "
          f"beside {b:.1f} tokens/s: {100 * (1 - b / a):.1f} % lost for {100 * taken:.1f} % "
          f"of the machine's CPU time taken ({(1 - b / a) / taken:.2f}x)")


if __name__ == "__main__":
    main()
