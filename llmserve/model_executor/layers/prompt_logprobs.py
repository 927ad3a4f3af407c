"""Prompt log-probabilities: how likely the model found each prompt token given the
tokens before it (vLLM's ``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``).
The raw model's log-softmax, as transformers computes it: no temperature, penalties
or token controls, which shape sampling, not the prompt.

A prefill chunk can hold thousands of prompt rows; their float32 log-softmax over a
128k vocabulary is 0.5 MB a row (a 2048-row chunk: 1 GB, twice that with the logits
and temporaries). So rows are scored ``ROWS_PER_SLICE`` at a time and only what is
reported stays: each row's target logprob, its rank and the top few."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.core.request import Logprob

# 256 rows x 128k vocabulary x 4 bytes: 128 MB of float32 log-softmax at a time.
ROWS_PER_SLICE = 256


@dataclass
class PromptScores:
    """Scores of a step's prompt rows, on the device: the target's logprob and rank
    (1 = the likeliest token) per row, and the ``k`` likeliest alternatives."""
    chosen: torch.Tensor  # [rows] float32
    ranks: torch.Tensor  # [rows] int64
    top_values: torch.Tensor  # [rows, k] float32 (k may be 0)
    top_ids: torch.Tensor  # [rows, k] int64

    @staticmethod
    def cat(parts: list[PromptScores]) -> PromptScores:
        return PromptScores(*(torch.cat(field) for field in zip(
            *((p.chosen, p.ranks, p.top_values, p.top_ids) for p in parts))))

    def logprobs(self, targets: list[int], num_top: int) -> list[Logprob]:
        """One Logprob per row (the rows of this object, in order), with ``num_top``
        alternatives each."""
        top_ids = self.top_ids[:, :num_top].tolist()
        top_values = self.top_values[:, :num_top].tolist()
        return [Logprob(t, lp, list(zip(ids, values)), rank)
                for t, lp, ids, values, rank in zip(targets, self.chosen.tolist(), top_ids,
                                                    top_values, self.ranks.tolist())]

    def rows(self, start: int, end: int) -> PromptScores:
        return PromptScores(self.chosen[start:end], self.ranks[start:end],
                            self.top_values[start:end], self.top_ids[start:end])


@torch.inference_mode()
def score_rows(logits: torch.Tensor, targets: torch.Tensor, num_top: int,
               vocab_size: int) -> PromptScores:
    """Row i of ``logits`` scores ``targets[i]`` (a device tensor)."""
    logprobs = torch.log_softmax(logits[:, :vocab_size].float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    ranks = (logprobs > chosen[:, None]).sum(dim=1) + 1
    top = logprobs.topk(num_top, dim=-1)
    return PromptScores(chosen, ranks, top.values, top.indices)

