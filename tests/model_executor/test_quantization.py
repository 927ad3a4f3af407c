"""Faster CPU modes (bf16, weight-only int8 / int4) keep the built-in model's quality:
greedy agreement with fp32 and perplexity on a fixed text the repo ships. Bounds are
loose enough to be stable across CPUs, tight enough to catch a broken dequantisation
(which sends perplexity into the hundreds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.scoring import perplexity
from llmserve.model_executor.layers.quantization import (
    QuantizedLinear,
    quantize_model,
    resolve_quantization,
)
from llmserve.model_executor.model_loader.gguf import gguf_layer_weight_types

TEXT = (Path(__file__).parents[2] / "benchmarks" / "data" / "declaration.txt").read_text()
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a",
           "The three laws of thermodynamics are"]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_linear_matches_its_dequantized_weights(bits):
    torch.manual_seed(bits)
    linear = torch.nn.Linear(128, 96, bias=True)
    q = QuantizedLinear(linear, bits)
    x = torch.randn(5, 128)
    got = q(x)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    # Quantisation error only: close to the dense layer, far from noise.
    dense = linear(x)
    rel = (got - dense).norm() / dense.norm()
    assert rel < (0.02 if bits == 8 else 0.15), rel


@pytest.fixture(scope="module")
def fp32():
    llm = LLM("smollm2-135m-instruct", dtype="float32")
    greedy = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    return perplexity(llm.engine, TEXT), greedy


@pytest.mark.slow
@pytest.mark.parametrize("dtype, quantization, max_ppl_ratio, min_agreement", [
    ("bfloat16", "none", 1.02, 0.5),
    ("bfloat16", "int8", 1.06, 0.4),
    ("bfloat16", "int4", 1.06, 0.4),
    ("float32", "int4", 1.06, 0.4),
])
def test_fast_modes_keep_quality(fp32, dtype, quantization, max_ppl_ratio, min_agreement):
    ref_ppl, ref_tokens = fp32
    llm = LLM("smollm2-135m-instruct", dtype=dtype, quantization=quantization)
    ppl = perplexity(llm.engine, TEXT)
    assert ref_ppl * 0.98 < ppl < ref_ppl * max_ppl_ratio, (ppl, ref_ppl)
    outs = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    # Share of greedy tokens equal to fp32's before the first divergence, averaged.
    agree = sum(next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) / len(r)
                for o, r in zip(outs, ref_tokens)) / len(PROMPTS)
    assert agree >= min_agreement, agree


Q41, Q4KM = {"Q4_1": 1000}, {"Q4_K": 800, "Q6_K": 200}


@pytest.mark.parametrize("requested, gguf_types, device, dtype, tp, want", [
    ("auto", Q41, "cpu", torch.bfloat16, 1, "int4"),  # the built-in model on a bf16 CPU
    ("auto", {"Q4_K": 10, "Q4_0": 5}, "cpu", torch.bfloat16, 1, "int4"),
    ("auto", Q41, "cpu", torch.float32, 1, "none"),  # AVX2 CPUs: the fp32 path
    ("auto", {"Q8_0": 1000}, "cpu", torch.bfloat16, 1, "none"),  # int4 would lose precision
    ("auto", Q4KM, "cpu", torch.bfloat16, 1, "none"),  # its Q6_K layers too
    ("auto", None, "cpu", torch.bfloat16, 1, "none"),  # safetensors checkpoints
    ("auto", Q41, "cuda", torch.bfloat16, 1, "none"),
    ("auto", Q41, "cpu", torch.bfloat16, 2, "none"),  # int4 + tensor parallel: untested
    ("int8", None, "cpu", torch.float32, 1, "int8"),  # explicit modes stay
    ("none", Q41, "cpu", torch.bfloat16, 1, "none"),
])
def test_auto_quantization_serves_a_4bit_gguf_at_its_precision(requested, gguf_types, device,
                                                               dtype, tp, want):
    assert resolve_quantization(requested, gguf_types, device, dtype, tp) == want


def test_quantize_model_refuses_an_unresolved_mode():
    with pytest.raises(ValueError, match="unresolved"):
        quantize_model(torch.nn.Module(), "auto")


def test_the_engine_resolves_auto_from_the_checkpoint(builtin_path, tiny_llama):
    assert set(gguf_layer_weight_types(builtin_path)) == {"Q4_1"}
    assert gguf_layer_weight_types(tiny_llama) is None
    llm = LLM("smollm2-135m-instruct", dtype="bf16")  # quantization left to auto; an alias
    assert llm.engine.config.quantization == "int4"
    layers = llm.engine.runner.model.model.layers
    assert isinstance(layers[0].mlp.down_proj, QuantizedLinear)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert out[0].outputs[0].text.strip()
    llm.shutdown()
    llm = LLM("smollm2-135m-instruct", dtype="float32")
    assert llm.engine.config.quantization == "none"
    llm.shutdown()
