"""Phi-3 (mini/medium, 4k and 128k), Phi-3.5-mini, Phi-4-mini: Llama's arithmetic, with
LongRoPE in the long-context variants (``llama.rope_inv_freq``; served up to the
pretraining context, ``supported._rope``). The checkpoint stacks the projections Llama
keeps apart: ``self_attn.qkv_proj`` is q's rows, then k's, then v's, and
``mlp.gate_up_proj`` gate's rows, then up's. ``fused_parts`` tells the loader so: it
splits them into the modules' q/k/v and gate/up (each rank taking its heads' and its MLP
rows), which ``fuse()`` joins again after loading, as for every Llama."""

from __future__ import annotations

from llmserve.model_executor.models.llama import LlamaForCausalLM


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
