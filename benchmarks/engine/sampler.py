"""The sampler's decode step against the path it replaced, both measured in the same
run (machines here are noisy and shared: compare ratios, not absolute times).

New: top-k/top-p over a topk of CANDIDATES tokens (a full sort only for rows whose kept
set may reach past them), seeded rows drawn by a counter-based hash on the logits'
device. Reference: one sort of the whole vocabulary per row (the copy kept in
tests/model_executor/test_sampler_filters.py), a race over every token, seeded rows drawn from a CPU
torch.Generator row by row and copied over.

Cases per (batch, vocab), rows alternating top_p=0.9 and top_k=50 on LM-like logits
(Gaussian, sd 5: top_p's set is ~15 tokens): ``filters`` unseeded, ``seeded`` every
row seeded, ``flat`` every row top_p=0.9 on near-uniform logits (each takes the sort
fallback: the ratio shows what the candidate pass costs when it does not help).
Printed: ms per sampler call (best of several) and ratio reference / new (> 1: new
faster); the last line is JSON with every ratio.

    python benchmarks/engine/sampler.py
    python benchmarks/engine/sampler.py --device cuda          # ~20 s on a GPU
    python benchmarks/engine/sampler.py --batches 32 --vocabs 49152 --cases filters
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from llmserve import SamplingParams
from llmserve.core.request import Request
from llmserve.model_executor.layers.sampler import Sampler
from tests.model_executor.test_sampler_filters import reference_filtered_probs

CASES = ("filters", "seeded", "flat")


def make_seqs(batch: int, seeded: bool, top_k_rows: bool = True):
    seqs = []
    for i in range(batch):
        kw = dict(top_k=50) if i % 2 and top_k_rows else dict(top_p=0.9)
        params = SamplingParams(temperature=1.0, seed=i if seeded else None, **kw)
        seqs.append(Request(f"b{i}", None, [5, 6, 7], params).sequences[0])
    return seqs


class ReferenceSampler:
    """The sampling part of the sampler before its candidate pass, for sampled rows without
    penalties, logprobs or controls (what the cases exercise)."""

    def __init__(self, seqs):
        # What Sequence.generator was: one CPU generator per seeded sequence.
        self.generators = [None if s.params.seed is None
                           else torch.Generator().manual_seed(s.params.seed) for s in seqs]

    @torch.inference_mode()
    def __call__(self, logits, seqs):
        logits = logits.float()
        dev = logits.device
        params = [s.params for s in seqs]
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        temps = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
        probs = reference_filtered_probs(logits / temps, [p.top_k for p in params],
                                         [p.top_p for p in params], [p.min_p for p in params])
        u = torch.rand(probs.shape, device=dev)
        for i, gen in enumerate(self.generators):
            if gen is not None:
                u[i] = torch.rand(probs.shape[1], generator=gen).to(dev)
        drawn = (probs / u.log_().neg_()).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), drawn).tolist()


def best_ms(fn, budget_s: float, reps: int) -> float:
    """Best over ``reps`` calls (at least 2), or fewer if the budget runs out."""
    fn()  # warm-up: allocator, kernels, lazy init
    best, spent = float("inf"), 0.0
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
        if spent > budget_s and i >= 1:
            break
    return best * 1e3


def run_case(case: str, batch: int, vocab: int, dev: str, budget_s: float, reps: int):
    gen = torch.Generator(device=dev).manual_seed(batch * vocab)
    scale = 0.1 if case == "flat" else 5.0
    logits = torch.randn(batch, vocab, generator=gen, device=dev) * scale
    seqs = make_seqs(batch, seeded=case == "seeded", top_k_rows=case != "flat")
    new, ref = Sampler(vocab, {2}), ReferenceSampler(seqs)
    t_new = best_ms(lambda: new(logits, seqs), budget_s, reps)
    t_ref = best_ms(lambda: ref(logits, seqs), budget_s, reps)
    return t_new, t_ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--reps", type=int, default=None, help="calls per timing (best of)")
    ap.add_argument("--budget", type=float, default=None, help="seconds per timing")
    args = ap.parse_args()
    gpu = args.device != "cpu"
    reps = args.reps or (20 if gpu else 5)
    budget = args.budget or (0.3 if gpu else 3.0)
    print(f"device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if gpu else
             f", {torch.get_num_threads()} threads"))
    print(f"{'case':8} {'batch':>5} {'vocab':>7} {'new ms':>9} {'ref ms':>9} {'ref/new':>8}")
    ratios = {}
    for case in args.cases:
        for batch in args.batches:
            for vocab in args.vocabs:
                t_new, t_ref = run_case(case, batch, vocab, args.device, budget, reps)
                ratios[f"{case}_b{batch}_v{vocab}"] = round(t_ref / t_new, 2)
                print(f"{case:8} {batch:5} {vocab:7} {t_new:9.2f} {t_ref:9.2f} "
                      f"{t_ref / t_new:8.2f}", flush=True)
    print(json.dumps({"bench": "sampler", "device": args.device, "ratios": ratios}))


if __name__ == "__main__":
    main()
