"""The sampler's top-k/top-p/min-p filters against the full-sort reference they replaced,
its counter-based seeded draw (range, statistics, batch independence, siblings), and
its vectorised penalties and min_tokens against the per-row loops they replaced."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve import SamplingParams
from llmserve.core.request import Request
from llmserve.model_executor.layers.sampler import (
    CANDIDATES,
    Sampler,
    Weights,
    filtered_weights,
    race,
    race_key,
    seeded_exponentials,
    uniform_from_bits,
)

EOS = 2
# The CPU always; a GPU where there is one (the sampler runs on the logits' device).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# --- the references (the sampler's code before issue 27) ------------------------------------
def reference_filtered_probs(logits, top_k, top_p, min_p):
    """Softmax after top-k, top-p and min-p by one sort of the whole vocabulary (also
    the baseline of benchmarks/engine/sampler.py, hence the devices)."""
    dev = logits.device
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=dev)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        cut = ranks >= k.unsqueeze(1)
        probs_sorted = torch.softmax(sorted_logits.masked_fill(cut, float("-inf")), dim=-1)
        before = probs_sorted.cumsum(dim=-1) - probs_sorted
        cut |= before >= torch.tensor(top_p, device=dev).unsqueeze(1)
        cut[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if any(m > 0 for m in min_p):
        top = probs.max(dim=-1, keepdim=True).values
        floor = torch.tensor(min_p, device=dev).unsqueeze(1) * top
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def reference_penalties(logits, seqs):
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    out_counts = torch.zeros(len(rows), logits.shape[1])
    seen = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool)
    for r, i in enumerate(rows):
        out = torch.tensor(seqs[i].output_token_ids, dtype=torch.long)
        out_counts[r].index_add_(0, out, torch.ones(len(out)))
        seen[r, torch.tensor(seqs[i].token_ids, dtype=torch.long)] = True
    p = [seqs[i].params for i in rows]
    rep = torch.tensor([x.repetition_penalty for x in p]).unsqueeze(1)
    freq = torch.tensor([x.frequency_penalty for x in p]).unsqueeze(1)
    pres = torch.tensor([x.presence_penalty for x in p]).unsqueeze(1)
    sub = logits[rows]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * out_counts - pres * (out_counts > 0).float()
    logits = logits.clone()
    logits[rows] = sub
    return logits


def reference_min_tokens(logits, seqs, eos_token_ids):
    for i, s in enumerate(seqs):
        p = s.params
        if s.matcher is not None:
            continue
        if p.min_tokens and s.num_output_tokens < p.min_tokens:
            banned = list((set() if p.ignore_eos else eos_token_ids) | set(p.stop_token_ids))
            logits[i, banned] = float("-inf")


# --- helpers -------------------------------------------------------------------------------
def dense(groups: list[Weights], batch: int, vocab: int) -> torch.Tensor:
    """The groups' weights as [batch, vocab] probabilities (each row normalised)."""
    out = torch.full((batch, vocab), float("nan"))
    for g in groups:
        w, ids = g.weights.cpu(), None if g.ids is None else g.ids.cpu()
        full = w if ids is None else torch.zeros(len(g.rows), vocab).scatter_(1, ids, w)
        out[torch.tensor(g.rows)] = full
    assert not out.isnan().any(), "a row is in no group"
    return out / out.sum(dim=-1, keepdim=True)


def at_the_edge(row, top_k, top_p, min_p, counts) -> bool:
    """Whether each rank in [counts[0], counts[1]) of the sorted row sits on a filter's
    edge to within rounding: the mass before it is top_p, or its probability is min_p
    times the largest (computed in float64)."""
    k = min(top_k, len(row)) if top_k > 0 else len(row)
    logits = row.double().sort(descending=True).values[:k]
    probs = torch.softmax(logits, dim=0)
    before = probs.cumsum(dim=0) - probs
    return all(abs(before[i] - top_p) < 1e-5 or abs(probs[i] / probs[0] - min_p) < 1e-5
               for i in range(*counts))


def random_rows(rng: random.Random, batch: int, vocab: int, ties: bool):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = torch.randn(batch, vocab, generator=gen)
    scale = torch.tensor([rng.choice([0.05, 0.5, 2.0, 6.0]) for _ in range(batch)])
    logits = logits * scale.unsqueeze(1)  # flat (forces the fallback) to peaked
    if ties:  # few distinct values: ties at every boundary
        logits = (logits * 2).round() / 2
    for r in range(batch):  # some rows with banned tokens, as token controls leave them
        if rng.random() < 0.2:
            logits[r, torch.randperm(vocab, generator=gen)[: vocab // 2]] = float("-inf")
    top_k = [rng.choice([0, 0, 1, 5, 50, CANDIDATES, CANDIDATES + 1, 2000, 2 ** 70])
             for _ in range(batch)]
    top_p = [rng.choice([1.0, 0.3, 0.9, 0.95, 0.999]) for _ in range(batch)]
    min_p = [rng.choice([0.0, 0.0, 0.05, 0.3]) for _ in range(batch)]
    return logits, top_k, top_p, min_p


def seqs_for(params_list, prompt=(5, 6, 7)):
    return [Request(f"r{i}", None, list(prompt), p).sequences[0]
            for i, p in enumerate(params_list)]


def sample(sampler, logits, seqs):
    return sampler(logits.clone(), seqs).token_ids


# --- filters -------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab, ties", [(1000, False), (1000, True), (49152, False),
                                         (49152, True), (300, False)])
def test_filtered_probabilities_equal_the_full_sort(vocab, ties, device):
    rng = random.Random(vocab + ties)
    for _ in range(6 if vocab < 10000 else 2):
        batch = 24
        logits, top_k, top_p, min_p = random_rows(rng, batch, vocab, ties)
        ref = reference_filtered_probs(logits, top_k, top_p, min_p)
        ref = ref / ref.sum(dim=-1, keepdim=True)
        new = dense(filtered_weights(logits.to(device), top_k, top_p, min_p), batch, vocab)
        for r in range(batch):
            a, b = ref[r][ref[r] > 0], new[r][new[r] > 0]
            if len(a) != len(b):  # float rounding decides a token exactly at the edge
                assert at_the_edge(logits[r], top_k[r], top_p[r], min_p[r],
                                   sorted((len(a), len(b)))), (r, top_k[r], top_p[r])
                continue
            # Ties at a boundary may keep either of the tied tokens: the same values.
            assert torch.allclose(a.sort().values, b.sort().values, rtol=1e-4, atol=1e-7)
            if not ties:
                assert torch.equal(ref[r] > 0, new[r] > 0)
                assert torch.allclose(ref[r], new[r], rtol=1e-4, atol=1e-7)


def test_peaked_top_p_rows_never_sort_and_flat_ones_fall_back():
    vocab = 49152
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen)
    logits[:2] *= 8.0  # peaked: top_p's mass is inside the candidates
    logits[2:] *= 0.1  # flat: it is not
    groups = filtered_weights(logits, [0, 50, 0, 50], [0.9] * 4, [0.0] * 4)
    width = {r: g.weights.shape[1] for g in groups for r in g.rows}
    assert width == {0: CANDIDATES, 1: CANDIDATES, 3: CANDIDATES, 2: vocab}
    # top_k past the candidates is the sort's too; no filter at all looks at every token.
    groups = filtered_weights(logits, [CANDIDATES + 1, 0], [1.0, 1.0], [0.0, 0.1])
    assert [(g.rows, g.weights.shape[1], g.ids is None) for g in groups] == [
        ([0], vocab, False), ([1], vocab, True)]


# --- seeded draws --------------------------------------------------------------------------
def test_uniforms_are_strictly_inside_0_1():
    extremes = torch.tensor([0, 1, 511, 512, 2 ** 31, 2 ** 32 - 512, 2 ** 32 - 1])
    u = uniform_from_bits(extremes)
    assert (u > 0).all() and (u < 1).all()
    keys = torch.tensor([race_key(s, t) for s in range(64) for t in range(4)])
    q = seeded_exponentials(keys, None, 1 << 14)
    assert torch.isfinite(q).all() and (q > 0).all()


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_draws_follow_the_distribution_across_seeds_and_steps(device):
    """Deterministic (fixed seeds), so it cannot flake: chi-square under the 0.1%
    critical value (df 5: 20.5) over seeds, and over the steps of one seed."""
    probs = [0.4, 0.25, 0.15, 0.1, 0.07, 0.03]
    vocab = 1000
    w = torch.zeros(1, vocab, device=device)
    w[0, 100:106] = torch.tensor(probs)  # at ids 100..105, a race over the whole row
    n = 6000
    for keys in ([race_key(s, 0) for s in range(n)], [race_key(7, t) for t in range(n)]):
        group = Weights(list(range(n)), w.expand(n, vocab), None)
        tokens = race([group], keys, n) - 100
        counts = torch.bincount(tokens.cpu(), minlength=6).tolist()
        assert len(counts) == 6 and chi_square(counts, probs) < 20.5, counts


def test_consecutive_steps_and_sibling_seeds_are_independent():
    """Pairs of draws over 4 equally likely tokens: (step t, step t+1) of one seed and
    (seed s, seed s + 1) at one step fill the 16 cells evenly (df 15, 0.1%: 37.7)."""
    n, w = 8000, torch.ones(1, 4)
    for first, second in (([race_key(3, t) for t in range(n)],
                           [race_key(3, t + 1) for t in range(n)]),
                          ([race_key(s, 5) for s in range(0, 2 * n, 2)],
                           [race_key(s + 1, 5) for s in range(0, 2 * n, 2)])):
        group = Weights(list(range(n)), w.expand(n, 4), None)
        a, b = race([group], first, n), race([group], second, n)
        counts = torch.bincount(a * 4 + b, minlength=16).tolist()
        assert chi_square(counts, [1 / 16] * 16) < 37.7, counts


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_row_is_the_same_whatever_shares_its_batch(device):
    vocab, steps = 2000, 6
    gen = torch.Generator().manual_seed(1)
    peaked, flat = torch.randn(vocab, generator=gen) * 4, torch.randn(vocab, generator=gen) * 0.1
    targets = [  # a candidate row, a fallback row, a top_k past the candidates, no filter
        (peaked, dict(top_p=0.9)), (flat, dict(top_p=0.9)), (flat, dict(top_k=900)),
        (flat, dict(min_p=0.5)), (peaked, dict(top_k=20, top_p=0.8))]
    others = [SamplingParams(temperature=0.7, top_p=0.5), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=99, top_k=CANDIDATES + 7),
              SamplingParams(temperature=1.3, top_k=3), SamplingParams(temperature=1.0)]
    sampler = Sampler(vocab, {EOS})
    for row, kw in targets:
        params = SamplingParams(temperature=1.0, seed=1234, **kw)
        alone, crowd = seqs_for([params]), seqs_for(others * 3 + [params] + others)
        mine = crowd[len(others) * 3]
        for _ in range(steps):
            batch = torch.randn(len(crowd), vocab, generator=gen)
            batch[len(others) * 3] = row
            tok = sample(sampler, row.unsqueeze(0).to(device), alone)[0]
            assert sample(sampler, batch.to(device), crowd)[len(others) * 3] == tok, kw
            for s in alone + crowd:
                s.append_token(tok if s in (alone[0], mine) else 3)


def test_seeds_and_steps_give_different_draws():
    vocab = 1000
    flat = torch.zeros(1, vocab)
    sampler = Sampler(vocab, {EOS})
    by_seed = [sample(sampler, flat, seqs_for([SamplingParams(temperature=1.0, seed=s)]))[0]
               for s in range(20)]
    assert len(set(by_seed)) >= 18
    seq = seqs_for([SamplingParams(temperature=1.0, seed=0)])
    by_step = []
    for _ in range(20):
        by_step.append(sample(sampler, flat, seq)[0])
        seq[0].append_token(by_step[-1])
    assert len(set(by_step)) >= 18


def test_parallel_samples_of_a_seeded_request_differ_and_equal_seed_plus_index():
    vocab = 1000
    flat = torch.zeros(4, vocab)
    sampler = Sampler(vocab, {EOS})
    seqs = Request("n4", None, [5, 6], SamplingParams(n=4, temperature=1.0, seed=5)).sequences
    tokens = sample(sampler, flat, seqs)
    assert len(set(tokens)) == 4
    singles = [sample(sampler, flat[:1], seqs_for([SamplingParams(temperature=1.0,
                                                                  seed=5 + i)]))[0]
               for i in range(4)]
    assert singles == tokens


def test_extreme_seeds_draw():
    vocab = 50
    sampler = Sampler(vocab, {EOS})
    seqs = seqs_for([SamplingParams(temperature=1.0, seed=s, n=2)
                     for s in (-2 ** 63, 2 ** 63 - 1)])
    seqs += [s.request.sequences[1] for s in seqs]  # seed 2**63: past int64, still a seed
    tokens = sample(sampler, torch.zeros(4, vocab), seqs)
    assert all(0 <= t < vocab for t in tokens)


# --- penalties and min_tokens --------------------------------------------------------------
def penalised_seqs(rng: random.Random, vocab: int):
    params = [SamplingParams(temperature=1.0), SamplingParams(repetition_penalty=1.3),
              SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
              SamplingParams(presence_penalty=1.5, repetition_penalty=0.8),
              SamplingParams(frequency_penalty=-1.0)]
    seqs = []
    for i in range(12):
        p = params[i % len(params)]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        seq = Request(f"p{i}", None, prompt, p).sequences[0]
        for _ in range(rng.choice([0, 1, 7, 60])):  # repeats, to count
            seq.append_token(rng.randrange(vocab) if rng.random() < 0.5 else prompt[0])
        seqs.append(seq)
    return seqs


def test_vectorised_penalties_equal_the_row_loop():
    rng, vocab = random.Random(3), 700
    for _ in range(4):
        seqs = penalised_seqs(rng, vocab)
        logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(4))
        ours = Sampler(vocab, {EOS})._apply_penalties(logits.clone(), seqs)
        assert torch.equal(ours, reference_penalties(logits, seqs))
        assert not torch.equal(ours, logits)


def test_vectorised_min_tokens_equals_the_row_loop():
    rng, vocab = random.Random(5), 300
    cases = [dict(min_tokens=4), dict(min_tokens=4, ignore_eos=True),
             dict(min_tokens=4, stop_token_ids=[7, 9, EOS]), dict(min_tokens=0),
             dict(min_tokens=2, stop_token_ids=[11])]
    seqs = []
    for i in range(15):
        seq = seqs_for([SamplingParams(max_tokens=10, **cases[i % len(cases)])])[0]
        for _ in range(rng.randint(0, 5)):
            seq.append_token(rng.randrange(vocab))
        seqs.append(seq)
    seqs[1].matcher = object()  # a grammar decides where its output ends
    logits = torch.randn(len(seqs), vocab)
    ours, ref = logits.clone(), logits.clone()
    Sampler(vocab, {EOS, 1})._suppress_eos_before_min_tokens(ours, seqs)
    reference_min_tokens(ref, seqs, {EOS, 1})
    assert torch.equal(ours, ref) and ours.isinf().any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_seeded_draw_is_the_same_on_the_gpu_and_the_cpu():
    """The hash is integer arithmetic: the same uniforms on either device, so the same
    tokens (a log's last bit apart at most)."""
    keys = torch.tensor([race_key(s, t) for s in range(50) for t in range(3)])
    ids = torch.randint(0, 1 << 17, (len(keys), 300))
    on_cpu = seeded_exponentials(keys, ids, 300)
    on_gpu = seeded_exponentials(keys.cuda(), ids.cuda(), 300).cpu()
    assert torch.allclose(on_cpu, on_gpu, rtol=1e-6)
    sampler, logits = Sampler(1000, {EOS}), torch.randn(40, 1000)
    params = [SamplingParams(temperature=1.0, seed=s, top_p=0.95) for s in range(40)]
    assert sample(sampler, logits, seqs_for(params)) == sample(sampler, logits.cuda(),
                                                               seqs_for(params))
