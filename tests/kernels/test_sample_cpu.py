"""csrc/sample_cpu.c (kernels/sample_cpu.py) against torch: greedy = first argmax, draws = the
inverse CDF of the softmax at the row's uniform number (gpu/sampling_draws.draw_full_vocab)."""
from __future__ import annotations

import math

import pytest
import torch

from pagedserve.gpu.sampling_draws import draw_full_vocab
from pagedserve.kernels import sample_cpu
from tests.needs import needs_library

pytestmark = needs_library(sample_cpu.library(), "sample_cpu", "no AVX-512 or AVX2 build on this CPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [5, 16, 49152, 49157])
def test_greedy_is_the_first_argmax_and_declines_non_finite_rows(dtype, cols):
    """Against torch's max(dim).indices: ties (bf16 has many; a tie planted across two vector
    lanes and in the tail), strided rows, a row of one repeated value, a subset of rows; a NaN,
    +inf or an all -inf row is declined (-1) so the sampler repairs it."""
    g = torch.Generator().manual_seed(cols)
    logits = torch.randn(6, cols + 7, generator=g).to(dtype)[:, :cols]  # rows cols + 7 apart
    logits[1] = 0.5  # all equal: index 0
    if cols > 20:
        logits[2, [3, 19]] = 9.0  # a tie in two lanes: the first wins
        logits[3, [cols - 1, 1]] = 9.0
    want = logits.float().max(dim=-1).indices.tolist()
    assert sample_cpu.greedy(logits) == want
    assert sample_cpu.greedy(logits.contiguous()) == want
    assert sample_cpu.greedy(logits, [4, 0, 2]) == [want[4], want[0], want[2]]
    odd = logits.clone()
    odd[4, cols // 2] = float("nan")
    odd[2, cols - 1] = float("inf")
    odd[5] = float("-inf")
    got = sample_cpu.greedy(odd)
    assert [got[i] for i in (2, 4, 5)] == [-1, -1, -1] and [got[i] for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]
    assert sample_cpu.greedy(logits.t()) is None  # columns not contiguous: not taken


def _reference(logits: torch.Tensor, temps: list[float], u: list[float]) -> list[int]:
    probs = torch.softmax(logits.float() / torch.tensor(temps).unsqueeze(1), dim=-1)
    return draw_full_vocab(probs, torch.tensor(u, dtype=torch.float64)).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [7, 300, 49152, 49157])
def test_draw_is_the_inverse_cdf_of_the_softmax(dtype, cols):
    """The same token as the torch path for 256 rows of random logits, temperatures and uniform
    numbers (u = 0 and u just below 1 included), strided rows, a subset of rows; a token nobody
    could draw (-inf logit) is never drawn."""
    g = torch.Generator().manual_seed(cols + 3)
    rows = 256
    logits = (torch.randn(rows, cols + 3, generator=g) * 3).to(dtype)[:, :cols]
    logits[:, 0] = float("-inf")
    temps = (torch.rand(rows, generator=g) * 1.9 + 0.05).tolist()
    u = torch.rand(rows, generator=g, dtype=torch.float64).tolist()
    u[0], u[1] = 0.0, 1.0 - 2.0 ** -53
    got = sample_cpu.draw(logits, None, temps, u)
    want = _reference(logits, temps, u)
    same = sum(a == b for a, b in zip(got, want))
    assert same >= rows - 1, (same, [(a, b) for a, b in zip(got, want) if a != b])  # a boundary may round apart
    assert 0 not in got and all(0 <= t < cols for t in got)
    sub = [5, 200, 17]
    assert sample_cpu.draw(logits, sub, [temps[i] for i in sub], [u[i] for i in sub]) == [got[i] for i in sub]


def test_draw_frequencies_follow_the_softmax():
    """Drawn over 20000 uniform numbers, each token's frequency matches its softmax probability
    (chi-square over 12 tokens, a 1e-4 false-failure rate)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0, 1.5, -2.0, 0.2, 0.7, -0.3]])
    temp, n = 0.8, 20000
    g = torch.Generator().manual_seed(0)
    u = torch.rand(n, generator=g, dtype=torch.float64).tolist()
    rows = logits.expand(n, -1).contiguous()
    got = torch.tensor(sample_cpu.draw(rows, None, [temp] * n, u))
    counts = torch.bincount(got, minlength=12).double()
    expected = torch.softmax(logits[0] / temp, dim=-1).double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.0, (chi2, counts.tolist(), expected.tolist())  # chi2(11) at p = 1e-4 is ~35.7-37


def test_draw_declines_non_finite_rows_and_ignores_other_rows():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 1000, generator=g)
    logits[1, 10] = float("nan")
    logits[2, 11] = float("inf")
    logits[3] = float("-inf")
    got = sample_cpu.draw(logits, None, [1.0] * 4, [0.5] * 4)
    assert got[1:] == [-1, -1, -1] and got[0] == _reference(logits[:1], [1.0], [0.5])[0]
    assert not math.isnan(logits[0].sum())
