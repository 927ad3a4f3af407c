"""LLM.generate takes vLLM's prompt forms and says clearly what it does not take."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_cache_memory=8 << 20)


def test_text_and_token_prompt_dicts_match_the_plain_forms(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = llm.tokenizer.encode("The capital of France is")
    plain = llm.generate(["The capital of France is", ids], params)
    dicts = llm.generate([{"prompt": "The capital of France is"},
                          {"prompt_token_ids": ids}], params)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[1].prompt_token_ids == ids
    one = llm.generate({"prompt_token_ids": ids}, params)
    assert one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids


@pytest.mark.parametrize("bad", [
    {"text": "hi"},
    {"prompt": "hi", "multi_modal_data": {}},
    {"prompt_token_ids": ["a"]},
    [1.5, 2.0],
    42,
    [["nested", "list"]],
])
def test_other_prompt_types_are_a_value_error_naming_the_accepted_forms(llm, bad):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(bad, SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished()
