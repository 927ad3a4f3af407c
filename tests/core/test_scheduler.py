"""Scheduler invariants: budgets, decode-first chunked prefill, preemption, no starvation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.core.request import SequenceStatus
from tests.sim import add, make_request, make_scheduler, simulate_step


def test_long_prompt_is_chunked_while_decodes_continue():
    sched = make_scheduler(num_blocks=128, block_size=4, max_num_batched_tokens=8)
    short = add(sched, make_request(prompt_len=3, max_tokens=20)).sequences[0]
    simulate_step(sched, sched.schedule())  # short prefilled, now decoding
    long = add(sched, make_request(prompt_len=50, max_tokens=2)).sequences[0]
    chunks = []
    while long.num_output_tokens == 0:
        batch = sched.schedule()
        assert batch.num_tokens <= 8
        assert short in batch.seqs, "a running decode skipped a step"
        assert batch.seqs[0] is short, "decodes come before prefill chunks"
        chunks.append(batch.num_new_tokens[batch.seqs.index(long)])
        simulate_step(sched, batch)
    assert sum(chunks) == 50 and max(chunks) == 7 and len(chunks) == 8


def test_a_step_refuses_a_sequence_with_no_tokens_to_compute():
    """A scheduler bug that put a sequence in a step with 0 tokens reached the CPU
    kernels as an empty query (heap corruption, found by benchmarks/engine/fuzz_sensitivity.py);
    the batch names it instead, and stays as it was."""
    sched = make_scheduler(num_blocks=16, block_size=4)
    seq = add(sched, make_request(prompt_len=3, max_tokens=2)).sequences[0]
    batch = sched.schedule()
    with pytest.raises(ValueError, match=f"sequence {seq.seq_id} scheduled with 0 new tokens"):
        batch.add(seq, 0)
    assert batch.num_new_tokens == [3] and batch.seqs == [seq]


def test_unchunked_prefill_waits_for_a_whole_budget():
    sched = make_scheduler(num_blocks=128, block_size=4, max_num_batched_tokens=16,
                           enable_chunked_prefill=False)
    add(sched, make_request(prompt_len=10, max_tokens=5))
    add(sched, make_request(prompt_len=10, max_tokens=5))
    batch = sched.schedule()
    assert batch.num_new_tokens == [10]  # the second does not fit this step


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(num_blocks=128, max_num_seqs=3, max_num_batched_tokens=100)
    for _ in range(5):
        add(sched, make_request(prompt_len=4, max_tokens=3))
    batch = sched.schedule()
    assert len(batch) == 3 and len(sched.waiting) == 2


def test_admission_respects_the_watermark():
    sched = make_scheduler(num_blocks=12, block_size=4, watermark=0.2)  # keep 2 free
    small = add(sched, make_request(prompt_len=4, max_tokens=3)).sequences[0]
    simulate_step(sched, sched.schedule())  # small runs: 1 block
    add(sched, make_request(prompt_len=4 * 9, max_tokens=1))  # 9 blocks: 2 left < 2 + 1
    assert sched.schedule().seqs == [small], "would leave fewer than the watermark free"
    sched2 = make_scheduler(num_blocks=12, block_size=4, watermark=0.2)
    add(sched2, make_request(prompt_len=4, max_tokens=3))
    simulate_step(sched2, sched2.schedule())
    add(sched2, make_request(prompt_len=4 * 8, max_tokens=1))  # 8 blocks: 3 left
    assert len(sched2.schedule()) == 2


def test_preemption_picks_the_latest_arrival_and_outputs_resume():
    sched = make_scheduler(num_blocks=6, block_size=4, watermark=0.0,
                           max_num_batched_tokens=64)
    a = add(sched, make_request(prompt_len=8, max_tokens=8)).sequences[0]
    b = add(sched, make_request(prompt_len=8, max_tokens=8)).sequences[0]
    simulate_step(sched, sched.schedule())  # both prefilled: 4 of 6 blocks
    preempted = []
    for _ in range(40):
        if not sched.has_work():
            break
        batch = sched.schedule()
        preempted += batch.preempted
        simulate_step(sched, batch)
    assert preempted and preempted[0] is b
    assert a.finished and b.finished
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert b.num_preemptions >= 1
    sched.bm.check_all_free()


def test_priority_policy_orders_waiting_requests():
    sched = make_scheduler(num_blocks=128, max_num_seqs=1, scheduling_policy="priority")
    low = add(sched, make_request(prompt_len=4, max_tokens=1, priority=5)).sequences[0]
    high = add(sched, make_request(prompt_len=4, max_tokens=1, priority=-1)).sequences[0]
    assert sched.schedule().seqs == [high]
    assert sched.waiting == [low]


def test_swap_preemption_moves_blocks_out_and_back():
    sched = make_scheduler(num_blocks=6, block_size=4, watermark=0.0, num_cpu_blocks=16,
                           preemption_mode="swap", max_num_batched_tokens=64)
    a = add(sched, make_request(prompt_len=8, max_tokens=8)).sequences[0]
    b = add(sched, make_request(prompt_len=8, max_tokens=8)).sequences[0]
    simulate_step(sched, sched.schedule())
    swapped_out = swapped_in = 0
    for _ in range(60):
        if not sched.has_work():
            break
        batch = sched.schedule()
        swapped_out += len(batch.ops_of("swap_out"))
        swapped_in += len(batch.ops_of("swap_in"))
        if batch.ops_of("swap_out"):
            assert b.status.value == "swapped" and b.cpu_block_table
            assert b.num_computed_tokens > 0, "swap keeps the computed KV"
        simulate_step(sched, batch)
    assert swapped_out > 0 and swapped_in == swapped_out
    assert sched.num_swapped_out >= 1
    assert a.num_output_tokens == b.num_output_tokens == 8
    sched.bm.check_all_free()


def test_swap_falls_back_to_recompute_when_cpu_space_is_full():
    sched = make_scheduler(num_blocks=6, block_size=4, watermark=0.0, num_cpu_blocks=1,
                           preemption_mode="swap", max_num_batched_tokens=64)
    add(sched, make_request(prompt_len=8, max_tokens=8))
    b = add(sched, make_request(prompt_len=8, max_tokens=8)).sequences[0]
    simulate_step(sched, sched.schedule())
    while b.num_preemptions == 0:
        simulate_step(sched, sched.schedule())
    assert b.status.value == "waiting" and b.num_computed_tokens == 0
    assert sched.num_swapped_out == 0


def test_priority_preemption_makes_room_for_an_urgent_request():
    sched = make_scheduler(num_blocks=8, block_size=4, watermark=0.0,
                           scheduling_policy="priority", max_num_batched_tokens=64)
    low = add(sched, make_request(prompt_len=24, max_tokens=8, priority=10)).sequences[0]
    simulate_step(sched, sched.schedule())
    urgent = add(sched, make_request(prompt_len=16, max_tokens=4, priority=0)).sequences[0]
    batch = sched.schedule()
    assert urgent in batch.seqs and low in batch.preempted and low not in batch.seqs
    while sched.has_work():
        simulate_step(sched, batch)
        batch = sched.schedule()
    assert urgent.finished and low.finished
    sched.bm.check_all_free()


def test_fcfs_never_preempts_for_waiting_requests():
    sched = make_scheduler(num_blocks=8, block_size=4, watermark=0.0,
                           max_num_batched_tokens=64)
    first = add(sched, make_request(prompt_len=24, max_tokens=8, priority=10)).sequences[0]
    simulate_step(sched, sched.schedule())
    add(sched, make_request(prompt_len=16, max_tokens=4, priority=0))
    batch = sched.schedule()
    assert batch.seqs == [first] and not batch.preempted


def test_parallel_samples_share_prompt_blocks_copy_on_write():
    sched = make_scheduler(num_blocks=32, block_size=4)
    req = add(sched, make_request(prompt_len=10, max_tokens=3, n=3))
    parent, *children = req.sequences
    simulate_step(sched, sched.schedule())  # prefill; the samples fork here
    assert all(c.block_table == parent.block_table for c in children)
    assert [sched.bm.blocks[b].ref_count for b in parent.block_table] == [3, 3, 3]
    batch = sched.schedule()  # each sample writes its first token into block 2
    assert len(batch.ops_of("copy")) == 2, "two of the three samples copy the shared tail block"
    tails = {s.block_table[2] for s in req.sequences}
    assert len(tails) == 3
    assert all(sched.bm.blocks[s.block_table[0]].ref_count == 3 for s in req.sequences)
    simulate_step(sched, batch)
    while sched.has_work():
        simulate_step(sched, sched.schedule())
    assert all(s.num_output_tokens == 3 for s in req.sequences)
    sched.bm.check_all_free()


@settings(max_examples=80, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 6),
                            st.integers(1, 3), st.integers(0, 3)),
                  min_size=1, max_size=16),
    budget=st.integers(1, 48),
    num_blocks=st.integers(12, 60),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    cpu_blocks=st.integers(0, 40),
    abort_at=st.lists(st.integers(0, 60), max_size=4),
)
def test_random_streams_respect_budgets_and_free_every_block(
        reqs, budget, num_blocks, max_seqs, caching, mode, policy, cpu_blocks, abort_at):
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                           max_num_seqs=max_seqs, enable_prefix_caching=caching,
                           preemption_mode=mode, scheduling_policy=policy,
                           num_cpu_blocks=cpu_blocks)
    # Only requests that can ever fit are admitted (the engine rejects the rest).
    pending = [r for r in reqs if -(-(r[0] + r[1]) // 4) <= num_blocks]
    last_arrival = max((r[2] for r in pending), default=0)
    all_reqs = []
    for step in range(3000):
        for p, m, _, n, prio in [r for r in pending if r[2] == step]:
            all_reqs.append(add(sched, make_request(prompt_len=p, max_tokens=m, n=n,
                                                    priority=prio)))
        if step in abort_at and sched.running:
            victim = sched.running[0].request
            for seq in victim.sequences:
                if not seq.finished:
                    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        if not sched.has_work() and step > last_arrival:
            break
        running_before = [s for s in sched.running if s.num_uncomputed_tokens == 1]
        batch = sched.schedule()
        assert batch.num_tokens <= budget
        assert len(sched.running) <= max(max_seqs, 3)
        assert len(set(map(id, batch.seqs))) == len(batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert n >= 1
            blocks = len(seq.block_table)
            assert blocks * 4 >= seq.num_computed_tokens + n  # room for the new tokens
            assert (blocks - 1) * 4 < seq.num_computed_tokens + n  # waste < one block
        # Every running decode is scheduled unless it was preempted or the budget
        # ran out on decodes ahead of it.
        if len(running_before) <= budget:
            for seq in running_before:
                assert seq in batch.seqs or seq in batch.preempted
        simulate_step(sched, batch)
    else:
        raise AssertionError("requests starved: the stream never drained")
    assert all(s.finished for r in all_reqs for s in r.sequences)
    sched.bm.check_all_free()


PREFIXES = [[(7 * k + i) % 500 + 3 for i in range(24)] for k in range(3)]


@settings(max_examples=400, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 14),
                            st.integers(0, 10), st.integers(1, 3), st.integers(0, 3)),
                  min_size=1, max_size=14),
    budget=st.integers(1, 40),
    num_blocks=st.integers(8, 40),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    chunked=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    cpu_blocks=st.integers(0, 40),
    abort_at=st.lists(st.integers(0, 60), max_size=3),
)
def test_kv_contents_survive_every_schedule(reqs, budget, num_blocks, max_seqs, caching,
                                            chunked, mode, policy, cpu_blocks, abort_at):
    """Shared prefixes, n > 1, priorities, swap and recompute under tight memory: every
    sequence always finds exactly its own KV (checked by fingerprint in simulate_step)."""
    if not chunked:
        budget = max(budget, 80)  # unchunked, a whole sequence must fit one step (recompute)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget,
                           max_num_seqs=max_seqs, enable_prefix_caching=caching,
                           enable_chunked_prefill=chunked, preemption_mode=mode,
                           scheduling_policy=policy, num_cpu_blocks=cpu_blocks, watermark=0.0)
    pending = []
    for prefix, tail, max_tokens, arrival, n, prio in reqs:
        prompt = (PREFIXES[prefix] if prefix < 3 else []) + [900 + tail + i for i in range(tail)]
        if -(-(len(prompt) + max_tokens) // 4) <= num_blocks:
            pending.append((arrival, prompt, max_tokens, n, prio))
    all_reqs = []
    for step in range(3000):
        for arrival, prompt, max_tokens, n, prio in pending:
            if arrival == step:
                all_reqs.append(add(sched, make_request(0, max_tokens, prio, n, prompt)))
        if step in abort_at and sched.running:
            for seq in sched.running[-1].request.sequences:
                if not seq.finished:
                    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        if not sched.has_work() and step > 10:
            break
        simulate_step(sched, sched.schedule())
    else:
        raise AssertionError("requests starved: the stream never drained")
    assert all(s.finished for r in all_reqs for s in r.sequences)
    sched.bm.check_all_free()


def test_a_request_that_fills_the_pool_starts_when_nothing_else_runs():
    """The watermark is for running sequences to grow into; alone, a request that fits
    the pool but not the pool minus the watermark must still run (it used to wait
    forever)."""
    sched = make_scheduler(num_blocks=20, block_size=4, watermark=0.1,
                           enable_chunked_prefill=False, max_num_batched_tokens=128)
    req = add(sched, make_request(prompt_len=79, max_tokens=1))
    for _ in range(5):
        simulate_step(sched, sched.schedule())
    assert req.finished
    sched.bm.check_all_free()
