"""--quantization fp8's math on the CPU (kernels/fp8_linear.py): per-channel weights, per-token
activations, torch._scaled_mm (it runs on CPU too) against the float32 reference."""
import pytest
import torch

from pagedserve.kernels import fp8_linear as f8


def test_weight_scales_are_per_output_channel_and_saturate_at_448():
    torch.manual_seed(0)
    w = torch.randn(32, 64) * torch.logspace(-3, 2, 32)[:, None]  # rows of very different ranges
    w[3] = 0.0  # a zero row: no division by zero
    q, s = f8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == (32,) and s.dtype == torch.float32
    assert torch.isfinite(q.float()).all()
    amax = q.float().abs().amax(dim=1)
    assert torch.allclose(amax[torch.arange(32) != 3], torch.full((31,), 448.0))  # each row uses the full range
    back = f8.dequantize(q, s)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 per element (normal range)
    big = w.abs() > s[:, None] * 2 ** -6
    assert ((back - w).abs()[big] <= w.abs()[big] * 2 ** -4 + 1e-12).all()
    assert (back[3] == 0).all()


def test_to_fp8_saturates_instead_of_nan():
    v = torch.tensor([1e6, -1e6, 448.0, 0.0])
    assert f8.to_fp8(v).float().tolist() == [448.0, -448.0, 448.0, 0.0]


def test_token_scales_are_per_row():
    x = torch.stack([torch.randn(48), torch.randn(48) * 1e-3, torch.zeros(48)])
    q, s = f8.quantize_tokens(x)
    assert s.shape == (3, 1)
    assert torch.allclose(q.float()[:2].abs().amax(dim=1), torch.tensor([448.0, 448.0]))
    assert (q.float()[2] == 0).all()


@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_equals_the_float32_math(m, dtype):
    torch.manual_seed(m)
    n, k = 48, 96
    w = torch.randn(n, k) * 0.05
    x = (torch.randn(m, k) * 3).to(dtype)
    bias = torch.randn(n)
    wq, ws = f8.quantize_weight(w)
    got = f8.fp8_linear(x, wq, ws, bias)
    ref = f8.reference_linear(x, wq, ws, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    # the only differences: the bf16 output's rounding (8 significant bits), before and after the bias
    err = (got.float() - ref).abs()
    assert (err <= 2 ** -7 * (ref.abs() + 2 * bias.abs()) + 1e-6).all()
    assert err.norm() / ref.norm() < 4e-3
    # and the quantized layer stays close to the full-precision one
    full = x.float() @ w.t() + bias
    assert (ref - full).norm() / full.norm() < 0.05


def test_leading_dimensions_kept():
    wq, ws = f8.quantize_weight(torch.randn(16, 32))
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    assert f8.fp8_linear(x, wq, ws).shape == (2, 3, 16)


def test_eligible_shapes_are_multiples_of_16():
    assert f8.eligible(4096, 14336) and f8.eligible(16, 16)
    assert not f8.eligible(4096, 4104) and not f8.eligible(49153, 4096)


def test_refused_on_cpu_and_on_gpus_before_ada():
    with pytest.raises(f8.Fp8UnsupportedError, match=r"--quantization fp8 .*compute capability >= 8\.9.*cpu"):
        f8.check_device("cpu")
    with pytest.raises(f8.Fp8UnsupportedError, match=r"--quantization fp8 .*compute capability 8\.0"):
        f8.check_device("cuda", capability=(8, 0))  # an A100
    f8.check_device("cuda", capability=(8, 9))  # L4 / L40S
    f8.check_device("cuda", capability=(9, 0))  # H100 / H200
