"""The output processor's three kinds say the same thing: a request's deltas, joined,
are its cumulative output's last state, which is its one final output; with stop
strings too (held back while they could still begin one, cut where one ends, with or
without the stop string kept), whichever tokens the string spans. A streamed request
keeps only the tail of its text a stop string could still start in."""

from __future__ import annotations

import random

import pytest

from llmserve import SamplingParams
from llmserve.config import EngineConfig
from llmserve.core.sampling_params import RequestOutputKind
from llmserve.engine.llm_engine import LLMEngine

KINDS = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=8 << 20))
    yield engine
    engine.shutdown()


def run(engine: LLMEngine, prompt: list[int], kind: RequestOutputKind, **params):
    """Every output of one request, and the longest text its choice kept meanwhile."""
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=60, ignore_eos=True,
                        output_kind=kind, **params)
    req = engine.add_request(prompt, sp)
    outputs, kept = [], 0
    while engine.has_unfinished():
        outputs += engine.step()
        state = engine.outputs.requests.get(req.request_id)
        if state is not None:
            kept = max(kept, len(state.choices[0].text.text))
    return outputs, kept


def joined(outputs) -> tuple[str, list[int], str, object]:
    text = "".join(o.outputs[0].text for o in outputs)
    tokens = [t for o in outputs for t in o.outputs[0].token_ids]
    last = outputs[-1].outputs[0]
    return text, tokens, last.finish_reason, last.stop_reason


def final(outputs) -> tuple[str, list[int], str, object]:
    c = outputs[-1].outputs[0]
    return c.text, list(c.token_ids), c.finish_reason, c.stop_reason


def test_deltas_join_into_the_cumulative_output(engine):
    rng = random.Random(3)
    prompt = [rng.randrange(3, 40000) for _ in range(12)]
    reference, _ = run(engine, prompt, RequestOutputKind.CUMULATIVE)
    text = final(reference)[0]
    assert len(text) > 40
    cases = [{}]
    for at in (1, len(text) // 3, len(text) // 2, len(text) - 4):
        for length in (1, 3, 6):
            stop = text[at:at + length]
            if stop.strip():
                cases += [{"stop": [stop]}, {"stop": [stop, "never-there"],
                                             "include_stop_str_in_output": True}]
    for params in cases:
        by_kind = {kind: run(engine, prompt, kind, **params) for kind in KINDS}
        cumulative = final(by_kind[RequestOutputKind.CUMULATIVE][0])
        assert joined(by_kind[RequestOutputKind.DELTA][0]) == cumulative, params
        finals = by_kind[RequestOutputKind.FINAL_ONLY][0]
        assert len(finals) == 1 and final(finals) == cumulative, params
        if params.get("stop"):
            assert cumulative[2] == "stop" and cumulative[3] == params["stop"][0], params
    engine.block_manager.check_all_free()


def test_a_stream_keeps_only_the_tail_a_stop_string_could_start_in(engine):
    prompt = list(range(100, 112))
    stop = "zz-not-generated"
    cumulative, kept_cumulative = run(engine, prompt, RequestOutputKind.CUMULATIVE, stop=[stop])
    delta, kept_delta = run(engine, prompt, RequestOutputKind.DELTA, stop=[stop])
    assert joined(delta)[0] == final(cumulative)[0]
    # a token's text is a few characters: the stream keeps the tail and one token more
    assert kept_delta < len(stop) + 40 < kept_cumulative
