"""Model runner details that matter on a GPU but can be checked here."""

from __future__ import annotations

import torch

import llmserve.worker.model_builder as model_builder
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine


def test_weights_are_materialised_in_the_serving_dtype(tiny_llama, monkeypatch):
    """Never an fp32 copy first: on a GPU that doubles a bf16 model's peak memory."""
    seen = {}
    real_load = model_builder.load_weights

    def spy(model, *args, **kwargs):
        seen.update({n: p.dtype for n, p in model.named_parameters()})
        return real_load(model, *args, **kwargs)

    monkeypatch.setattr(model_builder, "load_weights", spy)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="bfloat16",
                                    kv_cache_memory=1 << 20))
    assert seen and set(seen.values()) == {torch.bfloat16}
    assert engine.runner.model.model.rotary.cos.dtype == torch.float32
