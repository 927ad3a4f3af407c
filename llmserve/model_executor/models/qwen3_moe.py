"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms,
``llama.has_qk_norm``) with a sparse mixture-of-experts MLP in every layer but those
``mlp_only_layers`` names (and, with ``decoder_sparse_step`` > 1, all but every
step-th). The router's top-k is renormalised where ``norm_topk_prob`` says so. The
checkpoint names each expert's projections ``mlp.experts.{e}.{gate,up,down}_proj``,
the router ``mlp.gate``: the modules here carry the same names."""

from __future__ import annotations

from llmserve.distributed.shapes import RankShape
from llmserve.model_executor.layers.fused_moe.layer import SparseMoeBlock
from llmserve.model_executor.models.llama import MLP, LlamaForCausalLM


def is_sparse_layer(config, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


def qwen3_moe_mlp(config, layer_idx: int, shard: RankShape):
    if not is_sparse_layer(config, layer_idx):
        return MLP(config, shard)
    return SparseMoeBlock(
        config.hidden_size, config.num_experts, config.num_experts_per_tok,
        renormalize=bool(config.norm_topk_prob), tp_size=shard.size,
        make_expert=lambda: MLP(config, shard, intermediate=shard.moe_intermediate,
                                reduce=False))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    mlp_for_layer = staticmethod(qwen3_moe_mlp)
