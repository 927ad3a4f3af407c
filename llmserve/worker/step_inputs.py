"""The step message: a step's flat batch as plain lists, built once by rank 0 and sent
to every tensor-parallel rank (a few KB pickled per step, not per layer)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepInputs:
    """A step's flat batch as plain lists: what every rank builds its tensors from."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    max_query_len: int
    # Rows whose logits give prompt logprobs (rank 0 computes them after sample_rows).
    prompt_rows: list[int] = field(default_factory=list)
    # The prompt token each of those rows scores, and the most alternatives any asks.
    prompt_targets: list[int] = field(default_factory=list)
    prompt_top: int = 0
    # Async scheduling: rows of input_ids whose token is still on the device, and the
    # row of the previous step's token tensor that holds each.
    pending_rows: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)
    # Multi-LoRA: each sequence's adapter slot (-1: the base model), and the adapters
    # rank 0 placed in slots for this step, (slot, adapter id, parsed adapter), which
    # every rank loads (the weights travel with the step: no rank reads a source).
    lora_slots: list[int] = field(default_factory=list)
    lora_loads: list = field(default_factory=list)
