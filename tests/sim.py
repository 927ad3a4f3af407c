"""Drive the scheduler and block manager without a model: each step "computes"
the scheduled tokens and appends a fake sampled token, as the engine would.

The KV cache is real (``KVCache``, the engine's own block-op code) but tiny: each
slot holds a fingerprint of the token prefix up to its position, which is what a
real K/V vector depends on. Before every step, each scheduled sequence must find
the fingerprints of its computed tokens in its blocks — across prefix hits,
copy-on-write, swap-out/swap-in and blocks reused by others in the same step.
"""

from __future__ import annotations

import torch

from llmserve.config import EngineConfig
from llmserve.core.block_manager import BlockManager
from llmserve.core.request import Request, Sequence, SequenceStatus
from llmserve.core.sampling_params import SamplingParams
from llmserve.core.sched.scheduler import Scheduler
from llmserve.worker.kv_cache import KVCache


class SimScheduler(Scheduler):
    """A scheduler with the fingerprint KV cache it is checked against."""
    kv: KVCache


def make_scheduler(num_blocks=64, block_size=4, num_cpu_blocks=0, **kw) -> SimScheduler:
    config = EngineConfig(model="none", device="cpu", block_size=block_size, **kw)
    bm = BlockManager(num_blocks, block_size, config.enable_prefix_caching, config.watermark,
                      num_cpu_blocks)
    sched = SimScheduler(config, bm)
    sched.kv = KVCache(1, num_blocks, block_size, 1, 1, torch.float64, torch.device("cpu"),
                       num_cpu_blocks, check_integrity=True)
    sched.kv.storage.fill_(-1.0)
    return sched


def fingerprints(seq: Sequence, upto: int) -> list[float]:
    """Per position, a hash of the tokens up to and including it (exact in float64)."""
    out, h = [], 0
    for tok in seq.token_ids[:upto]:
        h = (h * 1000003 + tok + 1) % (1 << 50)
        out.append(float(h))
    return out


def _slots(sched: Scheduler, seq: Sequence, start: int, end: int) -> torch.Tensor:
    bs = sched.bm.block_size
    return torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(start, end)],
                        dtype=torch.long)


def check_and_write_kv(sched: SimScheduler, batch) -> None:
    """Apply the step's block ops, check every scheduled sequence's computed KV,
    then "compute" the new tokens by writing their fingerprints."""
    sched.kv.apply(batch.block_ops)
    keys = sched.kv.storage[0, 0].view(-1)
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        fps = fingerprints(seq, start + n)
        got = keys[_slots(sched, seq, 0, start)].tolist()
        assert got == fps[:start], f"{seq}: KV of its computed tokens was lost or overwritten"
        keys[_slots(sched, seq, start, start + n)] = torch.tensor(fps[start:],
                                                                  dtype=torch.float64)


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
    check_and_write_kv(sched, batch)
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
