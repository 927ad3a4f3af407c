"""The scheduler's output: one step's batch, what the worker runs. Kept apart from the
scheduler, as vLLM's v1 core does, so that the worker reads it without the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.core.block_manager import BlockOp
from llmserve.core.request import Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Block moves to apply before the forward, in this order.
    block_ops: list[BlockOp] = field(default_factory=list)
    predicted_s: float | None = None  # the cost model's duration for this step

    @property
    def kv_tokens(self) -> int:
        """Context tokens the step's attention reads."""
        return sum(s.num_computed_tokens + n for s, n in zip(self.seqs, self.num_new_tokens))

    @property
    def has_block_ops(self) -> bool:
        return bool(self.block_ops)

    def ops_of(self, kind: str) -> list[tuple[int, int]]:
        return [(op.src, op.dst) for op in self.block_ops if op.kind == kind]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_new: int) -> None:
        # A sequence in a step computes at least one token: the worker lays out rows by
        # these counts, and a zero would reach the CPU kernels as an empty query (a
        # crash, or heap corruption) instead of an error naming the scheduler's bug.
        if num_new < 1:
            raise ValueError(f"sequence {seq.seq_id} scheduled with {num_new} new tokens; "
                             f"a scheduled sequence computes at least 1")
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)

    def group_by_adapter(self) -> None:
        """Multi-LoRA: the sequences of each adapter next to each other (the base
        model's first, then by adapter id, each group in its scheduled order), so that
        the flat batch holds each adapter's rows as one block: the CPU's batched LoRA
        reads and writes them in place instead of gathering them."""
        order = sorted(range(len(self.seqs)), key=lambda i: _adapter_id(self.seqs[i]))
        self.seqs = [self.seqs[i] for i in order]
        self.num_new_tokens = [self.num_new_tokens[i] for i in order]


def _adapter_id(seq: Sequence) -> int:
    lora = seq.request.lora
    return lora.lora_int_id if lora is not None else 0
