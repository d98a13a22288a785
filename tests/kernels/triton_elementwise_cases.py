"""The cases of tests/kernels/test_triton_elementwise.py, run in a process of their own with
TRITON_INTERPRET=1 set before triton is imported (see that test). Each case raises on a mismatch."""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from pagedserve.kernels import triton_elementwise as te

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str, floor: float = 1e-3) -> None:
    """fp32: to rounding; half types: at most one unit in the last place of the rounded value.
    ``floor``: the smallest magnitude errors are taken relative to (a rotation's result may
    cancel to near 0; its error is one of its inputs' magnitude)."""
    if want.numel() == 0:
        assert got.shape == want.shape, what
        return
    tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(floor)).max().item()
    if err > tol:
        raise AssertionError(f"{what} {dtype}: relative error {err} > {tol}")


def _same_rounded(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Equal values; for bf16 within one unit in the last place: the interpreter converts fp32 to
    bf16 by truncation where torch and a compiled kernel round to nearest (checked on a GPU by
    the GPU check's model phase)."""
    if dtype != torch.bfloat16:
        assert torch.equal(got, want), what
        return
    spacing = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2 ** -126))) - 7)
    assert bool(((got.float() - want.float()).abs() <= spacing).all()), what


def rms_norm_cases() -> None:
    g = torch.Generator().manual_seed(0)
    for rows, n in ((3, 2048), (5, 100), (0, 64)):
        for dtype in DTYPES:
            x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
            res = torch.randn(rows, n, generator=g).to(dtype)
            w = torch.randn(n, generator=g) * 0.5 + 1
            eps = 1e-5
            # without a residual: x untouched, a new tensor
            x0 = x.clone()
            out = te.rms_norm(x, w, eps)
            want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w).to(dtype)
            assert torch.equal(x, x0), "rms_norm changed its input"
            _close(out, want, dtype, f"rms_norm {rows}x{n}")
            if dtype == torch.float32:
                _close(out, F.rms_norm(x, (n,), w, eps), dtype, "rms_norm vs F.rms_norm")
            # with one: residual += x in place (rounded as torch's add), then the norm of the sum
            r = res.clone()
            out = te.rms_norm(x, w, eps, r)
            total = x + res
            _same_rounded(r, total, dtype, f"residual sum {dtype}")
            want = (r.float() * torch.rsqrt(r.float().pow(2).mean(-1, keepdim=True) + eps) * w).to(dtype)
            _close(out, want, dtype, f"add_rms_norm {rows}x{n}")  # the norm of the sum it wrote
    # a strided x (rows of a wider tensor)
    wide = torch.randn(4, 96, generator=g)
    x = wide[:, :64]
    w = torch.ones(64)
    _close(te.rms_norm(x, w, 1e-6), F.rms_norm(x.contiguous(), (64,), w, 1e-6), torch.float32, "strided rms_norm")


def gemma_norm_case() -> None:
    """Gemma's RMSNorm (scale 1 + w, from ``_weight_f32``) through the kernel equals its torch path."""
    import pagedserve.gpu.models.layers as layers
    from pagedserve.gpu.models.gemma import GemmaRMSNorm
    from pagedserve.kernels import fused

    g = torch.Generator().manual_seed(3)
    norm = GemmaRMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g) * 0.3)
    x, res = torch.randn(4, 96, generator=g), torch.randn(4, 96, generator=g)
    fused.supports = lambda t: False  # the CPU's own C op comes first on CPU tensors: as on CUDA
    want_alone = norm.forward(x.clone())
    want, want_res = norm.forward(x.clone(), res.clone())
    layers.use_triton = lambda t: True
    got_alone = norm.forward(x.clone())
    got, got_res = norm.forward(x.clone(), res.clone())
    _close(got_alone, want_alone, torch.float32, "Gemma norm")
    _close(got, want, torch.float32, "Gemma add + norm")
    assert torch.equal(got_res, want_res)


def _rotate_reference(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    half = rotary_dim // 2
    cs = table[positions.clamp(0, table.shape[0] - 1)]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    out = x.float().clone()
    x1, x2 = out[..., :half].clone(), out[..., half:rotary_dim].clone()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rotary_dim] = x2 * cos + x1 * sin
    return out.to(x.dtype)


def rotary_cases() -> None:
    from pagedserve.gpu.models.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(1)
    for head_dim, rotary_dim, heads, kv_heads in ((64, 64, 9, 3), (128, 64, 4, 2), (80, 80, 5, 1)):
        rope = RotaryEmbedding(head_dim, rotary_dim, 256, 10000.0)
        table = rope.cos_sin_cache
        for dtype in DTYPES:
            tokens = 7
            width = (heads + 2 * kv_heads) * head_dim
            qkv = torch.randn(tokens, width, generator=g).to(dtype)
            qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)  # strided rows
            positions = torch.tensor([0, 1, 5, 17, 255, 300, 3])  # 300: past the table, clamped
            want = _rotate_reference(qk, table, positions, rotary_dim)
            v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
            te.rotary_neox_(qk, table, positions, rotary_dim)
            _close(qk, want, dtype, f"rotary d{head_dim} r{rotary_dim}", floor=1.0)
            assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before), "rotary wrote past q and k"
            if dtype == torch.float32:  # the torch path (positions inside the table) gives the same
                x = torch.randn(3, heads, head_dim, generator=g)
                pos = torch.tensor([2, 9, 100])
                cos, sin = rope.cos_sin(pos, torch.float32)
                want = rope.rotate_(x.clone(), cos, sin)
                got = x.clone()
                te.rotary_neox_(got, table, pos, rotary_dim)
                _close(got, want, dtype, "rotary vs RotaryEmbedding.rotate_", floor=1.0)


def silu_cases() -> None:
    g = torch.Generator().manual_seed(2)
    for rows, n in ((3, 3000), (2, 1024), (0, 16)):
        for dtype in DTYPES:
            x = (torch.randn(rows, 2 * n, generator=g) * 2).to(dtype)
            gate, up = x.float().chunk(2, dim=-1)
            want = (F.silu(gate) * up).to(dtype)
            _close(te.silu_and_mul(x), want, dtype, f"silu_and_mul {rows}x{n}")


def model_case() -> None:
    """A tiny Llama's forward with every Triton kernel (interpreted, on CPU tensors) equals the
    torch path: the wiring in gpu/models (in-place residual, rope positions, the halves)."""
    import pagedserve.gpu.models.layers as layers
    import pagedserve.gpu.models.rotary as rotary
    from pagedserve.gpu.models.llama import LlamaForCausalLM
    from pagedserve.kernels import fused
    from pagedserve.loadtest.tiny_model import TINY_CONFIG

    torch.manual_seed(0)
    model = LlamaForCausalLM({**TINY_CONFIG, "vocab_size": 512})
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    from pagedserve.gpu.forward_context import forward_context

    ids = torch.randint(0, 512, (11,))
    pos = torch.arange(11)
    with torch.inference_mode(), forward_context(None, []):  # no cache: attention over the prompt
        want = model.forward(ids, pos)
        calls = []
        real = te.rms_norm, te.rotary_neox_, te.silu_and_mul

        def counted(fn):
            def inner(*a, **k):
                calls.append(fn.__name__)
                return fn(*a, **k)
            return inner

        te.rms_norm, te.rotary_neox_, te.silu_and_mul = (counted(f) for f in real)
        layers.use_triton = rotary.use_triton = lambda t: True
        # the CPU's own fused C ops come first on CPU tensors: set aside, as on CUDA
        fused.supports, fused.available, fused.has_bf16_gemv = (lambda x: False), (lambda: False), (lambda: False)
        got = model.forward(ids, pos)
    n_layers = TINY_CONFIG["num_hidden_layers"]
    assert calls.count("rms_norm") == 2 * n_layers + 1, calls
    assert calls.count("rotary_neox_") == n_layers and calls.count("silu_and_mul") == n_layers, calls
    err = (got - want).abs().max().item()
    if err > 1e-4:
        raise AssertionError(f"tiny Llama: Triton path differs from torch by {err}")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        globals()[name]()
        print(f"ok {name}", flush=True)
