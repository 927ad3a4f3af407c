"""The token embedding kept as Q8_0 blocks where that is exact (issue 30, idle memory).

The promise is that the compact table never changes an output: every lookup returns
the very values the dense table in the serving dtype would, and a table that is not
exactly Q8_0 stays dense.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.model_executor.layers.q8_embedding import (
    Q8_BLOCK,
    Q8Embedding,
    compact_embedding,
    exact_q8_blocks,
)
from llmserve.model_executor.model_loader.weights import checkpoint_slice
from tests.conftest import BUILTIN


def q8_0_table(rows: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A table as a Q8_0 GGUF dequantises it: fp16 scales d times int8 codes, each
    block reaching +-127 (as Q8_0's quantiser makes it), one block all zeros."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, hidden // Q8_BLOCK, Q8_BLOCK), generator=g)
    q[..., 0] = torch.where(torch.rand(rows, hidden // Q8_BLOCK, generator=g) < 0.5, 127, -127)
    d = (torch.rand(rows, hidden // Q8_BLOCK, 1, generator=g) * 0.01).half().float()
    q[1, -1] = 0  # a block of zeros: scale 0
    d[1, -1] = 0
    return (q * d).flatten(-2), q.flatten(-2).to(torch.int8), d.squeeze(-1)


def test_q8_0_blocks_are_recovered_exactly_from_their_float32_values():
    table, codes, scales = q8_0_table(100, 4 * Q8_BLOCK)
    found = exact_q8_blocks(table)
    assert found is not None
    assert torch.equal(found[0], codes)
    assert torch.equal(found[1], scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lookups_equal_the_dense_table_in_the_serving_dtype(dtype):
    table, _, _ = q8_0_table(300, 6 * Q8_BLOCK, seed=1)
    dense = nn.Embedding.from_pretrained(table.to(dtype))
    compact = Q8Embedding(*exact_q8_blocks(table), dtype)
    ids = torch.tensor([[0, 1, 299, 7], [5, 5, 1, 2]])
    out = compact(ids)
    assert out.dtype == dtype and out.shape == (2, 4, 6 * Q8_BLOCK)
    assert torch.equal(out, dense(ids))
    assert torch.equal(compact(torch.arange(300)), table.to(dtype))


def test_a_table_that_is_not_q8_0_stays_dense():
    table, _, _ = q8_0_table(64, 2 * Q8_BLOCK)
    assert exact_q8_blocks(table.to(torch.bfloat16)) is None  # rounded: no longer d * q
    nudged = table.clone()
    nudged[63, 5] = torch.nextafter(nudged[63, 5], torch.tensor(1.0))  # one value off
    assert exact_q8_blocks(nudged) is None
    assert exact_q8_blocks(torch.randn(8, 48)) is None  # rows not in blocks of 32
    signed_zero = table.clone()
    signed_zero[1, -Q8_BLOCK:] = -0.0  # the zero block, negative: lookups would give +0.0
    assert exact_q8_blocks(signed_zero) is None
    tiny = table.clone()  # subnormal values whose code rounds to 128, past int8
    tiny[2, :Q8_BLOCK] = torch.tensor(2.0 ** -149) * torch.arange(Q8_BLOCK)
    assert exact_q8_blocks(tiny) is None


class _Model(nn.Module):
    def __init__(self, table: torch.Tensor, tied: bool = False):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding.from_pretrained(table.to(torch.bfloat16))
        self.lm_head = nn.Linear(table.shape[1], table.shape[0], bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


def test_compaction_reads_the_checkpoint_lazily_and_only_takes_exact_tables(tmp_path):
    table, _, _ = q8_0_table(5000, 2 * Q8_BLOCK, seed=2)  # more than one chunk of rows
    save_file({"exact": table, "noisy": torch.randn(5000, 2 * Q8_BLOCK),
               "short": table[:10].clone()}, tmp_path / "w.safetensors")
    handle = safe_open(tmp_path / "w.safetensors", framework="pt")

    model = _Model(table)
    assert compact_embedding(model, handle.get_slice("exact"))
    assert isinstance(model.model.embed_tokens, Q8Embedding)
    assert torch.equal(model.model.embed_tokens(torch.arange(5000)), table.to(torch.bfloat16))

    for name in ("noisy", "short"):  # not Q8_0; a table of another shape
        model = _Model(table)
        assert not compact_embedding(model, handle.get_slice(name))
        assert type(model.model.embed_tokens) is nn.Embedding
    assert not compact_embedding(_Model(table), None)
    changed = _Model(table)  # a loader that changed a row: what was loaded is served
    changed.model.embed_tokens.weight.data[7] *= 2
    assert not compact_embedding(changed, handle.get_slice("exact"))
    bf16 = _Model(table)  # a checkpoint not in float32: not read at all
    assert not compact_embedding(bf16, table.to(torch.bfloat16))
    tied = _Model(table, tied=True)  # its head computes with the dense table
    assert not compact_embedding(tied, handle.get_slice("exact"))
    assert type(tied.model.embed_tokens) is nn.Embedding


def built_in_engine(quantization: str) -> LLMEngine:
    # float32 on every CPU: bf16 would pack the unquantised head (no tie left to test)
    return LLMEngine(EngineConfig(model=BUILTIN, device="cpu", dtype="float32",
                                  kv_cache_memory=1 << 24, quantization=quantization))


def test_the_built_in_gguf_model_serves_its_embedding_from_q8_0_blocks():
    """The built-in model's GGUF keeps its embedding in Q8_0: with its tied LM head
    quantised, the engine holds the blocks, not a dense copy, and every row equals the
    checkpoint's in the serving dtype."""
    engine = built_in_engine("int8")
    try:
        runner = engine.runner
        embedding = runner.model.model.embed_tokens
        assert isinstance(embedding, Q8Embedding)
        checkpoint = checkpoint_slice(runner.model, engine.model_path,
                                      "model.embed_tokens.weight")[:]
        assert torch.equal(embedding(torch.arange(embedding.num_embeddings)),
                           checkpoint.to(runner.dtype))
        names = {n for n, _ in runner.model.named_parameters()}
        assert "model.embed_tokens.weight" not in names  # the dense table is gone
    finally:
        engine.shutdown()


def test_a_tied_head_computing_with_the_dense_table_keeps_it_the_only_copy():
    """Unquantised (float32 here, unpacked), the tied head multiplies by the dense
    table itself: blocks beside it would be a second copy, so the table stays."""
    engine = built_in_engine("none")
    try:
        model = engine.runner.model
        assert type(model.model.embed_tokens) is nn.Embedding
        assert model.lm_head.weight is model.model.embed_tokens.weight
    finally:
        engine.shutdown()
