"""Verification of one-hot (n-gram) drafts against the target model, exactly.

A sequence with a draft d_1..d_k was run on [last token, d_1, .., d_k], so the step
has the target's logits at k + 1 positions: row i scores the token after d_1..d_i.
Row i is sampled by the engine's own ``Sampler``, as if d_1..d_i were already output
tokens (penalties, min_tokens, token controls, logprobs and the seeded race key all
see that position), giving t_i ~ p_i. The draft's longest prefix with d_i == t_i
is accepted and t at the first mismatch (or t_k+1, the bonus token) follows it.

This is rejection sampling for a one-hot draft q = 1{d} (an n-gram draft): the
standard rule accepts d with probability min(1, p(d) / q(d)) = p(d), and on rejection
draws from norm(max(0, p - q)), which is p with d removed and renormalised. Drawing
t ~ p and accepting iff t == d realises both at once: P(accept) = P(t = d) = p(d), and
given a rejection t ~ p(. | t != d). Whatever the draft, every token output is the
target's own draw at its position given the tokens before it, so the output
distribution is the target's; greedy rows (argmax) give exactly the tokens decoding
without speculation gives, and so do seeded rows, since their draws are keyed by
(seed, output position). A draft model draws its tokens with the same keys
(``draft_model.py``), so a sampled draft is accepted whenever the two races agree.
"""

from __future__ import annotations

import torch

from llmserve.core.request import Sequence


class DraftPosition:
    """``seq`` as it would be with ``draft`` appended: what the sampler reads of a
    sequence (the parameters, the tokens and where its output starts)."""

    __slots__ = ("seq", "token_ids")

    def __init__(self, seq: Sequence, draft: list[int]):
        self.seq = seq
        self.token_ids = seq.token_ids + draft if draft else seq.token_ids

    params = property(lambda self: self.seq.params)
    index = property(lambda self: self.seq.index)
    coupling_seed = property(lambda self: self.seq.coupling_seed)
    request = property(lambda self: self.seq.request)
    # (the sampler only asks whether there is one: each position's mask comes as a row)
    matcher = property(lambda self: self.seq.matcher)
    num_prompt_tokens = property(lambda self: self.seq.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.seq.num_prompt_tokens


def accepted_length(draft: list[int], target: list[int]) -> int:
    """How many leading draft tokens the target's own tokens confirm."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n


def verify(sampler, logits: torch.Tensor, seqs: list[Sequence], masks=None
           ) -> list[tuple[list[int], list]]:
    """Per sequence (its draft in ``spec_token_ids``, its ``1 + k`` rows of ``logits``
    in order): the tokens to output (accepted draft + one of the target's) and their
    logprobs (None each where not asked). ``masks(constrained)``: the grammar's mask
    rows of those sequences, 1 + k each in order (structured_output/grammar.py); each
    position is sampled under its own, as it would be without the draft."""
    positions = [DraftPosition(s, s.spec_token_ids[:i])
                 for s in seqs for i in range(len(s.spec_token_ids) + 1)]
    grammar_rows = [i for i, p in enumerate(positions) if p.matcher is not None]
    bitmask = None
    if grammar_rows:
        bitmask = masks([s for s in seqs if s.matcher is not None])
    out = sampler(logits, positions, grammar_rows, bitmask)
    results, row = [], 0
    for seq in seqs:
        k = len(seq.spec_token_ids)
        target = out.token_ids[row:row + k + 1]
        n = accepted_length(seq.spec_token_ids, target)
        results.append((target[:n + 1], out.logprobs[row:row + n + 1]))
        row += k + 1
    return results
