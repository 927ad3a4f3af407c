"""The block moves of one engine step: applied in decision order, and the scheduler
never undoes in a step what it did earlier in it (issue #11's findings, one test each)."""

from __future__ import annotations

import torch

from llmserve.core.block_manager import BlockOp
from llmserve.worker.kv_cache import KVCache, KVIntegrityError, coalesce
from tests.sim import add, make_request, make_scheduler, simulate_step


def tiny_cache(num_blocks=8, num_cpu_blocks=4, check=False) -> KVCache:
    kv = KVCache(1, num_blocks, 1, 1, 1, torch.float32, torch.device("cpu"), num_cpu_blocks,
                 check_integrity=check)
    kv.storage.view(-1)[:] = torch.arange(num_blocks * 2, dtype=torch.float32)
    return kv


def test_ops_apply_in_decision_order_when_blocks_are_reused():
    """A swap-in frees CPU block 0, a later swap-out reuses it: the swap-in must read
    it first. Device block 1 is swapped out, then reused as a copy destination."""
    kv = tiny_cache()
    kv.cpu_storage[:, :, 0] = 100.0
    ops = [BlockOp("swap_in", 0, 5), BlockOp("swap_out", 1, 0), BlockOp("copy", 2, 1)]
    before = kv.storage.clone()
    kv.apply(ops)
    assert float(kv.storage[0, 0, 5]) == 100.0, "swap-in read a CPU block already overwritten"
    assert float(kv.cpu_storage[0, 0, 0]) == float(before[0, 0, 1])
    assert float(kv.storage[0, 0, 1]) == float(before[0, 0, 2])


def test_a_copy_chain_is_not_batched_into_one_gather():
    kv = tiny_cache()
    before = kv.storage.clone()
    kv.apply([BlockOp("copy", 0, 1), BlockOp("copy", 1, 2)])  # 2 gets 0's contents
    assert float(kv.storage[0, 0, 2]) == float(before[0, 0, 0])
    runs = coalesce([BlockOp("copy", 0, 1), BlockOp("copy", 1, 2), BlockOp("copy", 3, 4)])
    assert [len(pairs) for _, pairs in runs] == [1, 2]
    # Write after read is safe in one batch: the gather reads before the scatter writes.
    assert len(coalesce([BlockOp("copy", 1, 2), BlockOp("copy", 0, 1)])) == 1


def test_integrity_check_catches_a_swapped_block_overwritten_before_swap_in():
    kv = tiny_cache(check=True)
    kv.apply([BlockOp("swap_out", 3, 1)])
    kv.cpu_storage[:, :, 1] += 1  # what the old ordering did to a saved block
    try:
        kv.apply([BlockOp("swap_in", 1, 6)])
    except KVIntegrityError as e:
        assert "CPU block 1" in str(e)
    else:
        raise AssertionError("a changed swapped-out block went unnoticed")


def run_to_end(sched, first_batch=None):
    batch = first_batch or sched.schedule()
    for _ in range(500):
        simulate_step(sched, batch)
        if not sched.has_work():
            break
        batch = sched.schedule()
    sched.bm.check_all_free()


def test_a_swapped_sequence_is_not_swapped_in_and_out_in_one_step():
    """Found: a low-priority swapped sequence was swapped in, then picked as the victim
    of an urgent waiting request in the same step, its CPU blocks reused by its own
    swap-out. Now the urgent request is placed first and the swapped one stays out."""
    sched = make_scheduler(num_blocks=10, block_size=4, watermark=0.0, num_cpu_blocks=16,
                           preemption_mode="swap", scheduling_policy="priority",
                           max_num_batched_tokens=64)
    low = add(sched, make_request(prompt_len=16, max_tokens=12, priority=10)).sequences[0]
    mid = add(sched, make_request(prompt_len=16, max_tokens=12, priority=5)).sequences[0]
    simulate_step(sched, sched.schedule())
    while low.status.value != "swapped":  # both grow until low is swapped out
        simulate_step(sched, sched.schedule())
    simulate_step(sched, sched.schedule())
    add(sched, make_request(prompt_len=20, max_tokens=4, priority=0))
    for _ in range(200):
        if not sched.has_work():
            break
        batch = sched.schedule()
        assert set(batch.preempted).isdisjoint(batch.seqs), "a step undid its own decision"
        simulate_step(sched, batch)  # checks every sequence's KV by fingerprint
    assert low.finished and mid.finished
    sched.bm.check_all_free()


def test_a_sequence_with_a_queued_copy_is_never_preempted_in_that_step():
    """Found: samples of an n=2 request queued copy-on-write copies, then one was
    preempted for an urgent request in the same step and swapped out before its copy
    ran. Now the urgent request is placed first, before the samples allocate."""
    sched = make_scheduler(num_blocks=7, block_size=4, watermark=0.0, num_cpu_blocks=32,
                           preemption_mode="swap", scheduling_policy="priority",
                           max_num_batched_tokens=64)
    req = add(sched, make_request(prompt_len=10, max_tokens=6, n=2, priority=10))
    simulate_step(sched, sched.schedule())  # prefill; the two samples fork and share
    # Needs 5 of the 7 blocks: both samples must go, the first of which copied.
    add(sched, make_request(prompt_len=20, max_tokens=4, priority=0))
    preempted = []
    for _ in range(200):
        if not sched.has_work():
            break
        batch = sched.schedule()
        assert set(batch.preempted).isdisjoint(batch.seqs), "a step undid its own decision"
        preempted += batch.preempted
        simulate_step(sched, batch)  # checks every sequence's KV by fingerprint
    assert set(preempted) == set(req.sequences)
    assert all(s.num_output_tokens == 6 for s in req.sequences)
    sched.bm.check_all_free()


def test_an_urgent_prefill_preempts_a_less_urgent_decode_not_itself():
    """Found: decodes were placed first, so an urgent sequence still prefilling found
    only itself unscheduled and preempted itself (priority inversion)."""
    sched = make_scheduler(num_blocks=10, block_size=4, watermark=0.0,
                           scheduling_policy="priority", max_num_batched_tokens=8)
    low = add(sched, make_request(prompt_len=4, max_tokens=30, priority=10)).sequences[0]
    simulate_step(sched, sched.schedule())
    urgent = add(sched, make_request(prompt_len=30, max_tokens=2, priority=0)).sequences[0]
    preempted = []
    while urgent.num_output_tokens == 0:
        batch = sched.schedule()
        preempted += batch.preempted
        simulate_step(sched, batch)
    assert urgent.num_preemptions == 0, "the urgent request preempted itself"
    assert low in preempted
    run_to_end(sched)
