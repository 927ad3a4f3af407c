"""Beam search: equal to transformers' generate(num_beams=W) on the built-in model in
float32 (with and without EOS, with a length penalty and early stopping), beams sharing
blocks copy-on-write, under both preemption modes and the prefix cache, aborted cleanly,
and through a real server with the official client."""

from __future__ import annotations

import openai
import pytest
import torch

from llmserve import LLM, BeamSearchParams, SamplingParams
from llmserve.core.beam_search import BeamSearch, Candidate
from llmserve.core.block_manager import BlockManager
from llmserve.core.request import Request
from llmserve.entrypoints.llm import render_chat
from tests.oracle import load_hf
from tests.server_proc import ServerProcess

QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def llm(builtin_path):
    return LLM(str(builtin_path), dtype="float32", kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def oracle(builtin_path):
    return load_hf(builtin_path)


@pytest.fixture(scope="module")
def prompt(llm) -> list[int]:
    text = render_chat(llm.tokenizer, [{"role": "user", "content": QUESTION}])
    return llm.tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def hf_beams(model, ids, eos, params: BeamSearchParams):
    """transformers' hypotheses, best first: (generated tokens, score)."""
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        num_beams=params.beam_width, num_return_sequences=params.beam_width, do_sample=False,
        max_new_tokens=params.max_tokens, eos_token_id=eos, pad_token_id=0,
        length_penalty=params.length_penalty, early_stopping=params.early_stopping,
        output_scores=True, return_dict_in_generate=True)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(out.sequences[k, len(ids):len(ids) + n].tolist(), float(out.sequences_scores[k]))
            for k, n in enumerate(lengths)]


def assert_equal_to_transformers(llm, oracle, prompts, params):
    eos = None if params.ignore_eos else sorted(llm.engine.eos_token_ids)
    outs = llm.beam_search(prompts, params)
    for ids, out in zip(prompts, outs):
        ref = hf_beams(oracle, ids, eos, params)
        assert len(out.sequences) == params.beam_width
        for seq, (tokens, score) in zip(out.sequences, ref):
            assert seq.output_token_ids == tokens
            assert seq.tokens[:len(ids)] == ids
            ours = seq.cum_logprob / len(tokens) ** params.length_penalty
            assert abs(ours - score) < 1e-3
            assert seq.finish_reason == ("stop" if tokens[-1] in (eos or ()) else "length")
    llm.engine.block_manager.check_all_free()
    return outs


def test_equals_transformers_with_eos(llm, oracle, prompt):
    outs = assert_equal_to_transformers(llm, oracle, [prompt],
                                        BeamSearchParams(beam_width=4, max_tokens=12))
    best = outs[0].sequences[0]
    assert best.finish_reason == "stop" and "Paris" in best.text  # EOS did end a beam


def test_equals_transformers_without_eos_two_prompts_at_once(llm, oracle, prompt):
    other = llm.tokenizer.encode("The cache block is")
    assert_equal_to_transformers(llm, oracle, [prompt, other],
                                 BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))


@pytest.mark.parametrize("length_penalty, early_stopping", [(2.0, True), (0.5, "never")])
def test_equals_transformers_with_length_penalty(llm, oracle, prompt, length_penalty,
                                                 early_stopping):
    assert_equal_to_transformers(llm, oracle, [prompt], BeamSearchParams(
        beam_width=4, max_tokens=10, length_penalty=length_penalty,
        early_stopping=early_stopping))


# --- memory -----------------------------------------------------------------------------------
def peak_blocks(engine, add) -> int:
    """Most KV blocks held at once while ``add()``'s requests run."""
    add()
    peak = 0
    while engine.has_unfinished():
        engine.step()
        bm = engine.block_manager
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
    engine.block_manager.check_all_free()
    return peak


def test_eight_beams_share_blocks(builtin_path):
    llm = LLM(str(builtin_path), kv_cache_memory=64 << 20, enable_prefix_caching=False)
    ids = llm.tokenizer.encode("the cache block " * 30)[:100]
    engine, width, tokens = llm.engine, 8, 16
    beams = peak_blocks(engine, lambda: engine.add_request(ids, SamplingParams(
        n=width, max_tokens=tokens, beam=BeamSearchParams(width, tokens, ignore_eos=True))))
    independent = peak_blocks(engine, lambda: [engine.add_request(ids, SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True)) for _ in range(width)])
    per_seq = -(-(len(ids) + tokens) // 16)
    assert independent == width * per_seq
    # The prompt's 6 full blocks once, then each beam's own: its copied partial block
    # and the blocks it grows into.
    assert beams <= len(ids) // 16 + width * (per_seq - len(ids) // 16)
    assert beams < independent / 2


def test_a_fork_copies_at_most_its_partial_last_block():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    for prompt_len, copies in ((6, 1), (8, 0)):  # partial last block, then a full one
        req = Request("r", None, list(range(prompt_len)), SamplingParams(n=2))
        parent, child = req.sequences
        bm.allocate(parent, prompt_len)
        parent.num_computed_tokens = prompt_len
        bm.fork(parent, child)
        free = bm.num_free_blocks
        for seq in (parent, child):
            seq.append_token(1)
            bm.allocate(seq, seq.num_tokens)
        ops = bm.take_ops()
        assert sum(op.kind == "copy" for op in ops) == copies
        assert free - bm.num_free_blocks == copies + 2 * (1 - copies)
        bm.free(parent), bm.free(child)
        bm.check_all_free()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_beams_give_the_same_hypotheses(builtin_path, llm, prompt, mode):
    params = BeamSearchParams(beam_width=4, max_tokens=12)
    want = [(s.tokens, s.cum_logprob) for s in llm.beam_search([prompt], params)[0].sequences]
    block_bytes = llm.engine.runner.kv_bytes_per_block()
    small = LLM(str(builtin_path), dtype="float32", kv_cache_memory=5 * block_bytes,
                preemption_mode=mode, swap_space=64 << 20)
    got = small.beam_search([prompt], params)[0].sequences
    sched = small.engine.scheduler
    assert sched.num_preemptions > 0  # the cache was too small for 4 beams
    assert (sched.num_swapped_out > 0) == (mode == "swap")
    assert [s.tokens for s in got] == [t for t, _ in want]
    assert [s.cum_logprob for s in got] == pytest.approx([c for _, c in want], abs=1e-3)
    small.engine.block_manager.check_all_free()


def test_a_cached_prefix_and_an_abort(llm, prompt):
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    first = llm.beam_search([prompt], params)[0].sequences
    bm = llm.engine.block_manager
    hits = bm.prefix_hits
    again = llm.beam_search([prompt], params)[0].sequences
    assert bm.prefix_hits > hits
    assert [s.tokens for s in again] == [s.tokens for s in first]
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(n=4, max_tokens=8, beam=params), "to-abort")
    for _ in range(4):
        engine.step()
    assert engine.abort("to-abort")
    bm.check_all_free()


def test_the_search_itself():
    """One step by hand: a beam chosen twice forks, an EOS in the top W finishes."""
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=5), frozenset({9}))
    search.start(0)
    search.offer(0, [(9, -0.1), (4, -0.5), (5, -0.7), (6, -3.0)])
    assert search.ready and search.num_candidates == 4
    beams = search.select()
    assert [(c.token_id, c.cum_logprob) for c in beams] == [(4, -0.5), (5, -0.7)]
    assert [h.token_ids for h in search.hypotheses] == [[9]] and not search.done
    search.advance([(0, beams[0]), (1, beams[1])])
    assert search.tokens == {0: [4], 1: [5]}
    search.offer(0, [(7, -1.0), (8, -2.0)])
    assert not search.ready  # beam 1 has not offered yet
    search.offer(1, [(9, -0.1), (3, -4.0)])
    beams = search.select()
    assert [(c.parent, c.token_id) for c in beams] == [(0, 7), (0, 8)]
    assert isinstance(beams[0], Candidate)
    assert [h.token_ids for h in search.hypotheses] == [[9], [5, 9]]
    assert search.done  # two hypotheses in, and no live beam can beat -0.4 any more


@pytest.mark.parametrize("bad", [dict(beam_width=0), dict(beam_width=17), dict(max_tokens=0),
                                 dict(early_stopping="sometimes"), dict(temperature=-1)])
def test_bad_params(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})


# --- through the server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(builtin_path):
    proc = ServerProcess(str(builtin_path), host="127.0.0.49",
                         extra=["--served-model-name", "m", "--dtype", "float32"])
    yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
    assert proc.stop() == 0


def test_server_beam_search_equals_offline(client, llm, prompt):
    want = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10,
                                                      length_penalty=0.5))[0].sequences
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTION}], n=3, max_tokens=10,
        extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [
        llm.tokenizer.decode(s.output_token_ids, skip_special_tokens=True) for s in want]
    assert [c.finish_reason for c in r.choices] == [s.finish_reason for s in want]
    assert r.usage.completion_tokens == sum(len(s.output_token_ids) for s in want)
    c = client.completions.create(model="m", prompt=prompt, n=2, max_tokens=6,
                                  extra_body={"use_beam_search": True})
    assert len(c.choices) == 2 and c.choices[0].text != c.choices[1].text


@pytest.mark.parametrize("extra, field", [
    ({"stream": True}, "stream"), ({"logprobs": 0}, "logprobs"), ({"top_p": 0.5}, "top_p"),
    ({"stop": ["x"]}, "stop"), ({"n": 17}, "n"), ({"early_stopping": "soon"}, "early_stopping"),
    ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
])
def test_bad_beam_requests_are_400s_naming_the_field(client, extra, field):
    body = {"use_beam_search": True, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", max_tokens=3, extra_body=body)
    assert e.value.body["param"] == field
    assert client.completions.create(model="m", prompt="ok", max_tokens=1).choices
