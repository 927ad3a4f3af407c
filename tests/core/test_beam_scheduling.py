"""Beam search under memory pressure, at the scheduler: random mixes of beam and plain
requests on small caches (swap and recompute, fcfs and priority, continuous and static
batching, tight token budgets and sequence caps) all finish, with every KV write
checked and every block back at the end. Beams that have offered their next tokens
wait idle, holding blocks: these runs found three ways that could livelock or deadlock
(a sibling's chunked re-prefill preempting itself, another request's idle beams
blocking the queue head, static batches never readmitting a resumed beam)."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.core.beam_search import BeamSearch, BeamSearchParams
from llmserve.core.request import Request, SequenceStatus
from llmserve.core.sampling_params import SamplingParams
from llmserve.engine.beam_stepper import BeamStepper
from llmserve.engine.hooks import StepHook
from tests.sim import check_and_write_kv, check_no_shared_writes, make_scheduler

VOCAB = 50
MAX_STEPS = 3000


def random_requests(rng: random.Random, num_blocks: int) -> list[Request]:
    reqs = []
    for k in range(rng.randint(2, 3)):
        prompt_len, max_tokens = rng.randint(4, 24), rng.randint(4, 16)
        if (prompt_len + max_tokens + 3) // 4 > num_blocks:
            continue  # must fit alone
        if rng.random() < 0.9:
            width = rng.randint(2, 4)
            params = SamplingParams(n=width, max_tokens=max_tokens,
                                    beam=BeamSearchParams(width, max_tokens, ignore_eos=True))
        else:
            params = SamplingParams(max_tokens=max_tokens)
        req = Request(f"r{k}", None, [rng.randint(3, VOCAB - 1) for _ in range(prompt_len)],
                      params, arrival_time=float(k))
        if params.beam is not None:
            req.beams = BeamSearch(params.beam, frozenset())
            req.beams.start(req.sequences[0].seq_id)
        reqs.append(req)
    return reqs


def run(seed: int, batching: str) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    mode = rng.choice(["recompute", "swap"])
    num_blocks = rng.randint(8, 20)
    sched = make_scheduler(
        num_blocks=num_blocks, block_size=4, num_cpu_blocks=64 if mode == "swap" else 0,
        preemption_mode=mode, scheduling_policy=rng.choice(["fcfs", "priority"]),
        batching=batching, max_num_seqs=rng.randint(2, 8),
        max_num_batched_tokens=rng.randint(2, 20), watermark=rng.choice([0.0, 0.1]),
        enable_prefix_caching=rng.random() < 0.2)
    stepper = BeamStepper(sched, VOCAB, StepHook())
    reqs = random_requests(rng, num_blocks)
    pending, arrivals = list(reqs), sorted(rng.randint(0, 3) for _ in reqs)
    idle = 0
    for step in range(MAX_STEPS):
        while pending and arrivals[0] <= step:
            arrivals.pop(0)
            sched.add(pending.pop(0).sequences[0])
        if not sched.has_work():
            if pending:
                continue
            break
        batch = sched.schedule()
        if not batch.seqs:
            sched.kv.apply(batch.block_ops)
            idle += 1
            assert idle <= 5, f"seed {seed}: stalled with work left"
            continue
        idle = 0
        check_no_shared_writes(sched, batch)
        check_and_write_kv(sched, batch)
        due = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            sched.bm.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                due.append(seq)
        beams = [s for s in due if s.request.beams is not None]
        if beams:
            stepper(beams, torch.randn(len(beams), VOCAB))
        for seq in due:
            if seq.request.beams is None:
                seq.append_token(rng.randint(3, VOCAB - 1))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    else:
        raise AssertionError(f"seed {seed}: no end after {MAX_STEPS} steps")
    assert all(r.finished for r in reqs), seed
    for r in reqs:
        if r.beams is not None:
            assert len(r.beams.results()) == r.params.n
    sched.bm.check_all_free()


@pytest.mark.parametrize("batching, seeds", [("continuous", range(300)),
                                             ("static", range(150))])
def test_beams_under_pressure_always_finish_and_free_everything(batching, seeds):
    for seed in seeds:
        run(seed, batching)
