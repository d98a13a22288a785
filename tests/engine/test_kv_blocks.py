from dataclasses import dataclass, field

import pytest

from engine.kv_blocks import NULL_BLOCK, BlockManager


@dataclass
class Seq:
    seq_id: int
    token_ids: list[int]
    block_hashes: list[int] = field(default_factory=list)


def test_allocate_append_free_and_null_block():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.num_usable_blocks == 4 and bm.num_free_blocks == 4
    s = Seq(1, list(range(10)))
    table = bm.allocate_new(s, [], 10)
    assert len(table) == 3 and NULL_BLOCK not in table
    assert bm.append_slots(1, 12) == []  # still fits in 3 blocks
    assert len(bm.append_slots(1, 13)) == 1
    assert bm.append_slots(1, 17) is None  # no block left; nothing changed
    assert len(bm.table(1)) == 4 and bm.usage == 1.0
    bm.check_invariants()
    bm.free(1)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0 and not bm.tables
    bm.check_invariants()
    with pytest.raises(ValueError):
        BlockManager(1, 4)


def test_prefix_hit_shares_blocks_and_never_covers_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Seq(1, list(range(12)))
    bm.allocate_new(a, [], 12)
    bm.register_computed(a, 12)
    # same 12 tokens: only 2 blocks may hit (the last token must be computed)
    b = Seq(2, list(range(12)))
    hit = bm.find_cached_prefix(b)
    assert hit == bm.table(1)[:2]
    # 13 tokens sharing 12: all 3 full blocks hit
    c = Seq(3, list(range(12)) + [99])
    hit_c = bm.find_cached_prefix(c)
    assert hit_c == bm.table(1)
    table_c = bm.allocate_new(c, hit_c, 13)
    assert table_c[:3] == bm.table(1) and len(table_c) == 4
    assert all(bm.blocks[b].ref_count == 2 for b in bm.table(1))
    assert bm.prefix_cache_hits == 12 and bm.prefix_cache_queries == 12 + 13
    # a different first block breaks the chain even if later blocks match
    d = Seq(4, [100] + list(range(1, 12)) + [5])
    assert bm.find_cached_prefix(d) == []
    bm.check_invariants()


def test_partial_registration_only_full_computed_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Seq(1, list(range(10)))
    bm.allocate_new(a, [], 10)
    bm.register_computed(a, 6)  # one full block computed
    assert bm.find_cached_prefix(Seq(2, list(range(10)))) == bm.table(1)[:1]
    bm.register_computed(a, 10)
    assert bm.find_cached_prefix(Seq(3, list(range(10)))) == bm.table(1)[:2]


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    bm = BlockManager(num_blocks=7, block_size=2)  # 6 usable blocks
    a = Seq(1, [1, 2, 3, 4, 5])
    bm.allocate_new(a, [], 5)
    bm.register_computed(a, 5)  # blocks [1,2] [3,4] cached; [5] partial
    a_table = list(bm.table(1))
    bm.free(1)
    assert bm.num_free_blocks == 6
    # the anonymous partial block is reused first; cached blocks survive
    other = Seq(2, [9, 9])
    assert bm.allocate_new(other, [], 2) == [a_table[2]]
    assert bm.find_cached_prefix(Seq(3, [1, 2, 3, 4, 0])) == a_table[:2]
    # a hit on a free cached block takes it out of the free list
    hit_seq = Seq(4, [1, 2, 7])
    hit = bm.find_cached_prefix(hit_seq)
    assert hit == a_table[:1]
    bm.allocate_new(hit_seq, hit, 3)
    assert bm.blocks[a_table[0]].ref_count == 1
    bm.check_invariants()
    bm.free(4)
    bm.free(2)
    # LRU: a's tail block [3,4] was freed before its head [1,2] was (re)freed, so it goes first
    big = Seq(5, list(range(100, 110)))
    bm.allocate_new(big, [], 9)  # 5 blocks of 6: one cached block must be evicted
    assert bm.find_cached_prefix(Seq(6, [1, 2, 3, 4, 0])) == a_table[:1]
    bm.check_invariants()
    bm.allocate_new(Seq(7, [50, 51]), [], 2)  # the last free block: evicts [1,2]
    assert bm.find_cached_prefix(Seq(8, [1, 2, 3])) == []
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_allocate_new_counts_pinned_free_hits():
    bm = BlockManager(num_blocks=4, block_size=2)  # 3 usable
    a = Seq(1, [1, 2, 3, 4, 5])
    bm.allocate_new(a, [], 5)
    bm.register_computed(a, 5)
    bm.free(1)
    b = Seq(2, [1, 2, 3, 4, 5, 6, 7, 8])
    hit = bm.find_cached_prefix(b)
    assert len(hit) == 2
    # needs 4 blocks: 2 hits (both free) + 2 new, but only 1 other block is free
    assert bm.allocate_new(b, hit, 8) is None
    bm.check_invariants()
    assert bm.allocate_new(b, hit, 6) is not None
    bm.check_invariants()


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = Seq(1, [1, 2, 3, 4, 5])
    bm.allocate_new(a, [], 5)
    bm.register_computed(a, 5)
    assert bm.find_cached_prefix(Seq(2, [1, 2, 3, 4, 5])) == []
    assert bm.prefix_cache_queries == 0
