"""Tensor parallelism on CPU with gloo: the tokens of N ranks equal one rank's.

Random tiny checkpoints: a Llama (GQA 4/2, untied, so each rank holds one KV head) and
a Qwen2 (QKV biases, tied embeddings, GQA 4/1 so the KV head is replicated on both
ranks, and a vocabulary of 49155 that does not split in two, so the last shard of the
embedding and LM head is padded). Greedy outputs are compared token by token; a
divergence is accepted only at a near-tie of one rank's top-2 logits (the ranks' sums
are in another order). Seeded sampling (n > 1) must be equal exactly.

Only one tensor-parallel engine can live in a process (one torch.distributed group),
so ``tp_engine`` keeps one at a time and shuts the previous one down.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch.distributed as dist

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.distributed.shapes import check_tensor_parallel, rank_shape
from llmserve.entrypoints.launcher import ServerProcess
from llmserve.kernels.cpu.dispatch import gemm_backend
from llmserve.kernels.cpu.gemm import packing_available
from llmserve.model_executor.layers.cpu_linear import NativeLinear, PackedLinear
from tests.conftest import BUILTIN, write_tiny_checkpoint
from tests.differential import reconfigure

TIE_GAP = 1e-4
ENGINE_ARGS = dict(kv_cache_memory=8 << 20, max_num_batched_tokens=16,
                   preemption_mode="swap", swap_space=2 << 20)

_live: dict = {}  # the one live tensor-parallel LLM of this process


def tp_engine(key, make):
    if _live.get("key") != key:
        if _live.get("llm") is not None:
            _live.pop("llm").shutdown()
        _live.update(key=key, llm=make())
    return _live["llm"]


@pytest.fixture(scope="module", autouse=True)
def _shutdown_last():
    yield
    if _live.get("llm") is not None:
        _live.pop("llm").shutdown()
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def tiny_qwen2_tied(tmp_path_factory, builtin_path) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "qwen2-tied", builtin_path,
                                 "qwen2", seed=3, tie_word_embeddings=True,
                                 num_key_value_heads=1, vocab_size=49155)


@pytest.fixture(scope="module", params=["llama", "qwen2-tied"])
def _one_rank(request, tiny_models):
    path = (tiny_models["llama"] if request.param == "llama"
            else request.getfixturevalue("tiny_qwen2_tied"))
    return request.param, path, LLM(str(path), **ENGINE_ARGS)


@pytest.fixture
def pair(_one_rank):
    """(one rank, two ranks) on the same checkpoint."""
    key, path, one = _one_rank
    return one, tp_engine(key, lambda: LLM(str(path), tensor_parallel_size=2, **ENGINE_ARGS))


def prompts_with_shared_prefix(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49152) for _ in range(48)]  # three full blocks
    solo = [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 17, 70)]
    return solo + [prefix + [rng.randrange(3, 49152) for _ in range(n)] for n in (5, 9, 30)]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def assert_same_greedy(ref, got) -> None:
    ties = 0
    for r, g in zip(ref, got, strict=True):
        a, b = r.outputs[0], g.outputs[0]
        if a.token_ids == b.token_ids:
            continue
        i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        top = a.logprobs[i].top
        gap = top[0][1] - top[1][1]
        assert gap < TIE_GAP, (f"diverged at token {i} with a top-2 gap of {gap:.3g}, no tie\n"
                               f"1 rank  {a.token_ids}\n2 ranks {b.token_ids}")
        ties += 1
    assert ties <= 1, "more near-ties than chance explains"


def test_chunked_prefill_and_prefix_caching(pair):
    one, two = pair
    for llm in pair:
        reconfigure(llm.engine, llm.engine.runner.num_blocks)
    # Each rank caches only its KV heads: the same bytes per rank hold more blocks,
    # unless the KV heads are replicated (Qwen2's one KV head on two ranks).
    ratio = one.engine.runner.shard.num_kv_heads // two.engine.runner.shard.num_kv_heads
    assert ratio == (2 if two.engine.hf_config.num_key_value_heads >= 2 else 1)
    assert two.engine.runner.num_blocks == ratio * one.engine.runner.num_blocks
    prompts = prompts_with_shared_prefix(seed=1)
    ref = one.generate(prompts, greedy())
    # Twice: the second pass hits the prefix cache for every prompt's full blocks.
    for _ in range(2):
        assert_same_greedy(ref, two.generate(prompts, greedy()))
    bm = two.engine.block_manager
    assert bm.prefix_hits > 0
    bm.check_all_free()


def test_parallel_samples_with_seeds(pair):
    one, two = pair
    for llm in pair:
        reconfigure(llm.engine, llm.engine.runner.num_blocks)
    prompts = prompts_with_shared_prefix(seed=2)[2:5]
    params = [SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=10 + i, max_tokens=6,
                             ignore_eos=True) for i in range(len(prompts))]
    ref = [[c.token_ids for c in o.outputs] for o in one.generate(prompts, params)]
    got = [[c.token_ids for c in o.outputs] for o in two.generate(prompts, params)]
    assert got == ref


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(pair, mode):
    one, two = pair
    reconfigure(one.engine, one.engine.runner.num_blocks)
    prompts = prompts_with_shared_prefix(seed=3)[2:]
    ref = one.generate(prompts, greedy(16))
    # 12 blocks of 16 tokens cannot hold these four sequences at once.
    reconfigure(two.engine, 12, num_cpu_blocks=64 if mode == "swap" else 0,
                preemption_mode=mode)
    got = two.generate(prompts, greedy(16))
    sched = two.engine.scheduler
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swapped_out > 0
    assert_same_greedy(ref, got)
    two.engine.block_manager.check_all_free()


def test_builtin_model_on_three_ranks(builtin_path):
    """9 query heads and 3 KV heads: three ranks of 3/1 heads each."""
    prompts = ["The capital of France is", "def fibonacci(n):\n   "]
    args = dict(kv_cache_memory=16 << 20, max_num_batched_tokens=8, enable_prefix_caching=True)
    ref = LLM(BUILTIN, **args).generate(prompts, greedy(4))
    three = tp_engine("builtin-3", lambda: LLM(BUILTIN, tensor_parallel_size=3, **args))
    assert_same_greedy(ref, three.generate(prompts, greedy(4)))


@pytest.mark.skipif(not packing_available(), reason="no native bf16 on this CPU")
def test_bf16_ranks_pack_their_shards_and_agree_with_one_rank(tiny_models):
    """bf16 on a CPU (the suite's other engines are float32): every rank packs its own
    shard of each dense projection for this CPU's GEMM (ours on AVX512-BF16, oneDNN
    with AMX), and the first token's distribution over two ranks is one rank's up to
    bf16 rounding (each rank rounds its partial sums before the all-reduce): the top
    token is one rank's top or within 0.05 of it, never a token far behind."""
    args = dict(ENGINE_ARGS, dtype="bfloat16", quantization="none")
    path = str(tiny_models["llama"])
    prompts = prompts_with_shared_prefix(5)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    one = LLM(path, **args)
    try:
        ref = one.generate(prompts, params)
    finally:
        one.shutdown()
    two = tp_engine("llama-bf16", lambda: LLM(path, tensor_parallel_size=2, **args))
    expected = NativeLinear if gemm_backend() == "native" else PackedLinear
    layer = two.engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, expected)  # rank 0's shard
    assert layer.self_attn.qkv_proj.out_features == 2 * 16 + 2 * 16  # 2 of 4 heads, 1 of 2
    got = two.generate(prompts, params)
    for r, g in zip(ref, got, strict=True):
        want, have = r.outputs[0].logprobs[0].top, g.outputs[0].logprobs[0].top
        want_logprob = dict(want)
        assert have[0][0] in want_logprob
        assert want_logprob[have[0][0]] >= want[0][1] - 0.05
        assert abs(have[0][1] - want[0][1]) < 0.05
    two.engine.block_manager.check_all_free()


def test_unsplittable_shapes_are_refused_before_any_worker_starts():
    if _live.get("llm") is not None:
        _live.pop("llm").shutdown()
    with pytest.raises(ValueError, match=r"tensor parallel size 2 cannot split "
                                         r"smollm2-135m-instruct \(9 query heads, 3 KV heads"
                                         r".*Sizes that work for it: 1, 3"):
        LLM(BUILTIN, tensor_parallel_size=2)
    assert not dist.is_initialized()
    assert not _worker_pids(os.getpid())


def test_refusals_and_rank_shapes():
    class Shape:
        num_attention_heads, num_key_value_heads, intermediate_size, vocab_size = 8, 2, 96, 10

    with pytest.raises(ValueError, match="intermediate_size 96 is not divisible by 5"):
        check_tensor_parallel(Shape, 5)
    with pytest.raises(ValueError, match="integer >= 1"):
        EngineConfig(tensor_parallel_size=0, device="cpu")
    with pytest.raises(ValueError, match="--compile is not supported"):
        EngineConfig(tensor_parallel_size=2, device="cpu", compile=True)
    # 2 KV heads on 4 ranks: each KV head replicated on two consecutive ranks, next to
    # the query heads that read it.
    shapes = [rank_shape(Shape, r, 4) for r in range(4)]
    assert [(s.head_start, s.num_heads) for s in shapes] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s.kv_head_start, s.num_kv_heads) for s in shapes] == [(0, 1), (0, 1), (1, 1),
                                                                    (1, 1)]
    # A vocabulary of 10 in shards of 3: the last holds one real row.
    assert [(s.vocab_start, s.vocab_end) for s in shapes] == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_worker_killed_mid_generation_fails_the_step(tiny_qwen2_tied):
    """The step's collective fails on the broken connection; the error names the rank.
    (Reuses the last pair's two-rank engine when it is still the live one.)"""
    from llmserve.executor.tensor_parallel import WorkerDiedError
    path = tiny_qwen2_tied
    llm = tp_engine("qwen2-tied", lambda: LLM(str(path), tensor_parallel_size=2, **ENGINE_ARGS))
    engine = llm.engine
    reconfigure(engine, engine.runner.num_blocks)
    engine.add_request(list(range(5, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    _live.clear()  # nobody else may use this engine
    try:
        [worker] = engine.runner.group.procs
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) exited with signal "
                                                  r"SIGKILL"):
            for _ in range(20):
                engine.step()
    finally:
        llm.shutdown()
    assert not dist.is_initialized()


def _worker_pids(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += (task / "children").read_text().split()
    return [int(c) for c in children
            if b"llmserve-tp-rank" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_killed_worker_takes_the_server_down(tiny_llama, tmp_path):
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = ServerProcess(["serve", "--model", str(tiny_llama), "--tensor-parallel-size",
                                "2", "--kv-cache-memory", str(8 << 20), "--log-level",
                                "WARNING"], "127.0.0.2", stdout=log)
    try:
        out = _post(server.url + "/v1/completions",
                    {"model": str(tiny_llama), "prompt": "Hello", "max_tokens": 3})
        assert out["usage"]["completion_tokens"] == 3
        [worker] = _worker_pids(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        saw_503, deadline = False, time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(server.url + "/health", timeout=2)
            except urllib.error.HTTPError as e:
                saw_503 |= e.code == 503
            except OSError:
                pass
            time.sleep(0.1)
        assert server.proc.poll() not in (None, 0), "the server should exit non-zero"
        assert saw_503, "/health should answer 503 before the server exits"
        text = log_path.read_text()
        assert "tensor-parallel worker rank 1" in text and "SIGKILL" in text, text[-2000:]
    finally:
        server.stop()


def test_prompt_logprobs_over_several_slices(tiny_models):
    """A chunk's prompt rows are scored ROWS_PER_SLICE at a time, each slice's logits
    gathered by a collective every rank joins: two ranks give one rank's scores."""
    from llmserve.model_executor.layers.prompt_logprobs import ROWS_PER_SLICE
    path = str(tiny_models["llama"])
    args = dict(kv_cache_memory=8 << 20, max_num_batched_tokens=512)
    one = LLM(path, **args)
    two = tp_engine("slices", lambda: LLM(path, tensor_parallel_size=2, **args))
    rng = random.Random(5)
    prompt = [rng.randrange(3, 49152) for _ in range(ROWS_PER_SLICE + 40)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    a = one.generate([prompt], params)[0].prompt_logprobs
    b = two.generate([prompt], params)[0].prompt_logprobs
    assert len(a) == len(b) == len(prompt) and a[0] is None and b[0] is None
    assert [lp.token_id for lp in a[1:]] == [lp.token_id for lp in b[1:]] == prompt[1:]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a[1:], b[1:])) < 1e-3
