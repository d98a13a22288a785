"""The token bitmask (structured outputs, allowed_token_ids, bad_words) is applied before any
sampling transform: no mode ever samples a masked token, unmasked rows are untouched, and
logprobs list no masked token."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.contracts.messages import SamplingOptions
from pagedserve.gpu.sampler import Sampler
from pagedserve.gpu.sampling_mask import TokenMask, unpack_bitmask

V = 1000


def _rows(allowed: list[list[int]], vocab: int = V) -> bytes:
    words = (vocab + 31) // 32
    out = np.zeros((len(allowed), words * 32), dtype=np.uint8)
    for r, ids in enumerate(allowed):
        out[r, ids] = 1
    return np.packbits(out, axis=1, bitorder="little").view(np.int32).tobytes()


def test_unpack_matches_the_bits():
    allowed = [[0, 31, 32, 999], [5], list(range(0, V, 7))]
    m = unpack_bitmask(_rows(allowed), 3, V, torch.device("cpu"))
    assert m.shape == (3, V) and m.dtype == torch.bool
    for r, ids in enumerate(allowed):
        assert m[r].nonzero().squeeze(1).tolist() == sorted(ids)


MODES = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.5),
    dict(temperature=1.0, logit_bias={3: 100.0}),
    dict(temperature=0.0, logprobs=5),
    dict(temperature=1.0, logprobs=3),
]


@pytest.mark.parametrize("mode", MODES, ids=[str(m) for m in MODES])
def test_no_mode_samples_a_masked_token(mode):
    torch.manual_seed(0)
    batch = 12
    logits = torch.randn(batch, V) * 3
    # The unmasked favourites are far away from the allowed set, so a leak would show.
    allowed = {0: [10, 11, 12], 2: [500], 5: list(range(900, 1000)), 7: [3, 4], 11: [999]}
    rows = sorted(allowed)
    options = [SamplingOptions(seed=100 + i, **mode) for i in range(batch)]
    tokens = [[1, 2, 3, 10, 11] for _ in range(batch)]
    ref_logits = logits.clone()
    out = Sampler().sample(logits, options, tokens, [2] * batch,
                           token_mask=TokenMask(rows, _rows([allowed[r] for r in rows])))
    free = Sampler().sample(ref_logits, options, tokens, [2] * batch)
    for i, t in enumerate(out.token_ids):
        if i in allowed:
            assert t in allowed[i], (i, t)
        else:  # unmasked rows draw exactly as without a mask
            assert t == free.token_ids[i]
    if out.logprobs is not None:
        for i in rows:
            lp = out.logprobs[i]
            assert all(tid in allowed[i] for tid, _ in lp.top)
            assert all(v > float("-inf") for _, v in lp.top)
            assert lp.logprob > float("-inf")


def test_logprobs_renormalised_over_the_allowed_tokens():
    logits = torch.zeros(1, V)
    out = Sampler().sample(logits, [SamplingOptions(temperature=0.0, logprobs=2)], [[1]], [1],
                           token_mask=TokenMask([0], _rows([[7, 8]])))
    assert out.token_ids[0] in (7, 8)
    assert out.logprobs[0].logprob == pytest.approx(np.log(0.5), abs=1e-6)


def test_seeded_draw_same_with_and_without_other_rows_masked():
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    opts = [SamplingOptions(temperature=1.0, seed=9 + i) for i in range(4)]
    toks = [[1]] * 4
    a = Sampler().sample(logits.clone(), opts, toks, [1] * 4).token_ids
    b = Sampler().sample(logits.clone(), opts, toks, [1] * 4,
                         token_mask=TokenMask([1, 3], _rows([list(range(V)), [5, 6]]))).token_ids
    assert a[0] == b[0] and a[2] == b[2]
    assert a[1] == b[1]  # an all-allowed row is unchanged
    assert b[3] in (5, 6)


def test_inverted_unpack_and_tokens_past_the_mask_width():
    bits = _rows([[1, 2]], vocab=32)  # one word for a 40-token vocabulary
    allowed = unpack_bitmask(bits, 1, 40, torch.device("cpu"))
    banned = unpack_bitmask(bits, 1, 40, torch.device("cpu"), invert=True)
    assert allowed[0].nonzero().squeeze(1).tolist() == [1, 2]
    assert (banned == ~allowed).all()
