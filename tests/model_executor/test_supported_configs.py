"""Config fields and tensors the engine does not compute are refused at start-up, by
name; those it does compute still load and match transformers.

The bug this guarded first: a Mistral checkpoint with ``sliding_window: 48`` was served
with full attention, and its greedy tokens past 48 tokens differed from
transformers' with no warning. Sliding windows are computed now
(tests/model_executor/test_sliding_window.py); here, windowed configs serve transformers' tokens.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve import LLM, SamplingParams
from llmserve.errors import ModelLoadError
from llmserve.model_executor.model_loader.gguf import _gguf_config
from llmserve.model_executor.model_loader.sources import load_config
from llmserve.model_executor.models.supported import check_model_config, layer_sliding_window
from tests.conftest import write_tiny_checkpoint
from tests.oracle import compare_greedy, hf_greedy, load_hf

KV = 32 << 20


def tiny(tmp_path_factory, builtin_path, kind="llama", **overrides):
    return write_tiny_checkpoint(tmp_path_factory.mktemp(kind), builtin_path, kind,
                                 **overrides)


def refused(path, match: str, **engine_args) -> str:
    with pytest.raises(ModelLoadError, match=match) as e:
        LLM(str(path), kv_cache_memory=KV, **engine_args)
    return str(e.value)


# --- refused by name ---------------------------------------------------------------
REFUSED = {
    "mlp_bias": ("llama", dict(mlp_bias=True), r"mlp_bias=True: MLP biases"),
    "hidden_act": ("llama", dict(hidden_act="gelu"), r"hidden_act='gelu' is not implemented"),
    "rope_dynamic": ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                     r"rope type 'dynamic'"),
    # YaRN is served (test_gpt_oss.py), but a key transformers' YaRN does not read is not
    "rope_yarn": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 512,
                                              "rope.scaling.attn_factor": 0.5}),
                  r"rope type 'yarn' with rope.scaling.attn_factor"),
    "final_softcap": ("llama", dict(final_logit_softcapping=30.0),
                      r"final_logit_softcapping=30.0: final logit soft-capping"),
    "attn_softcap": ("llama", dict(attn_logit_softcapping=50.0),
                     r"attn_logit_softcapping=50.0"),
    "partial_rotary": ("llama", dict(partial_rotary_factor=0.5),
                       r"partial_rotary_factor=0.5: partial rotary"),
    "quantized": ("llama", dict(quantization_config={"quant_method": "gptq", "bits": 4}),
                  r"quantization_config=.*gptq.*pre-quantised checkpoints"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_unimplemented_config_field_is_refused_by_name(tmp_path_factory, builtin_path,
                                                          case):
    kind, overrides, match = REFUSED[case]
    path = tiny(tmp_path_factory, builtin_path, kind, **overrides)
    refused(path, match)


def test_the_cli_prints_the_refusal_and_exits_nonzero(tmp_path_factory, builtin_path):
    path = tiny(tmp_path_factory, builtin_path, "llama", partial_rotary_factor=0.5)
    run = subprocess.run([sys.executable, "-m", "llmserve", "generate", "--model",
                          str(path), "--prompt", "hi", "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "partial_rotary_factor=0.5" in run.stderr and "Traceback" not in run.stderr


def test_which_layers_are_windowed():
    """transformers' rules, over configs as it builds them: Mistral windows every layer;
    Qwen2 the layers from max_window_layers on, and none with its switch off; a
    window-less config none."""
    from transformers import MistralConfig, Qwen2Config
    mistral = MistralConfig(sliding_window=48, num_hidden_layers=2)
    assert [layer_sliding_window(mistral, i) for i in range(2)] == [48, 48]
    assert layer_sliding_window(MistralConfig(sliding_window=None), 0) is None
    off = Qwen2Config(use_sliding_window=False, sliding_window=48, num_hidden_layers=2)
    assert [layer_sliding_window(off, i) for i in range(2)] == [None, None]
    mixed = Qwen2Config(use_sliding_window=True, sliding_window=48, num_hidden_layers=2,
                        max_window_layers=1)
    assert [layer_sliding_window(mixed, i) for i in range(2)] == [None, 48]
    check_model_config(mixed, 32768)  # served, not refused


# --- tensors the model would not apply ----------------------------------------------
def rewrite_weights(path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def set_config(path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("extra", ["model.layers.0.mlp.down_proj.bias",
                                   "model.layers.1.self_attn.q_norm.weight"])
def test_a_tensor_the_model_does_not_load_is_refused(tmp_path_factory, builtin_path, extra):
    path = tiny(tmp_path_factory, builtin_path)
    rewrite_weights(path, lambda t: t.__setitem__(extra, torch.ones(64)))
    refused(path, f"unexpected tensor '{extra}' .* has no such parameter")


def test_a_tied_config_with_a_head_of_its_own_is_refused(tmp_path_factory, builtin_path):
    path = tiny(tmp_path_factory, builtin_path)  # untied: its lm_head differs
    set_config(path, tie_word_embeddings=True)
    refused(path, "tie_word_embeddings=True, but the checkpoint's lm_head.weight differs")


def test_a_tied_checkpoint_with_an_equal_head_loads(tmp_path_factory, builtin_path):
    """The common case of a tied model saved with a copy of its embedding."""
    path = tiny(tmp_path_factory, builtin_path, tie_word_embeddings=True)
    rewrite_weights(path, lambda t: t.__setitem__(
        "lm_head.weight", t["model.embed_tokens.weight"].clone()))
    LLM(str(path), kv_cache_memory=KV).generate("hi", SamplingParams(max_tokens=2))


def test_an_untied_config_without_a_head_is_refused(tmp_path_factory, builtin_path):
    path = tiny(tmp_path_factory, builtin_path, tie_word_embeddings=True)
    set_config(path, tie_word_embeddings=False)
    refused(path, "has no lm_head.weight, and its config says tie_word_embeddings=False")


# --- GGUF metadata ---------------------------------------------------------------------
GGUF_META = {"llama.embedding_length": 64, "llama.attention.head_count": 4,
             "llama.feed_forward_length": 128, "llama.block_count": 2,
             "llama.attention.layer_norm_rms_epsilon": 1e-5}


@pytest.mark.parametrize("meta, match", [
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.attn_factor": 0.5}, "rope type 'yarn' with rope.scaling.attn_factor"),
    ({"llama.rope.scaling.type": "dynamic", "llama.rope.scaling.factor": 4.0},
     "rope type 'dynamic'"),
    ({"llama.rope.dimension_count": 8}, "partial_rotary_factor=0.5"),
])
def test_gguf_attention_variants_reach_the_check(tmp_path, meta, match):
    """A GGUF's rope scaling, partial rotary or window is carried into the converted
    config.json, where the start-up check refuses it instead of its being dropped."""
    config = _gguf_config({**GGUF_META, **meta}, "llama", has_output=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=match):
        check_model_config(load_config(tmp_path), 2048)


def test_a_gguf_yarn_keeps_its_original_context(tmp_path):
    """llama.cpp's YaRN keys reach transformers' names (the pretraining context above
    all: without it transformers would take the extended one)."""
    config = _gguf_config({**GGUF_META, "llama.rope.scaling.type": "yarn",
                           "llama.rope.scaling.factor": 4.0,
                           "llama.rope.scaling.original_context_length": 512,
                           "llama.rope.scaling.yarn_beta_fast": 16.0}, "llama",
                          has_output=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_config(tmp_path)
    check_model_config(loaded, 2048)
    assert loaded.rope_parameters["original_max_position_embeddings"] == 512
    assert loaded.rope_parameters["beta_fast"] == 16.0


def test_a_gguf_window_reaches_the_model(tmp_path):
    config = _gguf_config({**GGUF_META, "llama.attention.sliding_window": 48}, "llama",
                          has_output=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert layer_sliding_window(load_config(tmp_path), 1) == 48


def test_the_builtin_gguf_passes_the_check(builtin_path):
    check_model_config(load_config(builtin_path), 8192)


# --- what the engine computes still loads, and matches transformers --------------------
def randomize_biases(path) -> None:
    """transformers initialises biases to zero: make them matter."""
    gen = torch.Generator().manual_seed(1)
    rewrite_weights(path, lambda t: t.update({
        n: torch.randn(v.shape, generator=gen) * 0.5 for n, v in t.items()
        if n.endswith(".bias")}))


SUPPORTED = {
    "head_dim": ("llama", dict(head_dim=32)),  # not hidden / heads (16)
    "attention_bias": ("llama", dict(attention_bias=True)),
    "rope_linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral_wide_window": ("mistral", dict(sliding_window=4096)),
    "mistral_window": ("mistral", dict(sliding_window=48)),  # prompts of 70, 130 tokens
    "qwen2_window": ("qwen2", dict(use_sliding_window=True, sliding_window=48,
                                   max_window_layers=1)),  # layer 0 full, layer 1 windowed
}


@pytest.mark.parametrize("case", list(SUPPORTED))
def test_supported_configs_match_transformers(tmp_path_factory, builtin_path, case):
    kind, overrides = SUPPORTED[case]
    path = tiny(tmp_path_factory, builtin_path, kind, **overrides)
    if overrides.get("attention_bias"):
        randomize_biases(path)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 70, 130)]
    greedy(path, prompts)


def test_a_window_served_within_max_model_len_matches_transformers(tmp_path_factory,
                                                                   builtin_path):
    """Asked for --max-model-len at most the window, the window never applies."""
    path = tiny(tmp_path_factory, builtin_path, "mistral", sliding_window=48)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 30, 40)]
    greedy(path, prompts, max_model_len=48)


def greedy(path, prompts, new_tokens=8, **engine_args) -> None:
    llm = LLM(str(path), kv_cache_memory=KV, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    hf = load_hf(path)
    verdicts = [compare_greedy(o.outputs[0].token_ids, hf_greedy(hf, p, new_tokens))
                for o, p in zip(outs, prompts)]
    assert verdicts.count("tie") <= 1, verdicts
