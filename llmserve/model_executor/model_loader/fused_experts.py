"""Mixture-of-experts checkpoints that store every expert of a layer in one tensor
(transformers 5's in-memory layout, which some checkpoints are saved in):

- ``...experts.gate_up_proj [experts, 2 * I, hidden]``: each expert's gate rows, then
  its up rows;
- ``...experts.down_proj [experts, hidden, I]``.

The engine's experts are separate modules (``experts.{e}.gate_proj.weight`` ...), the
layout of most published checkpoints; ``split_fused_experts`` turns a fused tensor
into those, with this rank's rows (gate/up) or columns (down) only.
"""

from __future__ import annotations

import re

import torch

from llmserve.distributed.shapes import RankShape
from llmserve.errors import ModelLoadError

FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def is_fused_experts(name: str) -> bool:
    return FUSED.match(name) is not None


def split_fused_experts(name: str, tensor: torch.Tensor,
                        shard: RankShape | None) -> list[tuple[str, torch.Tensor]]:
    """(parameter name, tensor) of each expert's projection in fused tensor ``name``."""
    m = FUSED.match(name)
    prefix, kind = m["prefix"], m["kind"]
    if tensor.dim() != 3:
        raise ModelLoadError(f"fused expert tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected [experts, rows, columns]")
    rank, size = (shard.rank, shard.size) if shard is not None else (0, 1)
    out = []
    for e, block in enumerate(tensor):
        if kind == "gate_up_proj":
            gate, up = block.chunk(2, dim=0)
            rows = gate.shape[0] // size
            part = slice(rank * rows, (rank + 1) * rows)
            out += [(f"{prefix}.{e}.gate_proj.weight", gate[part]),
                    (f"{prefix}.{e}.up_proj.weight", up[part])]
        else:
            cols = block.shape[1] // size
            out.append((f"{prefix}.{e}.down_proj.weight",
                        block[:, rank * cols:(rank + 1) * cols]))
    return out
