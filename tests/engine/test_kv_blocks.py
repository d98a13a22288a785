from dataclasses import dataclass, field

import pytest

from pagedserve.engine.kv_blocks import NULL_BLOCK, BlockManager

# CPython hashes a non-negative int k to k mod (2**61 - 1), and a tuple mixes only its items'
# hashes: under Python's hash() the token k and the token k + MERSENNE61 are the same block.
MERSENNE61 = 2**61 - 1


@dataclass
class Seq:
    seq_id: int
    token_ids: list[int]
    block_hashes: list = field(default_factory=list)
    cache_salt: str | None = None
    lora_key: bytes = b""


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


# ---- prefix-cache isolation (issue 10, fault 1) --------------------------------------------

def test_colliding_python_hashes_never_share_kv():
    """Under ``hash((parent, tuple(tokens)))`` these two prompts have equal block hashes, so the
    second tenant was served the first one's K/V. A hit must only ever cover equal tokens."""
    victim = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    attacker = [11 + MERSENNE61] + victim[1:]
    assert hash((None, tuple(victim[:4]))) == hash((None, tuple(attacker[:4])))  # the old key
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Seq(1, victim)
    bm.allocate_new(a, [], len(victim))
    bm.register_computed(a, len(victim))
    assert bm.find_cached_prefix(Seq(2, list(victim))) == bm.table(1)[:2]  # the genuine hit
    assert bm.find_cached_prefix(Seq(3, attacker)) == []
    # a collision in a later block (same first block, colliding second block) is refused too
    later = victim[:4] + [15 + MERSENNE61] + victim[5:]
    assert bm.find_cached_prefix(Seq(4, later)) == bm.table(1)[:1]
    bm.check_invariants()


def _cached_run(bm: BlockManager, seq_id: int, tokens: list[int], salt: str | None) -> list[int]:
    seq = Seq(seq_id, list(tokens), cache_salt=salt)
    hit = bm.find_cached_prefix(seq)
    bm.allocate_new(seq, hit, len(tokens))
    bm.register_computed(seq, len(tokens))
    return hit


def test_cache_salt_isolates_tenants_and_equal_salts_share():
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(100, 113))  # 3 full blocks + 1
    assert _cached_run(bm, 1, prompt, "tenant-a") == []
    assert _cached_run(bm, 2, prompt, "tenant-b") == []  # different salt: no block shared
    assert _cached_run(bm, 3, prompt, None) == []  # no salt is a tenant of its own
    assert _cached_run(bm, 4, prompt, "") == []  # an empty salt is not "no salt"
    assert _cached_run(bm, 5, prompt, "tenant-a") == bm.table(1)[:3]
    assert _cached_run(bm, 6, prompt, "tenant-b") == bm.table(2)[:3]
    assert _cached_run(bm, 7, prompt, None) == bm.table(3)[:3]
    tables = [set(bm.table(i)) for i in (1, 2, 3, 4)]
    assert all(not (x & y) for i, x in enumerate(tables) for y in tables[i + 1:])
    # the salt keys the whole chain: every block hash differs, not only the first
    a, b = Seq(8, prompt, cache_salt="tenant-a"), Seq(9, prompt, cache_salt="tenant-b")
    bm.find_cached_prefix(a), bm.find_cached_prefix(b)
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes)) and len(a.block_hashes) == 3
    assert bm.prefix_cache_hits == 3 * 3 * 4
    bm.check_invariants()


def test_chain_is_seeded_per_model():
    from pagedserve.engine.kv_blocks import model_hash_seed
    from pagedserve.contracts.config import ModelConfig

    seeds = {
        model_hash_seed(ModelConfig(model="/models/a", dtype="float32")),
        model_hash_seed(ModelConfig(model="/models/b", dtype="float32")),
        model_hash_seed(ModelConfig(model="/models/a", dtype="bfloat16")),
        model_hash_seed(ModelConfig(model="/models/a", dtype="float32", load_format="dummy")),
        model_hash_seed(ModelConfig(model="/models/a", dtype="float32", load_format="dummy", seed=1)),
        model_hash_seed(ModelConfig(model=None, load_format="dummy", hf_config={"hidden_size": 64})),
        model_hash_seed(ModelConfig(model=None, load_format="dummy", hf_config={"hidden_size": 32})),
    }
    assert len(seeds) == 7 and all(isinstance(s, bytes) for s in seeds)
    assert model_hash_seed(ModelConfig(model="/models/a")) == model_hash_seed(ModelConfig(model="/models/a"))
    prompt = list(range(9))
    x, y = Seq(1, prompt), Seq(2, prompt)
    BlockManager(8, 4, hash_seed=b"model-x").find_cached_prefix(x)
    BlockManager(8, 4, hash_seed=b"model-y").find_cached_prefix(y)
    assert len(x.block_hashes) == 2 and all(p != q for p, q in zip(x.block_hashes, y.block_hashes))
    # the digests are sha256-sized bytes, not Python ints
    assert all(isinstance(h, bytes) and len(h) == 32 for h in x.block_hashes)


def test_hash_block_covers_parent_tokens_and_extra_keys():
    from pagedserve.engine.kv_blocks import hash_block

    root = b"\0" * 32
    base = hash_block(root, [1, 2, 3, 4])
    assert base == hash_block(root, [1, 2, 3, 4])
    others = [hash_block(b"\1" + root[1:], [1, 2, 3, 4]), hash_block(root, [1, 2, 3, 5]),
              hash_block(root, [1 + MERSENNE61, 2, 3, 4]), hash_block(root, [1, 2, 3, 4], b"salt"),
              hash_block(root, [2**32 + 1, 2, 3, 4]), hash_block(root, [1, 2**32 + 2, 3, 4])]
    assert len({base, *others}) == 7


# ---- beam forks ------------------------------------------------------------------------------

def test_fork_shares_every_block_and_copy_on_write_unshares_only_the_written_tail():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent = Seq(1, list(range(10)))  # 3 blocks, the last one partial (2 tokens)
    table = list(bm.allocate_new(parent, [], 10))
    assert bm.fork(1, 2) == table and bm.fork(1, 3) == table
    assert all(bm.blocks[b].ref_count == 3 for b in table) and bm.num_free_blocks == 6
    bm.check_invariants()
    with pytest.raises(RuntimeError):
        bm.fork(1, 2)
    # position 10 lands in the shared partial block: a private copy, the full blocks stay shared
    (src, dst), = bm.copy_on_write(2, 10)
    assert src == table[2] and bm.table(2) == table[:2] + [dst] and bm.blocks[src].ref_count == 2
    assert bm.copy_on_write(2, 10) == []  # already private
    assert bm.copy_on_write(1, 12) == []  # a block not allocated yet: append_slots gives a fresh one
    bm.check_invariants()
    # the last holder keeps the original block; freeing all returns every block
    (_, dst3), = bm.copy_on_write(3, 10)
    assert bm.copy_on_write(1, 10) == [] and bm.blocks[table[2]].ref_count == 1
    for sid in (1, 2, 3):
        bm.free(sid)
        bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_copy_on_write_without_a_free_block_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)  # 3 usable
    bm.allocate_new(Seq(1, list(range(10))), [], 10)  # all 3
    bm.fork(1, 2)
    assert bm.copy_on_write(2, 10) is None
    assert bm.table(2) == bm.table(1)
    bm.check_invariants()


def test_first_block_key_parts_are_length_prefixed_so_no_two_tuples_collide():
    """(salt, adapter id, adapter path) enter the first block's key each with its length: salt "x"
    with adapter (1, "/a") and salt "xL1\\0/a" on the base model were the same chain (issue 37)."""
    from pagedserve.engine.lora_request import LoRARequest

    def first_hash(salt, lora):
        bm = BlockManager(num_blocks=8, block_size=4)
        s = Seq(1, list(range(9)), cache_salt=salt, lora_key=b"" if lora is None else lora.cache_key())
        bm.find_cached_prefix(s)
        return s.block_hashes[0]

    a1 = LoRARequest("a", 1, "/a")
    tuples = [(None, None), ("", None), ("x", a1), ("xL1\0/a", None), ("x", None), (None, a1),
              ("xL1\0/a", a1), ("x", LoRARequest("a", 1, "/a\0")), ("x", LoRARequest("a", 11, "/a")),
              ("x", LoRARequest("a", 1, "1\0/a")), ("S", None), (None, LoRARequest("b", 1, "/a"))]
    hashes = [first_hash(salt, lora) for salt, lora in tuples]
    assert hashes[0] == first_hash(None, None)
    # LoRARequest names are not part of the key (same id and path = same weights)
    assert hashes[5] == hashes[-1]
    assert len(set(hashes[:-1])) == len(tuples) - 1, "two different (salt, adapter) tuples share a chain"
