"""Kernels: ``cpu/`` (C, built once per CPU) and ``triton/``. A kernel knows tensors,
never requests, models or the engine. ``unified_attention`` (Triton, paged) is
imported lazily: importing Triton costs seconds and the CPU path never needs it."""


def __getattr__(name: str):
    if name == "unified_attention":
        from llmserve.kernels.triton.attention import unified_attention
        return unified_attention
    raise AttributeError(f"module 'llmserve.kernels' has no attribute {name!r}")
