"""Prompt-lookup (n-gram) proposals, vLLM's ``NgramProposer``: a sequence that is
quoting its context (code edits, summaries with quotes, repeated text) will likely
go on as the quoted text did, so the draft is what followed the latest earlier
occurrence of its last n tokens."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int,
                 prompt_lookup_min: int):
        assert 1 <= prompt_lookup_min <= prompt_lookup_max
        self.k = num_speculative_tokens
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Up to ``min(k, limit)`` tokens that followed the most recent earlier
        occurrence of the last n tokens (the longest n that has one, from
        ``prompt_lookup_max`` down to ``prompt_lookup_min``); [] if none has."""
        k = self.k if limit is None else min(self.k, limit)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _last_occurrence(tokens, n)
            if start is not None:
                return tokens[start + n:start + n + k].tolist()
        return []


def _last_occurrence(tokens: np.ndarray, n: int) -> int | None:
    """The largest i with tokens[i:i+n] == tokens[-n:] and i + n < len(tokens) (a
    token follows the occurrence), or None."""
    windows = sliding_window_view(tokens[:-1], n)  # starts 0 .. len - 1 - n
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(hits[-1]) if hits.size else None
