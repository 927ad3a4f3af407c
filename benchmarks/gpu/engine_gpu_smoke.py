"""The engine end to end on a GPU: start-up (load + warm-up), greedy agreement of the
Triton and torch attention backends in bf16, and decode throughput by batch size.

The model is a random-weight checkpoint (``lib/random_checkpoints.py``; the GPU machine
has no hub access), by default Llama-3.2-1B's shape (32 query heads, 8 KV heads of 64),
or the directory ``--model`` names (``gpu_check.sh`` writes one and passes it to every
step).
With random weights greedy tokens are near-ties more often than with a trained model,
so the backends' agreement is reported, not asserted. Each engine is released (gc and
the allocator's cache emptied) before the next is built: the next one sizes its KV
cache from the device's free memory. ``engines_alive_after_release`` in the results
says how many engines were still alive after each release (0 each time, or the next
engine was sized with an earlier one's memory still held).

    python benchmarks/gpu/engine_gpu_smoke.py --out results/engine_gpu.json
    python benchmarks/gpu/engine_gpu_smoke.py --smoke   # CPU, tiny model, fp32: the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

if not torch.cuda.is_available():  # --smoke: the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.args import add_checkpoint
from benchmarks.lib.device_memory import release_device_memory
from benchmarks.lib.greedy_agreement import greedy
from benchmarks.lib.paths import RESULTS
from benchmarks.lib.random_checkpoints import model_shape, write_checkpoint

BUILT: list[weakref.ref] = []  # every engine built, to check none outlives its release


def build(path: Path, backend: str, dtype: str, device: str):
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(path), device=device, dtype=dtype,
                                    attention_backend=backend,
                                    kv_cache_memory=None if device == "cuda" else 64 << 20,
                                    # the smoke's interpreter: fewer split-KV variants to
                                    # warm up (the prompts are at most 40 tokens)
                                    max_model_len=None if device == "cuda" else 256))
    t1 = time.perf_counter()
    engine.warm_up()
    BUILT.append(weakref.ref(engine))
    return engine, {"load_s": t1 - t0, "warm_up_s": time.perf_counter() - t1}


def decode_throughput(engine, batch: int, prompt_len: int, max_tokens: int) -> float:
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 32000) for _ in range(prompt_len)] for _ in range(batch)]
    greedy(engine, prompts[:1], 2)  # nothing cold
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = greedy(engine, prompts, max_tokens)
    return sum(map(len, outs)) / (time.perf_counter() - t0)


def measure_backend(path: Path, backend: str, prompts, smoke: bool, results: dict):
    """Start an engine on ``backend``, its greedy tokens for ``prompts`` and (Triton)
    decode throughput; the engine is unreachable once this returns or raises."""
    device, dtype = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
    engine, startup = build(path, backend, dtype, device)
    results[f"{backend}_startup"] = startup
    try:
        tokens = greedy(engine, prompts, 4 if smoke else 32)
        if backend == "triton":
            results["decode_tokens_per_s"] = {
                str(b): decode_throughput(engine, b, 16 if smoke else 128, 2 if smoke else 64)
                for b in ((1, 4) if smoke else (1, 32, 128))}
        return tokens
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    add_checkpoint(ap)
    ap.add_argument("--out", default=str(RESULTS / "engine_gpu.json"))
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --smoke to exercise the script)")
        return 0
    results: dict = {"device": "cpu" if args.smoke else torch.cuda.get_device_name()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(results, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else write_checkpoint(Path(tmp) / "model",
                                                                    args.smoke)
        results["model"] = model_shape(path)
        rng = random.Random(0)
        # The smoke's Triton runs in the interpreter (~1 s a step): each path once, in
        # as few steps as cover it.
        longest, count = (24, 4) if args.smoke else (600, 8)
        prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(8, longest))]
                   for _ in range(count)]
        tokens = {}
        for backend in ("triton", "torch"):
            try:
                tokens[backend] = measure_backend(path, backend, prompts, args.smoke, results)
            except Exception as e:  # noqa: BLE001 - record and go on
                results[f"{backend}_error"] = repr(e)
            finally:  # before the next engine sizes its KV cache from the free memory
                release_device_memory()
                # 0 each time, or the next engine was sized with this one still held
                results.setdefault("engines_alive_after_release", []).append(
                    sum(ref() is not None for ref in BUILT))
            save()
        if len(tokens) == 2:
            a, b = tokens["triton"], tokens["torch"]
            first_diff = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s))
                          for s, t in zip(a, b)]
            results["backend_agreement"] = {"identical_sequences": sum(s == t for s, t in
                                                                       zip(a, b)),
                                            "sequences": len(a),
                                            "first_difference_at": first_diff}
        save()
    print(json.dumps(results, indent=2))
    return 0 if "triton_error" not in results and "torch_error" not in results else 1


if __name__ == "__main__":
    raise SystemExit(main())
