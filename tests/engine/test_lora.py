"""Multi-LoRA serving against transformers+peft: several adapters and the base model in
one batch, adapters given at start-up and loaded at run time, refused adapters, tensor
parallelism and the int4 base.

Adapters are random PEFT adapters (tests/lora_adapters.py): their B is not zero, so an
adapter that was ignored, or another adapter's weights applied to a row, changes the
greedy tokens and fails the comparison.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import openai
import pytest
import torch

from llmserve import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import peft_greedy, write_peft_adapter
from tests.oracle import GREEDY_TOKENS, compare_greedy, random_prompts
from tests.server_proc import ServerProcess, scrape

GREEDY = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
PROMPTS = random_prompts(3, [5, 17, 33, 9, 21, 40])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "a1": write_peft_adapter(tiny_llama, root / "a1", rank=8, seed=1),
        "a2": write_peft_adapter(tiny_llama, root / "a2", rank=16, seed=2,
                                 targets=("q_proj", "v_proj", "down_proj")),
        # rsLoRA's alpha / sqrt(r), and the modules a2 leaves out
        "rs": write_peft_adapter(tiny_llama, root / "rs", rank=4, seed=3, use_rslora=True,
                                 targets=("k_proj", "o_proj", "gate_proj", "up_proj")),
    }


def lora(adapters, name: str | None, int_id: int = 0) -> LoRARequest | None:
    if name is None:
        return None
    return LoRARequest(name, int_id or 1 + sorted(adapters).index(name), str(adapters[name]))


def assert_matches_peft(base: Path, adapters, names, prompts, outputs) -> None:
    """Each output's greedy tokens equal transformers+peft's under its adapter (at most
    one divergence, at a near-tie)."""
    verdicts = []
    for name, prompt, tokens in zip(names, prompts, outputs):
        ref = peft_greedy(base, adapters[name] if name else None, [prompt])[0]
        verdicts.append(compare_greedy(tokens, ref))
    assert verdicts.count("tie") <= 1, verdicts


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_loras=4,
                 max_lora_rank=16, kv_cache_memory=8 << 20)
    yield engine
    engine.shutdown()


def test_a_mixed_batch_of_adapters_and_the_base_model_matches_peft(llm, tiny_llama, adapters):
    names = [None, "a1", "a2", "rs", "a1", None]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[lora(adapters, n) for n in names])
    tokens = [o.outputs[0].token_ids for o in outs]
    assert_matches_peft(tiny_llama, adapters, names, PROMPTS, tokens)
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    changed = [t != b for t, b, n in zip(tokens, base, names) if n]
    assert all(changed), "an adapter left the base model's tokens unchanged"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_the_triton_lora_kernels_serve_a_mixed_batch_as_peft_does(tiny_llama, adapters):
    """The CUDA path (Triton attention and the SGMV shrink/expand kernels, under the
    interpreter here): slots at the fixed rank stride, one launch for every adapter."""
    names = ["rs", None, "a1", "a2"]
    with LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_lora_rank=16,
             attention_backend="triton", kv_cache_memory=8 << 20) as engine:
        assert engine.engine.runner.lora.state.use_triton
        outs = engine.generate(PROMPTS[:4], GREEDY,
                               lora_request=[lora(adapters, n) for n in names])
    assert_matches_peft(tiny_llama, adapters, names, PROMPTS[:4],
                        [o.outputs[0].token_ids for o in outs])


@pytest.mark.parametrize("lengths, slots", [
    ([1] * 8, [0, 0, 1, 1, 2, 2, 3, 3]),  # decodes laid out by adapter: one block, in place
    ([1, 3, 1, 2, 1], [2, 0, -1, 2, 1]),  # small groups of unequal size: gathered, padded
    ([40, 1, 25, 1, 1], [1, 1, -1, 3, 1]),  # a long group whose rows are not contiguous
    ([20, 20, 20], [3, 0, 2]),  # equal prefill chunks back to back: one block
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_lora_kernel_equals_the_reference(lengths, slots, dtype):
    """kernels/cpu/lora.py against the segment-by-segment reference (the Triton
    kernels' own), with three slices of different widths and slots of different ranks."""
    from llmserve.kernels.cpu.lora import CPULoRAPlan, lora_add
    from llmserve.kernels.triton.lora import lora_expand_reference, lora_shrink_reference
    torch.manual_seed(len(lengths))
    big_r, outs, k, ranks = 8, [24, 8, 8], 32, [8, 4, 2, 6]
    a = torch.zeros(4, 3 * big_r, k)
    b = [torch.zeros(4, o, big_r) for o in outs]
    for slot, r in enumerate(ranks):  # each slot's rank, zero past it (as set_slot does)
        for i in range(3):
            a[slot, i * big_r:i * big_r + r] = torch.randn(r, k)
            b[i][slot, :, :r] = torch.randn(outs[i], r)
    a, b = a.to(dtype), [bi.to(dtype) for bi in b]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    x = torch.randn(starts[-1], k).to(dtype)
    y = torch.randn(starts[-1], sum(outs)).to(dtype)
    seg_starts, seg_slots = torch.tensor(starts), torch.tensor(slots)
    want = y.clone()
    xa = lora_shrink_reference(x, a, seg_starts, seg_slots, max(lengths))
    for i, (bi, offset) in enumerate(zip(b, [0, 24, 32])):
        lora_expand_reference(want, xa, bi, seg_starts, seg_slots, max(lengths),
                              i * big_r, offset)
    groups: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        if slot >= 0:
            groups.setdefault(slot, []).extend(range(starts[i], starts[i + 1]))
    got = y.clone()
    lora_add(got, x, a, b, CPULoRAPlan.build(groups, ranks), cache={})
    base_rows = [r for i, s in enumerate(slots) if s < 0 for r in range(starts[i], starts[i + 1])]
    assert torch.equal(got[base_rows], y[base_rows])  # the base model's rows untouched
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 10)


def test_one_slot_chunked_prefill_and_the_prefix_cache_keep_adapters_apart(tiny_llama,
                                                                          adapters):
    """One slot for three adapters (they take turns, evicting each other), prompts in
    16-token chunks, and the same prompt under each adapter and the base model: a prefix
    hit across adapters would hand one adapter another's KV."""
    engine = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_loras=1,
                 max_lora_rank=16, max_num_batched_tokens=16, kv_cache_memory=8 << 20)
    try:
        prompt = PROMPTS[-1]  # 40 tokens: two full blocks to hit
        names = [None, "a1", "a2", "rs", "a1", None]
        outs = engine.generate([prompt] * len(names), GREEDY,
                               lora_request=[lora(adapters, n) for n in names])
        tokens = [o.outputs[0].token_ids for o in outs]
        assert_matches_peft(tiny_llama, adapters, names, [prompt] * len(names), tokens)
        assert tokens[1] == tokens[4] and tokens[0] == tokens[5]
        again = engine.generate([prompt], GREEDY, lora_request=lora(adapters, "a2"))
        assert again[0].outputs[0].token_ids == tokens[2]
        assert engine.engine.block_manager.prefix_hits > 0  # the cache did serve same-adapter hits
    finally:
        engine.shutdown()


def test_an_adapter_unloaded_and_replaced_mid_request_keeps_serving_its_request(llm,
                                                                               adapters):
    """The name is unregistered, then registered again from another adapter, while a
    request under the first one is half way: it finishes as if nothing happened (even
    with its weights dropped from host memory), and a new request gets the new one."""
    engine, registry = llm.engine, llm.engine.loras
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first, _ = registry.register("mid", str(adapters["a2"]), registry.parse(str(adapters["a2"])))
    want = llm.generate([PROMPTS[2]], params, lora_request=first)[0].outputs[0].token_ids
    old = engine.add_request(PROMPTS[2], params.copy(), lora_request=first)
    for _ in range(6):
        engine.step()
    assert 0 < old.sequences[0].num_output_tokens < 24
    assert registry.unregister("mid") == first
    engine.runner.lora.cache.drop(first.lora_int_id)
    second, new = registry.register("mid", str(adapters["rs"]), registry.parse(str(adapters["rs"])))
    assert new and second.lora_int_id != first.lora_int_id
    fresh = engine.add_request(PROMPTS[2], params.copy(), lora_request=registry.lookup("mid"))
    while engine.has_unfinished():
        engine.step()
    assert old.sequences[0].token_ids[len(PROMPTS[2]):] == want
    assert fresh.sequences[0].token_ids[len(PROMPTS[2]):] != want
    registry.unregister("mid")


def _edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def bad_adapters(tmp_path_factory, tiny_llama, tiny_models) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    return {
        "rank 32 .* exceeds --max-lora-rank 16":
            write_peft_adapter(tiny_llama, root / "rank", rank=32),
        "belongs to another base model":
            write_peft_adapter(tiny_models["llama3"], root / "other", rank=4),
        "does not exist": root / "missing",
        "target module 'lm_head' is not supported":
            write_peft_adapter(tiny_llama, root / "head", rank=4, targets=("lm_head",)),
        "DoRA": _edit_config(write_peft_adapter(tiny_llama, root / "dora", rank=4),
                             use_dora=True),
        "no adapter_config.json": Path(tiny_llama),  # a model, not an adapter
        "not a JSON object": _write_config(root / "list", []),
        "lora_alpha must be a positive number": _edit_config(
            write_peft_adapter(tiny_llama, root / "alpha", rank=4), lora_alpha="16"),
        "LoRA biases": _edit_config(write_peft_adapter(tiny_llama, root / "bias", rank=4),
                                    lora_bias=True),
    }


def _write_config(path: Path, config) -> Path:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_bad_adapters_are_refused_with_the_reason_and_change_nothing(llm, bad_adapters):
    bm = llm.engine.block_manager
    for i, (reason, path) in enumerate(bad_adapters.items()):
        with pytest.raises(ValueError, match=reason):
            llm.generate(PROMPTS[:2], GREEDY, lora_request=LoRARequest("bad", 90 + i, str(path)))
        assert not llm.engine.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks
    assert llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids


def test_an_adapter_id_names_one_source_and_salts_cannot_be_forged(llm, adapters):
    with pytest.raises(ValueError, match="already names the adapter"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=[
            LoRARequest("x", 1, str(adapters["a2"]))])  # id 1 is a1's (lora())
    # A client's own salt cannot be an adapter's: KV under a1 stays a1's.
    with pytest.raises(ValueError, match="NUL"):
        llm.engine.add_request(PROMPTS[0], GREEDY, cache_salt="\x00lora:1\x00")
    assert not llm.engine.has_unfinished()


def test_an_adapter_without_a_slot_holds_back_later_adapters_but_not_the_base_model(
        tiny_llama, adapters):
    """One slot, held by a long a1 request: an urgent a2 request waits for it, the base
    model's requests do not wait behind a2, and a later a1 request does not overtake a2
    (it would keep a1's slot busy for ever)."""
    with LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_loras=1,
             max_lora_rank=16, kv_cache_memory=8 << 20,
             scheduling_policy="priority") as engine:
        e = engine.engine

        def add(prompt, max_tokens, name, priority):
            return e.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                        ignore_eos=True),
                                 lora_request=lora(adapters, name), priority=priority)
        long = add(PROMPTS[0], 40, "a1", 5)
        e.step()
        reqs = {"a2": add(PROMPTS[1], 4, "a2", 0), "base": add(PROMPTS[2], 4, None, 0),
                "a1 later": add(PROMPTS[3], 4, "a1", 1)}
        first: dict[str, int] = {}
        step = 1
        while e.has_unfinished():
            e.step()
            step += 1
            for name, req in [*reqs.items(), ("a1 long", long)]:
                if name not in first and req.sequences[0].num_output_tokens:
                    first[name] = step
    assert first["base"] == first["a1 long"] == 2, first
    assert first["a2"] > 30 and first["a1 later"] > first["a2"], first


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        LLM("smollm2-135m-instruct", lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="expected NAME=SOURCE"):
        LLM("smollm2-135m-instruct", enable_lora=True, lora_modules=["nosource"])
    with pytest.raises(ValueError, match="max_cpu_loras .* must be >= max_loras"):
        LLM("smollm2-135m-instruct", enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="--compile"):
        LLM("smollm2-135m-instruct", enable_lora=True, compile=True)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        with LLM("smollm2-135m-instruct", kv_cache_memory=8 << 20) as plain:
            plain.generate(["hi"], GREEDY, lora_request=LoRARequest("x", 1, "/nowhere"))


# --- over HTTP, with the openai client ---------------------------------------------------
def _completion(client: openai.OpenAI, model: str, prompt: list[int]) -> list[str]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=GREEDY_TOKENS,
                                    temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    return out.choices[0].logprobs.tokens


def assert_texts_match_peft(tokenizer, base: Path, adapters, names, prompts, texts) -> None:
    """``texts``: each answer's tokens as the API shows them (one string per token);
    the position of each that shows peft's token there gets its id, any other -1."""
    ids = []
    for name, prompt, shown in zip(names, prompts, texts):
        ref = peft_greedy(base, adapters[name] if name else None, [prompt])[0]
        ids.append([t if tokenizer.decode([t]) == s else -1 for t, s in zip(ref.tokens, shown)]
                   + [-1] * (len(shown) - len(ref.tokens)))
    assert_matches_peft(base, adapters, names, prompts, ids)


def test_http_adapters_from_the_start_and_loaded_at_run_time_serve_concurrently(
        tiny_llama, adapters, bad_adapters):
    proc = ServerProcess(str(tiny_llama), host="127.0.0.131", extra=[
        "--served-model-name", "tiny", "--dtype", "float32", "--enable-lora",
        "--max-lora-rank", "16", "--lora-modules", f"a1={adapters['a1']}",
        "--api-key", "k"])
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="k")
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"tiny", "a1"}
        assert listed["a1"].parent == "tiny" and listed["a1"].root == str(adapters["a1"])

        # Loaded at run time; again from the same source is fine, from another is not.
        http = client._client
        headers = {"Authorization": "Bearer k"}
        load = {"lora_name": "a2", "lora_path": f"file://{adapters['a2']}"}
        assert http.post(proc.url + "/v1/load_lora_adapter", json=load, headers=headers
                         ).status_code == 200
        assert http.post(proc.url + "/v1/load_lora_adapter", json=load, headers=headers
                         ).status_code == 200
        clash = http.post(proc.url + "/v1/load_lora_adapter", headers=headers,
                          json={"lora_name": "a2", "lora_path": str(adapters["rs"])})
        assert clash.status_code == 400 and "already loaded" in clash.json()["error"]["message"]
        assert http.post(proc.url + "/v1/load_lora_adapter", json=load).status_code == 401

        # A bad adapter: a 400 naming the problem, and the engine keeps serving.
        for reason, path in bad_adapters.items():
            bad = http.post(proc.url + "/v1/load_lora_adapter", headers=headers,
                            json={"lora_name": "bad", "lora_path": str(path)})
            assert bad.status_code == 400, bad.text
            error = bad.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert __import__("re").search(reason, error["message"]), error["message"]

        names = ["tiny", "a1", "a2", "a1", "tiny", "a2"]
        aclient = openai.AsyncOpenAI(base_url=proc.url + "/v1", api_key="k")

        async def all_at_once():
            async def one(model, prompt):
                out = await aclient.completions.create(
                    model=model, prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0,
                    logprobs=1, extra_body={"ignore_eos": True})
                assert out.model == model
                return out.choices[0].logprobs.tokens
            return await asyncio.gather(*(one(m, p) for m, p in zip(names, PROMPTS)))
        tokens = asyncio.run(all_at_once())
        info = [k for k in scrape(proc.url) if k.startswith("vllm:lora_requests_info{")]
        assert len(info) == 1 and 'max_lora="4"' in info[0], info
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
        assert_texts_match_peft(tokenizer, tiny_llama, adapters,
                                [None if n == "tiny" else n for n in names], PROMPTS, tokens)

        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="nope", prompt="hi", max_tokens=2)
        assert missing.value.body["code"] == "model_not_found"
        assert "'a1'" in missing.value.body["message"]  # it names what it does serve

        # Unloaded mid-stream, and the name loaded again from another adapter: the
        # stream finishes with the adapter it started with.
        def text(**extra):
            return client.completions.create(model="a2", prompt=PROMPTS[2], max_tokens=40,
                                             temperature=0, extra_body={"ignore_eos": True},
                                             **extra)
        whole = text().choices[0].text
        stream = text(stream=True)
        parts = [next(iter(stream)).choices[0].text]
        assert http.post(proc.url + "/v1/unload_lora_adapter", headers=headers,
                         json={"lora_name": "a2"}).status_code == 200
        assert http.post(proc.url + "/v1/load_lora_adapter", headers=headers, json={
            "lora_name": "a2", "lora_path": str(adapters["rs"])}).status_code == 200
        parts += [chunk.choices[0].text for chunk in stream]
        assert "".join(parts) == whole
        assert text().choices[0].text != whole  # the new "a2" is another adapter

        # Unloaded: gone from /v1/models and a 404; unloading again is a 404 too.
        assert http.post(proc.url + "/v1/unload_lora_adapter", headers=headers,
                         json={"lora_name": "a2"}).status_code == 200
        assert {m.id for m in client.models.list().data} == {"tiny", "a1"}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="a2", prompt="hi", max_tokens=2)
        again = http.post(proc.url + "/v1/unload_lora_adapter", headers=headers,
                          json={"lora_name": "a2"})
        assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
        assert _completion(client, "a1", PROMPTS[1]) == tokens[1]
    finally:
        assert proc.stop() == 0


def test_http_an_adapter_whose_source_vanished_is_a_400_and_the_engine_lives(
        tiny_llama, adapters, tmp_path):
    """Its weights left host memory (one cached adapter, and another was loaded since),
    then its directory was deleted: its requests get a 400 naming the path, and the
    engine serves on."""
    import shutil
    doomed = shutil.copytree(adapters["a1"], tmp_path / "doomed")
    proc = ServerProcess(str(tiny_llama), host="127.0.0.133", extra=[
        "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank", "16",
        "--lora-modules", f"v={doomed}", f"w={adapters['a2']}"])
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x")
        assert client.completions.create(model="w", prompt="hi", max_tokens=2).choices
        shutil.rmtree(doomed)
        with pytest.raises(openai.BadRequestError, match="doomed"):
            client.completions.create(model="v", prompt="hi", max_tokens=2)
        assert client.completions.create(model="w", prompt="hi", max_tokens=2).choices
        assert client._client.get(proc.url + "/health").status_code == 200
    finally:
        assert proc.stop() == 0


def test_http_lora_updates_can_be_switched_off(tiny_llama, adapters):
    proc = ServerProcess(str(tiny_llama), host="127.0.0.132", extra=[
        "--enable-lora", "--disable-lora-updates", "--lora-modules", f"a1={adapters['a1']}"])
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x")
        res = client._client.post(proc.url + "/v1/load_lora_adapter",
                                  json={"lora_name": "a2", "lora_path": str(adapters["a2"])})
        assert res.status_code == 404
        assert {m.id for m in client.models.list().data} == {str(tiny_llama), "a1"}
    finally:
        assert proc.stop() == 0


# --- tensor parallelism and the int4 base ------------------------------------------------
@pytest.mark.slow
def test_tensor_parallel_adapters_match_peft(tiny_llama, adapters):
    names = ["a1", None, "a2", "rs"]
    with LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_lora_rank=16,
             tensor_parallel_size=2, kv_cache_memory=8 << 20) as engine:
        outs = engine.generate(PROMPTS[:4], GREEDY,
                               lora_request=[lora(adapters, n) for n in names])
    assert_matches_peft(tiny_llama, adapters, names, PROMPTS[:4],
                        [o.outputs[0].token_ids for o in outs])


def _perplexity(outputs) -> float:
    lps = [lp.logprob for out in outputs for lp in out.prompt_logprobs[1:]]
    return math.exp(-sum(lps) / len(lps))


@pytest.mark.slow
def test_int4_base_with_an_adapter_stays_within_int4_bounds(builtin_path, tmp_path):
    """The built-in model served int4 in bf16 (what `llmserve serve` does by default)
    with an adapter: perplexity and greedy agreement against transformers+peft in
    float32, within the int4 bounds tests/model_executor/test_quantization.py holds the
    base model to."""
    import torch
    from peft import PeftModel

    from tests.oracle import load_hf
    adapter = write_peft_adapter(builtin_path, tmp_path / "a", rank=8, std=0.02, seed=5)
    text = ("The quick brown fox jumps over the lazy dog. Paged attention stores the "
            "keys and values of each sequence in fixed-size blocks, found through a table.")
    hf = PeftModel.from_pretrained(load_hf(builtin_path), str(adapter)).eval()
    with LLM("smollm2-135m-instruct", quantization="int4", dtype="bfloat16",
             enable_lora=True, max_lora_rank=8) as engine:
        ids = engine.tokenizer.encode(text)
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        ref = math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())
        req = LoRARequest("a", 1, str(adapter))
        scored = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                 lora_request=req)
        # On a text this short (~30 tokens) int4's rounding moves perplexity either way
        # by a few percent: 0.972 of the reference on an Ice Lake Xeon, where ATen's int4
        # kernel computes the products (not quant_gemm). A wrong adapter moves it far more.
        assert ref * 0.95 < _perplexity(scored) < ref * 1.06, (_perplexity(scored), ref)
        prompts = random_prompts(7, [12, 30])
        outs = engine.generate(prompts, GREEDY, lora_request=req)
    refs = peft_greedy(builtin_path, adapter, prompts)
    agree = sum(next((i for i, (a, b) in enumerate(zip(o.outputs[0].token_ids, r.tokens))
                      if a != b), GREEDY_TOKENS) / GREEDY_TOKENS
                for o, r in zip(outs, refs)) / len(prompts)
    assert agree >= 0.4, agree
