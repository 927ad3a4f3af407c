"""How many draft tokens pay for themselves: speculation must never cost throughput.

Each drafted token is one more row in the step. Where a step's cost hardly grows with
its rows (a GPU decode, memory-bound) every plausible draft pays; where it grows
steeply (a CPU, compute-bound; or a big batch) only drafts that are likely accepted
do. So, for each sequence and step:

    draft token i is worth verifying  <=>  a ** i  >  row_cost

- ``a``: the sequence's own per-token acceptance rate, from its recent drafts (a draft
  of j tokens with n accepted is n successes and, if n < j, one failure; decayed so
  that a sequence that starts or stops quoting is followed within a few drafts). A
  sequence not drafted drifts back towards the prior, so it is probed again later.
- ``row_cost``: what one more draft row costs, in tokens: the seconds a draft token adds
  to a decode step (its row in the target, and a draft model's pass) times the tokens
  per second the batch makes without drafts, i.e. per_draft * B / (fixed + per_seq *
  B) for B sequences. The coefficients are fitted online (exponentially weighted least
  squares over the decode steps measured: seconds = fixed + per_seq * B + per_draft *
  drafted tokens; core/sched/least_squares.py), one fit per range of batch sizes (1,
  2-3, 4-7, ...: a CPU runs a few rows in one C call and many op by op, at other costs
  per row); until a range saw steps with two different numbers of draft tokens,
  ``PRIOR_ROW_COST``.
"""

from __future__ import annotations

import math

import numpy as np

from llmserve.core.request import Sequence
from llmserve.core.sched.least_squares import DecayedLeastSquares

PRIOR_RATE = 0.8  # a new sequence's acceptance rate: optimistic, so it tries at once
PRIOR_ROW_COST = 0.2  # until the step cost is measured
RATE_DECAY = 0.7  # per draft: ~3 drafts of memory
PROBE_DRIFT = 0.03  # per undrafted step: a rejected sequence is tried again in ~10
COST_DECAY = 0.98  # per decode step: ~50 steps of memory
REFIT_EVERY = 8


class StepCost:
    """seconds = fixed + per_seq * B + per_draft * drafted, fitted over the decode steps
    of one range of batch sizes."""

    def __init__(self):
        self._fit = DecayedLeastSquares(3, COST_DECAY, ridge=1e-9)  # x = [1, B, drafted]
        self._seen = set()  # draft token counts seen: a fit needs two
        self.coef = None  # (fixed, per_seq, per_draft) seconds, once fitted
        self._unfitted = 0  # steps observed since the last fit

    def observe(self, seqs: int, drafted: int, seconds: float) -> None:
        self._fit.add(np.array([1.0, seqs, drafted]), seconds)
        if len(self._seen) < 2:
            self._seen.add(drafted)
        self._unfitted += 1
        # A fit is small next to a decode step but not free, and the costs drift
        # slowly: refit every few steps, not every step.
        if len(self._seen) == 2 and (self.coef is None or self._unfitted >= REFIT_EVERY):
            self.coef = tuple(float(c) for c in self._fit.solve())
            self._unfitted = 0

    def row_cost(self, batch_size: int) -> float:
        if self.coef is None:
            return PRIOR_ROW_COST
        fixed, per_seq, per_draft = self.coef
        plain = fixed + per_seq * batch_size  # a step without drafts
        return per_draft * batch_size / plain if plain > 0 else PRIOR_ROW_COST


class DraftPolicy:
    def __init__(self):
        self.costs: dict[int, StepCost] = {}  # by batch_size.bit_length()

    # --- the decision -------------------------------------------------------------
    def max_draft(self, seq: Sequence, batch_size: int, k: int) -> int:
        """The longest draft worth verifying for ``seq`` in a step of ``batch_size``
        decodes (0: none), at most ``k``."""
        rate = self.rate(seq)
        cost = self.row_cost(batch_size)
        if rate <= cost or rate <= 0.0:
            return 0
        if rate >= 1.0 or cost <= 0.0:
            return k
        return min(k, int(math.log(cost) / math.log(rate)))  # largest i with a^i > cost

    def row_cost(self, batch_size: int) -> float:
        cost = self.costs.get(batch_size.bit_length())
        return cost.row_cost(batch_size) if cost is not None else PRIOR_ROW_COST

    @staticmethod
    def rate(seq: Sequence) -> float:
        hits, trials = _stats(seq)
        return hits / trials

    # --- what was measured ----------------------------------------------------------
    @staticmethod
    def drafted(seq: Sequence, num_draft: int, num_accepted: int) -> None:
        hits, trials = _stats(seq)
        failed = 1 if num_accepted < num_draft else 0
        seq.draft_stats = (RATE_DECAY * hits + num_accepted,
                           RATE_DECAY * trials + num_accepted + failed)

    @staticmethod
    def not_drafted(seq: Sequence) -> None:
        hits, trials = _stats(seq)
        seq.draft_stats = ((1 - PROBE_DRIFT) * hits + PROBE_DRIFT * PRIOR_RATE,
                           (1 - PROBE_DRIFT) * trials + PROBE_DRIFT)

    def observe_step(self, seqs: int, drafted: int, seconds: float) -> None:
        """A decode step of ``seqs`` sequences and ``drafted`` draft tokens took
        ``seconds``."""
        self.costs.setdefault(seqs.bit_length(), StepCost()).observe(seqs, drafted, seconds)


def _stats(seq: Sequence) -> tuple[float, float]:
    return seq.draft_stats or (PRIOR_RATE, 1.0)
