"""A request's token controls applied to its row of logits, in place: allowed_token_ids
(everything else -inf), bad_words (-inf where the output would complete one) and
logit_bias (added). Rows that use none of them are not touched; the sampler skips this
module entirely when no row does."""

from __future__ import annotations

import torch

from llmserve.core.request import Sequence

NEG_INF = float("-inf")


def apply_token_controls(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows = [i for i, s in enumerate(seqs) if s.params.has_token_controls]
    _keep_only_allowed(logits, [i for i in rows if seqs[i].params.allowed_token_ids], seqs)
    banned = [(i, t) for i in rows for t in banned_by_bad_words(seqs[i])]
    if banned:
        r, c = zip(*banned)
        logits[_ids(r, logits), _ids(c, logits)] = NEG_INF
    _add_logit_bias(logits, [i for i in rows if seqs[i].params.logit_bias], seqs)


def banned_by_bad_words(seq: Sequence) -> list[int]:
    """vLLM's rule: a bad word's last token is banned when the output so far ends with
    the tokens before it (always, for a one-token word)."""
    tokens, n_out = seq.token_ids, seq.num_output_tokens
    banned = []
    for word in seq.params.bad_words_token_ids:
        k = len(word) - 1
        if k == 0 or (k <= n_out and tokens[-k:] == word[:-1]):
            banned.append(word[-1])
    return banned


def _keep_only_allowed(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    if not rows:
        return
    allowed = [seqs[i].params.allowed_token_ids for i in rows]
    keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    keep[_ids([r for r, ids in enumerate(allowed) for _ in ids], logits),
         _ids([t for ids in allowed for t in ids], logits)] = True
    index = _ids(rows, logits)
    logits[index] = logits[index].masked_fill(~keep, NEG_INF)


def _add_logit_bias(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    if not rows:
        return
    items = [(i, t, b) for i in rows for t, b in seqs[i].params.logit_bias.items()]
    r, c, bias = zip(*items)
    values = torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    logits.index_put_((_ids(r, logits), _ids(c, logits)), values, accumulate=True)


def _ids(values, logits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=logits.device)
