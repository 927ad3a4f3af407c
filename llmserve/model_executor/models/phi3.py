"""Phi-3 (mini/medium, 4k and 128k), Phi-3.5-mini, Phi-4-mini: Llama's arithmetic, with
LongRoPE in the long-context variants (``llama.rope_inv_freq``; served up to the
pretraining context, ``supported._rope``). The checkpoint stacks the projections Llama
keeps apart: ``self_attn.qkv_proj`` is q's rows, then k's, then v's, and
``mlp.gate_up_proj`` gate's rows, then up's. ``fused_parts`` tells the loader so: it
splits them into the modules' q/k/v and gate/up (each rank taking its heads' and its MLP
rows), which ``fuse()`` joins again after loading, as for every Llama.

Phi-4-mini turns only the first 3/4 of each head (``partial_rotary_factor``). The
engine's rotary (every path: C, Triton, torch) pairs dim i with dim i + head_dim/2;
rather than teach each kernel another pairing, ``fuse()`` reorders the dims of every
q and k head so that the pairs transformers turns sit there, and the cos/sin tables
turn the other dims by nothing (``llama.RotaryEmbedding``)."""

from __future__ import annotations

import torch

from llmserve.model_executor.models.llama import LlamaForCausalLM, rotary_dim


def partial_rotary_order(head_dim: int, rot: int) -> torch.Tensor:
    """A head's dims in the order that puts transformers' rotary pairs (i, i + rot/2),
    i < rot/2, at the engine's (i, i + head_dim/2): the first half holds the pairs'
    first dims, then half of the dims left unturned; the second half the partners,
    then the other unturned ones. q and k in the same order keep every q.k product
    (so the attention) as it was; v keeps its order."""
    half, rot_half = head_dim // 2, rot // 2
    unturned = torch.arange(rot, head_dim)
    return torch.cat([torch.arange(rot_half), unturned[:half - rot_half],
                      torch.arange(rot_half, rot), unturned[half - rot_half:]])


class Phi3ForCausalLM(LlamaForCausalLM):
    def fused_parts(self, name: str) -> list[tuple[str, int]] | None:
        """The parameters checkpoint tensor ``name`` stacks, with their row counts."""
        c = self.config
        if name.endswith(".self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [(prefix + "q_proj.weight", q), (prefix + "k_proj.weight", kv),
                    (prefix + "v_proj.weight", kv)]
        if name.endswith(".mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            rows = c.intermediate_size
            return [(prefix + "gate_proj.weight", rows), (prefix + "up_proj.weight", rows)]
        return None

    def fuse(self) -> None:
        head_dim = self.config.head_dim
        rot = rotary_dim(self.config)
        if rot < head_dim:  # after loading, before q/k/v are joined (and quantised)
            order = partial_rotary_order(head_dim, rot)
            for layer in self.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    w = proj.weight
                    heads = w.view(-1, head_dim, w.shape[1])  # a rank holds whole heads
                    with torch.no_grad():
                        w.copy_(heads[:, order.to(w.device)].reshape(w.shape))
        super().fuse()
