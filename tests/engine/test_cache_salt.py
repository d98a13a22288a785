"""cache_salt through EngineCore: tenants never share prefix-cache blocks, also across preemption."""
from __future__ import annotations

import pytest

from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.fakes import BYTE0, make_core, run_to_completion

GREEDY = dict(temperature=0.0)
SHARED = [BYTE0 + 40 + i % 50 for i in range(22)]  # 5 full blocks of 4 + 2


def _watch_owners(bm):
    """Record which salt published each cached block and fail any hit served to another salt."""
    owner: dict[tuple[int, bytes], str | None] = {}
    register, find = bm.register_computed, bm.find_cached_prefix

    def register_computed(seq, n):
        register(seq, n)
        for b in bm.tables.get(seq.seq_id, []):
            h = bm.blocks[b].block_hash
            if h is not None:
                assert owner.setdefault((b, h), seq.cache_salt) == seq.cache_salt, "block re-owned"

    def find_cached_prefix(seq):
        hit = find(seq)
        for b in hit:
            key = (b, bm.blocks[b].block_hash)
            assert owner[key] == seq.cache_salt, f"block {b} of {owner[key]!r} served to {seq.cache_salt!r}"
        return hit

    bm.register_computed, bm.find_cached_prefix = register_computed, find_cached_prefix


def test_equal_prompts_share_blocks_only_with_equal_salt():
    core, _ = make_core(block_size=4)
    _watch_owners(core.block_manager)
    hits = []
    for i, salt in enumerate(["a", "b", None, "a", "b", None]):
        before = core.stats().prefix_cache_hits
        core.add_request(f"r{i}", None, SHARED, SamplingParams(max_tokens=2, **GREEDY), cache_salt=salt)
        res = run_to_completion(core)
        hits.append(core.stats().prefix_cache_hits - before)
        assert res[f"r{i}"].num_cached_tokens == hits[-1]
    assert hits == [0, 0, 0, 20, 20, 20]


@pytest.mark.parametrize("sampling", [GREEDY, dict(temperature=0.8, seed=7)])
def test_salted_requests_survive_preemption_and_never_cross_tenants(sampling):
    salts = ["a", "b", None, "a", "b", "a"]

    def workload(core):
        for i, salt in enumerate(salts):
            core.add_request(f"r{i}", None, SHARED + [BYTE0 + 60 + i] * (i % 3),
                             SamplingParams(max_tokens=14, **sampling), cache_salt=salt)

    big, _ = make_core(num_blocks=512, block_size=4)
    workload(big)
    ref = {k: [c.token_ids for c in v.outputs] for k, v in run_to_completion(big).items()}
    small, _ = make_core(num_blocks=19, block_size=4, max_num_batched_tokens=32)  # 18 usable blocks
    _watch_owners(small.block_manager)
    workload(small)
    res = run_to_completion(small, check=lambda c: c.block_manager.check_invariants())
    assert small.stats().num_preemptions > 0 and small.stats().prefix_cache_hits > 0
    assert {k: [c.token_ids for c in v.outputs] for k, v in res.items()} == ref
    assert small.block_manager.num_free_blocks == 18


def test_salt_must_be_a_string():
    core, _ = make_core()
    with pytest.raises(RequestRejectedError, match="cache_salt"):
        core.add_request("r", None, SHARED, SamplingParams(max_tokens=1), cache_salt=123)
