"""Random PEFT LoRA adapters for the multi-LoRA tests, made by ``peft`` itself, and
transformers+peft as their oracle.

An adapter made here changes the base model's greedy tokens (its A and B are random,
not PEFT's zero-initialised B), so a test that ignored it, or applied another adapter's
weights, would fail.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.oracle import GREEDY_TOKENS, OracleRun, hf_greedy, load_hf

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(base: Path, out: Path, rank: int = 8, alpha: int = 16,
                       targets=ALL_TARGETS, seed: int = 0, std: float = 0.05,
                       use_rslora: bool = False) -> Path:
    """A LoRA adapter of the checkpoint at ``base``, saved by ``peft`` at ``out``
    (adapter_config.json + adapter_model.safetensors) with random A and B."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = load_hf(base)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        lora_dropout=0.0, bias="none", use_rslora=use_rslora,
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.normal_(0.0, std)
    peft_model.save_pretrained(out)
    return out


def copy_adapter(src: Path, out: Path) -> Path:
    shutil.copytree(src, out)
    return out


_runs: dict = {}


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]],
                max_new_tokens: int = GREEDY_TOKENS) -> list[OracleRun]:
    """transformers(+peft, with ``adapter``) greedy runs in float32, once per session."""
    key = (str(base), str(adapter), tuple(map(tuple, prompts)), max_new_tokens)
    if key not in _runs:
        model = load_hf(base)
        if adapter is not None:
            from peft import PeftModel
            model = PeftModel.from_pretrained(model, str(adapter)).eval()
        _runs[key] = [hf_greedy(model, p, max_new_tokens) for p in prompts]
    return _runs[key]
