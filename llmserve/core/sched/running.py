"""The running batch: the sequences that hold KV blocks on the device, in the order the
scheduler serves them (sorted by urgency at the start of each step; admitted and
forked ones join at the end).

Membership, ``append`` and ``remove`` are O(1), and so are the multi-LoRA question of
whether an adapter runs and the engine's counts of what runs (``tally``: kept as
sequences come and go).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from llmserve.core.sched.tally import SequenceTally

if TYPE_CHECKING:  # typing only: importing core.request would load torch
    from llmserve.core.request import Sequence


class RunningBatch:
    def __init__(self, urgency: Callable[[Sequence], tuple]):
        self._urgency = urgency
        self._seqs: dict[Sequence, tuple] = {}  # in serving order -> its urgency
        self.tally = SequenceTally()

    def append(self, seq: Sequence) -> None:
        if seq in self._seqs:
            raise ValueError(f"{seq} is already running")
        self._seqs[seq] = self._urgency(seq)
        self.tally.add(seq)

    def remove(self, seq: Sequence) -> None:
        del self._seqs[seq]
        self.tally.remove(seq)

    def sort(self) -> None:
        """Most urgent first."""
        self._seqs = dict(sorted(self._seqs.items(), key=lambda item: item[1]))

    def urgency_of(self, seq: Sequence) -> tuple:
        return self._seqs[seq]

    def runs_adapter(self, lora_int_id: int) -> bool:
        return self.tally.runs_adapter(lora_int_id)

    @property
    def num_adapters(self) -> int:
        """Distinct adapters running."""
        return self.tally.num_adapters

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
