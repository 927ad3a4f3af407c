"""Drive the scheduler and block manager without a model: each step "computes"
the scheduled tokens and appends a fake sampled token, as the engine would."""

from __future__ import annotations

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.config import EngineConfig
from llmserve.engine.sampling import SamplingParams
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sequence import Request, SequenceStatus


def make_scheduler(num_blocks=64, block_size=4, **kw) -> Scheduler:
    config = EngineConfig(model="none", device="cpu", block_size=block_size, **kw)
    bm = BlockManager(num_blocks, block_size, config.enable_prefix_caching, config.watermark)
    return Scheduler(config, bm)


_n = 0


def make_request(prompt_len: int, max_tokens: int, priority: int = 0, n: int = 1,
                 prompt: list[int] | None = None, arrival: float | None = None) -> Request:
    global _n
    _n += 1
    ids = prompt if prompt is not None else [(_n * 7919 + i) % 1000 + 3 for i in range(prompt_len)]
    req = Request(f"r{_n}", None, ids, SamplingParams(max_tokens=max_tokens, n=n),
                  priority=priority, arrival_time=float(_n if arrival is None else arrival))
    return req


def simulate_step(sched: Scheduler, batch) -> list:
    """Apply a scheduled batch; returns the sequences that finished."""
    finished = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        sched.bm.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(1000 + seq.num_output_tokens)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                finished.append(seq)
    return finished
