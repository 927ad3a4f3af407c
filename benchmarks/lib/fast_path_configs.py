"""The GPU fast path's configurations (each a set of engine flags) and the engine each
one builds: what ``gpu/gpu_fast_path.py`` measures against eager steps and
``gpu/gpu_greedy_margins.py`` checks the greedy tokens of.

llmserve is imported inside ``build``: a GPU check's smoke sets TRITON_INTERPRET before
anything imports the kernels."""

from __future__ import annotations

import time
from pathlib import Path

CONFIGS = {
    "eager": {"cuda_graphs": False},
    "default": {},  # CUDA graphs, on by default on CUDA
    "staging_tables": {"pinned_staging": True, "device_block_tables": True},
    "async": {"async_scheduling": True},
    "fused": {"fused_kernels": True},
    "all": {"pinned_staging": True, "device_block_tables": True, "profile_kv_cache": True,
            "async_scheduling": True, "fused_kernels": True},
}
BASELINE = "eager"
# Refused off CUDA as flags: the smoke attaches these pieces to the runner directly.
CUDA_ONLY = ("cuda_graphs", "pinned_staging", "device_block_tables", "profile_kv_cache")


def build(path: Path, flags: dict, smoke: bool, max_num_seqs: int):
    """An engine with ``flags`` on the checkpoint at ``path``, warmed up (with CUDA
    graphs: every bucket captured), and its start-up times and KV blocks."""
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.worker.step_buffers import enable_fast_path
    common = dict(model=str(path), attention_backend="triton", max_num_seqs=max_num_seqs,
                  enable_prefix_caching=False)
    t0 = time.perf_counter()
    if smoke:  # refused on CPU as flags: attach the pieces the flags would
        anywhere = {k: v for k, v in flags.items() if k not in CUDA_ONLY}
        engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", kv_cache_memory=16 << 20,
                                        max_model_len=256, **common, **anywhere))
        sizes = [1, 2, 4] if flags.get("cuda_graphs", True) else None
        enable_fast_path(engine.runner, engine.max_model_len,
                         pinned_staging=flags.get("pinned_staging", False),
                         device_block_tables=flags.get("device_block_tables", False),
                         graph_sizes=sizes, capture=False)
    else:
        engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", max_model_len=4096,
                                        **common, **flags))
    t1 = time.perf_counter()
    engine.warm_up()  # with CUDA graphs: captures every bucket
    return engine, {"load_s": t1 - t0, "warm_up_s": time.perf_counter() - t1,
                    "kv_blocks": engine.runner.num_blocks}
