"""Multi-LoRA in the engine with a fake executor: the adapter keys the prefix cache, a step runs
at most max_loras adapters, slots travel as diffs, preemption (recompute and swap) keeps a
request's adapter; bad requests are refused up front."""
from __future__ import annotations

import pytest

from pagedserve.contracts.config import LoRAConfig
from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.lora_request import LoRARequest
from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.fakes import BYTE0, FakeExecutor, FakeTokenizer, make_config, run_to_completion
from tests.lora_fixtures import TINY_HF, write_adapter_files

SHARED = [BYTE0 + 40 + i % 50 for i in range(22)]  # 5 full blocks of 4 + 2


def make_lora_core(max_loras: int = 2, **kw):
    from pagedserve.engine.core import EngineCore

    config = make_config(**kw)
    config.model.hf_config = dict(TINY_HF)
    config.lora = LoRAConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=4)
    executor = SlotTrackingExecutor(config.cache.num_gpu_blocks_override, config.cache.block_size,
                                    num_swap_blocks=config.cache.num_swap_blocks or 0)
    return EngineCore(config, executor, FakeTokenizer()), executor


class SlotTrackingExecutor(FakeExecutor):
    """Keeps the workers' slot table from the steps' loads, and which adapter each seq ran with."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.slot_table: dict[int, int] = {}
        self.ran_with: dict[int, set[int | None]] = {}  # seq id -> adapter ids seen
        self.adapters_per_step: list[set[int]] = []
        self.loads = 0

    def execute(self, step):
        for load in step.lora_loads or ():
            self.slot_table[load.slot] = load.lora_id
            self.loads += 1
        slots = step.lora_slots.tolist() if step.lora_slots_buf else [-1] * len(step.seq_ids)
        assert len(slots) == len(step.seq_ids)
        ids = [None if s < 0 else self.slot_table[s] for s in slots]
        self.adapters_per_step.append({i for i in ids if i is not None})
        for sid, lora_id in zip(step.seq_ids, ids):
            self.ran_with.setdefault(sid, set()).add(lora_id)
        return super().execute(step)


@pytest.fixture
def adapters(tmp_path):
    return {i: LoRARequest(f"ad{i}", i, str(write_adapter_files(tmp_path / f"ad{i}"))) for i in range(1, 5)}


def test_equal_prompts_share_blocks_only_with_the_same_adapter(adapters):
    core, _ = make_lora_core(block_size=4)
    hits = []
    for i, lora in enumerate([adapters[1], adapters[2], None, adapters[1], adapters[2], None]):
        before = core.stats().prefix_cache_hits
        core.add_request(f"r{i}", None, SHARED, SamplingParams(max_tokens=2, temperature=0), lora_request=lora)
        run_to_completion(core)
        hits.append(core.stats().prefix_cache_hits - before)
    assert hits == [0, 0, 0, 20, 20, 20]


def _add(core, rid, prompt, lora, expected: dict, max_tokens: int = 6) -> None:
    core.add_request(rid, None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), lora_request=lora)
    expected[core.requests[rid].seqs[0].seq_id] = {None if lora is None else lora.lora_int_id}


def test_a_step_runs_at_most_max_loras_adapters_and_slots_load_once(adapters):
    core, ex = make_lora_core(max_loras=2, block_size=4)
    expected = {}
    for i in range(12):
        _add(core, f"r{i}", SHARED + [BYTE0 + i], adapters[1 + i % 4] if i % 5 else None, expected)
    core.step()
    s = core.stats()
    assert s.max_lora == 2 and len(s.lora_running) == 2 and set(s.lora_running) | set(s.lora_waiting) == {
        "ad1", "ad2", "ad3", "ad4"}
    res = run_to_completion(core)
    assert core.stats().lora_running == core.stats().lora_waiting == ()
    assert len(res) == 12 and all(r.outputs[0].finish_reason == "length" for r in res.values())
    assert max(len(a) for a in ex.adapters_per_step) == 2
    assert ex.loads < len(ex.adapters_per_step)  # loads are diffs, not one per step
    assert ex.ran_with == expected  # every sequence ran with its own adapter only


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_adapter(adapters, mode):
    expected = {}

    def workload(core):
        expected.clear()
        for i in range(6):
            _add(core, f"r{i}", SHARED + [BYTE0 + 60 + i] * (i % 3), adapters[1 + i % 2] if i % 3 else None,
                 expected, max_tokens=14)

    big, _ = make_lora_core(num_blocks=512, block_size=4)
    workload(big)
    ref = {k: v.outputs[0].token_ids for k, v in run_to_completion(big).items()}
    small, ex = make_lora_core(num_blocks=19, block_size=4, max_num_batched_tokens=32, preemption_mode=mode,
                               num_swap_blocks=64 if mode == "swap" else None)
    workload(small)
    res = run_to_completion(small, check=lambda c: c.block_manager.check_invariants())
    assert small.stats().num_preemptions > 0
    assert {k: v.outputs[0].token_ids for k, v in res.items()} == ref
    assert ex.ran_with == expected  # before and after every preemption


def test_requests_are_refused_without_lora_or_with_a_bad_adapter(tmp_path, adapters):
    from tests.engine.fakes import make_core

    plain, _ = make_core()
    with pytest.raises(RequestRejectedError, match="--enable-lora"):
        plain.add_request("r", None, SHARED, SamplingParams(max_tokens=1), lora_request=adapters[1])
    core, _ = make_lora_core()
    big = LoRARequest("big", 9, str(write_adapter_files(tmp_path / "big", r=8)))
    with pytest.raises(RequestRejectedError, match="'big'.*rank 8 is over --max-lora-rank 4"):
        core.add_request("r", None, SHARED, SamplingParams(max_tokens=1), lora_request=big)
    with pytest.raises(RequestRejectedError, match="not a directory"):
        core.add_request("r2", None, SHARED, SamplingParams(max_tokens=1),
                         lora_request=LoRARequest("gone", 10, str(tmp_path / "nowhere")))
    assert not core.has_unfinished()


def test_lora_request_fields_are_checked():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("a", 1, "")
