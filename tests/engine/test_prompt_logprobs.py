"""Prompt log-probabilities (vLLM's prompt_logprobs; OpenAI's echo with logprobs, the
request evaluation harnesses send): equal to transformers' log-softmax over the prompt,
also when the prompt is chunked or its prefix is already cached, offline and through a
real server with the official client."""

from __future__ import annotations

import openai
import pytest
import torch

from llmserve import LLM, SamplingParams
from tests.oracle import load_hf
from tests.server_proc import ServerProcess

TEXT = ("The capital of France is Paris. The capital of Germany is Berlin. The capital "
        "of Italy is Rome, and the capital of Spain is Madrid.")


@pytest.fixture(scope="module")
def offline(builtin_path):
    # An 8-token budget chunks every prompt here: rows of several steps are scored.
    return LLM(str(builtin_path), dtype="float32", max_num_batched_tokens=8,
               kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def oracle(builtin_path):
    return load_hf(builtin_path)


@torch.inference_mode()
def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Row i: transformers' log-softmax after ids[:i + 1]."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_matches(prompt_lps, ids, ref, num_top):
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for i, lp in enumerate(prompt_lps[1:], start=1):
        row = ref[i - 1]
        assert lp.token_id == ids[i]
        assert abs(lp.logprob - row[ids[i]].item()) < 1e-3, i
        assert lp.rank == int((row > row[ids[i]]).sum()) + 1
        top = row.topk(num_top) if num_top else None
        assert [t for t, _ in lp.top] == (top.indices.tolist() if top else [])


def test_offline_prompt_logprobs_equal_transformers_in_chunks(offline, oracle):
    ids = offline.tokenizer.encode(TEXT)
    assert len(ids) > 2 * 8  # three chunks at least
    out = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    assert_matches(out.prompt_logprobs, ids, hf_prompt_logprobs(oracle, ids), 3)


def test_a_cached_prefix_still_yields_its_prompt_logprobs(offline, oracle):
    ids = offline.tokenizer.encode(TEXT + " The capital of Portugal is")
    engine = offline.engine
    offline.generate([ids], SamplingParams(max_tokens=1))  # now the prefix is cached
    hits = engine.block_manager.prefix_hits
    offline.generate([ids], SamplingParams(max_tokens=1))
    assert engine.block_manager.prefix_hits > hits  # the cache does hold it
    out = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert_matches(out.prompt_logprobs, ids, hf_prompt_logprobs(oracle, ids), 0)
    engine.block_manager.check_all_free()


def test_prompt_logprobs_are_validated():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


# --- through the server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(builtin_path):
    proc = ServerProcess(str(builtin_path), host="127.0.0.48",
                         extra=["--served-model-name", "m", "--dtype", "float32"])
    yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    assert proc.stop() == 0


def test_echo_with_max_tokens_0_scores_the_prompt_only(client, offline, oracle):
    """lm-evaluation-harness's loglikelihood request."""
    ids = offline.tokenizer.encode(TEXT)
    r = client.completions.create(model="m", prompt=ids, echo=True, logprobs=1, max_tokens=0)
    choice, ref = r.choices[0], hf_prompt_logprobs(oracle, ids)
    assert choice.text == offline.tokenizer.decode(ids)
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lps = choice.logprobs
    assert lps.tokens == [offline.tokenizer.decode([t]) for t in ids]
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lps.token_logprobs[i] - ref[i - 1][ids[i]].item()) < 1e-3
        best = offline.tokenizer.decode([int(ref[i - 1].argmax())])
        assert best in lps.top_logprobs[i]  # the top alternative, and the token itself
        assert offline.tokenizer.decode([ids[i]]) in lps.top_logprobs[i]


def test_echo_puts_the_prompt_before_the_completion(client):
    plain = client.completions.create(model="m", prompt="Hello there", max_tokens=3,
                                      temperature=0, logprobs=0)
    r = client.completions.create(model="m", prompt="Hello there", max_tokens=3,
                                  temperature=0, logprobs=0, echo=True)
    c = r.choices[0]
    assert c.text == "Hello there" + plain.choices[0].text
    n_prompt = r.usage.prompt_tokens
    assert len(c.logprobs.token_logprobs) == n_prompt + 3
    assert c.logprobs.token_logprobs[n_prompt:] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert r.usage.completion_tokens == 3


def test_streamed_echo_sends_the_prompt_in_the_first_chunk(client):
    plain = client.completions.create(model="m", prompt="Hello there", max_tokens=4,
                                      temperature=0)
    chunks = list(client.completions.create(model="m", prompt="Hello there", max_tokens=4,
                                            temperature=0, echo=True, stream=True))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert chunks[0].choices[0].text.startswith("Hello there")
    assert text == "Hello there" + plain.choices[0].text


def test_vllm_prompt_logprobs_field(client, offline, oracle):
    ids = offline.tokenizer.encode("Paris is the capital of")
    r = client.completions.create(model="m", prompt=ids, max_tokens=1,
                                  extra_body={"prompt_logprobs": 2})
    body = r.choices[0].model_extra["prompt_logprobs"]
    ref = hf_prompt_logprobs(oracle, ids)
    assert body[0] is None and len(body) == len(ids)
    for i in range(1, len(ids)):
        entry = body[i][str(ids[i])]
        assert abs(entry["logprob"] - ref[i - 1][ids[i]].item()) < 1e-3
        assert entry["decoded_token"] == offline.tokenizer.decode([ids[i]])
        assert len(body[i]) <= 3  # the token and its top 2
    chat = client.chat.completions.create(model="m", max_tokens=1, messages=[
        {"role": "user", "content": "hi"}], extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
])
def test_bad_prompt_logprob_requests_are_400s_naming_the_field(client, body, field):
    create = (client.chat.completions.create if "messages" in body
              else client.completions.create)
    known = {k: v for k, v in body.items() if k not in ("prompt_logprobs", "echo")}
    extra = {k: v for k, v in body.items() if k in ("prompt_logprobs", "echo")}
    with pytest.raises(openai.BadRequestError) as e:
        create(model="m", **known, extra_body=extra)
    assert e.value.body["param"] == field
    assert client.completions.create(model="m", prompt="ok", max_tokens=1).choices


def test_rows_are_scored_a_slice_at_a_time(offline, oracle, monkeypatch):
    """More prompt rows in a step than one slice holds (a 5-row slice here; 256 in
    serving, bounding the float32 log-softmax a long chunk would otherwise need)."""
    import llmserve.worker.model_runner as model_runner
    monkeypatch.setattr(model_runner, "ROWS_PER_SLICE", 5)
    ids = offline.tokenizer.encode(TEXT)
    out = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert_matches(out.prompt_logprobs, ids, hf_prompt_logprobs(oracle, ids), 2)


def _assert_offsets_index_the_text(text: str, lps) -> None:
    assert len(lps.text_offset) == len(lps.tokens) and lps.text_offset[0] == 0
    for token, offset in zip(lps.tokens, lps.text_offset):
        assert text[offset:offset + len(token)] == token


def test_text_offset_indexes_each_token_in_the_text(client):
    """OpenAI's text_offset: where each token's text starts in the choice's text, with
    the echoed prompt, and the same whether streamed or not."""
    args = dict(model="m", prompt="The capital of France is", max_tokens=6, temperature=0,
                logprobs=1)
    plain = client.completions.create(**args).choices[0]
    _assert_offsets_index_the_text(plain.text, plain.logprobs)
    echoed = client.completions.create(echo=True, **args).choices[0]
    _assert_offsets_index_the_text(echoed.text, echoed.logprobs)
    chunks = [ch.choices[0] for ch in client.completions.create(stream=True, **args)
              if ch.choices and ch.choices[0].logprobs]
    assert [o for ch in chunks for o in ch.logprobs.text_offset] == plain.logprobs.text_offset
