"""llmserve: a Kubernetes-native LLM serving platform.

The offline API (``LLM``, ``SamplingParams``, ...) is imported lazily, so the
gateway and the operator start without loading PyTorch.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "llmserve.entrypoints.llm",
    "LLMEngine": "llmserve.engine.llm_engine",
    "SamplingParams": "llmserve.core.sampling_params",
    "StructuredOutputsParams": "llmserve.core.sampling_params",
    "BeamSearchParams": "llmserve.core.beam_search",
    "LoRARequest": "llmserve.core.lora_request",
    "EngineConfig": "llmserve.config",
    "RequestOutput": "llmserve.engine.output",
    "CompletionOutput": "llmserve.engine.output",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
