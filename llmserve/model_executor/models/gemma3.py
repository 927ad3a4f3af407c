"""Gemma 3, its text model (``Gemma3ForCausalLM``): Gemma 2's decoder (``gemma2.py``)
with

- per-head q/k norms (Gemma's ``1 + weight`` RMSNorm over head_dim) before the rotary;
- two rotaries: the sliding (local) layers turn by their own base
  (``rope_local_base_freq``) and never scale; the global layers by ``rope_theta``,
  with the checkpoint's rope scaling (linear x8 on the 4B-27B models). transformers 5
  keeps the two under the layer types in ``rope_parameters``; 4.x in ``rope_theta`` /
  ``rope_scaling`` and ``rope_local_base_freq``: both are read;
- five local layers to one global (``layer_types``), no soft-capping by default
  (``attn_logit_softcapping`` / ``final_logit_softcapping`` still honoured if set).

The vision-language checkpoint (``Gemma3ForConditionalGeneration``) is refused at
start-up (``supported.py``), naming this class.
"""

from __future__ import annotations

import copy

import torch

from llmserve.model_executor.models.gemma2 import (
    Gemma2ForCausalLM,
    GemmaAttention,
    GemmaDecoderLayer,
    GemmaModel,
    GemmaRMSNorm,
    gemma_mlp,
)
from llmserve.model_executor.models.llama import RotaryEmbedding
from llmserve.model_executor.models.supported import layer_type_ropes, rope_params

LOCAL, GLOBAL = "sliding_attention", "full_attention"


class Gemma3Attention(GemmaAttention):
    def __init__(self, config, layer_idx: int, shard):
        super().__init__(config, layer_idx, shard)
        # One weight for every head (replicated across ranks), as llama's Qwen3 norms.
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_class = Gemma3Attention


def rope_config(config, layer_type: str):
    """A copy of ``config`` that llama's rotary reads as the rope of ``layer_type``
    layers: that type's parameters and base, and no scaling for the local layers of a
    4.x config (which scales the global ones only)."""
    nested = layer_type_ropes(config)
    if nested:
        rope = dict(nested.get(layer_type) or {})
    elif layer_type == GLOBAL:
        rope = dict(rope_params(config), rope_theta=getattr(config, "rope_theta", 1e6))
    else:
        rope = {"rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    rope.setdefault("rope_type", rope.pop("type", "default"))
    view = copy.copy(config)
    view.rope_parameters = rope
    view.rope_theta = rope.get("rope_theta", 10000.0)
    return view


class Gemma3Model(GemmaModel):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config, max_positions: int, shard, mlp_for_layer=gemma_mlp):
        super().__init__(config, max_positions, shard, mlp_for_layer)
        self.layer_types = list(config.layer_types)
        # Each layer type's cos/sin tables, float32, built on the CPU here. Kept out of
        # the module tree (a plain dict): the model is built on the meta device and
        # materialised empty, and the runner then rebuilds ``rotary`` (llama's one rope)
        # alone; these move to the positions' device on first use.
        self.layer_ropes = {kind: RotaryEmbedding(rope_config(config, kind), max_positions)
                            for kind in (LOCAL, GLOBAL)}

    def forward(self, input_ids, positions):
        """llama's stack (Gemma never takes the native decoder), each layer with the
        rotary of its type."""
        x = self.embed(input_ids)
        ropes = {kind: self._rope(kind, positions) for kind in (LOCAL, GLOBAL)}
        out, residual = None, x
        for layer, kind in zip(self.layers, self.layer_types):
            out, residual = self.run_layer(layer, out, residual, *ropes[kind])
        return self.norm.add_and_norm(residual, out)[1]

    def _rope(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.layer_ropes[kind]
        if rope.cos.device != positions.device:
            rope = self.layer_ropes[kind] = rope.to(positions.device)
        return rope(positions)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class = Gemma3Model

