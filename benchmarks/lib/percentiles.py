"""Percentiles of measured samples: one definition for every script.

numpy's linear interpolation unless a script says otherwise (``method="nearest"``: an
observed value, as a rank statistic of few samples wants)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float, method: str = "linear") -> float | None:
    """The ``q``-th percentile (0-100) of ``values``; None when there are none."""
    return float(np.percentile(values, q, method=method)) if len(values) else None


def summary_ms(seconds: Sequence[float]) -> dict:
    """Mean, p50 and p99 of durations in seconds, in milliseconds (None without any)."""
    if not len(seconds):
        return {"mean": None, "p50": None, "p99": None}
    ms = np.array(seconds) * 1000
    return {"mean": float(ms.mean()), "p50": percentile(ms, 50), "p99": percentile(ms, 99)}
