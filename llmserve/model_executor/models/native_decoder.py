"""The decoder stack in one C call per decode step (``kernels/decoder.c``).

An eager decode step of a small model spends about as long in Python between its ~25
ops a layer as in the ops, and the second thread idles through that Python. The
``NativeDecoder`` runs every layer of a decode-only step in C, reading the weights
where the model keeps them (no second copy) and the paged KV cache where the engine
keeps it. A projection is int4 (ATen's pack) or dense bf16 packed for ``gemm.c``
(``NativeLinear``: AMX and AVX512-BF16 CPUs). A bf16 projection is the per-op path's
own ``bf16_gemm`` call, and so are an int4 projection's products of many rows where the
per-op path binds ``quant_gemm`` for them (``quant_gemm_rows``): such stacks run steps
of any size. Elsewhere an int4 stack computes with its own kernels, and only up to
``max_native_tokens`` rows. Long prefills and every model it does not cover keep the
per-op path. Every choice is the layers' own, read once when the stack is built: both
paths compute a product with the same kernel.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from llmserve.kernels.cpu.decoder import (
    StackDims,
    StackLayer,
    bf16_struct,
    int4_pack_block_n,
    q4_struct,
)
from llmserve.kernels.cpu.dispatch import QUANT_GEMM
from llmserve.kernels.cpu.gemm import (
    native_gemm_available,
    quant_tiled_available,
    rounds_x_to_int8,
)
from llmserve.kernels.cpu.native import cpu_library, panel_gemms_built
from llmserve.model_executor.layers.cpu_linear import NativeLinear
from llmserve.model_executor.layers.quantization import INT4_GROUP, QuantizedLinear
from llmserve.model_executor.models.llama import DecoderLayer

log = logging.getLogger(__name__)

# The most rows of a step the stack runs where its int4 products are all its own, by
# what the per-op path it replaces computes them with (benchmarks/cpu/cpu_decoder.py
# measures each crossover; docs/benchmarks.md has the figures):
# - quant_gemm there, x not rounded (LLMSERVE_CPU_INT8_ACTIVATIONS=0 on AMX or Zen 4):
#   the stack dequantises each weight chunk once per 8 tokens, the per-op path's
#   quant_gemm each block once for all rows; 16 lets two or three streams' drafted
#   steps (1 + k rows each) run in C too.
MAX_NATIVE_TOKENS = 16
# - ATen's AVX2 pack (32-column blocks) with a library built without the panel GEMM:
#   the tiles dequantise once per 2 tokens.
MAX_NATIVE_TOKENS_AVX2 = 8
# - the AVX2 pack with the panel GEMM: past 128 rows (long prefill chunks) the per-op
#   path's float32 GEMM of dequantised weights is the faster.
MAX_NATIVE_TOKENS_AVX2_PANELS = 128
# - no quant_gemm (AVX-512 without BF16) and x not rounded: the stack's products of 16
#   rows and more are a GEMM over dequantised panels, ahead of the per-op path up to the
#   engine's default max_num_seqs.
MAX_NATIVE_TOKENS_WITHOUT_BF16 = 128
# - the same CPUs with a library built without the panel GEMM (its 8-row tiles only).
MAX_NATIVE_TOKENS_TILES_ONLY = 32
# - x rounded to int8 (AVX2, or AVX-512 VNNI without AMX tiles in use): the stack's
#   products are the same int8 panels as the per-op path's, so it runs whole prompt
#   steps in C too, saving the per-op path's ~25 calls a layer and their intermediates.
#   Not past the largest measured: the stack holds every intermediate of all its rows at
#   once (hundreds of KB a row for an 8B model), which the KV budget does not count.
MAX_NATIVE_TOKENS_INT8_X = 2048


def max_native_tokens(block_n: int) -> int | None:
    """The most rows a step may have to run in C, for ATen's int4 pack layout here
    (None: no limit; a bf16 stack's products are the per-op path's own)."""
    if block_n == 0:
        return None
    if rounds_x_to_int8() and panel_gemms_built():  # the per-op path's int8 panels
        return MAX_NATIVE_TOKENS_INT8_X
    if block_n != 64:
        return MAX_NATIVE_TOKENS_AVX2_PANELS if panel_gemms_built() else MAX_NATIVE_TOKENS_AVX2
    if quant_tiled_available(4):
        return MAX_NATIVE_TOKENS
    if panel_gemms_built() and not native_gemm_available():  # decoder.c's panels run here
        return MAX_NATIVE_TOKENS_WITHOUT_BF16
    return MAX_NATIVE_TOKENS_TILES_ONLY


class NativeDecoder:
    """Every decoder layer of a bound ``LlamaForCausalLM`` whose projections are int4 or
    packed for ``gemm.c`` as one C call.
    Holds raw pointers into the model's weights and KV cache: build it after both are
    in place (``try_build``), and drop it if either is replaced."""

    lora_state = None  # multi-LoRA's LoRAState: set by the model runner when enabled

    def __init__(self, model, block_n: int):
        c = model.config
        layers = model.model.layers
        first = layers[0].self_attn
        cache = first.kv_cache
        int4 = int4_projections(model)
        self.dims = StackDims(c.hidden_size, first.num_heads, first.num_kv_heads,
                              first.head_dim, layers[0].mlp.intermediate, block_n,
                              layers[0].input_layernorm.eps, first.scale, cache.shape[1],
                              cache.shape[2], int(rounds_int4_x(int4)),
                              quant_gemm_rows(int4))
        self.row_limit = max_native_tokens(block_n)
        # The tensors the pointers point into: kept alive as long as this is.
        self._keep = [t for layer in layers for t in layer_tensors(layer)]
        self.layers = (StackLayer * len(layers))(*(
            StackLayer(layer.input_layernorm.weight.data_ptr(),
                       layer.post_attention_layernorm.weight.data_ptr(),
                       *(linear_struct(lin, self._keep) for lin in projections(layer)),
                       layer.self_attn.kv_cache.data_ptr())
            for layer in layers))
        self.num_layers = len(layers)
        self._lib = cpu_library()

    @classmethod
    def try_build(cls, model) -> NativeDecoder | None:
        """The native stack for ``model``, or None where it does not apply (see
        ``unsupported``), or for an ATen pack layout the kernel does not read."""
        why = unsupported(model)
        if why is None:
            int4 = int4_projections(model)
            block_n = int4_pack_block_n() if int4 else 0
            if block_n is None:
                why = "ATen's int4 pack layout is not one the C kernel reads"
            elif any(lin.out_features % block_n for lin in int4):
                why = f"a projection's width is not a multiple of {block_n}"
            else:
                return cls(model, block_n)
        log.debug("decode steps run op by op: %s", why)
        return None

    def quant_gemm_rows(self) -> int:
        """From how many rows the stack's int4 products are quant_gemm's (0: none)."""
        return self.dims.quant_gemm_rows

    def applies(self, num_tokens: int, meta) -> bool:
        """A step whose rows are all C-kernel rows in order (``all_rows_native``: row i
        is query i, with its own block-table row and causal context length, which is
        how the C side reads them: decodes, drafted decodes' 1 + k rows, short
        prompts), of at most ``row_limit`` rows, or of any number where every
        product is the per-op path's own (bf16; int4 from ``quant_gemm_rows``)."""
        plan = meta.plan if meta is not None else None
        if self.lora_state is not None and self.lora_state.step is not None:
            return False  # an adapter runs in this step: the per-op path applies it
        limit, tiled = self.row_limit, self.quant_gemm_rows()
        return (plan is not None and plan.all_rows_native
                and (limit is None or num_tokens <= limit or 0 < tiled <= num_tokens))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta) -> torch.Tensor:
        """The residual stream after the last layer, for ``x [tokens, hidden]``."""
        x = x.to(torch.bfloat16).contiguous()
        tokens = x.shape[0]
        cos = cos.reshape(tokens, -1).float().contiguous()  # the C side reads float32
        sin = sin.reshape(tokens, -1).float().contiguous()
        plan = meta.plan
        rc = self._lib.stack_decode_layers(
            torch.get_num_threads(), ctypes.byref(self.dims), self.layers, self.num_layers,
            x.data_ptr(), tokens, cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
            plan.decode_tables.data_ptr(), plan.decode_tables.shape[1],
            plan.decode_seq_lens.data_ptr())
        if rc == -1:
            raise MemoryError("stack_decode_layers: out of memory for its scratch buffers")
        if rc != 0:
            raise RuntimeError(f"stack_decode_layers failed with code {rc}")
        return x


def quant_gemm_rows(int4: list) -> int:
    """From how many rows the per-op path's int4 products are quant_gemm's for every
    projection in ``int4`` (their bound kernels), so that the stack takes it too and
    any number of rows; 0 where one of them never takes it, or with no int4 projection."""
    starts = {lin.row_kernels.trailing(QUANT_GEMM) for lin in int4}
    return starts.pop() if len(starts) == 1 and None not in starts else 0


def rounds_int4_x(int4: list) -> bool:
    """Whether the per-op path's int4 products round x to int8 (their bound kernels):
    the stack's then do too, from the same row count."""
    return bool(int4) and int4[0].row_kernels.x == "int8"


def projections(layer) -> tuple:
    """The layer's four projections (under a multi-LoRA wrapper: the projection it
    wraps, which is what the C stack computes when no adapter runs)."""
    return tuple(getattr(p, "base", p) for p in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
        layer.mlp.down_proj))


def int4_projections(model) -> list:
    """Every int4 projection of the model's layers (the others are bf16 for gemm.c)."""
    return [lin for layer in model.model.layers for lin in projections(layer)
            if isinstance(lin, QuantizedLinear)]


def linear_struct(linear, keep: list[torch.Tensor]):
    """A projection as the C stack reads it: int4, or bf16 packed for ``gemm.c``. An int4
    bias also in float32 (kept alive in ``keep``), as quant_gemm adds it."""
    if isinstance(linear, NativeLinear):
        return bf16_struct(linear)
    lin = q4_struct(linear)
    if linear.bias is not None:
        keep.append(bias := linear.bias.float().contiguous())
        lin.bias_f32 = bias.data_ptr()
    return lin


def layer_tensors(layer) -> list[torch.Tensor]:
    """Every tensor of ``layer`` the C stack holds a pointer into."""
    tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
               layer.self_attn.kv_cache]
    for lin in projections(layer):
        weights = [lin.packed] if isinstance(lin, NativeLinear) else [lin.qweight, lin.scales]
        tensors += weights + ([lin.bias] if lin.bias is not None else [])
    return tensors


def unsupported(model) -> str | None:
    """Why the native stack cannot run ``model`` (None: it can, kernel permitting)."""
    if cpu_library() is None:
        return "the C kernels are not built"
    if model.shard.size > 1:
        return "tensor parallelism"
    layers = model.model.layers
    if any(type(layer) is not DecoderLayer for layer in layers):
        return "a family's own decoder layer (Gemma's norms and GELU MLP)"
    if any(layer.self_attn.q_norm is not None for layer in layers):
        return "per-head q/k norms (Qwen3)"
    if any(layer.self_attn.sliding_window for layer in layers):
        return "sliding-window layers"
    if any(layer.self_attn.sinks is not None for layer in layers):
        return "attention sinks"
    if any(layer.self_attn.softcap for layer in layers):
        return "attention logit soft-capping"
    if any(not hasattr(layer.mlp, "gate_up_proj") for layer in layers):
        return "a mixture-of-experts MLP"
    cache = layers[0].self_attn.kv_cache
    if cache is None or cache.dtype != torch.bfloat16 or cache.device.type != "cpu":
        return "no bf16 CPU KV cache bound"
    for layer in layers:
        for lin in projections(layer):
            if isinstance(lin, NativeLinear):
                continue  # gemm.c's bf16 panels: the kernel takes every shape packed
            if not isinstance(lin, QuantizedLinear) or lin.bits != 4:
                return "a projection neither int4 nor packed for gemm.c (oneDNN's, int8)"
            if lin.in_features % INT4_GROUP:
                return "an input width not a multiple of the int4 group"
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.bfloat16 for w in norms):
            return "norm weights not bf16"
        if not layer.self_attn.kv_cache.is_contiguous():
            return "a layer cache is not contiguous"
    if layers[0].self_attn.head_dim > 512 or layers[0].self_attn.head_dim % 2:
        return "head_dim unsupported"
    if model.config.hidden_size > 16384:  # add_rms_norm_bf16's row limit
        return "hidden size above 16384"
    return None
