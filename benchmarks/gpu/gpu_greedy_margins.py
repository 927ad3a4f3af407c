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

    python benchmarks/gpu/gpu_greedy_margins.py --model DIR --configs default all
    python benchmarks/gpu/gpu_greedy_margins.py --smoke   # CPU, tiny model: the script runs
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.args import add_checkpoint
from benchmarks.lib.device_memory import release_device_memory
from benchmarks.lib.fast_path_configs import BASELINE, CONFIGS, build
from benchmarks.lib.greedy_agreement import compare, greedy_with_margins
from benchmarks.lib.paths import RESULTS
from benchmarks.lib.random_checkpoints import write_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint(ap)
    ap.add_argument("--configs", nargs="+", default=["default", "all"],
                    choices=[c for c in CONFIGS if c != BASELINE])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "gpu_greedy_margins.json"))
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
            generated[name] = greedy_with_margins(engine, prompts, tokens)
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
