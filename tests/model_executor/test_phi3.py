"""Phi-3 (issue 31): a checkpoint whose q/k/v and gate/up projections are stacked in
one tensor each (``qkv_proj``, ``gate_up_proj``), split at load; LongRoPE served up to
the pretraining context; Phi-4-mini's partial rotary. Each random tiny checkpoint's
greedy tokens equal transformers' in float32 (a divergence only at a near-tie,
``tests/oracle.py``): chunked and unchunked, with the Triton attention in the
interpreter, and on two tensor-parallel ranks (each splitting its own heads' and MLP
rows out of the stacked tensors).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.errors import ModelLoadError
from llmserve.model_executor.layers.quantization import QuantizedLinear
from llmserve.model_executor.models.llama import RotaryEmbedding
from llmserve.model_executor.models.supported import check_model_config
from tests.conftest import write_tiny_checkpoint
from tests.oracle import assert_greedy_matches, random_prompts

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
HEAD_DIM = 16  # hidden 64 over 4 heads
ORIGINAL_LEN = 64  # the longrope checkpoint's original_max_position_embeddings


def longrope_scaling(seed: int, rotated: int = HEAD_DIM) -> dict:
    """Random LongRoPE factors, one per rotary frequency; the long ones larger, as in
    Phi-3.5 (they must never be used below the original context)."""
    rng = random.Random(seed)
    return {"rope_type": "longrope",
            "short_factor": [rng.uniform(1.0, 3.0) for _ in range(rotated // 2)],
            "long_factor": [rng.uniform(4.0, 40.0) for _ in range(rotated // 2)]}


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, builtin_path) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("phi3"), builtin_path, "phi3", seed=7)


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory, builtin_path) -> Path:
    # Extended 64x past its pretraining context: attention factor sqrt(2).
    return write_tiny_checkpoint(tmp_path_factory.mktemp("phi3_longrope"), builtin_path,
                                 "phi3", seed=8, rope_scaling=longrope_scaling(8),
                                 original_max_position_embeddings=ORIGINAL_LEN,
                                 max_position_embeddings=4096)


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory, builtin_path) -> Path:
    """Phi-4-mini's shape: half of each head turned (it turns 3/4), LongRoPE, a tied
    head."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("phi4_mini"), builtin_path, "phi3",
                                 seed=9, partial_rotary_factor=0.5, tie_word_embeddings=True,
                                 rope_scaling=longrope_scaling(9, rotated=HEAD_DIM // 2),
                                 original_max_position_embeddings=ORIGINAL_LEN,
                                 max_position_embeddings=4096)


def prompts_of(seed: int, lengths=(1, 7, 17, 40, 129, 300)) -> list[list[int]]:
    return random_prompts(seed, lengths)


def assert_matches(llm: LLM, path: Path, prompts: list[list[int]]) -> None:
    assert_greedy_matches(llm, path, prompts)


@pytest.mark.parametrize("budget, chunked", [(16, True), (2048, False)])
def test_greedy_tokens_equal_transformers(phi3, budget, chunked):
    llm = LLM(str(phi3), max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
              kv_cache_memory=32 << 20)
    assert_matches(llm, phi3, prompts_of(1))
    llm.engine.block_manager.check_all_free()


def test_triton_attention_in_the_interpreter(phi3):
    llm = LLM(str(phi3), attention_backend="triton", kv_cache_memory=16 << 20,
              max_num_batched_tokens=32)
    assert_matches(llm, phi3, prompts_of(2, lengths=(5, 21, 40)))


def test_two_tensor_parallel_ranks(phi3):
    """Each rank splits its two query heads, its KV head and its 64 MLP rows out of
    the stacked tensors."""
    llm = LLM(str(phi3), tensor_parallel_size=2, kv_cache_memory=16 << 20,
              max_num_batched_tokens=32)
    try:
        assert_matches(llm, phi3, prompts_of(3, lengths=(3, 30, 70)))
    finally:
        llm.shutdown()


def test_fused_projections_are_quantised(phi3):
    """The q/k/v and gate/up split at load are fused again and quantised like any
    Llama's, and the prompt log-probabilities stay close to float32's."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = prompts_of(4, lengths=(60,))

    def prompt_logprobs(llm):
        out = llm.generate(prompt, params)[0].prompt_logprobs[1:]
        return torch.tensor([p.logprob for p in out])

    ref = prompt_logprobs(LLM(str(phi3), kv_cache_memory=16 << 20))
    llm = LLM(str(phi3), kv_cache_memory=16 << 20, quantization="int8")
    for layer in llm.engine.runner.model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
            assert isinstance(linear, QuantizedLinear) and linear.bits == 8
    err = (prompt_logprobs(llm) - ref).abs().mean().item()
    assert err < 0.05, err


def test_a_stacked_tensor_that_contradicts_the_config_is_refused(phi3, tmp_path):
    """4 KV heads in the config, 2 in the weights: the split would misplace v's rows."""
    wrong = tmp_path / "wrong"
    shutil.copytree(phi3, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps(dict(config, num_key_value_heads=4)))
    with pytest.raises(ModelLoadError, match=r"fused tensor 'model\.layers\.0\.self_attn\."
                                             r"qkv_proj\.weight' has shape \(128, 64\).*"
                                             r"192 rows = 64 \(q_proj\) \+ 64 \(k_proj\)"):
        LLM(str(wrong), kv_cache_memory=16 << 20)


# --- LongRoPE ---------------------------------------------------------------------------

def test_longrope_tables_equal_transformers(phi3_longrope):
    """cos/sin of every position below the original context: the short factors, scaled
    by the attention factor sqrt(1 + ln 64 / ln 64), as transformers computes them."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    config = AutoConfig.from_pretrained(phi3_longrope)
    config.head_dim = HEAD_DIM
    ours = RotaryEmbedding(config, ORIGINAL_LEN)
    positions = torch.arange(ORIGINAL_LEN)[None]
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    half = HEAD_DIM // 2
    assert torch.equal(ours.cos, cos[0, :, :half])  # bit for bit
    assert torch.equal(ours.sin, sin[0, :, :half])
    assert ours.cos[0, 0].item() == pytest.approx(2 ** 0.5)  # the attention factor


@pytest.mark.parametrize("budget, chunked", [(16, True), (2048, False)])
def test_longrope_greedy_tokens_equal_transformers(phi3_longrope, budget, chunked):
    llm = LLM(str(phi3_longrope), max_model_len=ORIGINAL_LEN, max_num_batched_tokens=budget,
              enable_chunked_prefill=chunked, kv_cache_memory=16 << 20)
    # Prompt and output within the original context, as max_model_len allows.
    assert_matches(llm, phi3_longrope, prompts_of(5, lengths=(1, 9, 30, 56)))


@pytest.mark.parametrize("max_model_len", [None, ORIGINAL_LEN + 1])
def test_longrope_past_the_original_context_is_refused(phi3_longrope, max_model_len):
    """transformers would switch to the long factors there (4096 is the default
    max_model_len: the config's max_position_embeddings)."""
    with pytest.raises(ModelLoadError, match=r"original_max_position_embeddings=64.*"
                                             r"serve it with --max-model-len 64"):
        LLM(str(phi3_longrope), max_model_len=max_model_len, kv_cache_memory=16 << 20)


# --- Partial rotary (Phi-4-mini) --------------------------------------------------------

@pytest.mark.parametrize("budget, chunked", [(16, True), (2048, False)])
def test_partial_rotary_greedy_tokens_equal_transformers(phi4_mini, budget, chunked):
    llm = LLM(str(phi4_mini), max_model_len=ORIGINAL_LEN, max_num_batched_tokens=budget,
              enable_chunked_prefill=chunked, kv_cache_memory=16 << 20)
    assert_matches(llm, phi4_mini, prompts_of(6, lengths=(1, 9, 30, 56)))


def test_partial_rotary_with_triton_and_two_ranks(phi4_mini):
    """Each rank reorders the dims of its own q/k heads; the Triton kernels take the
    same tables."""
    prompts = prompts_of(7, lengths=(5, 21, 50))
    llm = LLM(str(phi4_mini), max_model_len=ORIGINAL_LEN, attention_backend="triton",
              kv_cache_memory=16 << 20, max_num_batched_tokens=32)
    assert_matches(llm, phi4_mini, prompts)
    llm = LLM(str(phi4_mini), max_model_len=ORIGINAL_LEN, tensor_parallel_size=2,
              kv_cache_memory=16 << 20, max_num_batched_tokens=32)
    try:
        assert_matches(llm, phi4_mini, prompts)
    finally:
        llm.shutdown()


def test_partial_rotary_stays_refused_where_the_model_does_not_reorder_heads():
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                         partial_rotary_factor=0.75, architectures=["LlamaForCausalLM"])
    with pytest.raises(ModelLoadError, match="partial_rotary_factor=0.75"):
        check_model_config(config, 2048)
