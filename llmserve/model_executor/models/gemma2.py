"""Gemma 2 (``Gemma2ForCausalLM``) on llama.py's decoder, where it computes differently:

- RMSNorm scales by ``1 + weight`` (the checkpoint stores the offset from one), in
  float32, rounded to the input's dtype after the product;
- the token embedding is scaled by sqrt(hidden_size), rounded to the embedding's dtype
  first (as transformers does: in bf16, 48.0 for a hidden size of 2304);
- the MLP gates with GELU (tanh approximation) instead of SiLU;
- each layer norms its attention's output and its MLP's input and output too
  (``post_attention_layernorm`` is a norm of the attention's output here, not of the
  residual stream), four norms a layer;
- attention scales by ``query_pre_attn_scalar ** -0.5``, soft-caps its logits
  (``attn_logit_softcapping``, llama.Attention's ``softcap``), and alternates sliding
  and global layers (``layer_types``, read by ``supported.layer_sliding_window``);
- the logits are soft-capped (``final_logit_softcapping``); the head is tied.

Gemma 3 (``gemma3.py``) builds on these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model_executor.layers.backends import Backends
from llmserve.model_executor.models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    RMSNorm,
)


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma2RMSNorm: ``x / rms(x) * (1 + w)`` in float32, then rounded.
    Torch's ops only: llama's C and Triton norms multiply by ``w`` itself."""

    def bind_backend(self, backends: Backends) -> None:
        super().bind_backend(Backends())

    def _norm_torch(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(Attention):
    """llama's attention, scaled by ``query_pre_attn_scalar ** -0.5`` (not by head_dim)."""

    def __init__(self, config, layer_idx: int, shard):
        super().__init__(config, layer_idx, shard)
        self.scale = config.query_pre_attn_scalar ** -0.5


class GemmaMLP(MLP):
    """gate/up/down as llama's, the gate through GELU's tanh approximation
    (``gelu_pytorch_tanh``): torch's ops only (the Triton and C kernels are SiLU's)."""

    def bind_backend(self, backends: Backends) -> None:
        super().bind_backend(Backends())

    def _act_torch(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gemma_mlp(config, layer_idx: int, shard) -> nn.Module:
    return GemmaMLP(config, shard)


class GemmaDecoderLayer(DecoderLayer):
    """Norms before and after both the attention and the MLP (sandwich norms)."""

    attention_class = GemmaAttention
    norm_class = GemmaRMSNorm

    def __init__(self, config, layer_idx: int, shard, mlp_for_layer=gemma_mlp):
        super().__init__(config, layer_idx, shard, mlp_for_layer)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin):
        """As llama's DecoderLayer: ``x`` is the previous layer's output still to be
        added to the residual stream (None before the first layer)."""
        if x is not None:
            residual = residual + x
        attn = self.self_attn(self.input_layernorm(residual), cos, sin)
        residual = residual + self.post_attention_layernorm(attn)
        out = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(out), residual


class GemmaModel(LlamaModel):
    layer_class = GemmaDecoderLayer

    def __init__(self, config, max_positions: int, shard, mlp_for_layer=gemma_mlp):
        super().__init__(config, max_positions, shard, mlp_for_layer)
        # A float, not a buffer: the model is built on the meta device and materialised
        # empty, which would leave a buffer garbage.
        self.embed_scale = config.hidden_size ** 0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings times sqrt(hidden) rounded to their dtype first (bf16: 48.0
        for 2304), as transformers multiplies."""
        x = self.embed_tokens(input_ids)
        return x * float(torch.tensor(self.embed_scale).to(x.dtype))


class Gemma2ForCausalLM(LlamaForCausalLM):
    mlp_for_layer = staticmethod(gemma_mlp)
    model_class = GemmaModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """llama's logits, soft-capped: ``cap * tanh(logits / cap)``."""
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap
