"""Which implementation a layer computes with, bound once when the model is loaded (as
vLLM's ``CustomOp`` picks its forward), never decided per call.

A norm, an attention or an MLP has up to three implementations:

- ``TORCH``: torch's ops. Any device and dtype, and the only one torch.compile can
  trace (the C kernels are ctypes calls). What a layer computes with until it is bound.
- ``C``: the CPU's C kernels (``kernels/cpu/native.py``), where they are built and the
  layer's dtype is one they take: one call where the torch ops take several.
- ``TRITON``: ``--fused-kernels``' Triton kernels (``kernels/triton/fused.py``):
  add+RMSNorm, rotary+KV write, SiLU x up; fewer launches and HBM passes a decode step.
  They round as Hugging Face does (so in float32 they agree with torch's to the last
  ulps; in 16-bit, the norm can differ by one unit from torch's F.rms_norm, which
  rounds the weight product once).

The loader builds one ``Backends`` for the model (what it knows of the device, the
kernels and the flags) and hands it to every layer (``bind_backends``); each layer
picks from it what applies to itself (a norm whose weight is not bf16 keeps torch's).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.kernels.cpu.native import cpu_library


class Backend(enum.Enum):
    TORCH = "torch"
    C = "c"
    TRITON = "triton"


@dataclass(frozen=True)
class Backends:
    """What a model is bound with. ``fused``: --fused-kernels (Triton norms, rotary + KV
    write, SiLU x up). ``c_kernels``: a CPU with the C kernels built, run eagerly.
    ``cpu_attention``: attention reads a CPU plan (not Triton's), so its C path may run.
    ``compiled``: the layers run inside a torch.compile'd graph (torch's ops only, and
    no choice by row count). ``dtype``: the model's."""

    fused: bool = False
    c_kernels: bool = False
    cpu_attention: bool = False
    compiled: bool = False
    dtype: torch.dtype = torch.float32

    def norm(self, weight: torch.Tensor) -> Backend:
        """A Llama RMSNorm's: the C kernel takes bf16 rows and a bf16 weight."""
        if self.fused:
            return Backend.TRITON
        return Backend.C if self.c_kernels and weight.dtype == torch.bfloat16 else Backend.TORCH

    def activation(self) -> Backend:
        """SiLU x up's: the C kernel takes bf16."""
        if self.fused:
            return Backend.TRITON
        return Backend.C if self.c_kernels and self.dtype == torch.bfloat16 else Backend.TORCH

    def attention(self) -> Backend:
        """Rotary + K/V store + attention's: in C where the step's CPU plan says so."""
        if self.fused:
            return Backend.TRITON
        return Backend.C if self.c_kernels and self.cpu_attention else Backend.TORCH


def backends_for(device: torch.device, dtype: torch.dtype, fused: bool,
                 triton_attention: bool) -> Backends:
    """The loader's choice for a model on ``device`` in ``dtype``."""
    if fused:
        from llmserve.kernels.triton import fused as _  # noqa: F401 - fail here, not mid-step
    c_kernels = device.type == "cpu" and cpu_library() is not None
    return Backends(fused=fused, c_kernels=c_kernels, cpu_attention=not triton_attention,
                    dtype=dtype)


COMPILED = Backends(compiled=True)


def bind_backends(module: nn.Module, backends: Backends) -> None:
    """Every layer of ``module`` that has implementations to choose from takes its own
    from ``backends``."""
    for m in module.modules():
        bind = getattr(m, "bind_backend", None)
        if bind is not None:
            bind(backends)
