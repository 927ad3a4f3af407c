"""Dense bf16 linears on oneDNN-packed weights (``kernels/cpu_linear``): the same
product as ``F.linear``, and the engine packing exactly the dense projections."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve import LLM, SamplingParams
from llmserve.engine import model_runner
from llmserve.engine.quantization import QuantizedLinear
from llmserve.kernels.cpu_linear import PackedLinear, packing_available

pytestmark = pytest.mark.skipif(not packing_available(),
                                reason="oneDNN has no bf16 kernels on this CPU")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("rows", [1, 5, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 1536), (100, 24)])
def test_packed_linear_computes_the_dense_product(rows, bias, out_features, in_features):
    """As accurate as F.linear against a float32 reference, and equal to it up to
    bf16 rounding (a wrong layout or a dropped bias is off by ~100 %)."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    if bias:
        linear.bias.data.normal_()
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    reference = F.linear(x.float(), linear.weight.float(),
                         None if linear.bias is None else linear.bias.float())
    dense = F.linear(x, linear.weight, linear.bias)
    packed = PackedLinear(linear)(x)
    assert packed.shape == dense.shape and packed.dtype == torch.bfloat16
    assert relative_error(packed, reference) <= 2 * relative_error(dense, reference) + 1e-3
    assert relative_error(packed, dense) < 1e-2


def test_packed_linear_takes_any_leading_shape_and_no_rows():
    linear = torch.nn.Linear(24, 40).to(torch.bfloat16)
    packed = PackedLinear(linear)
    x = torch.randn(2, 3, 24).to(torch.bfloat16)
    assert relative_error(packed(x), linear(x)) < 1e-2
    assert packed(x[0, :0]).shape == (0, 40)


def first_token_logprobs(llm: LLM) -> list[tuple[int, float]]:
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=5, ignore_eos=True)
    out = llm.generate(["The quick brown fox"], params)[0].outputs[0]
    return out.logprobs[0].top


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_the_engine_packs_its_dense_projections_and_computes_the_same(tiny_models, kind,
                                                                      monkeypatch):
    """A bf16 CPU engine packs every dense projection and the LM head (tied to the
    embedding in llama3, whose lookups keep the plain rows). Its first token's
    distribution is the unpacked engine's (biases, qwen2, included), up to bf16
    rounding: a near-tie may pick the other token, never one far behind."""
    llm = LLM(str(tiny_models[kind]), dtype="bfloat16", quantization="none",
              kv_cache_memory=16 << 20)
    try:
        model = llm.engine.runner.model
        layer = model.model.layers[0]
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj, model.lm_head):
            assert isinstance(module, PackedLinear)
        packed = first_token_logprobs(llm)
    finally:
        llm.shutdown()
    monkeypatch.setattr(model_runner, "packing_applies", lambda device, dtype: False)
    llm = LLM(str(tiny_models[kind]), dtype="bfloat16", quantization="none",
              kv_cache_memory=16 << 20)
    try:
        assert type(llm.engine.runner.model.lm_head) is torch.nn.Linear
        dense = first_token_logprobs(llm)
    finally:
        llm.shutdown()
    dense_logprob = dict(dense)
    assert packed[0][0] in dense_logprob
    assert dense_logprob[packed[0][0]] >= dense[0][1] - 0.05
    torch.testing.assert_close([p for _, p in packed], [p for _, p in dense],
                               rtol=0.02, atol=0.05)


def test_quantised_projections_are_left_alone(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="bfloat16", quantization="int8",
              kv_cache_memory=16 << 20)
    try:
        model = llm.engine.runner.model
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
        assert isinstance(model.lm_head, QuantizedLinear)
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
    finally:
        llm.shutdown()
