"""Mixture-of-experts checkpoints that store every expert of a layer in one tensor
(transformers 5's in-memory layout, which some checkpoints are saved in):

- ``...experts.gate_up_proj [experts, 2 * I, hidden]``: each expert's gate rows, then
  its up rows;
- ``...experts.down_proj [experts, hidden, I]``.

The engine's experts are separate modules (``experts.{e}.gate_proj.weight`` ...), the
layout of most published checkpoints; ``split_fused_experts`` turns a fused tensor
into those, with this rank's rows (gate/up) or columns (down) only.

gpt-oss's experts are stored transposed, with gate and up columns interleaved and
biases beside them (``split_interleaved_experts``); its model holds them as loaded and
splits them after loading, since the biases (and MXFP4's scales) come as tensors of
their own.
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


def split_interleaved_experts(gate_up: torch.Tensor, gate_up_bias: torch.Tensor,
                              down: torch.Tensor, down_bias: torch.Tensor,
                              shard: RankShape | None) -> list[dict[str, torch.Tensor]]:
    """gpt-oss's fused expert tensors (transformers 5's ``GptOssExperts``, and its
    MXFP4 checkpoints once dequantised) as each expert's ``nn.Linear`` weights, this
    rank's share only:

    - ``gate_up [experts, hidden, 2 * I]`` (x @ it), its gate and up columns
      interleaved (even: gate, odd: up), ``gate_up_bias [experts, 2 * I]``;
    - ``down [experts, I, hidden]``, ``down_bias [experts, hidden]``.

    Each expert gets ``gate_up_proj.weight [2 * I/N, hidden]`` (this rank's gate rows,
    then its up rows), ``gate_up_proj.bias``, ``down_proj.weight [hidden, I/N]`` and
    ``down_proj.bias``: the rank's outputs are summed over the ranks, so the bias is
    rank 0's, zeros on the others."""
    rank, size = (shard.rank, shard.size) if shard is not None else (0, 1)
    experts, _, width = gate_up.shape
    if width % 2 or down.shape[0] != experts or down.shape[1] * 2 != width:
        raise ModelLoadError(f"gpt-oss expert tensors of shapes {tuple(gate_up.shape)} and "
                             f"{tuple(down.shape)}: expected [experts, hidden, 2 * I] and "
                             f"[experts, I, hidden]")
    rows = width // 2 // size
    part = slice(rank * rows, (rank + 1) * rows)
    out = []
    for e in range(experts):
        gate, up = gate_up[e, :, 0::2][:, part], gate_up[e, :, 1::2][:, part]
        bias = gate_up_bias[e]
        out.append({
            "gate_up_proj.weight": torch.cat([gate.t(), up.t()]),
            "gate_up_proj.bias": torch.cat([bias[0::2][part], bias[1::2][part]]),
            "down_proj.weight": down[e, part].t(),
            "down_proj.bias": down_bias[e] if rank == 0 else torch.zeros_like(down_bias[e]),
        })
    return out
