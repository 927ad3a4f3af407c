"""Tensor parallelism: step time, decode throughput and per-rank memory, TP=1 vs TP=N.

Each size runs in this process one after the other (one tensor-parallel engine at a
time), on the same model and the same prompts: a prefill of ``--batch`` prompts, then
``--decode-steps`` timed decode steps of the whole batch (median step time; decode
throughput = batch / median step). Prints a table with each size's ratio to the first
and, on CUDA, each GPU's memory in use, the weights and the KV cache of a rank.

On a CPU the ranks share the machine's cores (each gets cores / N threads): nothing is
gained, and the ratio shows what the per-layer all-reduces (2 per layer + 1 for the
embedding, over gloo) and the step broadcast cost. On GPUs (NCCL) it is the real
thing. ``--random-llama`` writes (once) a random checkpoint of the built-in model's size
(30 layers, hidden 576, MLP 1536) but with 8 query / 4 KV heads, which split in two:
the built-in model's 9/3 heads split only in three, more ranks than a 2-core machine
has cores.

    python benchmarks/engine/tensor_parallel.py --random-llama  # CPU, TP 1 vs 2 (see below)
    python benchmarks/engine/tensor_parallel.py --tp 1 3        # the built-in model, 1 vs 3 ranks
    python benchmarks/engine/tensor_parallel.py --device cuda \\
        --model hf://Qwen/Qwen2.5-7B-Instruct --tp 1 2 --batch 1 32 \\
        --json tp.json                                          # a lent multi-GPU machine
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch

from llmserve import LLM, SamplingParams


def random_llama(out: str) -> str:
    """A random Llama of the built-in model's size with heads that split in 2 and 4."""
    from pathlib import Path
    if (Path(out) / "config.json").is_file():
        return out
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from llmserve.model_executor.model_loader.sources import resolve_model
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(out)
    builtin = resolve_model("smollm2-135m-instruct")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin / name, Path(out) / name)
    return out


def _allreduce_rank(rank: int, size: int, port: int, numel: int, iters: int, result) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    x = torch.ones(numel)
    for _ in range(10):
        dist.all_reduce(x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if rank == 0:
        result.put((time.perf_counter() - t0) / iters)
    dist.destroy_process_group()


def allreduce_latency_us(size: int, numel: int, iters: int = 300) -> float:
    """One gloo all-reduce of ``numel`` fp32 over ``size`` local processes (the per-layer
    communication of a CPU step; a step does 2 per layer + 1)."""
    from llmserve.utils import free_port
    ctx = torch.multiprocessing.get_context("spawn")
    result, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, size, port, numel, iters, result))
             for r in range(size)]
    for proc in procs:
        proc.start()
    latency = result.get(timeout=300)
    for proc in procs:
        proc.join()
    return latency * 1e6


def measure(model: str, tp: int, args) -> dict:
    engine_args = dict(device=args.device, tensor_parallel_size=tp,
                       max_num_batched_tokens=max(args.prompt_len * max(args.batch), 64),
                       max_num_seqs=max(args.batch), enable_prefix_caching=False)
    if args.dtype:
        engine_args["dtype"] = args.dtype
    if args.device == "cpu":
        engine_args["kv_cache_memory"] = args.kv_cache_mib << 20
        if args.threads_per_rank:
            engine_args["num_threads"] = args.threads_per_rank * tp
    t0 = time.perf_counter()
    llm = LLM(model, **engine_args)
    load_s = time.perf_counter() - t0
    engine = llm.engine
    try:
        llm.generate([[5] * 16], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
        out = {"tp": tp, "device": args.device, "dtype": engine.config.dtype,
               "threads_per_rank": max(1, engine.config.num_threads // tp),
               "load_s": round(load_s, 1), "kv_blocks": engine.runner.num_blocks}
        rng = random.Random(0)
        for bs in args.batch:
            prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)]
                       for _ in range(bs)]
            reqs = [engine.add_request(p, SamplingParams(temperature=0, ignore_eos=True,
                                                         max_tokens=args.decode_steps + 8))
                    for p in prompts]
            t0 = time.perf_counter()
            while any(r.sequences[0].num_output_tokens == 0 for r in reqs):
                engine.step()
            prefill_s = time.perf_counter() - t0
            times = []
            for _ in range(args.decode_steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            for r in reqs:
                engine.abort(r.request_id)
            step = statistics.median(times)
            out[f"bs{bs}"] = {"prefill_s": round(prefill_s, 4), "decode_step_ms":
                              round(step * 1e3, 2), "decode_tok_s": round(bs / step, 1)}
        if args.device.startswith("cuda"):
            params = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
            out["rank0_weights_gib"] = round(params / 2**30, 3)
            out["rank0_kv_gib"] = round(engine.runner.kv_cache.storage.nbytes / 2**30, 3)
            out["gpu_used_gib"] = [round((t - f) / 2**30, 2) for f, t in
                                   (torch.cuda.mem_get_info(i) for i in range(tp))]
        return out
    finally:
        llm.shutdown()
        del llm, engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="default: the engine's auto choice")
    p.add_argument("--random-llama", nargs="?", const="/tmp/llmserve-bench-random-llama",
                   default=None, metavar="DIR",
                   help="use (writing it once) a random Llama of the built-in model's size "
                        "with 8/4 heads, instead of --model")
    p.add_argument("--tp", type=int, nargs="+", default=None,
                   help="sizes to compare (default 1 2; 1 3 for the built-in model, whose "
                        "9/3 heads do not split in two)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--kv-cache-mib", type=int, default=256, help="CPU: KV bytes per rank")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="CPU: torch threads of each rank (default: the cores / N); 1 keeps "
                        "OpenMP out of the comparison on a busy machine")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    model = random_llama(args.random_llama) if args.random_llama else args.model
    if args.tp is None:
        args.tp = [1, 3] if model == "smollm2-135m-instruct" else [1, 2]
    results = []
    for tp in args.tp:
        r = measure(model, tp, args)
        print(json.dumps(r), flush=True)
        results.append(r)
    base = results[0]
    vs = f"vs TP {base['tp']}"
    print(f"\n{'TP':>3} {'batch':>5} {'decode step ms':>15} {'tok/s':>8} {vs:>9}"
          f" {'prefill s':>10} {'KV blocks':>10}")
    for r in results:
        for bs in args.batch:
            m, b = r[f"bs{bs}"], base[f"bs{bs}"]
            print(f"{r['tp']:>3} {bs:>5} {m['decode_step_ms']:>15.2f} {m['decode_tok_s']:>8.1f} "
                  f"{m['decode_step_ms'] / b['decode_step_ms']:>8.2f}x {m['prefill_s']:>10.3f} "
                  f"{r['kv_blocks']:>10}")
        if "gpu_used_gib" in r:
            print(f"    TP {r['tp']}: GPU memory in use {r['gpu_used_gib']} GiB; rank 0 weights "
                  f"{r['rank0_weights_gib']} GiB, KV cache {r['rank0_kv_gib']} GiB")
    comm = {}
    if args.device == "cpu":
        from llmserve.model_executor.model_loader.sources import load_config, resolve_model
        c = load_config(resolve_model(model))
        per_step = 2 * c.num_hidden_layers + 1
        for tp in [t for t in args.tp if t > 1]:
            for bs in args.batch:
                us = allreduce_latency_us(tp, bs * c.hidden_size)
                comm[f"tp{tp}_bs{bs}"] = {"allreduce_us": round(us, 1),
                                          "per_step_ms": round(us * per_step / 1e3, 2)}
                print(f"gloo all-reduce of [{bs}, {c.hidden_size}] fp32 on {tp} ranks: "
                      f"{us:.0f} us; x{per_step} per decode step = {us * per_step / 1e3:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "allreduce": comm}, f,
                      indent=2)


if __name__ == "__main__":
    main()
