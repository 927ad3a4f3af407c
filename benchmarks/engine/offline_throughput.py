"""Offline throughput: llmserve versus transformers generate() in static batches.

Both run N requests with output lengths uniform in [lo, hi] (ignore_eos), on the
same model, in the same process, one after the other; throughput counts only the
tokens each request asked for. Prints tokens/s of each and the ratio, and where
llmserve's step time goes.

    python benchmarks/engine/offline_throughput.py --num-requests 64 --min-out 20 --max-out 300 \
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.offline_engine import make_llm, make_workload, run_llmserve
from llmserve.platforms.cpu import auto_dtype


def load_transformers(path: str, dtype: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, like the llmserve run
    model.generation_config.pad_token_id = 0
    return model


def run_transformers(model, prompts, outs, batch_size: int, dtype: str) -> dict:
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch, lens = prompts[start:start + batch_size], outs[start:start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                           min_new_tokens=max(lens), do_sample=False)
    wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(outs) / wall, "wall_s": wall, "dtype": dtype}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-out", type=int, default=20)
    ap.add_argument("--max-out", type=int, default=300)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--dtype", default="auto",
                    help="both sides; auto = the engine's choice for this CPU (its fastest)")
    ap.add_argument("--quantization", default="none",
                    help="llmserve only: none|int8|int4|auto (auto: the engine's choice; on a "
                         "CPU without bf16 arithmetic, int4 in bf16 storage)")
    ap.add_argument("--compile", action="store_true", help="llmserve only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate the two sides this many times; the median ratio counts")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    def workload(r: int):  # new prompts each round: none is in the prefix cache
        return make_workload(args.num_requests, args.min_out, args.max_out,
                             args.min_prompt, args.max_prompt, args.seed + r)

    llm = make_llm(args.model, args.max_num_seqs, args.dtype,
                   {"quantization": args.quantization, "compile": args.compile})
    # transformers in the CPU's own choice (float32 without bf16 arithmetic), also where
    # the engine stores an int4 model in bf16 there
    hf_dtype = auto_dtype("cpu") if args.dtype == "auto" else llm.engine.config.dtype
    hf_model = None
    rounds = []
    for r in range(args.rounds):  # alternating sides: a noisy neighbour hits both
        prompts, outs = workload(r)
        ours = run_llmserve(llm, prompts, outs)
        print(f"\nround {r + 1}: llmserve {ours['tokens_per_s']:8.1f} tokens/s  "
              f"({ours['wall_s']:.1f} s, {ours['steps']} steps, {ours['dtype']})")
        total = ours["wall_s"]
        for part in ("schedule_s", "forward_s", "postprocess_s", "other_s"):
            print(f"  {part[:-2]:<12} {ours[part]:7.2f} s  {100 * ours[part] / total:5.1f} %")
        result = {"llmserve": ours}
        if not args.skip_transformers:
            if hf_model is None:
                hf_model = load_transformers(ours["model_path"], hf_dtype)
            hf = run_transformers(hf_model, prompts, outs, args.hf_batch_size, hf_dtype)
            result.update(transformers=hf, ratio=ours["tokens_per_s"] / hf["tokens_per_s"])
            print(f"round {r + 1}: transformers {hf['tokens_per_s']:8.1f} tokens/s  "
                  f"({hf['wall_s']:.1f} s, static batches of {args.hf_batch_size}, "
                  f"{hf['dtype']}): ratio {result['ratio']:.2f}x", flush=True)
        rounds.append(result)
    summary = {"rounds": rounds, "args": vars(args)}
    if not args.skip_transformers:
        ratios = sorted(r["ratio"] for r in rounds)
        summary["median_ratio"] = statistics.median(ratios)
        print(f"ratio llmserve / transformers: median {summary['median_ratio']:.2f}x "
              f"over {len(ratios)} rounds ({', '.join(f'{x:.2f}' for x in ratios)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
