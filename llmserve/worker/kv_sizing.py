"""KV cache sized from a profiled peak (``--profile-kv-cache``; off until a GPU run
validates it).

The default sizing on CUDA takes a fraction of the memory free after the weights are
loaded, which ignores the activations of the largest step: a step of
``max_num_batched_tokens`` tokens can then run out of memory with the KV pool full.
Profiling runs one dummy forward of that many tokens (plus the logits of
``max_num_seqs`` rows) before the pool exists, reads the peak the PyTorch allocator
saw, and gives the KV pool what is left of ``total x gpu_memory_utilization``, as
vLLM does.
"""

from __future__ import annotations

import torch

from llmserve.kernels.cpu.attention import make_cpu_plan
from llmserve.model_executor.layers.attention import AttentionMetadata, forward_context
from llmserve.utils import cdiv

# A CPU engine's KV budget unless --kv-cache-memory says otherwise.
DEFAULT_CPU_KV_BYTES = 1 << 30


def kv_budget_from_profile(*, total: int, free: int, utilization: float, torch_peak: int,
                           torch_reserved: int) -> int:
    """Bytes for the KV pool: the share of the device we may use (``total x
    utilization``), less the PyTorch allocator's peak during the profile (weights and
    the largest step's activations), less what the process holds outside PyTorch's
    allocator (CUDA context, cuBLAS workspaces: the device's used memory not reserved
    by PyTorch). Raises ValueError when nothing is left."""
    non_torch = max(0, (total - free) - torch_reserved)
    budget = int(total * utilization) - torch_peak - non_torch
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {utilization:.2f} x {total / 2**30:.1f} GiB "
            f"= {total * utilization / 2**30:.1f} GiB, of which the profiled peak of the "
            f"weights and one max_num_batched_tokens step takes {torch_peak / 2**30:.1f} GiB "
            f"and memory outside PyTorch {non_torch / 2**30:.1f} GiB; raise "
            f"--gpu-memory-utilization or lower --max-num-batched-tokens")
    return budget


@torch.inference_mode()
def profile_kv_budget(runner, num_tokens: int, num_sampling_rows: int) -> int:
    """Run one dummy step of ``num_tokens`` prompt tokens (one sequence) and the logits of
    ``num_sampling_rows`` rows on ``runner``'s device, before its KV pool exists, and
    return the KV budget in bytes. The dummy step writes and reads only a one-block
    scratch cache bound for the duration (every token's slot and block are in it)."""
    dev = runner.device
    c = runner.hf_config
    bs = runner.block_size
    scratch = torch.zeros((c.num_hidden_layers, 2, 1, bs, runner.shard.num_kv_heads,
                           c.head_dim), dtype=runner.dtype, device=dev)
    runner.model.bind_kv_cache(scratch)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.long, device=dev) % bs,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
        block_tables=torch.zeros((1, cdiv(num_tokens, bs)), dtype=torch.int32, device=dev),
        max_query_len=num_tokens, max_seq_len=num_tokens, use_triton=runner.use_triton)
    if not runner.use_triton:
        meta.plan = make_cpu_plan([0, num_tokens], [num_tokens],
                                  [[0] * cdiv(num_tokens, bs)], bs, 1, device=dev)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
    max_positions = runner.model.model.rotary.cos.shape[0]  # the budget may exceed it
    pos = torch.arange(num_tokens, dtype=torch.long, device=dev) % max_positions
    with forward_context(meta):
        hidden = runner.model(ids, pos)
    # float32, as the sampler's general path converts them
    runner.model.compute_logits(hidden[:num_sampling_rows]).float()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del hidden
    free, total = torch.cuda.mem_get_info(dev)
    return kv_budget_from_profile(total=total, free=free,
                                  utilization=runner.config.gpu_memory_utilization,
                                  torch_peak=peak, torch_reserved=torch.cuda.memory_reserved(dev))


def model_weight_bytes(hf_config, max_model_len: int, dtype: torch.dtype) -> int:
    """Bytes a model holds once built, before quantisation and unsharded (so at most what
    it will hold): float parameters in ``dtype``, packed ones (MXFP4's uint8) and buffers
    (the fp32 rotary tables) as they are. Counted on a meta-device build before any
    weight is loaded: what a KV budget sized from free device memory must leave for a
    model loaded after it (a draft model's)."""
    from llmserve.distributed.shapes import rank_shape
    from llmserve.model_executor.model_loader.weights import empty_model_init
    from llmserve.model_executor.models.registry import SUPPORTED_ARCHITECTURES

    if getattr(hf_config, "head_dim", None) is None:  # as the model runner sets it
        hf_config.head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    arch = next((a for a in hf_config.architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"architectures {hf_config.architectures}: none is supported "
                         f"({', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    with empty_model_init():
        model = SUPPORTED_ARCHITECTURES[arch](hf_config, max_model_len,
                                              rank_shape(hf_config, 0, 1))
    model.tie_weights()  # a tied head shares the embedding's storage
    elem = torch.tensor([], dtype=dtype).element_size()
    params = sum(p.numel() * (elem if p.is_floating_point() else p.element_size())
                 for p in model.parameters())
    return params + sum(b.numel() * b.element_size() for b in model.buffers())


def kv_block_bytes(hf_config, block_size: int, element_size: int,
                   num_kv_heads: int | None = None) -> int:
    """Bytes of one KV block across all layers (K and V), of ``num_kv_heads`` KV heads
    (a tensor-parallel rank's; default: all of the model's)."""
    head_dim = (getattr(hf_config, "head_dim", None)
                or hf_config.hidden_size // hf_config.num_attention_heads)
    heads = num_kv_heads or hf_config.num_key_value_heads
    return 2 * hf_config.num_hidden_layers * block_size * heads * head_dim * element_size
