"""The attention call of every layer: store this step's K/V, attend over the cache.

On CUDA the Triton kernels run; elsewhere the PyTorch references do. The step's
``AttentionMetadata`` is built once by the model runner and read by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels.reference import AttentionPlan, paged_attention_torch, write_kv_cache_ref


@dataclass
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V)
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    use_triton: bool = False
    plan: AttentionPlan | None = None  # torch path only


def paged_attention(q, k, v, meta: AttentionMetadata, layer_idx: int, scale: float):
    k_cache, v_cache = meta.kv_caches[layer_idx]
    out = torch.empty_like(q)
    if meta.use_triton:
        from llmserve.kernels.triton_attention import unified_attention, write_kv_cache
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        unified_attention(q, k_cache, v_cache, out, query_start_loc=meta.query_start_loc,
                          seq_lens=meta.seq_lens, block_tables=meta.block_tables,
                          max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                          scale=scale)
    else:
        write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        paged_attention_torch(q, k_cache, v_cache, out, meta.plan, scale)
    return out
