"""The scheduler's tallies (core/sched/tally.py) are what the engine's stats and metrics
read instead of scanning its queues: after every step of random workloads (preemption
by swap and by recompute, parallel samples, adapters, priorities, aborts) each tally
must equal a scan of its collection, and a waiting sequence must have computed nothing
(the stats count its whole prompt as still to compute)."""

from __future__ import annotations

import random

import pytest

from llmserve.core.lora_request import LoRARequest
from llmserve.core.request import SequenceStatus
from tests.sim import add, make_request, make_scheduler, simulate_step

ADAPTERS = [LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b"), LoRARequest("c", 3, "/c")]


def scanned(seqs) -> tuple[int, int, list[str]]:
    seqs = list(seqs)
    return (len({s.request.request_id for s in seqs}), sum(s.num_prompt_tokens for s in seqs),
            sorted({s.request.lora.lora_name for s in seqs if s.request.lora}))


def tallied(collection) -> tuple[int, int, list[str]]:
    t = collection.tally
    return t.num_requests, t.prompt_tokens, t.adapter_names()


def check(sched) -> None:
    for name in ("running", "waiting", "swapped"):
        collection = getattr(sched, name)
        assert tallied(collection) == scanned(collection), name
    assert all(s.num_computed_tokens == 0 for s in sched.waiting)


@pytest.mark.parametrize("seed", range(12))
def test_tallies_equal_a_scan_after_every_step(seed):
    rng = random.Random(seed)
    mode = rng.choice(["recompute", "swap"])
    sched = make_scheduler(num_blocks=rng.randint(9, 16), block_size=4,
                           num_cpu_blocks=64 if mode == "swap" else 0, preemption_mode=mode,
                           scheduling_policy=rng.choice(["fcfs", "priority"]),
                           max_num_seqs=rng.choice([4, 8]), max_num_batched_tokens=16,
                           enable_lora=True, max_loras=2)
    live = []
    for _ in range(300):
        if rng.random() < 0.4 and len(live) < 16:
            req = make_request(rng.randint(2, 16), rng.randint(4, 16),
                               priority=rng.randint(0, 2), n=rng.choice([1, 1, 2]))
            req.lora = rng.choice([None, *ADAPTERS])
            live.append(add(sched, req))
        if live and rng.random() < 0.05:  # an abort
            req = live.pop(rng.randrange(len(live)))
            for seq in req.sequences:
                if not seq.finished:
                    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        simulate_step(sched, sched.schedule())
        live = [r for r in live if not r.finished]
        check(sched)
    assert sched.num_preemptions, "the workload never preempted: it tests less than it says"
