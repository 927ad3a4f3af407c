"""MXFP4 checkpoints (the released gpt-oss weights): each expert tensor is stored as
``<name>_blocks [experts, rows, cols / 32, 16]`` uint8, two E2M1 (4-bit float) values a
byte, low nibble first, and ``<name>_scales [experts, rows, cols / 32]`` uint8, one
E8M0 exponent (biased by 127) per group of 32 values. The engine dequantises them at
load, with transformers' own converter, into the serving dtype: the MoE then runs as
a bf16/float32 checkpoint would (and ``--quantization int8/int4`` re-quantises it).
Keeping them packed at run time is not implemented.
"""

from __future__ import annotations

import torch

from llmserve.errors import ModelLoadError


def is_mxfp4(config) -> bool:
    """Whether ``config`` says its experts are MXFP4 (``quantization_config``)."""
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(
        quant, "quant_method", None)
    return str(method).lower() == "mxfp4"


def packed_shapes(experts: int, rows: int, cols: int) -> tuple[tuple, tuple]:
    """The (blocks, scales) shapes of an MXFP4 tensor of ``experts x rows x cols``."""
    if cols % 32:
        raise ModelLoadError(f"an MXFP4 tensor's rows must be whole groups of 32 values: "
                             f"{cols} columns")
    return (experts, rows, cols // 32, 16), (experts, rows, cols // 32)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """``[experts, rows, cols/32, 16]`` blocks and their scales -> the values
    transposed, ``[experts, cols, rows]`` in ``dtype`` (the layout of transformers'
    ``GptOssExperts`` parameters)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if blocks.shape[:-1] != scales.shape:
        raise ModelLoadError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                             f"{tuple(scales.shape)} do not match")
    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)
