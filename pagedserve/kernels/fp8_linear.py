"""FP8 (e4m3) linear layers for ``--quantization fp8`` (vLLM's name): W8A8 with one scale per
output channel of the weight (static, set at load) and one per token of the activations (dynamic,
computed each call), the matmul through ``torch._scaled_mm`` with row-wise scales.

The math, in float32 (``reference_linear`` computes exactly this, the test oracle):

    s_w[n] = max_k |W[n, k]| / 448          W8[n, k] = e4m3(W[n, k] / s_w[n])
    s_x[m] = max_k |x[m, k]| / 448          x8[m, k] = e4m3(x[m, k] / s_x[m])
    y[m, n] = s_x[m] * s_w[n] * sum_k x8[m, k] * W8[n, k]  (+ bias[n])

e4m3fn's largest finite value is 448 (vLLM and torch saturate to it); a zero row gets the scale
``EPS / 448`` so nothing divides by zero. ``torch._scaled_mm`` takes the fp8 operands as they are
(A row-major [M, K], B column-major [K, N]: the [N, K] weight transposed as a view), the scales as
float32 [M, 1] and [1, N], and writes bf16; it runs on CPU too (a oneDNN kernel), so the same call
is tested here against the float32 math. On CUDA it needs compute capability 8.9 or later (Ada,
Hopper, Blackwell): ``check_device`` says which devices can, and every refusal names the option.
``torch._scaled_mm`` also wants K and N multiples of 16: ``eligible`` says which layers qualify
(the others keep their weights in the model's dtype).
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
EPS = 1e-12  # a zero row's amax (vLLM's per-token quantization clamps the same way)
MIN_CAPABILITY = (8, 9)  # Ada Lovelace; Hopper is 9.0
ALIGN = 16  # torch._scaled_mm: K and N multiples of 16
OUT_DTYPE = torch.bfloat16  # row-wise scaled matmuls write bf16


class Fp8UnsupportedError(ValueError):
    """``--quantization fp8`` on a device without FP8 matmuls; the message says what runs where."""


def supported_message(where: str) -> str:
    return (f"--quantization fp8 needs an NVIDIA GPU with FP8 matmuls (compute capability >= "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: Ada, Hopper, Blackwell); {where}. Use --quantization "
            f"none there, or int8 / int4 on the CPU")


def check_device(device: torch.device | str, capability: tuple[int, int] | None = None) -> None:
    """Raise Fp8UnsupportedError unless ``device`` runs FP8 matmuls. ``capability`` stands in for
    the device's own (tests, and the GPU check's dry run, ask about cards they do not have)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise Fp8UnsupportedError(supported_message(f"this model runs on {device.type}"))
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "this GPU"
        raise Fp8UnsupportedError(supported_message(
            f"{name} has compute capability {capability[0]}.{capability[1]}"))


def eligible(out_features: int, in_features: int) -> bool:
    return out_features % ALIGN == 0 and in_features % ALIGN == 0


def _scales(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=EPS) / FP8_MAX


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (e4m3 [N, K], float32 scales [N]): one scale per output channel."""
    w = weight.float()
    scale = _scales(w.abs().amax(dim=1))
    return to_fp8(w / scale[:, None]), scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (e4m3 [M, K], float32 scales [M, 1]): one scale per token. No host
    read, so it is captured in a CUDA graph like any elementwise op."""
    xf = x.float()
    scale = _scales(xf.abs().amax(dim=1, keepdim=True))
    return to_fp8(xf / scale), scale


def to_fp8(values: torch.Tensor) -> torch.Tensor:
    """Saturate to +-448, then round to nearest even e4m3 (the cast alone would give NaN above 448)."""
    return values.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 rows and their scales ([N] or [N, 1]) -> float32 (tests, accuracy checks, oracles)."""
    return q.float() * scale.reshape(-1, 1).float()


def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The matmul: e4m3 [M, K] x e4m3 [N, K]^T with row-wise scales -> bf16 [M, N]. The one call
    the CUDA path makes (and the CPU runs in tests)."""
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=OUT_DTYPE)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b for an fp8 weight, in ``x``'s dtype and shape ([..., K] -> [..., N])."""
    lead = x.shape[:-1]
    xq, xs = quantize_tokens(x.reshape(-1, x.shape[-1]))
    y = scaled_mm(xq, xs, wq, w_scale)
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = y.reshape(*lead, y.shape[-1])
    return y if y.dtype is x.dtype else y.to(x.dtype)


def reference_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_linear`` in float32 from the same quantized operands (the oracle): float32 out."""
    xq, xs = quantize_tokens(x.reshape(-1, x.shape[-1]))
    y = (xq.float() @ wq.float().t()) * xs * w_scale.reshape(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], y.shape[-1])
