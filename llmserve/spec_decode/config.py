"""``--speculative-config``: vLLM's JSON shape, checked once at start-up. Imports nothing
of llmserve, so that ``llmserve.config`` can use it without climbing the layers."""

from __future__ import annotations

import json
from dataclasses import dataclass

# Engine settings speculation cannot be combined with yet (EngineConfig refuses them).
UNSUPPORTED_WITH = {
    "async_scheduling": "--async-scheduling (the draft depends on the token in flight)",
    "tensor_parallel_size": "--tensor-parallel-size > 1 (the workers would need the drafts)",
    "kv_role": "--kv-role prefill|decode (P/D hand-off of a partly accepted step)",
    "check_kv_integrity": "--check-kv-integrity (it hashes slots that are rolled back)",
}
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram speculation: up to ``num_speculative_tokens`` drafted per step, copied
    from what followed the latest earlier occurrence of the sequence's last n tokens,
    n from ``prompt_lookup_max`` down to ``prompt_lookup_min``; off while more than
    ``disable_by_batch_size`` sequences run (None: never off)."""
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = None
    method: str = "ngram"

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the CLI's JSON string or the Python API's dict; ValueError naming the
        key at fault."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object (a dict), e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        if "model" in value:
            raise ValueError("speculative_config: draft models ('model') are not implemented "
                             'yet; only n-gram (prompt lookup) speculation is: '
                             '{"method": "ngram", "num_speculative_tokens": K}')
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {list(_KEYS)}")
        method = value.get("method", "ngram")
        if method not in ("ngram", "[ngram]"):
            raise ValueError(f"speculative_config: method must be 'ngram' (the only one "
                             f"implemented), got {method!r}")
        k = _positive(value, "num_speculative_tokens", required=True)
        lo, hi = _positive(value, "prompt_lookup_min"), _positive(value, "prompt_lookup_max")
        # vLLM's defaults: 5 and 5; one given sets the other.
        lo, hi = lo or hi or 5, hi or lo or 5
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        return cls(k, hi, lo, _positive(value, "disable_by_batch_size"))


def _positive(value: dict, key: str, required: bool = False) -> int | None:
    x = value.get(key)
    if x is None:
        if required:
            raise ValueError(f"speculative_config: {key} is required (a positive integer)")
        return None
    if not isinstance(x, int) or isinstance(x, bool) or x < 1:
        raise ValueError(f"speculative_config: {key} must be a positive integer, got {x!r}")
    return x
