"""Incremental detokenisation: each token's new text, summed over a sequence, is the
tokenizer's decode of the whole output, whichever decode the engine calls."""

from __future__ import annotations

import copy
import random

import pytest

from llmserve import SamplingParams
from llmserve.engine.detokenizer import Detokenizer, SequenceText, window_decoder
from llmserve.model_executor.model_loader.sources import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(builtin_path):
    return load_tokenizer(builtin_path)


def streamed_texts(detok: Detokenizer, prompt: list[int], output: list[int],
                   skip: bool) -> list[str]:
    """The sequence's text after each output token."""
    params = SamplingParams(max_tokens=len(output), skip_special_tokens=skip,
                            ignore_eos=True)
    seq = SequenceText(prompt, params)
    texts = []
    for token in output:
        detok.update(seq, token)
        texts.append(seq.text)
    return texts


def test_the_builtin_tokenizer_decodes_windows_in_rust(tokenizer):
    """A fast tokenizer that cleans up no spaces: its Rust decode, with no wrapper."""
    assert window_decoder(tokenizer) == tokenizer.backend_tokenizer.decode


def test_streamed_text_is_the_text_decoded(tokenizer):
    """Multi-byte characters split over several byte-level tokens, after a prompt and
    without one: the text streamed token by token is the text."""
    text = "Naïve café — 日本語 and emoji 🙂🚀; done."
    output = tokenizer.encode(text, add_special_tokens=False)
    for prompt in ([], tokenizer.encode("Say it:", add_special_tokens=False)):
        assert streamed_texts(Detokenizer(tokenizer), prompt, output, True)[-1] == text


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_decode_streams_what_transformers_decode_does(tokenizer, skip):
    """Random ids (invalid UTF-8 runs among them) and special tokens: after every token,
    the same text as with transformers' decode."""
    rng = random.Random(7)
    special = sorted(tokenizer.all_special_ids)
    reference = Detokenizer(tokenizer)
    reference._decode = tokenizer.decode
    for trial in range(30):
        prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(0, 12))]
        output = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(0, 49152)
                  for _ in range(rng.randint(1, 40))]
        assert (streamed_texts(Detokenizer(tokenizer), prompt, output, skip)
                == streamed_texts(reference, prompt, output, skip)), trial


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(tokenizer):
    """transformers' decode also cleans up spaces where the tokenizer asks: the wrapper
    stays for those."""
    before = tokenizer.clean_up_tokenization_spaces
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert window_decoder(tokenizer) == tokenizer.decode
    finally:
        tokenizer.clean_up_tokenization_spaces = before


def test_a_tokenizer_class_with_its_own_decode_keeps_it(tokenizer):
    """A class that changes the text in its decode (CPM's spaces, CTC's merged
    repeats): the engine streams what that decode gives."""
    class Shouting(type(tokenizer)):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    assert window_decoder(shouting) == shouting.decode
    output = tokenizer.encode("Quiet words, then café.", add_special_tokens=False)
    text = streamed_texts(Detokenizer(shouting), [], output, True)[-1]
    assert text == "QUIET WORDS, THEN CAFÉ."
