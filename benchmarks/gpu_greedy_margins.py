"""Where a GPU fast-path configuration's greedy tokens leave eager steps': a near-tie
(rounding) or a real difference (a bug)?

``gpu_fast_path.py`` reports greedy agreement with eager steps and the first differing
position. On a random-weight model the logits are nearly flat, so a different order of
float32 sums (CUDA graphs fix a bucket's split-KV count where the eager path picks it per
step) can flip an argmax without anything being wrong. This script asks for the top 2
log-probabilities of every generated token and, for each sequence that differs, prints
the eager path's margin between its top two tokens at the first differing position, against
the largest difference the two configurations show in the log-probability of the same
token before it (their rounding noise). A difference at a margin within that noise is a
tie broken the other way; one far outside it is a bug.

    python benchmarks/gpu_greedy_margins.py --model DIR --configs default all
    python benchmarks/gpu_greedy_margins.py --smoke   # CPU, tiny model: the script runs
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu_smoke import write_checkpoint  # noqa: E402
from gpu_fast_path import BASELINE, CONFIGS, build  # noqa: E402
from random_llama import release_device_memory  # noqa: E402


def generate(engine, prompts, max_tokens: int) -> list[list[tuple[int, float, float]]]:
    """Greedy tokens of each prompt with (token, its logprob, top-1 minus top-2 logprob)."""
    from llmserve import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    out = []
    for r in reqs:
        seq = r.sequences[0]
        out.append([(tok, lp.logprob, lp.top[0][1] - lp.top[1][1])
                    for tok, lp in zip(seq.output_token_ids, seq.logprobs)])
    return out


def compare(base: list, other: list) -> dict:
    """Per differing sequence: where, the base's top-2 margin there, and the largest
    |logprob difference| of the same tokens before it (the two paths' rounding noise)."""
    diffs, noise = [], 0.0
    for a, b in zip(base, other):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), None)
        stop = len(a) if first is None else first
        noise = max([noise] + [abs(x[1] - y[1]) for x, y in zip(a[:stop], b[:stop])])
        if first is not None:
            diffs.append({"at": first, "base_margin": a[first][2],
                          "other_margin": b[first][2]})
    worst = max((d["base_margin"] for d in diffs), default=0.0)
    return {"sequences": len(base), "differing": len(diffs), "differences": diffs,
            "noise_before": noise, "largest_margin_crossed": worst,
            "all_within_noise": worst <= 2 * noise}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, fp32")
    ap.add_argument("--model", help="a checkpoint directory (default: write a random one)")
    ap.add_argument("--configs", nargs="+", default=["default", "all"],
                    choices=[c for c in CONFIGS if c != BASELINE])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/gpu_greedy_margins.json")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(8, 600))] for _ in range(16)]
    tokens = args.tokens
    if args.smoke:
        prompts, tokens = [p[:12] for p in prompts[:2]], 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else write_checkpoint(Path(tmp) / "model",
                                                                    args.smoke)
        generated = {}
        for name in [BASELINE] + args.configs:
            engine, _ = build(path, CONFIGS[name], args.smoke, len(prompts))
            generated[name] = generate(engine, prompts, tokens)
            engine = None
            release_device_memory()
            if name != BASELINE:
                results[name] = compare(generated[BASELINE], generated[name])
                print(name, json.dumps(results[name]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
