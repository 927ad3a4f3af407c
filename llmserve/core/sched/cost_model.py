"""How long will a step take? A small linear cost model, fitted online.

    seconds = c0 + c_tok * tokens computed + c_kv * KV tokens read + c_seq * sequences

Each term is what a step's work scales with on any device: the GEMMs with the tokens
computed, attention with the context every scheduled sequence reads, and per-sequence
work (metadata, sampling, detokenisation) with the batch size. (Counting a prefill
chunk's reads as chunk × context, quadratic in the chunk, was tried: no better on the
CPU cap benchmark, so the simpler linear form stays.) The coefficients are
fitted by exponentially weighted least squares (least_squares.py; in relative error)
over measured steps, so they follow the machine (and its noise) rather than a profile
taken once.
The scheduler uses the model to keep each step under a latency target
(``--target-itl-ms``).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from llmserve.core.sched.least_squares import DecayedLeastSquares

# Feature scales: keep the normal equations well conditioned (tokens ~ 1-2k, KV reads
# up to ~1e5, sequences up to ~1e2).
_SCALE = np.array([1.0, 1e-2, 1e-4, 1e-1])
# Decode-only observations between two fits: a fit costs ~0.25 ms (a third of a fast
# CPU decode step, were it done every step), and the decay averages ~200 steps anyway.
REFIT_EVERY = 8


class StepCostModel:
    def __init__(self, decay: float = 0.995, min_observations: int = 8,
                 ridge: float = 1e-3):
        self.min_observations = min_observations
        self._fit = DecayedLeastSquares(4, decay, ridge)
        self.coef = np.zeros(4)  # in seconds per unit of each (unscaled) feature
        self._unfitted = 0  # observations since the last fit
        self.observations = 0
        self.mixed_observations = 0  # steps with more tokens than sequences (prefill)
        # actual / predicted of recent steps: how far a plan must stay under a target.
        self._ratios: deque[float] = deque(maxlen=256)

    @property
    def ready(self) -> bool:
        """Enough steps, and some with prefill: decode-only steps (tokens ==
        sequences) cannot tell the per-token cost from the per-sequence one."""
        return self.observations >= self.min_observations and self.mixed_observations >= 2

    def observe(self, tokens: int, kv_tokens: int, seqs: int, seconds: float) -> None:
        x = np.array([1.0, tokens, kv_tokens, seqs]) * _SCALE
        # Relative errors: step noise scales with the step, and a small step mispredicted
        # by 1 ms matters as much as a big one by 10.
        self._fit.add(x, seconds, weight=1.0 / (seconds + 1e-3) ** 2)
        self.observations += 1
        self.mixed_observations += tokens > seqs
        self._unfitted += 1
        # Steps with prefill are what separate the per-token from the per-sequence
        # cost (and are long, so a fit costs little next to them): refit at once.
        if (self._unfitted >= REFIT_EVERY or tokens > seqs
                or self.observations <= self.min_observations):
            self.refit()

    def refit(self) -> None:
        self.coef = self._fit.solve() * _SCALE
        self._unfitted = 0

    def observe_error(self, actual: float, predicted: float) -> None:
        if predicted > 0:
            self._ratios.append(actual / predicted)

    @property
    def margin(self) -> float:
        """The 90th percentile of actual / predicted over recent steps (at least 1):
        planning for target / margin keeps ~90 % of steps under the target even
        though single steps are noisy (1 until 32 steps were seen)."""
        if len(self._ratios) < 32:
            return 1.0
        return max(1.0, float(np.percentile(self._ratios, 90)))

    def predict(self, tokens: int, kv_tokens: int, seqs: int) -> float:
        return float(self.coef @ np.array([1.0, tokens, kv_tokens, seqs]))

    @property
    def fixed(self) -> float:
        """The cost of a step before anything is in it."""
        return float(self.coef[0])

    def seq_cost(self, num_new: int, context_after: int) -> float:
        """What adding one sequence computing ``num_new`` tokens with ``context_after``
        tokens of context costs a step."""
        _, c_tok, c_kv, c_seq = self.coef
        return float(c_tok * num_new + c_kv * context_after + c_seq)

    def max_tokens_within(self, seconds: float, num_computed: int) -> int:
        """The largest chunk of a sequence with ``num_computed`` tokens of context
        already cached that costs at most ``seconds``."""
        _, c_tok, c_kv, c_seq = self.coef
        room = seconds - c_seq - c_kv * num_computed
        per_token = c_tok + c_kv
        if room <= 0:
            return 0
        if per_token <= 0:
            return 1 << 30
        return int(room / per_token)
