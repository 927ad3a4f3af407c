"""GGUF files converted once into a Hugging Face directory under the user's cache folder
(dequantized weights as safetensors, config.json, tokenizer.json), so later loads read
safetensors and a saved tokenizer and take seconds."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from llmserve.envs import cache_root
from llmserve.errors import ModelLoadError

# GGUF tensor names -> Hugging Face names ("{i}" is the layer index).
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


_GGUF_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}


def convert_gguf(gguf_path: Path) -> Path:
    """Convert once; return the cached Hugging Face-format directory."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v3"
                         .encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        _convert_gguf_into(gguf_path, tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except ModelLoadError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"cannot convert {gguf_path}: {e}") from e
    return target



def _convert_gguf_into(gguf_path: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import save_file
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file: {e}") from e
    meta = {k: _field_value(f) for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_id")}
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(_GGUF_ARCHS)})")
    config = _gguf_config(meta, arch, has_output=any(t.name == "output.weight"
                                                      for t in reader.tensors))
    tensors = {}
    for t in tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor"):
        name = _hf_name(t.name)
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            w = _unpermute_rope(w, heads)
        tensors[name] = w.contiguous()
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / GGUF_SOURCE).write_text(json.dumps(_gguf_layer_types(gguf_path.name, reader),
                                              indent=2))
    _convert_tokenizer(gguf_path, out, meta)


GGUF_SOURCE = "gguf_source.json"  # what the checkpoint was converted from



def _gguf_layer_types(name: str, reader) -> dict:
    """The quantisation of the GGUF's decoder layers: elements per tensor type of the
    2-D layer weights (not the embedding or output, which GGUF keeps finer)."""
    types: dict[str, int] = {}
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            kind = t.tensor_type.name
            types[kind] = types.get(kind, 0) + int(t.n_elements)
    return {"file": name, "layer_weight_types": types}



def gguf_layer_weight_types(path: Path) -> dict[str, int] | None:
    """Elements per tensor type of a converted GGUF's layer weights ({"Q4_1": ...}), or
    None for checkpoints that did not come from a GGUF (or were converted before the
    converter recorded it)."""
    source = Path(path) / GGUF_SOURCE
    if not source.is_file():
        return None
    return json.loads(source.read_text()).get("layer_weight_types") or None



def _field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - fields of odd types are not needed
        return None



def _hf_name(gguf_name: str) -> str:
    i, rest = None, gguf_name
    if gguf_name.startswith("blk."):
        _, i, rest = gguf_name.split(".", 2)
    if rest not in _GGUF_NAMES:
        # e.g. Llama 3.1's rope_freqs.weight: a tensor the model would not apply.
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not one the engine computes "
                             f"with, so this GGUF variant is not supported (Llama 3.1+ "
                             f"GGUFs carry rope_freqs): serve the model's Hugging Face "
                             f"checkpoint instead")
    return _GGUF_NAMES[rest].format(i=i)



def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows interleaved for its RoPE; undo it for rotate-half."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))



def _gguf_config(meta: dict, arch: str, has_output: bool) -> dict:
    p = arch + "."
    hf_arch, model_type = _GGUF_ARCHS[arch]
    hidden = int(meta[p + "embedding_length"])
    heads = int(meta[p + "attention.head_count"])
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": int(meta.get(p + "attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta[p + "attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(p + "context_length", 2048)),
        "vocab_size": int(meta.get(p + "vocab_size", 0)) or None,
        "tie_word_embeddings": not has_output,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    config.update(_gguf_attention_variants(meta, p, config["head_dim"]))
    return {k: v for k, v in config.items() if v is not None}



def _gguf_attention_variants(meta: dict, p: str, head_dim: int) -> dict:
    """The GGUF's rope scaling, partial rotary and sliding window, in config.json's
    names: carried over so that ``supported.check_model_config`` sees them (and
    refuses what the engine does not compute) instead of their being dropped."""
    out = {}
    scaling = meta.get(p + "rope.scaling.type")
    if scaling and scaling != "none":
        out["rope_scaling"] = {"rope_type": scaling,
                               "factor": float(meta.get(p + "rope.scaling.factor") or 1.0)}
        if scaling == "yarn":
            out["rope_scaling"].update(_gguf_yarn(meta, p))
    rotary_dim = meta.get(p + "rope.dimension_count")
    if rotary_dim and int(rotary_dim) != head_dim:
        out["partial_rotary_factor"] = int(rotary_dim) / head_dim
    if meta.get(p + "attention.sliding_window"):
        out["sliding_window"] = int(meta[p + "attention.sliding_window"])
    return out



# llama.cpp's YaRN keys with transformers' names (its formula is transformers' with
# truncate, the default), and those transformers has no equivalent for, with their
# neutral values: carried under their GGUF names where set otherwise, so that
# ``supported.check_model_config`` refuses them by name.
_YARN_KEYS = {"rope.scaling.original_context_length": "original_max_position_embeddings",
              "rope.scaling.yarn_beta_fast": "beta_fast",
              "rope.scaling.yarn_beta_slow": "beta_slow"}
_YARN_LLAMA_CPP_ONLY = {"rope.scaling.attn_factor": (1.0,),
                        "rope.scaling.yarn_ext_factor": (-1.0, 1.0),
                        "rope.scaling.yarn_log_multiplier": (0.0,)}


def _gguf_yarn(meta: dict, p: str) -> dict:
    out = {name: meta[p + key] for key, name in _YARN_KEYS.items() if p + key in meta}
    out.update({key: meta[p + key] for key, neutral in _YARN_LLAMA_CPP_ONLY.items()
                if p + key in meta and float(meta[p + key]) not in neutral})
    return out


def _convert_tokenizer(gguf_path: Path, out: Path, meta: dict) -> None:
    """transformers builds a fast tokenizer from the GGUF vocabulary; saving it as
    tokenizer.json makes every later load take well under a second."""
    from transformers import AutoTokenizer
    print(f"converting the tokenizer of {gguf_path.name} (once)...", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    template = meta.get("tokenizer.chat_template")
    if template:
        tok.chat_template = template
    tok.save_pretrained(out)

