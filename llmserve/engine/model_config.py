"""What an engine learns from its checkpoint before it builds anything, and the engine
configuration resolved against it, once.

``resolve`` turns the user's ``EngineConfig`` into the one the engine runs: ``--dtype``
and ``--quantization auto`` decided for this checkpoint on this device, and the step's
token budget raised to a whole prompt when prefill is not chunked. The result is
frozen: nothing downstream rewrites it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from llmserve.config import EngineConfig
from llmserve.distributed.shapes import check_tensor_parallel
from llmserve.model_executor.layers.quantization import (
    bf16_storage_for_int4,
    resolve_quantization,
)
from llmserve.model_executor.model_loader.gguf import gguf_layer_weight_types
from llmserve.model_executor.model_loader.sources import (
    load_config,
    load_tokenizer,
    resolve_model,
)
from llmserve.model_executor.models.registry import check_architecture
from llmserve.model_executor.models.supported import check_model_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    hf_config: object  # transformers' PretrainedConfig
    tokenizer: object
    name: str  # the served name
    max_model_len: int
    eos_token_ids: frozenset[int]

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


def resolve(config: EngineConfig) -> tuple[EngineConfig, ModelConfig]:
    """The frozen engine configuration for this checkpoint, and what the engine needs
    to know of the checkpoint. Raises ModelLoadError or ValueError naming the problem."""
    path = resolve_model(config.model)
    config = _resolve_precision(config, path)
    hf_config = load_config(path)
    check_architecture(hf_config)
    tokenizer = load_tokenizer(path)
    model_max = getattr(hf_config, "max_position_embeddings", None) or 4096
    max_model_len = min(config.max_model_len or model_max, model_max)
    check_model_config(hf_config, max_model_len)
    if not config.enable_chunked_prefill:
        # Unchunked, a whole prompt must fit one step's budget.
        config = replace(config, max_num_batched_tokens=max(config.max_num_batched_tokens,
                                                            max_model_len))
    check_tensor_parallel(hf_config, config.tensor_parallel_size, config.model)
    model = ModelConfig(path, hf_config, tokenizer, config.served_model_name or config.model,
                        max_model_len, frozenset(eos_token_ids(hf_config, tokenizer, path)))
    return config.frozen(), model


def _resolve_precision(config: EngineConfig, path: Path) -> EngineConfig:
    """``--quantization auto`` becomes a mode (and, for int4 on a CPU without bf16
    arithmetic, the dtype bfloat16 storage), before any rank builds its model."""
    gguf_types = gguf_layer_weight_types(path)
    if config.dtype_from_cpu and bf16_storage_for_int4(
            config.quantization, gguf_types, config.device, config.tensor_parallel_size):
        log.info("dtype auto -> bfloat16 storage for int4 (this CPU has no bf16 "
                 "arithmetic; the int4 kernels compute in float32)")
        config = replace(config, dtype="bfloat16")
    resolved = resolve_quantization(config.quantization, gguf_types, config.device,
                                    config.torch_dtype, config.tensor_parallel_size)
    if config.quantization == "auto":
        log.info("quantization auto -> %s (checkpoint: %s, %s on %s)", resolved,
                 f"GGUF {sorted(gguf_types)}" if gguf_types else "not a GGUF",
                 config.dtype, config.device)
    return replace(config, quantization=resolved)


def eos_token_ids(hf_config, tokenizer, path: Path) -> set[int]:
    """Every id that ends a generation: the model config's, the tokenizer's and the
    generation config's."""
    ids = set()
    for source in (hf_config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids
