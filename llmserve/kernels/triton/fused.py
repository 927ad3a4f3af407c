"""Triton kernels fusing the decode step's elementwise work (issue 27, ``--fused-kernels``).

A Llama decoder layer run op by op launches ~30 kernels a step, most of them small
elementwise passes over a few rows: at decode batch sizes the GPU then waits on
launches and re-reads the same rows from HBM. Three groups are fused here:

* ``add_rms_norm`` / ``rms_norm``: the residual add and the RMSNorm after it, one pass.
* ``rope_and_write_kv``: the rotary embedding of q and k, and the store of the
  rotated k and of v into the paged KV cache at the step's slots, one kernel; the
  attention kernel then only reads the cache (``write_kv_cache`` is not launched).
* ``silu_and_mul``: ``silu(gate) * up`` of the fused gate/up projection's output.

Each rounds as the op-by-op path it replaces does (comments below say where), so
float32 outputs match it to the last few ulps and 16-bit ones to one unit. The tests
(tests/kernels/test_fused_kernels.py) compare them under ``TRITON_INTERPRET=1`` on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_NORM_DIM = 65536  # one row is one program's tile


# --- residual add + RMSNorm ----------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r,
                         stride_o, stride_ro, eps, DIM: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < DIM
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the model's dtype, as ``x + residual`` in torch is, and
        # the norm is taken of that rounded residual stream.
        summed = (x + r).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / DIM + eps)
    # Hugging Face's order (LlamaRMSNorm; the C kernel add_rms_norm_bf16 matches it
    # too): the normalised row rounded to the model dtype, then times the weight,
    # rounded again.
    normed = (x * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as 2-D rows of ``dim`` with unit column stride (a view where it can be)."""
    rows = t.reshape(-1, dim)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    dim = x.shape[-1]
    if dim > MAX_NORM_DIM:
        raise ValueError(f"Triton RMSNorm: rows of {dim} unsupported (at most {MAX_NORM_DIM})")
    x2 = _rows(x, dim)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_res = None if residual is None else torch.empty_like(out)
    n = x2.shape[0]
    if n:
        r2 = x2 if residual is None else _rows(residual, dim)
        ro = out if new_res is None else new_res
        block = triton.next_power_of_2(dim)
        # One program per row: wide rows get more warps (8192 fp32 values = 32 a thread).
        _add_rms_norm_kernel[(n,)](x2, r2, weight, out, ro, x2.stride(0), r2.stride(0), dim,
                                   dim, eps, DIM=dim, BLOCK=block,
                                   HAS_RESIDUAL=residual is not None,
                                   num_warps=min(16, max(1, block // 256)))
    return out, new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` (last dimension), rounded as Hugging Face does."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of ``x + residual``, ``x + residual``): the decoder layer's residual add
    and the norm after it in one pass over the rows. Neither input is modified."""
    normed, new_residual = _norm(x, residual, weight, eps)
    return normed, new_residual


# --- rotary embedding + KV-cache write -----------------------------------------------
@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                          slot_ptr, stride_qkv, stride_cos, stride_sin, stride_qo,
                          NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, HALF_P: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    """Program (token, head block): BLOCK_H of the token's q and k heads (q heads first,
    then k heads, as in the fused projection), each rotated as two halves."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF_P)
    d_mask = offs < HALF
    c = tl.load(cos_ptr + token * stride_cos + offs, mask=d_mask, other=0.0)
    s = tl.load(sin_ptr + token * stride_sin + offs, mask=d_mask, other=0.0)
    in_range = heads < NUM_HEADS + NUM_KV_HEADS
    mask = in_range[:, None] & d_mask[None, :]
    src = qkv_ptr + token * stride_qkv + heads[:, None] * HEAD_DIM + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # Hugging Face's "rotate half" in float32, as apply_rotary computes it.
    lo = x1 * c[None, :] - x2 * s[None, :]
    hi = x2 * c[None, :] + x1 * s[None, :]

    is_q = heads < NUM_HEADS
    q_head = tl.where(is_q, heads, 0)
    q_dst = q_out_ptr + token * stride_qo + q_head[:, None] * HEAD_DIM + offs[None, :]
    q_mask = mask & is_q[:, None]
    tl.store(q_dst, lo.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_dst + HALF, hi.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: its query is computed, nothing is stored
        return
    is_k = in_range & (heads >= NUM_HEADS)
    kv_head = tl.where(is_k, heads - NUM_HEADS, 0)
    kv_mask = mask & is_k[:, None]
    cache_off = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head[:, None] * HEAD_DIM + offs[None, :]
    cache_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + cache_off, lo.to(cache_ty), mask=kv_mask)
    tl.store(k_cache_ptr + cache_off + HALF, hi.to(cache_ty), mask=kv_mask)
    # V head h sits NUM_KV_HEADS heads after K head h: copied as it is.
    v_src = src + NUM_KV_HEADS * HEAD_DIM
    tl.store(v_cache_ptr + cache_off, tl.load(v_src, mask=kv_mask), mask=kv_mask)
    tl.store(v_cache_ptr + cache_off + HALF, tl.load(v_src + HALF, mask=kv_mask), mask=kv_mask)


def rope_and_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int) -> torch.Tensor:
    """For the fused projection ``qkv [tokens, heads + 2 kv_heads, head_dim]`` (q, k, v
    heads in that order) and ``cos``/``sin`` (float32, ``[tokens, (1,) head_dim / 2]``):
    rotates k and stores it and v at flat slot ``slot_mapping[t]`` of the caches
    (``[blocks, block_size, kv_heads, head_dim]``; negative slots are skipped), and
    returns the rotated queries ``[tokens, heads, head_dim]``. The whole head is
    rotated (partial rotary is refused at start-up: supported.py)."""
    tokens = qkv.shape[0]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    if qkv.shape[1:] != (num_heads + 2 * kv_heads, head_dim):
        raise ValueError(f"qkv {tuple(qkv.shape)}: expected [tokens, {num_heads} + 2 x "
                         f"{kv_heads}, {head_dim}]")
    if qkv.stride(2) != 1 or qkv.stride(1) != head_dim:
        qkv = qkv.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    cos, sin = _rows(cos, head_dim // 2), _rows(sin, head_dim // 2)
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    half_p = triton.next_power_of_2(head_dim // 2)
    # ~512 values of a half per program: 8 heads of 128, 16 of 64.
    block_h = min(triton.next_power_of_2(num_heads + kv_heads), max(1, 512 // half_p))
    grid = (tokens, triton.cdiv(num_heads + kv_heads, block_h))
    _rope_write_kv_kernel[grid](qkv, cos, sin, q, k_cache, v_cache, slot_mapping,
                                qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0),
                                NUM_HEADS=num_heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                                HALF_P=half_p, BLOCK_H=block_h)
    return q


# --- SiLU x up -----------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, INTER: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + INTER + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch's rounding of F.silu(gate) * up: silu rounded to the dtype, then the product.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs,
             (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``gate_up [..., 2 * intermediate]`` (gate columns first),
    in one pass without the split's temporaries."""
    if gate_up.shape[-1] != 2 * intermediate:
        raise ValueError(f"gate_up's last dimension is {gate_up.shape[-1]}, "
                         f"expected 2 x {intermediate}")
    rows = _rows(gate_up, 2 * intermediate)
    out = torch.empty((*gate_up.shape[:-1], intermediate), dtype=gate_up.dtype,
                      device=gate_up.device)
    if rows.shape[0]:
        block = min(1024, triton.next_power_of_2(intermediate))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(intermediate, block))](
            rows, out, rows.stride(0), intermediate, INTER=intermediate, BLOCK=block)
    return out
