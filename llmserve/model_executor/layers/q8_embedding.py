"""The token embedding kept as int8 codes with one float32 scale per 32 values, the
layout of GGUF's Q8_0, where that holds the checkpoint's values exactly.

A Q8_0 GGUF (the built-in model's embedding is one) is converted into float32 values
d * q; stored densely in the serving dtype they take twice the bytes of the codes (bf16:
57 MB for the built-in model's 49,152 x 576 table, beside its 28 MB int8 LM head). The
block layout is recovered from those float32 values by quantising again with
d = max|x| / 127, which returns the same d and q when x came from Q8_0, and is kept only
if dequantising gives back every value bit for bit, and every lookup then equals the
row that was loaded (d * q in float32, then the serving dtype): the memory saving never
changes an output. Any other checkpoint (a bf16 one) keeps its dense table.
"""

from __future__ import annotations

import torch
from torch import nn

Q8_BLOCK = 32  # values per scale, as GGUF's Q8_0
_CHECK_VALUES = 1 << 22  # values re-quantised at a time: bounds the float32 temporaries


def exact_q8_blocks(table) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 codes [V, H], float32 scales [V, H / 32]) that dequantise to ``table``
    exactly in float32, or None where no such blocks exist (or H is not a multiple of
    32). ``table`` is a tensor, or a safetensors slice (read a chunk of rows at a time,
    so a checkpoint that is not Q8_0 is turned down after reading its first chunk)."""
    rows, hidden = _shape(table)
    if hidden % Q8_BLOCK:
        return None
    codes = torch.empty(rows, hidden, dtype=torch.int8)
    scales = torch.empty(rows, hidden // Q8_BLOCK, dtype=torch.float32)
    step = max(1, _CHECK_VALUES // hidden)
    for start in range(0, rows, step):
        chunk = table[start:start + step]
        if not chunk.dtype.is_floating_point:
            return None
        x = chunk.float().unflatten(-1, (-1, Q8_BLOCK))
        d = x.abs().amax(dim=-1, keepdim=True) / 127
        q = (x / torch.where(d == 0, 1.0, d)).round().clamp(-127, 127).to(torch.int8)
        # Compared as bits, from the int8 codes lookups will read: -0.0 is not 0.0, and
        # a code that only fits before the cast (subnormal blocks) fails here.
        if not torch.equal(_bits(dequantize(q, d)), _bits(x)):
            return None
        codes[start:start + len(x)] = q.flatten(-2)
        scales[start:start + len(x)] = d.squeeze(-1)
    return codes, scales


def _shape(table) -> tuple[int, ...]:
    return tuple(table.shape if isinstance(table, torch.Tensor) else table.get_shape())


def dequantize(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Codes [..., blocks, 32] (any dtype holding the integers) times their scales
    [..., blocks, 1], in float32: the one product both the check and lookups compute,
    so a lookup gives exactly the values the check compared."""
    return q.float() * d


class Q8Embedding(nn.Module):
    """``nn.Embedding``'s lookups, from the blocks ``exact_q8_blocks`` found."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.dtype = dtype
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        q = self.codes[input_ids].unflatten(-1, (-1, Q8_BLOCK))
        return dequantize(q, self.scales[input_ids].unsqueeze(-1)).flatten(-2).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q8 blocks of {Q8_BLOCK}"


def compact_embedding(model: nn.Module, checkpoint_table) -> bool:
    """Replace ``model.model.embed_tokens`` (one rank's plain ``nn.Embedding``) by a
    ``Q8Embedding`` when the checkpoint's table (a tensor or a safetensors slice) is
    exactly Q8_0 blocks; True if it did, freeing the dense table. Not while a tied LM
    head still computes with that table (unquantised and unpacked): the blocks would
    be a second copy."""
    embedding = model.model.embed_tokens
    if type(embedding) is not nn.Embedding or checkpoint_table is None:
        return False
    if getattr(getattr(model, "lm_head", None), "weight", None) is embedding.weight:
        return False
    if _shape(checkpoint_table) != tuple(embedding.weight.shape):
        return False
    if _dtype_name(checkpoint_table) != "F32":  # Q8_0 converts to float32 values
        return False
    blocks = exact_q8_blocks(checkpoint_table)
    if blocks is None:
        return False
    compact = Q8Embedding(*blocks, embedding.weight.dtype).to(embedding.weight.device)
    if not _same_rows(compact, embedding.weight):  # what was loaded, not just the file
        return False
    model.model.embed_tokens = compact
    return True


def _dtype_name(table) -> str:
    if isinstance(table, torch.Tensor):
        return "F32" if table.dtype == torch.float32 else str(table.dtype)
    return table.get_dtype()


def _same_rows(compact: Q8Embedding, dense: torch.Tensor) -> bool:
    """Every lookup equals the loaded table's row, bit for bit (a loader that changed
    the rows, or a rounding path of its own, keeps the dense table)."""
    step = max(1, _CHECK_VALUES // compact.embedding_dim)
    for start in range(0, compact.num_embeddings, step):
        ids = torch.arange(start, min(start + step, compact.num_embeddings))
        if not torch.equal(_bits(compact(ids)), _bits(dense[ids])):
            return False
    return True


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns: unlike float comparison, -0.0 differs from 0.0."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize])
