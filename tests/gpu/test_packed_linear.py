"""Prepacked CPU linear weights (gpu/models/packed_linear.py): the packed matmul equals F.linear
for every batch size in both dtypes, loading packs every unquantized linear layer (and only
those), and the switch / missing-op fallbacks keep the plain F.linear path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.gpu.forward_context import forward_context
from pagedserve.gpu.models import packed_linear
from pagedserve.gpu.models.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from pagedserve.gpu.models.packed_linear import PackedWeight, can_pack, dense_weight, pack_model, small_rows
from tests.gpu.test_models import ARCHS, load_ours, save_hf_model

LINEARS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
# max |packed - F.linear| over max |F.linear|: fp32 differs only in summation order; bf16 output
# is rounded once (2^-8 relative) and both sides may round differently.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def packing_on(monkeypatch):
    """Packing is on unless PAGEDSERVE_PACKED_LINEAR=0 (a test environment might set it)."""
    monkeypatch.setenv(packed_linear.ENV, "1")


def test_packing_is_on_by_default_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv(packed_linear.ENV)
    assert packed_linear.enabled()
    monkeypatch.setenv(packed_linear.ENV, "0")
    assert not packed_linear.enabled()
    model = torch.nn.Sequential(ColumnParallelLinear(8, 8))
    assert pack_model(model) == 0 and model[0].pweight is None


def test_row_buckets_cover_every_batch_with_bounded_padding():
    buckets = packed_linear.buckets_upto(2048)
    assert len(buckets) == len(set(buckets)) <= 25 and buckets == sorted(buckets)
    for rows in range(1, 2049):
        b = packed_linear.row_bucket(rows)
        assert b >= rows and b in buckets
        if rows > 32:
            assert b / rows <= 1.5 and (b - rows) / b < 0.34  # at most ~a third of the rows padded
    assert packed_linear.row_bucket(17) == 24 and packed_linear.row_bucket(16) == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warm_up_builds_every_bucket_serving_then_uses(dtype, monkeypatch):
    """RSS stays flat while serving: after warm_row_buckets no batch size reaches the packed
    matmul with a row count (hence an oneDNN primitive) it has not seen."""
    _need_packing(dtype)
    rows_seen: set[int] = set()
    real = packed_linear._onednn_linear

    def recording(x, packed, bias):
        rows_seen.add(x.shape[0])
        return real(x, packed, bias)

    monkeypatch.setattr(packed_linear, "_onednn_linear", recording)
    torch.manual_seed(0)
    model = torch.nn.Sequential(ColumnParallelLinear(96, 64, bias=True), RowParallelLinear(64, 96),
                                ParallelLMHead(500, 96))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    model.to(dtype)
    assert pack_model(model) == 3
    built = packed_linear.warm_row_buckets(model, max_tokens=300, max_seqs=40)
    warmed = set(rows_seen)
    assert warmed == {b for b in packed_linear.buckets_upto(300) if b > small_rows(dtype)}
    assert built == 2 * len(warmed) + len([b for b in warmed if b <= packed_linear.row_bucket(40)])
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (3, 5, 17, 33, 100, 257, 299, 300):
            x = torch.randn(rows, 96, generator=g).to(dtype)
            h = model[0](x)  # padded to its bucket, cut back to ``rows``
            want = F.linear(x, dense_weight(model[0]), model[0].bias)
            assert h.shape == want.shape
            assert (h.float() - want.float()).abs().max() / want.float().abs().max() < TOL[dtype]
            model[1](h)
    assert rows_seen == warmed  # no new row count: no new primitive, no RSS growth


def _need_packing(dtype) -> None:
    if not can_pack(torch.empty(2, 2, dtype=dtype)):
        pytest.skip(f"no packed GEMM for {dtype} in this torch build / CPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matmul_equals_f_linear(dtype, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(200, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(200, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 96, generator=g).to(dtype)
    _need_packing(dtype)
    pw = PackedWeight(w)
    with torch.inference_mode():
        got, want = pw.linear(x, b), F.linear(x, w, b)
        got3 = pw.linear(x.view(1, rows, 96), b)  # a leading batch dimension works too
    assert got.dtype == dtype and got.shape == (rows, 200)
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < TOL[dtype], err
    assert torch.equal(got3.view(rows, 200), got)
    assert torch.equal(pw.dense(), w)  # the packed copy holds the weight exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plain_copy_answers_small_batches_and_packed_the_rest(dtype, monkeypatch):
    from pagedserve.kernels import fused

    _need_packing(dtype)
    if dtype == torch.bfloat16 and not fused.has_bf16_gemv():
        pytest.skip("no AVX512-BF16 GEMV here")
    w = (torch.randn(64, 96) * 0.1).to(dtype)
    b = torch.randn(64).to(dtype)
    rows_plain = small_rows(dtype)
    assert rows_plain == {torch.bfloat16: 2, torch.float32: 1}[dtype]
    pw = PackedWeight(w, rows_plain)
    assert pw.plain is not None
    for rows in (1, 2, 3):
        x = torch.randn(rows, 96).to(dtype)
        want = F.linear(x, w, b).float()
        assert ((pw.linear(x, b).float() - want).abs().max() / want.abs().max()) < TOL[dtype]
    monkeypatch.setenv("PAGEDSERVE_PACKED_SMALL_ROWS", "0")
    assert small_rows(dtype) == 0


def test_small_fp32_batches_read_the_plain_weight_with_our_gemv():
    """The fp32 plain copy (and an unpacked fp32 weight, up to GEMV_F32_MAX_M rows) goes through
    fz_gemv_f32, which reads the weight ~2.5x faster than torch's GEMV on the AVX2 box: the same
    bits as that kernel, and F.linear's values to fp32 rounding."""
    from pagedserve.gpu.models.layers import linear
    from pagedserve.kernels import fused

    _need_packing(torch.float32)
    if not fused.has_f32_gemv():
        pytest.skip("no vector build of the fused C library")
    w, b = torch.randn(300, 96) * 0.1, torch.randn(300)
    pw = PackedWeight(w, small_rows(torch.float32))
    x = torch.randn(1, 96)
    assert torch.equal(pw.linear(x, b), fused.gemv_f32(x, w) + b)
    for rows in (1, 3, fused.GEMV_F32_MAX_M):
        xr = torch.randn(rows, 96)
        got = linear(xr, w, b)
        assert torch.equal(got, fused.gemv_f32(xr, w) + b)
        torch.testing.assert_close(got, F.linear(xr, w, b), atol=1e-5, rtol=1e-5)
    xr = torch.randn(fused.GEMV_F32_MAX_M + 1, 96)
    assert torch.equal(linear(xr, w, b), F.linear(xr, w, b))  # past it: torch


# one packed copy by PAGEDSERVE_PACKED_SMALL_ROWS=0, or because the plain copies would not fit the
# memory budget (a model that fills the box); None: the default, both copies for this small model
@pytest.mark.parametrize("one_copy", ["env", "budget", None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama3-tied-scaled", "llama-linear-rope-bias"])  # a tied head; biases
def test_load_packs_every_unquantized_linear(arch, dtype, one_copy, tmp_path, monkeypatch):
    from pagedserve.kernels import fused

    _need_packing(dtype)
    if one_copy == "env":
        monkeypatch.setenv("PAGEDSERVE_PACKED_SMALL_ROWS", "0")
    elif one_copy == "budget":
        monkeypatch.setattr(packed_linear, "plain_copy_budget", lambda: 1000)
    cfg = ARCHS[arch]
    save_hf_model(cfg, tmp_path)
    model = load_ours(tmp_path, dtype)
    linears = [m for m in model.modules() if isinstance(m, LINEARS)]
    assert len(linears) == 4 * cfg["num_hidden_layers"] + 1
    assert all(m.pweight is not None for m in linears)
    tied = cfg.get("tie_word_embeddings", False)
    emb = model.model.embed_tokens
    assert getattr(emb, "pweight", None) is None and emb.weight.numel() > 0  # the lookup table stays plain
    assert (model.lm_head.weight is emb.weight) == tied
    plain_copy = not one_copy and (dtype == torch.float32 or fused.has_bf16_gemv())
    for m in linears:  # the plain weight is gone unless a lookup shares it or small batches read it
        assert (m.pweight.plain is not None) == plain_copy
        assert (m.weight.numel() > 0) == (plain_copy or (tied and m is model.lm_head))

    monkeypatch.setenv(packed_linear.ENV, "0")
    plain = load_ours(tmp_path, dtype)
    assert all(m.pweight is None and m.weight.numel() > 0 for m in plain.modules() if isinstance(m, LINEARS))
    for a, b in zip(linears, [m for m in plain.modules() if isinstance(m, LINEARS)]):
        assert torch.equal(dense_weight(a), b.weight)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    for n in (23, 1):  # a prefill, and one row (the GEMV's batch size)
        ids = torch.arange(n) * 5 % 97
        with torch.inference_mode(), forward_context(None, []):
            got = model.compute_logits(model(ids, torch.arange(n)))
            want = plain.compute_logits(plain(ids, torch.arange(n)))
        assert (got - want).abs().max() < tol * want.abs().max(), n


def test_missing_ops_and_other_devices_keep_f_linear(tmp_path, monkeypatch):
    save_hf_model(ARCHS["llama"], tmp_path)
    assert not can_pack(torch.empty(4, 4, device="meta"))
    monkeypatch.setattr(packed_linear, "_onednn", lambda dtype: False)
    assert not can_pack(torch.empty(4, 4)) and not can_pack(torch.empty(4, 4, dtype=torch.bfloat16))
    model = load_ours(tmp_path, torch.float32)
    assert all(m.pweight is None and m.weight.numel() > 0 for m in model.modules() if isinstance(m, LINEARS))
    assert pack_model(model) == 0


def test_quantized_layers_are_left_alone():
    from pagedserve.contracts.config import ModelConfig
    from pagedserve.gpu.models.loader import load_model

    model = load_model(ModelConfig(load_format="dummy", hf_config=ARCHS["llama"], quantization="int8"),
                       "cpu", torch.float32)
    linears = [m for m in model.modules() if isinstance(m, LINEARS)]
    assert linears and all(m.qweight is not None and m.pweight is None for m in linears)
