"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral, SmolLM) over a paged KV cache.
Families that differ only in their MLP (mixture-of-experts: ``qwen3_moe.py``,
``mixtral.py``) reuse it with their own ``mlp_for_layer``.

The batch is flat: ``input_ids`` and ``positions`` hold the new tokens of every
scheduled sequence back to back; attention finds each sequence's past through
the block tables in the step's attention metadata. Parameter names follow the
Hugging Face checkpoints, so safetensors load by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.distributed import comm
from llmserve.distributed.shapes import RankShape, rank_shape
from llmserve.kernels.cpu.native import add_rms_norm, silu_and_mul
from llmserve.model_executor.layers.attention import (
    c_rope_attention,
    fused_rope_attention,
    paged_attention,
    step_metadata,
)
from llmserve.model_executor.layers.backends import COMPILED, Backend, Backends, bind_backends
from llmserve.model_executor.models.supported import (
    layer_sliding_window,
    rope_params,
    rope_type,
)


class RMSNorm(nn.Module):
    """Llama's RMSNorm, and the residual add fused into it (``add_and_norm``), by the
    implementation bound at load (``bind_backend``): torch's, the C kernel's (one call
    instead of ~8 ops) or Triton's."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.bind_backend(Backends())

    def bind_backend(self, backends: Backends) -> None:
        self.backend = backends.norm(self.weight)
        self._norm, self._add_and_norm = {
            Backend.TORCH: (self._norm_torch, self._add_and_norm_torch),
            Backend.C: (self._norm_c, self._add_and_norm_c),
            Backend.TRITON: (self._norm_triton, self._add_and_norm_triton),
        }[self.backend]

    @property
    def fused(self) -> bool:
        return self.backend is Backend.TRITON

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
        """(x + delta, its norm): the residual add and the next norm."""
        return self._add_and_norm(x, delta)

    def _norm_torch(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def _add_and_norm_torch(self, x, delta):
        x = x + delta
        return x, self._norm_torch(x)

    def _norm_c(self, x):
        return add_rms_norm(x, self.weight, self.eps)[1]

    def _add_and_norm_c(self, x, delta):
        return add_rms_norm(x, self.weight, self.eps, delta)

    def _norm_triton(self, x):
        from llmserve.kernels.triton import fused
        return fused.rms_norm(x, self.weight, self.eps)

    def _add_and_norm_triton(self, x, delta):
        from llmserve.kernels.triton import fused
        normed, x = fused.add_rms_norm(delta, x, self.weight, self.eps)
        return x, normed


def rotary_dim(config) -> int:
    """How many of each head's dims the rotary turns: all, or the first
    ``partial_rotary_factor`` of them (Phi-4-mini: 3/4; transformers 5 keeps the
    factor in ``rope_parameters``)."""
    factor = (getattr(config, "partial_rotary_factor", None)
              or rope_params(config).get("partial_rotary_factor") or 1.0)
    return int(config.head_dim * factor)


def rope_inv_freq(config) -> torch.Tensor:
    """Inverse frequencies of the rotated dims' pairs, with Llama 3's long-context
    scaling, LongRoPE's short factors (Phi-3) or YaRN (gpt-oss) when configured."""
    dim = rotary_dim(config)
    base = getattr(config, "rope_theta", None) or rope_params(config).get("rope_theta", 10000.0)
    # float32 throughout, as transformers computes it, so positions agree bit for bit.
    # On the CPU explicitly: the model is built on the meta device, where this
    # arithmetic would go through torch's Python references (and import TorchDynamo).
    arange = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (base ** (arange.float() / dim))
    scaling = rope_params(config)
    kind = rope_type(config)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "longrope":
        # transformers switches to the long factors once a sequence passes
        # original_max_position_embeddings; supported._rope caps max_model_len there.
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / (short * base ** (arange.float() / dim))  # its rounding order
    elif kind == "yarn":
        # transformers' own function: its ramp between beta_fast and beta_slow,
        # ``truncate`` and mscale variants are many details to get bit for bit. On the
        # CPU (it makes its tensors on the default device: meta while the model builds).
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        with torch.device("cpu"):
            inv_freq = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")[0]
    elif kind != "default":  # supported.check_model_config refuses it at start-up
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq.float()


def rope_attention_factor(config) -> float:
    """The factor LongRoPE and YaRN multiply cos and sin by (so every attention logit
    by its square), transformers' ``_compute_longrope_parameters`` /
    ``_compute_yarn_parameters``; 1 for the other types."""
    if rope_type(config) == "yarn":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        with torch.device("cpu"):
            return float(ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")[1])
    if rope_type(config) != "longrope":
        return 1.0
    scaling = rope_params(config)
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    # The pretraining context; transformers prefers Phi-3's top-level copy of it.
    original = (getattr(config, "original_max_position_embeddings", None)
                or scaling["original_max_position_embeddings"])
    # Phi-3 states no factor: the context it was extended to over the one it was trained on.
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """cos/sin table for every position; a step gathers its rows once for all layers."""

    def __init__(self, config, max_positions: int):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, rope_inv_freq(config))
        factor = rope_attention_factor(config)
        cos, sin = freqs.cos() * factor, freqs.sin() * factor
        # Partial rotary: the model orders each q/k head so that the rotated pairs come
        # first in each half (phi3.partial_rotary_order); the rest turn by nothing.
        still = config.head_dim // 2 - freqs.shape[1]
        if still:
            cos, sin = F.pad(cos, (0, still), value=1.0), F.pad(sin, (0, still))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T,1,d/2]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's "rotate half" convention (the two halves of each head form
    pairs), computed in float32 as transformers does."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def has_qk_norm(config) -> bool:
    """Qwen3's RMSNorm of each query and key head (over head_dim) before the rotary."""
    return config.model_type in ("qwen3", "qwen3_moe")


def has_attention_sinks(config) -> bool:
    """gpt-oss's learned logit per query head (``self_attn.sinks``), which joins the
    softmax's denominator and owns no value row."""
    return config.model_type == "gpt_oss"


class Attention(nn.Module):
    """This rank's query heads and the KV heads they read; with several ranks the
    o_proj outputs (row-parallel) are summed over them."""

    def __init__(self, config, layer_idx: int, shard: RankShape):
        super().__init__()
        self.layer_idx = layer_idx
        self.tp_size = shard.size
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        bias = bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2")
        hidden = config.hidden_size
        # Loaded under the checkpoint's names, then fused into one GEMM (fuse()).
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.qkv_proj: nn.Linear | None = None
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden,
                                bias=bool(getattr(config, "attention_bias", False)))
        self.scale = self.head_dim ** -0.5
        self.sliding_window = layer_sliding_window(config, layer_idx)  # None: all keys
        # Gemma 2's cap on the scaled scores, cap * tanh(s / cap) (None: uncapped).
        self.softcap = getattr(config, "attn_logit_softcapping", None) or None
        # This rank's heads' sinks (the loader shards the checkpoint's by head). The
        # loader casts them to the model's dtype, as transformers keeps them; the
        # kernels compute with them in float32.
        self.sinks = (nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
                      if has_attention_sinks(config) else None)
        # Per-head norms (one weight shared by every head, so replicated across ranks).
        self.q_norm = self.k_norm = None
        if has_qk_norm(config):
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.kv_cache: torch.Tensor | None = None  # [2, blocks, block_size, kv_heads, d]
        self.bind_backend(Backends())

    def bind_backend(self, backends: Backends) -> None:
        """Rotary, K/V store and attention: torch's ops (Triton's attention on CUDA),
        the C kernels where the step's CPU plan is theirs, or --fused-kernels' Triton
        rotary + KV write."""
        self.backend = backends.attention()
        self._attend = {Backend.TORCH: self._attend_torch, Backend.C: self._attend_c,
                        Backend.TRITON: self._attend_triton}[self.backend]

    @property
    def fused(self) -> bool:
        return self.backend is Backend.TRITON

    def fuse(self) -> None:
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin):
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        return self._output(self._attend(qkv, cos, sin), t)

    def _variants(self) -> dict:
        return dict(window=self.sliding_window, sinks=self.sinks, softcap=self.softcap)

    def _attend_torch(self, qkv, cos, sin):
        qk = apply_rotary(qkv[:, :self.num_heads + self.num_kv_heads], cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        return paged_attention(q, k, v, self.kv_cache, self.scale, **self._variants())

    def _attend_c(self, qkv, cos, sin):
        if not step_metadata().plan.native:  # no row of this step is the C kernel's
            return self._attend_torch(qkv, cos, sin)
        return c_rope_attention(qkv, cos, sin, self.kv_cache, self.scale, self.num_heads,
                                **self._variants())

    def _attend_triton(self, qkv, cos, sin):
        return fused_rope_attention(qkv, cos, sin, self.kv_cache, self.scale, self.num_heads,
                                    **self._variants())

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with its query and key heads normalised (the paths below take it whole)."""
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return torch.cat([self.q_norm(q), self.k_norm(k), v], dim=1)

    def _output(self, o: torch.Tensor, t: int) -> torch.Tensor:
        out = self.o_proj(o.view(t, -1))
        return comm.all_reduce(out) if self.tp_size > 1 else out


class MLP(nn.Module):
    """gate/up column-parallel, down row-parallel: this rank's MLP rows. An expert of a
    mixture-of-experts block is one too (``intermediate``: its rows on this rank;
    ``reduce=False``: the block sums its experts' outputs over the ranks once)."""

    def __init__(self, config, shard: RankShape, intermediate: int | None = None,
                 reduce: bool = True):
        super().__init__()
        h, i = config.hidden_size, intermediate or shard.intermediate
        self.tp_size = shard.size if reduce else 1
        self.intermediate = i
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.gate_up_proj: nn.Linear | None = None
        self.down_proj = nn.Linear(i, h, bias=False)
        self.bind_backend(Backends())

    def bind_backend(self, backends: Backends) -> None:
        """SiLU(gate) x up: torch's split and two ops, the C kernel's one pass, or
        --fused-kernels' Triton kernel."""
        self.backend = backends.activation()
        self._activation = {Backend.TORCH: self._act_torch, Backend.C: self._act_c,
                            Backend.TRITON: self._act_triton}[self.backend]

    @property
    def fused(self) -> bool:
        return self.backend is Backend.TRITON

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x):
        out = self.down_proj(self._activation(self.gate_up_proj(x)))
        return comm.all_reduce(out) if self.tp_size > 1 else out

    def _act_torch(self, gate_up):
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate) * up

    def _act_c(self, gate_up):
        return silu_and_mul(gate_up, self.intermediate)

    def _act_triton(self, gate_up):
        from llmserve.kernels.triton import fused
        return fused.silu_and_mul(gate_up, self.intermediate)


def fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """One Linear computing the given ones side by side (their outputs concatenated):
    one GEMM instead of several. The parts' storage is released by the caller."""
    first = linears[0]
    out_features = sum(lin.out_features for lin in linears)
    fused = nn.Linear(first.in_features, out_features, bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([lin.bias for lin in linears]))
    return fused


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows ``[start, start + rows)`` of the token embedding: ids outside
    them look up zeros, and the ranks' lookups are summed."""

    def __init__(self, shard: RankShape, hidden: int):
        super().__init__(shard.vocab_per_rank, hidden)
        self.start = shard.vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local * inside, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return comm.all_reduce(x)


def dense_mlp(config, layer_idx: int, shard: RankShape) -> nn.Module:
    return MLP(config, shard)


class DecoderLayer(nn.Module):
    # A family whose attention or norms compute otherwise names its own (gemma2.py).
    attention_class = Attention
    norm_class = RMSNorm

    def __init__(self, config, layer_idx: int, shard: RankShape, mlp_for_layer=dense_mlp):
        super().__init__()
        self.self_attn = self.attention_class(config, layer_idx, shard)
        self.mlp = mlp_for_layer(config, layer_idx, shard)
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin):
        """``x``: the previous layer's MLP output, still to be added to the residual
        stream (None before the first layer, where ``residual`` is the embedding).
        Returns (this layer's MLP output, the residual stream): each residual add is
        fused into the norm after it, vLLM's layout."""
        if x is None:
            h = self.input_layernorm(residual)
        else:
            residual, h = self.input_layernorm.add_and_norm(residual, x)
        attn = self.self_attn(h, cos, sin)
        residual, h = self.post_attention_layernorm.add_and_norm(residual, attn)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    layer_class = DecoderLayer  # a family's own layer (gemma2.py)

    def __init__(self, config, max_positions: int, shard: RankShape, mlp_for_layer=dense_mlp):
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(shard, config.hidden_size) if shard.size > 1
                             else nn.Embedding(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(self.layer_class(config, i, shard, mlp_for_layer)
                                    for i in range(config.num_hidden_layers))
        self.norm = self.layer_class.norm_class(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.run_layer = _run_layer  # or its torch.compile'd version (compile_layers)
        # Decode steps of an int4 or gemm.c-packed bf16 model on a CPU: every layer in one
        # C call (models/native_decoder.py), set by the model runner where it applies.
        self.native_decoder = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings (a family that scales them overrides this)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions):
        x = self.embed(input_ids)
        cos, sin = self.rotary(positions)
        meta = step_metadata()
        if self.native_decoder is not None and self.native_decoder.applies(x.shape[0], meta):
            return self.norm(self.native_decoder.run(x, cos, sin, meta))
        out, residual = None, x
        for layer in self.layers:
            out, residual = self.run_layer(layer, out, residual, cos, sin)
        return self.norm.add_and_norm(residual, out)[1]

    def compile_layers(self) -> None:
        """One compiled graph for a decoder layer, shared by every layer (their weights
        and caches are the graph's inputs), with the token count dynamic; the layers
        take torch's ops, which the compiler can trace. (One graph for the whole stack
        was tried: far longer to compile cold, no faster a step.)"""
        bind_backends(self.layers, COMPILED)
        self.run_layer = torch.compile(_run_layer, dynamic=True)


def _run_layer(layer: DecoderLayer, x, residual, cos, sin):
    return layer(x, residual, cos, sin)


class LlamaForCausalLM(nn.Module):
    """``shard``: the part of the model this tensor-parallel rank holds (None: all).
    A family whose layers differ only in their MLP overrides ``mlp_for_layer``, and
    ``param_name`` where its checkpoint names tensors otherwise."""

    mlp_for_layer = staticmethod(dense_mlp)
    model_class = LlamaModel  # a family's own stack (gemma2.py)

    def __init__(self, config, max_positions: int, shard: RankShape | None = None):
        super().__init__()
        if getattr(config, "head_dim", None) is None:
            config.head_dim = config.hidden_size // config.num_attention_heads
        self.config = config
        self.shard = shard = shard or rank_shape(config, 0, 1)
        self.model = self.model_class(config, max_positions, shard, self.mlp_for_layer)
        # Vocabulary-parallel with several ranks: this rank's rows of the vocabulary.
        self.lm_head = nn.Linear(config.hidden_size,
                                 shard.vocab_per_rank if shard.size > 1 else config.vocab_size,
                                 bias=False)
        self.tie_weights()

    @staticmethod
    def param_name(checkpoint_name: str) -> str:
        """The parameter a checkpoint tensor fills (its own name here)."""
        return checkpoint_name

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse(self) -> None:
        """After loading: fused QKV and gate/up projections (fewer, larger GEMMs)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward(self, input_ids, positions) -> torch.Tensor:
        """Hidden states of every new token, ``[num_tokens, hidden]``; the attention
        metadata comes from ``attention.forward_context``."""
        return self.model(input_ids, positions)

    def bind_kv_cache(self, storage: torch.Tensor) -> None:
        """Give each layer its cache ``storage[i]`` of the KV storage
        ``[layers, 2, blocks, block_size, kv_heads, head_dim]``."""
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = storage[i]
        # It points into the previous cache: the model runner builds it again.
        self.model.native_decoder = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of ``hidden``'s rows, in the model's dtype; with several ranks,
        gathered onto rank 0 in float32 (every rank must call this; the others get
        None)."""
        logits = self.lm_head(hidden)  # in the model's dtype: the sampler converts
        if self.shard.size > 1:
            return comm.gather_logits(logits.float(), self.config.vocab_size)
        return logits
