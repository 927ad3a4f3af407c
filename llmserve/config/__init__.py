"""The engine's configuration: ``EngineConfig`` (engine.py, whose fields are the engine
flags), what it parses (speculative.py: ``--speculative-config``; lora.py:
``--lora-modules``) and which settings refuse each other (clashes.py). Imports neither
torch nor pydantic at the top: ``llmserve gateway`` parses its command line without
them."""

from llmserve.config.engine import (
    GPU_GROUP,
    QUANTIZATION_MODES,
    EngineConfig,
    cuda_graphs_off_because,
)

__all__ = ["GPU_GROUP", "QUANTIZATION_MODES", "EngineConfig", "cuda_graphs_off_because"]
