"""Beam search in the engine (fake model): the result equals the pure beam rule looped over whole
sequences; finished beams are kept and ranked by cum_logprob / len ** length_penalty; beams share
their prompt blocks (copy-on-write of the partial tail only) and give every block back."""
from __future__ import annotations

import pytest

from pagedserve.engine.beam_search import Hypothesis, LiveBeam, select
from pagedserve.engine.sampling_params import BeamSearchParams
from pagedserve.engine.errors import RequestRejectedError, SamplingParamsError
from tests.engine.beam_fakes import fake_top, reference_beam_search
from tests.engine.fakes import BYTE0, EOS, make_core, run_to_completion

A, B, C, X, Y = (BYTE0 + 65 + i for i in range(5))


def used_blocks(core) -> int:
    bm = core.block_manager
    return bm.num_usable_blocks - bm.num_free_blocks


def run(core, check=None):
    peak = [0]

    def each(c):
        c.block_manager.check_invariants()
        peak[0] = max(peak[0], used_blocks(c))
        if check:
            check(c)

    return run_to_completion(core, check=each), peak[0]


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_engine_equals_reference_and_frees_everything(width, ignore_eos):
    core, ex = make_core(top_logprobs=fake_top, num_blocks=128, block_size=4)
    prompts = [[BYTE0 + (7 * i + j) % 50 for j in range(5 + 3 * i)] for i in range(3)]
    params = BeamSearchParams(beam_width=width, max_tokens=9, ignore_eos=ignore_eos)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", None, p, params)
    results, _ = run(core)
    for i, p in enumerate(prompts):
        want = reference_beam_search(p, params)
        got = results[f"r{i}"].outputs
        assert [(o.token_ids, o.finish_reason) for o in got] == [(h.token_ids, h.finish_reason) for h in want]
        assert [o.cumulative_logprob for o in got] == pytest.approx([h.cum_logprob for h in want])
        assert [o.index for o in got] == list(range(len(got)))
    assert core.block_manager.num_free_blocks == core.block_manager.num_usable_blocks
    assert not core.requests and set(ex.seqs) == set(core.scheduler._finished_ids)  # forgotten at the next step


def test_eos_beams_are_kept_and_ranked_with_the_length_penalty():
    """After the prompt: EOS (-0.4) ends at once; A (-0.5) and B (-1.0) go on, each with one
    likely continuation. At length 3 the live beams have cum -0.7 and -1.15: per token they
    beat the one-token EOS hypothesis (length_penalty 1) but not in total (length_penalty 0)."""
    table = {(): [(EOS, -0.4), (A, -0.5), (B, -1.0), (C, -3.0)],
             (A,): [(X, -0.1), (EOS, -3.0), (Y, -4.0), (C, -5.0)],
             (B,): [(Y, -0.05), (EOS, -3.0), (X, -4.0), (C, -5.0)]}

    def top(tokens, options=None, num_prompt=0):
        out = tokens[3:]
        key = tuple(out[:1]) if out else ()
        return table[key] if len(out) < 2 else [(C, -0.1), (EOS, -2.5), (X, -4.0), (Y, -5.0)]

    prompt = [BYTE0 + 1, BYTE0 + 2, BYTE0 + 3]
    outs = {}
    for lp in (1.0, 0.0):
        core, _ = make_core(top_logprobs=top, num_blocks=64, block_size=4)
        params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=lp)
        core.add_request("r", None, prompt, params)
        results, _ = run(core)
        outs[lp] = [(o.token_ids, o.finish_reason, round(o.cumulative_logprob, 6)) for o in results["r"].outputs]
        assert [(h.token_ids, h.finish_reason) for h in reference_beam_search(prompt, params, top=top)] == [
            (t, r) for t, r, _ in outs[lp]]
    assert outs[1.0] == [([A, X, C], "length", -0.7), ([B, Y, C], "length", -1.15)]
    assert outs[0.0] == [([EOS], "stop", -0.4), ([A, X, C], "length", -0.7)]


def test_eos_text_is_not_in_the_output_and_n_limits_the_beams():
    def top(tokens, options=None, num_prompt=0):
        return [(EOS, -0.1), (A, -1.0), (B, -2.0), (C, -3.0)] if len(tokens) == 2 else fake_top(tokens)

    core, _ = make_core(top_logprobs=top, num_blocks=64, block_size=4)
    core.add_request("r", None, [BYTE0 + 1, BYTE0 + 2], BeamSearchParams(beam_width=2, max_tokens=4, n=1))
    out = run(core)[0]["r"].outputs
    assert len(out) == 1 and out[0].token_ids == [EOS] and out[0].text == "" and out[0].finish_reason == "stop"


def test_beams_share_the_prompt_blocks_and_copy_only_the_tail():
    """A 10-token prompt in blocks of 4 is 3 blocks (the last one partial). Four beams after the
    first round hold those 3 blocks plus 3 private copies of the partial one: 6 blocks, where four
    independent requests hold 12."""
    prompt = [BYTE0 + i for i in range(10)]
    core, ex = make_core(top_logprobs=fake_top, num_blocks=64, block_size=4, prefix_caching=False)
    core.add_request("beam", None, prompt, BeamSearchParams(beam_width=4, max_tokens=3, ignore_eos=True))
    core.step()  # the prompt, once
    assert used_blocks(core) == 3
    scheduled = core.schedule()  # 4 beams: 3 forks announced, each with a copy of the tail block
    assert used_blocks(core) == 6 and len(scheduled.step_input.blocks_to_copy) == 3
    assert len(scheduled.step_input.new_seqs) == 3
    tables = [core.block_manager.table(s.seq_id) for s in core.requests["beam"].seqs]
    assert len(tables) == 4 and all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 4
    core.process(scheduled, ex.execute(scheduled.step_input))
    assert ex.num_copied_blocks == 3
    run(core)
    assert used_blocks(core) == 0

    from pagedserve.engine.sampling_params import SamplingParams
    core2, _ = make_core(num_blocks=64, block_size=4, prefix_caching=False)
    for i in range(4):
        core2.add_request(f"r{i}", None, prompt, SamplingParams(temperature=0, max_tokens=2))
    core2.step()
    assert used_blocks(core2) == 12


def test_a_tiny_cache_preempts_beams_and_the_result_is_unchanged():
    prompt = [BYTE0 + i for i in range(9)]
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    want = reference_beam_search(prompt, params)
    # 3 beams of 9 + 10 tokens in blocks of 2 need 3 x 11 = 33 blocks on private blocks (what the
    # admission check asks: a preempted beam comes back on its own); beside another request of 60
    # tokens (30 blocks) they do not fit, so beams get preempted and recomputed.
    from pagedserve.engine.sampling_params import SamplingParams
    core, ex = make_core(top_logprobs=fake_top, num_blocks=34, block_size=2, max_num_batched_tokens=8)
    core.add_request("other", None, [BYTE0 + 60 + i for i in range(30)], SamplingParams(temperature=0, max_tokens=30))
    core.add_request("beam", None, prompt, params)
    results, _ = run(core)
    assert core.stats().num_preemptions > 0
    assert [o.token_ids for o in results["beam"].outputs] == [h.token_ids for h in want]


def test_a_beam_request_that_fits_only_with_shared_prompt_blocks_is_rejected():
    """Found by the scheduler property test: 3 beams whose private copies exceed the cache, once
    one was preempted, cycled through self-preemption for ever beside siblings holding theirs."""
    core, _ = make_core(top_logprobs=fake_top, num_blocks=24, block_size=2)
    with pytest.raises(RequestRejectedError, match="may need 33 KV blocks but the cache has 23"):
        core.add_request("beam", None, [BYTE0 + i for i in range(9)],
                         BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))
    assert not core.requests


def test_abort_returns_every_block_and_ends_the_request():
    core, ex = make_core(top_logprobs=fake_top, num_blocks=64, block_size=4)
    core.add_request("r", None, [BYTE0 + i for i in range(6)], BeamSearchParams(beam_width=3, max_tokens=20))
    for _ in range(4):
        assert core.step() == []  # no deltas before the end
    out = core.abort_request("r")
    assert out.finished and out.outputs and all(o.finish_reason == "abort" for o in out.outputs)
    core.step()
    assert used_blocks(core) == 0 and not core.requests and not core.scheduler.running


def test_params_and_rejections():
    with pytest.raises(SamplingParamsError):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(SamplingParamsError):
        BeamSearchParams(beam_width=2, max_tokens=4, n=3)
    core, _ = make_core(top_logprobs=fake_top, num_blocks=16, block_size=4, max_num_seqs=4)
    with pytest.raises(RequestRejectedError, match="max_num_seqs"):
        core.add_request("w", None, [BYTE0] * 4, BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(RequestRejectedError, match="KV blocks"):
        core.add_request("m", None, [BYTE0] * 4, BeamSearchParams(beam_width=4, max_tokens=16))
    assert not core.requests and used_blocks(core) == 0


def test_select_keeps_only_top_width_finished_and_stops_when_no_live_beam_can_win():
    beams = [LiveBeam("p", -1.0, [A], [(EOS, -0.1), (X, -0.2), (EOS + 100, -0.3), (Y, -5.0)])]
    stop = frozenset({EOS, EOS + 100})
    sel = select(beams, 1, [], 2, stop, 1.0, False, 4)
    # EOS ranks first: finished (score -1.1 / 2); the second stop token ranks past width 1: dropped
    assert [h.token_ids for h in sel.finished] == [[A, EOS]]
    assert sel.next_beams == [("p", X, pytest.approx(-1.2))]
    assert sel.done  # the best live beam (-1.2 / 2) cannot beat the finished one (-1.1 / 2)
    worse = [Hypothesis([B], -9.0, -9.0, "stop")]
    sel2 = select([LiveBeam("p", -1.0, [A], [(X, -0.2), (Y, -0.3)])], 1, worse, 2, stop, 1.0, False, 4)
    assert not sel2.done and sel2.finished == worse


def test_out_of_vocabulary_stop_ids_change_nothing():
    """Issue 22: stop ids that cannot occur must not widen the candidates (K) nor change the
    result; K counts only in-vocabulary stop ids and never exceeds the vocabulary."""
    from tests.engine.fakes import VOCAB
    prompt = [BYTE0 + i for i in range(6)]
    outs = []
    for stop in ([], list(range(VOCAB, VOCAB + 5000)), [A, B] + list(range(VOCAB, VOCAB + 50))):
        core, _ = make_core(top_logprobs=fake_top, num_blocks=64, block_size=4)
        params = BeamSearchParams(beam_width=2, max_tokens=5, stop_token_ids=stop)
        core.add_request("r", None, prompt, params)
        g = core.requests["r"].beam
        in_vocab = len([t for t in set(stop) | {EOS} if t < VOCAB])
        assert g.num_candidates == min(max(2, 1 + in_vocab) * 2, VOCAB)
        assert core.requests["r"].seqs[0].options.logprobs == g.num_candidates
        outs.append([(o.token_ids, o.finish_reason) for o in run(core)[0]["r"].outputs])
    assert outs[0] == outs[1]
    core, _ = make_core(top_logprobs=fake_top, num_blocks=64, block_size=4)
    core.add_request("r", None, prompt, BeamSearchParams(beam_width=16, max_tokens=2,
                                                         stop_token_ids=list(range(VOCAB - 200, VOCAB))))
    assert core.requests["r"].beam.num_candidates == VOCAB
