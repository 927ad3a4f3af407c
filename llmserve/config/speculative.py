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
_NGRAM_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
               "disable_by_batch_size")
_DRAFT_KEYS = ("method", "model", "num_speculative_tokens", "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Up to ``num_speculative_tokens`` drafted per step, off while more than
    ``disable_by_batch_size`` sequences run (None: never off). ``method`` "ngram": the
    draft is copied from what followed the latest earlier occurrence of the sequence's
    last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``;
    "draft_model": a smaller ``model`` sharing the target's tokenizer (any form --model
    takes) proposes it greedily."""
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    disable_by_batch_size: int | None = None
    method: str = "ngram"
    model: str | None = None

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
        # vLLM's rule: a model given and no method means a draft model.
        method = value.get("method", "draft_model" if "model" in value else "ngram")
        if method in ("ngram", "[ngram]"):
            return cls._ngram(value)
        if method == "draft_model":
            return cls._draft_model(value)
        raise ValueError(f"speculative_config: method must be 'ngram' or 'draft_model' (the "
                         f"ones implemented), got {method!r}")

    @classmethod
    def _ngram(cls, value: dict) -> SpeculativeConfig:
        _known_keys(value, _NGRAM_KEYS, "ngram")
        k = _positive(value, "num_speculative_tokens", required=True)
        lo, hi = _positive(value, "prompt_lookup_min"), _positive(value, "prompt_lookup_max")
        # vLLM's defaults: 5 and 5; one given sets the other.
        lo, hi = lo or hi or 5, hi or lo or 5
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        return cls(k, hi, lo, _positive(value, "disable_by_batch_size"))

    @classmethod
    def _draft_model(cls, value: dict) -> SpeculativeConfig:
        _known_keys(value, _DRAFT_KEYS, "draft_model")
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model', the "
                             "draft model (any form --model takes)")
        k = _positive(value, "num_speculative_tokens", required=True)
        return cls(k, disable_by_batch_size=_positive(value, "disable_by_batch_size"),
                   method="draft_model", model=model)


def _known_keys(value: dict, known: tuple, method: str) -> None:
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown} for method {method!r}; "
                         f"known: {list(known)}")


def _positive(value: dict, key: str, required: bool = False) -> int | None:
    x = value.get(key)
    if x is None:
        if required:
            raise ValueError(f"speculative_config: {key} is required (a positive integer)")
        return None
    if not isinstance(x, int) or isinstance(x, bool) or x < 1:
        raise ValueError(f"speculative_config: {key} must be a positive integer, got {x!r}")
    return x
