"""The running batch: the sequences that hold KV blocks on the device, in the order the
scheduler serves them (sorted by urgency at the start of each step; admitted and
forked ones join at the end).

Membership, ``append`` and ``remove`` are O(1), and so is the multi-LoRA question of
whether an adapter runs (how many sequences of each adapter run is kept as they come
and go).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing only: importing core.request would load torch
    from llmserve.core.request import Sequence


class RunningBatch:
    def __init__(self, urgency: Callable[[Sequence], tuple]):
        self._urgency = urgency
        self._seqs: dict[Sequence, tuple] = {}  # in serving order -> its urgency
        self._adapters: Counter[int] = Counter()  # lora_int_id -> running sequences

    def append(self, seq: Sequence) -> None:
        if seq in self._seqs:
            raise ValueError(f"{seq} is already running")
        self._seqs[seq] = self._urgency(seq)
        if seq.request.lora is not None:
            self._adapters[seq.request.lora.lora_int_id] += 1

    def remove(self, seq: Sequence) -> None:
        del self._seqs[seq]
        lora = seq.request.lora
        if lora is not None:
            self._adapters[lora.lora_int_id] -= 1
            if not self._adapters[lora.lora_int_id]:
                del self._adapters[lora.lora_int_id]

    def sort(self) -> None:
        """Most urgent first."""
        self._seqs = dict(sorted(self._seqs.items(), key=lambda item: item[1]))

    def urgency_of(self, seq: Sequence) -> tuple:
        return self._seqs[seq]

    def runs_adapter(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters

    @property
    def num_adapters(self) -> int:
        """Distinct adapters running."""
        return len(self._adapters)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs

    def __getitem__(self, index: int) -> Sequence:
        """The ``index``-th in serving order (O(n): for inspection)."""
        return list(self._seqs)[index]

    def __repr__(self) -> str:
        return f"RunningBatch({list(self._seqs)!r})"
