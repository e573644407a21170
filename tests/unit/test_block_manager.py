import pytest

from pagoda.core.block_manager import BlockManager
from pagoda.core.sequence import Sequence
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def seq(tokens, n=1):
    return Sequence("r", list(tokens), SamplingParams(n=n))


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
