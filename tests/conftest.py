"""Shared fixtures: the built-in model and tiny random checkpoints written on the fly."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _pin_this_xdist_worker() -> None:
    """Under ``pytest -n N`` each worker gets its own share of the cores, set before
    torch starts its thread pool: N workers each spinning one OpenMP thread per core
    would oversubscribe the machine. Engines and servers the tests start inherit the
    mask (their thread count defaults to it)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or count < 2 or len(cores) < 2:
        return
    index = int(worker[2:])
    share = cores[index::count] or [cores[index % len(cores)]]
    os.sched_setaffinity(0, share)


_pin_this_xdist_worker()

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's interpreter (fp32/fp16 only).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines run in float32 unless a test asks for another dtype, whatever this CPU's
# automatic choice (bf16 where it has native bf16): outputs then compare exactly with
# transformers and across batch shapes. Inherited by the servers the tests start.
os.environ.setdefault("LLMSERVE_CPU_DTYPE", "float32")

import pytest  # noqa: E402

from llmserve.model_executor.model_loader.sources import resolve_model  # noqa: E402

BUILTIN = "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def builtin_path() -> Path:
    return resolve_model(BUILTIN)


def write_tiny_checkpoint(out: Path, builtin: Path, kind: str = "llama", seed: int = 0,
                          **overrides) -> Path:
    """A random 2-layer model saved with save_pretrained, sharing the built-in
    model's tokenizer so text prompts and chat templates work. ``overrides`` change
    the config (e.g. ``tie_word_embeddings=True``)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.08,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    elif kind == "llama3":  # Llama 3 RoPE scaling, GQA 3:1, tied embeddings
        cfg = dict(common, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                   tie_word_embeddings=True)
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 256}
        model = LlamaForCausalLM(LlamaConfig(**cfg, rope_theta=500000.0))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0))
        with torch.no_grad():  # make the QKV biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "qwen3":  # per-head q/k norms; head_dim 32, so q_proj is wider than hidden
        from transformers import Qwen3Config, Qwen3ForCausalLM
        model = Qwen3ForCausalLM(Qwen3Config(**dict(common, head_dim=32), rope_theta=1000000.0))
        _randomise_norms(model)
    elif kind == "qwen3_moe":  # 8 experts of 32 rows, top-2 (overrides: norm_topk_prob, ...)
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        cfg = dict(dict(common, head_dim=32), num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, norm_topk_prob=True)
        cfg.update(overrides)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg, rope_theta=1000000.0))
        _randomise_norms(model)
    elif kind == "mixtral":  # 4 experts of 64 rows, top-2
        from transformers import MixtralConfig, MixtralForCausalLM
        model = MixtralForCausalLM(MixtralConfig(**dict(common, intermediate_size=64),
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 rope_theta=1000000.0))
    elif kind == "phi3":  # fused qkv_proj / gate_up_proj; overrides may set longrope
        from transformers import Phi3Config, Phi3ForCausalLM
        model = Phi3ForCausalLM(Phi3Config(**dict({"sliding_window": None}, **common),
                                           rope_theta=10000.0))
    elif kind == "mistral":  # overrides usually set sliding_window
        from transformers import MistralConfig, MistralForCausalLM
        model = MistralForCausalLM(MistralConfig(**common, rope_theta=10000.0))
    else:
        raise ValueError(kind)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (builtin / name).exists():
            shutil.copy(builtin / name, out / name)
    return out


def _randomise_norms(model) -> None:
    """Norm weights are ones at initialisation: random ones make a q/k norm matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, builtin_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: write_tiny_checkpoint(root / kind, builtin_path, kind)
            for kind in ("llama", "llama3", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


# The files that take longest (`make test`'s --durations), collected first. `make test`
# runs xdist with --dist loadfile --no-loadscope-reorder, which hands files to the
# workers one at a time in collection order, so the last ones handed out are short and
# the two workers finish together. (xdist's default reorder, by test count, put the
# GPU check's 4-test file, with its 100-second dry run, last.)
LONGEST_FIRST = ("test_gpu_check.py", "test_kernels.py", "test_gpu_fast_path.py",
                 "test_async_scheduling.py", "test_differential_fuzz.py",
                 "test_beam_search.py", "test_structured_outputs.py",
                 "test_tensor_parallel.py", "test_lora.py", "test_model_families.py",
                 "test_spec_decode.py", "test_disaggregation.py", "test_kv_transport.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable
