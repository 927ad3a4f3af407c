"""Batched sampling over the logits of one step.

Every transformation is a tensor operation over the whole batch; per-row
parameters come in as tensors built once per step. Randomness uses the
"exponential race" (argmax of w / q with q ~ Exp(1), w proportional to the filtered
probabilities), which is an exact draw. A seeded row's q is a counter-based hash of
(seed, output position, token id), computed on the logits' device for all seeded rows
at once: a seeded request gives the same tokens whatever else shares its batch, and
no host generator is stepped row by row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from llmserve.core.request import Sequence
from llmserve.kernels.cpu.native import argmax_applies, argmax_rows
from llmserve.model_executor.layers.token_controls import apply_token_controls

# Top-k/top-p rows race over their CANDIDATES likeliest tokens (one topk) instead of a
# sort of the whole vocabulary (49k-152k entries); a row whose kept set may reach past
# them is sorted as before, so the result is exact either way. A topk rather than a
# threshold bisection: one kernel on either device, where a bisection costs dozens of
# passes over the vocabulary. 512: a real model's top-p set at temperature <= 1 almost
# always lies within it, and topk grows slowly with k, far below the sort's cost
# (docs/architecture.md, "Sampling"). Fixed, not sized by the batch's largest top_k, so
# which path a row takes depends on that row alone (seeded outputs stay
# batch-independent).
CANDIDATES = 512
NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (sampled logprob, [(token, logprob) top-k]) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


@dataclass
class SampledTokens:
    """A step's sampled tokens still on the logits' device (async scheduling reads
    them back a step later): ``tokens`` feeds the next step's inputs there, and
    ``resolve`` is the one host sync."""
    tokens: torch.Tensor  # [rows] int64
    params: list
    # (chosen logprob [rows], top values [rows, k], top ids [rows, k]) or None
    logprob_tensors: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None

    def resolve(self) -> SamplerOutput:
        return SamplerOutput(self.tokens.tolist(),
                             logprob_lists(self.logprob_tensors, self.params))


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 grammar_rows: list[int] | None = None,
                 bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """``bitmask`` (one row per entry of ``grammar_rows``) lists the tokens each
        constrained row may take; the others are never sampled."""
        return self.sample(logits, seqs, grammar_rows, bitmask).resolve()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               grammar_rows: list[int] | None = None,
               bitmask: torch.Tensor | None = None) -> SampledTokens:
        """As ``__call__``, leaving the tokens (and logprobs) on the device."""
        logits = logits[:, : self.vocab_size]
        params = [s.params for s in seqs]
        if not grammar_rows and all(self._plain_greedy(s) for s in seqs):
            # Nothing to transform or report: the argmax of the raw logits, in their
            # dtype (bf16 -> float32 is exact, so the same token), without the copy.
            return SampledTokens(greedy_tokens(logits), params, None)
        logits = logits.float()
        dev = logits.device
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits, seqs)
        self._suppress_eos_before_min_tokens(logits, seqs)
        want_logprobs = any(p.logprobs is not None for p in params)
        # Logprobs are the model's (after penalties), not the grammar's renormalisation.
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        # After the logprobs, as the grammar: a banned token's -inf has no JSON form.
        if any(p.has_token_controls for p in params):
            apply_token_controls(logits, seqs)
        if grammar_rows:
            apply_bitmask(logits, grammar_rows, bitmask)

        if all(p.greedy for p in params):  # decided on the host: no device sync
            tokens = logits.argmax(dim=-1)
        else:
            temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params],
                                 device=dev).unsqueeze(1)
            sampled = [i for i, p in enumerate(params) if not p.greedy]
            groups = filtered_weights(logits / temps, [p.top_k for p in params],
                                      [p.top_p for p in params], [p.min_p for p in params],
                                      sampled)
            tokens = race(groups, [race_key_of(s) for s in seqs], len(seqs))
            if len(sampled) < len(seqs):  # a full pass, only when a row needs it
                greedy = torch.tensor([p.greedy for p in params], device=dev)
                tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        return SampledTokens(tokens, params, logprob_tensors(logprobs, tokens, params))

    @staticmethod
    def _plain_greedy(seq: Sequence) -> bool:
        """Greedy with no penalty, no logprobs, no grammar, no token controls and no
        token banned yet."""
        p = seq.params
        return (p.greedy and not p.has_penalties and p.logprobs is None
                and seq.matcher is None and not p.has_token_controls
                and not (p.min_tokens and seq.num_output_tokens < p.min_tokens))

    # --- steps -----------------------------------------------------------------
    def _apply_penalties(self, logits, seqs):
        """vLLM's semantics: repetition over prompt + output; presence and
        frequency over the output only."""
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        dev = logits.device
        out_counts, seen = token_counts([seqs[i] for i in rows], logits.shape[1], dev)
        p = [seqs[i].params for i in rows]
        rep = torch.tensor([x.repetition_penalty for x in p], device=dev).unsqueeze(1)
        freq = torch.tensor([x.frequency_penalty for x in p], device=dev).unsqueeze(1)
        pres = torch.tensor([x.presence_penalty for x in p], device=dev).unsqueeze(1)
        sub = logits[rows]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * out_counts - pres * (out_counts > 0).float()
        logits = logits.clone()
        logits[rows] = sub
        return logits

    def _suppress_eos_before_min_tokens(self, logits, seqs):
        rows, cols = [], []
        for i, s in enumerate(seqs):
            p = s.params
            if s.matcher is not None:
                continue  # a grammar decides where its output ends
            if p.min_tokens and s.num_output_tokens < p.min_tokens:
                banned = (set() if p.ignore_eos else self.eos_token_ids) | set(p.stop_token_ids)
                rows += [i] * len(banned)
                cols += banned
        if rows:  # one indexed write for the batch, not one per row
            index = torch.tensor([rows, cols], dtype=torch.long, device=logits.device)
            logits[index[0], index[1]] = NEG_INF


def logprob_tensors(logprobs, tokens, params):
    """On the device: each row's sampled logprob and the batch's top-k (k: the largest
    asked), or None when no row asks."""
    if logprobs is None:
        return None
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    k = max(p.logprobs or 0 for p in params)
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    return chosen, top_vals, top_ids


def logprob_lists(tensors, params) -> list:
    """Per row: (sampled logprob, [(token, logprob)] of its own top-k) or None."""
    if tensors is None:
        return [None] * len(params)
    chosen, top_vals, top_ids = (t.tolist() if t is not None else None for t in tensors)
    result = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            result.append(None)
            continue
        n = p.logprobs
        top = list(zip(top_ids[i][:n], top_vals[i][:n])) if n else []
        result.append((chosen[i], top))
    return result


def token_counts(seqs: list[Sequence], vocab: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: how often each token occurs in its output (float) and whether it
    occurs at all in prompt + output (bool), both [len(seqs), vocab]. One padded id
    tensor and two scatters for the batch: the pad id is an extra column, dropped."""
    ids = [s.token_ids for s in seqs]
    width = max(len(t) for t in ids)
    padded = torch.tensor([t + [vocab] * (width - len(t)) for t in ids], dtype=torch.long,
                          device=device)
    n_prompt = torch.tensor([s.num_prompt_tokens for s in seqs], device=device)
    is_output = torch.arange(width, device=device) >= n_prompt.unsqueeze(1)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    counts.scatter_add_(1, padded, is_output.float())
    seen = torch.zeros(len(seqs), vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, padded, True)
    return counts[:, :vocab], seen[:, :vocab]


# --- filters -------------------------------------------------------------------------
class Weights(NamedTuple):
    """Race weights of some rows of the batch (``rows``, ascending): ``weights[r, j]``
    is proportional to the filtered probability of token ``ids[r, j]`` (of token j
    where ``ids`` is None) and 0 where a filter cut it. Weights are exp(logit - the
    row's largest), so the top token weighs 1 and min_p compares with them directly."""
    rows: list[int]
    weights: torch.Tensor
    ids: torch.Tensor | None


def filtered_weights(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                     min_p: list[float], rows: list[int] | None = None) -> list[Weights]:
    """The kept set of each row: its top_k likeliest tokens, then the smallest prefix of
    those whose mass reaches top_p (the first always kept), then min_p. Rows are split
    by how little of the vocabulary they need: top-k/top-p rows look at CANDIDATES
    tokens and fall back to a full sort only when top_k is larger or (flat rows, rare)
    the candidates' mass falls short of top_p; rows without either filter look at
    every token, unsorted. Only ``rows`` (default: all) are filtered; the groups say
    which rows they hold."""
    vocab = logits.shape[1]
    # Clamped on the host: any positive top_k is valid, but not every int fits int64.
    k = [min(x, vocab) if x > 0 else vocab for x in top_k]
    cap = min(CANDIDATES, vocab)
    plain, cand, full = [], [], []
    for i in range(len(k)) if rows is None else rows:
        ki, p = k[i], top_p[i]
        if ki == vocab and p >= 1.0:
            plain.append(i)  # no top-k/top-p: every token, unsorted
        elif ki <= cap or ki == vocab:
            cand.append(i)
        else:
            full.append(i)  # top_k past the candidates
    groups = []
    if cand:
        group, short = _candidate_weights(logits, cand, k, top_p)
        groups += [group] if group.rows else []
        full = sorted(full + short)
    if full:
        groups.append(_sorted_weights(logits, full, k, top_p))
    if plain:
        sub = _take(logits, plain)
        groups.append(Weights(plain, (sub - sub.max(dim=-1, keepdim=True).values).exp_(),
                              None))
    return [_apply_min_p(g, min_p) for g in groups]


def _candidate_weights(logits, rows, k, top_p) -> tuple[Weights, list[int]]:
    """Top-k/top-p within each row's CANDIDATES likeliest tokens; returns the rows whose
    kept set may reach past them (top_k unset and the candidates' mass under top_p)."""
    dev = logits.device
    sub = _take(logits, rows)
    vals, ids = sub.topk(min(CANDIDATES, sub.shape[1]), dim=-1)  # sorted, descending
    ks = torch.tensor([k[i] for i in rows], device=dev).unsqueeze(1)
    beyond_k = torch.arange(vals.shape[1], device=dev) >= ks
    masked = vals.masked_fill(beyond_k, NEG_INF)
    # top_p's mass is over the top-k set: all among the candidates when top_k fits,
    # else (top_k unset) the whole vocabulary's.
    whole = [k[i] > vals.shape[1] for i in rows]
    norm = torch.logsumexp(masked, dim=-1)
    if any(whole):  # the row's largest logit is known: one pass, not logsumexp's two
        top = vals[:, :1]
        every = (sub - top).exp_().sum(dim=-1).log_() + top.squeeze(1)
        norm = torch.where(torch.tensor(whole, device=dev), every, norm)
    probs = (masked - norm.unsqueeze(1)).exp_()
    cum = probs.cumsum(dim=-1)
    tp = torch.tensor([top_p[i] for i in rows], device=dev)
    cut = beyond_k | (cum - probs >= tp.unsqueeze(1))
    cut[:, 0] = False
    weights = (vals - vals[:, :1]).exp_().masked_fill_(cut, 0.0)
    short = []
    if any(whole):  # the only device sync of the filters, and only for such rows
        spill = ((cum[:, -1] < tp) & torch.tensor(whole, device=dev)).tolist()
        short = [r for r, s in zip(rows, spill) if s]
        if short:
            keep = [j for j, s in enumerate(spill) if not s]
            rows = [rows[j] for j in keep]
            weights, ids = weights[keep], ids[keep]
    return Weights(rows, weights, ids), short


def _sorted_weights(logits, rows, k, top_p) -> Weights:
    """Top-k/top-p over a full sort of each row (the exact fallback)."""
    dev = logits.device
    sorted_logits, order = _take(logits, rows).sort(dim=-1, descending=True)
    ks = torch.tensor([k[i] for i in rows], device=dev).unsqueeze(1)
    cut = torch.arange(sorted_logits.shape[1], device=dev) >= ks
    probs = torch.softmax(sorted_logits.masked_fill(cut, NEG_INF), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always).
    before = probs.cumsum(dim=-1) - probs
    cut |= before >= torch.tensor([top_p[i] for i in rows], device=dev).unsqueeze(1)
    cut[:, 0] = False
    weights = (sorted_logits - sorted_logits[:, :1]).exp_().masked_fill_(cut, 0.0)
    return Weights(rows, weights, order)


def _apply_min_p(group: Weights, min_p: list[float]) -> Weights:
    floors = [min_p[i] for i in group.rows]
    if not any(m > 0 for m in floors):
        return group
    # The top token weighs exactly 1: "p < min_p * p_max" is "weight < min_p".
    floor = torch.tensor(floors, device=group.weights.device).unsqueeze(1)
    return group._replace(weights=group.weights.masked_fill(group.weights < floor, 0.0))


def _take(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows], without the copy when that is every row."""
    if len(rows) == logits.shape[0]:
        return logits
    return logits[torch.tensor(rows, device=logits.device)]


# --- the race --------------------------------------------------------------------------
def race(groups: list[Weights], keys: list[tuple[int, int] | None],
         batch: int) -> torch.Tensor:
    """One token per row of the groups (other rows are left unset): argmax of
    weight / q, q ~ Exp(1) per token, drawn from the row's key where it has one
    (seeded) and from torch's generator otherwise."""
    dev = groups[0].weights.device
    tokens = torch.empty(batch, dtype=torch.long, device=dev)
    for g in groups:
        pick = (g.weights / _exponentials(g, keys)).argmax(dim=-1)
        tok = pick if g.ids is None else g.ids.gather(1, pick.unsqueeze(1)).squeeze(1)
        if len(g.rows) == batch:
            return tok
        tokens[torch.tensor(g.rows, device=dev)] = tok
    return tokens


def _exponentials(group: Weights, keys) -> torch.Tensor:
    w = group.weights
    seeded = [j for j, row in enumerate(group.rows) if keys[row] is not None]
    if len(seeded) == len(group.rows):
        return seeded_exponentials(_key_tensor(keys, group.rows, w.device), group.ids, w.shape[1])
    # -log(U): on a CPU a uniform draw plus a vectorised log is several times cheaper
    # than exponential_.
    q = torch.rand(w.shape, device=w.device).log_().neg_()
    if seeded:
        index = torch.tensor(seeded, device=w.device)
        ids = None if group.ids is None else group.ids[index]
        rows = [group.rows[j] for j in seeded]
        q[index] = seeded_exponentials(_key_tensor(keys, rows, w.device), ids, w.shape[1])
    return q


def _key_tensor(keys, rows, device) -> torch.Tensor:
    return torch.tensor([keys[r] for r in rows], dtype=torch.long, device=device)


# --- counter-based randomness for seeded rows -------------------------------------------
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
# On a CPU, hash this many entries at a time so the int64 temporaries stay in cache
# (a whole batch at once took markedly longer); a GPU takes every row in one go.
_CPU_CHUNK = 1 << 16


def race_key_of(seq: Sequence) -> tuple[int, int] | None:
    """The key of a seeded sequence's next draw: its seed (seed + index for parallel
    samples, so siblings differ; else the random seed speculation couples it by) and
    the position of the token being drawn (so steps differ, and a recomputed or
    swapped sequence resumes where it was)."""
    seed = seq.params.sample_seed(seq.index)
    if seed is None:
        seed = seq.coupling_seed
    return None if seed is None else race_key(seed, seq.num_output_tokens)


def race_key(seed: int, step: int) -> tuple[int, int]:
    """Two 32-bit words from (seed, step), mixed on the host in Python ints (exact)."""
    x = _splitmix64(_splitmix64(seed & _M64) ^ step)
    return x & _M32, x >> 32


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def seeded_exponentials(keys: torch.Tensor, ids: torch.Tensor | None,
                        width: int) -> torch.Tensor:
    """-log(u) per (row, column), u = uniform_from_bits(hash(row's key, token id)).
    ``keys`` is [rows, 2] int64; ``ids`` gives each column's token id ([rows, width]),
    or None when column j is token j."""
    dev = keys.device
    tokens = torch.arange(width, device=dev).unsqueeze(0) if ids is None else ids
    out = torch.empty(keys.shape[0], width, device=dev)
    step = keys.shape[0] if dev.type != "cpu" else max(1, _CPU_CHUNK // width)
    for s in range(0, keys.shape[0], step):
        tok = tokens if ids is None else tokens[s:s + step]
        h = _mix32(tok ^ keys[s:s + step, :1])
        h = _mix32(h.bitwise_xor_(keys[s:s + step, 1:]))
        out[s:s + step] = uniform_from_bits(h).log_().neg_()
    return out


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer (Wellons' hash-prospector "lowbias32" shape, with
    constants below 2**31) on int64 values below 2**32, in place: every product stays
    under 2**63, so nothing overflows, and each is masked back to 32 bits."""
    h.bitwise_xor_(h >> 16).mul_(0x21F0AAAD).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 15).mul_(0x735A2D97).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 15)


def uniform_from_bits(h: torch.Tensor) -> torch.Tensor:
    """A float32 uniform strictly inside (0, 1) from 32 random bits: the top 23 bits
    plus one half, over 2**23, all exact in float32, so never 0 (log(0)) nor 1."""
    return ((h >> 9).float() + 0.5).mul_(2.0 ** -23)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row (the first, on ties), by the C kernel for bf16 CPU logits."""
    if argmax_applies(logits):
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """logits[rows] = -inf wherever the row's bit is 0 (in place)."""
    vocab = logits.shape[1]
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> _BITS.to(logits.device)) & 1
    allowed = bits.view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
