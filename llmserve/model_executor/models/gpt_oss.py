"""gpt-oss (gpt-oss-20b, gpt-oss-120b): Llama's decoder with

- attention: q/k/v/o biases, sliding windows on alternate layers (``layer_types``),
  YaRN rotary (``llama.rope_inv_freq``), and a learned per-head sink logit in every
  softmax's denominator;
- a sparse mixture-of-experts MLP in every layer (``GptOssMoeBlock``): a router with a
  bias whose softmax is taken over the top k logits only (``routing.top_k_softmax``),
  and experts with biases and a clamped SwiGLU (``fused_moe.layer.clamped_swiglu``),
  each run on its own tokens by ``SparseMoeBlock``.

The checkpoint stores each layer's experts fused (``mlp.experts.gate_up_proj
[experts, hidden, 2I]``, gate and up columns interleaved, ``down_proj [experts, I,
hidden]``, and their biases), in float, or in MXFP4 (``*_blocks`` / ``*_scales``,
``model_loader/mxfp4.py``). The block holds those tensors as loaded (``packed``) and
``fuse()`` turns them into per-expert Linears, this rank's rows only: dequantised,
de-interleaved, transposed (``fused_experts.split_interleaved_experts``). From then on
the experts are fused, quantised (int8/int4) and sharded like any other. The grouped
Triton MoE kernel computes neither biases nor the clamp, so gpt-oss keeps the
per-expert path on CUDA too.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.distributed.shapes import RankShape
from llmserve.model_executor.layers.fused_moe.layer import SparseMoeBlock, clamped_swiglu
from llmserve.model_executor.layers.fused_moe.routing import top_k_softmax
from llmserve.model_executor.model_loader import mxfp4
from llmserve.model_executor.model_loader.fused_experts import split_interleaved_experts
from llmserve.model_executor.model_loader.weights import empty_model_init
from llmserve.model_executor.models.llama import LlamaForCausalLM

SWIGLU_ALPHA = 1.702  # configs before transformers 5 do not state it


class GptOssExpert(nn.Module):
    """One expert: ``gate_up_proj`` (this rank's gate rows, then its up rows, with
    biases), the clamped SwiGLU, ``down_proj`` (with a bias, rank 0's only)."""

    def __init__(self, weights: dict[str, torch.Tensor], alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = _linear(weights["gate_up_proj.weight"], weights["gate_up_proj.bias"])
        self.down_proj = _linear(weights["down_proj.weight"], weights["down_proj.bias"])
        self.intermediate = self.down_proj.in_features
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(clamped_swiglu(gate, up, self.alpha, self.limit))


def _linear(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """A Linear holding copies of ``weight`` and ``bias`` (never views: they would keep
    the checkpoint's whole fused tensors alive), with no random initialisation first."""
    with empty_model_init():
        linear = nn.Linear(weight.shape[1], weight.shape[0])
    linear.weight = nn.Parameter(weight.to(bias.dtype).clone(memory_format=torch.contiguous_format))
    linear.bias = nn.Parameter(bias.clone(memory_format=torch.contiguous_format))
    return linear


class CheckpointExperts(nn.Module):
    """A layer's expert tensors in the checkpoint's fused layout, until ``fuse()``:
    float ``gate_up_proj`` / ``down_proj``, or MXFP4 ``*_blocks`` / ``*_scales``
    (uint8: the model's dtype casts leave them as they are), and the biases."""

    def __init__(self, config, packed: bool):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.packed = packed
        if packed:
            for name, (rows, cols) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
                blocks, scales = mxfp4.packed_shapes(e, rows, cols)
                self.register_parameter(f"{name}_blocks", _codes(blocks))
                self.register_parameter(f"{name}_scales", _codes(scales))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
            self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))

    def weight(self, name: str) -> torch.Tensor:
        """``name``'s float values, ``[experts, in, out]``, in the biases' dtype."""
        dtype = self.gate_up_proj_bias.dtype
        if self.packed:
            return mxfp4.dequantize(getattr(self, f"{name}_blocks"),
                                    getattr(self, f"{name}_scales"), dtype)
        return getattr(self, name)


def _codes(shape: tuple) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)


class GptOssMoeBlock(SparseMoeBlock):
    """A ``SparseMoeBlock`` with gpt-oss's router (biased, softmax after the top k) whose
    experts are built by ``fuse()`` from the checkpoint's tensors (``packed``)."""

    def __init__(self, config, shard: RankShape):
        super().__init__(config.hidden_size, config.num_local_experts,
                         config.num_experts_per_tok, renormalize=False, make_expert=None,
                         tp_size=shard.size, router_bias=True)
        self.shard = shard
        self.alpha = getattr(config, "swiglu_alpha", None) or SWIGLU_ALPHA
        self.limit = config.swiglu_limit
        self.packed = CheckpointExperts(config, mxfp4.is_mxfp4(config))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return top_k_softmax(self.gate(x), self.top_k)

    def fuse(self) -> None:
        """After loading: the checkpoint's tensors become this rank's experts."""
        p = self.packed
        with torch.no_grad():
            parts = split_interleaved_experts(p.weight("gate_up_proj"), p.gate_up_proj_bias,
                                              p.weight("down_proj"), p.down_proj_bias,
                                              self.shard)
            self.experts = nn.ModuleList(GptOssExpert(w, self.alpha, self.limit)
                                         for w in parts)
        del self.packed

    def use_triton_kernel(self) -> bool:
        """The grouped Triton kernel computes SiLU x up without biases: not this."""
        return False


def gpt_oss_mlp(config, layer_idx: int, shard: RankShape) -> GptOssMoeBlock:
    return GptOssMoeBlock(config, shard)


class GptOssForCausalLM(LlamaForCausalLM):
    mlp_for_layer = staticmethod(gpt_oss_mlp)

    @staticmethod
    def param_name(checkpoint_name: str) -> str:
        """The router is the block's ``gate``; the fused experts its ``packed``."""
        return (checkpoint_name.replace(".mlp.router.", ".mlp.gate.")
                .replace(".mlp.experts.", ".mlp.packed."))
