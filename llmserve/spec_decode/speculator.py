"""The engine's side of speculation: which running sequences get a draft this step,
and the counters behind vLLM's ``spec_decode`` metrics."""

from __future__ import annotations

from llmserve.core.request import Sequence
from llmserve.spec_decode.config import SpeculativeConfig
from llmserve.spec_decode.ngram_proposer import NgramProposer


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.num_speculative_tokens,
                                      config.prompt_lookup_max, config.prompt_lookup_min)
        self.num_drafts = 0  # sequences verified with a draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, running: list[Sequence]) -> None:
        """Set every running sequence's ``spec_token_ids`` (the scheduler may shorten
        them to fit the step). None above ``disable_by_batch_size``."""
        limit = self.config.disable_by_batch_size
        off = limit is not None and len(running) > limit
        for seq in running:
            room = 0 if off else self._room(seq)
            seq.spec_token_ids = self.proposer.propose(seq.token_ids, room) if room else []

    def _room(self, seq: Sequence) -> int:
        """Most draft tokens ``seq`` can use: a decode, not a beam (the search picks
        its tokens) nor a grammar (drafts would need checking against it), whose step
        emits at most 1 + k tokens within max_tokens and the model's length."""
        if (seq.num_uncomputed_tokens != 1 or seq.num_output_tokens == 0
                or seq.request.beams is not None or seq.matcher is not None):
            return 0
        left = min(seq.params.max_tokens - seq.num_output_tokens,
                   self.max_model_len - seq.num_tokens)
        return max(0, left - 1)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
