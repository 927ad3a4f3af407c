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


def _variant(kernel, args, kwargs, unspecialised: set[str]) -> tuple:
    """What Triton compiles a kernel variant for: the compile-time constants, each tensor
    argument's dtype and 16-byte alignment, and each integer's class (1, a multiple of 16,
    other) unless the kernel is declared not to specialise on it."""
    import inspect
    key = [kernel.fn.__name__, tuple(sorted(kwargs.items()))]
    for name, value in zip(inspect.signature(kernel.fn).parameters, args):
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and name not in unspecialised:
            key.append((name, 1 if value == 1 else 16 if value % 16 == 0 else 0))
    return tuple(key)


def test_no_kernel_variant_is_new_after_the_kernel_warm_up():
    """Issue 27: the split count now depends on the GPU's occupancy and decode-only
    batches have their own kernel, so ``warm_up`` must still compile every variant the
    engine can launch. Record the variant of each launch during the warm-up, then run
    what an engine runs (decode-only batches of 1 to 3 sequences at context limits that
    choose 1 to 16 splits, mixed and prefill-only batches): none may be new, or a user's
    request would wait for a compile."""
    from llmserve.kernels.triton import attention as ta
    kernels = [ta._write_kv_kernel, ta._unified_attention_kernel, ta._split_decode_kernel,
               ta._split_reduce_kernel]
    variants: list[tuple] = []

    def recorder(kernel):
        unspecialised = (set(kernel.kwargs.get("do_not_specialize") or ()) if ta.INTERPRETED
                         else {p.name for p in kernel.params if p.do_not_specialize})
        return lambda *a, **kw: variants.append(_variant(kernel, a, kw, unspecialised))

    device = torch.device("cpu" if ta.INTERPRETED else "cuda")
    heads, kv_heads, head_dim, block_size, max_len = 2, 1, 32, 16, 1024
    hooks = [(k, recorder(k)) for k in kernels]
    for kernel, hook in hooks:
        kernel.add_pre_run_hook(hook)
    try:
        ta.warm_up(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   block_size=block_size, dtype=torch.float32, device=device,
                   max_seq_len=max_len, max_num_seqs=3)
        warmed = set(variants)
        variants.clear()
        g = torch.Generator().manual_seed(0)
        k_cache, v_cache = torch.randn(2, 16, block_size, kv_heads, head_dim,
                                       generator=g).to(device)
        chosen = set()
        for shapes in ([(1, 5)], [(1, 17), (1, 40)], [(1, 33), (1, 1), (1, 20)],
                       [(3, 20), (1, 17)], [(5, 5)]):
            qsl = torch.tensor([0] + [q for q, _ in shapes], dtype=torch.int32).cumsum(0)
            q = torch.randn(int(qsl[-1]), heads, head_dim, generator=g).to(device)
            kv = torch.randn(q.shape[0], kv_heads, head_dim, generator=g).to(device)
            ta.write_kv_cache(kv, kv, k_cache, v_cache, torch.arange(q.shape[0]).to(device))
            tables = torch.arange(3 * len(shapes), dtype=torch.int32).view(len(shapes), 3)
            decode = max(n for n, _ in shapes) == 1
            for limit in ((64, 600, max_len) if decode else (max_len,)):
                out = torch.full_like(q, float("nan"))
                ta.unified_attention(q, k_cache, v_cache, out,
                                     query_start_loc=qsl.int().to(device),
                                     seq_lens=torch.tensor([s for _, s in shapes],
                                                           dtype=torch.int32).to(device),
                                     block_tables=tables.to(device),
                                     max_query_len=max(n for n, _ in shapes),
                                     max_seq_len=limit, scale=head_dim ** -0.5)
                assert not out.isnan().any()
                if decode:
                    chosen.add(ta._choose_splits(len(shapes), kv_heads, limit, block_size,
                                                 ta.num_sms(device)))
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)
    assert {1, 8, 16} <= chosen, chosen  # one pass, and split-KV at two depths
    new = set(variants) - warmed
    assert not new, f"compiled after the warm-up: {sorted(new, key=str)}"
