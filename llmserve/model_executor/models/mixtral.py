"""Mixtral (8x7B, 8x22B): Mistral's attention with a sparse mixture-of-experts MLP in
every layer, its router's top-k always renormalised. The checkpoint's names differ
from the modules' (``block_sparse_moe.experts.{e}.w1/w3/w2`` are an expert's gate, up
and down projections; ``block_sparse_moe.gate`` the router): ``param_name`` maps them."""

from __future__ import annotations

import re

from llmserve.distributed.shapes import RankShape
from llmserve.model_executor.layers.fused_moe.layer import SparseMoeBlock
from llmserve.model_executor.models.llama import MLP, LlamaForCausalLM

_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def mixtral_mlp(config, layer_idx: int, shard: RankShape):
    return SparseMoeBlock(
        config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
        renormalize=True, tp_size=shard.size,
        make_expert=lambda: MLP(config, shard, intermediate=shard.moe_intermediate,
                                reduce=False))


class MixtralForCausalLM(LlamaForCausalLM):
    mlp_for_layer = staticmethod(mixtral_mlp)

    @staticmethod
    def param_name(checkpoint_name: str) -> str:
        name = checkpoint_name.replace(".block_sparse_moe.", ".mlp.")
        return re.sub(r"\.experts\.(\d+)\.(w[123])\.",
                      lambda m: f".experts.{m[1]}.{_EXPERT_PROJ[m[2]]}.", name)
