"""The fused decode layer's LoRA delta (csrc/fused_cpu.c: after each linear of fz_attn_in and
fz_mlp_out, ``y[m] += (x[m] @ A[slot]^T) @ B[slot]`` for the rows that name a slot) against torch:
the base layer plus the delta, rows of adapter 0, adapter 1 and none mixed in one call, each build
(portable, AVX2, AVX512-BF16 where the CPU has it) forced in a fresh process, fp32 and bf16
activations, each with fp32 and with bf16 adapter weights (--lora-dtype: the reference then uses the
weights as stored, widened to fp32, as the kernel does)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import fused
from pagedserve.kernels.abi import LinearSpec

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C compiler for the fused ops")

H, I, QH, KVH, D, ROT, R = 64, 96, 4, 2, 16, 16, 4
N_QKV = (QH + 2 * KVH) * D
ROWS = [0, 1, -1, 0, 1]  # slot per row: adapter 0, adapter 1, the base model
SLOTS = 2


def _plain(w: torch.Tensor) -> LinearSpec:
    return LinearSpec(fused.KIND_PLAIN, 0, w.data_ptr(), None, None, None, None)


def _lora(g, n_in: int, cols: list[int], dtype, R: int = R, slots: int = SLOTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots as gpu/models/lora_layers.py lays them out: A [slots, S*R, in]; B^T [slots, S*R, out],
    block-diagonal (section i's R rows feed columns cols[i]..cols[i+1]); slot 1 has rank 2 (rows
    2, 3 of each section zero, as a smaller adapter is padded)."""
    S = len(cols) - 1
    a = torch.randn(slots, S * R, n_in, generator=g) * 0.3
    b = torch.zeros(slots, S * R, cols[-1])
    for i in range(S):
        b[:, i * R:(i + 1) * R, cols[i]:cols[i + 1]] = torch.randn(slots, R, cols[i + 1] - cols[i], generator=g) * 0.3
    a[1, :, :].view(S, R, n_in)[:, 2:] = 0
    b[1, :, :].view(S, R, cols[-1])[:, 2:] = 0
    return a.to(dtype).contiguous(), b.to(dtype).contiguous()


def _delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows=ROWS) -> torch.Tensor:
    """The reference delta in fp32 of the weights as stored (base rows: zero), with t = x @ A^T rounded
    to the activations' dtype as the eager layer's F.linear rounds it (gpu/models/lora_layers.py
    delta_into; a no-op for fp32)."""
    out = torch.zeros(x.shape[0], b.shape[2])
    for m, s in enumerate(rows):
        if s >= 0:
            out[m] = (x[m].float() @ a[s].float().t()).to(x.dtype).float() @ b[s].float()
    return out


def _linear(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows=ROWS) -> torch.Tensor:
    """The eager LoRA linear's arithmetic, in fp32 (the caller rounds): the base output in the
    activations' dtype (F.linear), then y + t @ B summed in fp32 (addmm_). With bf16 activations the
    base output and t are each rounded before the delta is added, and a layer's delta is often as
    large as its base output: a reference that adds the delta before any rounding drifts from this
    by more than bf16's tolerance after three chained linears (issue 36)."""
    return (x.float() @ w.float().t()).to(x.dtype).float() + _delta(x, a, b, rows)


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)


def _rows():
    return torch.tensor(ROWS, dtype=torch.int32)


def check_mlp_out(dtype, lora_dtype) -> None:
    """fz_mlp_out with LoRA on o, gate/up and down: == torch's layer + deltas; base rows bit-equal
    to the call without LoRA; a NULL row list is the base layer."""
    lib = fused.library()
    g = torch.Generator().manual_seed(5)
    M, A = len(ROWS), QH * D
    w_o, w_gu, w_d = (torch.randn(n, k, generator=g).mul(0.2).to(dtype) for n, k in ((H, A), (2 * I, H), (H, I)))
    norm_w = torch.rand(H, generator=g) + 0.5
    attn = torch.randn(M, A, generator=g).to(dtype)
    res0 = torch.randn(M, H, generator=g).to(dtype)
    loras = {"o": _lora(g, A, [0, H], lora_dtype), "gu": _lora(g, H, [0, I, 2 * I], lora_dtype),
             "d": _lora(g, I, [0, H], lora_dtype)}
    specs = {k: _plain(w) for k, w in (("o", w_o), ("gu", w_gu), ("d", w_d))}

    def run(with_lora: bool, rows):
        for k, spec in specs.items():
            a, b = loras[k]
            if with_lora:
                fused.attach_lora(spec, a, b, R, [0, H] if k != "gu" else [0, I, 2 * I])
        res = res0.clone()
        y, h, act, out = (torch.empty(M, n, dtype=dtype) for n in (H, 2 * I, I, H))
        rc = lib.fz_mlp_out(attn.data_ptr(), A, ctypes.addressof(specs["o"]), y.data_ptr(), res.data_ptr(),
                            norm_w.data_ptr(), 1e-5, M, H, ctypes.addressof(specs["gu"]), I, h.data_ptr(),
                            act.data_ptr(), ctypes.addressof(specs["d"]), out.data_ptr(), 2,
                            int(dtype == torch.bfloat16), None if rows is None else rows.data_ptr())
        assert rc == 0
        return out, res

    base_out, base_res = run(False, None)
    rows = _rows()
    got_out, got_res = run(True, rows)
    ref_y = _linear(attn, w_o, *loras["o"]).to(dtype)
    ref_res = (res0.float() + ref_y.float()).to(dtype)
    yn = F.rms_norm(ref_res.float(), (H,), norm_w, 1e-5).to(dtype)
    hh = _linear(yn, w_gu, *loras["gu"]).to(dtype)
    act = F.silu(hh[:, :I]) * hh[:, I:]  # the eager F.silu(gate).mul_(up): bf16 rounds after each op
    ref_out = _linear(act, w_d, *loras["d"])
    torch.testing.assert_close(got_res.float(), ref_res.float(), **_tol(dtype))
    torch.testing.assert_close(got_out.float(), ref_out, **_tol(dtype))
    assert torch.equal(got_out[2], base_out[2]) and torch.equal(got_res[2], base_res[2])  # the base row
    assert not torch.allclose(got_out[0].float(), base_out[0].float(), **_tol(dtype))  # the delta is there
    null_out, _ = run(True, None)
    assert torch.equal(null_out, base_out)


def check_attn_in(dtype, lora_dtype) -> None:
    """fz_attn_in with LoRA on qkv: the delta lands before rotary and the KV write (the cached v
    rows are the reference's; q and k as the reference rotated by the tested fused rotary)."""
    lib = fused.library()
    from pagedserve.gpu.models.rotary import RotaryEmbedding

    rope = RotaryEmbedding(D, ROT, 256, 10000.0)
    g = torch.Generator().manual_seed(9)
    M = len(ROWS)
    w_qkv = torch.randn(N_QKV, H, generator=g).mul(0.2).to(dtype)
    norm_w = torch.rand(H, generator=g) + 0.5
    x0 = torch.randn(M, H, generator=g).to(dtype)
    res0 = torch.randn(M, H, generator=g).to(dtype)
    cols = [0, QH * D, (QH + KVH) * D, N_QKV]
    a, b = _lora(g, H, cols, lora_dtype)
    positions = torch.tensor([3, 0, 17, 100, 9])
    slots = torch.tensor([5, 40, 2, 63, 20])
    spec = _plain(w_qkv)
    fused.attach_lora(spec, a, b, R, cols)
    x, res = x0.clone(), res0.clone()
    qkv = torch.empty(M, N_QKV, dtype=dtype)
    k_cache, v_cache = (torch.zeros(4, 16, KVH, D, dtype=dtype) for _ in range(2))
    rows = _rows()
    rc = lib.fz_attn_in(x.data_ptr(), res.data_ptr(), 1, norm_w.data_ptr(), 1e-5, M, H, ctypes.addressof(spec),
                        N_QKV, qkv.data_ptr(), QH, KVH, D, ROT, None, None, 0.0, rope.cos_sin_cache.data_ptr(),
                        positions.data_ptr(),
                        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), 64, 0, 2,
                        int(dtype == torch.bfloat16), rows.data_ptr())
    assert rc == 0
    ref_res = (x0.float() + res0.float()).to(dtype)
    xn = F.rms_norm(ref_res.float(), (H,), norm_w, 1e-5).to(dtype)
    ref = _linear(xn, w_qkv, a, b).to(dtype)
    fused.rotary_neox_(ref, QH + KVH, D, ROT, rope.cos_sin_cache, positions)
    torch.testing.assert_close(qkv.float(), ref.float(), **_tol(dtype))
    flat_v = v_cache.view(-1, KVH * D)
    torch.testing.assert_close(flat_v[slots].float(), ref[:, cols[2]:].float(), **_tol(dtype))
    flat_k = k_cache.view(-1, KVH * D)
    torch.testing.assert_close(flat_k[slots].float(), ref[:, cols[1]:cols[2]].float(), **_tol(dtype))


def check_groups_and_tails(dtype, lora_dtype) -> None:
    """fz_attn_out with shapes off the kernel's blocks: K and N not multiples of 8 / 16, 16 rows (the
    plain GEMV's most) of four slots (6, 5, 2, 1 rows: every tail of the 4-row blocks), base rows
    between them, one and two threads (16 rows take the parallel region, 3 rows do not): the
    residual gets base + delta per row, the base rows the base alone."""
    lib = fused.library()
    g = torch.Generator().manual_seed(13)
    K, N, rank = 1501, 523, 20
    pattern = [0] * 6 + [1] * 5 + [2] * 2 + [3] + [-1] * 2
    rows = [pattern[(7 * i) % len(pattern)] for i in range(len(pattern))]  # interleaved
    w = torch.randn(N, K, generator=g).mul(0.05).to(dtype)
    a, b = _lora(g, K, [0, N], lora_dtype, R=rank, slots=4)
    norm_w = torch.rand(N, generator=g) + 0.5
    spec = _plain(w)
    fused.attach_lora(spec, a, b, rank, [0, N])
    for m_rows in (rows, rows[:3]):
        M = len(m_rows)
        x = torch.randn(M, K, generator=g).to(dtype)
        ref = _linear(x, w, a, b, m_rows)
        def run(threads, rows_tensor):
            res = torch.zeros(M, N, dtype=dtype)
            y = torch.empty(M, N, dtype=dtype)
            assert lib.fz_attn_out(x.data_ptr(), K, ctypes.addressof(spec), y.data_ptr(), res.data_ptr(),
                                   norm_w.data_ptr(), 1e-5, M, N, threads, int(dtype == torch.bfloat16),
                                   None if rows_tensor is None else rows_tensor.data_ptr()) == 0
            return res

        for threads in (1, 2):
            res = run(threads, torch.tensor(m_rows, dtype=torch.int32))
            torch.testing.assert_close(res.float(), ref, **_tol(dtype))
            base = run(threads, None)
            for m, s in enumerate(m_rows):
                assert torch.equal(res[m], base[m]) == (s < 0), (m, s)


def check(dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    for lora_dtype in (torch.float32, torch.bfloat16):
        check_mlp_out(dtype, lora_dtype)
        check_attn_in(dtype, lora_dtype)
        check_groups_and_tails(dtype, lora_dtype)
        check_delta_alone(dtype, lora_dtype)


def check_delta_alone(dtype, lora_dtype) -> None:
    """fused.lora_add (the delta without a base layer, for prefill chunks): a prefill-sized step, long
    runs of one slot and base runs (more groups and more of t than the stack keeps), == the reference;
    base rows bit-equal to y before."""
    g = torch.Generator().manual_seed(11)
    rank, cols = 16, [0, 40, 56, 72]  # q / k / v-like sections
    a, b = _lora(g, H, cols, lora_dtype, R=rank, slots=3)
    rows = torch.tensor([0] * 70 + [-1] * 30 + [2] * 45 + [1] * 33 + [0] * 22, dtype=torch.int32)
    x = torch.randn(rows.numel(), H, generator=g).to(dtype)
    y0 = torch.randn(rows.numel(), cols[-1], generator=g).to(dtype)
    spec = LinearSpec()
    fused.attach_lora(spec, a, b, rank, cols)
    y = y0.clone()
    fused.lora_add(spec, x, y, rows)
    want = y0.float() + _delta(x, a, b, rows.tolist())
    torch.testing.assert_close(y.float(), want, **_tol(dtype))
    base = rows < 0
    assert torch.equal(y[base], y0[base])
    with pytest.raises(ValueError, match="int32 slots"):
        fused.lora_add(spec, x, y, rows[:-1])


def _in_fresh_process(isa: str, dtype_name: str) -> str:
    """Run ``check`` with the fused library built for ``isa`` (PAGEDSERVE_ISA caps the level);
    returns the build's fz_isa()."""
    code = ("import sys; from pagedserve.kernels import fused; from tests.kernels.test_fused_lora import check; "
            "check(sys.argv[1]); print(fused.library().fz_isa())")
    env = dict(os.environ, PAGEDSERVE_ISA=isa)
    proc = subprocess.run([sys.executable, "-c", code, dtype_name], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("isa,level", [("scalar", "0"), ("avx2", "1")])
def test_fp32_layer_with_lora_matches_torch(isa, level):
    from pagedserve.kernels.isa import cpu_flags

    if isa == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no AVX2 on this CPU")
    assert _in_fresh_process(isa, "float32") == level


@pytest.mark.skipif(not fused.has_bf16_gemv(), reason="the bf16 fused layer needs AVX512-BF16")
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_avx512bf16_layer_with_lora_matches_torch(dtype_name):
    assert _in_fresh_process("avx512bf16", dtype_name) == "2"


def test_this_process_build_with_lora_matches_torch():
    check("float32")
    for lora_dtype in (torch.float32, torch.bfloat16):  # bf16 activations take the widening path on any build
        check_delta_alone(torch.bfloat16, lora_dtype)
    if fused.has_bf16_gemv():
        check("bfloat16")
