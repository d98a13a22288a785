"""Property test: thousands of random add / step / abort / preempt operations on a tiny KV cache,
preempting by recompute or by swapping to a tiny host pool (which fills up: then recompute).

Beam-search requests (engine/beam_engine.py) join the mix: their beams fork and free shared
blocks, and each must end with exactly the beams of the pure reference search.

After every operation the block accounting must be exact (free + used == total, ref counts equal
the number of tables holding each block, cached hashes consistent), the engine's view of every
sequence must equal the fake worker's (token ids, computed count, block table), and every
finished greedy request must have exactly the tokens it would have had alone — whatever
preemption, chunking, prefix-cache hits and aborts happened on the way.
"""
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedserve.engine.sampling_params import BeamSearchParams
from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.request import SeqStatus
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.contracts.messages import SamplingOptions
from tests.engine.beam_fakes import fake_top, reference_beam_search
from tests.engine.fakes import BYTE0, default_next_token, make_core

GREEDY_OPTS = SamplingOptions(temperature=0.0)

op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 24), st.integers(1, 20), st.integers(1, 3),
              st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("abort_inflight"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
    st.tuples(st.just("beam"), st.integers(1, 12), st.integers(1, 8), st.integers(1, 3), st.booleans(),
              st.integers(0, 3)),
)


def expected_tokens(prompt_ids, max_tokens):
    tokens = list(prompt_ids)
    for _ in range(max_tokens):
        tokens.append(default_next_token(tokens, GREEDY_OPTS, len(prompt_ids)))
    return tokens[len(prompt_ids):]


def check_consistency(core, ex):
    bm = core.block_manager
    sched = core.scheduler
    bm.check_invariants()
    running = {s.seq_id: s for s in sched.running}
    assert set(bm.tables) == set(running), "only running sequences hold blocks"
    # A beam request's forks may take the running set past max_num_seqs, by its width - 1 at most.
    beam_reqs = {id(s.request): s.request.beam.params.beam_width for s in running.values() if s.request.beam}
    assert len(running) <= sched.max_num_seqs + sum(w - 1 for w in beam_reqs.values())
    for s in sched.waiting:
        assert s.status is SeqStatus.WAITING and s.num_computed_tokens == 0 and not s.on_worker
    swap = bm.swap
    assert set(swap.tables) <= {s.seq_id for s in sched.waiting}, "only waiting sequences are swapped out"
    for sid, host in swap.tables.items():
        assert len(host) == bm.blocks_for(swap.num_computed[sid]) and swap.num_computed[sid] > 0
    for sid, s in running.items():
        assert s.status is SeqStatus.RUNNING
        table = bm.tables[sid]
        assert len(table) * bm.block_size >= s.num_computed_tokens
        if not s.on_worker:
            assert s in sched._forked  # a beam fork announced at the next step
            continue
        w = ex.seqs[sid]
        beam = s.request.beam
        # Reported this round: the worker appended its token (a report older than a preemption is
        # stale until the beam, recomputed, reports again).
        if beam is not None and sid in beam.reports and s.num_computed_tokens == s.num_tokens:
            assert w.token_ids == s.token_ids + [beam.reports[sid][0]]
        else:
            assert w.token_ids == s.token_ids
        assert w.computed == s.num_computed_tokens
        assert w.table == table
    on_worker = {s.seq_id for s in sched.running if s.on_worker}
    unannounced = {s.seq_id for s in sched._forked}  # beam forks: NewSeq at the next step
    assert set(ex.seqs) == on_worker | set(sched._finished_ids)
    # A fork preempted before its announcement waits (it comes back as a NewSeq); _unshare_forks skips it.
    assert all(s.status in (SeqStatus.RUNNING, SeqStatus.WAITING) or s.is_finished for s in sched._forked)
    assert unannounced.isdisjoint(ex.seqs)
    assert not on_worker & set(sched._finished_ids)


# Regression: a swapped-out beam fork that was never announced (its tail copy never ran) came back
# with a bad cached prefix; an idle beam (all computed, waiting for its siblings) swapped out came
# back with nothing to compute.
@example(num_blocks=8, block_size=4, budget=5, max_seqs=4, policy="fcfs", prefix=False, mode="swap", num_swap_blocks=6,
         ops=[("step",)] * 5 + [("abort", 0)] * 2 + [("add", 1, 1, 1, 0, 0)] * 7 + [
             ("beam", 10, 4, 2, False, 0), ("step",), ("step",), ("step",), ("step",), ("add", 1, 1, 1, 0, 1), ("step",),
             ("beam", 3, 7, 2, False, 2), ("step",), ("add", 23, 16, 1, 2, 3), ("beam", 9, 8, 3, False, 3), ("step",),
             ("step",), ("preempt", 9), ("preempt", 15), ("preempt", 7), ("step",), ("step",), ("step",),
             ("add", 19, 8, 1, 2, 2), ("step",), ("beam", 11, 8, 1, False, 2), ("step",), ("step",), ("step",),
             ("preempt", 31), ("abort", 7), ("step",), ("add", 2, 7, 3, 0, 2)])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(7, 16), block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(4, 32), max_seqs=st.integers(1, 6), policy=st.sampled_from(["fcfs", "priority"]),
    prefix=st.booleans(), ops=st.lists(op, min_size=20, max_size=90),
    mode=st.sampled_from(["recompute", "swap"]), num_swap_blocks=st.integers(0, 12),
)
def test_random_operations_keep_block_accounting_exact(num_blocks, block_size, budget, max_seqs, policy,
                                                         prefix, ops, mode, num_swap_blocks):
    core, ex = make_core(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                         max_num_seqs=max_seqs, policy=policy, prefix_caching=prefix, max_model_len=64,
                         preemption_mode=mode, num_swap_blocks=num_swap_blocks, top_logprobs=fake_top)
    capacity = core.block_manager.num_usable_blocks * block_size
    families = [[BYTE0 + 40 + (f * 11 + i * 5) % 60 for i in range(24)] for f in range(4)]
    requests = {}  # request id -> (prompt, max_tokens, n)
    beams = {}  # request id -> (prompt, BeamSearchParams)
    results = {}
    aborted = set()
    counter = 0

    def collect(outs):
        for o in outs:
            r = results.setdefault(o.request_id, {})
            for c in o.outputs:
                acc = r.setdefault(c.index, [[], None])
                acc[0] += c.token_ids
                acc[1] = c.finish_reason

    for item in ops:
        kind = item[0]
        if kind == "add":
            _, plen, max_tokens, n, priority, family = item
            p = families[family][:plen]
            if plen + max_tokens - 1 > capacity:
                continue  # would be rejected (tested elsewhere)
            rid = f"r{counter}"
            counter += 1
            core.add_request(rid, None, p, SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0),
                             priority=priority)
            requests[rid] = (p, max_tokens, n)
        elif kind == "beam":
            _, plen, max_tokens, width, ignore_eos, family = item
            p = families[family][:plen]
            rid = f"b{counter}"
            counter += 1
            params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos)
            try:
                core.add_request(rid, None, p, params)
            except RequestRejectedError:
                continue  # too wide or too long for this tiny engine (tested elsewhere)
            beams[rid] = (p, params)
        elif kind == "step":
            collect(core.step())
        elif kind in ("abort", "abort_inflight") and requests:
            live = [r for r in [*requests, *beams] if r in core.requests]
            if not live:
                continue
            rid = live[item[1] % len(live)]
            if kind == "abort":
                out = core.abort_request(rid)
                collect([out])
            else:
                sched = core.schedule()
                if sched is None:
                    continue
                step_out = ex.execute(sched.step_input)
                collect([core.abort_request(rid)])
                collect(core.process(sched, step_out))
            aborted.add(rid)
        elif kind == "preempt" and core.scheduler.running:
            # What priority preemption may pick (engine/scheduler.py _preempt_for): never a beam.
            running = [s for s in core.scheduler.running if s.request.beam is None]
            if running:
                core.scheduler._preempt(running[item[1] % len(running)])
        check_consistency(core, ex)

    # drain: everything not aborted finishes with exactly its solo greedy output
    for _ in range(5000):
        if not core.has_unfinished():
            break
        collect(core.step())
        check_consistency(core, ex)
    assert not core.has_unfinished()
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks and not bm.tables and bm.usage == 0.0
    assert bm.swap.num_free_blocks == bm.swap.num_blocks and not bm.swap.tables
    for rid, (p, params) in beams.items():
        outs = results[rid]
        if rid in aborted:
            continue
        want = reference_beam_search(p, params, max_model_len=64)
        assert [(outs[i][0], outs[i][1]) for i in sorted(outs)] == [(h.token_ids, h.finish_reason) for h in want]
    for rid, (p, max_tokens, n) in requests.items():
        if rid in aborted:
            assert all(reason in ("abort", "length") for _, reason in results[rid].values())
            continue
        want = expected_tokens(p, max_tokens)
        assert sorted(results[rid]) == list(range(n))
        for toks, reason in results[rid].values():
            assert (toks, reason) == (want, "length")
