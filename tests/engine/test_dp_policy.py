"""The data-parallel routing policy: least loaded, prefix-aware, overloaded fallback, dead skipped."""
from __future__ import annotations

from pagedserve.engine.dp_policy import PrefixIndex, ReplicaView, choose_replica
from pagedserve.engine.kv_blocks import BlockManager, root_hash


def views(*specs):
    """(num_requests, kv_usage, prefix_blocks, alive) per replica."""
    return [ReplicaView(i, alive, n, kv, p) for i, (n, kv, p, alive) in enumerate(specs)]


def test_least_loaded_by_requests_then_kv_usage():
    assert choose_replica(views((3, 0.1, 0, True), (1, 0.9, 0, True), (2, 0.0, 0, True))).index == 1
    # equal requests: the one with less of its KV cache in use
    assert choose_replica(views((2, 0.6, 0, True), (2, 0.2, 0, True))).index == 1


def test_prefix_hit_wins_over_a_lighter_replica():
    v = choose_replica(views((0, 0.0, 0, True), (2, 0.1, 5, True)), max_imbalance=4)
    assert v.index == 1
    # the longest hit among the candidates
    v = choose_replica(views((1, 0.0, 2, True), (1, 0.0, 7, True), (0, 0.0, 0, True)))
    assert v.index == 1


def test_overloaded_replica_loses_its_prefix_affinity():
    # 4 requests beyond the least loaded: overloaded
    assert choose_replica(views((0, 0.0, 0, True), (4, 0.1, 9, True)), max_imbalance=4).index == 0
    assert choose_replica(views((0, 0.0, 0, True), (3, 0.1, 9, True)), max_imbalance=4).index == 1
    # KV usage far above the least loaded's: overloaded too
    assert choose_replica(views((1, 0.1, 0, True), (1, 0.5, 9, True)), kv_imbalance=0.25).index == 0
    # then the next-longest hit that is not overloaded
    assert choose_replica(views((0, 0.0, 0, True), (9, 0.0, 9, True), (1, 0.0, 3, True))).index == 2


def test_dead_replica_is_never_chosen():
    assert choose_replica(views((0, 0.0, 9, False), (5, 0.5, 0, True))).index == 1
    assert choose_replica(views((0, 0.0, 0, False), (0, 0.0, 0, False))) is None


def _cache_prompt(bm: BlockManager, tokens: list[int], salt=None) -> None:
    class Seq:
        seq_id = 1
        token_ids = tokens
        block_hashes: list = []
        cache_salt = salt
        lora_key = b""

    seq = Seq()
    seq.block_hashes = []
    bm.allocate_new(seq, [], len(tokens))
    bm.register_computed(seq, len(tokens))
    bm.free(seq.seq_id)


def test_prefix_index_counts_the_block_managers_own_hits():
    B = 16
    seed = b"model"
    bms = [BlockManager(64, B, True, seed), BlockManager(64, B, True, seed)]
    shared = list(range(100, 100 + 3 * B))
    _cache_prompt(bms[1], shared + [7] * B)
    index = PrefixIndex(B, root_hash(seed), 2)
    prompt = shared + [9] * (2 * B)
    hashes = index.block_hashes(prompt, None)
    assert len(hashes) == (len(prompt) - 1) // B
    hits = index.hits(hashes, lambda r, h: bms[r].is_cached(h), [True, True])
    assert hits == [0, 3]
    # another tenant's salt never matches
    salted = index.block_hashes(prompt, "tenant-b")
    assert index.hits(salted, lambda r, h: bms[r].is_cached(h), [True, True]) == [0, 0]
    # a dead replica reports no hit
    assert index.hits(hashes, lambda r, h: bms[r].is_cached(h), [True, False]) == [0, 0]


def test_prefix_index_remembers_routed_prompts_until_their_replica_forgets():
    index = PrefixIndex(16, b"\0" * 32, 2, max_blocks=4)
    prompt = list(range(200))
    hashes = index.block_hashes(prompt, None)
    assert len(hashes) == 4  # capped
    never = lambda r, h: False  # noqa: E731 - nothing computed yet
    assert index.hits(hashes, never, [True, True]) == [0, 0]
    index.routed(hashes, 0)
    assert index.hits(hashes, never, [True, True]) == [4, 0]
    # a prompt sharing two blocks
    other = index.block_hashes(prompt[:32] + [1] * 40, None)
    assert index.hits(other, never, [True, True]) == [2, 0]
    index.forget_replica(0)
    assert index.hits(hashes, never, [True, True]) == [0, 0]


def test_prefix_record_is_bounded():
    index = PrefixIndex(16, b"\0" * 32, 2, record_size=8)
    for start in range(0, 1000, 100):
        index.routed(index.block_hashes(list(range(start, start + 80)), None), 1)
    assert len(index._record) == 8
