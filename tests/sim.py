"""Drive the scheduler and block manager without a model: each step "computes"
the scheduled tokens and appends a fake sampled token, as the engine would."""

from __future__ import annotations

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.config import EngineConfig
from llmserve.engine.sampling import SamplingParams
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sequence import Request, SequenceStatus


def make_scheduler(num_blocks=64, block_size=4, num_cpu_blocks=0, **kw) -> Scheduler:
    config = EngineConfig(model="none", device="cpu", block_size=block_size, **kw)
    bm = BlockManager(num_blocks, block_size, config.enable_prefix_caching, config.watermark,
                      num_cpu_blocks)
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


def add(sched: Scheduler, req: Request) -> Request:
    """As the engine does: only the first sample queues; the rest fork from it."""
    sched.add(req.sequences[0])
    return req


def check_no_shared_writes(sched: Scheduler, batch) -> None:
    """Every block a step writes into belongs to exactly one sequence."""
    bs = sched.bm.block_size
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = sched.bm.blocks[seq.block_table[pos // bs]]
            assert block.ref_count == 1, f"{seq} writes into shared {block}"


def simulate_step(sched: Scheduler, batch) -> list:
    """Apply a scheduled batch; returns the sequences that finished."""
    check_no_shared_writes(sched, batch)
    finished, due = [], []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        sched.bm.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            due.append(seq)
            due += sched.fork_children(seq)
    for seq in due:
        seq.append_token(1000 + seq.num_output_tokens + 7 * seq.index)
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
            finished.append(seq)
    return finished
