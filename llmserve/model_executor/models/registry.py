"""Which model class serves each Hugging Face architecture name (``config.json``'s
``architectures``). One file per model family; a family serves every architecture
whose arithmetic it computes (``supported.py`` refuses the config variants it does not)."""

from __future__ import annotations

from llmserve.errors import ModelLoadError
from llmserve.model_executor.models.gemma2 import Gemma2ForCausalLM
from llmserve.model_executor.models.gemma3 import Gemma3ForCausalLM
from llmserve.model_executor.models.gpt_oss import GptOssForCausalLM
from llmserve.model_executor.models.llama import LlamaForCausalLM
from llmserve.model_executor.models.mixtral import MixtralForCausalLM
from llmserve.model_executor.models.phi3 import Phi3ForCausalLM
from llmserve.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # with per-head q/k norms (llama.has_qk_norm)
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,  # fused qkv/gate_up split at load; LongRoPE
    "GptOssForCausalLM": GptOssForCausalLM,  # sinks, YaRN, biased experts; MXFP4 dequantised
    "Gemma2ForCausalLM": Gemma2ForCausalLM,  # (1 + w) norms, GELU, soft-capping, tied head
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # + q/k norms, local/global ropes
    # refused at start-up (supported.TEXT_ONLY_CLASSES), naming Gemma3ForCausalLM
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
}


def check_architecture(config) -> None:
    """ModelLoadError unless one of ``config``'s architectures is served here."""
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(f"unsupported architecture {archs}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
