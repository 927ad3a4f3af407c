"""What a collection of sequences holds (the running batch, a queue), kept as sequences
come and go, so that neither the scheduler nor the engine's stats scan it: how many
sequences of each request and of each adapter it holds, and their prompt tokens.

Invariant: every count equals what a scan of the collection's sequences would give."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing only: importing core.request would load torch
    from llmserve.core.request import Sequence


class SequenceTally:
    __slots__ = ("_requests", "_adapters", "_names", "prompt_tokens")

    def __init__(self):
        self._requests: Counter[str] = Counter()  # request id -> its sequences here
        self._adapters: Counter[int] = Counter()  # lora_int_id -> its sequences here
        self._names: dict[int, str] = {}  # lora_int_id -> the adapter's name
        self.prompt_tokens = 0

    def add(self, seq: Sequence) -> None:
        self._requests[seq.request.request_id] += 1
        lora = seq.request.lora
        if lora is not None:
            self._adapters[lora.lora_int_id] += 1
            self._names[lora.lora_int_id] = lora.lora_name
        self.prompt_tokens += seq.num_prompt_tokens

    def remove(self, seq: Sequence) -> None:
        _drop(self._requests, seq.request.request_id)
        lora = seq.request.lora
        if lora is not None and not _drop(self._adapters, lora.lora_int_id):
            del self._names[lora.lora_int_id]
        self.prompt_tokens -= seq.num_prompt_tokens

    @property
    def num_requests(self) -> int:
        """Distinct requests (parallel samples and beams share one)."""
        return len(self._requests)

    def runs_adapter(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters

    @property
    def num_adapters(self) -> int:
        """Distinct adapters."""
        return len(self._adapters)

    def adapter_names(self) -> list[str]:
        return sorted(set(self._names.values()))


def _drop(counter: Counter, key) -> int:
    """One fewer of ``key``; how many are left (none: the key is gone)."""
    counter[key] -= 1
    left = counter[key]
    if not left:
        del counter[key]
    return left
