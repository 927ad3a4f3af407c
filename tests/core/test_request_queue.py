"""The scheduler's request queues (``core/sched/request_queue.py``) against a sorted list:
their order, heads with sequences skipped, membership, and the tenant-fair head as the
scheduler chose it from a sorted waiting list; then the scheduler's admission order
against the same reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.core.request import SequenceStatus
from llmserve.core.sched.fair_share import TenantShares
from llmserve.core.sched.overload import expired, waiting_requests
from llmserve.core.sched.policy import POLICIES
from llmserve.core.sched.request_queue import (
    FCFSQueue,
    PriorityQueue,
    TenantFairQueue,
    fcfs_key,
    priority_key,
)
from llmserve.core.sched.running import RunningBatch
from tests.sim import add, make_request, make_scheduler, simulate_step


def sequence(priority=0, arrival=0.0, tenant=""):
    req = make_request(prompt_len=4, max_tokens=1, priority=priority, arrival=arrival)
    req.tenant = tenant
    return req.sequences[0]


def reference_head(ordered: list, shares: TenantShares, ranked: bool, skip=frozenset()):
    """The waiting head as the scheduler picked it from a list kept sorted: among each
    tenant's first sequence (of the head's priority, ``ranked``), in list order until
    every active tenant was seen, the fairest."""
    queue = [s for s in ordered if s.seq_id not in skip]
    if not queue or not shares.contended:
        return queue[0] if queue else None
    heads, seen = [], set()
    for seq in queue:
        if ranked and seq.priority != queue[0].priority:
            break
        if seq.request.tenant in seen:
            continue
        seen.add(seq.request.tenant)
        heads.append(seq)
        if len(seen) == len(shares.active):
            break
    return shares.fairest(heads)


def test_fcfs_and_priority_queues_serve_in_their_order():
    seqs = [sequence(priority=p, arrival=a) for p, a in [(2, 1.0), (0, 3.0), (1, 2.0), (0, 4.0)]]
    fcfs, prio = FCFSQueue(), PriorityQueue()
    for seq in reversed(seqs):
        fcfs.add(seq)
        prio.add(seq)
    assert list(fcfs) == [seqs[0], seqs[2], seqs[1], seqs[3]] and fcfs.head() is seqs[0]
    assert list(prio) == [seqs[1], seqs[3], seqs[2], seqs[0]] and prio.head() is seqs[1]
    assert prio.head(skip={seqs[1].seq_id, seqs[3].seq_id}) is seqs[2]
    assert prio.head(skip={s.seq_id for s in seqs}) is None


def test_membership_follows_add_and_remove():
    queue, seq, other = FCFSQueue(), sequence(arrival=1.0), sequence(arrival=2.0)
    assert not queue and queue.head() is None and seq not in queue
    queue.add(seq)
    queue.add(other)
    with pytest.raises(ValueError, match="already queued"):
        queue.add(seq)
    queue.remove(seq)
    assert seq not in queue and other in queue and len(queue) == 1
    assert queue.head() is other and queue == [other]
    with pytest.raises(KeyError):
        queue.remove(seq)
    queue.add(seq)  # back after a removal (its old heap entry is dead, not revived twice)
    assert list(queue) == [seq, other] and len(queue) == 2


def test_iteration_is_a_snapshot_of_the_order():
    queue = PriorityQueue()
    seqs = [sequence(priority=p) for p in (1, 0, 2)]
    for seq in seqs:
        queue.add(seq)
    seen = []
    for seq in queue:  # removing while iterating, as aborting every waiting request does
        queue.remove(seq)
        seen.append(seq)
    assert seen == [seqs[1], seqs[0], seqs[2]] and not queue


def test_overload_counts_the_queue_unsorted_and_expires_in_its_order():
    waiting = PriorityQueue()
    seqs = [sequence(priority=p, arrival=a) for p, a in [(2, 0.0), (0, 1.0), (1, 2.0), (0, 9.0)]]
    for seq in seqs:
        waiting.add(seq)
    assert set(waiting.members) == set(seqs) and len(waiting_requests(waiting)) == 4
    late = expired(5.0, waiting, now=8.0)
    assert [r.request_id for r in late] == [s.request.request_id for s in seqs[1:3] + seqs[:1]]


OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "add", "remove", "charge", "leave"]),
                         st.integers(0, 3), st.integers(0, 2), st.integers(0, 6),
                         st.integers(0, 40)),
               max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, policy=st.sampled_from(["fcfs", "priority"]),
       skips=st.lists(st.integers(0, 40), max_size=3))
def test_queues_agree_with_a_sorted_list(ops, policy, skips):
    """Random adds, removals, tenants charged or gone: every queue's order, length,
    membership and head (with sequences skipped) are the sorted list's."""
    policy = POLICIES[policy]()
    key, ranked = policy.urgency, policy.name == "priority"
    shares = TenantShares()
    plain, fair = policy.new_queue(), TenantFairQueue(policy.new_queue, shares, policy.tier)
    live, gone = [], []
    for op, tenant, priority, arrival, n in ops:
        if op == "add":
            seq = sequence(priority, float(arrival), f"t{tenant}")
            shares.arrive(seq.request)
            live.append(seq)
            plain.add(seq)
            fair.add(seq)
        elif op == "remove" and live:
            seq = live.pop(n % len(live))
            gone.append(seq)
            plain.remove(seq)
            fair.remove(seq)
        elif op == "charge" and live:
            shares.charge(live[n % len(live)].request, n)
        elif op == "leave" and live:  # its request finished elsewhere (a sibling's end)
            shares.leave(live[n % len(live)].request)
        ordered = sorted(live, key=key)
        assert list(plain) == ordered and list(fair) == ordered
        assert len(plain) == len(fair) == len(live) and bool(fair) == bool(live)
        assert all(s in fair and s in plain for s in live)
        assert not any(s in fair or s in plain for s in gone)
        skip = {ordered[i % len(ordered)].seq_id for i in skips} if ordered else set()
        for s in (frozenset(), skip):
            assert plain.head(s) is (next((q for q in ordered if q.seq_id not in s), None))
            assert fair.head(s) is reference_head(ordered, shares, ranked, s)


def test_fcfs_and_priority_keys():
    late_urgent, early = sequence(priority=0, arrival=5.0), sequence(priority=3, arrival=1.0)
    assert fcfs_key(early) < fcfs_key(late_urgent)
    assert priority_key(late_urgent) < priority_key(early)


def test_the_running_batch_keeps_its_order_and_adapter_counts():
    running = RunningBatch(fcfs_key)
    seqs = [sequence(arrival=a) for a in (3.0, 1.0, 2.0)]
    for seq in seqs:
        running.append(seq)
    assert list(running) == seqs and running[0] is seqs[0] and running[-1] is seqs[2]
    running.sort()
    assert list(running) == [seqs[1], seqs[2], seqs[0]]
    running.remove(seqs[2])
    assert seqs[2] not in running and len(running) == 2 and running.num_adapters == 0
    with pytest.raises(ValueError, match="already running"):
        running.append(seqs[0])


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 8),
                               st.integers(0, 12)),
                     min_size=1, max_size=24),
       policy=st.sampled_from(["fcfs", "priority"]),
       aborts=st.lists(st.integers(0, 30), max_size=4))
def test_the_scheduler_admits_in_the_reference_order(reqs, policy, aborts):
    """One sequence at a time, each done in one step: every step admits exactly the
    head the reference picks from a sorted list of what waits, with the scheduler's
    own tenant counters (arrivals over time, tenants of several weights, aborts)."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1,
                           max_num_batched_tokens=64, scheduling_policy=policy)
    ranked = policy == "priority"
    pending = sorted(enumerate(reqs), key=lambda r: r[1][3])
    waiting, step = [], 0
    while pending or waiting:
        while pending and pending[0][1][3] <= step:
            i, (tenant, priority, prompt, _) = pending.pop(0)
            req = make_request(prompt_len=prompt + 1, max_tokens=1, priority=priority,
                               arrival=float(i % 5))
            req.tenant, req.tenant_weight = f"t{tenant}", 1.0 + tenant
            waiting.append(add(sched, req).sequences[0])
        if step in aborts and waiting:
            seq = waiting.pop(len(waiting) // 2)
            sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        expected = reference_head(sorted(waiting, key=sched.policy.urgency), sched.shares,
                                  ranked)
        batch = sched.schedule()
        assert batch.seqs == ([expected] if expected else [])
        if expected is not None:
            waiting.remove(expected)
        assert all(s.finished for s in simulate_step(sched, batch))
        step += 1
    sched.bm.check_all_free()
