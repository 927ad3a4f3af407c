"""llmserve against other systems: llama.cpp, lm-evaluation-harness (see benchmarks/README.md)."""
