"""PyTorch references for the paged-attention kernels: the tests' oracle (the engine's CPU
path is kernels/cpu/attention.py).

KV cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A batch concatenates the new tokens of every sequence; ``query_start_loc``
gives where each sequence's tokens start, ``seq_lens`` each sequence's total
length (cached prefix + new tokens, whose K/V are already written).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store token t's K/V at flat slot ``slot_mapping[t]``; negative slots are skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


@dataclass
class AttentionPlan:
    """Index tensors for the torch path, built once per step and shared by all layers."""
    decode_rows: torch.Tensor | None = None  # positions in q of single-token queries
    decode_tables: torch.Tensor | None = None  # [S, max_blocks] long
    decode_keep: torch.Tensor | None = None  # [S, max_blocks * block_size], False = padding
    # (start, end, seq_len, block ids of the sequence, causal mask or None)
    prefills: list[tuple] = field(default_factory=list)


def make_attention_plan(query_start_loc: list[int], seq_lens: list[int],
                        block_tables: torch.Tensor, block_size: int) -> AttentionPlan:
    dev = block_tables.device
    plan = AttentionPlan()
    num_seqs = len(seq_lens)
    decodes = [i for i in range(num_seqs) if query_start_loc[i + 1] - query_start_loc[i] == 1]
    if decodes:
        max_blocks = -(-max(seq_lens[i] for i in decodes) // block_size)
        index = torch.tensor(decodes, device=dev)
        plan.decode_rows = torch.tensor([query_start_loc[i] for i in decodes], device=dev)
        plan.decode_tables = block_tables[index, :max_blocks].long()
        lens = torch.tensor([seq_lens[i] for i in decodes], device=dev)
        plan.decode_keep = (torch.arange(max_blocks * block_size, device=dev).unsqueeze(0)
                            < lens.unsqueeze(1))
    for i in range(num_seqs):
        start, end, seq_len = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
        n = end - start
        if n <= 1:
            continue
        table = block_tables[i, :-(-seq_len // block_size)].long()
        mask = None
        if seq_len > n:  # causal over a cached prefix: row r sees keys <= context + r
            rows = torch.arange(n, device=dev).unsqueeze(1) + (seq_len - n)
            mask = torch.arange(seq_len, device=dev).unsqueeze(0) <= rows
        plan.prefills.append((start, end, seq_len, table, mask))
    return plan


def unified_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          out: torch.Tensor, *, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, block_tables: torch.Tensor,
                          max_query_len: int, max_seq_len: int, scale: float) -> torch.Tensor:
    """Reference for ``unified_attention``: new token i of a sequence with context
    c = seq_len - query_len attends keys 0 .. c + i."""
    plan = make_attention_plan(query_start_loc.tolist(), seq_lens.tolist(), block_tables,
                               k_cache.shape[1])
    return paged_attention_torch(q, k_cache, v_cache, out, plan, scale)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          out: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
    """Decodes together in one padded batch; prefill chunks one sequence at a time."""
    if plan.decode_rows is not None:
        _decode_attention(q, k_cache, v_cache, out, plan, scale)
    for start, end, seq_len, table, mask in plan.prefills:
        k = k_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)  # [kvh,L,d]
        v = v_cache.index_select(0, table).flatten(0, 1)[:seq_len].transpose(0, 1)
        qs = q[start:end].transpose(0, 1)  # [H, n, d]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out


def _decode_attention(q, k_cache, v_cache, out, plan: AttentionPlan, scale: float) -> None:
    """Gather each decode's blocks into a padded ``[S, L, kvh, d]`` tensor (one
    index_select, the cheapest gather on CPU) and mask the padding. SDPA reads K/V
    through strided views, so no further copies are made."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num, max_blocks = plan.decode_tables.shape
    length = max_blocks * block_size
    flat = plan.decode_tables.reshape(-1)
    k = k_cache.index_select(0, flat).view(num, length, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(num, length, num_kv_heads, head_dim).transpose(1, 2)
    qd = q[plan.decode_rows].unsqueeze(2)  # [S, H, 1, d]
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=plan.decode_keep[:, None, None, :],
                                       scale=scale, enable_gqa=True)
    out[plan.decode_rows] = o.squeeze(2)


# --- dense references over explicit K/V, for the attention variants --------------------------
def dense_reference(q, k, v, query_lens, seq_lens, window, scale, sinks=None, softcap=None):
    """Dense attention of each sequence's new tokens (``q`` back to back) over its own
    ``k[seq]``, ``v[seq]`` ``[length, kv_heads, d]``, in transformers' arithmetic:
    scores scaled, soft-capped (``softcap``: ``cap * tanh(s / cap)``), masked to the
    causal ``window`` (None: the whole context), and softmaxed with each head's sink
    logit (``sinks [heads]``) as one more column that owns no value row."""
    out, row = torch.empty_like(q), 0
    for seq, (n, length) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(length - n, length).unsqueeze(1)
        keys = torch.arange(length).unsqueeze(0)
        visible = (keys <= pos) & (keys > pos - (window or length))
        qs = q[row:row + n].transpose(0, 1)
        group = q.shape[1] // k[seq].shape[1]
        ks = k[seq].repeat_interleave(group, 1).transpose(0, 1)
        vs = v[seq].repeat_interleave(group, 1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
        probs = scores.softmax(-1)[..., :length]
        out[row:row + n] = (probs @ vs).transpose(0, 1)
        row += n
    return out


def paged_batch(query_lens, seq_lens, heads=4, kv_heads=2, head_dim=32, seed=0,
                block_size=16):
    """q, the paged cache ``[2, blocks, block_size, kv_heads, d]`` holding every context
    (blocks shuffled), each sequence's block table, and the dense K/V."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
    tables, ks, vs = [], [], []
    for length, nb in zip(seq_lens, blocks_per_seq):
        table = [order.pop() for _ in range(nb)]
        k = torch.randn(length, kv_heads, head_dim, generator=gen)
        v = torch.randn(length, kv_heads, head_dim, generator=gen)
        for t in range(length):
            cache[0, table[t // block_size], t % block_size] = k[t]
            cache[1, table[t // block_size], t % block_size] = v[t]
        tables.append(table)
        ks.append(k)
        vs.append(v)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    return q, cache, tables, ks, vs
