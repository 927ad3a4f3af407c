"""Random PEFT-format LoRA adapters, written with safetensors (no training, no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmserve.model_executor.lora.adapter import module_shapes


def write_adapter(out: Path, hf_config, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of every projection of every layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (in_f, out_f) in module_shapes(hf_config).items():
            owner = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{owner}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": list(module_shapes(hf_config))}))
    return out
