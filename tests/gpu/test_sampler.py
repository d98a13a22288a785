"""Sampler: logits processing exactly as defined, filters never leak, seeded draws reproducible.

Run as a script (``python tests/gpu/test_sampler.py``) to time one call at B=64, V=49152.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from pagedserve.contracts.messages import SampledLogprobs, SamplingOptions
from pagedserve.gpu.sampler import Sampler, SamplerOutput, compute_prompt_logprobs, process_logits


def _run(logits, options, token_ids=None, num_prompt=None, sampler=None) -> SamplerOutput:
    b = logits.shape[0]
    if token_ids is None:
        token_ids = [[0, 1, 2] for _ in range(b)]
    if num_prompt is None:
        num_prompt = [len(t) for t in token_ids]
    return (sampler or Sampler()).sample(logits.clone(), options, token_ids, num_prompt)


def _draws(logits_row, opt_kwargs, n, sampler=None, steps=None) -> list[int]:
    """n draws for one logits row: n batch rows, each with its own seed."""
    logits = logits_row.unsqueeze(0).repeat(n, 1)
    options = [SamplingOptions(seed=1000 + s, **opt_kwargs) for s in range(n)]
    token_ids = [[5] * (1 + (steps[s] if steps else 0)) for s in range(n)]
    return _run(logits, options, token_ids, [1] * n, sampler).token_ids


# ---------------------------------------------------------------- greedy and temperature


def test_temperature_zero_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 300)
    out = _run(logits, [SamplingOptions(temperature=0.0, seed=i) for i in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_greedy_takes_the_first_of_tied_maxima():
    """As argmax (and vLLM): the lowest index among equal largest logits, bf16 logits full of ties
    included, in a batch of greedy rows and in a batch mixed with sampled rows."""
    logits = torch.zeros(3, 49152)
    logits[0, [9, 5, 30000]] = 1.0
    logits[1, [40000, 100]] = 2.0
    logits[2] = torch.randn(49152).bfloat16().float()  # bf16 values: many ties
    expected = [5, 100, int(logits[2].argmax())]
    assert _run(logits.clone(), [SamplingOptions(temperature=0.0)] * 3).token_ids == expected
    mixed = [SamplingOptions(temperature=0.0), SamplingOptions(temperature=1.0, seed=3), SamplingOptions(temperature=0.0)]
    out = _run(logits.clone(), mixed).token_ids
    assert out[0] == 5 and out[2] == expected[2]


def test_tiny_temperature_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(64, 500)
    best = torch.randint(0, 500, (64,))
    logits[torch.arange(64), best] = logits.max(-1).values + 0.05
    options = [SamplingOptions(temperature=1e-3, seed=s) for s in range(64)]
    assert _run(logits, options).token_ids == best.tolist()
    # Mixed with greedy rows in one batch, the same answer.
    options = [SamplingOptions(temperature=(0.0 if s % 2 else 1e-3), seed=s) for s in range(64)]
    assert _run(logits, options).token_ids == best.tolist()


def test_temperature_one_samples_the_softmax_distribution():
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    n = 4000
    counts = torch.bincount(torch.tensor(_draws(logits, {}, n)), minlength=4).float() / n
    assert torch.allclose(counts, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.03), counts
    # temperature 0.5 squares the probabilities (then renormalises)
    counts = torch.bincount(
        torch.tensor(_draws(logits, {"temperature": 0.5}, n)), minlength=4
    ).float() / n
    expected = torch.tensor([0.01, 0.04, 0.09, 0.16]) / 0.30
    assert torch.allclose(counts, expected, atol=0.03), counts


def test_large_vocab_draw_follows_probabilities_across_chunks():
    # 700 tokens: several 256-wide chunks and a partial last one
    probs = torch.full((700,), 0.2 / 697)
    probs[650], probs[3], probs[511] = 0.45, 0.25, 0.1  # 511: last token of a chunk
    n = 4000
    draws = torch.tensor(_draws(torch.log(probs), {}, n))
    assert (draws == 650).float().mean().item() == pytest.approx(0.45, abs=0.03)
    assert (draws == 3).float().mean().item() == pytest.approx(0.25, abs=0.03)
    assert (draws == 511).float().mean().item() == pytest.approx(0.10, abs=0.02)
    rest = draws[(draws != 650) & (draws != 3) & (draws != 511)]
    assert len(rest) / n == pytest.approx(0.2, abs=0.03)
    assert (rest >= 512).float().mean().item() == pytest.approx(185 / 697, abs=0.06)


# ---------------------------------------------------------------- filters never leak


def _allowed_top_p(logits_row, p, temperature=1.0):
    probs = torch.softmax(logits_row / temperature, -1)
    order = probs.argsort(descending=True)
    allowed, mass = set(), 0.0
    for t in order.tolist():
        allowed.add(t)
        mass += probs[t].item()
        if mass >= p:
            break
    return allowed


def test_top_k_never_samples_outside_the_top_k():
    torch.manual_seed(2)
    logits = torch.randn(200)
    allowed = set(logits.topk(7).indices.tolist())
    draws = _draws(logits, {"top_k": 7}, 600)
    assert set(draws) <= allowed
    assert len(set(draws)) == 7  # it is a filter, not argmax


def test_top_k_renormalises_over_the_kept_tokens():
    logits = torch.log(torch.tensor([0.05, 0.4, 0.05, 0.3, 0.2]))
    n = 4000
    counts = torch.bincount(torch.tensor(_draws(logits, {"top_k": 2}, n)), minlength=5).float() / n
    assert torch.allclose(counts, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7, 0.0]), atol=0.03), counts


@pytest.mark.parametrize("candidates", [256, 4])  # 4: the nucleus never fits, full-sort path
def test_top_p_never_samples_outside_the_nucleus(candidates):
    torch.manual_seed(3)
    logits = torch.randn(300) * 2
    p = 0.7
    allowed = _allowed_top_p(logits, p, temperature=0.8)
    assert 8 < len(allowed) < 150
    draws = _draws(logits, {"top_p": p, "temperature": 0.8}, 600, Sampler(top_p_candidates=candidates))
    assert set(draws) <= allowed
    assert len(set(draws)) > len(allowed) // 2


def test_top_p_same_tokens_whatever_the_candidate_count():
    """Escalating 2 -> 16 -> 128 -> sort gives exactly what one big candidate set gives."""
    torch.manual_seed(12)
    logits = torch.randn(40, 600) * 1.5
    options = [SamplingOptions(seed=s, top_p=0.3 + 0.015 * s) for s in range(40)]
    small = _run(logits, options, sampler=Sampler(top_p_candidates=2)).token_ids
    big = _run(logits, options, sampler=Sampler(top_p_candidates=600)).token_ids
    assert small == big
    for i, tok in enumerate(big):
        assert tok in _allowed_top_p(logits[i], options[i].top_p)


def test_top_p_histogram_path_with_tied_logits():
    """A huge flat nucleus (histogram path) over quantised logits full of ties, as bf16 gives."""
    gen = torch.Generator().manual_seed(14)
    v = 3000
    levels = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0])
    logits = levels[torch.randint(0, 5, (v,), generator=gen)]
    p = 0.6
    probs = torch.softmax(logits.double(), -1)
    mass_by_level = [probs[logits == lv].sum().item() for lv in levels.tolist()]
    q_by_level = [math.exp(lv) / torch.exp(logits.double()).sum().item() for lv in levels.tolist()]
    # descending levels: 2.0 then 1.5 ... ; the boundary level is partly in the nucleus
    before, kept_mass, boundary = 0.0, 0.0, None
    for lv in (4, 3, 2, 1, 0):
        if before + mass_by_level[lv] >= p:
            m = math.ceil((p - before) / q_by_level[lv] - 1e-9)
            kept_mass, boundary = before + m * q_by_level[lv], lv
            break
        before += mass_by_level[lv]
    assert boundary is not None and boundary < 4
    n = 3000
    draws = torch.tensor(_draws(logits, {"top_p": p}, n, Sampler(top_p_candidates=8)))
    assert bool((logits[draws] >= levels[boundary]).all())
    top_share = (logits[draws] == 2.0).float().mean().item()
    assert top_share == pytest.approx(mass_by_level[4] / kept_mass, abs=0.03)


def test_top_p_nucleus_includes_the_token_that_crosses_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    n = 4000
    draws = _draws(logits, {"top_p": 0.6}, n)
    assert set(draws) == {0, 1}  # 0.5 < 0.6, so the 0.3 token is in
    # renormalised over the nucleus: 0.5 / 0.8 and 0.3 / 0.8
    assert draws.count(0) / n == pytest.approx(0.625, abs=0.03)
    draws = _draws(logits, {"top_p": 0.4}, 200)
    assert set(draws) == {0}


def test_top_k_and_top_p_together():
    # top-k=3 keeps {0.4, 0.3, 0.2} -> renormalised {4/9, 3/9, 2/9}; top-p 0.7 keeps the first two.
    logits = torch.log(torch.tensor([0.05, 0.4, 0.05, 0.3, 0.2]))
    draws = _draws(logits, {"top_k": 3, "top_p": 0.7}, 800)
    assert set(draws) == {1, 3}
    draws = _draws(logits, {"top_k": 3, "top_p": 0.8}, 800)  # 7/9 < 0.8: third one too
    assert set(draws) == {1, 3, 4}


def test_min_p_never_samples_below_the_threshold():
    torch.manual_seed(4)
    logits = torch.randn(400) * 1.5
    t, min_p = 0.9, 0.2
    probs = torch.softmax(logits / t, -1)
    allowed = set((probs >= min_p * probs.max()).nonzero().squeeze(1).tolist())
    assert 3 < len(allowed) < 100
    draws = _draws(logits, {"min_p": min_p, "temperature": t}, 600)
    assert set(draws) <= allowed
    assert len(set(draws)) > len(allowed) // 2


def test_filters_in_a_mixed_large_batch():
    """Every filter at once, rows interleaved, realistic vocabulary size."""
    torch.manual_seed(5)
    b, v = 48, 8000
    logits = torch.randn(b, v) * 3
    kinds = [
        {"top_k": 20, "temperature": 0.7},
        {"top_p": 0.8, "temperature": 1.0},
        {"min_p": 0.1, "temperature": 0.6},
        {"top_k": 50, "top_p": 0.5, "temperature": 1.2},
    ]
    options = [SamplingOptions(seed=s, **kinds[s % 4]) for s in range(b)]
    out = _run(logits, options, sampler=Sampler(top_p_candidates=64)).token_ids
    for i, tok in enumerate(out):
        kw = kinds[i % 4]
        row = logits[i] / kw["temperature"]
        if "top_k" in kw:
            assert tok in set(row.topk(kw["top_k"]).indices.tolist())
        if "top_p" in kw and "top_k" not in kw:
            assert tok in _allowed_top_p(logits[i], kw["top_p"], kw["temperature"])
        if "min_p" in kw:
            probs = torch.softmax(row, -1)
            assert probs[tok] >= kw["min_p"] * probs.max()


# ---------------------------------------------------------------- logits processing, exactly


def _process(logits, options, token_ids, num_prompt):
    return process_logits(logits.clone(), options, token_ids, num_prompt)


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    # prompt [0, 3], generated [1]; tokens 2, 4, 5 never seen
    out = _process(logits, [SamplingOptions(repetition_penalty=2.0)], [[0, 3, 1]], [2])
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 1.0, -2.0, 0.5, 3.0]]))


def test_frequency_penalty_counts_generated_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    # prompt [0, 2], generated [2, 2, 3]: count(2)=2, count(3)=1; prompt occurrences don't count
    out = _process(logits, [SamplingOptions(frequency_penalty=0.5)], [[0, 2, 2, 2, 3]], [2])
    assert torch.equal(out, torch.tensor([[1.0, 1.0, 0.0, 0.5, 1.0]]))


def test_presence_penalty_is_flat_over_generated_tokens():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    out = _process(logits, [SamplingOptions(presence_penalty=0.25)], [[0, 2, 2, 2, 3]], [2])
    assert torch.equal(out, torch.tensor([[1.0, 1.0, 0.75, 0.75, 1.0]]))


def test_negative_penalties_reward():
    logits = torch.tensor([[0.0, 0.0, 0.0]])
    opt = SamplingOptions(frequency_penalty=-1.0, presence_penalty=-0.5)
    out = _process(logits, [opt], [[1, 1]], [0])
    assert torch.equal(out, torch.tensor([[0.0, 2.5, 0.0]]))


def test_penalties_combined_in_vllm_order():
    # repetition first, then frequency and presence
    logits = torch.tensor([[4.0, -4.0, 2.0, 8.0]])
    opt = SamplingOptions(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    # prompt [3], generated [1, 2, 2]
    out = _process(logits, [opt], [[3, 1, 2, 2]], [1])
    expected = torch.tensor([[4.0, -8.0 - 1.0 - 0.5, 1.0 - 2.0 - 0.5, 4.0]])
    assert torch.equal(out, expected)


def test_logit_bias_and_min_tokens_and_penalty_rows_in_a_mixed_batch():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 4)
    options = [
        SamplingOptions(),  # untouched
        SamplingOptions(logit_bias={0: 10.0, 3: -1.5}),
        SamplingOptions(min_tokens=3, min_tokens_blocked_ids=(3, 1)),
        SamplingOptions(presence_penalty=1.0),
    ]
    token_ids = [[0, 1], [0, 1], [0, 1, 2], [0, 1, 2]]  # row 2 and 3: one generated token (2)
    out = _process(logits, options, token_ids, [2, 2, 2, 2])
    inf = float("inf")
    expected = torch.tensor(
        [[1.0, 2.0, 3.0, 4.0], [11.0, 2.0, 3.0, 2.5], [1.0, -inf, 3.0, -inf], [1.0, 2.0, 2.0, 4.0]]
    )
    assert torch.equal(out, expected)


def test_min_tokens_lifts_once_reached():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    opt = SamplingOptions(min_tokens=2, min_tokens_blocked_ids=(3,))
    assert _process(logits, [opt], [[0, 9 % 4]], [1])[0, 3] == float("-inf")  # 1 generated
    assert torch.equal(_process(logits, [opt], [[0, 1, 2]], [1]), logits)  # 2 generated


def _dense_reference(logits, options, token_ids, num_prompt):
    """vLLM's formulas written densely, row by row."""
    out = logits.clone()
    b, v = out.shape
    for i, o in enumerate(options):
        prompt, gen = token_ids[i][: num_prompt[i]], token_ids[i][num_prompt[i]:]
        for tok, bias in (o.logit_bias or {}).items():
            out[i, tok] += bias
        if len(gen) < o.min_tokens:
            out[i, list(o.min_tokens_blocked_ids)] = float("-inf")
        counts = torch.bincount(torch.tensor(gen, dtype=torch.long), minlength=v).float()
        in_prompt = torch.zeros(v, dtype=torch.bool)
        in_prompt[prompt] = True
        seen = in_prompt | (counts > 0)
        row = out[i]
        pen = torch.where(row > 0, row / o.repetition_penalty, row * o.repetition_penalty)
        row = torch.where(seen, pen, row)
        row = row - o.frequency_penalty * counts - o.presence_penalty * (counts > 0).float()
        out[i] = row
    return out


def test_processing_matches_a_dense_reference_on_random_batches():
    gen = torch.Generator().manual_seed(13)
    b, v = 12, 97
    for trial in range(5):
        logits = torch.randn(b, v, generator=gen) * 3
        options, token_ids, num_prompt = [], [], []
        for i in range(b):
            pick = lambda: float(torch.rand(1, generator=gen)) < 0.5  # noqa: E731
            n_prompt = int(torch.randint(0, 30, (1,), generator=gen))
            n_gen = int(torch.randint(0, 30, (1,), generator=gen))
            ids = torch.randint(0, v // 3, (n_prompt + n_gen,), generator=gen).tolist()
            options.append(
                SamplingOptions(
                    repetition_penalty=1.3 if pick() else 1.0,
                    frequency_penalty=0.4 if pick() else 0.0,
                    presence_penalty=-0.7 if pick() else 0.0,
                    logit_bias={5: 2.5, 90: -1.0} if pick() else None,
                    min_tokens=10 if pick() else 0,
                    min_tokens_blocked_ids=(1, 2),
                )
            )
            token_ids.append(ids)
            num_prompt.append(n_prompt)
        got = _process(logits, options, token_ids, num_prompt)
        expected = _dense_reference(logits, options, token_ids, num_prompt)
        assert torch.allclose(got, expected, atol=1e-6), trial
        assert torch.equal(torch.isinf(got), torch.isinf(expected))


def test_no_options_leave_logits_untouched():
    torch.manual_seed(6)
    logits = torch.randn(5, 40)
    out = _process(logits, [SamplingOptions()] * 5, [[1, 2, 3]] * 5, [1] * 5)
    assert torch.equal(out, logits)


# ---------------------------------------------------------------- bias and min_tokens end to end


def test_logit_bias_forces_and_forbids_tokens():
    torch.manual_seed(7)
    logits = torch.randn(100)
    target = int(logits.argmin())
    assert set(_draws(logits, {"logit_bias": {target: 100.0}}, 100)) == {target}
    best = int(logits.argmax())
    logits[best] += 6.0  # almost always sampled without the bias
    assert best in _draws(logits, {}, 100)
    assert best not in _draws(logits, {"logit_bias": {best: -100.0}}, 300)
    greedy = _run(
        logits.unsqueeze(0), [SamplingOptions(temperature=0.0, logit_bias={best: -100.0})]
    ).token_ids
    assert greedy[0] != best


def test_min_tokens_blocks_eos_until_reached():
    eos = 7
    logits = torch.zeros(1, 10)
    logits[0, eos] = 10.0
    opt = SamplingOptions(temperature=0.0, min_tokens=3, min_tokens_blocked_ids=(eos,))
    prompt = [1, 2]
    for generated in range(3):
        ids = prompt + [4] * generated
        assert _run(logits, [opt], [ids], [2]).token_ids[0] != eos
    assert _run(logits, [opt], [prompt + [4, 4, 4]], [2]).token_ids[0] == eos
    # random sampling is blocked as well
    assert eos not in _draws(logits[0], {"min_tokens": 1, "min_tokens_blocked_ids": (eos,)}, 100)


# ---------------------------------------------------------------- seeds and determinism

_KINDS = [
    {},
    {"temperature": 0.6},
    {"top_k": 10, "temperature": 0.9},
    {"top_p": 0.9},
    {"min_p": 0.05, "temperature": 1.3},
    {"top_k": 40, "top_p": 0.8, "frequency_penalty": 0.3, "repetition_penalty": 1.2},
]


@pytest.mark.parametrize("kind", range(len(_KINDS)))
def test_same_seed_and_step_same_token_whatever_the_batch(kind):
    torch.manual_seed(8)
    v = 3000
    target_logits = torch.randn(v) * 2
    target = SamplingOptions(seed=4242, **_KINDS[kind])
    target_ids = [3, 1, 4, 1, 5, 9, 2, 6]  # 5 prompt, 3 generated
    alone = _run(target_logits.unsqueeze(0), [target], [target_ids], [5]).token_ids[0]

    others = torch.randn(15, v) * 2
    other_opts = [SamplingOptions(seed=s, **_KINDS[s % len(_KINDS)]) for s in range(15)]
    other_opts[3] = SamplingOptions(temperature=0.0)
    for pos in (0, 7, 15):
        logits = torch.cat([others[:pos], target_logits.unsqueeze(0), others[pos:]])
        opts = other_opts[:pos] + [target] + other_opts[pos:]
        ids = [[1, 2, 3]] * pos + [target_ids] + [[1, 2, 3, 4]] * (15 - pos)
        nprompt = [2] * pos + [5] + [2] * (15 - pos)
        for sampler in (Sampler(), Sampler(top_p_candidates=16)):
            out = _run(logits, opts, ids, nprompt, sampler).token_ids
            assert out[pos] == alone
    # After a preemption the prompt/generated split is the same, so is the token; the draw
    # depends on the step (number of generated tokens), not on the batch.
    again = _run(target_logits.unsqueeze(0), [target], [list(target_ids)], [5]).token_ids[0]
    assert again == alone


def test_step_and_seed_both_change_the_draw():
    logits = torch.zeros(1000)  # uniform
    by_seed = _draws(logits, {}, 50)
    assert len(set(by_seed)) > 40
    one_seed = SamplingOptions(seed=99)
    by_step = [
        _run(logits.unsqueeze(0), [one_seed], [[0] * (1 + step)], [1]).token_ids[0]
        for step in range(50)
    ]
    assert len(set(by_step)) > 40
    repeat = [
        _run(logits.unsqueeze(0), [one_seed], [[0] * (1 + step)], [1]).token_ids[0]
        for step in range(50)
    ]
    assert repeat == by_step


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_of_the_raw_logits_with_sorted_top_n():
    torch.manual_seed(9)
    logits = torch.randn(4, 50) * 2
    raw = torch.log_softmax(logits, -1)
    options = [
        SamplingOptions(logprobs=5, temperature=0.7, repetition_penalty=1.5, seed=1),
        SamplingOptions(temperature=0.0),  # did not ask
        SamplingOptions(logprobs=0, temperature=0.0, logit_bias={3: 50.0}),
        SamplingOptions(logprobs=2, top_k=3, presence_penalty=1.0, seed=2),
    ]
    out = _run(logits, options, [[1, 2, 3, 4]] * 4, [2] * 4)
    assert out.logprobs is not None and out.logprobs[1] is None
    assert out.token_ids[2] == 3  # bias changed the choice, not the reported logprob
    for i, k in ((0, 5), (2, 0), (3, 2)):
        entry = out.logprobs[i]
        assert isinstance(entry, SampledLogprobs)
        assert entry.logprob == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        assert len(entry.top) == k
        expected = raw[i].sort(descending=True)
        for r, (tok, lp) in enumerate(entry.top):
            assert tok == expected.indices[r].item()
            assert lp == pytest.approx(expected.values[r].item(), abs=1e-6)
        assert [lp for _, lp in entry.top] == sorted([lp for _, lp in entry.top], reverse=True)


def test_compute_prompt_logprobs_matches_manual():
    torch.manual_seed(10)
    logits = torch.randn(6, 30)
    nxt = [4, 0, 29, 7, 7, 15]
    entries = compute_prompt_logprobs(logits, torch.tensor(nxt), 3)
    assert len(entries) == 6
    for i, e in enumerate(entries):
        row = logits[i] - torch.logsumexp(logits[i], 0)
        assert e.logprob == pytest.approx(row[nxt[i]].item(), abs=1e-5)
        top = sorted(range(30), key=lambda t: -row[t].item())[:3]
        assert [t for t, _ in e.top] == top
        for t, lp in e.top:
            assert lp == pytest.approx(row[t].item(), abs=1e-5)
    assert all(e.top == [] for e in compute_prompt_logprobs(logits, nxt, 0))
    assert math.isclose(
        compute_prompt_logprobs(logits, nxt, 0)[2].logprob, entries[2].logprob, abs_tol=1e-7
    )


def test_bf16_logits_and_bad_shapes():
    torch.manual_seed(11)
    logits = torch.randn(2, 20)
    out = _run(logits.bfloat16(), [SamplingOptions(temperature=0.0)] * 2)
    assert out.token_ids == logits.bfloat16().float().argmax(-1).tolist()
    with pytest.raises(ValueError, match="2 logit rows but 3 options"):
        Sampler().sample(logits, [SamplingOptions()] * 3, [[1]] * 2, [1] * 2)


# ---------------------------------------------------------------- device placement (issue 10 fault 5)


class _SameDevice(TorchDispatchMode):
    """Fail any op whose tensor inputs or outputs are not all on ``device``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.device != self.device:
                raise AssertionError(f"{func} got a tensor on {t.device}, the logits are on {self.device}")
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device != self.device:
                raise AssertionError(f"{func} made a tensor on {t.device}, the logits are on {self.device}")
        return out


@contextlib.contextmanager
def _logits_device_only():
    """On CUDA the logits live on the GPU and a tensor made without ``device=`` lands on the CPU.
    Here the logits are on the CPU, so make the default device ``meta`` instead: any tensor the
    sampler makes without the logits' device is then on meta, and every op is checked."""
    with torch.device("meta"), _SameDevice(torch.device("cpu")):
        yield


_DEVICE_CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(),
    "temperature 0.7 + min_p": dict(temperature=0.7, min_p=0.05),
    "top_k": dict(top_k=5, temperature=0.9),
    "top_p": dict(top_p=0.8),
    "top_k + top_p": dict(top_k=40, top_p=0.5),
    "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    "logit_bias + min_tokens": dict(logit_bias={3: 5.0, 7: -100.0}, min_tokens=5,
                                    min_tokens_blocked_ids=[2, 9]),
    "logprobs": dict(logprobs=3, temperature=0.8),
    "greedy logprobs": dict(logprobs=0, temperature=0.0),
}


@pytest.mark.parametrize("mixed", [False, True], ids=["uniform batch", "mixed batch"])
@pytest.mark.parametrize("case", list(_DEVICE_CASES))
def test_every_tensor_the_sampler_makes_is_on_the_logits_device(case, mixed):
    torch.manual_seed(21)
    b, v = 6, 700
    logits = torch.randn(b, v) * 3
    options = [SamplingOptions(seed=i, **_DEVICE_CASES[case]) for i in range(b)]
    if mixed:  # every other row greedy / plain: exercises the row selections and scatters
        options[1::2] = [SamplingOptions(temperature=0.0 if i % 4 == 1 else 1.0, seed=i)
                         for i in range(1, b, 2)]
    token_ids = [[1, 2, 3, 3, 4 + i] for i in range(b)]
    expected = _run(logits, options, token_ids, [3] * b)
    with _logits_device_only():
        got = _run(logits, options, token_ids, [3] * b)
    assert got == expected


@pytest.mark.parametrize("candidates", [2, 400])  # histogram and full-sort paths of top-p
def test_top_p_fallback_paths_stay_on_the_logits_device(candidates):
    torch.manual_seed(22)
    logits = torch.randn(4, 3000) * 0.1  # flat: the nucleus is far beyond the first candidates
    options = [SamplingOptions(seed=i, top_p=0.9) for i in range(4)]
    sampler = Sampler(top_p_candidates=candidates)
    expected = _run(logits, options, sampler=sampler)
    with _logits_device_only():
        assert _run(logits, options, sampler=sampler) == expected


def test_prompt_logprobs_stay_on_the_logits_device():
    torch.manual_seed(23)
    logits = torch.randn(5, 40)
    for targets in ([1, 2, 3, 4, 5], torch.tensor([1, 2, 3, 4, 5])):
        expected = compute_prompt_logprobs(logits, targets, 2)
        with _logits_device_only():
            assert compute_prompt_logprobs(logits, targets, 2) == expected


# ---------------------------------------------------------------- non-finite logits (one row must not fail the step)

_INF = float("inf")
_NAN = float("nan")

_NON_FINITE_KINDS = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(),
    "temperature 0.7 + min_p": dict(temperature=0.7, min_p=0.05),
    "top_k": dict(top_k=5, temperature=0.9),
    "top_p": dict(top_p=0.9),
    "top_p near 1": dict(top_p=0.999),
    "top_k + top_p": dict(top_k=40, top_p=0.5),
    "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.5),
    "logprobs": dict(logprobs=2, temperature=0.8),
}

# Bad row patterns and the tokens the documented policy allows for that row.
_BAD_ROWS = {
    "+inf at 7": (lambda r: r.__setitem__(7, _INF), {7}),
    "+inf at 3 and 9, NaN at 4": (lambda r: (r.__setitem__(3, _INF), r.__setitem__(9, _INF),
                                            r.__setitem__(4, _NAN)), {3, 9}),
    "-inf row with one +inf": (lambda r: (r.fill_(-_INF), r.__setitem__(5, _INF)), {5}),
    "NaN at the argmax": (lambda r: r.__setitem__(int(r.argmax()), _NAN), None),
    "all NaN": (lambda r: r.fill_(_NAN), None),
    "all -inf": (lambda r: r.fill_(-_INF), None),
}


@pytest.mark.parametrize("candidates", [16, 256])  # 16: top-p rows reach the histogram path
@pytest.mark.parametrize("bad", list(_BAD_ROWS))
@pytest.mark.parametrize("kind", list(_NON_FINITE_KINDS))
def test_a_non_finite_row_gets_a_token_and_leaves_the_other_rows_alone(kind, bad, candidates):
    torch.manual_seed(31)
    b, v = 4, 3000
    clean = torch.randn(b, v) * 2
    options = [SamplingOptions(seed=100 + i, **_NON_FINITE_KINDS[kind]) for i in range(b)]
    token_ids = [[1, 2, 3, 4 + i] for i in range(b)]
    sampler = Sampler(top_p_candidates=candidates)
    expected = _run(clean, options, token_ids, [2] * b, sampler).token_ids
    poisoned = clean.clone()
    make_bad, allowed = _BAD_ROWS[bad]
    make_bad(poisoned[2])
    out = _run(poisoned, options, token_ids, [2] * b, sampler)
    assert [t for i, t in enumerate(out.token_ids) if i != 2] == [
        t for i, t in enumerate(expected) if i != 2
    ]
    tok = out.token_ids[2]
    assert 0 <= tok < v
    if allowed is not None:  # +inf entries are the only candidates
        assert tok in allowed
    elif bad == "NaN at the argmax" and kind == "greedy":  # NaN counts as -inf
        row = clean[2].clone()
        row[int(clean[2].argmax())] = -_INF
        assert tok == int(row.argmax())
    elif bad in ("all NaN", "all -inf") and kind == "greedy":  # no candidate: all equal
        assert tok == 0


def test_logit_bias_of_inf_forces_the_token_in_a_shared_batch():
    """+inf/-inf biases (offline API, NaN from a penalty) reach the sampler as they are."""
    torch.manual_seed(32)
    logits = torch.randn(3, 5000)
    options = [SamplingOptions(seed=i, top_p=0.95) for i in range(3)]
    expected = _run(logits, options, sampler=Sampler(top_p_candidates=16)).token_ids
    options[1] = SamplingOptions(seed=1, top_p=0.95, logit_bias={42: _INF, 43: _NAN})
    out = _run(logits, options, sampler=Sampler(top_p_candidates=16)).token_ids
    assert out == [expected[0], 42, expected[2]]


# ---------------------------------------------------------------- timing (not a test)


def _bench() -> None:
    import time

    b, v = 64, 49152
    torch.manual_seed(0)
    flat = torch.randn(b, v)
    peaked = torch.randn(b, v) * 2.5  # closer to a model's output: a few hundred plausible tokens
    token_ids = [list(range(i, i + 300)) + [(7 * i + j) % v for j in range(100)] for i in range(b)]
    nprompt = [300] * b
    cases = {
        "all greedy": [SamplingOptions(temperature=0.0)] * b,
        "all temperature 0.6, seeded": [SamplingOptions(temperature=0.6, seed=i) for i in range(b)],
        "top-p/top-k mix + penalties": [
            SamplingOptions(
                temperature=0.8,
                seed=i,
                top_k=(40 if i % 3 == 0 else 0),
                top_p=(0.9 if i % 3 != 2 else 1.0),
                min_p=(0.02 if i % 3 == 2 else 0.0),
                repetition_penalty=1.1,
                frequency_penalty=0.2,
                presence_penalty=0.1,
            )
            for i in range(b)
        ],
    }
    sampler = Sampler()
    print(f"torch threads: {torch.get_num_threads()}")
    for name, opts in cases.items():
        for dist, base in (("peaked", peaked), ("flat", flat)):
            runs = []
            for _ in range(10):
                x = base.clone()
                t0 = time.perf_counter()
                sampler.sample(x, opts, token_ids, nprompt)
                runs.append(time.perf_counter() - t0)
            runs.sort()
            print(f"{name:32s} {dist:6s} median {runs[5] * 1e3:7.2f} ms  min {runs[0] * 1e3:7.2f} ms")


if __name__ == "__main__":
    _bench()


def test_plain_greedy_rows_take_the_one_pass_argmax():
    """All rows greedy with nothing that changes the logits: the tokens come from one C pass over the
    logits in their own dtype (no torch op at all: no fp32 copy) and equal the general path's, ties
    included; a row with NaN / +inf / only -inf goes the general way (repaired), and a penalised
    row is processed."""
    from pagedserve.kernels import sample_cpu

    torch.manual_seed(4)
    logits = torch.randn(5, 49152).bfloat16()  # many ties among bf16 values
    logits[1, [7, 900]] = 30.0
    want = [int(r.float().argmax()) for r in logits]
    greedy_opts = [SamplingOptions(temperature=0.0)] * 5
    with _OpLog() as ops:
        fast = Sampler().sample(logits, greedy_opts, [[0]] * 5, [1] * 5).token_ids
    assert fast == want == _general(logits.float(), greedy_opts).token_ids and want[1] == 7
    if sample_cpu.library() is not None:
        assert ops.funcs == [], ops.funcs  # the C pass
    odd = logits.clone()
    odd[2, 11] = float("nan")
    odd[3] = float("-inf")
    odd[4, 12] = float("inf")
    assert _run(odd.clone(), greedy_opts).token_ids == _general(odd.float(), greedy_opts).token_ids
    penalised = [SamplingOptions(temperature=0.0, presence_penalty=100.0)] * 5
    out = Sampler().sample(logits.clone(), penalised, [[0, want[0]]] * 5, [1] * 5).token_ids
    assert out[0] != want[0]  # the penalty applied


def _general(logits, options, token_ids=None):
    """The torch path alone (what every row took before the C pass)."""
    token_ids = token_ids or [[0, 1, 2] for _ in options]
    return Sampler()._sample_general(logits.clone(), options, token_ids, [len(t) for t in token_ids], None)


def test_plain_temperature_rows_draw_in_c_like_the_general_path():
    """Temperature rows without filters, penalties or logprobs: drawn in C with no torch op, the
    same tokens as the general path for the same seeds; in a batch with a logprobs row and a top-k
    row those two go the general way (their own outputs unchanged) while the plain rows keep their
    tokens: a seeded row's token does not depend on its neighbours. A NaN row is repaired."""
    from pagedserve.kernels import sample_cpu

    torch.manual_seed(5)
    logits = (torch.randn(16, 49152) * 2).bfloat16()
    plain = [SamplingOptions(temperature=0.3 + 0.1 * i, seed=100 + i) for i in range(16)]
    with _OpLog() as ops:
        fast = Sampler().sample(logits, plain, [[0, 1, 2]] * 16, [3] * 16).token_ids
    if sample_cpu.library() is not None:
        assert ops.funcs == [], ops.funcs
    assert fast == _general(logits.float(), plain).token_ids
    mixed = list(plain)
    mixed[3] = SamplingOptions(temperature=0.7, seed=7, logprobs=2)
    mixed[9] = SamplingOptions(temperature=0.7, seed=8, top_k=5)
    out = _run(logits, mixed)
    assert [t for i, t in enumerate(out.token_ids) if i not in (3, 9)] == [t for i, t in enumerate(fast) if i not in (3, 9)]
    alone = _general(logits[[3, 9]].float(), [mixed[3], mixed[9]])
    assert [out.token_ids[3], out.token_ids[9]] == alone.token_ids
    assert out.logprobs[3] is not None and out.logprobs[0] is None and out.logprobs[3].top == alone.logprobs[0].top
    odd = logits.clone()
    odd[6, 100] = float("nan")
    assert _run(odd, plain).token_ids == _general(odd.float(), plain).token_ids


class _OpLog(TorchDispatchMode):
    """Record the aten ops run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_without_the_c_pass_every_row_takes_the_torch_path(monkeypatch):
    """Where sample_cpu cannot run (no AVX-512: AVX2 machines), plain rows give the general path's
    tokens through the general path itself."""
    from pagedserve.kernels import sample_cpu

    monkeypatch.setattr(sample_cpu, "library", lambda: None)
    torch.manual_seed(6)
    logits = torch.randn(6, 3000).bfloat16()
    options = [SamplingOptions(temperature=0.0)] * 3 + [SamplingOptions(temperature=0.8, seed=i) for i in range(3)]
    calls = []
    general = Sampler._sample_general

    def spy(self, *args):
        calls.append(args[0].shape[0])
        return general(self, *args)

    monkeypatch.setattr(Sampler, "_sample_general", spy)
    out = _run(logits, options).token_ids
    assert calls == [6]
    assert out == _general(logits.float(), options).token_ids


# ---------------------------------------------------------------- logprobs never cross rows (issue 22)


def test_a_row_asking_for_more_logprobs_than_the_vocabulary_never_reads_the_next_row():
    """Issue 22: a beam row with many out-of-vocabulary stop ids asks for K > vocab candidates.
    The top-k tensor is capped at the vocabulary, and each row's slice of it must be too: the
    row's entries are its own tokens, never the next row's (another tenant's request)."""
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(3, vocab)
    alone = _run(logits[:1], [SamplingOptions(temperature=0.0, logprobs=vocab + 200)]).logprobs[0]
    options = [SamplingOptions(temperature=0.0, logprobs=vocab + 200),
               SamplingOptions(temperature=0.0, logprobs=5), SamplingOptions(temperature=0.0, logprobs=vocab * 3)]
    out = _run(logits, options).logprobs
    for r in (0, 2):
        assert len(out[r].top) == vocab
        assert sorted(t for t, _ in out[r].top) == list(range(vocab))
    assert out[0].top == alone.top
    assert len(out[1].top) == 5
    want = torch.log_softmax(logits[0], -1)
    assert [v for _, v in out[0].top] == pytest.approx([float(want[t]) for t, _ in out[0].top])


# ---------------------------------------------------------------- bias and min_tokens ids prepared once (issue 22)


class _CountedDict(dict):
    reads = 0

    def _count(name):
        def f(self, *a):
            _CountedDict.reads += 1
            return getattr(dict, name)(self, *a)
        return f

    for _name in ("items", "keys", "values", "__iter__", "__getitem__", "get"):
        locals()[_name] = _count(_name)
    del _name


class _CountedTuple(tuple):
    reads = 0

    def __iter__(self):
        _CountedTuple.reads += 1
        return tuple.__iter__(self)

    def __getitem__(self, i):
        _CountedTuple.reads += 1
        return tuple.__getitem__(self, i)


def _reference_bias_and_block(logits, options, token_ids, num_prompt):
    """Per key, as it was."""
    out = logits.clone()
    for i, o in enumerate(options):
        for t, b in (o.logit_bias or {}).items():
            if 0 <= t < out.shape[1]:
                out[i, t] += b
        if o.min_tokens > 0 and len(token_ids[i]) - num_prompt[i] < o.min_tokens:
            for t in o.min_tokens_blocked_ids:
                if 0 <= t < out.shape[1]:
                    out[i, t] = float("-inf")
    return out


def test_bias_and_min_tokens_ids_are_tensors_built_once_and_a_step_reads_no_key():
    """Issue 22: every logit_bias key and min_tokens id was looped over in Python for every row at
    every step. They become tensors once per sequence (Sampler.logits_preps, kept by the worker);
    a step then reads none of them and applies all rows in one op each, with the same values."""
    torch.manual_seed(1)
    vocab = 300
    logits = torch.randn(4, vocab)
    bias = _CountedDict({t: float((t % 7) - 3) for t in range(0, vocab + 500, 3)})  # some out of vocabulary
    blocked = _CountedTuple(list(range(5, vocab + 200, 11)))
    options = [SamplingOptions(temperature=0.0, logit_bias=bias),
               SamplingOptions(temperature=0.7, seed=3, min_tokens=5, min_tokens_blocked_ids=blocked),
               SamplingOptions(temperature=0.0),
               SamplingOptions(temperature=0.0, logit_bias=bias, min_tokens=2, min_tokens_blocked_ids=blocked)]
    token_ids = [[1, 2, 3], [1, 2], [1], [1, 2, 3, 4]]
    num_prompt = [1, 1, 1, 1]
    held = Sampler.logits_preps(logits, options, [None] * 4)
    assert held[2] is None and held[0].bias_ids.shape[0] == len(range(0, vocab, 3))
    assert Sampler.logits_preps(logits, options, held) == held  # kept: nothing rebuilt
    _CountedDict.reads = _CountedTuple.reads = 0
    got = process_logits(logits.clone(), options, token_ids, num_prompt, held)
    out = _run(logits, options, token_ids, num_prompt)
    _CountedDict.reads = _CountedTuple.reads = 0
    for _ in range(3):
        assert Sampler().sample(logits.clone(), options, token_ids, num_prompt, preps=held).token_ids == out.token_ids
    assert _CountedDict.reads == 0 and _CountedTuple.reads == 0
    want = _reference_bias_and_block(logits, options, token_ids, num_prompt)
    assert torch.equal(got, want)
    assert bool(torch.isinf(got[1, 5])) and not bool(torch.isinf(got[3, 5]))  # row 3 is past min_tokens
