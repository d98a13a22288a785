"""One device-to-host read per sampling step (issue 24 item 7): on CUDA every host read of a
device value (``tolist``, ``item``, ``bool(t)``, ``nonzero``, a boolean-mask index, ``unique``,
``repeat_interleave`` without its size) waits for the GPU, and so does a blocking copy to it
(``t[index] = 1.0``, a list index, ``torch.tensor``), so a step of each common kind (greedy,
temperature, top-k, top-p, min-p, logprobs, logit_bias / min_tokens, a token mask) does all its
device work and then ONE read, through gpu.sampling_host.to_host. Counted here on the CPU: the
seam's calls, plus every such operation outside it (gpu.sync_watch). The rare paths (a non-finite
row, a top-p nucleus beyond the first candidates) read again, and still give the same tokens."""
from __future__ import annotations

import contextlib

import pytest
import torch

import pagedserve.gpu.sampling_host as sampling_host
from pagedserve.contracts.messages import SamplingOptions
from pagedserve.gpu.sampler import Sampler
from pagedserve.gpu.sampling_mask import TokenMask
from pagedserve.gpu.sync_watch import SyncWatch


@contextlib.contextmanager
def _count_reads():
    """Yields a list: "to_host" per seam call, then every other operation that waits for a CUDA
    device (gpu.sync_watch)."""
    reads: list[str] = []
    real_to_host = sampling_host.to_host

    def to_host(t):
        reads.append("to_host")
        return real_to_host(t)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(sampling_host, "to_host", to_host)
        with SyncWatch() as events:
            yield reads
    reads.extend(events)


def _step(monkeypatch, logits, options, mask=None):
    """One step through the torch path (the CUDA path: the C pass is CPU-only); (tokens, reads)."""
    from pagedserve.kernels import sample_cpu

    monkeypatch.setattr(sample_cpu, "library", lambda: None)
    token_ids = [[0, 1, 2, 3] for _ in options]
    with _count_reads() as reads:
        out = Sampler().sample(logits.clone(), options, token_ids, [2] * len(options), token_mask=mask)
    return out, reads


def _logits(rows=6, vocab=3000, seed=0, scale=3.0):
    torch.manual_seed(seed)
    return torch.randn(rows, vocab) * scale


GREEDY = SamplingOptions(temperature=0.0)
COMMON = {
    "greedy": [GREEDY] * 4,
    "temperature": [SamplingOptions(temperature=0.8, seed=i) for i in range(4)],
    "top_k": [SamplingOptions(temperature=0.9, top_k=20, seed=i) for i in range(4)],
    "top_p": [SamplingOptions(temperature=0.7, top_p=0.9, seed=i) for i in range(4)],
    "min_p": [SamplingOptions(temperature=1.0, min_p=0.05, seed=i) for i in range(4)],
    "mixed": [GREEDY, SamplingOptions(temperature=0.8, seed=1), SamplingOptions(top_k=5, seed=2),
              SamplingOptions(top_p=0.8, top_k=50, seed=3), SamplingOptions(top_p=0.9, seed=4, temperature=0.5)],
    "logprobs": [SamplingOptions(temperature=0.0, logprobs=3), GREEDY,
                 SamplingOptions(temperature=0.8, seed=5, logprobs=0), SamplingOptions(top_p=0.9, seed=6, logprobs=5)],
    "bias_min_tokens": [SamplingOptions(temperature=0.0, logit_bias={7: 50.0, 99999: 1.0}),
                        SamplingOptions(temperature=0.8, seed=3, min_tokens=5, min_tokens_blocked_ids=(1, 2, -4))],
}


@pytest.mark.parametrize("kind", sorted(COMMON))
def test_a_common_step_reads_the_device_once(monkeypatch, kind):
    options = COMMON[kind]
    out, reads = _step(monkeypatch, _logits(len(options)), options)
    assert reads == ["to_host"], reads
    assert len(out.token_ids) == len(options) and all(0 <= t < 3000 for t in out.token_ids)
    if kind == "logprobs":
        assert [e is not None for e in out.logprobs] == [True, False, True, True]
        assert len(out.logprobs[0].top) == 3 and len(out.logprobs[3].top) == 5
    if kind == "bias_min_tokens":
        assert out.token_ids[0] == 7 and out.token_ids[1] not in (1, 2)


def test_a_masked_step_reads_the_device_once(monkeypatch):
    """Structured outputs: the token mask is applied on the device, no extra read."""
    allowed = [5, 9, 2000]
    words = bytearray(4 * ((3000 + 31) // 32))
    for t in allowed:
        words[t // 8] |= 1 << (t % 8)
    options = [SamplingOptions(temperature=0.8, seed=1, logprobs=5)]
    out, reads = _step(monkeypatch, _logits(1), options, TokenMask([0], bytes(words)))
    assert reads == ["to_host"], reads
    assert out.token_ids[0] in allowed and {t for t, _ in out.logprobs[0].top} <= set(allowed)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf_row"])
def test_a_non_finite_row_reads_again_and_keeps_every_token(monkeypatch, bad):
    """Rare: the step's read says a row was not finite; only that row is drawn again (repaired),
    and every token equals a step with no such row for the others."""
    options = COMMON["mixed"] + [SamplingOptions(temperature=0.9, seed=9, logprobs=2)]
    logits = _logits(len(options), seed=1)
    clean, _ = _step(monkeypatch, logits, options)
    odd = logits.clone()
    if bad == "nan":
        odd[1, 17] = float("nan")
    elif bad == "inf":
        odd[5, 40] = float("inf")
    else:
        odd[3] = float("-inf")
    out, reads = _step(monkeypatch, odd, options)
    assert reads[0] == "to_host" and len(reads) > 1
    changed = {"nan": 1, "inf": 5, "-inf_row": 3}[bad]
    assert [t for i, t in enumerate(out.token_ids) if i != changed] == \
        [t for i, t in enumerate(clean.token_ids) if i != changed]
    if bad == "inf":
        assert out.token_ids[5] == 40 and out.logprobs[5] is not None
    assert all(0 <= t < 3000 for t in out.token_ids)


def test_a_wide_nucleus_reads_again_and_draws_as_before(monkeypatch):
    """Rare: a flat row's top-p nucleus lies beyond the first 256 candidates; its token comes from
    a second, wider pass, the same one a sampler with a candidate list covering it draws."""
    torch.manual_seed(3)
    logits = torch.randn(3, 2000) * 0.3  # flat: nuclei of hundreds of tokens
    logits[0] *= 20  # peaked: inside the candidates
    options = [SamplingOptions(top_p=0.9, seed=1), SamplingOptions(top_p=0.95, seed=2),
               SamplingOptions(top_p=0.5, seed=3, logprobs=1)]
    out, reads = _step(monkeypatch, logits, options)
    assert len(reads) > 1
    wide = Sampler(top_p_candidates=2000).sample(logits.clone(), options, [[0, 1, 2, 3]] * 3, [2] * 3)
    assert out.token_ids == wide.token_ids
    assert out.logprobs[2].logprob == pytest.approx(wide.logprobs[2].logprob)


PENALISED = [SamplingOptions(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, seed=7),
             SamplingOptions(temperature=0.0),
             SamplingOptions(repetition_penalty=0.8, temperature=0.0, logprobs=2),
             SamplingOptions(frequency_penalty=-0.7, presence_penalty=1.5, top_p=0.9, seed=3)]


def test_a_penalised_step_on_cuda_reads_the_device_once(monkeypatch):
    """CUDA takes the dense penalty pass (gpu.sampling_logits.dense_penalties): no extra read."""
    import pagedserve.gpu.sampling_logits as sl
    monkeypatch.setattr(sl, "dense_penalties", lambda logits: True)
    out, reads = _step(monkeypatch, _logits(len(PENALISED)), PENALISED)
    assert reads == ["to_host"], reads


@pytest.mark.parametrize("seed", range(4))
def test_the_dense_penalty_pass_equals_the_sparse_one(monkeypatch, seed):
    """Bit for bit, with repeated, out-of-vocabulary and prompt-only tokens, some rows unpenalised."""
    import pagedserve.gpu.sampling_logits as sl
    g = torch.Generator().manual_seed(seed)
    vocab = 500
    logits = torch.randn(len(PENALISED), vocab, generator=g) * 4
    logits[0, 3] = 0.0
    token_ids = [torch.randint(-3, vocab + 3, (int(n),), generator=g).tolist()
                 for n in torch.randint(0, 40, (len(PENALISED),), generator=g)]
    token_ids[1] = token_ids[1] + [3, 3, 3]
    prompt = [min(len(t), 5) for t in token_ids]
    only = [PENALISED[0]] * len(PENALISED)  # every row penalised: the whole-tensor write
    sparse = [sl.process_logits(logits.clone(), opts, token_ids, prompt) for opts in (PENALISED, only)]
    monkeypatch.setattr(sl, "dense_penalties", lambda logits: True)
    with _count_reads() as reads:
        dense = [sl.process_logits(logits.clone(), opts, token_ids, prompt) for opts in (PENALISED, only)]
    assert reads == []
    assert torch.equal(dense[0], sparse[0]) and torch.equal(dense[1], sparse[1])
    assert not torch.equal(dense[0], logits)
