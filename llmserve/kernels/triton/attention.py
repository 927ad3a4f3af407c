"""Triton kernels: paged KV-cache writes and varlen paged attention.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.

``unified_attention`` serves a batch that mixes prefill chunks and decodes.
Each program owns one KV head and a tile of BLOCK_Q query tokens of one
sequence; the query heads that share the KV head are packed into the M
dimension (BLOCK_M = BLOCK_Q x padded group size), so every K/V tile is loaded
once for the whole group (GQA). A program finds its sequence by binary search
over the query start offsets. Keys are visited one cache block at a time with
an fp32 online softmax; a row whose keys are all masked keeps a zero output.

Decode-only batches (one query token per sequence) run a decode kernel instead:
program (sequence, KV head, split) holds just the group's query heads as its rows
(BLOCK_Q = 1), so no row of its tile is padding for queries that do not exist. With
several splits each program attends a disjoint share of the keys and a second kernel
merges the partial results by log-sum-exp; the split count is chosen from the GPU's
occupancy (``choose_splits``), so long contexts fill the SMs at any batch size.

A sliding window of W keys (``window``; 0: none) limits the query at position p to the
keys in (p - W, p]: masked in the online softmax, and the cache blocks wholly before a
tile's window are never visited.

Two extras, each a compile-time switch so that models without them pay nothing:
logit soft-capping (Gemma 2: each scaled score s becomes ``softcap * tanh(s /
softcap)`` before masking) and attention sinks (gpt-oss: a learned logit per query head
that joins the softmax's maximum and denominator but owns no value row). A sink is
added where a row's softmax is finished: by the kernel that writes the output, so in
split-KV decode by the reduce, once, never per split.

Shapes the kernels support are checked by ``check_supported`` (a ValueError
that names the violated limit); ``unified_attention`` calls it on every call.

The PyTorch references live in ``reference.py``; tests compare the two under
``TRITON_INTERPRET=1`` on CPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Limits of the kernels below (see ``check_supported``).
MIN_BLOCK_SIZE = 16  # BLOCK_SIZE is the K dimension of tl.dot(p, v): K >= 16 for 16-bit
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # head_dim is padded to a power of two in [16, 256]
MAX_SPLITS = 32  # split-KV: NUM_SPLITS is a tl.arange length, so a power of two <= this
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --- KV-cache write -------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     key_stride, value_stride, ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + token.to(tl.int64) * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * value_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store token t's K/V (``[T, kv_heads, head_dim]``) at flat slot
    ``slot_mapping[t]`` = block * block_size + offset; negative slots are skipped."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    key, value = key.reshape(num_tokens, row), value.reshape(num_tokens, row)
    assert key.stride(1) == 1 and value.stride(1) == 1 and k_cache.is_contiguous()
    _write_kv_kernel[(num_tokens,)](key, value, k_cache, v_cache, slot_mapping,
                                    key.stride(0), value.stride(0), ROW=row,
                                    BLOCK=triton.next_power_of_2(row))


# --- attention ------------------------------------------------------------------------------------
@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Index of the sequence whose q-blocks contain global q-block ``q_block``.
    Sequence s owns q-blocks starting at query_start_loc[s] // BLOCK_Q + s."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_blocks(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_ptr,
                   kv_head, first_block, last_block, seq_len, context_len, query_pos,
                   stride_kb, stride_ks, stride_kh, scale, window, softcap,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_DIM_P: tl.constexpr, USE_SOFTCAP: tl.constexpr):
    """Online softmax over cache blocks [first_block, last_block)."""
    offs_s = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    # Keys at or below this position are outside each row's sliding window (-1: none).
    below = tl.where(window > 0, context_len + query_pos - window, -1)
    for j in range(first_block, last_block):
        block = tl.load(block_table_ptr + j).to(tl.int64)  # int64: large pools
        key_pos = j * BLOCK_SIZE + offs_s
        base = block * stride_kb + kv_head * stride_kh
        kv_off = base + offs_s[:, None] * stride_ks + offs_d[None, :]
        kv_mask = (key_pos[:, None] < seq_len) & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_SIZE], fp32
        if USE_SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (e^2x + 1): exact at +-inf
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (key_pos[None, :] < seq_len) & \
                  (key_pos[None, :] <= context_len + query_pos[:, None]) & \
                  (key_pos[None, :] > below[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet has m_new = -inf: subtract 0 instead.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _finish(acc, m_i, l_i, sinks_ptr, head, row_mask, HAS_SINKS: tl.constexpr):
    """Each row's output: acc / l, with the row's head's sink joining l (rescaled to
    the larger of the two maxima); a row with nothing visible stays zero."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0)
        m = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp(sink - m)
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


# Triton compiles one variant of a kernel per "specialisation" of its integer arguments
# (equal to 1, divisible by 16, other). ``num_seqs`` and the block tables' row stride
# (the step's longest table) change with every batch, so specialising on them would
# make early requests of a new shape wait for a compile the warm-up never saw; they are
# plain runtime integers instead (tests/kernels/test_kernels.py checks every integer argument).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "window"])
def _unified_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr,
        block_tables_ptr, sinks_ptr, num_seqs, scale, window, softcap,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_bt,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, USE_SOFTCAP: tl.constexpr,
        HAS_SINKS: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    query_pos = local * BLOCK_Q + offs_m // GROUP_P
    head_in_group = offs_m % GROUP_P
    head = kv_head * GROUP + head_in_group
    offs_d = tl.arange(0, HEAD_DIM_P)
    row_mask = (query_pos < q_len) & (head_in_group < GROUP)
    token = (q_start + query_pos).to(tl.int64)
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    io_mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)

    # Keys this tile can see: up to the causal limit of its last query row.
    last_query = tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len) - 1
    num_blocks = tl.cdiv(context_len + last_query + 1, BLOCK_SIZE)
    # ... and from the first key the window of its first query row reaches.
    first_block = tl.where(window > 0, tl.maximum(context_len + local * BLOCK_Q - window + 1,
                                                  0) // BLOCK_SIZE, 0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr,
                                   block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head,
                                   first_block, num_blocks, seq_len, context_len, query_pos,
                                   stride_kb, stride_ks, stride_kh, scale, window, softcap,
                                   BLOCK_SIZE, HEAD_DIM, HEAD_DIM_P, USE_SOFTCAP)
    out = _finish(acc, m_i, l_i, sinks_ptr, head, row_mask, HAS_SINKS)
    o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["stride_bt", "window"])
def _split_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr, scale, window, softcap,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
        NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr,
        GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, USE_SOFTCAP: tl.constexpr,
        HAS_SINKS: tl.constexpr):
    """Decode-only: program (seq, kv head, split) attends one share of the keys. With one
    split it writes the output itself (sinks included); otherwise its partial result,
    without the sink, which the reduce adds once."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    if tl.load(query_start_loc_ptr + seq + 1) == token:  # no query (padding): no output row
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_m = tl.arange(0, BLOCK_M)
    head_in_group = offs_m % GROUP_P
    head = kv_head * GROUP + head_in_group
    # Rows past GROUP_P exist only where Triton's tl.dot needs more rows than the group
    # has (BLOCK_M floor, see _decode_rows); rows past GROUP pad the group to a power of 2.
    row_mask = (offs_m < GROUP_P) & (head_in_group < GROUP)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    total_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    # A sliding window's decode sees keys [seq_len - window, seq_len): split those blocks.
    window_start = tl.where(window > 0, tl.maximum(seq_len - window, 0) // BLOCK_SIZE, 0)
    per_split = tl.cdiv(total_blocks - window_start, NUM_SPLITS)
    first = window_start + split * per_split
    last = tl.minimum(first + per_split, total_blocks)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    query_pos = tl.zeros([BLOCK_M], dtype=tl.int32)  # a decode is query 0 of context seq_len-1
    acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr,
                                   block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head,
                                   first, last, seq_len, seq_len - 1, query_pos,
                                   stride_kb, stride_ks, stride_kh, scale, window, softcap,
                                   BLOCK_SIZE, HEAD_DIM, HEAD_DIM_P, USE_SOFTCAP)
    if NUM_SPLITS == 1:  # the whole context: no partials, no reduce launch
        out = _finish(acc, m_i, l_i, sinks_ptr, head, row_mask, HAS_SINKS)
        tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    else:
        part = (seq.to(tl.int64) * NUM_SPLITS + split) * NUM_HEADS + head
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], acc,
                 mask=row_mask[:, None])
        tl.store(part_m_ptr + part, m_i, mask=row_mask)
        tl.store(part_l_ptr + part, l_i, mask=row_mask)


@triton.jit
def _split_reduce_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, query_start_loc_ptr,
                         sinks_ptr, stride_ot, stride_oh, NUM_HEADS: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_P: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Merge the splits of one (sequence, head) by log-sum-exp; the head's sink joins
    the merged denominator once."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    if tl.load(query_start_loc_ptr + seq + 1) == token:  # no query: that row is not ours
        return
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    part = (seq.to(tl.int64) * NUM_SPLITS + offs_s) * NUM_HEADS + head
    m = tl.load(part_m_ptr + part)
    l = tl.load(part_l_ptr + part)  # noqa: E741
    m_max = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head)
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)  # empty splits have m = -inf: weight 0
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :])
    total = tl.sum(acc * w[:, None], axis=0)
    denom = tl.sum(l * w, axis=0)
    if HAS_SINKS:
        denom += tl.exp(sink - m_max)
    out = total / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def check_supported(*, block_size: int | None = None, head_dim: int | None = None,
                    num_heads: int | None = None, num_kv_heads: int | None = None,
                    dtype: torch.dtype | None = None) -> None:
    """Raise ValueError, naming every violated limit, if the Triton kernels cannot
    serve this shape; arguments left None are not checked (a config can check
    ``block_size`` and ``dtype`` before the model's head shape is known).

    * ``block_size``: a power of two >= 16. A cache block is one key tile
      (``tl.arange``) and the K dimension of ``tl.dot(p, v)``, which Triton compiles
      only for K >= 16 with 16-bit inputs (older releases want M, N, K >= 16). The
      interpreter does not check this, so CPU tests cannot catch it.
    * ``head_dim``: 16 .. 256, any value (80, 96, 112 ... are padded to the next power
      of two; the padded width is the K dimension of ``tl.dot(q, k^T)``). 256 is the
      widest tile tried; wider ones need more registers and shared memory per program.
    * ``num_heads`` a multiple of ``num_kv_heads`` (GQA groups of equal size; the
      group size itself need not be a power of two).
    * ``dtype`` (optional): float16, bfloat16 or float32; bfloat16 is refused when the
      kernels run in Triton's CPU interpreter, whose bf16 arithmetic is wrong.
    """
    problems = []
    if block_size is not None and (block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1)):
        problems.append(f"block_size must be a power of two >= {MIN_BLOCK_SIZE} "
                        f"(a key tile of tl.dot), got {block_size}")
    if head_dim is not None and not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        problems.append(f"head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}")
    if num_heads is not None and num_kv_heads is not None and (
            num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads):
        problems.append(f"num_heads ({num_heads}) must be a positive multiple of "
                        f"num_kv_heads ({num_kv_heads})")
    if dtype is not None and dtype not in _SUPPORTED_DTYPES:
        problems.append(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    if dtype == torch.bfloat16 and INTERPRETED:
        problems.append("bfloat16 is computed wrongly by Triton's interpreter "
                        "(TRITON_INTERPRET=1); use float16 or float32 there")
    if problems:
        raise ValueError("Triton attention kernels do not support this shape: "
                         + "; ".join(problems))


def _prev_power_of_2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


# --- split-KV decode: how many splits ------------------------------------------------------
DEFAULT_NUM_SMS = 132  # an H200; used where there is no CUDA device (CPU, the interpreter)
# Programs per SM the split count aims for: several resident programs per SM keep enough
# K/V loads in flight to cover HBM latency, and a few waves even out the tail where
# sequences of unequal length finish at different times.
PROGRAMS_PER_SM = 4
MIN_SPLIT_BLOCKS = 4  # no split shorter than this many cache blocks (of the longest sequence)
MIN_SPLIT_CONTEXT = 512  # below this many keys a decode step is launch-bound: never split


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device | str | None = None) -> int:
    """Streaming multiprocessors of ``device`` (default: the current CUDA device), or
    DEFAULT_NUM_SMS without CUDA, where the interpreter makes the same choices the
    H200 would. Called per attention call: the CUDA query is cached per device."""
    if INTERPRETED or (device is None and not torch.cuda.is_available()):
        return DEFAULT_NUM_SMS
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)


def choose_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_size: int,
                  sms: int) -> int:
    """Split-KV count for a decode-only batch on a GPU of ``sms`` SMs: a power of two in
    [1, MAX_SPLITS], the smallest that gives (sequences x KV heads x splits) >=
    PROGRAMS_PER_SM x sms programs, but no more than leaves every split
    MIN_SPLIT_BLOCKS cache blocks of the longest sequence (shorter sequences leave their
    last splits empty, which the merge ignores).

    Powers of two because the reduce kernel loads the splits of one head as
    ``tl.arange(0, NUM_SPLITS)``, and because NUM_SPLITS is a compile-time constant:
    powers of two keep the variants few (six), so ``warm_up`` compiles them all ahead."""
    programs = num_seqs * num_kv_heads
    target = PROGRAMS_PER_SM * sms
    if programs >= target or max_seq_len < MIN_SPLIT_CONTEXT:
        return 1
    wanted = triton.next_power_of_2(-(-target // programs))
    by_length = max_seq_len // (MIN_SPLIT_BLOCKS * block_size)
    return _prev_power_of_2(min(wanted, MAX_SPLITS, by_length))


def _choose_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_size: int,
                   sms: int | None = None) -> int:
    """``choose_splits`` on this machine's GPU (``sms`` None: the current device's)."""
    return choose_splits(num_seqs, num_kv_heads, max_seq_len, block_size,
                         num_sms() if sms is None else sms)


def reachable_splits(num_kv_heads: int, max_seq_len: int, block_size: int,
                     sms: int | None = None) -> list[int]:
    """Every split count ``_choose_splits`` can return for this model and context limit:
    the powers of two up to its choice for one sequence at the longest context (it
    chooses fewer splits for more sequences and for shorter contexts)."""
    top = _choose_splits(1, num_kv_heads, max_seq_len, block_size, sms)
    return [1 << i for i in range(top.bit_length())]


# --- decode tile ------------------------------------------------------------------------------
@functools.cache
def _min_dot_rows() -> int:
    """Fewest rows (M) tl.dot accepts. Triton >= 3.2 asks the backend (NVIDIA: M >= 1,
    padding small tiles for the tensor cores; AMD: 1) and the interpreter takes any;
    older releases want M >= 16."""
    if INTERPRETED:
        return 1
    try:
        from triton.backends.nvidia.compiler import min_dot_size  # noqa: F401
    except ImportError:
        return 16
    return 1


def _decode_rows(group_p: int, decode_tile: str = "fit") -> int:
    """BLOCK_M of the decode kernel. "fit": the group's query heads and nothing else (a
    decode has one query token, so a BLOCK_Q > 1 tile was (BLOCK_Q - 1) / BLOCK_Q padding:
    three quarters at GQA 4); fewer rows mean a smaller fp32 accumulator and softmax per
    program, so more programs stay resident to keep K/V loads in flight. "padded": the
    16-row tile of before (benchmark comparison only)."""
    if decode_tile == "padded":
        return max(16, group_p)
    return max(group_p, _min_dot_rows())


def warm_up(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
            dtype: torch.dtype, device: torch.device, max_seq_len: int,
            max_num_seqs: int, sinks: bool = False, softcap: bool = False) -> int:
    """Compile every kernel variant the engine can launch, on tiny inputs: prefill and
    decode, and each split count of split-KV decode. The kernels do not specialise on
    the batch (``do_not_specialize``); batches of 1, 2 and 16 sequences (the integer
    classes Triton specialises on: 1, multiples of 16, others) still run, so a kernel
    that did would be compiled here. ``sinks`` / ``softcap``: the model's layers have
    them (gpt-oss, Gemma 2), so the variants with those switches are the ones compiled.
    Returns the number of launches."""
    check_supported(block_size=block_size, head_dim=head_dim, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, dtype=dtype)
    batch_sizes = sorted({n for n in (1, 2, 16) if n <= max_num_seqs})
    num_blocks = max(batch_sizes) * 2
    cache = torch.zeros((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype,
                        device=device)
    splits = reachable_splits(num_kv_heads, max_seq_len, block_size, num_sms(device))
    extras = dict(sinks=torch.zeros(num_heads, device=device) if sinks else None,
                  softcap=1.0 if softcap else None)
    launches = 0
    for num_seqs in batch_sizes:
        for query_len in (1, 2):
            num_tokens = num_seqs * query_len
            q = torch.zeros((num_tokens, num_heads, head_dim), dtype=dtype, device=device)
            kv = torch.zeros((num_tokens, num_kv_heads, head_dim), dtype=dtype, device=device)
            slots = torch.arange(num_tokens, device=device) * 2  # inside each seq's 1st block
            write_kv_cache(kv, kv, cache[0], cache[1], slots)
            starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * query_len
            lens = torch.full((num_seqs,), query_len, dtype=torch.int32, device=device)
            tables = torch.arange(num_blocks, dtype=torch.int32, device=device).view(
                num_seqs, -1)
            for num_splits in (splits if query_len == 1 else [1]):
                unified_attention(q, cache[0], cache[1], torch.empty_like(q),
                                  query_start_loc=starts, seq_lens=lens, block_tables=tables,
                                  max_query_len=query_len, max_seq_len=query_len,
                                  scale=head_dim ** -0.5, num_splits=num_splits, **extras)
                launches += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return launches


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor, *, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int,
                      max_seq_len: int, scale: float, num_splits: int | None = None,
                      decode_tile: str = "fit",
                      window: int | None = None, sinks: torch.Tensor | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Causal paged attention of each sequence's new tokens over its cached keys
    (``window``: the last that many of them, a sliding window; None: all).
    ``sinks``: ``[num_heads]`` float32 logits joining each head's softmax denominator
    (attention sinks; None: none); ``softcap``: scores become
    ``softcap * tanh(scores / softcap)`` (None or 0: left as they are).

    ``num_splits`` forces the split-KV path (decode-only batches) with that many
    splits (a power of two <= MAX_SPLITS); by default it is chosen from the batch
    shape and the GPU's SM count. ``decode_tile="padded"`` brings back the 16-row decode
    tile of before (``warm_up`` does not compile its variants). Raises ValueError for
    shapes outside ``check_supported``."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_supported(block_size=block_size, head_dim=head_dim, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, dtype=q.dtype)
    if num_splits is not None and not (1 <= num_splits <= MAX_SPLITS
                                       and num_splits & (num_splits - 1) == 0):
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_SPLITS}], "
                         f"got {num_splits}")
    if decode_tile not in ("fit", "padded"):
        raise ValueError(f"decode_tile must be 'fit' or 'padded', got {decode_tile!r}")
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    head_dim_p = triton.next_power_of_2(head_dim)
    assert k_cache.stride(3) == 1 and q.stride(2) == 1 and out.stride(2) == 1
    decode = max_query_len == 1
    window = window or 0
    extras = _Extras(sinks, softcap, num_heads)
    if num_splits is None:
        num_splits = (_choose_splits(num_seqs, num_kv_heads, max_seq_len, block_size,
                                     num_sms(q.device)) if decode else 1)
    if decode and (num_splits > 1 or decode_tile == "fit"):
        _decode(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
                num_splits, group, group_p, head_dim, head_dim_p,
                _decode_rows(group_p, decode_tile), window, extras)
        return out
    _mixed(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale, group,
           group_p, head_dim_p, window, extras)
    return out


def _mixed(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale, group,
           group_p, head_dim_p, window, extras):
    """Prefill chunks and mixed batches: BLOCK_Q query tokens x the group per tile. A
    decode inside a mixed batch still fills one BLOCK_Q row of its tile; choosing the
    tile per sequence would need the decode/prefill split on the host every step."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    block_m = max(16, group_p)
    block_q = block_m // group_p
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        extras.sinks_arg(q), num_seqs, scale, window, extras.softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m,
        USE_SOFTCAP=extras.use_softcap, HAS_SINKS=extras.has_sinks)


class _Extras:
    """Sinks and soft-capping as kernel arguments: the compile-time switches, the cap
    (1.0 when unused, never divided by then) and the sinks (q itself when none: a valid
    pointer the kernels never read)."""

    def __init__(self, sinks: torch.Tensor | None, softcap: float | None, num_heads: int):
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(f"sinks must have shape ({num_heads},), got {tuple(sinks.shape)}")
        self.sinks = None if sinks is None else sinks.detach().float().contiguous()
        self.has_sinks = sinks is not None
        self.use_softcap = bool(softcap)
        self.softcap = float(softcap) if softcap else 1.0

    def sinks_arg(self, q: torch.Tensor) -> torch.Tensor:
        return self.sinks if self.has_sinks else q


def _decode(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
            num_splits, group, group_p, head_dim, head_dim_p, block_m, window, extras):
    num_heads = q.shape[1]
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    if num_splits == 1:  # the kernel writes ``out`` itself; the partial pointers go unused
        part_acc = part_m = part_l = out
    else:
        part_acc = torch.empty((num_seqs, num_splits, num_heads, head_dim_p),
                               dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_seqs, num_splits, num_heads), dtype=torch.float32,
                             device=q.device)
        part_l = torch.empty_like(part_m)
    _split_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l, query_start_loc, seq_lens,
        block_tables, extras.sinks_arg(q), scale, window, extras.softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, GROUP=group, GROUP_P=group_p,
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m,
        USE_SOFTCAP=extras.use_softcap, HAS_SINKS=extras.has_sinks)
    if num_splits > 1:
        _split_reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_m, part_l, out, query_start_loc, extras.sinks_arg(q),
            out.stride(0), out.stride(1), NUM_HEADS=num_heads, NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, HAS_SINKS=extras.has_sinks)


# True when this module's kernels were built for Triton's CPU interpreter
# (TRITON_INTERPRET=1 when it was imported): they then take CPU tensors.
INTERPRETED = type(_unified_attention_kernel).__name__ == "InterpretedFunction"
