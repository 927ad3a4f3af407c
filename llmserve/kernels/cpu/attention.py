"""Paged attention on CPUs: what the engine runs there (``reference.py`` stays the
plain oracle that tests compare with).

A step's ``CPUAttentionPlan`` is built once and read by every layer:

- Decodes (one new token each) run together in the compiled C kernel
  (``decode.c`` via ``native.py``) when the plan is ``native``: straight from
  the paged cache, each KV block read once for its GQA group, many times faster than
  the torch path below (``benchmarks/cpu/cpu_attention.py``). Otherwise (no C
  compiler, fp16, ``LLMSERVE_CPU_KERNELS=torch``) they run together in torch: Their
  block ids, padded to the longest context, are gathered with one ``index_select``
  per layer (K and V rows together, from the layer's contiguous cache viewed as one
  row per block: the cheapest CPU gather; row indices are built once per step), and
  attended in one SDPA call with the GQA group as the query length:
  ``q [S, kv_heads, group, d]`` against ``K, V [S, kv_heads, L, d]``, so K/V are
  never repeated per query head.
- Prefill chunks of short contexts (cached prefix + chunk at most
  ``MAX_ROWWISE_CONTEXT`` tokens) run in the same C kernel when the plan is ``native``:
  each token a query row over its causal prefix. Longer contexts, and every chunk on
  the torch path, run one SDPA each over their gathered context, causal with the
  offset of the cached prefix.

A layer with a sliding window of W keys (Mistral's, Gemma's local layers) sees, from
the query at position p, the keys in (p - W, p]. The plan is the step's, shared by
every layer; what a window changes (the C kernel's first key per row, the torch paths'
masks) is derived from it on first use by a windowed layer and kept for the others.

Two extras change the softmax itself: logit soft-capping (Gemma 2: each scaled score s
becomes ``softcap * tanh(s / softcap)`` before masking) and attention sinks (gpt-oss:
a learned logit per query head that joins the softmax's maximum and denominator and
owns no value row). The C kernel takes both; on the torch paths a layer with either
runs ``_attention_with_extras`` (the arithmetic SDPA does, written out, since SDPA
has neither) and a layer with neither keeps SDPA.

Softmax and accumulation are in float32 whatever the cache dtype: CPU SDPA in bf16 with
a mask is several times slower than in fp32, and converting the gathered K/V costs less
than that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmserve.kernels.cpu.native import paged_decode
from llmserve.utils import cdiv


@dataclass
class CPUAttentionPlan:
    decode_rows: torch.Tensor | None = None  # positions in q of single-token queries
    # rows of the layer cache viewed as [2 * blocks, row]: K rows then V rows, padded
    decode_rows_kv: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # [S, 1, 1, max_blocks * block_size], True = key
    decode_lens: torch.Tensor | None = None  # [S] context length of each decode
    num_decodes: int = 0
    decode_only: bool = False  # every row of q is a decode, in order: no scatter needed
    # Every row of q is a C-kernel row, in order (decodes, drafted decodes' 1 + k rows,
    # short prefill chunks): decode_q_rows is arange(T), so a kernel may take row i as
    # query i with its own table row and causal length (the C decoder stack does).
    all_rows_native: bool = False
    # The C kernel's inputs (native plans): int32 rows of q (every decode, and each row
    # of a short prefill chunk), their block tables and context lengths.
    native: bool = False
    decode_q_rows: torch.Tensor | None = None
    decode_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    # (start, end, seq_len, K-then-V rows, causal mask or None), one per prefill chunk
    prefills: list[tuple] = field(default_factory=list)
    # What a sliding window of each size changes, built on first use (``windowed``).
    _windowed: dict = field(default_factory=dict)

    def windowed(self, window: int) -> tuple:
        """(first key per C-kernel row, torch decode mask, one mask per prefill chunk)
        for a layer that sees the last ``window`` keys of each query's context."""
        if window not in self._windowed:
            self._windowed[window] = self._build_windowed(window)
        return self._windowed[window]

    def _build_windowed(self, window: int) -> tuple:
        first_keys = decode_mask = None
        if self.native:  # row i attends keys [seq_len_i - window, seq_len_i)
            first_keys = (self.decode_seq_lens - window).clamp_(min=0).to(torch.int32)
        elif self.decode_mask is not None:
            keys = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            low = (self.decode_lens - window).unsqueeze(1)
            decode_mask = self.decode_mask & (keys.unsqueeze(0) >= low)[:, None, None, :]
        masks = []
        for start, end, seq_len, blocks, _ in self.prefills:
            n = end - start  # row r is the query at position seq_len - n + r
            rows = torch.arange(n, device=blocks.device).unsqueeze(1) + (seq_len - n)
            keys = torch.arange(seq_len, device=blocks.device).unsqueeze(0)
            masks.append((keys <= rows) & (keys > rows - window))
        return first_keys, decode_mask, masks


# With the C kernel, a prefill chunk whose context (cached prefix + chunk) is at most
# this many tokens attends row by row, each row a query over its own causal prefix
# (what a decode is): no gathered float32 copy of the context and no SDPA call per
# chunk, which makes whole prefills faster. Each row re-reads its context, so the cost
# grows with chunk x context: past about this much context (a later chunk of a long
# prompt, a long cached prefix) SDPA's blocked kernel is the faster.
MAX_ROWWISE_CONTEXT = 2048


def make_cpu_plan(query_start_loc: list[int], seq_lens: list[int],
                  block_tables: list[list[int]], block_size: int,
                  num_cache_blocks: int, native: bool = False,
                  device: torch.device | str = "cpu") -> CPUAttentionPlan:
    """From plain lists (the model runner's per-step bookkeeping): no device syncs.
    ``num_cache_blocks`` is the cache's block count (V rows follow the K rows);
    ``native``: decodes, and prefill chunks of short contexts row by row, run in the C
    kernel (the caller checked it is built and supports the dtype). ``device``: the KV
    cache's: every index and mask tensor is built there, since ``index_select`` and
    SDPA refuse operands on two devices (the torch backend on CUDA)."""
    device = torch.device(device)
    if native and device.type != "cpu":
        raise ValueError(f"the C attention kernel reads CPU caches only, not {device}")

    plan = CPUAttentionPlan()
    query_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))]
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    plan.num_decodes = len(decodes)
    plan.decode_only = bool(decodes) and len(decodes) == len(seq_lens)
    rowwise = [i for i, n in enumerate(query_lens)
               if n == 1 or (native and seq_lens[i] <= MAX_ROWWISE_CONTEXT)]
    if rowwise and native:
        _native_rows(plan, rowwise, query_start_loc, query_lens, seq_lens, block_tables,
                     block_size)
    elif decodes:
        _torch_decodes(plan, decodes, query_start_loc, seq_lens, block_tables, block_size,
                       num_cache_blocks, device)
    _prefill_chunks(plan, query_start_loc, seq_lens, block_tables, block_size,
                    num_cache_blocks, device)
    return plan


def _kv_rows(blocks: list[int], num_cache_blocks: int, device) -> torch.Tensor:
    """The cache rows of ``blocks``' K, then of their V (V rows follow the K rows)."""
    ids = torch.tensor(blocks, device=device)
    return torch.cat([ids, ids + num_cache_blocks])


def _torch_decodes(plan: CPUAttentionPlan, decodes: list[int], query_start_loc: list[int],
                   seq_lens: list[int], block_tables: list[list[int]], block_size: int,
                   num_cache_blocks: int, device) -> None:
    """The torch path's decodes: their blocks padded to the longest context, gathered
    in one go, and the mask of each row's keys."""
    num_blocks = max(cdiv(seq_lens[i], block_size) for i in decodes)
    padded = [block_tables[i][:num_blocks] + [0] * (num_blocks - len(block_tables[i]))
              for i in decodes]
    plan.decode_rows = torch.tensor([query_start_loc[i] for i in decodes], device=device)
    plan.decode_rows_kv = _kv_rows([b for row in padded for b in row], num_cache_blocks,
                                   device)
    lens = plan.decode_lens = torch.tensor([seq_lens[i] for i in decodes], device=device)
    keys = torch.arange(num_blocks * block_size, device=device)
    plan.decode_mask = (keys.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]


def _prefill_chunks(plan: CPUAttentionPlan, query_start_loc: list[int], seq_lens: list[int],
                    block_tables: list[list[int]], block_size: int, num_cache_blocks: int,
                    device) -> None:
    """Each prefill chunk the C kernel does not take row by row: one SDPA over its
    gathered context, causal with the offset of its cached prefix."""
    for i in range(len(seq_lens)):
        start, end, seq_len = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
        n = end - start
        if n <= 1 or (plan.native and seq_len <= MAX_ROWWISE_CONTEXT):
            continue
        blocks = _kv_rows(block_tables[i][:cdiv(seq_len, block_size)], num_cache_blocks,
                          device)
        mask = None
        if seq_len > n:  # causal over a cached prefix: row r sees keys <= context + r
            rows = torch.arange(n, device=device).unsqueeze(1) + (seq_len - n)
            mask = torch.arange(seq_len, device=device).unsqueeze(0) <= rows
        plan.prefills.append((start, end, seq_len, blocks, mask))


def _native_rows(plan: CPUAttentionPlan, seqs: list[int], query_start_loc: list[int],
                 query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                 block_size: int) -> None:
    """The C kernel's inputs: one query row per decode and per token of each prefill
    chunk of a short context (row r of a chunk of n sees the first seq_len - n + r + 1 tokens),
    with its sequence's block table."""
    width = max(cdiv(seq_lens[i], block_size) for i in seqs)
    tables = torch.tensor([block_tables[i][:width] + [0] * (width - len(block_tables[i][:width]))
                           for i in seqs], dtype=torch.int32)
    counts = torch.tensor([query_lens[i] for i in seqs])
    plan.native = True
    plan.all_rows_native = len(seqs) == len(seq_lens)
    if int(counts.max()) == 1:  # decodes only: a row each
        plan.decode_q_rows = torch.tensor([query_start_loc[i] for i in seqs], dtype=torch.int32)
        plan.decode_tables = tables
        plan.decode_seq_lens = torch.tensor([seq_lens[i] for i in seqs], dtype=torch.int32)
        return
    plan.decode_q_rows = torch.cat([torch.arange(query_start_loc[i], query_start_loc[i + 1],
                                                 dtype=torch.int32) for i in seqs])
    plan.decode_tables = tables.repeat_interleave(counts, dim=0)
    plan.decode_seq_lens = torch.cat([torch.arange(seq_lens[i] - query_lens[i] + 1,
                                                   seq_lens[i] + 1, dtype=torch.int32)
                                      for i in seqs])


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store token t's K/V at flat slot ``slot_mapping[t]`` of the layer's cache
    ``[2, blocks, block_size, kv_heads, d]`` (the CPU runner never pads: no negative
    slots to skip)."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def paged_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, plan: CPUAttentionPlan,
                        scale: float, window: int | None = None,
                        sinks: torch.Tensor | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """``q [T, heads, d]`` over the layer's paged cache
    ``[2, blocks, block_size, kv_heads, d]``; returns ``[T, heads, d]`` in q's dtype.
    ``window``: the layer's sliding window (None: the whole context); ``sinks``:
    ``[heads]`` logits joining each head's softmax denominator (None: none);
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` (None: as they are)."""
    first_keys, decode_mask, prefill_masks = (plan.windowed(window) if window
                                              else (None, plan.decode_mask, None))
    extras = (None if sinks is None else sinks.detach().float(), softcap or None)
    if plan.native:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_decode(q, out, kv_cache, plan.decode_q_rows, plan.decode_tables,
                     plan.decode_seq_lens, scale, first_keys, *extras)
        _prefill(q, kv_cache, plan, scale, out, prefill_masks, extras)
        return out
    if plan.decode_only:
        return _decode(q, kv_cache, plan, scale, decode_mask, extras).to(q.dtype)
    out = torch.empty_like(q)
    if plan.num_decodes:
        out[plan.decode_rows] = _decode(q[plan.decode_rows], kv_cache, plan, scale,
                                        decode_mask, extras).to(q.dtype)
    _prefill(q, kv_cache, plan, scale, out, prefill_masks, extras)
    return out


def _prefill(q, kv_cache, plan: CPUAttentionPlan, scale: float, out: torch.Tensor,
             window_masks: list | None = None, extras: tuple = (None, None)) -> None:
    """Each prefill chunk: one SDPA over its gathered context, into ``out``'s rows
    (``window_masks``: each chunk's sliding-window mask instead of its causal one;
    ``extras``: (sinks, softcap), either of which makes it ``_attention_with_extras``)."""
    sinks, softcap = extras
    for i, (start, end, seq_len, blocks, mask) in enumerate(plan.prefills):
        if window_masks is not None:
            mask = window_masks[i]
        kv = _gather(kv_cache, blocks)[:, :seq_len].transpose(1, 2)  # [2, kv_heads, L, d]
        qs = q[start:end].float().transpose(0, 1)  # [heads, n, d]
        if sinks is None and softcap is None:
            o = F.scaled_dot_product_attention(qs, kv[0], kv[1], attn_mask=mask,
                                               is_causal=mask is None, scale=scale,
                                               enable_gqa=True)
        else:
            if mask is None:  # a whole prompt: causal from its first token
                mask = torch.ones(end - start, seq_len, dtype=torch.bool,
                                  device=q.device).tril()
            group = qs.shape[0] // kv.shape[1]
            o = _attention_with_extras(qs, kv[0].repeat_interleave(group, 0),
                                       kv[1].repeat_interleave(group, 0), mask, scale,
                                       None if sinks is None else sinks[:, None, None],
                                       softcap)
        out[start:end] = o.transpose(0, 1)


def _attention_with_extras(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor, scale: float, sinks: torch.Tensor | None,
                           softcap: float | None) -> torch.Tensor:
    """softmax(cap(q k^T scale) masked, sink) v in float32, batch dimensions broadcast:
    ``q [..., n, d]``, ``k``, ``v [..., L, d]``, ``mask`` True where a key is seen,
    ``sinks`` shaped to broadcast against the scores' ``[..., n, 1]`` (or None). The
    sink is a last column of the scores that the value product leaves out."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs @ v


def _gather(kv_cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """K and V of some blocks in one gather (``rows``: K rows then V rows of the cache
    viewed as ``[2 * blocks, row]``): ``[2, len * block_size, kv_heads, d]`` float32."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    got = kv_cache.view(2 * num_blocks, -1).index_select(0, rows)
    return got.view(2, -1, kv_heads, head_dim).float()


def _decode(q, kv_cache, plan: CPUAttentionPlan, scale: float,
            mask: torch.Tensor, extras: tuple = (None, None)) -> torch.Tensor:
    num, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    group = heads // kv_heads
    length = mask.shape[-1]
    kv = _gather(kv_cache, plan.decode_rows_kv).view(2, num, length, kv_heads, head_dim)
    qg = q.float().view(num, kv_heads, group, head_dim)  # the group is the query length
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
    sinks, softcap = extras
    if sinks is None and softcap is None:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    else:  # query head kv_head * group + g is row g of its KV head's "query"
        o = _attention_with_extras(qg, k, v, mask, scale,
                                   None if sinks is None else sinks.view(kv_heads, group, 1),
                                   softcap)
    return o.reshape(num, heads, head_dim)
