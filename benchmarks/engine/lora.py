"""Multi-LoRA throughput: 32 streams spread over 8 adapters vs 32 streams on the base
model, same engine, same run, alternating rounds; plus adapter load time and memory.

The built-in model in its default serving mode (int4 in bf16 on CPUs that have bf16),
with ``--enable-lora --max-loras 8``. The adapters are random PEFT-format adapters of
rank ``--rank`` on every projection (q/k/v/o, gate/up/down), written with safetensors.
Each round runs the 32 streams once on the base model and once with stream ``i`` under
adapter ``i % 8``; the ratio is LoRA tokens/s over base tokens/s, median over rounds.

    python benchmarks/engine/lora.py [--rounds 3] [--streams 32] [--adapters 8] [--rank 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.lora_adapter import write_adapter
from llmserve import LLM, SamplingParams

PROMPT = ("Write a detailed paragraph about the history of paged memory in operating "
          "systems and how it inspired the paged KV cache of LLM serving engines.")


def run(llm: LLM, loras: list, max_tokens: int) -> float:
    """Tokens per second of one batch of len(loras) streams."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([PROMPT] * len(loras), params, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    llm = LLM("smollm2-135m-instruct", enable_lora=True, max_loras=args.adapters,
              max_lora_rank=max(args.rank, 8), max_num_seqs=args.streams)
    engine = llm.engine
    print(f"model: built-in, {engine.config.dtype}, quantization {engine.config.quantization}; "
          f"{args.streams} streams x {args.max_tokens} tokens; {args.adapters} adapters of "
          f"rank {args.rank} on every projection")
    with tempfile.TemporaryDirectory() as tmp:
        loads, sizes, loras = [], [], []
        for i in range(args.adapters):
            path = write_adapter(Path(tmp) / f"a{i}", engine.hf_config, args.rank, seed=i)
            start = time.perf_counter()
            parsed = engine.loras.parse(str(path))
            lora, _ = engine.loras.register(f"a{i}", str(path), parsed)
            adapter = parsed[0]
            loads.append(time.perf_counter() - start)
            sizes.append(adapter.nbytes)
            loras.append(lora)
        per_stream = [loras[i % args.adapters] for i in range(args.streams)]
        run(llm, [None] * 4, 8)  # warm-up, both paths
        run(llm, per_stream[:4], 8)
        base, lora_tps = [], []
        for r in range(args.rounds):
            base.append(run(llm, [None] * args.streams, args.max_tokens))
            lora_tps.append(run(llm, per_stream, args.max_tokens))
            print(f"round {r + 1}: base {base[-1]:.1f} tok/s, {args.adapters} adapters "
                  f"{lora_tps[-1]:.1f} tok/s, ratio {lora_tps[-1] / base[-1]:.2f}")
    slot_bytes = sum(lin.a.nbytes + sum(b.nbytes for b in lin.b)
                     for lin in engine.runner.lora.layers.values())
    ratio = statistics.median(lo / b for lo, b in zip(lora_tps, base))
    print(f"\nthroughput ratio ({args.adapters} adapters / base), median of "
          f"{args.rounds}: {ratio:.2f}  (target >= 0.7)")
    print(f"adapter load (read + check + register): median {statistics.median(loads) * 1e3:.0f} "
          f"ms, max {max(loads) * 1e3:.0f} ms")
    print(f"memory per adapter: {statistics.median(sizes) / 2**20:.1f} MiB in host memory "
          f"(float32, parsed); device slots: {slot_bytes / 2**20:.1f} MiB for "
          f"{engine.config.max_loras} slots at max rank {engine.config.max_lora_rank} "
          f"({slot_bytes / engine.config.max_loras / 2**20:.1f} MiB per slot)")
    llm.shutdown()


if __name__ == "__main__":
    main()
