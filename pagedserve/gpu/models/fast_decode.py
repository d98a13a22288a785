"""Small-batch decode of a Llama layer in two C calls (kernels/csrc/fused_cpu.c).

Why: a batch-1 decode step of the default model spent ~4 of ~20 ms in Python and torch glue
between the dozen C calls each of its 30 layers makes (norm, qkv GEMV, rotary, KV write, o GEMV,
add + norm, gate/up GEMV, SiLU and mul, down GEMV). ``fz_attn_in`` does everything before
attention and ``fz_mlp_out`` everything after, with the same C pieces (so the same roundings);
attention itself stays the one paged-attention dispatch (kernels.attention).

A decode-only step (every request one new token) goes further: ``FastDecodeStack`` runs all the
model's layers in one C call (``fz_decode_stack``: the same two calls per layer with the decode
attention kernel between them, called by address), which removes the ~45 us of Python between a
layer's calls and the ~35 us of attention dispatch per layer (2.4 of 14.2 ms a token at batch 1).

When: CPU with AVX512-BF16, bf16 activations, one tensor-parallel rank, a Llama layer without
biases, and each linear either plain bf16 rows (our bf16 GEMV reads them; up to
``fused.GEMV_MAX_M`` rows) or a q8_0 / q4_1 weight on the 16-channel layout (the fused layer calls
the same VNNI / AMX kernels the eager path would, up to the rows those take). Larger batches,
fp32 machines and other layouts take the eager path. With multi-LoRA (``attach_lora``) each linear
also adds its rows' adapter deltas in C (csrc/fused_lora.h), so a step with adapter rows stays
here too. ``PAGEDSERVE_FAST_DECODE=0`` turns it off;
``PAGEDSERVE_FAST_DECODE=layer`` keeps the per-layer calls and no stack (tests compare the two).

Qwen3 layers (q/k RMS norms, done inside ``fz_attn_in``) and MoE layers take the per-layer calls, not
the stack: a MoE layer's feed-forward is its SparseMoeBlock (one C call of its own, kernels/moe_cpu.py),
after ``fz_attn_out`` (o projection, residual add and norm). Before, these layers' attention ran ~15
eager torch ops (314 us a layer of a 12-layer MoE model, loadtest/PERF.md).
"""
from __future__ import annotations

import ctypes
import itertools
import logging

import torch
from torch import nn

from pagedserve.contracts import env
from pagedserve.gpu.forward_context import get_forward_context
from pagedserve.kernels import cpu_attention, fused, qgemm_n16
from pagedserve.kernels.abi import LayerSpec, LinearSpec
from pagedserve.kernels.attention import paged_attention
from pagedserve.kernels import kv_cache_dtype

logger = logging.getLogger(__name__)

ENV = env.FAST_DECODE.name
FP32_LAYER_MAX_ROWS = 64  # fp32 activations with quantized weights: the most rows a fused layer takes


class BoundLinear:
    """One linear layer as the fused layer calls it: its LinearSpec (and the spec's address),
    output size and the most rows the path takes."""

    __slots__ = ("spec", "address", "out_features", "max_rows")

    def __init__(self, spec: LinearSpec, out_features: int, max_rows: int):
        self.spec, self.out_features, self.max_rows = spec, out_features, max_rows
        self.address = ctypes.addressof(spec)  # the module keeps the tensors it points at alive


def bind_linear(module: nn.Module, dtype: torch.dtype) -> BoundLinear | None:
    """The fused layer's view of a bias-free linear layer for activations of ``dtype``, or None
    where it cannot read the weight: q8_0 / q4_1 weights (either activation dtype; the AMX kernel
    only for bf16 ones), or plain rows of the activations' own dtype (the bf16 or fp32 GEMV)."""
    # optional: bias, qweight (quantized) and pweight (packed) exist only on the layers that have them
    if getattr(module, "bias", None) is not None:
        return None
    qweight = getattr(module, "qweight", None)
    if qweight is not None:
        kind = {"q8_0": fused.KIND_Q8_0, "q4_1": fused.KIND_Q4_1}.get(qweight.mode)
        entry = qweight.kernel.fused_entry() if kind is not None else None
        if entry is None:
            return None
        tensors, small, big, rows = entry
        if dtype is not torch.bfloat16 and big is not None:  # the AMX kernel multiplies bf16 rows only
            big, rows = None, qgemm_n16.FUSED_MAX_M
        if dtype is torch.float32:  # the layer's norms, rotary and SiLU run on one thread: decode-sized
            rows = min(rows, FP32_LAYER_MAX_ROWS)  # batches, even where the kernel takes every M (AVX2)
        ptrs = [t.data_ptr() for t in tensors] + [None] * (3 - len(tensors))
        spec = LinearSpec(kind, qgemm_n16.AMX_MIN_M if big else 0, *ptrs, small, big)
        return BoundLinear(spec, qweight.out_features, rows)
    most = fused.GEMV_MAX_M if dtype is torch.bfloat16 else fused.GEMV_F32_MAX_M
    pw = getattr(module, "pweight", None)  # optional: a packed layer's weight
    if pw is not None:
        weight, rows = pw.plain, pw.small_rows
    else:
        weight, rows = module.weight, most
    if weight is None or weight.dtype is not dtype or not weight.is_contiguous() or not rows:
        return None
    spec = LinearSpec(fused.KIND_PLAIN, 0, weight.data_ptr(), None, None, None, None)
    return BoundLinear(spec, weight.shape[0], min(rows, most))


class FastDecodeLayer:
    """One LlamaDecoderLayer's weights and shapes, bound once; ``forward`` mirrors the layer's."""

    def __init__(self, layer: nn.Module, weights: dict[str, BoundLinear]):
        attn = layer.self_attn
        self.layer_idx = attn.attn.layer_idx
        self.scale = attn.attn.scale
        self.q_heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.rotary = attn.rotary_emb
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.qk_norms = None if attn.q_norm is None else (attn.q_norm, attn.k_norm)  # Qwen3
        self.moe = None if "gate_up" in weights else layer.mlp  # a SparseMoeBlock: its own C step
        self.weights = weights  # (keeps the specs alive)
        self.w_qkv, self.w_o = weights["qkv"].address, weights["o"].address
        self.hidden = weights["o"].out_features
        self.n_qkv = weights["qkv"].out_features
        if self.moe is None:
            self.w_gu, self.w_down = weights["gate_up"].address, weights["down"].address
            self.inter = weights["gate_up"].out_features // 2
        else:
            self.w_gu = self.w_down = self.inter = None
        self.max_rows = min(w.max_rows for w in weights.values())
        self.dtype = layer.input_layernorm.weight.dtype  # the activations' (fp32 or bf16)
        self.dtype_code = int(self.dtype is torch.bfloat16)
        self.lora = None  # the adapter slots its specs point into (attach_lora), kept alive here

    def attach_lora(self, slots: dict) -> bool:
        """Point the four linears' specs at their multi-LoRA slots (``slots``: qkv / o / gate_up /
        down -> gpu.models.lora_layers.LoRALinear), so steps with adapter rows stay on this path;
        False (nothing changed) where the slots are not fp32 / bf16 CPU tensors (either dtype with
        either activations' dtype: csrc/fused_lora.h widens bf16 and sums in fp32)."""
        if any(h.a.device.type != "cpu" or not fused.supports(h.a) for h in slots.values()):
            return False
        for name, h in slots.items():
            fused.attach_lora(self.weights[name].spec, h.a, h.b, h.rank, h.cols())
        self.lora = slots
        return True

    def forward(self, rope: tuple, x: torch.Tensor, residual: torch.Tensor | None):
        """(out, residual) like LlamaDecoderLayer.forward, or None when this step is not ours."""
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        if meta is None or not ctx.kv_caches or not x.is_contiguous() or rope[2] is None or x.dtype != self.dtype:
            return None  # the profile run, a strided input, or positions the fused rotary cannot read
        lib = fused.library()
        M, H = x.shape
        threads = torch.get_num_threads()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        if not kv_cache_dtype.readable(k_cache.dtype, x.dtype):
            return None
        lora_rows = _lora_rows(ctx, self.lora is not None)
        if lora_rows is False:
            return None
        first = residual is None
        if first:
            residual = torch.empty_like(x)
        qkv = x.new_empty((M, self.n_qkv))
        slots = meta.slot_mapping
        qn = kn = None
        eps_qk = 0.0
        if self.qk_norms is not None:
            qn, kn = (n._weight_f32().data_ptr() for n in self.qk_norms)
            eps_qk = self.qk_norms[0].eps
        rc = lib.fz_attn_in(x.data_ptr(), residual.data_ptr(), int(not first), self.in_norm._weight_f32().data_ptr(),
                            self.in_norm.eps, M, H, self.w_qkv, self.n_qkv, qkv.data_ptr(),
                            self.q_heads, self.kv_heads, self.head_dim, self.rotary.rotary_dim, qn, kn, eps_qk,
                            self.rotary.cos_sin_cache.data_ptr(), rope[2].data_ptr(), k_cache.data_ptr(),
                            v_cache.data_ptr(), slots.data_ptr(), k_cache.shape[0] * k_cache.shape[1],
                            kv_cache_dtype.write_kind(k_cache.dtype, x.dtype), threads, self.dtype_code, lora_rows)
        if rc:
            _raise_for(rc)
        q = qkv[:, : self.q_heads * self.head_dim].view(M, self.q_heads, self.head_dim)
        attn = paged_attention(q, k_cache, v_cache, meta, self.scale).reshape(M, self.q_heads * self.head_dim)
        if not attn.is_contiguous():
            attn = attn.contiguous()
        y = x.new_empty((M, H))
        if self.moe is not None:
            rc = lib.fz_attn_out(attn.data_ptr(), attn.shape[1], self.w_o, y.data_ptr(), residual.data_ptr(),
                                 self.post_norm._weight_f32().data_ptr(), self.post_norm.eps, M, H, threads,
                                 self.dtype_code, lora_rows)
            if rc:
                _raise_for(rc)
            return self.moe.forward(y), residual
        h = x.new_empty((M, 2 * self.inter))
        a = x.new_empty((M, self.inter))
        out = x.new_empty((M, H))
        rc = lib.fz_mlp_out(attn.data_ptr(), attn.shape[1], self.w_o, y.data_ptr(), residual.data_ptr(),
                            self.post_norm._weight_f32().data_ptr(), self.post_norm.eps, M, H,
                            self.w_gu, self.inter, h.data_ptr(), a.data_ptr(), self.w_down, out.data_ptr(), threads,
                            self.dtype_code, lora_rows)
        if rc:
            _raise_for(rc)
        return out, residual


class FastDecodeStack:
    """A model's run of FastDecodeLayers for decode-only steps, in one ``fz_decode_stack`` call."""

    def __init__(self, layers: list[FastDecodeLayer]):
        self.layers = layers
        first = layers[0]
        self.q_heads, self.kv_heads, self.head_dim = first.q_heads, first.kv_heads, first.head_dim
        self.hidden, self.n_qkv, self.inter, self.scale = first.hidden, first.n_qkv, first.inter, first.scale
        self.rotary = first.rotary
        self.max_rows = min(layer.max_rows for layer in layers)
        self._specs = None  # (key, LayerSpec array): rebuilt when the caches or a norm weight change
        # The norms' weight Parameters, read once: nn.Module attribute lookups cost ~1 us each, 60 a step.
        self._norm_weights = [n.weight for layer in layers for n in (layer.in_norm, layer.post_norm)]
        self._scratch: tuple[torch.Tensor, ...] | None = None

    @staticmethod
    def compatible(layers: list[FastDecodeLayer]) -> bool:
        """One stack needs every layer to share shapes, scale and rotary table, and none to have
        q/k norms or a MoE feed-forward (fz_decode_stack runs Llama layers only)."""
        if any(x.qk_norms is not None or x.moe is not None for x in layers):
            return False
        f = layers[0]
        shape = (f.q_heads, f.kv_heads, f.head_dim, f.hidden, f.n_qkv, f.inter, f.scale, id(f.rotary))
        return all((x.q_heads, x.kv_heads, x.head_dim, x.hidden, x.n_qkv, x.inter, x.scale, id(x.rotary)) == shape
                   for x in layers)

    def _layer_specs(self, kv_caches: list) -> ctypes.Array:
        key = (id(kv_caches), tuple(w._version for w in self._norm_weights))  # a reload copy_()s into them
        if self._specs is not None and self._specs[0] == key:
            return self._specs[1]
        specs = (LayerSpec * len(self.layers))()
        keep = []
        for spec, layer in zip(specs, self.layers):
            k_cache, v_cache = kv_caches[layer.layer_idx]
            w_in, w_post = layer.in_norm._weight_f32(), layer.post_norm._weight_f32()
            keep += [w_in, w_post, k_cache, v_cache]
            spec.w_in_norm, spec.w_post_norm = w_in.data_ptr(), w_post.data_ptr()
            spec.eps_in, spec.eps_post = layer.in_norm.eps, layer.post_norm.eps
            spec.qkv, spec.o, spec.gu, spec.down = layer.w_qkv, layer.w_o, layer.w_gu, layer.w_down
            spec.k_cache, spec.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        specs._keep = keep  # the tensors the addresses point into
        self._specs = (key, specs)
        return specs

    def _scratch_for(self, M: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's intermediate buffers: the first M rows of one set, grown to the most rows seen
        (one set per batch size would keep ~13 KB x M for every M up to max_rows)."""
        if self._scratch is None or self._scratch[0].shape[0] < M or self._scratch[0].dtype != like.dtype:
            self._scratch = tuple(like.new_empty((M, n)) for n in (self.n_qkv, self.q_heads * self.head_dim,
                                                                    self.hidden, 2 * self.inter, self.inter))
        return tuple(b[:M] for b in self._scratch)

    def forward(self, rope: tuple, x: torch.Tensor, residual: torch.Tensor | None):
        """(out, residual) after every layer, or None when this step is not a decode-only one the
        stack can run (the caller runs the layers one by one)."""
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        M = x.shape[0]
        if (meta is None or not ctx.kv_caches or M > self.max_rows or meta.num_decodes != M
                or meta.num_requests != M or not x.is_contiguous() or rope[2] is None
                or x.dtype != self.layers[0].dtype):
            return None
        lora_rows = _lora_rows(ctx, all(layer.lora is not None for layer in self.layers))
        if lora_rows is False:
            return None
        k0, v0 = ctx.kv_caches[self.layers[0].layer_idx]
        attention = cpu_attention.decode_call_by_address(meta, x.dtype, self.q_heads, k0, v0)
        if attention is None:
            return None
        kernel, call = attention
        first = residual is None
        if first:
            residual = torch.empty_like(x)
        out = torch.empty_like(x)
        qkv, att, y, h, a = self._scratch_for(M, x)
        rc = fused.library().fz_decode_stack(
            ctypes.addressof(self._layer_specs(ctx.kv_caches)), len(self.layers), x.data_ptr(), residual.data_ptr(),
            int(not first), out.data_ptr(), M, self.hidden, self.n_qkv, self.q_heads, self.kv_heads, self.head_dim,
            self.rotary.rotary_dim, self.inter, self.rotary.cos_sin_cache.data_ptr(), rope[2].data_ptr(),
            meta.slot_mapping.data_ptr(), k0.shape[0] * k0.shape[1], kernel, call.tables_ptr, call.tables_stride,
            call.seq_lens_ptr, k0.shape[1], self.scale, call.part, call.threads,
            cpu_attention.dtype_code(x.dtype, k0), qkv.data_ptr(),
            att.data_ptr(),
            y.data_ptr(), h.data_ptr(), a.data_ptr(), torch.get_num_threads(), lora_rows)
        if rc:
            _raise_for(rc)
        return out, residual


def _lora_rows(ctx, has_slots: bool) -> int | None | bool:
    """The step's per-row adapter slots for the C calls: None (address NULL) for a step without
    adapter rows, their int32 array's address, or False where this path cannot apply them (no slots
    attached, or a batch without per-row slots): the caller then steps aside."""
    lora = ctx.lora
    if lora is None:
        return None
    if not has_slots or lora.rows is None:
        return False
    return lora.rows.data_ptr()


def _raise_for(rc: int):
    if rc == fused.ATTN_FAILED:
        raise RuntimeError("the decode attention kernel rejected its arguments or ran out of memory")
    if rc == -2:
        raise IndexError("KV cache slot out of range in the fast decode path")
    if rc == fused.KERNEL_FAILED:
        raise MemoryError("the quantized kernel found no memory for its activation scratch")
    raise RuntimeError("the fused decode layer is not available in this build")


def _mode() -> str:
    """on | off | layer ($PAGEDSERVE_FAST_DECODE), read at each use."""
    return env.FAST_DECODE.get()


def enabled() -> bool:
    return _mode() != "off"


def bind_fast_decode(model: nn.Module) -> int:
    """Give every eligible decoder layer a ``fast_decode`` (FastDecodeLayer); returns how many.
    bf16 activations need the AVX512-BF16 build; fp32 ones (AVX2 machines) any build of the fused
    ops (q8_0 / q4_1 weights through the quantized kernels, plain fp32 rows through fz_gemv_f32)."""
    if not (enabled() and fused.available()):
        return 0
    if any(t.device.type != "cpu" for t in itertools.chain(model.parameters(), model.buffers())):
        return 0  # a CUDA model: the C layers would read its device pointers on the host
    from pagedserve.gpu.models.layers import GatedMLP, SiluAndMul
    from pagedserve.gpu.models.llama import LlamaDecoderLayer
    from pagedserve.gpu.models.moe import SparseMoeBlock
    from pagedserve.gpu.parallel_state import get_tp_size

    if get_tp_size() != 1:
        return 0  # o_proj / down_proj would need their all-reduce
    bound = 0
    for layer in model.modules():
        if not isinstance(layer, LlamaDecoderLayer):
            continue
        attn, mlp = layer.self_attn, layer.mlp
        moe = isinstance(mlp, SparseMoeBlock)
        if not attn.attn.plain or not (moe or isinstance(mlp, GatedMLP) and isinstance(mlp.act, SiluAndMul)):
            continue
        dtype = layer.input_layernorm.weight.dtype
        if not (dtype is torch.float32 or (dtype is torch.bfloat16 and fused.has_bf16_gemv())):
            continue
        weights = {"qkv": bind_linear(attn.qkv_proj, dtype), "o": bind_linear(attn.o_proj, dtype)}
        if not moe:
            weights.update(gate_up=bind_linear(mlp.gate_up_proj, dtype), down=bind_linear(mlp.down_proj, dtype))
        if any(w is None for w in weights.values()):
            continue
        layer.fast_decode = FastDecodeLayer(layer, weights)
        bound += 1
    _bind_stacks(model)
    if bound:
        logger.info("fast decode path bound for %d layers (batches up to %d rows)", bound,
                    min(layer.fast_decode.max_rows for layer in model.modules()
                        if getattr(layer, "fast_decode", None) is not None))  # optional: bound layers only
    return bound


def _bind_stacks(model: nn.Module) -> None:
    """Give each LlamaModel whose own layers all took a FastDecodeLayer its FastDecodeStack."""
    from pagedserve.gpu.models.llama import LlamaModel

    if _mode() != "on":
        return
    for body in model.modules():
        if not isinstance(body, LlamaModel):
            continue
        layers = [getattr(layer, "fast_decode", None) for layer in body._own_layers]  # optional: bound ones
        if layers and all(f is not None for f in layers) and FastDecodeStack.compatible(layers):
            body.fast_stack = FastDecodeStack(layers)
            logger.info("fast decode stack: %d layers in one call for decode-only steps", len(layers))
