"""A checkpoint's safetensors files and loading them into a model built on the meta
device, each tensor checked against the parameter it fills."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from llmserve.errors import ModelLoadError
from llmserve.model_executor.model_loader.fused_experts import (
    is_fused_experts,
    split_fused_experts,
)
from llmserve.model_executor.model_loader.shards import read_shard, shard_of

# transformers' index of a sharded checkpoint. Only the shards it names are weights of
# the model: other *.safetensors beside them (Mistral's consolidated.safetensors) are
# another copy in another naming.
INDEX_FILE = "model.safetensors.index.json"



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
    """Copy every safetensors tensor into the parameter of the same name (a fused one,
    split, into the parameters it stacks: ``fused_parts``). A tensor-parallel rank's
    model (``model.shard``) reads only its shard of each."""
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    names = _checkpoint_names(path)
    handle_of = dict((n, h) for h, n in names)
    loaded: set[str] = set()
    for handle, checkpoint_name in tqdm(names, desc="loading weights", unit="tensor",
                                        leave=False):
        name = model.param_name(checkpoint_name)
        if name in params or fused_parts(model, name) or is_fused_experts(name):
            loaded.update(_load_tensor(model, params, handle, checkpoint_name, name, dtype))
        elif tied and name == "lm_head.weight":
            _check_tied_head(handle_of, path)
        elif not name.endswith("rotary_emb.inv_freq"):  # (that one derives from the config)
            raise ModelLoadError(
                f"unexpected tensor {checkpoint_name!r} in {path}: "
                f"{type(model).__name__}, as its config.json configures it, has no such "
                f"parameter, and serving without it would give wrong answers (does the "
                f"config match the weights?)")
    _check_complete(set(params) - loaded - ({"lm_head.weight"} if tied else set()), path,
                    tied)
    model.to(device=device, dtype=dtype)


def _checkpoint_names(path: Path) -> list[tuple]:
    """(open safetensors file, tensor name) of every tensor of the checkpoint."""
    from safetensors import safe_open
    names, files = [], weight_files(path)
    try:
        for f in files:
            h = safe_open(f, framework="pt")
            names += [(h, n) for n in h.keys()]
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot read safetensors in {path}: {e}") from e
    return names


def _load_tensor(model, params: dict, handle, checkpoint_name: str, name: str,
                 dtype: torch.dtype) -> list[str]:
    """One checkpoint tensor into its parameters (a fused tensor's parts, a layer's
    fused experts, or this rank's shard of one parameter); the names filled."""
    shard = getattr(model, "shard", None)
    parts = fused_parts(model, name)
    if parts:
        filled = split_fused(name, handle.get_tensor(checkpoint_name), parts, shard,
                             model.config.head_dim)
    elif name not in params:  # is_fused_experts(name)
        filled = split_fused_experts(name, handle.get_tensor(checkpoint_name), shard)
    elif shard is not None and shard.size > 1:
        filled = [(name, read_shard(handle, checkpoint_name, shard, model.config.head_dim,
                                    name))]
    else:
        filled = [(name, handle.get_tensor(checkpoint_name))]
    for part_name, tensor in filled:
        _fill(params, part_name, tensor, dtype)
    return [part_name for part_name, _ in filled]


def _check_complete(missing: set[str], path: Path, tied: bool) -> None:
    if missing == {"lm_head.weight"}:
        raise ModelLoadError(f"checkpoint {path} has no lm_head.weight, and its config says "
                             f"tie_word_embeddings={tied}: the head is not tied to the "
                             f"embedding (set tie_word_embeddings to true if it is)")
    if missing:
        raise ModelLoadError(f"checkpoint {path} lacks tensors: {sorted(missing)[:4]}")



def checkpoint_slice(model: torch.nn.Module, path: Path, param: str):
    """A lazy safetensors slice of the checkpoint tensor that fills parameter ``param``
    (indexing it reads only those rows), or None if no tensor does: for a second look
    at a tensor's stored values after loading cast them to the serving dtype."""
    from safetensors import safe_open

    for f in weight_files(path):
        handle = safe_open(f, framework="pt")
        for name in handle.keys():
            if model.param_name(name) == param:
                return handle.get_slice(name)
    return None


def fused_parts(model: torch.nn.Module, name: str) -> list[tuple[str, int]] | None:
    """The parameters that checkpoint tensor ``name`` stacks by rows, each with its row
    count, in order (Phi-3's ``qkv_proj``: q, k, v), from the model's optional
    ``fused_parts`` hook; None for a tensor that fills one parameter."""
    hook = getattr(model, "fused_parts", None)
    return hook(name) if hook is not None else None


def split_fused(name: str, tensor: torch.Tensor, parts: list[tuple[str, int]],
                shard, head_dim: int) -> list[tuple[str, torch.Tensor]]:
    """(parameter, this rank's rows of it) for each part stacked in ``tensor``: a part is
    sharded as the tensor of its own name would be (q/k/v by head, gate/up by row)."""
    rows = [n for _, n in parts]
    if tensor.shape[0] != sum(rows):
        layout = " + ".join(f"{n} ({part.split('.')[-2]})" for part, n in parts)
        raise ModelLoadError(f"fused tensor {name!r} has shape {tuple(tensor.shape)}: its "
                             f"config says {sum(rows)} rows = {layout} (does the config "
                             f"match the weights?)")
    sharded = shard is not None and shard.size > 1
    return [(part, shard_of(block, shard, head_dim, part) if sharded else block)
            for (part, _), block in zip(parts, tensor.split(rows))]


def _fill(params: dict, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    param = params.get(name)
    if param is None:
        raise ModelLoadError(f"unexpected tensor {name!r}: the model has no such parameter "
                             f"(does the config match the weights?)")
    if tuple(tensor.shape) != tuple(param.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"config says {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(dtype))


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

