"""Speculative decoding (ngram) in the engine: scheduler lookahead, rollback, stops inside an accepted
run, preemption, against the worker-mirroring FakeExecutor (which verifies drafts as the worker
does, contracts/messages.py step 4b, and asserts every K/V slot a sequence reads)."""
import pytest

from pagedserve.contracts.config import ConfigError, EngineConfig, SpeculativeConfig
from pagedserve.engine.errors import RequestRejectedError
from pagedserve.engine.sampling_params import BeamSearchParams, SamplingParams
from tests.engine.fakes import BYTE0, FakeTokenizer, make_core, run_to_completion

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def quoting_model(period: int = 7, noise: int = 5):
    """Mostly repeats the token ``period`` back (so prompt lookup finds it), sometimes not (a
    rejected draft): a deterministic function of the tokens (and the seed when sampling)."""
    def next_token(tokens, options, num_prompt):
        key = (options.seed if options.temperature else 0, tuple(tokens[-6:]))
        if hash(key) % noise == 0:
            return BYTE0 + 33 + hash((key, 1)) % 90
        return tokens[-period]
    return next_token


def quoted_prompt(i: int, length: int = 30) -> list[int]:
    unit = [BYTE0 + 65 + (i * 5 + j * 3) % 26 for j in range(7)]
    return (unit * (length // 7 + 1))[:length]


def run(spec, prompts, params, **kw):
    core, ex = make_core(next_token=quoting_model(), speculative=spec, **kw)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(f"r{i}", None, p, sp)

    def check(core):
        core.block_manager.check_invariants()
    res = run_to_completion(core, check=check)
    core.block_manager.check_invariants()
    assert core.block_manager.num_free_blocks == core.block_manager.num_usable_blocks
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in r.outputs]
            for rid, r in res.items()}, core, ex


def both(prompts, params, **kw):
    base, _, _ = run(None, prompts, params, **kw)
    spec, core, ex = run(NGRAM, prompts, params, **kw)
    assert spec == base
    accepted = [a for _, a in ex.num_verified]
    assert any(a > 0 for a in accepted) and any(a < d for d, a in ex.num_verified), ex.num_verified
    return base, core, ex


@pytest.mark.parametrize("budget,prefix_caching", [(64, True), (8, True), (64, False)])
def test_greedy_equal_with_chunked_prefill_and_prefix_caching(budget, prefix_caching):
    prompts = [quoted_prompt(i, 12 + 9 * i) for i in range(6)] + [quoted_prompt(0, 30)]  # the last shares blocks
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True) for i in range(7)]
    _, core, _ = both(prompts, params, max_num_batched_tokens=budget, prefix_caching=prefix_caching,
                      num_blocks=256)
    s = core.stats()
    assert s.spec_decode_num_draft_tokens > s.spec_decode_num_accepted_tokens > 0
    assert sum(s.spec_decode_num_accepted_tokens_per_pos) == s.spec_decode_num_accepted_tokens
    assert s.spec_decode_num_accepted_tokens_per_pos == sorted(s.spec_decode_num_accepted_tokens_per_pos,
                                                               reverse=True)


def test_seeded_sampling_equal():
    prompts = [quoted_prompt(i, 20) for i in range(4)]
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=25, ignore_eos=True, logprobs=1)
              for i in range(4)]
    both(prompts, params)


@pytest.mark.parametrize("max_tokens", range(1, 14))
def test_max_tokens_inside_an_accepted_run_never_exceeded(max_tokens):
    prompts = [quoted_prompt(i, 21) for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True) for _ in range(3)]
    base, _, ex = run(NGRAM, prompts, params)
    assert base == run(None, prompts, params)[0]
    for outs in base.values():
        assert len(outs[0][0]) == max_tokens and outs[0][2] == "length"
    # Drafts are capped to what max_tokens leaves: never more tokens than asked for.
    assert all(d <= max_tokens - 1 for d, _ in ex.num_verified)


def test_stop_string_inside_an_accepted_run_ends_the_text_there():
    tok = FakeTokenizer()
    p = quoted_prompt(3, 28)
    free, _, _ = run(None, [p], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)])
    text = free["r0"][0][1]
    for at in (9, 13, 22, 30):  # stop strings starting at several offsets of the generated text
        stop = text[at:at + 2]
        params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])]
        base, _, ex = run(None, [p], params)
        spec, _, ex = run(NGRAM, [p], params)
        assert spec == base
        ids, out_text, reason, stop_reason = spec["r0"][0]
        assert reason == "stop" and stop_reason == stop and out_text == text[:text.index(stop)]
        assert stop not in tok.decode(ids)[:-len(stop)] if len(ids) > 1 else True


def test_stop_token_inside_an_accepted_run():
    p = quoted_prompt(2, 28)
    free, _, _ = run(None, [p], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)])
    ids = free["r0"][0][0]
    stop_id = ids[17]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id])]
    base, _, _ = run(None, [p], params)
    spec, _, _ = run(NGRAM, [p], params)
    assert spec == base and spec["r0"][0][0][-1] == stop_id and spec["r0"][0][3] == stop_id


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_mid_run_gives_identical_outputs(mode):
    prompts = [quoted_prompt(i, 14 + i) for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for _ in range(8)]
    kw = dict(num_blocks=24, block_size=4, preemption_mode=mode, num_swap_blocks=64 if mode == "swap" else None)
    _, core, _ = both(prompts, params, **kw)
    assert core.scheduler.num_preemptions > 0


def test_rejected_drafts_free_their_blocks_and_are_never_registered():
    """A draft run that fills a whole block and is rejected: the block goes back to the free list
    and no prefix-cache entry covers a slot holding a rejected draft."""
    p = quoted_prompt(1, 15)  # a 7-token unit repeated: the lookup proposes its next token

    def never_accepts(tokens, options, num_prompt):  # steps by 2 through the unit: never what was proposed
        return p[(2 * (len(tokens) - num_prompt + 1) + p.index(tokens[num_prompt - 1])) % 7]
    core, ex = make_core(next_token=never_accepts, num_blocks=64, block_size=4,
                         speculative={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1})
    core.add_request("r", None, p, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    bm = core.block_manager
    seq = core.requests["r"].seqs[0]
    free_before = None
    shrunk = 0
    for _ in range(7):
        if not core.has_unfinished():
            break
        step = core.scheduler.schedule()
        if step.drafts is not None and step.drafts[0]:
            held = len(bm.table(seq.seq_id))
            assert held == bm.blocks_for(seq.num_computed_tokens + len(step.drafts[0]))
            free_before = bm.num_free_blocks
            out = ex.execute(step.step_input)
            core.process(step, out)
            if seq.is_finished:
                break
            assert len(bm.table(seq.seq_id)) == bm.blocks_for(seq.num_tokens) <= held
            assert bm.num_free_blocks == free_before + held - bm.blocks_for(seq.num_tokens)
            shrunk += held > bm.blocks_for(seq.num_tokens)
            assert seq.num_computed_tokens == seq.num_tokens - 1
        else:
            core.process(step, ex.execute(step.step_input))
            if seq.is_finished:
                break
        B = bm.block_size
        for h, block_id in bm._cached.items():  # every registered block holds real tokens
            owner_table = bm.table(seq.seq_id)
            if block_id in owner_table:
                i = owner_table.index(block_id)
                for t in range(i * B, (i + 1) * B):
                    assert ex.kv[block_id * B + t % B] == (seq.token_ids[t], t)
                    assert t < seq.num_computed_tokens
        bm.check_invariants()
    assert free_before is not None and shrunk
    assert ex.num_verified and all(a == 0 for _, a in ex.num_verified)


def test_drafts_count_against_the_token_budget_and_fall_back_without_blocks():
    core, ex = make_core(next_token=quoting_model(), num_blocks=256, max_num_batched_tokens=6,
                         speculative=NGRAM)
    for i in range(3):
        core.add_request(f"r{i}", None, quoted_prompt(i, 10), SamplingParams(temperature=0, max_tokens=30,
                                                                            ignore_eos=True))

    def check(core):
        step = ex.steps[-1]
        assert sum(step.num_new_tokens) <= 6
    run_to_completion(core, check=check)
    assert any(step.num_draft_tokens_buf for step in ex.steps)


def test_disable_by_batch_size_turns_drafts_off_for_large_batches():
    spec = dict(NGRAM, disable_by_batch_size=3)
    core, ex = make_core(next_token=quoting_model(), num_blocks=256, speculative=spec)
    for i in range(4):
        core.add_request(f"r{i}", None, quoted_prompt(i, 20), SamplingParams(temperature=0, max_tokens=10 + 15 * i,
                                                                            ignore_eos=True))
    run_to_completion(core)
    for step in ex.steps:
        if len(step.seq_ids) >= 3:
            assert not step.num_draft_tokens_buf
    assert any(step.num_draft_tokens_buf for step in ex.steps)  # once the batch shrinks


def test_abort_mid_step_with_drafts_frees_everything():
    core, ex = make_core(next_token=quoting_model(noise=1000), num_blocks=64, speculative=NGRAM)
    core.add_request("r", None, quoted_prompt(0, 20), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        step = core.schedule()
        out = ex.execute(step.step_input)
        if step.drafts is not None and any(step.drafts):
            core.abort_request("r")
            core.process(step, out)
            break
        core.process(step, out)
    else:
        raise AssertionError("no step with drafts")
    bm = core.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks and not core.has_unfinished()


def test_beam_search_refused_with_speculation():
    core, _ = make_core(speculative=NGRAM)
    with pytest.raises(RequestRejectedError, match="beam search is not supported with speculative decoding"):
        core.add_request("b", None, quoted_prompt(0, 8), BeamSearchParams(beam_width=2, max_tokens=4))


def test_unsupported_combinations_refused_at_start():
    config = EngineConfig.from_options(speculative_config=NGRAM, pipeline_parallel_size=2)
    from pagedserve.engine.spec_decode import check_supported

    with pytest.raises(ConfigError, match="pipeline-parallel-size"):
        check_supported(config)


@pytest.mark.parametrize("value,match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "unsupported key"),
    ('{"method": "ngram"', "not valid JSON"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_bad_speculative_config_is_a_config_error(value, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_options(speculative_config=value)


def test_speculative_config_as_vllm_reads_it():
    c = SpeculativeConfig.from_option('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (5, 4, 4)
    c = SpeculativeConfig.from_option({"method": "ngram", "prompt_lookup_min": 2})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (2, 2)
    c = SpeculativeConfig.from_option({"method": "ngram"})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (5, 5)
    c = SpeculativeConfig.from_option({"model": "/some/draft", "num_speculative_tokens": 2})
    assert c.method == "draft_model" and c.model == "/some/draft"
    config = EngineConfig.from_options(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert EngineConfig.from_options(**config.options()).speculative == config.speculative


def test_pipeline_parallel_refused_before_any_worker_starts():
    from pagedserve.contracts.config import default_model_path
    from pagedserve.engine.bootstrap import resolve_config
    from pagedserve.loadtest.tiny_model import TINY_CONFIG

    config = EngineConfig.from_options(model=default_model_path(), load_format="dummy", hf_config=TINY_CONFIG,
                                       speculative_config=NGRAM, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="pipeline-parallel-size"):
        resolve_config(config)  # build_engine's first call, before the executor starts
