"""Gemma 2 and Gemma 3 (text) against transformers (issue 31).

Random tiny checkpoints written with transformers' own classes, whose arithmetic the
engine must reproduce: (1 + w) RMSNorms (random weights, so w alone would differ), the
embedding scaled by sqrt(hidden), GELU-tanh MLPs, the four norms a layer,
``query_pre_attn_scalar`` as the attention scale (not head_dim), a sliding layer and a
global one (``layer_types``), Gemma 2's attention and final logit soft-capping (caps
low enough to bite), Gemma 3's per-head q/k norms and its two ropes (a local base for
sliding layers, linear scaling on the global one only), tied embeddings.

Greedy tokens equal transformers' in float32 (tests/oracle.py's near-tie rule) for
prompts longer than the window: on the CPU path (the C decode kernel and the torch
path), under the Triton interpreter, with chunked prefill + prefix caching +
recompute preemption, and over two tensor-parallel ranks, where the heads split.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.errors import ModelLoadError
from llmserve.model_executor.models.native_decoder import unsupported
from tests.conftest import TOKENIZER_FILES
from tests.differential import reconfigure
from tests.oracle import assert_greedy_matches, load_hf, random_prompts

NEW_TOKENS = 8
WINDOW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
ATTN_CAP, FINAL_CAP = 1.0, 3.0


def write_gemma_checkpoint(out: Path, builtin: Path, family: str, seed: int = 0) -> Path:
    """A random 2-layer Gemma (one sliding layer, one global) saved with transformers'
    save_pretrained, with the built-in model's tokenizer. Every norm weight random
    around zero (Gemma scales by 1 + w), and q/k projections wide enough that the
    attention cap changes the scores."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, head_dim=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.08,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention"],
                  query_pre_attn_scalar=24, tie_word_embeddings=True)
    if family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**common, attn_logit_softcapping=ATTN_CAP,
                                               final_logit_softcapping=FINAL_CAP))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **common, rope_theta=10000.0, rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.25)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (builtin / name).exists():
            shutil.copy(builtin / name, out / name)
    return out


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory, builtin_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    return {family: write_gemma_checkpoint(root / family, builtin_path, family, seed=7)
            for family in ("gemma2", "gemma3")}


def prompts_of(seed: int, lengths=(3, 23, 25, 60, 130)) -> list[list[int]]:
    """Shorter than, at and far past the window."""
    return random_prompts(seed, lengths)


def assert_matches(llm: LLM, path: Path, prompts: list[list[int]]) -> None:
    assert_greedy_matches(llm, path, prompts)


FAMILIES = ["gemma2", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path, budget", [("native", 16), ("torch", 2048)])
def test_greedy_tokens_equal_transformers(gemma_models, family, path, budget):
    """The C decode kernel with chunked prefill (16-token chunks), and the torch path
    with whole prompts."""
    model = gemma_models[family]
    llm = LLM(str(model), kv_cache_memory=16 << 20, max_num_batched_tokens=budget,
              enable_chunked_prefill=budget < 2048)
    llm.engine.runner.c_attention = path == "native"
    attn = [layer.self_attn for layer in llm.engine.runner.model.model.layers]
    assert [a.sliding_window for a in attn] == [WINDOW, None]
    assert [a.softcap for a in attn] == [ATTN_CAP if family == "gemma2" else None] * 2
    assert unsupported(llm.engine.runner.model)  # the int4 C stack computes Llama's layer
    assert_matches(llm, model, prompts_of(1))
    llm.engine.block_manager.check_all_free()


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_attention_in_the_interpreter(gemma_models, family):
    model = gemma_models[family]
    llm = LLM(str(model), attention_backend="triton", kv_cache_memory=16 << 20,
              max_num_batched_tokens=32)
    assert_matches(llm, model, prompts_of(2, lengths=(10, 45)))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_and_recompute_preemption_keep_the_tokens(gemma_models, family):
    """Prompts sharing a prefix longer than the window, in 32-token chunks, on a cache
    too small for all at once: later prompts start from cached blocks, running ones
    are preempted and recomputed, without changing a token."""
    model = gemma_models[family]
    rng = random.Random(9)
    shared = [rng.randrange(3, 49152) for _ in range(48)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(n)] for n in (5, 30, 50, 70)]
    llm = LLM(str(model), kv_cache_memory=16 << 20, max_num_batched_tokens=32,
              enable_chunked_prefill=True)
    # 12 blocks of 16 tokens: the longest prompt and its output need 8 of them
    reconfigure(llm.engine, 12, 0, preemption_mode="recompute", watermark=0.0)
    assert_matches(llm, model, prompts)
    scheduler, blocks = llm.engine.scheduler, llm.engine.block_manager
    assert scheduler.num_preemptions > 0 and blocks.prefix_hits > 0
    blocks.check_all_free()


@pytest.mark.parametrize("family", FAMILIES)
def test_two_tensor_parallel_ranks(gemma_models, family):
    """Two query heads and one KV head a rank; the norms replicated, the tied
    embedding split by vocabulary rows."""
    model = gemma_models[family]
    llm = LLM(str(model), tensor_parallel_size=2, kv_cache_memory=16 << 20,
              max_num_batched_tokens=32)
    try:
        assert_matches(llm, model, prompts_of(4, lengths=(5, 45)))
    finally:
        llm.shutdown()


def test_final_logits_are_soft_capped(gemma_models):
    """Greedy tokens cannot see the final cap (tanh keeps the order); the
    log-probabilities can: each equals transformers' log-softmax of its capped logits."""
    model = gemma_models["gemma2"]
    prompt = prompts_of(5, lengths=(30,))[0]
    llm = LLM(str(model), kv_cache_memory=16 << 20)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=0))
    got = out[0].outputs[0].logprobs[0]
    with torch.inference_mode():
        logits = load_hf(model)(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    assert logits.abs().max() < FINAL_CAP  # capped: no logit reaches the cap
    want = torch.log_softmax(logits, -1)[got.token_id].item()
    assert got.logprob == pytest.approx(want, abs=1e-4)


def test_the_vision_language_checkpoint_is_refused_naming_the_text_class(gemma_models,
                                                                          tmp_path):
    from transformers import Gemma3Config, Gemma3TextConfig
    text = Gemma3TextConfig.from_pretrained(gemma_models["gemma3"])
    config = Gemma3Config(text_config=text.to_dict())
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    for name in (*TOKENIZER_FILES, "model.safetensors"):
        if (gemma_models["gemma3"] / name).exists():
            shutil.copy(gemma_models["gemma3"] / name, tmp_path / name)
    with pytest.raises(ModelLoadError, match="Gemma3ForConditionalGeneration .* served as "
                                             "Gemma3ForCausalLM"):
        LLM(str(tmp_path), kv_cache_memory=16 << 20)
