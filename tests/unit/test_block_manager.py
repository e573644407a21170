import pytest

from pagoda.core.block_manager import BlockManager
from pagoda.core.sequence import Sequence
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def seq(tokens, n=1):
    return Sequence("r", list(tokens), SamplingParams(n=n))


def grow(bm, s, n):
    """s's tokens computed so far, then n more tokens (decodes) allocated"""
    s.num_computed_tokens = s.num_tokens
    for _ in range(n):
        s.append_token(7)
    bm.allocate(s, n)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.allocate(s, 10) == []
    assert len(bm.block_table(s)) == 3 and bm.num_free_blocks == 5
    bm.free(s)
    bm.check_no_leaks()


def test_allocation_fails_without_side_effects_when_blocks_run_out():
    bm = BlockManager(2, 4)
    a = seq(range(8))
    assert bm.allocate(a, 8) == []
    b = seq(range(100, 104))
    assert bm.allocate(b, 4) is None
    assert bm.num_free_blocks == 0 and b.seq_id not in bm.tables


def test_prefix_cache_hits_full_blocks_only_and_never_the_last_token():
    bm = BlockManager(16, 4)
    a = seq(range(12))
    bm.allocate(a, 12)
    b = seq(list(range(12)))  # identical prompt: last block must be recomputed for its logits
    assert bm.find_cached_prefix(b) == bm.block_table(a)[:2]
    c = seq(list(range(8)) + [99, 98])
    assert bm.find_cached_prefix(c) == bm.block_table(a)[:2]
    d = seq([5] + list(range(1, 12)))
    assert bm.find_cached_prefix(d) == []


def test_cached_blocks_survive_free_and_are_evicted_lru():
    bm = BlockManager(4, 4)
    a = seq(range(9))  # 2 full blocks + 1 partial
    bm.allocate(a, 9)
    table_a = list(bm.block_table(a))
    bm.free(a)
    bm.check_no_leaks()
    b = seq(list(range(8)) + [7, 7])
    hits = bm.find_cached_prefix(b)
    assert hits == table_a[:2]
    assert bm.allocate(b, 2, hits) == []
    assert bm.block_table(b)[:2] == table_a[:2]
    bm.free(b)
    assert bm.num_evicted_blocks == 0  # b took the unhashed partial block, not a cached one
    # fill the whole cache with new content: old hashes are evicted
    c = seq(range(200, 216))
    bm.allocate(c, 16)
    assert bm.find_cached_prefix(seq(range(9))) == []
    assert bm.num_evicted_blocks == 2  # a's two full blocks, counted once each
    bm.free(c)
    bm.check_no_leaks()


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(8, 4)
    a = seq(range(9))
    bm.allocate(a, 9)
    b = seq(range(9))
    hits = bm.find_cached_prefix(b)
    bm.allocate(b, 1, hits)
    assert bm.ref_counts[hits[0]] == 2
    bm.free(a)
    assert bm.ref_counts[hits[0]] == 1
    bm.free(b)
    bm.check_no_leaks()


def test_fork_shares_blocks_and_copy_on_write_on_the_partial_block():
    bm = BlockManager(8, 4)
    parent = seq(range(6), n=2)
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    parent.append_token(50)
    child = parent.fork(1)
    child.token_ids[-1] = 51
    bm.fork(parent, child)
    shared_partial = bm.block_table(parent)[1]
    assert bm.ref_counts[shared_partial] == 2
    copies = bm.allocate(child, 1)
    assert len(copies) == 1 and copies[0][0] == shared_partial
    assert bm.block_table(child)[1] == copies[0][1] != shared_partial
    assert bm.block_table(child)[0] == bm.block_table(parent)[0]
    assert bm.allocate(parent, 1) == []  # now the only owner: writes in place
    bm.free(parent)
    bm.free(child)
    bm.check_no_leaks()


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = seq(range(9))
    bm.allocate(a, 9)
    assert bm.find_cached_prefix(seq(range(9))) == []


def test_a_table_takes_consecutive_blocks_where_the_pool_has_them():
    # the attention kernels read a context's blocks in table order: consecutive blocks stream, a jump waits on
    # memory. Freed tail first, a context's blocks come back to the next one ascending, not in the queue's order;
    # and a context growing a block at a time (decodes beside others) takes the block after its last when free
    bm = BlockManager(32, 4)
    a = seq(range(32))
    bm.allocate(a, 32)
    assert bm.block_table(a) == list(range(8))
    bm.free(a)  # the queue: 8-31, then 7, 6, ..., 0 (still cached)
    b = seq(range(100, 132))
    bm.allocate(b, 32)
    assert bm.block_table(b) == list(range(8, 16))  # the least recently used run
    c = seq(range(200, 232))
    bm.allocate(c, 32)
    assert bm.block_table(c) == list(range(16, 24))
    d = seq(range(300, 332))
    bm.allocate(d, 32)
    assert bm.block_table(d) == list(range(24, 32))
    e = seq(range(400, 432))  # the pool's oldest free blocks now: a's, freed tail first
    bm.allocate(e, 32)
    assert bm.block_table(e) == list(range(8)) and bm.num_evicted_blocks == 8
    for s in (b, c, d, e):
        bm.free(s)
    # a context growing a block at a time (its decodes) takes the block after its last when that one is free
    f = seq(range(500, 504))
    bm.allocate(f, 4)
    start = bm.block_table(f)[0]
    for _ in range(3):
        grow(bm, f, 4)
    assert bm.block_table(f) == list(range(start, start + 4)) and start != 0
    bm.free(f)
    bm.check_no_leaks()


def test_a_growing_table_never_takes_a_recently_freed_cached_block_out_of_turn():
    # the block after a table's last is taken out of the queue's order only when it caches nothing or was freed
    # in the older half of the free history: a prompt just freed stays for the prefix cache, as in a plain LRU
    bm = BlockManager(12, 4)
    p, q, r = (seq(range(first, first + n)) for first, n in ((0, 16), (100, 4), (200, 16)))
    for s in (p, q, r):
        bm.allocate(s, s.num_tokens)
    assert (bm.block_table(p), bm.block_table(q), bm.block_table(r)) == ([0, 1, 2, 3], [4], [5, 6, 7, 8])
    bm.free(p)
    bm.free(r)  # r's blocks (5-8) are the most recently freed
    grow(bm, q, 4)
    assert bm.block_table(q) == [4, 9]  # not 5: the least recently used block instead
    assert bm.find_cached_prefix(seq(range(200, 217))) == [5, 6, 7, 8] and bm.num_evicted_blocks == 0
    bm.free(q)
    bm.check_no_leaks()
