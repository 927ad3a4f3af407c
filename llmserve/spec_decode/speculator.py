"""The engine's side of speculation: which running sequences get a draft this step,
who proposes it (n-gram lookup, or a draft model once the step's slots are reserved),
and the counters behind vLLM's ``spec_decode`` metrics."""

from __future__ import annotations

from llmserve.config.speculative import SpeculativeConfig
from llmserve.core.request import Sequence
from llmserve.core.sched.output import ScheduledBatch
from llmserve.spec_decode.draft_model import DraftModel
from llmserve.spec_decode.draft_policy import DraftPolicy
from llmserve.spec_decode.ngram_proposer import NgramProposer

# What a draft model's reserved draft holds until the draft model fills it in: any
# valid token id (the scheduler reads only the length).
PLACEHOLDER = 0
# Draft-model tokens a step may compute to catch sequences' draft KV up (their first
# draft, or one after a recompute or undrafted steps): a longer prompt's catch-up is
# spread over steps instead of stalling one (draft_model.py).
CATCH_UP_TOKENS = 256


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 draft: DraftModel | None = None, sampler=None):
        self.config = config
        self.max_model_len = max_model_len
        self.draft = draft
        self.sampler = sampler  # the engine's: a draft model's tokens are drawn by it
        self.proposer = (NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max,
                                       config.prompt_lookup_min)
                         if draft is None else None)
        self.reset()

    def reset(self) -> None:
        """Counters at zero and the draft policy unlearnt (after the warm-up)."""
        # How long a draft pays (None: always k, where the proposer has that many).
        self.policy: DraftPolicy | None = DraftPolicy()
        # This step's (sequences, draft tokens), if decodes only.
        self._decode_step: tuple[int, int] | None = None
        self._lagging: list[Sequence] = []  # drafts wait for their draft KV to catch up
        self._catch_up_left = CATCH_UP_TOKENS  # of this step's catch-up budget
        self.num_drafts = 0  # sequences verified with a draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, running: list[Sequence]) -> None:
        """Before scheduling: set every running sequence's ``spec_token_ids`` (the
        scheduler may shorten them to fit the step); a draft model's are placeholders,
        its tokens come in ``fill``. None above ``disable_by_batch_size``."""
        limit = self.config.disable_by_batch_size
        off = limit is not None and len(running) > limit  # vLLM's rule: every request
        # The policy prices a draft row in a step of this many decodes (the steps it
        # learns from); prefilling sequences neither draft nor make decode rows.
        decodes = sum(1 for seq in running if seq.num_uncomputed_tokens == 1)
        k = self.config.num_speculative_tokens
        budget = CATCH_UP_TOKENS
        self._lagging = []
        for seq in running:
            room = 0 if off else min(k, self._room(seq))
            if room and self.policy is not None:
                room = min(room, self.policy.max_draft(seq, decodes, k))
                if not room:
                    self.policy.not_drafted(seq)
            if room and self.draft is not None:
                gap = self.draft.gap(seq)
                if gap > budget:  # caught up in ``fill`` first, drafted later
                    self._lagging.append(seq)
                    room = 0
                else:
                    budget -= gap
            if not room:
                seq.spec_token_ids = []
            elif self.draft is not None:
                seq.spec_token_ids = [PLACEHOLDER] * room
            else:
                seq.spec_token_ids = self._grammatical(
                    seq, self.proposer.propose(seq.token_ids, room))
        self._catch_up_left = budget

    def fill(self, batch: ScheduledBatch) -> None:
        """After scheduling (the drafts' slots are reserved): the draft model's tokens."""
        decodes = all(s.num_computed_tokens == s.num_tokens - 1 for s in batch.seqs)
        self._decode_step = (len(batch.seqs), sum(batch.num_new_tokens) - len(batch.seqs)
                             ) if decodes else None
        drafted = [s for s in batch.seqs if s.spec_token_ids]
        if self.draft is None:
            return
        if drafted:
            self.draft.propose(drafted, self.sampler)
        if self._lagging:
            scheduled = {s.seq_id for s in batch.seqs}
            self.draft.catch_up([s for s in self._lagging if s.seq_id in scheduled
                                 and s.num_computed_tokens == s.num_tokens - 1],
                                self._catch_up_left)
            self._lagging = []

    @staticmethod
    def _grammatical(seq: Sequence, draft: list[int]) -> list[int]:
        """The longest prefix of ``draft`` that ``seq``'s grammar (if any) allows: a
        token it refuses would be rejected in verification, and so would all after it.
        (A draft model's tokens come after scheduling; verification cuts those.)"""
        if seq.matcher is None or not draft:
            return draft
        return draft[:seq.matcher.validate_tokens(draft)]

    def _room(self, seq: Sequence) -> int:
        """Most draft tokens ``seq`` can use: a decode, not a beam (the search picks
        its tokens), whose step emits at most 1 + k tokens within max_tokens and the
        model's length."""
        if (seq.num_uncomputed_tokens != 1 or seq.num_output_tokens == 0
                or seq.request.beams is not None):
            return 0
        left = min(seq.params.max_tokens - seq.num_output_tokens,
                   self.max_model_len - seq.num_tokens)
        return max(0, left - 1)

    def observe_step(self, seconds: float) -> None:
        """The step just run took ``seconds`` (the policy learns decode steps' cost)."""
        if self._decode_step and self.policy is not None:
            self.policy.observe_step(*self._decode_step, seconds)

    def record(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        if self.policy is not None:
            self.policy.drafted(seq, num_draft, num_accepted)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
