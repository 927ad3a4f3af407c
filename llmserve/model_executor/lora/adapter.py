"""A PEFT LoRA adapter read from disk and checked against the base model.

PEFT saves ``adapter_config.json`` (rank ``r``, ``lora_alpha``, the target modules,
options) and ``adapter_model.safetensors`` with, per adapted module,
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight``
``[out, r]``; the module computes ``base(x) + scale * B(A(x))`` with
``scale = alpha / r`` (``alpha / sqrt(r)`` under rsLoRA). We keep ``scale * B`` so the
layers never multiply by it.

Everything the engine cannot apply is refused here with a message naming it, before the
adapter is registered: a rank above ``--max-lora-rank``, a module other than the
decoder's q/k/v/o and gate/up/down projections, a tensor whose shape is not the base
model's (an adapter of another model), DoRA, trained biases, modules_to_save.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.distributed.shapes import RankShape, expert_intermediate
from llmserve.errors import ModelLoadError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
# The fused projections the layers hold, and which checkpoint module each slice is.
FUSED_SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter the engine cannot serve (the HTTP API's 400)."""


@dataclass
class LoRAWeights:
    """One adapted module: ``a`` ``[r, in]`` and ``b`` ``[out, r]`` (scale folded in),
    float32 on the CPU."""
    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """A checked adapter: its modules by (layer, module name), and its largest rank."""
    path: str
    rank: int
    modules: dict[tuple[int, str], LoRAWeights]

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())


def module_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection LoRA may adapt, for the whole (unsharded) model."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    shapes = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv),
              "v_proj": (c.hidden_size, kv), "o_proj": (q, c.hidden_size)}
    if expert_intermediate(c) is None:  # the experts of a MoE block are not adapted
        i = c.intermediate_size
        shapes.update(gate_proj=(c.hidden_size, i), up_proj=(c.hidden_size, i),
                      down_proj=(i, c.hidden_size))
    return shapes


def load_adapter(path: Path, hf_config, max_rank: int, source: str | None = None
                 ) -> LoRAAdapter:
    """Read and check the PEFT adapter in directory ``path`` (``source``: how the user
    named it, for messages). Raises LoRAError naming what is wrong."""
    where = source or str(path)
    try:
        return _load(path, hf_config, max_rank, where)
    except LoRAError:
        raise
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, RuntimeError) as e:
        # A file of the right names but the wrong contents: still the client's error.
        raise LoRAError(f"adapter {where}: malformed adapter ({type(e).__name__}: {e})") from e


def _load(path: Path, hf_config, max_rank: int, where: str) -> LoRAAdapter:
    config = _read_config(path, where)
    shapes = module_shapes(hf_config)
    targets = config.get("target_modules")
    if isinstance(targets, list):  # (a string is a regular expression: the tensors tell)
        for target in targets:
            if target.split(".")[-1] not in shapes:
                raise LoRAError(f"adapter {where}: target module {target!r} is not "
                                f"supported; LoRA is applied to the decoder layers' "
                                f"{', '.join(shapes)}")
    tensors = _read_tensors(path, where)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.search(key)
        if match is None:
            other = re.search(r"(\w+)\.lora_\w+", key)
            what = f"target module {other[1]!r}" if other else f"tensor {key!r}"
            raise LoRAError(f"adapter {where}: {what} is not supported; LoRA is applied to "
                            f"the decoder layers' {', '.join(shapes)}")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in shapes:
            raise LoRAError(f"adapter {where}: target module {module!r} is not supported for "
                            f"this model; LoRA is applied to {', '.join(shapes)}")
        if layer >= hf_config.num_hidden_layers:
            raise LoRAError(f"adapter {where}: it adapts layer {layer}, but the base model "
                            f"has {hf_config.num_hidden_layers} layers: it belongs to "
                            f"another base model")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"adapter {where}: no LoRA weights found")
    modules = {key: _checked(where, key, ab, shapes[key[1]], config, max_rank)
               for key, ab in sorted(pairs.items())}
    return LoRAAdapter(where, max(w.rank for w in modules.values()), modules)


def _read_config(path: Path, where: str) -> dict:
    file = path / "adapter_config.json"
    if not file.is_file():
        raise LoRAError(f"adapter {where}: no adapter_config.json in {path} (a PEFT LoRA "
                        f"adapter directory has adapter_config.json and "
                        f"adapter_model.safetensors)")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"adapter {where}: unreadable adapter_config.json ({e})") from e
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {where}: adapter_config.json is not a JSON object")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoRAError(f"adapter {where}: lora_alpha must be a positive number, not {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, list) and not all(isinstance(t, str) for t in targets):
        raise LoRAError(f"adapter {where}: target_modules must be names, not {targets!r}")
    kind = config.get("peft_type", "LORA")
    refusals = [
        (kind != "LORA", f"peft_type {kind!r} (only LORA adapters)"),
        (config.get("use_dora"), "DoRA (use_dora)"),
        (config.get("bias", "none") != "none", f"trained biases (bias={config.get('bias')!r})"),
        (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')}"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out weights"),
        (config.get("lora_bias"), "LoRA biases (lora_bias)"),
    ]
    for refused, what in refusals:
        if refused:
            raise LoRAError(f"adapter {where}: {what} is not supported")
    return config


def _read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    file = path / "adapter_model.safetensors"
    if file.is_file():
        from safetensors.torch import load_file
        try:
            return load_file(file)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file
            raise LoRAError(f"adapter {where}: unreadable adapter_model.safetensors ({e})") from e
    legacy = path / "adapter_model.bin"
    if legacy.is_file():
        try:
            return torch.load(legacy, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise LoRAError(f"adapter {where}: unreadable adapter_model.bin ({e})") from e
    raise LoRAError(f"adapter {where}: no adapter_model.safetensors in {path}")


def _checked(where: str, key: tuple[int, str], ab: dict[str, torch.Tensor],
             shape: tuple[int, int], config: dict, max_rank: int) -> LoRAWeights:
    layer, module = key
    if set(ab) != {"A", "B"}:
        raise LoRAError(f"adapter {where}: layer {layer} {module} has lora_{''.join(ab)} "
                        f"without its pair")
    a, b = ab["A"], ab["B"]
    in_f, out_f = shape
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or a.shape[0] < 1:
        raise LoRAError(f"adapter {where}: layer {layer} {module}: lora_A {list(a.shape)} "
                        f"and lora_B {list(b.shape)} are not a rank-r pair")
    rank = a.shape[0]
    if not (a.is_floating_point() and b.is_floating_point()):
        raise LoRAError(f"adapter {where}: layer {layer} {module}: weights must be floating "
                        f"point, not {a.dtype}/{b.dtype}")
    if rank > max_rank:
        raise LoRAError(f"adapter {where}: rank {rank} (layer {layer} {module}) exceeds "
                        f"--max-lora-rank {max_rank}")
    if a.shape[1] != in_f or b.shape[0] != out_f:
        raise LoRAError(f"adapter {where}: layer {layer} {module} maps {a.shape[1]} -> "
                        f"{b.shape[0]} features, but the base model's {module} maps "
                        f"{in_f} -> {out_f}: the adapter belongs to another base model")
    alpha = _pattern_value(config.get("alpha_pattern") or {}, layer, module,
                           config.get("lora_alpha", 8))
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    w = LoRAWeights(a.float().contiguous(), (b.float() * scale).contiguous())
    if not (torch.isfinite(w.a).all() and torch.isfinite(w.b).all()):
        raise LoRAError(f"adapter {where}: layer {layer} {module} has NaN or infinite weights")
    return w


def _pattern_value(pattern: dict, layer: int, module: str, default):
    """PEFT's per-module override (``alpha_pattern``): a key matches the end of the
    module's name, as a regular expression."""
    name = f"model.layers.{layer}.self_attn.{module}" if module in ATTENTION_MODULES else \
        f"model.layers.{layer}.mlp.{module}"
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?{key}$", name):
            return value
    return default


# --- one tensor-parallel rank's share ---------------------------------------------------
def shard_weights(w: LoRAWeights, module: str, shape: RankShape, head_dim: int,
                  intermediate: int) -> LoRAWeights:
    """This rank's part: column-parallel projections (q/k/v, gate/up) keep all of A and
    their output rows of B; row-parallel ones (o, down) keep their input columns of A
    and all of B (their partial products are summed by the layer's all-reduce, which
    the LoRA delta joins before it)."""
    if shape.size == 1:
        return w
    if module == "q_proj":
        start, rows = shape.head_start * head_dim, shape.num_heads * head_dim
        return LoRAWeights(w.a, w.b[start:start + rows])
    if module in ("k_proj", "v_proj"):
        start, rows = shape.kv_head_start * head_dim, shape.num_kv_heads * head_dim
        return LoRAWeights(w.a, w.b[start:start + rows])
    per_rank = intermediate // shape.size
    if module in ("gate_proj", "up_proj"):
        start = shape.rank * per_rank
        return LoRAWeights(w.a, w.b[start:start + per_rank])
    if module == "o_proj":
        start, cols = shape.head_start * head_dim, shape.num_heads * head_dim
        return LoRAWeights(w.a[:, start:start + cols], w.b)
    start = shape.rank * per_rank  # down_proj
    return LoRAWeights(w.a[:, start:start + per_rank], w.b)


def resolve_adapter_source(source: str) -> Path:
    """The local directory of an adapter named by a path, ``file://``, ``pvc://`` (the
    claim as the operator mounts it) or ``hf://ORG/REPO[@REV]``."""
    from llmserve.model_executor.model_loader.hub import download_adapter
    from llmserve.model_executor.model_loader.sources import PVC_MOUNT, _local_path_of_uri
    try:
        if source.startswith("hf://"):
            return download_adapter(source)
        if source.startswith("pvc://"):
            claim, _, sub = source[len("pvc://"):].partition("/")
            mounted = Path(ADAPTER_PVC_MOUNT) / claim / sub
            path = mounted if mounted.exists() else Path(PVC_MOUNT) / sub
        else:
            path = Path(_local_path_of_uri(source) if "://" in source else source).expanduser()
    except ModelLoadError as e:
        raise LoRAError(f"adapter {source}: {e}") from e
    if not path.is_dir():
        raise LoRAError(f"adapter {source}: {path} does not exist or is not a directory")
    return path


# Where the operator mounts the claim of a pvc:// adapter source: /adapters/CLAIM.
ADAPTER_PVC_MOUNT = "/adapters"
