"""Building blocks shared by the model definitions, written for tensor parallelism.

Linear layers hold only this rank's shard. Every parameter carries a ``weight_loader(param,
loaded, shard_id)`` that takes the *full* checkpoint tensor, cuts this rank's part out and copies
it in (converting dtype), so the loader never needs to know how a layer is sharded. Fused layers
(qkv, gate/up) are loaded one checkpoint tensor at a time, addressed by ``shard_id``; their
``shard_ids`` attribute lists what must arrive before the parameter counts as loaded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.contracts.errors import ModelLoadError
from pagedserve.kernels import fused
from pagedserve.kernels.attention import use_triton
from pagedserve.gpu.parallel_state import divide, get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelLoadError(f"shape mismatch for {what}: checkpoint has {tuple(src.shape)}, "
                             f"model expects {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Replicated parameter: copy the whole tensor."""
    _copy_checked(param.data, loaded, "parameter")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed=None) -> torch.Tensor:
    """The layer's prepacked weight when it has one (gpu/models/packed_linear.py); else F.linear,
    except small batches on CPU: bf16 on AVX512-BF16 CPUs, where torch's GEMV reads the weights at
    about 0.7x the rate of our kernel, and fp32, where it reads them at ~12 GB/s against our
    kernel's ~23 GB/s on the AVX2 box (a tied fp32 LM head of the default model: 8.9 ms a step;
    loadtest/PERF.md). Decode is that read."""
    if packed is not None:
        return packed.linear(x, bias)
    if (x.dim() == 2 and x.device.type == "cpu" and weight.device.type == "cpu" and weight.is_contiguous()
            and x.dtype is weight.dtype):
        if (x.dtype is torch.bfloat16 and x.shape[0] <= fused.GEMV_MAX_M and fused.has_bf16_gemv()):
            y = fused.gemv_bf16(x.contiguous(), weight)
            return y if bias is None else y.add_(bias)
        if x.dtype is torch.float32 and 1 <= x.shape[0] <= fused.GEMV_F32_MAX_M and fused.has_f32_gemv():
            y = fused.gemv_f32(x.contiguous(), weight)
            return y if bias is None else y.add_(bias)
    return F.linear(x, weight, bias)


def _new_param(*shape: int, loader, shard_ids: tuple | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader
    p.shard_ids = shard_ids
    return p


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; optionally adds the residual first (returns both)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = _new_param(hidden_size, loader=default_weight_loader)
        self._w32: torch.Tensor | None = None  # fp32 copy of the weight for the fused CPU op
        self._w32_key = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel accumulates in float32 for bf16 input: one op instead of five.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def _weight_f32(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version)  # a reload (copy_) bumps the version
        if self._w32_key != key:
            self._w32 = w.detach().float().contiguous()
            self._w32_key = key
        return self._w32

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dim() == 2 and x.is_contiguous() and fused.supports(x) and self.weight.device.type == "cpu":
            # CPU: one C pass instead of five torch ops (plus the add); in place on x and
            # residual, which are this step's fresh activations.
            if residual is None:
                return fused.rms_norm(x, self._weight_f32(), self.eps)
            if residual.is_contiguous() and residual.dtype == x.dtype:
                fused.add_rms_norm_(x, residual, self._weight_f32(), self.eps)
                return x, residual
        if x.dim() == 2 and x.stride(1) == 1 and use_triton(x) and (
                residual is None or residual.is_contiguous() and residual.dtype == x.dtype):
            # CUDA: one kernel (the add and the norm), residual updated in place, as on CPU.
            from pagedserve.kernels import triton_elementwise  # imports triton: only on the CUDA path

            out = triton_elementwise.rms_norm(x, self._weight_f32(), self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = _new_param(hidden_size, loader=default_weight_loader)
        self.bias = _new_param(hidden_size, loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split along the output dimension; the output stays sharded."""

    qweight = None  # a gpu.models.quantization.QuantizedWeight under --quantization int8/int4
    pweight = None  # a gpu.models.packed_linear.PackedWeight: the unquantized weight, prepacked

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.output_size_per_rank = divide(output_size, self.tp_size, "linear output size")
        self.weight = _new_param(self.output_size_per_rank, input_size, loader=self.weight_loader)
        self.bias = _new_param(self.output_size_per_rank, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        if loaded.shape[0] != n * self.tp_size:
            raise ModelLoadError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
                                 f"{(n * self.tp_size, *param.shape[1:])}")
        _copy_checked(param.data, loaded.narrow(0, self.tp_rank * n, n), "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.linear(x)  # bias included
        return linear(x, self.weight, self.bias, self.pweight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (gate and up of the MLP)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        ids = tuple(range(len(output_sizes)))
        self.weight.shard_ids = ids
        if self.bias is not None:
            self.bias.shard_ids = ids

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # the checkpoint already holds the fused tensor
            return super().weight_loader(param, loaded)
        size = divide(self.output_sizes[shard_id], self.tp_size, "fused linear part")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        if loaded.shape[0] != size * self.tp_size:
            raise ModelLoadError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
                                 f"{(size * self.tp_size, *param.shape[1:])}")
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size),
                      f"fused part {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks (kv heads replicated when there are
    fewer of them than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "number of attention heads")
        if tp >= num_kv_heads:
            divide(tp, num_kv_heads, "tensor-parallel size over kv heads")
            self.num_kv_heads, self.kv_replicas = 1, tp // num_kv_heads
        else:
            self.num_kv_heads, self.kv_replicas = divide(num_kv_heads, tp, "number of kv heads"), 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias)
        self.weight.shard_ids = ("q", "k", "v")
        if self.bias is not None:
            self.bias.shard_ids = ("q", "k", "v")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise ModelLoadError("a fused qkv tensor must be split before loading")
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank, full = 0, q, self.tp_rank, q * self.tp_size
        else:
            offset = q if shard_id == "k" else q + kv
            size, rank = kv, self.tp_rank // self.kv_replicas
            full = kv * self.tp_size // self.kv_replicas
        if loaded.shape[0] != full:
            raise ModelLoadError(f"shape mismatch for {shard_id}: checkpoint has {tuple(loaded.shape)}, "
                                 f"model expects {(full, *param.shape[1:])}")
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size),
                      f"{shard_id} projection")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split along the input dimension; partial sums all-reduced."""

    qweight = None  # a gpu.models.quantization.QuantizedWeight under --quantization int8/int4
    pweight = None  # a gpu.models.packed_linear.PackedWeight: the unquantized weight, prepacked

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_rank = divide(input_size, self.tp_size, "linear input size")
        self.weight = _new_param(output_size, self.input_size_per_rank, loader=self.weight_loader)
        self.bias = _new_param(output_size, loader=default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[1]
        if loaded.dim() != 2 or loaded.shape[1] != n * self.tp_size:
            raise ModelLoadError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
                                 f"{(param.shape[0], n * self.tp_size)}")
        _copy_checked(param.data, loaded.narrow(1, self.tp_rank * n, n), "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.pweight) if self.qweight is None else self.qweight.linear(x)
        if self.tp_size > 1:
            y = tp_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks (vocab padded to a multiple of the rank count)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.start = self.tp_rank * self.rows_per_rank
        self.end = min(self.start + self.rows_per_rank, num_embeddings)
        self.weight = _new_param(self.rows_per_rank, embedding_dim, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ModelLoadError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
                                 f"{(self.num_embeddings, param.shape[1])}")
        n = self.end - self.start
        _copy_checked(param.data[:n], loaded[self.start:self.end], "embedding rows")
        if n < param.shape[0]:
            param.data[n:].zero_()

    qweight = None  # a packed table (gpu.models.quantization.QuantizedWeight): lookups read its rows

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.qweight is None else self.qweight.rows(ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = torch.where(outside, 0, input_ids - self.start)
        out = self._lookup(local)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over this rank's vocab rows; logits gathered to the full vocabulary."""

    qweight = None  # a gpu.models.quantization.QuantizedWeight under --quantization int8/int4
    pweight = None  # a gpu.models.packed_linear.PackedWeight (a tied table stays plain for lookups)

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        super().__init__(num_embeddings, embedding_dim)
        self.bias = _new_param(self.rows_per_rank, loader=self.bias_loader) if bias else None

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.end - self.start
        _copy_checked(param.data[:n], loaded[self.start:self.end], "lm head bias")

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Logits over the vocabulary: fp32, or (``fp32=False``, for the sampler, which widens
        only when it needs to) in the head's output dtype."""
        if self.qweight is None:
            logits = linear(hidden, self.weight, self.bias, self.pweight)
        else:
            logits = self.qweight.linear(hidden)  # bias included
        if self.tp_size > 1:
            logits = tp_all_gather(logits, dim=-1)
        logits = logits[..., : self.num_embeddings]
        return logits.float() if fp32 else logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)


class SiluAndMul(nn.Module):
    """silu(gate) * up over the two halves of a fused gate/up output. On CPU the fused decode
    layer's own C loop, so a row gets the same bits whether its step runs fused or eager (batch
    invariance): bf16 on AVX512-BF16 CPUs (torch's bf16 results bit for bit, 1.6x faster: 256 x
    1536 137 -> 84 us), fp32 with the vectorised exp of csrc/exp.h (a scalar-expf kernel had
    measured 1.5-14x slower than torch, loadtest/PERF.md); torch's ops elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous() and x.device.type == "cpu":
            if x.dtype is torch.bfloat16 and fused.has_bf16_gemv():
                return fused.silu_and_mul_bf16(x)
            if x.dtype is torch.float32 and fused.available():
                return fused.silu_and_mul_f32(x)  # the fused decode layer's own SiLU: same bits
        if x.dim() == 2 and x.stride(1) == 1 and use_triton(x):
            from pagedserve.kernels import triton_elementwise

            return triton_elementwise.silu_and_mul(x)  # one kernel instead of two
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)  # x is a fresh matmul output: reuse it


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))  # no __call__ overhead
