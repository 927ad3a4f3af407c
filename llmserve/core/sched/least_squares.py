"""Exponentially weighted least squares, fitted online, with non-negative coefficients.

What the engine's timing models share (the scheduler's step cost model and the
speculator's draft pricing): each observation ``x`` (features) and ``y`` (seconds)
joins weighted sums of ``x x^T`` and ``x y``, older ones decayed by ``decay`` per
observation, so the fit follows the machine (and its noise) rather than a profile
taken once. A fit solves those normal equations with every coefficient >= 0: more work
never takes less time, and a negative coefficient fitted to noise would price work
as a saving.
"""

from __future__ import annotations

import numpy as np


class DecayedLeastSquares:
    def __init__(self, num_features: int, decay: float, ridge: float):
        self.decay = decay
        self._gram = np.eye(num_features) * ridge  # decayed, weighted sum of x x^T
        self._moment = np.zeros(num_features)  # and of x y

    def add(self, x: np.ndarray, y: float, weight: float = 1.0) -> None:
        self._gram = self.decay * self._gram + weight * np.outer(x, x)
        self._moment = self.decay * self._moment + weight * x * y

    def solve(self) -> np.ndarray:
        """The coefficients, each >= 0: solve, drop the negative ones, solve again over
        the rest (an active set; the features here are few, so a few rounds)."""
        n = len(self._moment)
        active = np.ones(n, dtype=bool)
        for _ in range(n):
            sol = np.zeros(n)
            idx = np.flatnonzero(active)
            sol[idx] = np.linalg.lstsq(self._gram[np.ix_(idx, idx)], self._moment[idx],
                                       rcond=None)[0]
            if (sol >= 0).all():
                return sol
            active &= sol > 0
        return np.clip(sol, 0, None)
