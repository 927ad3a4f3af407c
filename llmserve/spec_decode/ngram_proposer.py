"""Prompt-lookup (n-gram) proposals, vLLM's ``NgramProposer``: a sequence that is
quoting its context (code edits, summaries with quotes, repeated text) will likely
go on as the quoted text did, so the draft is what followed the latest earlier
occurrence of its last n tokens."""

from __future__ import annotations

import numpy as np


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
        # Earlier positions holding the last token: where every match must end.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = _latest_match(tokens, ends, n)
            if end is not None:
                return tokens[end + 1:end + 1 + k].tolist()
        return []


def _latest_match(tokens: np.ndarray, ends: np.ndarray, n: int) -> int | None:
    """The largest i in ``ends`` with tokens[i-n+1:i+1] == tokens[-n:] (a token follows
    it, since ends < len - 1), or None."""
    ends = ends[ends >= n - 1]
    for back in range(1, n):
        ends = ends[tokens[ends - back] == tokens[-1 - back]]
    return int(ends[-1]) if ends.size else None
