"""Block pool bookkeeping: tables, ref counts, prefix-cache keys, LRU eviction."""

from __future__ import annotations

from llmserve.core.block_manager import DROPPED, BlockManager, hash_block
from tests.sim import make_request


def test_allocation_grows_on_demand_and_frees_everything():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    seq = make_request(prompt_len=5, max_tokens=4).sequences[0]
    bm.allocate(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 8
    bm.allocate(seq, 8)  # still fits in two blocks: no new block
    assert len(seq.block_table) == 2
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3
    assert abs(bm.usage - 0.3) < 1e-9
    bm.free(seq)
    assert seq.block_table == []
    bm.check_all_free()


def test_block_hash_is_chained():
    a = hash_block(b"", [1, 2, 3, 4])
    assert hash_block(b"", [1, 2, 3, 4]) == a
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(b"", [5, 6, 7, 8])
    assert hash_block(b"", [1, 2, 3, 4], b"salt") != a


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_request(0, 4, prompt=list(range(3, 14))).sequences[0]  # 11 tokens
    bm.allocate(first, 11)
    first.num_computed_tokens = 11
    bm.cache_full_blocks(first)  # two full blocks registered
    second = make_request(0, 4, prompt=list(range(3, 14)) + [99]).sequences[0]
    hits = bm.match_prefix(second)
    assert hits == first.block_table[:2]
    bm.take_prefix(second, hits)
    assert second.num_computed_tokens == 8
    assert bm.blocks[hits[0]].ref_count == 2
    assert (bm.prefix_queries, bm.prefix_hits) == (12, 8)
    bm.free(first)
    bm.free(second)
    bm.check_all_free()


def test_lru_eviction_order_and_chain_tail_first():
    bm = BlockManager(num_blocks=5, block_size=2)
    old = make_request(0, 1, prompt=[5, 6, 7, 8, 9, 10]).sequences[0]
    new = make_request(0, 1, prompt=[11, 12, 13, 14]).sequences[0]
    for seq in (old, new):
        bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
    old_blocks, new_blocks = list(old.block_table), list(new.block_table)
    bm.free(old)  # freed first: least recently used
    bm.free(new)
    # Eviction order: the old chain tail to head, then the newer chain tail to head.
    order = list(bm.free_queue)
    assert order == old_blocks[::-1] + new_blocks[::-1]
    # A hit "touches" old's head block: it leaves the queue and returns at the end.
    again = make_request(0, 1, prompt=[5, 6, 99]).sequences[0]
    hits = bm.match_prefix(again)
    assert hits == [old_blocks[0]]
    bm.take_prefix(again, hits)
    assert old_blocks[0] not in bm.free_queue
    bm.free(again)
    assert list(bm.free_queue)[-1] == old_blocks[0]
    # Allocating evicts from the front and drops the evicted block's key.
    fresh = make_request(0, 1, prompt=[1, 2]).sequences[0]
    bm.allocate(fresh, 2)
    assert fresh.block_table == [old_blocks[2]]
    assert bm.blocks[old_blocks[2]].block_hash == b""
    assert bm.match_prefix(make_request(0, 1, prompt=[5, 6, 7, 8, 9, 10, 1]).sequences[0]) \
        == old_blocks[:2]


def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_request(0, 1, prompt=[5, 6, 7]).sequences[0]
    bm.allocate(seq, 3)
    seq.num_computed_tokens = 3
    bm.cache_full_blocks(seq)  # block 0 full and cached, block 1 partial
    cached, partial = seq.block_table
    bm.free(seq)
    assert list(bm.free_queue)[0] == partial
    assert list(bm.free_queue)[-1] == cached
    other = make_request(0, 1, prompt=[1, 2, 3, 4, 5, 6]).sequences[0]
    bm.allocate(other, 6)  # three blocks: the cached block survives
    assert bm.match_prefix(make_request(0, 1, prompt=[5, 6, 1]).sequences[0]) != []


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    seq = make_request(0, 1, prompt=[5, 6, 7, 8, 9]).sequences[0]
    bm.allocate(seq, 5)
    seq.num_computed_tokens = 5
    bm.cache_full_blocks(seq)
    assert bm.match_prefix(make_request(0, 1, prompt=[5, 6, 7, 8, 9]).sequences[0]) == []


def test_a_window_frees_blocks_behind_it_and_hits_need_only_its_blocks():
    """Window of 6 keys, blocks of 4: after computing 16 tokens the next query (position
    16) sees keys 11..16, so blocks 0 and 1 are released and dropped from the table.
    Once they are evicted, a prompt with the same 16-token prefix still hits all 16:
    chained keys make blocks 2 and 3, which its window sees, vouch for the rest."""
    bm = BlockManager(num_blocks=8, block_size=4, sliding_window=6)
    prompt = list(range(3, 19))  # 16 tokens
    first = make_request(0, 4, prompt=prompt).sequences[0]
    bm.allocate(first, 16)
    first.num_computed_tokens = 16
    bm.cache_full_blocks(first)
    table = list(first.block_table)
    bm.free_outside_window(first)
    assert first.block_table == [DROPPED, DROPPED] + table[2:]
    assert bm.num_held(first.block_table) == 2 and bm.num_free_blocks == 6
    evictor = make_request(0, 4, prompt=[99] * 24).sequences[0]
    bm.allocate(evictor, 24)  # every free block, so blocks 0 and 1 lose their keys
    bm.free(evictor)
    second = make_request(0, 4, prompt=prompt + [7]).sequences[0]
    hits = bm.match_prefix(second)
    assert hits == [DROPPED, DROPPED] + table[2:]
    bm.take_prefix(second, hits)
    assert second.num_computed_tokens == 16 and bm.blocks[table[2]].ref_count == 2
    bm.free(first)
    bm.free(second)
    bm.check_all_free()


def test_blocks_at_once_bounds_a_windowed_sequence():
    assert BlockManager(8, 4, sliding_window=6).blocks_at_once(1000, chunk=8) == 5
    assert BlockManager(8, 4, sliding_window=6).blocks_at_once(10, chunk=8) == 3
    assert BlockManager(8, 4).blocks_at_once(1000, chunk=8) == 250
