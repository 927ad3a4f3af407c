"""A request's ``bad_words`` as the token-id sequences the sampler bans, tokenized once
per request as vLLM does."""

from __future__ import annotations


def bad_words_token_ids(words: list[str], tokenizer, vocab_size: int) -> list[list[int]]:
    """Each word tokenized alone and after a space (its form mid-text), the latter kept
    only when it is a different word of as many tokens (vLLM's rule). Sequences with an
    id the model cannot produce are dropped: they can never be generated anyway."""
    found: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        found.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            found.append(spaced)
    unique = {tuple(ids) for ids in found if ids and max(ids) < vocab_size}
    return [list(ids) for ids in sorted(unique)]
