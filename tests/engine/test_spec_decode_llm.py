"""Speculative decoding (ngram) with real models: greedy tokens equal to plain decoding on the default
model (chunked prefill, prefix caching, preemption, a stop string and max_tokens inside accepted
runs), seeded sampling reproducible and equal, penalties and filters per position, and the target
distribution kept (chi-square over many seeded draws of a small-vocabulary model)."""
from __future__ import annotations

import math
from collections import Counter

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.gpu.device import cpu_has_bf16
from pagedserve.loadtest.tiny_model import TINY_CONFIG
from tests.tiny import tiny_llm

# The exactness claims hold to the last bit of the arithmetic: a verified run's attention is one SDPA
# chunk, a plain decode's the C kernel, and they agree to fp32 rounding. Under the bf16 K/V that
# "auto" keeps for the quantized model on AVX2 machines, such a last-bit difference can round a K or
# V element one bf16 step the other way (~1e3 times larger), and a near-tie then flips a greedy
# token with or without speculation alike; so the engines compared here keep fp32 K/V where the
# model runs in fp32.
EXACT_KV = {} if cpu_has_bf16() else {"kv_cache_dtype": "float32"}
# Issue 36 (open): on AVX-512 BF16 / AMX CPUs "auto" runs the default model in bf16, whose matmul and
# attention paths are not yet batch-invariant, so a verified row can differ from a plain decode of
# the same position and a near-tie flips. Known and tracked there, not hidden: these tests still run
# (and report XPASS once it holds); strict is off because a near-tie does not flip on every prompt.
NOT_YET_EXACT_HERE = pytest.mark.xfail(
    cpu_has_bf16(), strict=False,
    reason="issue 36: bf16 paths on AVX-512/AMX are not batch-invariant yet; speculation equals plain greedy on AVX2")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
TEXTS = [
    "The committee will meet on Tuesday at noon in the main hall to review the budget for next year.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
]


def chat_prompts(llm) -> list[str]:
    tok = llm.get_tokenizer()
    out = [tok.apply_chat_template([{"role": "user", "content": f"Repeat the following text exactly:\n\n{t}"}])
           for t in TEXTS]
    out.append(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]))
    return out


@pytest.fixture(scope="module")
def base():
    from pagedserve.engine.llm import LLM

    llm = LLM(kv_cache_memory=0.25, **EXACT_KV)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec():
    """Chunked prefill with a small budget (drafts compete with prompt chunks), prefix caching on."""
    from pagedserve.engine.llm import LLM

    llm = LLM(kv_cache_memory=0.25, max_num_batched_tokens=48, speculative_config=NGRAM, **EXACT_KV)
    yield llm
    llm.shutdown()


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@NOT_YET_EXACT_HERE
def test_default_model_greedy_equal_token_for_token(base, spec):
    prompts = chat_prompts(base)
    sp = SamplingParams(temperature=0, max_tokens=48)
    want = base.generate(prompts, sp, use_tqdm=False)
    before = spec.core.stats()
    got = spec.generate(prompts, sp, use_tqdm=False)
    assert ids(got) == ids(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    after = spec.core.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    # Prefix caching: the same prompts again hit the cache and still give the same tokens.
    assert ids(spec.generate(prompts, sp, use_tqdm=False)) == ids(want)
    assert spec.core.stats().prefix_cache_hits > after.prefix_cache_hits


def test_default_model_stop_and_max_tokens_inside_accepted_runs(base, spec):
    prompt = chat_prompts(base)[0]
    full = base.generate([prompt], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (3, 7, 11, 14, 18)]
    for at in (8, 23, 41):
        params.append(SamplingParams(temperature=0, max_tokens=40, stop=[full.text[at:at + 5]]))
    prompts = [prompt] * len(params)
    want = [base.generate([p], sp, use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params)]
    got = [spec.generate([p], sp, use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params)]
    for w, g, sp in zip(want, got, params):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            w.token_ids, w.text, w.finish_reason, w.stop_reason)
        if sp.stop:
            assert g.finish_reason == "stop" and sp.stop[0] not in g.text
        else:
            assert len(g.token_ids) == sp.max_tokens


@NOT_YET_EXACT_HERE
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_default_model_preemption_mid_run(base, mode):
    from pagedserve.engine.llm import LLM

    prompts = chat_prompts(base) * 2
    sp = SamplingParams(temperature=0, max_tokens=40)
    want = ids(base.generate(prompts, sp, use_tqdm=False))
    # 12 blocks of 16 tokens: one request fits, eight at once do not.
    llm = LLM(num_gpu_blocks_override=16, preemption_mode=mode, swap_space=0.05, speculative_config=NGRAM,
              **EXACT_KV)
    try:
        assert ids(llm.generate(prompts, sp, use_tqdm=False)) == want
        s = llm.core.stats()
        assert s.num_preemptions > 0 and s.spec_decode_num_accepted_tokens > 0
    finally:
        llm.shutdown()


# ---- a small-vocabulary random model: drafts are proposed at almost every step -----------------

SMALL = dict(TINY_CONFIG, vocab_size=16, hidden_size=32, intermediate_size=64)
REPEATING = [[3, 4, 5, 6, 7] * 4, [8, 9, 8, 10, 8, 9, 8, 10, 11, 12], [5, 5, 6, 5, 5, 6, 5, 5]]


@pytest.fixture(scope="module")
def small_pair():
    plain = tiny_llm(hf_config=SMALL)
    # prompt_lookup_min 1: with 16 tokens the last one is nearly always in the prompt, so drafts come
    fast = tiny_llm(hf_config=SMALL, speculative_config=dict(NGRAM, prompt_lookup_min=1))
    yield plain, fast
    plain.shutdown()
    fast.shutdown()


def _sampled(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in REPEATING for _ in params],
                        [sp for _ in REPEATING for sp in params], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("extra", [
    {"temperature": 0},
    {"temperature": 0, "repetition_penalty": 1.4, "frequency_penalty": 0.6, "presence_penalty": 0.4},
    {"temperature": 0.9},
    {"temperature": 0.7, "top_k": 5, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 1.1, "repetition_penalty": 1.2, "frequency_penalty": 0.3, "min_tokens": 4},
])
def test_small_vocab_seeded_equal_and_reproducible(small_pair, extra):
    plain, fast = small_pair
    params = [SamplingParams(seed=s, max_tokens=16, ignore_eos=True, logprobs=2, **extra) for s in range(6)]
    want = _sampled(plain, params)
    before = fast.core.stats()
    got = _sampled(fast, params)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert _sampled(fast, params) == got  # reproducible
    for (_, lw), (_, lg) in zip(want, got):  # logprobs of every token as without speculation
        for ew, eg in zip(lw, lg):
            assert ew.keys() == eg.keys()
            for tid in ew:
                assert eg[tid].logprob == pytest.approx(ew[tid].logprob, abs=1e-5)
                assert eg[tid].rank == ew[tid].rank
    after = fast.core.stats()
    assert after.spec_decode_num_draft_tokens > before.spec_decode_num_draft_tokens


def _chi2_quantile(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719: p = 1e-4)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def _two_sample_chi2(a: Counter, b: Counter) -> tuple[float, int]:
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    cells, rest = [], (0, 0)
    for k in keys:  # categories expected below 5 in either sample are pooled
        if (a[k] + b[k]) * min(na, nb) / (na + nb) >= 5:
            cells.append((a[k], b[k]))
        else:
            rest = (rest[0] + a[k], rest[1] + b[k])
    if sum(rest):
        cells.append(rest)
    stat = 0.0
    for x, y in cells:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            e = tot * n / (na + nb)
            stat += (obs - e) ** 2 / e
    return stat, len(cells) - 1


def test_small_vocab_distribution_kept_chi_square(small_pair):
    """Rejection sampling keeps the target distribution: the first tokens' frequencies over many
    seeded draws with speculation match those of plain sampling with other seeds."""
    plain, fast = small_pair
    n = 1000
    prompt = {"prompt_token_ids": REPEATING[0]}
    runs = {}
    for name, llm, seed0 in (("plain", plain, 10_000), ("spec", fast, 20_000)):
        before = llm.core.stats()
        outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=seed0 + i, max_tokens=6,
                                                          ignore_eos=True) for i in range(n)], use_tqdm=False)
        runs[name] = [o.outputs[0].token_ids for o in outs]
        after = llm.core.stats()
    assert after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens > n  # drafts were verified
    assert 0 < after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    for pos in (1, 2, 3):
        a = Counter(t[pos] for t in runs["plain"])
        b = Counter(t[pos] for t in runs["spec"])
        stat, df = _two_sample_chi2(a, b)
        assert df >= 2 and stat < _chi2_quantile(df), (pos, stat, df, a, b)
    # Pairs of positions 1-2: the joint, where a wrongly accepted draft would show first.
    a = Counter(tuple(t[1:3]) for t in runs["plain"])
    b = Counter(tuple(t[1:3]) for t in runs["spec"])
    stat, df = _two_sample_chi2(a, b)
    assert stat < _chi2_quantile(df), (stat, df)


# ---- draft model ---------------------------------------------------------------------------------

def _draft_llm(path, **kw):
    from pagedserve.engine.llm import LLM

    return LLM(kv_cache_memory=0.25, speculative_config={"model": str(path), "num_speculative_tokens": 3},
               **EXACT_KV, **kw)


@NOT_YET_EXACT_HERE
def test_draft_model_itself_accepts_everything(base, default_model_path):
    prompts = chat_prompts(base)
    sp = SamplingParams(temperature=0, max_tokens=32)
    want = ids(base.generate(prompts, sp, use_tqdm=False))
    llm = _draft_llm(default_model_path, max_num_batched_tokens=48)
    try:
        assert ids(llm.generate(prompts, sp, use_tqdm=False)) == want
        s = llm.core.stats()
        assert s.spec_decode_num_draft_tokens > 0
        assert s.spec_decode_num_accepted_tokens == s.spec_decode_num_draft_tokens
        # Seeded sampling: the very tokens of plain sampling (a greedy draft is a point mass).
        seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=24) for i in range(len(prompts))]
        assert ids(llm.generate(prompts, seeded, use_tqdm=False)) == ids(base.generate(prompts, seeded,
                                                                                        use_tqdm=False))
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory):
    """A random 2-layer Llama with the default model's vocabulary, saved as safetensors."""
    from tests.gpu.test_models import save_hf_model

    path = tmp_path_factory.mktemp("draft")
    save_hf_model(dict(TINY_CONFIG), path)
    return path


@NOT_YET_EXACT_HERE
def test_random_draft_model_output_as_plain_greedy(base, random_draft_dir):
    prompts = chat_prompts(base)
    sp = SamplingParams(temperature=0, max_tokens=32)
    want = ids(base.generate(prompts, sp, use_tqdm=False))
    llm = _draft_llm(random_draft_dir, num_gpu_blocks_override=16)  # preemption too
    try:
        assert ids(llm.generate(prompts * 2, sp, use_tqdm=False)) == want * 2
        s = llm.core.stats()
        assert s.spec_decode_num_draft_tokens > s.spec_decode_num_accepted_tokens
        assert s.num_preemptions > 0
    finally:
        llm.shutdown()


def test_draft_model_of_another_vocabulary_refused(tmp_path_factory):
    from tests.gpu.test_models import save_hf_model

    path = tmp_path_factory.mktemp("draft_vocab")
    save_hf_model(dict(TINY_CONFIG, vocab_size=1000), path)
    with pytest.raises(Exception, match="vocabulary of 1000 tokens but the model has 49152"):
        _draft_llm(path)


def test_worker_processes_carry_drafts_and_verified_runs(small_pair):
    """executor mp (serve's): drafts and multi-token outputs through the step ring."""
    plain, _ = small_pair
    params = [SamplingParams(temperature=t, seed=3, max_tokens=20, ignore_eos=True, logprobs=1) for t in (0, 0.8)]
    want = _sampled(plain, params)
    llm = tiny_llm(hf_config=SMALL, executor="mp", speculative_config=dict(NGRAM, prompt_lookup_min=1))
    try:
        assert _sampled(llm, params) == want
        assert llm.core.stats().spec_decode_num_accepted_tokens > 0
    finally:
        llm.shutdown()
