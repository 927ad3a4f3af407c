"""Model runner details that matter on a GPU but can be checked here."""

from __future__ import annotations

import torch

import llmserve.worker.model_builder as model_builder
from llmserve.config import EngineConfig
from llmserve.core.sampling_params import SamplingParams
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


def test_each_layer_binds_its_implementation_at_load(tiny_llama, monkeypatch):
    """Norms, attention and MLPs pick torch's or the C kernels' implementation once, by
    the model's dtype and device: a bf16 CPU engine's take C throughout, a float32 one's
    norms and MLPs torch's (the C ones take bf16) and its attention C; a step asks for
    nothing again."""
    from llmserve.kernels.cpu.native import cpu_library
    from llmserve.model_executor.layers import backends
    from llmserve.model_executor.layers.backends import Backend
    from llmserve.model_executor.models.llama import MLP, Attention, RMSNorm
    if cpu_library() is None:
        return  # no C kernels here: everything is torch's, as the default binding
    for dtype, norm, mlp in (("bfloat16", Backend.C, Backend.C),
                             ("float32", Backend.TORCH, Backend.TORCH)):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype=dtype,
                                        kv_cache_memory=1 << 22))
        modules = list(engine.runner.model.modules())
        assert {m.backend for m in modules if isinstance(m, RMSNorm)} == {norm}
        assert {m.backend for m in modules if isinstance(m, MLP)} == {mlp}
        assert {m.backend for m in modules if isinstance(m, Attention)} == {Backend.C}

        def asked():
            raise AssertionError("a step asked which backend to take")
        monkeypatch.setattr(backends, "cpu_library", asked)
        req = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True))
        while not req.finished:
            engine.step()
        monkeypatch.undo()
        engine.shutdown()
