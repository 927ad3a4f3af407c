"""The attention call of every layer: store this step's K/V, attend over the cache.

On CUDA the Triton kernels run; on CPUs the CPU path (``kernels/cpu/attention.py``).
The step's ``AttentionMetadata`` is built once by the model runner and read by all
layers through a forward context (``forward_context``), as vLLM does: attention is one
opaque custom op, ``llmserve::paged_attention``, whose only tensor arguments are the
layer's own. So a decoder layer compiles (``torch.compile``) into one graph that every
layer shares, with the token count dynamic and the per-step bookkeeping (block
tables, prefill chunks) outside the graph.

Each layer's cache is one tensor ``[2 (K, V), blocks, block_size, kv_heads, head_dim]``
(a view of the KV storage): a single mutated argument, which the compiler updates in
place (two views of one storage would make it copy the cache on every call).

Every entry point takes a layer's three attention variants alike: ``window`` (its
sliding window, None: the whole context), ``sinks`` (``[heads of this rank]`` float32
logits joining each head's softmax denominator, gpt-oss; None: none) and ``softcap``
(scores become ``softcap * tanh(scores / softcap)``, Gemma 2; None: as they are).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from llmserve.kernels.cpu.attention import CPUAttentionPlan, paged_attention_cpu, write_kv
from llmserve.kernels.cpu.native import rope_and_cache


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    use_triton: bool = False
    plan: CPUAttentionPlan | None = None  # torch path only
    # Triton decode: a fixed split-KV count (CUDA graphs: the captured launch must not
    # depend on the step's context lengths); None lets the kernel choose per step.
    num_splits: int | None = None


_current: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata):
    """Make ``meta`` the step's attention metadata for the duration of a forward."""
    global _current
    _current, previous = meta, _current
    try:
        yield
    finally:
        _current = previous


def step_metadata() -> AttentionMetadata | None:
    """The metadata of the forward in progress (None outside ``forward_context``)."""
    return _current


def c_rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     kv_cache: torch.Tensor, scale: float, num_heads: int,
                     window: int | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """A step whose CPU plan is the C kernel's (``plan.native``): rotary embedding and
    the K/V store in one call (``native.rope_and_cache``), then the attention of
    ``paged_attention_cpu`` (decodes and short prefill chunks in C, longer chunks in
    SDPA). Eager only: the layers bound to it are never compiled."""
    meta = _current
    q = rope_and_cache(qkv, cos, sin, kv_cache, meta.slot_mapping, num_heads)
    return paged_attention_cpu(q, kv_cache, meta.plan, scale, window, sinks, softcap)


def fused_rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         kv_cache: torch.Tensor, scale: float, num_heads: int,
                         window: int | None = None, sinks: torch.Tensor | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """``--fused-kernels``: one Triton kernel rotates q and k and stores k and v at the
    step's slots (``kernels/triton/fused.py``), then the attention reads the cache
    without writing it again. Eager only: the config refuses --fused-kernels with
    --compile, so this never meets the custom op."""
    from llmserve.kernels.triton.fused import rope_and_write_kv
    meta = _current
    assert meta is not None, "attention runs inside forward_context()"
    q = rope_and_write_kv(qkv, cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping,
                          num_heads)
    return paged_attention(q, None, None, kv_cache, scale, kv_written=True, window=window,
                           sinks=sinks, softcap=softcap)


def paged_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                    kv_cache: torch.Tensor, scale: float, kv_written: bool = False,
                    window: int | None = None, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Write this step's ``k``/``v`` into the layer's cache and attend ``q`` over it;
    ``kv_written``: a fused kernel has stored them already (``k``, ``v`` unused);
    ``window``, ``sinks``, ``softcap``: the layer's variants (module docstring).
    Under torch.compile this is the opaque op; eagerly its body is called directly (a
    custom op's dispatch costs more than many of the kernels it would wrap)."""
    if kv_written:
        meta = _current
        assert meta is not None, "paged_attention runs inside forward_context()"
        return _attend(q, kv_cache, scale, meta, window, sinks, softcap)
    if torch.compiler.is_compiling():
        return torch.ops.llmserve.paged_attention(q, k, v, kv_cache, scale, window or 0,
                                                  sinks, softcap or 0.0)
    return _paged_attention_kernel(q, k, v, kv_cache, scale, window or 0, sinks,
                                   softcap or 0.0)


def _paged_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            kv_cache: torch.Tensor, scale: float, window: int = 0,
                            sinks: torch.Tensor | None = None,
                            softcap: float = 0.0) -> torch.Tensor:
    meta = _current
    assert meta is not None, "paged_attention runs inside forward_context()"
    if not meta.use_triton:
        write_kv(k, v, kv_cache, meta.slot_mapping)
    else:
        from llmserve.kernels.triton.attention import write_kv_cache
        write_kv_cache(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
    return _attend(q, kv_cache, scale, meta, window or None, sinks, softcap or None)


def _attend(q: torch.Tensor, kv_cache: torch.Tensor, scale: float,
            meta: AttentionMetadata, window: int | None = None,
            sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of ``q`` over the layer's cache, which holds this step's K/V already."""
    if not meta.use_triton:
        return paged_attention_cpu(q, kv_cache, meta.plan, scale, window, sinks, softcap)
    from llmserve.kernels.triton.attention import unified_attention
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    out = torch.empty_like(q)
    unified_attention(q, k_cache, v_cache, out, query_start_loc=meta.query_start_loc,
                      seq_lens=meta.seq_lens, block_tables=meta.block_tables,
                      max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                      scale=scale, num_splits=meta.num_splits, window=window, sinks=sinks,
                      softcap=softcap)
    return out


# The op wraps the plain function, which eager calls keep calling directly (through
# the dispatcher they would also import TorchDynamo, and its memory: platforms/memory.py).
_paged_attention = torch.library.custom_op("llmserve::paged_attention", _paged_attention_kernel,
                                           mutates_args=("kv_cache",))


@_paged_attention.register_fake
def _(q, k, v, kv_cache, scale, window=0, sinks=None, softcap=0.0):
    return torch.empty_like(q)
