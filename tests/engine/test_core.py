"""EngineCore + Scheduler + BlockManager against the worker-mirroring FakeExecutor."""
import pytest

from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.sampling_params import SamplingParams
from tests.engine.fakes import BYTE0, EOS, FakeTokenizer, make_core, run_to_completion

tok = FakeTokenizer()
GREEDY = dict(temperature=0.0)


def prompt(seed: int, length: int) -> list[int]:
    return [BYTE0 + 33 + (seed * 7 + i * 13) % 90 for i in range(length)]


def scripted(tokens_after_prompt):
    """A model that emits a fixed token list (then 'z' forever)."""
    def next_token(tokens, options, num_prompt):
        i = len(tokens) - num_prompt
        return tokens_after_prompt[i] if i < len(tokens_after_prompt) else BYTE0 + ord("z")
    return next_token


def outputs_of(results):
    return {rid: [c.token_ids for c in r.outputs] for rid, r in results.items()}


def add_workload(core, num=8, plen=lambda i: 5 + 7 * i, max_tokens=lambda i: 3 + i % 5, **sp):
    for i in range(num):
        core.add_request(f"r{i}", None, prompt(i, plen(i)), SamplingParams(max_tokens=max_tokens(i), **(sp or GREEDY)))


# ---- budget, chunked prefill ------------------------------------------------------------------

def test_token_budget_and_max_num_seqs_respected_every_step():
    core, ex = make_core(num_blocks=256, max_num_batched_tokens=16, max_num_seqs=3)
    add_workload(core, num=6)

    def check(core):
        step = ex.steps[-1]
        assert sum(step.num_new_tokens) <= 16
        assert len(step.seq_ids) <= 3
        assert len(core.scheduler.running) <= 3
    res = run_to_completion(core, check=check)
    assert all(r.finished and r.outputs[0].finish_reason == "length" for r in res.values())
    assert any(sum(s.num_new_tokens) == 16 for s in ex.steps)


def test_chunked_prefill_splits_resumes_and_keeps_decodes_flowing():
    ref_core, _ = make_core(num_blocks=256, max_num_batched_tokens=512)
    ref_core.add_request("short", None, prompt(1, 5), SamplingParams(max_tokens=8, **GREEDY))
    ref_core.add_request("long", None, prompt(2, 50), SamplingParams(max_tokens=4, **GREEDY))
    ref = outputs_of(run_to_completion(ref_core))

    core, ex = make_core(num_blocks=256, max_num_batched_tokens=16)
    core.add_request("short", None, prompt(1, 5), SamplingParams(max_tokens=8, **GREEDY))
    first = core.step()  # short prefills alone
    core.add_request("long", None, prompt(2, 50), SamplingParams(max_tokens=4, **GREEDY))
    res = outputs_of(run_to_completion(core))
    res["short"][0] = first[0].outputs[0].token_ids + res["short"][0]
    assert res == ref
    long_id = next(ns.seq_id for s in ex.steps for ns in s.new_seqs if len(ns.token_ids) == 50)
    chunks = [n for s in ex.steps for sid, n in zip(s.seq_ids, s.num_new_tokens) if sid == long_id]
    # 15 of the first step's 16 tokens go to the long prompt (1 is the decode), then 15, 15, 5
    assert chunks[:4] == [15, 15, 15, 5] and chunks[4:] == [1, 1, 1]
    # the short request decoded in every step while the long prompt was being prefilled
    short_id = ex.steps[0].seq_ids[0]
    assert all(short_id in s.seq_ids and s.seq_ids[0] == short_id for s in ex.steps[1:5])


def test_batched_equals_one_at_a_time():
    alone = {}
    for i in range(5):
        core, _ = make_core()
        core.add_request(f"r{i}", None, prompt(i, 3 + 9 * i), SamplingParams(max_tokens=6, **GREEDY))
        alone.update(outputs_of(run_to_completion(core)))
    core, _ = make_core(max_num_batched_tokens=20)
    for i in range(5):
        core.add_request(f"r{i}", None, prompt(i, 3 + 9 * i), SamplingParams(max_tokens=6, **GREEDY))
    assert outputs_of(run_to_completion(core)) == alone


# ---- preemption ---------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("sampling", [GREEDY, dict(temperature=0.8, seed=7)])
def test_preemption_gives_identical_outputs(prefix_caching, sampling):
    big, _ = make_core(num_blocks=512, prefix_caching=prefix_caching)
    add_workload(big, num=6, plen=lambda i: 6 + 3 * i, max_tokens=lambda i: 12, **sampling)
    ref = outputs_of(run_to_completion(big))

    small, ex = make_core(num_blocks=13, block_size=4, prefix_caching=prefix_caching)  # 12 usable blocks
    add_workload(small, num=6, plen=lambda i: 6 + 3 * i, max_tokens=lambda i: 12, **sampling)
    res = outputs_of(run_to_completion(small, check=lambda c: c.block_manager.check_invariants()))
    assert small.stats().num_preemptions > 0
    assert res == ref
    # a preempted sequence came back as a NewSeq with its generated tokens included
    assert any(ns.num_prompt_tokens < len(ns.token_ids) for s in ex.steps for ns in s.new_seqs)
    assert small.block_manager.num_free_blocks == 12


def test_preemption_victim_is_latest_arrival_and_resumes_first():
    core, ex = make_core(num_blocks=7, block_size=4, max_num_batched_tokens=64)  # 6 usable blocks
    core.add_request("old", None, prompt(1, 8), SamplingParams(max_tokens=12, **GREEDY), arrival_time=1.0)
    core.add_request("new", None, prompt(2, 8), SamplingParams(max_tokens=12, **GREEDY), arrival_time=2.0)
    core.step()
    # arrives when the cache is full: it waits, and the victim will be queued before it
    core.add_request("later", None, prompt(3, 3), SamplingParams(max_tokens=2, **GREEDY), arrival_time=3.0)
    seen_preempted = []
    while core.has_unfinished():
        sched = core.schedule()
        seen_preempted += [s.request.request_id for s in sched.preempted]
        if sched.preempted:
            # the victim is at the front of the waiting queue, before "later"
            assert core.scheduler.waiting[0].request.request_id == "new"
        core.process(sched, ex.execute(sched.step_input))
    assert seen_preempted and set(seen_preempted) == {"new"}


def test_priority_policy_order_and_victim():
    core, ex = make_core(policy="priority", max_num_seqs=1)
    core.add_request("low", None, prompt(1, 4), SamplingParams(max_tokens=2, **GREEDY), priority=5)
    core.add_request("high", None, prompt(2, 4), SamplingParams(max_tokens=2, **GREEDY), priority=-1)
    core.add_request("mid", None, prompt(3, 4), SamplingParams(max_tokens=2, **GREEDY), priority=0)
    finished = []
    while core.has_unfinished():
        finished += [o.request_id for o in core.step() if o.finished]
    assert finished == ["high", "mid", "low"]

    # under memory pressure the lowest priority (even if it arrived first) is preempted
    core, ex = make_core(policy="priority", num_blocks=7, block_size=4)
    core.add_request("low", None, prompt(1, 8), SamplingParams(max_tokens=12, **GREEDY), priority=9, arrival_time=1)
    core.add_request("high", None, prompt(2, 8), SamplingParams(max_tokens=12, **GREEDY), priority=0, arrival_time=2)
    victims = []
    while core.has_unfinished():
        sched = core.schedule()
        victims += [s.request.request_id for s in sched.preempted]
        core.process(sched, ex.execute(sched.step_input))
    assert victims and set(victims) == {"low"}


def test_fcfs_waiting_queue_does_not_overtake():
    core, ex = make_core(num_blocks=9, block_size=4, max_num_batched_tokens=64)  # 8 usable
    core.add_request("a", None, prompt(1, 20), SamplingParams(max_tokens=3, **GREEDY))
    core.add_request("b", None, prompt(2, 20), SamplingParams(max_tokens=3, **GREEDY))  # does not fit next to a
    core.add_request("c", None, prompt(3, 2), SamplingParams(max_tokens=3, **GREEDY))  # would fit, must wait
    core.step()
    assert [s.request.request_id for s in core.scheduler.running] == ["a"]
    run_to_completion(core)


# ---- abort --------------------------------------------------------------------------------------

def test_abort_in_every_state_returns_every_block():
    core, ex = make_core(num_blocks=13, block_size=4, max_num_batched_tokens=8)
    bm = core.block_manager
    core.add_request("waiting", None, prompt(0, 30), SamplingParams(max_tokens=5, **GREEDY))
    out = core.abort_request("waiting")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert core.abort_request("waiting") is None and core.abort_request("nope") is None

    core.add_request("prefill", None, prompt(1, 30), SamplingParams(max_tokens=5, **GREEDY))
    core.step()  # one chunk of 8
    assert bm.num_free_blocks < 12
    core.abort_request("prefill")
    assert bm.num_free_blocks == 12 and not core.has_unfinished()

    core.add_request("decode", None, prompt(2, 5), SamplingParams(max_tokens=30, **GREEDY))
    core.step()
    core.step()
    seq_id = ex.steps[-1].seq_ids[0]
    core.abort_request("decode")
    assert bm.num_free_blocks == 12

    # aborted between schedule and process (the step is in flight): its token is ignored
    core.add_request("inflight", None, prompt(3, 5), SamplingParams(max_tokens=30, **GREEDY))
    sched = core.schedule()
    assert seq_id in sched.step_input.finished_seq_ids  # the worker forgets the aborted seq
    out = ex.execute(sched.step_input)
    core.abort_request("inflight")
    assert core.process(sched, out) == []
    assert bm.num_free_blocks == 12

    # preempted (back in waiting) then aborted
    core.add_request("p1", None, prompt(4, 8), SamplingParams(max_tokens=30, **GREEDY))
    core.add_request("p2", None, prompt(5, 8), SamplingParams(max_tokens=30, **GREEDY))
    while core.stats().num_preemptions == 0:
        core.step()
    victim = next(s for s in core.scheduler.waiting)
    core.abort_request(victim.request.request_id)
    core.abort_request("p1" if victim.request.request_id == "p2" else "p2")
    bm.check_invariants()
    assert bm.num_free_blocks == 12 and not bm.tables
    # the next step tells the worker to forget everything that was aborted
    core.add_request("last", None, prompt(6, 3), SamplingParams(max_tokens=1, **GREEDY))
    run_to_completion(core)
    # the worker only still holds "last", whose id goes out with the next step
    assert len(ex.seqs) == 1 and set(ex.seqs) == set(core.scheduler._finished_ids)


# ---- rejection ----------------------------------------------------------------------------------

def test_requests_that_can_never_fit_are_rejected_with_numbers():
    core, _ = make_core(num_blocks=9, block_size=4, max_model_len=64)  # 8 usable blocks = 32 tokens
    with pytest.raises(RequestRejectedError, match=r"60 tokens and max_tokens is 10: 70 > .* 64"):
        core.add_request("a", None, prompt(0, 60), SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejectedError, match=r"needs 9 KV blocks of 4 tokens but the whole cache has 8"):
        core.add_request("b", None, prompt(0, 30), SamplingParams(max_tokens=6))
    with pytest.raises(RequestRejectedError, match=r"64 tokens .*\(max_model_len\) is 64"):
        core.add_request("c", None, prompt(0, 64), SamplingParams(max_tokens=None))
    with pytest.raises(RequestRejectedError, match="empty"):
        core.add_request("d", None, [], SamplingParams())
    core.add_request("ok", None, prompt(0, 30), SamplingParams(max_tokens=3))  # 32 K/V tokens: fits exactly
    with pytest.raises(RequestRejectedError, match="already in use"):
        core.add_request("ok", None, prompt(0, 3), SamplingParams())
    assert isinstance(RequestRejectedError("x"), ValueError)
    # max_tokens=None is capped by what the cache can hold, not rejected
    core.add_request("open", None, prompt(1, 10), SamplingParams(max_tokens=None, **GREEDY))
    res = run_to_completion(core)
    assert res["open"].outputs[0].finish_reason == "length"
    assert len(res["open"].outputs[0].token_ids) == 32 + 1 - 10


# ---- stop conditions ----------------------------------------------------------------------------

def run_one(script, **params):
    core, _ = make_core(next_token=scripted(script))
    core.add_request("r", None, prompt(0, 5), SamplingParams(**params))
    deltas = []
    while core.has_unfinished():
        deltas += core.step()
    return deltas


def merged(deltas):
    c = deltas[-1].outputs[0]
    return "".join(d.outputs[0].text for d in deltas), [t for d in deltas for t in d.outputs[0].token_ids], c


def test_eos_stops_unless_ignored_and_is_not_in_text():
    script = tok.byte_ids("ab") + [EOS] + tok.byte_ids("cd")
    text, ids, last = merged(run_one(script, max_tokens=10))
    assert (text, ids, last.finish_reason, last.stop_reason) == ("ab", script[:3], "stop", None)
    text, ids, last = merged(run_one(script, max_tokens=5, ignore_eos=True))
    assert (text, ids, last.finish_reason) == ("abcd", script, "length")


def test_min_tokens_defers_eos_and_stops():
    script = [EOS] + tok.byte_ids("ab!cd")
    text, ids, last = merged(run_one(script, max_tokens=10, min_tokens=3, stop=["!"], stop_token_ids=[EOS]))
    # the fake worker honours min_tokens_blocked_ids: EOS is replaced by "x" at step 0
    assert text == "xab" and last.stop_reason == "!"


def test_stop_token_ids_reported():
    stop_id = tok.byte_ids("#")[0]
    text, ids, last = merged(run_one(tok.byte_ids("ab#cd"), max_tokens=10, stop_token_ids=[stop_id]))
    assert (text, last.finish_reason, last.stop_reason) == ("ab", "stop", stop_id)
    assert ids[-1] == stop_id
    text, _, _ = merged(run_one(tok.byte_ids("ab#cd"), max_tokens=10, stop_token_ids=[stop_id],
                                include_stop_str_in_output=True))
    assert text == "ab#"


def test_stop_string_finishes_and_nothing_after_is_emitted():
    deltas = run_one(tok.byte_ids("hi ST") + [tok.word("STOP")] + tok.byte_ids("more"), max_tokens=20, stop="STOP")
    text, ids, last = merged(deltas)
    assert text == "hi ST"
    assert (last.finish_reason, last.stop_reason) == ("stop", "STOP")
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert len(ids) == 6
    # "ST" was held back until the decision
    assert [d.outputs[0].text for d in deltas][:5] == ["h", "i", " ", "", ""]


def test_max_tokens_length_and_delta_concatenation():
    deltas = run_one(tok.byte_ids("abcdefgh"), max_tokens=4)
    assert [d.outputs[0].text for d in deltas] == ["a", "b", "c", "d"]
    assert deltas[-1].outputs[0].finish_reason == "length" and deltas[-1].finished
    assert deltas[0].metrics.first_token_time is not None and deltas[-1].metrics.finished_time is not None


def test_logprobs_shape():
    deltas = run_one(tok.byte_ids("abc"), max_tokens=3, logprobs=2)
    lps = [lp for d in deltas for lp in d.outputs[0].logprobs]
    assert len(lps) == 3
    first = lps[0]
    a = tok.byte_ids("a")[0]
    assert first[a].logprob == -0.25 and first[a].rank == 1 and first[a].decoded_token == "a"
    assert len(first) == 2
    assert deltas[-1].outputs[0].cumulative_logprob == pytest.approx(-0.75)
    assert run_one(tok.byte_ids("abc"), max_tokens=2)[-1].outputs[0].logprobs is None


def test_worker_error_fails_the_step_requests():
    core, ex = make_core()
    core.add_request("a", None, prompt(0, 5), SamplingParams(max_tokens=5))
    core.step()
    ex.error = "boom"
    outs = core.step()
    assert len(outs) == 1 and outs[0].finished and outs[0].error == "boom"
    assert outs[0].outputs[0].finish_reason == "error"
    assert not core.has_unfinished() and core.block_manager.num_free_blocks == 63


_WORKER_TRACEBACK = """Traceback (most recent call last):
  File "/srv/pagedserve/gpu/worker.py", line 187, in _serve
    out = runner.execute(step)
          ^^^^^^^^^^^^^^^^^^^^
  File "/srv/pagedserve/gpu/sampler.py", line 382, in _draw_top_p_by_histogram
    mass = torch.zeros(rows, n_b).scatter_add_(1, bucket, probs)
RuntimeError: index -9223372036854775808 is out of bounds
for dimension 1 with size 2048
"""


def test_worker_error_reaches_the_request_as_one_line_and_the_log_in_full(caplog):
    """The client sees RequestOutput.error (500 body, SSE error event): the exception, never
    the worker's traceback with the server's file paths; the log keeps the traceback."""
    core, ex = make_core()
    core.add_request("a", None, prompt(0, 5), SamplingParams(max_tokens=5))
    core.step()
    ex.error = _WORKER_TRACEBACK
    with caplog.at_level("ERROR", logger="pagedserve.engine.core"):
        outs = core.step()
    assert outs[0].error == (
        "RuntimeError: index -9223372036854775808 is out of bounds for dimension 1 with size 2048"
    )
    assert "/srv/pagedserve" in caplog.text and "scatter_add_" in caplog.text
    # An error that is not a traceback (an encode failure reported by the worker) stays as it is.
    core.add_request("b", None, prompt(1, 5), SamplingParams(max_tokens=5))
    core.step()
    ex.error = "cannot encode StepOutput: int too big"
    assert core.step()[0].error == "cannot encode StepOutput: int too big"


# ---- prefix caching and n > 1 ---------------------------------------------------------------

def test_prefix_cache_hits_for_shared_prefix():
    core, ex = make_core(block_size=4)
    shared = prompt(9, 20)
    core.add_request("a", None, shared + prompt(1, 3), SamplingParams(max_tokens=2, **GREEDY))
    run_to_completion(core)
    core.add_request("b", None, shared + prompt(2, 5), SamplingParams(max_tokens=2, **GREEDY))
    res = run_to_completion(core)
    assert res["b"].num_cached_tokens == 20
    st = core.stats()
    assert st.prefix_cache_hits == 20 and st.prefix_cache_queries == 23 + 25
    assert ex.steps[-2].new_seqs[0].num_computed_tokens == 20
    assert list(ex.steps[-2].num_new_tokens) == [5]


def test_n_sequences_share_prompt_blocks_and_seeded_reproducible():
    def run():
        core, ex = make_core(block_size=4)
        core.add_request("r", None, prompt(3, 18), SamplingParams(n=3, seed=11, temperature=0.9, max_tokens=6))
        return core, ex, run_to_completion(core)["r"]
    core, ex, out = run()
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    # siblings hit the 4 full prompt blocks (the 18th token must be recomputed)
    assert core.stats().prefix_cache_hits == 2 * 16
    assert run()[2].outputs == out.outputs
    # the same seeded request gives the same tokens when batched with other work
    core2, _ = make_core(block_size=4, max_num_batched_tokens=16)
    add_workload(core2, num=4)
    core2.add_request("r", None, prompt(3, 18), SamplingParams(n=3, seed=11, temperature=0.9, max_tokens=6))
    assert run_to_completion(core2)["r"].outputs == out.outputs


def test_stats_counts():
    core, _ = make_core(max_num_seqs=2)
    add_workload(core, num=4)
    st = core.stats()
    assert (st.num_running, st.num_waiting) == (0, 4)
    core.step()
    st = core.stats()
    assert (st.num_running, st.num_waiting) == (2, 2) and 0 < st.kv_cache_usage < 1


def test_prompt_logprobs_collected_across_chunks_and_sent_once():
    from pagedserve.contracts.messages import PromptLogprobs, SampledLogprobs

    core, ex = make_core(max_num_batched_tokens=4)
    p = prompt(0, 7)
    core.add_request("r", None, p, SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY))
    deltas = []
    while core.has_unfinished():
        sched = core.schedule()
        out = ex.execute(sched.step_input)
        n, sid = sched.num_new_tokens[0], sched.seqs[0].seq_id
        start = sched.seqs[0].num_computed_tokens - n
        if start < 7:  # a prefill chunk reports the prompt positions it predicts
            first = max(start, 1)
            end = min(start + n, 7)
            out.prompt_logprobs = [PromptLogprobs(sid, first, [
                SampledLogprobs(-float(pos), [(p[pos], -float(pos))]) for pos in range(first, end)])]
        deltas += core.process(sched, out)
    assert deltas[0].prompt_logprobs[0] is None
    assert [e[p[pos]].logprob for pos, e in enumerate(deltas[0].prompt_logprobs) if e] == [-1.0 * i for i in range(1, 7)]
    assert deltas[0].prompt_logprobs[3][p[3]].rank == 1
    assert all(d.prompt_logprobs is None for d in deltas[1:])


def test_out_of_vocabulary_prompt_ids_are_rejected_before_they_reach_the_model():
    core, _ = make_core()
    vocab = BYTE0 + 100
    core.checks.vocab_size = vocab  # the admission checks (engine/request_checks.py) hold the bound
    with pytest.raises(RequestRejectedError, match=rf"token id {vocab} is out of range: the vocabulary has {vocab}"):
        core.add_request("oov", None, [BYTE0 + 40, vocab], SamplingParams())
    assert not core.has_unfinished()
    core.add_request("ok", None, [BYTE0 + 40, vocab - 1], SamplingParams(max_tokens=2, **GREEDY))
    assert run_to_completion(core)["ok"].finished


def _unencodable_params() -> SamplingParams:
    """Settings that pass validation, then are changed to an integer msgpack cannot encode
    (a dataclass is mutable: the last line of defence must hold without validation)."""
    p = SamplingParams(max_tokens=5)
    p.top_k = 2**64
    return p


def test_a_step_that_cannot_be_encoded_fails_its_requests_and_the_engine_goes_on():
    core, ex = make_core()
    core.add_request("ok1", None, prompt(0, 5), SamplingParams(max_tokens=3))
    core.step()
    core.abort_request("ok1")  # its finished id travels with the next (unsendable) step
    core.add_request("bad", None, prompt(1, 5), _unencodable_params())
    outs = core.step()  # raised OverflowError before: the offline loop died
    bad = [o for o in outs if o.request_id == "bad"]
    assert bad and bad[-1].finished and bad[-1].outputs[0].finish_reason == "error"
    assert "cannot be encoded" in bad[-1].error and "\n" not in bad[-1].error
    assert not core.has_unfinished()
    # The workers' view stays right: the lost step's finished ids are sent again and its new
    # sequence, never registered, is not (FakeExecutor asserts both), and requests run again.
    core.add_request("after", None, prompt(2, 5), SamplingParams(max_tokens=4))
    after = run_to_completion(core)["after"]
    assert after.finished and after.outputs[0].finish_reason == "length"
    assert len(ex.seqs) == 1  # only "after" (forgotten at the next step): ok1 did not leak
    assert core.block_manager.num_free_blocks == 63


# ---- prompt admission (SchedulerConfig.prompt_admit_tokens) ------------------------------------

def _first_step_prompts(admit: int, lengths: list[int], budget: int = 512) -> list[int]:
    core, ex = make_core(num_blocks=512, max_num_batched_tokens=budget, max_model_len=2048)
    core.scheduler.prompt_admit_tokens = admit
    for i, n in enumerate(lengths):
        core.add_request(f"r{i}", None, prompt(i, n), SamplingParams(max_tokens=2, **GREEDY))
    core.step()
    return list(ex.steps[0].num_new_tokens)


def test_a_step_stops_taking_prompts_once_it_holds_the_admit_tokens():
    assert _first_step_prompts(0, [100] * 4) == [100] * 4  # 0: the budget alone limits
    assert _first_step_prompts(256, [100] * 4) == [100, 100, 100]  # 300 >= 256: the fourth waits
    assert _first_step_prompts(100, [100] * 4) == [100]
    # one long prompt's chunk still fills the whole budget
    assert _first_step_prompts(256, [1500, 100]) == [512]


def test_prompt_admission_keeps_outputs_and_serves_each_prompt_in_order():
    ref_core, _ = make_core(num_blocks=512, max_num_batched_tokens=512)
    add_workload(ref_core, num=6, plen=lambda i: 40 + i)
    want = outputs_of(run_to_completion(ref_core))
    core, ex = make_core(num_blocks=512, max_num_batched_tokens=512)
    core.scheduler.prompt_admit_tokens = 40
    add_workload(core, num=6, plen=lambda i: 40 + i)
    assert outputs_of(run_to_completion(core)) == want
    # one new prompt per step, in arrival order, while the earlier ones decode beside it
    firsts = [next(k for k, s in enumerate(ex.steps) if any(len(ns.token_ids) == 40 + i for ns in s.new_seqs))
              for i in range(6)]
    assert firsts == list(range(6))


def test_serve_defaults_to_admitting_256_prompt_tokens_per_step_offline_to_the_budget():
    import argparse

    from pagedserve.app import serve_cmd
    from pagedserve.app.engine_args import add_engine_args, engine_config_from_args

    serve = argparse.ArgumentParser()
    serve_cmd.add_arguments(serve)
    offline = argparse.ArgumentParser()
    add_engine_args(offline)
    assert engine_config_from_args(serve.parse_args([])).scheduler.prompt_admit_tokens == 256
    assert engine_config_from_args(serve.parse_args(["--prompt-admit-tokens", "0"])).scheduler.prompt_admit_tokens == 0
    assert engine_config_from_args(offline.parse_args([])).scheduler.prompt_admit_tokens == 0


class _EqInt(int):
    compares = 0

    def __eq__(self, other):
        _EqInt.compares += 1
        return int.__eq__(self, other)

    __hash__ = int.__hash__


def test_stop_token_ids_are_looked_up_in_a_set():
    """Issue 22: every generated token was compared with every stop id (``in`` on a list)."""
    stop_id = tok.byte_ids("#")[0]
    ids = [_EqInt(100_000 + i) for i in range(5000)] + [_EqInt(stop_id)]
    _EqInt.compares = 0
    text, out_ids, last = merged(run_one(tok.byte_ids("abcdef#gh"), max_tokens=20, stop_token_ids=ids))
    assert (text, last.finish_reason, last.stop_reason) == ("abcdef", "stop", stop_id)
    assert _EqInt.compares < 100


def test_logprobs_already_delivered_are_not_kept_by_the_core():
    """Issue 22: logprobs + top_logprobs 20 with n 128 kept ~21 objects per token per choice in
    the core for the whole request although each delta had carried them out. The core keeps only
    what it has not delivered yet; the merged deltas still hold every entry, in order."""
    core, _ = make_core()
    core.add_request("r", None, prompt(0, 5), SamplingParams(n=3, max_tokens=12, logprobs=2, ignore_eos=True))
    seqs = core.requests["r"].seqs
    results = run_to_completion(core, check=lambda c: [None for s in seqs if s.logprobs]
                                and pytest.fail("delivered logprobs are still held by the core"))
    for o in results["r"].outputs:
        assert len(o.logprobs) == len(o.token_ids) == 12
        assert [max(e, key=lambda t: e[t].logprob) for e in o.logprobs] == o.token_ids
    assert all(s.logprobs == [] for s in seqs)
