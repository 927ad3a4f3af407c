"""One rank's model and KV cache, built by ordered load passes (``LOAD_PASSES``).

Invariants the order keeps (each pass below says which it relies on):

1. Weights are materialised once, empty, in the serving dtype on the device, then filled
   from the checkpoint: never an fp32 copy first (that would double a bf16 model's peak
   on a GPU).
2. Every replacement of a layer's weights happens before anything keeps a pointer into
   them: fuse -> quantise -> pack -> compact the embedding, then the move onto huge pages,
   then the LoRA slots (which wrap the final projections) and the C decoder stack (which
   points into weights and cache alike).
3. Each layer's implementation is bound once, after the module tree is final and the
   attention backend is known (``layers/backends.py``); a quantised linear's kernels
   were bound when it was built (``kernels/cpu/dispatch.py``), with the threads set
   first.
4. The KV budget is sized after everything else that takes device memory (weights,
   LoRA slots): on CUDA the pool is what is left. Tensor-parallel ranks agree on the
   smallest block count.
5. The cache is bound to the layers before the C decoder stack is built (it keeps
   pointers into it); rebinding the cache drops the stack. torch.compile'd layers and
   the C stack exclude each other.

``build`` runs the passes on a ``Load`` and returns it; the model runner serves with
what it holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llmserve.config import EngineConfig
from llmserve.distributed.shapes import RankShape, rank_shape
from llmserve.kernels.cpu.gemm import packing_applies
from llmserve.kernels.cpu.native import DTYPE_CODES, cpu_library
from llmserve.model_executor.layers.backends import backends_for, bind_backends
from llmserve.model_executor.layers.cpu_linear import pack_linears
from llmserve.model_executor.layers.fused_moe.layer import SparseMoeBlock
from llmserve.model_executor.layers.q8_embedding import compact_embedding
from llmserve.model_executor.layers.quantization import quantize_model
from llmserve.model_executor.lora.slots import LoRASlots
from llmserve.model_executor.model_loader.weights import (
    checkpoint_slice,
    empty_model_init,
    load_weights,
)
from llmserve.model_executor.models.llama import RotaryEmbedding
from llmserve.model_executor.models.native_decoder import NativeDecoder
from llmserve.model_executor.models.registry import SUPPORTED_ARCHITECTURES
from llmserve.platforms.memory import huge_pages_wanted
from llmserve.worker.kv_cache import KVCache
from llmserve.worker.kv_sizing import DEFAULT_CPU_KV_BYTES, kv_block_bytes, profile_kv_budget
from llmserve.worker.weight_arena import pack_weights

log = logging.getLogger(__name__)


@dataclass
class Load:
    """What the passes read (the first block) and build up (the rest)."""

    config: EngineConfig
    hf_config: object
    model_path: Path
    max_model_len: int
    rank: int
    device: torch.device
    dtype: torch.dtype
    shard: RankShape
    extra_bytes_per_block: int = 0  # a draft model's cache of the same blocks
    reserved_bytes: int = 0  # device memory left for what loads after (a draft's weights)
    blocks: tuple[int, int] | None = None  # (device, CPU swap) counts to take as they are
    model: nn.Module | None = None
    use_triton: bool = False  # attention through the Triton kernels
    c_attention: bool = False  # decodes and short prefills attend in the C kernel
    lora: LoRASlots | None = None
    num_blocks: int = 0
    num_swap_blocks: int = 0
    kv_cache: KVCache | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def kv_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return kv_block_bytes(self.hf_config, self.block_size, elem, self.shard.num_kv_heads)


def start(config: EngineConfig, hf_config, model_path, max_model_len: int, rank: int = 0,
          **sizing) -> Load:
    """The device, dtype and shard of ``rank``, with the engine's threads set (shared
    among its ranks) before any layer is built: quantised layers bind their kernels for
    that thread count."""
    tp = config.tensor_parallel_size
    device = torch.device(f"cuda:{rank}" if config.device == "cuda" and tp > 1
                          else config.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, config.num_threads // tp))
    if getattr(hf_config, "head_dim", None) is None:
        hf_config.head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    return Load(config, hf_config, Path(model_path), max_model_len, rank, device,
                config.torch_dtype, rank_shape(hf_config, rank, tp), **sizing)


# --- the passes, in order -----------------------------------------------------------------
def load_checkpoint(load: Load) -> None:
    """Built on the meta device (no random init of 100M+ parameters), materialised empty
    in the serving dtype (invariant 1) and filled from the checkpoint; the cos/sin
    tables, on meta too, rebuilt in float32 whatever the weights are."""
    c = load.hf_config
    arch = next(a for a in c.architectures if a in SUPPORTED_ARCHITECTURES)
    with empty_model_init():
        model = SUPPORTED_ARCHITECTURES[arch](c, load.max_model_len, load.shard).to(load.dtype)
    model.to_empty(device=load.device)
    model.tie_weights()
    load_weights(model, load.model_path, load.dtype, str(load.device))
    model.model.rotary = RotaryEmbedding(c, load.max_model_len).to(load.device)
    load.model = model


def fuse_projections(load: Load) -> None:
    """Fused QKV and gate/up projections: fewer, larger GEMMs (and what the next passes
    quantise and pack)."""
    load.model.fuse()


def quantise(load: Load) -> None:
    """Weight-only int8/int4 projections and LM head (``--quantization``)."""
    quantize_model(load.model, load.config.quantization)


def pack_dense_linears(load: Load) -> None:
    """The dense bf16 linears left, in oneDNN's or gemm.c's layout once instead of on
    every call (not for torch.compile, which packs its own)."""
    if packing_applies(load.device, load.dtype) and not load.config.compile:
        pack_linears(load.model)


def compact_token_embedding(load: Load) -> None:
    """A Q8_0 embedding (GGUF) kept as its int8 blocks: the same rows, half the memory."""
    if load.device.type == "cpu" and load.shard.size == 1:
        compact_embedding(load.model, checkpoint_slice(load.model, load.model_path,
                                                       "model.embed_tokens.weight"))


def choose_attention(load: Load) -> None:
    """Triton attention where the config asks for it (the shapes checked now, not at the
    first step); else on a CPU the C kernel for the dtypes it knows, built now so that
    no request waits for the compiler."""
    if load.config.uses_triton:
        from llmserve.kernels.triton.attention import check_supported
        c = load.hf_config
        check_supported(block_size=load.block_size, head_dim=c.head_dim,
                        num_heads=load.shard.num_heads, num_kv_heads=load.shard.num_kv_heads,
                        dtype=load.dtype)
        load.use_triton = True
    load.c_attention = (load.device.type == "cpu" and not load.use_triton
                        and load.dtype in DTYPE_CODES and cpu_library() is not None)


def bind_layer_backends(load: Load) -> None:
    """Each norm, attention and MLP takes its implementation (invariant 3); every module
    in eval mode."""
    load.model.eval()
    bind_backends(load.model, backends_for(load.device, load.dtype, load.config.fused_kernels,
                                           load.use_triton))


def move_weights_to_huge_pages(load: Load) -> None:
    """The final weights onto 2 MB pages (invariant 2: before anything points into
    them)."""
    if load.device.type == "cpu" and huge_pages_wanted():
        pack_weights(load.model)


def group_moe_experts(load: Load) -> None:
    """With Triton attention, a mixture-of-experts layer's experts in one grouped launch."""
    if load.use_triton:
        for module in load.model.modules():
            if isinstance(module, SparseMoeBlock):
                module.use_triton_kernel()


def add_lora_slots(load: Load) -> None:
    """Multi-LoRA: the final projections wrapped, their adapter slots allocated before
    the KV cache takes what memory is left (invariant 4)."""
    if load.config.enable_lora:
        load.lora = LoRASlots(load.model, load.hf_config, load.shard, load.config,
                              load.use_triton)


def size_kv_cache(load: Load) -> None:
    """Device and CPU-swap block counts (invariant 4), or the ones given (a draft
    model's cache has the target's blocks)."""
    if load.blocks is not None:
        load.num_blocks, load.num_swap_blocks = load.blocks
        return
    per_block = load.kv_bytes_per_block() + load.extra_bytes_per_block
    load.num_blocks = _num_kv_blocks(load, per_block)
    load.num_swap_blocks = (int(load.config.swap_space // per_block)
                            if load.config.preemption_mode == "swap" else 0)


def bind_kv_cache(load: Load) -> None:
    """The KV storage, each layer given its slice (invariant 5: before the C stack)."""
    c = load.hf_config
    load.kv_cache = KVCache(c.num_hidden_layers, load.num_blocks, load.block_size,
                            load.shard.num_kv_heads, c.head_dim, load.dtype, load.device,
                            load.num_swap_blocks, load.config.check_kv_integrity)
    load.model.bind_kv_cache(load.kv_cache.storage)


def compile_or_stack(load: Load) -> None:
    """``--compile``'s layers, or, on a CPU, the C decoder stack for the decode steps it
    covers (invariant 5), told where the adapters' state is: it steps aside for a step
    with an adapter."""
    model = load.model.model
    if load.config.compile:
        model.compile_layers()
        return
    if load.c_attention:
        model.native_decoder = NativeDecoder.try_build(load.model)
    if load.lora is not None and model.native_decoder is not None:
        model.native_decoder.lora_state = load.lora.state


LOAD_PASSES = (load_checkpoint, fuse_projections, quantise, pack_dense_linears,
               compact_token_embedding, choose_attention, bind_layer_backends,
               move_weights_to_huge_pages, group_moe_experts, add_lora_slots, size_kv_cache,
               bind_kv_cache, compile_or_stack)


def build(load: Load) -> Load:
    for step in LOAD_PASSES:
        step(load)
    return load


def _num_kv_blocks(load: Load, per_block: int) -> int:
    config = load.config
    budget = config.kv_cache_memory
    if budget is None:
        if load.device.type == "cuda" and config.profile_kv_cache:
            budget = profile_kv_budget(load, config.max_num_batched_tokens,
                                       config.max_num_seqs) - load.reserved_bytes
        elif load.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(load.device)
            budget = int(free - total * (1 - config.gpu_memory_utilization)
                         - load.reserved_bytes)
        else:
            budget = DEFAULT_CPU_KV_BYTES
    num = budget // per_block
    if load.shard.size > 1:  # every rank's cache has the same blocks: the smallest
        t = torch.tensor([num], dtype=torch.int64,
                         device=load.device if load.device.type == "cuda" else "cpu")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        num = int(t.item())
    if num < 1:
        left = (f", after {load.reserved_bytes} bytes left for a draft model's weights"
                if load.reserved_bytes and config.kv_cache_memory is None
                and load.device.type == "cuda" else "")
        raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block "
                         f"(one block takes {load.kv_bytes_per_block()} bytes{left})")
    return int(num)
