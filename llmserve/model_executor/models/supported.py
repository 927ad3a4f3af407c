"""What the engine computes, checked against a checkpoint's config at start-up.

The model code reads a handful of config fields. A checkpoint may set others that
transformers honours and change the arithmetic: a sliding window, a rope variant, an
MLP bias, soft-capping. Left unread, they would make the engine serve wrong tokens
with no warning (a Mistral checkpoint with ``sliding_window: 4096`` answered every
conversation past 4,096 tokens wrongly). So each such field is checked here, and a
value the engine does not implement is refused by name, with what would work.
(Sliding windows are computed, per layer: ``layer_sliding_window``.)

The checkpoint's tensors are checked as they load (``weights.load_weights``): a tensor
the model has no parameter for is refused the same way, never dropped.
"""

from __future__ import annotations

from llmserve.errors import ModelLoadError
from llmserve.model_executor.model_loader.mxfp4 import is_mxfp4

# Rope variants ``llama.rope_inv_freq`` computes.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
# What transformers' YaRN reads (``llama.rope_inv_freq`` calls it); any other key (a
# GGUF's llama.cpp-only factors) would be dropped.
YARN_PARAMETERS = {"rope_type", "type", "rope_theta", "factor",
                   "original_max_position_embeddings", "beta_fast", "beta_slow",
                   "attention_factor", "mscale", "mscale_all_dim", "truncate",
                   "partial_rotary_factor"}
# The MLP's gate activation: SiLU (transformers also calls it swish).
SUPPORTED_ACTIVATIONS = ("silu", "swish")
# Gemma's MLP (``models/gemma2.py``) gates with GELU's tanh approximation, and
# transformers reads it from ``hidden_activation``; its attention and final logits
# are soft-capped where the config says (llama.Attention, gemma2.compute_logits).
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
# Multimodal checkpoints refused, with the text-only class that serves their text.
TEXT_ONLY_CLASSES = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# Fields of other families that change the arithmetic where set; none is computed here.
UNSUPPORTED_FIELDS = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "mlp_bias": "MLP biases",
    "partial_rotary_factor": "partial rotary embeddings",
    "quantization_config": "pre-quantised checkpoints (use --quantization on a "
                           "bf16/float32 checkpoint instead)",
}
# The value of each of those fields that means "off".
_OFF = {"partial_rotary_factor": 1.0}
# Whose model orders its q/k heads for a partial rotary (``models/phi3.py``).
PARTIAL_ROTARY_ARCHITECTURES = ("Phi3ForCausalLM",)
# Whose MXFP4 experts are dequantised at load (``models/gpt_oss.py``).
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)


def check_model_config(config, max_model_len: int) -> None:
    """Refuse ``config`` if serving it up to ``max_model_len`` tokens needs arithmetic
    the engine does not implement; the error names the field and its value."""
    for check in (_text_only, _unsupported_fields, _activation, _rope):
        problem = check(config, max_model_len)
        if problem:
            archs = ", ".join(getattr(config, "architectures", None) or ["?"])
            raise ModelLoadError(f"this {archs} checkpoint cannot be served correctly: "
                                 f"{problem}")


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The attention window of layer ``layer_idx`` (it sees the last that many keys), or
    None where it attends to the whole context. transformers' rules: ``layer_types``
    where the config has it; Qwen2's ``use_sliding_window`` switch, windowing the
    layers from ``max_window_layers`` on; else ``sliding_window`` for every layer
    (Mistral, Mixtral)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    if layer_idx < (getattr(config, "max_window_layers", None) or 0):
        return None
    return int(window)


def model_sliding_window(config) -> int | None:
    """The window every layer shares, or None when any layer sees the whole context
    (then no block can ever be freed for being outside a window)."""
    windows = {layer_sliding_window(config, i) for i in range(config.num_hidden_layers)}
    return windows.pop() if len(windows) == 1 else None


def rope_params(config) -> dict:
    """The rope scaling parameters: transformers 5 keeps them in ``rope_parameters``,
    4.x in ``rope_scaling`` (None: no scaling)."""
    return dict(getattr(config, "rope_parameters", None)
                or getattr(config, "rope_scaling", None) or {})


def rope_type(config) -> str:
    params = rope_params(config)
    return params.get("rope_type", params.get("type")) or "default"


def layer_type_ropes(config) -> dict | None:
    """Each layer type's rope parameters where transformers 5 nests them under the
    layer types (Gemma 3: local and global ropes), else None."""
    params = rope_params(config)
    types = set(getattr(config, "layer_types", None) or ())
    return {t: params[t] for t in types if t in params} if types & params.keys() else None


def _text_only(config, max_model_len: int) -> str | None:
    for arch in getattr(config, "architectures", None) or []:
        if arch in TEXT_ONLY_CLASSES:
            return (f"{arch} (images and text) is not implemented; its text model is "
                    f"served as {TEXT_ONLY_CLASSES[arch]} (a text-only checkpoint)")
    return None


def _unsupported_fields(config, max_model_len: int) -> str | None:
    archs = getattr(config, "architectures", None) or ["?"]
    for field, what in UNSUPPORTED_FIELDS.items():
        if field == "partial_rotary_factor" and set(archs) <= set(PARTIAL_ROTARY_ARCHITECTURES):
            continue
        if field.endswith("_softcapping") and set(archs) <= set(GEMMA_ARCHITECTURES):
            continue
        if (field == "quantization_config" and set(archs) <= set(MXFP4_ARCHITECTURES)
                and is_mxfp4(config)):
            continue
        value = getattr(config, field, None)
        if value is None and field == "partial_rotary_factor":
            value = rope_params(config).get(field)  # transformers 5 keeps it there
        if value not in (None, False, _OFF.get(field)):
            return f"{field}={value!r}: {what} are not implemented"
    return None


def _activation(config, max_model_len: int) -> str | None:
    archs = getattr(config, "architectures", None) or ["?"]
    if set(archs) <= set(GEMMA_ARCHITECTURES):
        act = getattr(config, "hidden_activation", None)
        if act not in GEMMA_ACTIVATIONS:
            return (f"hidden_activation={act!r} is not implemented (supported: "
                    f"{', '.join(GEMMA_ACTIVATIONS)})")
        return None
    act = getattr(config, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        return (f"hidden_act={act!r} is not implemented (supported: "
                f"{', '.join(SUPPORTED_ACTIVATIONS)})")
    return None


def _rope(config, max_model_len: int) -> str | None:
    for layer_type, params in (layer_type_ropes(config) or {}).items():
        params = params or {}
        kind = params.get("rope_type", params.get("type")) or "default"
        if kind not in SUPPORTED_ROPE_TYPES or kind == "longrope":  # Gemma 3's two ropes
            return (f"rope type {kind!r} of the {layer_type} layers is not implemented "
                    f"(supported: {', '.join(t for t in SUPPORTED_ROPE_TYPES if t != 'longrope')})")
    kind = rope_type(config)
    if kind not in SUPPORTED_ROPE_TYPES:
        return (f"rope type {kind!r} (rope_scaling / rope_parameters) is not implemented "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    unknown = sorted(set(rope_params(config)) - YARN_PARAMETERS) if kind == "yarn" else []
    if unknown:
        return f"rope type 'yarn' with {', '.join(unknown)}: not implemented"
    if kind == "longrope":
        # transformers rotates by the short factors up to the pretraining context and by
        # the long ones past it, every position again once a sequence crosses it: a
        # paged cache keeps the keys it rotated, so only the short side is served.
        original = (getattr(config, "original_max_position_embeddings", None)
                    or rope_params(config)["original_max_position_embeddings"])
        if max_model_len > original:
            return (f"rope type 'longrope' with original_max_position_embeddings="
                    f"{original}: its long factors (contexts past {original} tokens) "
                    f"are not implemented; serve it with --max-model-len {original} (or "
                    f"less), where the short factors apply")
    return None
