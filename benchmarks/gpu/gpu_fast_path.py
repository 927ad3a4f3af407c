"""The GPU fast-path flags, each against eager steps, on a GPU in bf16: greedy
agreement, decode step time by batch size, host syncs in the model runner, KV blocks and
start-up time.

Configurations: ``eager`` (``--no-cuda-graphs``, the default before CUDA graphs were
turned on), ``default`` (CUDA graphs), then, each with the graphs: ``staging_tables``
(``--pinned-staging --device-block-tables``), ``async`` (``--async-scheduling``),
``fused`` (``--fused-kernels``) and ``all`` (every flag, ``--profile-kv-cache`` too).
The model is the random Llama-shaped checkpoint of
``engine_gpu_smoke.py`` (about 1B parameters, 32/8 heads of 64), or the directory
``--model`` names (``gpu_check.sh`` passes a SmolLM2-135M-shaped one: the host's
per-step work, which these flags cut, matters most on small models).

Greedy tokens of ``staging_tables`` must equal ``default``'s exactly (same kernels,
same graphs, same inputs). With CUDA graphs a bucket's split-KV count is fixed for ``max_model_len``
where the eager path chooses it from the step, which changes the order of the fp32
sums; on a random model's near-ties that can flip a bf16 argmax, so agreement is
reported with the first differing position rather than asserted.

    python benchmarks/gpu/gpu_fast_path.py --out results/gpu_fast_path.json
    python benchmarks/gpu/gpu_fast_path.py --smoke   # CPU, tiny model: the script runs (no speed)

``--smoke`` runs on CPU under Triton's interpreter, where the flags are refused: it
attaches the same pieces to the runner directly (graphs without capture), as the
tests do.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # --smoke: the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.args import add_checkpoint
from benchmarks.lib.decode_step import decode_step_ms
from benchmarks.lib.device_memory import release_device_memory
from benchmarks.lib.fast_path_configs import BASELINE, CONFIGS, build
from benchmarks.lib.greedy_agreement import greedy
from benchmarks.lib.paths import RESULTS
from benchmarks.lib.random_checkpoints import model_shape, write_checkpoint

HBM_BYTES_PER_S = 4.8e12  # H200


def step_bytes(engine, batch: int, context: int) -> int:
    """Bytes a decode step must read from memory at least: every weight once, and each
    sequence's K and V over its context."""
    runner = engine.runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return weights + batch * context * runner.kv_bytes_per_block() // runner.block_size


def forward_host_syncs(engine, batch: int = 4, steps: int = 4) -> dict:
    """Host syncs inside the model runner (not the sampler, whose sampled tokens are the
    one sync a step needs) during a few decode steps, with CUDA's sync debug mode set to
    warn: the count per step and the first few warnings."""
    import warnings
    real_run, found = engine.runner.run, {"runner_calls": 0, "syncs": 0, "first": []}

    def run(b, *pending):
        found["runner_calls"] += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return real_run(b, *pending)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                syncs = [str(w.message)[:300] for w in caught if "synchroniz" in str(w.message)]
                found["syncs"] += len(syncs)
                found["first"] = (found["first"] + syncs)[:3]

    engine.runner.run = run
    try:
        decode_step_ms(engine, batch, steps)
    finally:
        del engine.runner.run
    return found


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None)
             for s, t in zip(a, b)]
    return {"identical": a == b, "identical_sequences": sum(s == t for s, t in zip(a, b)),
            "sequences": len(a), "first_difference_at": first}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    add_checkpoint(ap)
    ap.add_argument("--out", default=str(RESULTS / "gpu_fast_path.json"))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--context", type=int, default=2048,
                    help="prompt tokens of each decoding sequence (GPU)")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --smoke to exercise the script)")
        return 0
    batches = (1, 3) if args.smoke else (1, 32, 128)
    steps = 1 if args.smoke else 20
    prompt_len = 16 if args.smoke else args.context
    results: dict = {"device": torch.cuda.get_device_name() if not args.smoke else "cpu",
                     "configs": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else write_checkpoint(Path(tmp) / "model",
                                                                    args.smoke)
        results["model"] = model_shape(path)
        rng = random.Random(0)
        # The smoke's Triton runs in the interpreter (~1 s a step): each path once, in
        # as few steps as cover it (one batch of prompts, two tokens: a prefill and a decode).
        longest, count = (24, max(batches)) if args.smoke else (600, 8)
        prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(8, longest))]
                   for _ in range(count)]
        tokens = {}
        for name in args.configs:
            res = results["configs"][name] = {"flags": CONFIGS[name]}
            engine = None
            try:
                engine, startup = build(path, CONFIGS[name], args.smoke, max(batches))
                res.update(startup)
                tokens[name] = greedy(engine, prompts, 2 if args.smoke else 32)
                res["decode_step_ms"] = {str(b): decode_step_ms(engine, b, steps, prompt_len)
                                         for b in batches}
                res["hbm_fraction"] = {  # of the H200's 4.8 TB/s, at the least bytes read
                    b: step_bytes(engine, int(b), prompt_len) / (ms / 1000) / HBM_BYTES_PER_S
                    for b, ms in res["decode_step_ms"].items()}
                if not args.smoke:
                    try:
                        res["runner_host_syncs"] = forward_host_syncs(engine)
                    except Exception as e:  # noqa: BLE001 - a diagnostic, not a result
                        res["runner_host_syncs"] = {"error": repr(e)}
            except Exception as e:  # noqa: BLE001 - record and go on with the next
                res["error"] = repr(e)
                failed = True
            finally:  # the next engine needs this one's KV pool and graphs freed
                engine = None
                release_device_memory()
            if BASELINE in tokens and name in tokens and name != BASELINE:
                res["greedy_vs_eager"] = agreement(tokens[BASELINE], tokens[name])
                base = results["configs"][BASELINE].get("decode_step_ms", {})
                res["speedup_vs_eager"] = {b: base[b] / ms for b, ms in
                                           res.get("decode_step_ms", {}).items() if b in base}
            out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    both = {"staging_tables", "default"} <= set(tokens)
    if both and tokens["staging_tables"] != tokens["default"]:
        print("staging_tables changed the default's greedy tokens: a bug, not rounding")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
