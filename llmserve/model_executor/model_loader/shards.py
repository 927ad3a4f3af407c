"""Tensor-parallel loading: which rows and columns of a checkpoint tensor this rank holds
(the shape arithmetic is ``llmserve.distributed.shapes``)."""

from __future__ import annotations

import torch

from llmserve.distributed.shapes import RankShape


def read_shard(handle, name: str, shape: RankShape, head_dim: int,
               param: str | None = None) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``name`` (which fills parameter ``param``,
    by default the same name), reading only that part from the safetensors file
    (``get_slice``)."""
    return shard_of(handle.get_slice(name), shape, head_dim, param or name)


def shard_of(sl, shape: RankShape, head_dim: int, param: str) -> torch.Tensor:
    """This rank's part of ``sl``, everything that fills parameter ``param`` on one
    rank (a safetensors slice, or a tensor: both index alike):

    - column-parallel (output rows split): q/k/v (weights and biases, by head),
      gate/up (by MLP row; an expert's by its own rows), embedding and LM head (by
      vocabulary row, padded);
    - row-parallel (input columns split): o_proj, down_proj; their bias (if any) is
      added once, on rank 0, since the ranks' outputs are summed;
    - attention sinks (one per query head) by head;
    - everything else (norms, a MoE router) whole."""
    if param.endswith("self_attn.sinks"):
        return sl[shape.head_start:shape.head_start + shape.num_heads]
    leaf = param.split(".")[-2]  # the module: q_proj, o_proj, embed_tokens, lm_head, ...
    is_bias = param.endswith(".bias")
    rows = shape.moe_intermediate if ".experts." in param else shape.intermediate
    if leaf in ("embed_tokens", "lm_head"):
        rows = sl[shape.vocab_start:shape.vocab_end]
        pad = shape.vocab_per_rank - rows.shape[0]
        return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]) if pad else rows
    if leaf == "q_proj":
        a = shape.head_start * head_dim
        return sl[a:a + shape.num_heads * head_dim]
    if leaf in ("k_proj", "v_proj"):
        a = shape.kv_head_start * head_dim
        return sl[a:a + shape.num_kv_heads * head_dim]
    if leaf in ("gate_proj", "up_proj"):
        return sl[shape.rank * rows:(shape.rank + 1) * rows]
    if leaf in ("o_proj", "down_proj"):
        if is_bias:
            full = sl[:]
            return full if shape.rank == 0 else torch.zeros_like(full)
        width = shape.num_heads * head_dim if leaf == "o_proj" else rows
        a = shape.rank * width
        return sl[:, a:a + width]
    return sl[:]
