"""Incremental detokenisation and stop strings (the output processor's, one place).

Decoding the whole output every step is quadratic; instead each sequence keeps two
offsets into its tokens and decodes only a short window (the classic prefix/read
offset scheme). A window that ends in an incomplete UTF-8 character (decoded as
U+FFFD) waits for the next token.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from llmserve.core.sampling_params import SamplingParams

# Prompt tokens the first window decodes against: enough for a tokenizer that merges
# across the prompt's end (a leading space, a split character).
PROMPT_CONTEXT = 5


def window_decoder(tokenizer):
    """``decode(ids, skip_special_tokens=...)`` for ``tokenizer`` (the keyword is
    required: the Rust decode's default is True, transformers' False): the Rust
    tokenizer's own decode where transformers' is only a wrapper around it (a fast
    tokenizer whose class keeps transformers' decode and that cleans up no spaces),
    else transformers'. The wrapper's Python costs about twice the Rust decode's time
    per call, and a token takes two calls on the engine thread between steps, where
    the model's threads wait."""
    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast)
            and cls.decode is PreTrainedTokenizerFast.decode
            # e.g. CPM's, CTC's: their own (transformers' class, read, not reached into)
            and cls._decode is PreTrainedTokenizerFast._decode  # noqa: SLF001
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return tokenizer.backend_tokenizer.decode
    return tokenizer.decode


class SequenceText:
    """One sequence's text as its tokens come. ``token_ids`` holds the prompt's last
    few tokens, then the output's."""

    __slots__ = ("params", "token_ids", "num_prompt_tokens", "text", "prefix_offset",
                 "read_offset", "stop_reason")

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams):
        self.params = params
        self.token_ids = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.num_prompt_tokens = len(self.token_ids)
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = self.num_prompt_tokens
        self.stop_reason: str | None = None  # the stop string that ended it

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode = window_decoder(tokenizer)

    def decode_new_text(self, seq: SequenceText) -> str:
        ids = seq.token_ids
        skip = seq.params.skip_special_tokens
        prefix = self._decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
        full = self._decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            seq.prefix_offset = seq.read_offset
            seq.read_offset = len(ids)
            return full[len(prefix):]
        return ""

    def update(self, seq: SequenceText, token_id: int, check_stop: bool = True) -> str | None:
        """Append ``token_id`` and its text; the stop string it completes (the text is
        cut there), if ``check_stop`` and min_tokens are out."""
        seq.token_ids.append(token_id)
        old_len = len(seq.text)
        seq.text += self.decode_new_text(seq)
        p = seq.params
        if not (check_stop and p.stop) or seq.num_output_tokens < p.min_tokens:
            return None
        return self._check_stop_strings(seq, old_len)

    @staticmethod
    def _check_stop_strings(seq: SequenceText, old_len: int) -> str | None:
        text = seq.text
        # Only a match that overlaps the new text can be new.
        tail_start = max(0, old_len - max(len(s) for s in seq.params.stop) + 1)
        for stop in seq.params.stop:
            at = text.find(stop, tail_start)
            if at >= 0:
                keep = at + len(stop) if seq.params.include_stop_str_in_output else at
                seq.text = text[:keep]
                seq.stop_reason = stop
                return stop
        return None
