"""Warm-up before serving: every path runs once at start-up, leaves no trace, and a
kernel that cannot run fails the start-up with a clear message instead of the first
request."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from llmserve import SamplingParams
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine


def generate(engine: LLMEngine, prompts) -> list[list[int]]:
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [r.sequences[0].output_token_ids for r in reqs]


def test_warm_up_leaves_no_trace(tiny_llama):
    prompts = [list(range(10, 50)), list(range(100, 107))]
    cold = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=8 << 20))
    warm = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=8 << 20))
    warm.warm_up()
    bm = warm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.cached, "warm-up left blocks behind"
    assert (bm.prefix_queries, bm.prefix_hits, warm.stats.steps) == (0, 0, 0)
    assert not warm.requests
    assert generate(warm, prompts) == generate(cold, prompts)


def test_warm_up_fits_a_tiny_kv_cache_and_budget(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=4 * 8192,
                                    max_num_batched_tokens=4, block_size=16))
    assert engine.block_manager.num_blocks == 4
    engine.warm_up()
    engine.block_manager.check_all_free()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_kernel_that_cannot_run_fails_the_start_up_not_the_first_request(tiny_llama):
    """Triton kernels without a GPU (and without the interpreter) cannot launch: the
    server must exit at start-up with a one-line error, never listen and then die."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "llmserve", "serve", "--model", str(tiny_llama),
         "--attention-backend", "triton", "--kv-cache-memory", str(8 << 20),
         "--host", "127.0.0.9", "--port", "18999"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("llmserve: error: the engine failed its warm-up on cpu with the "
                           "triton attention backend"), last


def test_warm_up_through_the_triton_kernels(tiny_llama):
    """Under the interpreter here, on the GPU for real: the engine's warm-up runs the
    Triton path end to end, then every kernel variant, and leaves nothing behind."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=8 << 20,
                                    attention_backend="triton", max_num_seqs=4))
    assert engine.runner.use_triton
    engine.warm_up()
    engine.block_manager.check_all_free()
    assert generate(engine, [list(range(10, 30))])[0]
