"""Which model class serves each Hugging Face architecture name (``config.json``'s
``architectures``). One file per model family; a family serves every architecture
whose arithmetic it computes (``supported.py`` refuses the config variants it does not)."""

from __future__ import annotations

from llmserve.model_executor.models.llama import LlamaForCausalLM

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
