"""llmserve: a Kubernetes-native LLM serving platform."""

__version__ = "0.1.0"

from llmserve.engine.llm_engine import LLM, LLMEngine  # noqa: E402
from llmserve.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from llmserve.engine.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
