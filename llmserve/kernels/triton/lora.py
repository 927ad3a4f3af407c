"""Triton kernels for batched multi-LoRA (punica's segmented gather matmul, SGMV).

One batch mixes sequences that use different LoRA adapters, or none. The flat batch
holds each sequence's new tokens contiguously, so it is a list of segments, each with
the slot of its adapter in the stacked weights (-1: the base model alone). A LoRA
linear adds ``x @ A[slot].T @ B[slot].T`` to the base output in two launches:

- ``lora_shrink``: ``xa = x @ A[slot].T`` for all the linear's output slices at once
  (``a [slots, n*R, K]``, slice i's A in rows ``i*R:(i+1)*R``), float32 out;
- ``lora_expand``: once per output slice, ``y[:, out_offset:out_offset+N_i] +=
  xa[:, rank_offset:rank_offset+R] @ b[slot].T``, summed in float32 with y's old value
  and rounded once into y's dtype.

Grid: (segment, row tile, column tile). A program reads its segment's slot and exits at
once for -1 or when its row tile starts past the segment's end, so ``max_seg_len`` (a
Python int from the caller) only sizes the grid: nothing reads a device value back on
the host, and both launches can be captured in a CUDA graph.

``tl.dot`` wants tiles of at least 16 in each dimension: ranks below 16 (and row tiles
of one-token decodes) are padded with masked loads. With float32 models the dots run
in IEEE float32 on a GPU (not TF32), so they agree with the reference as closely there
as in the interpreter; 16-bit models multiply on tensor cores with float32 sums, and
the expand step multiplies the float32 ``xa`` by B widened to float32 (TF32 keeps B's
16-bit values exactly, unlike rounding ``xa`` to 16 bits).

``lora_shrink_reference`` and ``lora_expand_reference`` are the PyTorch references: a
loop over the segments (host reads; for tests, not for the hot path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DOT_MIN = 16  # tl.dot's smallest tile side
SHRINK_BLOCK_N = 64  # columns of xa (ranks of all slices) per program
SHRINK_BLOCK_K = 64  # hidden features per step of the shrink's reduction
EXPAND_BLOCK_N = 64  # output features per program


# --- PyTorch references ---------------------------------------------------------------
def _segments(seg_starts: torch.Tensor, seg_slots: torch.Tensor):
    """(first row, end row, slot) of each segment, read on the host."""
    starts = seg_starts.tolist()
    return [(starts[g], starts[g + 1], slot) for g, slot in enumerate(seg_slots.tolist())]


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor,
                          seg_slots: torch.Tensor, max_seg_len: int) -> torch.Tensor:
    """``[T, n*R]`` float32: each segment's rows times its slot's A, transposed; rows of
    slot -1 (and rows in no segment) are 0. ``max_seg_len`` is unused (API parity)."""
    del max_seg_len
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for start, end, slot in _segments(seg_starts, seg_slots):
        if slot >= 0 and end > start:
            out[start:end] = x[start:end].float() @ a[slot].float().T
    return out


def lora_expand_reference(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
                          seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                          max_seg_len: int, rank_offset: int, out_offset: int) -> None:
    """In place: ``y[rows, out_offset:out_offset+N] += xa[rows, rank_offset:+R] @
    b[slot].T`` for each segment with a slot, summed in float32, rounded once."""
    del max_seg_len
    n, rank = b.shape[1], b.shape[2]
    for start, end, slot in _segments(seg_starts, seg_slots):
        if slot < 0 or end <= start:
            continue
        delta = xa[start:end, rank_offset:rank_offset + rank].float() @ b[slot].float().T
        view = y[start:end, out_offset:out_offset + n]
        view.copy_((view.float() + delta).to(y.dtype))


# --- Triton kernels -------------------------------------------------------------------
@triton.jit
def _segment_rows(seg_starts_ptr, seg_slots_ptr, BLOCK_M: tl.constexpr):
    """This program's slot, its row indices (int64) and which of them are in its
    segment; slot -1 also when the row tile starts past the segment's end."""
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    start = tl.load(seg_starts_ptr + seg).to(tl.int64)
    end = tl.load(seg_starts_ptr + seg + 1).to(tl.int64)
    first = start + tl.program_id(1) * BLOCK_M
    slot = tl.where(first < end, slot, -1)
    rows = first + tl.arange(0, BLOCK_M).to(tl.int64)
    return slot, rows, rows < end


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr,
                   K, NR, stride_xm, stride_xk, stride_as, stride_an, stride_ak,
                   stride_om, stride_on, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[rows, cols] = x[rows, :] @ a[slot, cols, :].T for one (segment, row tile,
    column tile); float32 sums over K in BLOCK_K steps."""
    slot, rows, row_mask = _segment_rows(seg_starts_ptr, seg_slots_ptr, BLOCK_M)
    if slot < 0:
        return
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < NR
    x_rows = x_ptr + rows[:, None] * stride_xm
    a_cols = a_ptr + slot * stride_as + cols[None, :] * stride_an
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :] * stride_xk,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_cols + ks[:, None] * stride_ak,  # [BLOCK_K, BLOCK_N]: A transposed
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, acc,
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _expand_kernel(y_ptr, xa_ptr, b_ptr, seg_starts_ptr, seg_slots_ptr,
                   N, R, rank_offset, out_offset, stride_ym, stride_yn,
                   stride_xam, stride_xar, stride_bs, stride_bn, stride_br,
                   IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    """y[rows, out_offset + cols] += xa[rows, rank_offset:+R] @ b[slot, cols, :].T for
    one (segment, row tile, column tile): one dot over the whole (padded) rank."""
    slot, rows, row_mask = _segment_rows(seg_starts_ptr, seg_slots_ptr, BLOCK_M)
    if slot < 0:
        return
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    xa = tl.load(xa_ptr + rows[:, None] * stride_xam + (rank_offset + ranks)[None, :]
                 * stride_xar, mask=row_mask[:, None] & rank_mask[None, :], other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bn
                + ranks[:, None] * stride_br,  # [BLOCK_R, BLOCK_N]: B transposed
                mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
    if IEEE:
        delta = tl.dot(xa, b.to(tl.float32), input_precision="ieee")
    else:
        delta = tl.dot(xa, b.to(tl.float32))
    y_tile = y_ptr + rows[:, None] * stride_ym + (out_offset + cols)[None, :] * stride_yn
    tile_mask = row_mask[:, None] & col_mask[None, :]
    old = tl.load(y_tile, mask=tile_mask, other=0.0).to(tl.float32)
    tl.store(y_tile, (old + delta).to(y_ptr.dtype.element_ty), mask=tile_mask)


# --- launchers ------------------------------------------------------------------------
def _at_least_dot(n: int) -> int:
    return max(DOT_MIN, triton.next_power_of_2(n))


def _row_block(max_seg_len: int) -> int:
    """16 rows when every segment is short (decodes), else 64 (prefill chunks)."""
    return DOT_MIN if max_seg_len <= DOT_MIN else 64


def _check_segments(seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> int:
    """The number of segments, after shape checks that read no device values."""
    if seg_slots.dim() != 1 or seg_starts.shape != (seg_slots.numel() + 1,):
        raise ValueError(f"seg_starts must be [G+1] for seg_slots [G]; got "
                         f"{tuple(seg_starts.shape)} and {tuple(seg_slots.shape)}")
    return seg_slots.numel()


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, max_seg_len: int) -> torch.Tensor:
    """``xa [T, n*R]`` float32 = each segment's rows of ``x [T, K]`` times
    ``a[slot].T`` (``a [S, n*R, K]``); rows of slot -1 are 0. ``max_seg_len`` must
    bound every segment's length (rows past it would be left 0)."""
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"x [T, K] and a [S, n*R, K] disagree: {tuple(x.shape)}, "
                         f"{tuple(a.shape)}")
    if a.dtype != x.dtype:
        raise ValueError(f"x is {x.dtype} but the LoRA A weights are {a.dtype}")
    num_segments = _check_segments(seg_starts, seg_slots)
    tokens, k = x.shape
    nr = a.shape[1]
    out = torch.zeros(tokens, nr, dtype=torch.float32, device=x.device)
    if num_segments == 0 or max_seg_len <= 0 or tokens == 0:
        return out
    block_m = _row_block(max_seg_len)
    block_n = min(SHRINK_BLOCK_N, _at_least_dot(nr))
    grid = (num_segments, triton.cdiv(max_seg_len, block_m), triton.cdiv(nr, block_n))
    _shrink_kernel[grid](
        x, a, out, seg_starts, seg_slots, k, nr, x.stride(0), x.stride(1),
        a.stride(0), a.stride(1), a.stride(2), out.stride(0), out.stride(1),
        IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=SHRINK_BLOCK_K)
    return out


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int,
                rank_offset: int, out_offset: int) -> None:
    """In place: ``y[rows of g, out_offset:out_offset+N_i] += xa[rows,
    rank_offset:rank_offset+R] @ b[slot].T`` (``b [S, N_i, R]``), summed in float32
    with y's value and rounded once into y's dtype; rows of slot -1 are untouched."""
    if y.dim() != 2 or xa.dim() != 2 or b.dim() != 3 or xa.shape[0] != y.shape[0]:
        raise ValueError(f"y [T, N], xa [T, n*R] and b [S, N_i, R] disagree: "
                         f"{tuple(y.shape)}, {tuple(xa.shape)}, {tuple(b.shape)}")
    if xa.dtype != torch.float32:
        raise ValueError(f"xa must be float32 (lora_shrink's output), not {xa.dtype}")
    n, rank = b.shape[1], b.shape[2]
    if not (0 <= rank_offset and rank_offset + rank <= xa.shape[1]):
        raise ValueError(f"ranks {rank_offset}:{rank_offset + rank} outside xa's "
                         f"{xa.shape[1]} columns")
    if not (0 <= out_offset and out_offset + n <= y.shape[1]):
        raise ValueError(f"columns {out_offset}:{out_offset + n} outside y's "
                         f"{y.shape[1]} columns")
    num_segments = _check_segments(seg_starts, seg_slots)
    if num_segments == 0 or max_seg_len <= 0 or y.shape[0] == 0 or n == 0:
        return
    block_m = _row_block(max_seg_len)
    grid = (num_segments, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, EXPAND_BLOCK_N))
    _expand_kernel[grid](
        y, xa, b, seg_starts, seg_slots, n, rank, rank_offset, out_offset,
        y.stride(0), y.stride(1), xa.stride(0), xa.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        IEEE=y.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=EXPAND_BLOCK_N,
        BLOCK_R=_at_least_dot(rank))
