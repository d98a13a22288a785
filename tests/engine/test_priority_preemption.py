"""--scheduling-policy priority preempts: a waiting request of higher priority (lower value) takes
the blocks or the slot of running requests of lower priority; equal priorities keep FCFS order;
preempted requests still finish with their solo greedy tokens (fake worker, which checks every
K/V slot before sampling)."""
from __future__ import annotations

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.fakes import BYTE0, make_core
from tests.engine.test_scheduler_property import expected_tokens


def prompt(k: int, n: int = 8) -> list[int]:
    return [BYTE0 + 40 + (k * 7 + i) % 60 for i in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def run(core, max_steps=2000, tokens=None):
    """Step to the end; per request: the step index of its first token and of its end, tokens."""
    first, done, tokens = {}, {}, {} if tokens is None else tokens
    for step in range(max_steps):
        if not core.has_unfinished():
            return first, done, tokens
        for out in core.step():
            c = out.outputs[0]
            tokens.setdefault(out.request_id, []).extend(c.token_ids)
            if c.token_ids:
                first.setdefault(out.request_id, step)
            if out.finished:
                done[out.request_id] = step
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("limit", ["slots", "blocks"])
def test_high_priority_arrival_gets_first_token_before_low_priority_ones_finish(mode, limit):
    # slots: two running requests fill max_num_seqs; blocks: they hold every KV block.
    kw = dict(max_num_seqs=2, num_blocks=64) if limit == "slots" else dict(max_num_seqs=8, num_blocks=9)
    core, ex = make_core(block_size=4, max_num_batched_tokens=64, policy="priority",
                         preemption_mode=mode, num_swap_blocks=32, **kw)
    core.add_request("low0", None, prompt(0), greedy(24), priority=5)
    core.add_request("low1", None, prompt(1), greedy(24), priority=5)
    early: dict[str, list[int]] = {}
    for _ in range(3):
        for out in core.step():
            early.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert len(core.scheduler.running) == 2
    core.add_request("high", None, prompt(2), greedy(4), priority=0)
    first, done, tokens = run(core, tokens=early)
    assert first["high"] == 0, "the high-priority request waited"
    assert done["high"] < min(done["low0"], done["low1"])
    assert core.stats().num_preemptions >= 1
    if mode == "swap":
        assert core.block_manager.swap.num_swapped_out >= 1
        assert core.block_manager.swap.num_swapped_in == core.block_manager.swap.num_swapped_out
    # the preempted requests still finish with their solo greedy tokens
    assert tokens["low0"] == expected_tokens(prompt(0), 24)
    assert tokens["low1"] == expected_tokens(prompt(1), 24)
    assert tokens["high"] == expected_tokens(prompt(2), 4)


def test_fcfs_does_not_preempt_for_a_new_arrival():
    core, ex = make_core(block_size=4, max_num_batched_tokens=64, max_num_seqs=2, num_blocks=64)
    core.add_request("low0", None, prompt(0), greedy(24), priority=5)
    core.add_request("low1", None, prompt(1), greedy(24), priority=5)
    for _ in range(3):
        core.step()
    core.add_request("high", None, prompt(2), greedy(4), priority=0)
    first, done, _ = run(core)
    assert first["high"] > min(done["low0"], done["low1"])
    assert core.stats().num_preemptions == 0


def test_equal_priorities_keep_fcfs_order_and_are_not_preempted():
    # One slot at a time: later arrivals of the same priority never overtake or preempt.
    core, ex = make_core(block_size=4, max_num_batched_tokens=64, max_num_seqs=1, num_blocks=64,
                         policy="priority")
    for k in range(5):
        core.add_request(f"r{k}", None, prompt(k), greedy(6), priority=3, arrival_time=float(k))
    early = {out.request_id: list(out.outputs[0].token_ids) for out in core.step()}
    core.add_request("late", None, prompt(9), greedy(6), priority=3)
    first, done, tokens = run(core, tokens=early)
    order = sorted(done, key=done.get)
    assert order == ["r0", "r1", "r2", "r3", "r4", "late"]
    assert core.stats().num_preemptions == 0
    for k in range(5):
        assert tokens[f"r{k}"] == expected_tokens(prompt(k), 6)


def test_lowest_priority_then_latest_arrival_is_preempted_first():
    core, ex = make_core(block_size=4, max_num_batched_tokens=64, max_num_seqs=3, num_blocks=64,
                         policy="priority")
    core.add_request("p1_early", None, prompt(0), greedy(30), priority=1, arrival_time=0.0)
    core.add_request("p2_early", None, prompt(1), greedy(30), priority=2, arrival_time=1.0)
    core.add_request("p2_late", None, prompt(3), greedy(30), priority=2, arrival_time=2.0)
    core.step()
    core.add_request("p0", None, prompt(2), greedy(3), priority=0)
    core.step()
    running = {s.request.request_id for s in core.scheduler.running}
    assert running == {"p0", "p1_early", "p2_early"}
    core.add_request("p1_new", None, prompt(4), greedy(3), priority=1)
    core.step()
    running = {s.request.request_id for s in core.scheduler.running}
    assert running == {"p0", "p1_early", "p1_new"}, "p2_early goes next; a p1 never preempts a p1"
    run(core)


def test_no_starvation_of_equal_priorities_under_a_stream_of_higher_ones():
    # Requests of one priority level all finish, in arrival order, while higher ones keep coming.
    core, ex = make_core(block_size=4, max_num_batched_tokens=32, max_num_seqs=2, num_blocks=64,
                         policy="priority")
    for k in range(4):
        core.add_request(f"mid{k}", None, prompt(k), greedy(5), priority=1, arrival_time=float(k))
    finished = []
    for i in range(400):
        if i < 60 and i % 6 == 0:
            core.add_request(f"hi{i}", None, prompt(10 + i), greedy(2), priority=0)
        for out in core.step():
            if out.finished:
                finished.append(out.request_id)
        if not core.has_unfinished():
            break
    mids = [r for r in finished if r.startswith("mid")]
    assert mids == ["mid0", "mid1", "mid2", "mid3"]


def test_swap_outs_of_a_step_that_was_never_sent_are_carried_by_the_next():
    # The high-priority request cannot be encoded: its step fails before reaching the worker,
    # but the victim it swapped out must still get its K/V copied before anyone reuses its blocks.
    core, ex = make_core(block_size=4, max_num_batched_tokens=64, max_num_seqs=1, num_blocks=64,
                         policy="priority", preemption_mode="swap", num_swap_blocks=16)
    core.add_request("low", None, prompt(0), greedy(12), priority=5)
    tokens = {}
    for _ in range(3):
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    bad = greedy(3)
    bad.top_k = 2**64  # changed after validation: the step cannot be encoded
    core.add_request("bad", None, prompt(1), bad, priority=0)
    outs = core.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "bad"] == ["error"]
    assert core.block_manager.swap.is_swapped(core.requests["low"].seqs[0].seq_id)
    core.add_request("next", None, prompt(2), greedy(3), priority=0)  # reuses the victim's blocks
    first, done, tokens = run(core, tokens=tokens)
    assert any(s.blocks_to_swap_out for s in ex.steps), "the swap-out never reached the worker"
    assert tokens["low"] == expected_tokens(prompt(0), 12)
    assert tokens["next"] == expected_tokens(prompt(2), 3)
