"""Collectives between the tensor-parallel ranks of one engine (``torch.distributed``:
NCCL on CUDA, gloo on CPU). Each is a no-op question on one rank; the model's layers
call them, the executor starts the group."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from llmserve import envs

# A collective that does not complete in this long fails (a hung peer). Workers wait
# for work on their pipe, not in a collective, so an idle engine never times out.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=envs.LLMSERVE_TP_TIMEOUT_S)


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place."""
    dist.all_reduce(x)
    return x


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Rank 0 gets ``[rows, vocab]`` from every rank's ``[rows, vocab / N]`` (padding
    cut off); the other ranks get None."""
    if dist.get_rank() == 0:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :vocab_size]
    dist.gather(local, None, dst=0)
    return None


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"
