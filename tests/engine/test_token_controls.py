"""Token controls (logit_bias, allowed_token_ids, bad_words): through a real server and the
official client, checked token by token against the offline engine, and their 400s."""

from __future__ import annotations

import openai
import pytest

from llmserve import LLM, SamplingParams
from llmserve.core.sampling_params import ParamError
from llmserve.engine.bad_words import bad_words_token_ids
from tests.server_proc import ServerProcess

PROMPT = "the cache block"
VOCAB = 49152  # the tiny checkpoint's (conftest)


@pytest.fixture(scope="module")
def client(tiny_llama):
    proc = ServerProcess(str(tiny_llama), host="127.0.0.47",
                         extra=["--served-model-name", "tiny"])
    yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory=64 << 20)


def greedy(offline, **controls) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=10, **controls)
    return offline.generate([PROMPT], params)[0].outputs[0].token_ids


def complete(client, **kw) -> openai.types.Completion:
    return client.completions.create(**{"model": "tiny", "prompt": PROMPT, "max_tokens": 10,
                                        "temperature": 0, **kw})


# --- logit_bias -----------------------------------------------------------------------------
def test_plus_100_forces_the_token(client, offline):
    forced = offline.tokenizer.encode(" cache")[0]
    assert forced not in greedy(offline)
    r = complete(client, logit_bias={str(forced): 100})
    assert r.choices[0].text == offline.tokenizer.decode([forced] * 10)


def test_minus_100_on_the_greedy_token_changes_the_output(client, offline):
    base = greedy(offline)
    biased = greedy(offline, logit_bias={base[0]: -100})
    assert biased[0] != base[0]
    text = complete(client, logit_bias={str(base[0]): -100}).choices[0].text
    assert text == offline.tokenizer.decode(biased) != complete(client).choices[0].text


def test_a_small_bias_on_chat_is_the_offline_result(client, offline):
    msgs = [{"role": "user", "content": "hi"}]
    bias = {offline.tokenizer.encode(" cache")[0]: 5.0}
    ref = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=8, logit_bias=bias))
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                       temperature=0,
                                       logit_bias={str(k): v for k, v in bias.items()})
    assert r.choices[0].message.content == ref[0].outputs[0].text


# --- allowed_token_ids ----------------------------------------------------------------------
def test_allowed_token_ids_restrict_every_sampled_token(client, offline):
    tok = offline.tokenizer
    allowed = [tok.encode(w)[0] for w in (" the", " a", " cache", " block")]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=allowed)
    ids = offline.generate([PROMPT], params)[0].outputs[0].token_ids
    assert len(ids) == 12 and set(ids) <= set(allowed)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                  seed=3, logprobs=0, extra_body={"allowed_token_ids": allowed})
    assert set(r.choices[0].logprobs.tokens) <= {tok.decode([t]) for t in allowed}
    assert r.choices[0].text == tok.decode(ids)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, logprobs=True, extra_body={"allowed_token_ids": allowed})
    assert {t.token for t in chat.choices[0].logprobs.content} <= \
        {tok.decode([t]) for t in allowed}


# --- bad_words ------------------------------------------------------------------------------
def _words(offline, base: list[int], length: int) -> tuple[int, str]:
    """The first position of the greedy output where ``length`` tokens spell a word that
    bans exactly those tokens, and that word."""
    tok = offline.tokenizer
    for i in range(len(base) - length + 1):
        word = tok.decode(base[i:i + length])
        if base[i:i + length] in bad_words_token_ids([word], tok, VOCAB):
            return i, word
    raise AssertionError(f"no {length}-token word in {base}")


def test_a_single_token_bad_word_is_never_generated(client, offline):
    base = greedy(offline)
    i, word = _words(offline, base, 1)
    ids = greedy(offline, bad_words=[word])
    assert ids[:i] == base[:i] and base[i] not in ids
    text = complete(client, extra_body={"bad_words": [word]}).choices[0].text
    assert word in complete(client).choices[0].text and word not in text
    assert text == offline.tokenizer.decode(ids)


def test_a_multi_token_bad_word_bans_its_last_token_after_the_others(client, offline):
    base = greedy(offline)
    i, word = _words(offline, base, 2)
    ids = greedy(offline, bad_words=[word])
    assert ids[:i + 1] == base[:i + 1] and ids[i + 1] != base[i + 1]
    assert all(ids[j:j + 2] != base[i:i + 2] for j in range(len(ids) - 1))
    text = complete(client, extra_body={"bad_words": [word]}).choices[0].text
    assert text == offline.tokenizer.decode(ids)


# --- 400s naming the field; the server keeps serving ---------------------------------------
@pytest.mark.parametrize("body,param,needle", [
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias", "vocabulary"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"five": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": "1"}}, "logit_bias", "number"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids", "vocabulary"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids", "non-negative"),
    # min_tokens indexes the logits with the stop ids: one past the vocabulary was a 500
    ({"stop_token_ids": [VOCAB], "min_tokens": 1}, "stop_token_ids", "vocabulary"),
    ({"bad_words": [" "]}, "bad_words", "blank"),
    ({"bad_words": "word"}, "bad_words", "array"),
])
def test_bad_token_controls_are_400s_naming_the_field(client, body, param, needle):
    for create in (lambda: complete(client, extra_body=body),
                   lambda: client.chat.completions.create(
                       model="tiny", messages=[{"role": "user", "content": "hi"}],
                       max_tokens=2, extra_body=body)):
        with pytest.raises(openai.BadRequestError) as e:
            create()
        err = e.value.body
        assert err["param"] == param and needle in err["message"], err
    assert complete(client, max_tokens=2).usage.completion_tokens >= 1


# --- the offline API ------------------------------------------------------------------------
@pytest.mark.parametrize("controls,field", [
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: True}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": (1, 2)}, "allowed_token_ids"),
    ({"bad_words": ["ok", ""]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
])
def test_sampling_params_reject_bad_controls(controls, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**controls)


@pytest.mark.parametrize("controls,field", [
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [1, VOCAB]}, "allowed_token_ids"),
    ({"stop_token_ids": [VOCAB], "min_tokens": 1}, "stop_token_ids"),
])
def test_the_engine_rejects_ids_outside_the_vocabulary(offline, controls, field):
    with pytest.raises(ParamError, match="vocabulary") as e:
        offline.generate([PROMPT], SamplingParams(max_tokens=2, **controls))
    assert e.value.param == field
    assert len(greedy(offline)) == 10
