"""Which tensor-parallel sizes a model's shape allows, and each rank's share of it.

Pure arithmetic on the model's head counts and sizes, with no torch: the engine checks
a configuration with it before it starts any worker, and the operator refuses what it
can check from the spec alone (the built-in model's shape is known) with the same
message.

Rank ``r`` of ``N`` holds query heads ``[r * H/N, (r + 1) * H/N)``. Its KV heads are
the ones those query heads read: ``KV/N`` of them when ``N`` divides the KV head count,
else (``KV`` divides ``N``) the one KV head of its query heads' group, replicated on
``N/KV`` ranks. MLP rows ``[r * I/N, (r + 1) * I/N)``, and the same share of every
expert's rows in a mixture-of-experts model (``expert_intermediate``). Vocabulary
rows in ``N`` equal parts of ``ceil(V/N)``, the last one padded with zero rows that
are cut off the gathered logits, so any vocabulary size works.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.utils import cdiv


@dataclass(frozen=True)
class RankShape:
    rank: int
    size: int
    num_heads: int  # query heads on this rank
    head_start: int  # the first of them
    num_kv_heads: int  # KV heads on this rank (one replica when N > KV)
    kv_head_start: int
    intermediate: int  # MLP rows on this rank
    moe_intermediate: int  # each expert's MLP rows on this rank (MoE models)
    vocab_per_rank: int  # rows of the embedding / LM head, padded
    vocab_size: int  # the model's own

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_end(self) -> int:
        """End of the rank's real (unpadded) rows."""
        return min(self.vocab_size, self.vocab_start + self.vocab_per_rank)


def expert_intermediate(hf_config) -> int | None:
    """An expert's MLP width in a mixture-of-experts model (None: a dense model).
    Qwen's MoE configs name it ``moe_intermediate_size``; Mixtral's experts are
    ``intermediate_size`` wide."""
    if not (getattr(hf_config, "num_experts", None)
            or getattr(hf_config, "num_local_experts", None)):
        return None
    return getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size


def _problems(heads: int, kv_heads: int, intermediate: int, size: int,
              moe_intermediate: int | None = None) -> list[str]:
    problems = []
    if heads % size:
        problems.append(f"{heads} query heads are not divisible by {size}")
    if kv_heads % size and size % kv_heads:
        problems.append(f"{kv_heads} KV heads neither divide evenly among {size} ranks nor "
                        f"replicate evenly onto them ({size} is not a multiple of {kv_heads})")
    if intermediate % size:
        problems.append(f"intermediate_size {intermediate} is not divisible by {size}")
    if moe_intermediate and moe_intermediate % size:
        problems.append(f"the experts' intermediate size {moe_intermediate} is not "
                        f"divisible by {size}")
    return problems


def supported_sizes(hf_config, limit: int = 16) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` that this model's shape allows."""
    c = hf_config
    return [n for n in range(1, limit + 1)
            if not _problems(c.num_attention_heads, c.num_key_value_heads,
                             c.intermediate_size, n, expert_intermediate(c))]


def check_tensor_parallel(hf_config, size: int, model: str = "this model") -> None:
    """ValueError naming the numbers, and the sizes that would work, unless ``size``
    ranks can split the model."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    c = hf_config
    problems = _problems(c.num_attention_heads, c.num_key_value_heads, c.intermediate_size,
                         size, expert_intermediate(c))
    if problems:
        ok = supported_sizes(hf_config, max(8, size))
        raise ValueError(
            f"tensor parallel size {size} cannot split {model} "
            f"({c.num_attention_heads} query heads, {c.num_key_value_heads} KV heads, "
            f"intermediate_size {c.intermediate_size}): {'; '.join(problems)}. "
            f"Sizes that work for it: {', '.join(map(str, ok))}")


def rank_shape(hf_config, rank: int, size: int) -> RankShape:
    c = hf_config
    check_tensor_parallel(c, size)
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    local_heads = heads // size
    if kv % size == 0:
        local_kv, kv_start = kv // size, rank * (kv // size)
    else:  # KV divides N: N/KV consecutive ranks share one KV head
        local_kv, kv_start = 1, rank // (size // kv)
    vocab_per_rank = cdiv(c.vocab_size, size)
    return RankShape(rank=rank, size=size, num_heads=local_heads,
                     head_start=rank * local_heads, num_kv_heads=local_kv,
                     kv_head_start=kv_start, intermediate=c.intermediate_size // size,
                     moe_intermediate=(expert_intermediate(c) or 0) // size,
                     vocab_per_rank=vocab_per_rank, vocab_size=c.vocab_size)
