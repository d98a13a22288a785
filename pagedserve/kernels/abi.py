"""The ctypes side of every C kernel's exports: one table per library, and the structs that cross.

csrc/exports.h declares the same functions and structs on the C side, and every source includes it
(so the compiler checks each definition against it). ctypes cannot check anything: a c_int where
the C side takes an int64_t, or a struct field out of place, corrupts memory silently. So
tests/kernels/test_abi.py holds these tables to exports.h, argument by argument, and each struct's
size and field offsets to the compiler's ``sizeof`` / ``offsetof``.
"""
from __future__ import annotations

import ctypes

P, I64, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

# Kernel name (kernels/isa.py) -> exported function -> (restype, argtypes).
_Q8_MM = [P, I64, I64, P, P, P, P, I64, I, I]  # x, M, K, w, d, bias, y, N, nthreads, flags
_Q4_MM = [P, I64, I64, P, P, P, P, P, I64, I, I]  # x, M, K, w, d, mn, bias, y, N, nthreads, flags
_DECODE = [P, I64, P, P, P, I64, P, I64, I64, I64, I64, I64, F, P, I64, I, I64, I]  # pa_decode / pam_decode

SIGNATURES: dict[str, dict[str, tuple[type | None, list[type]]]] = {
    "qgemm": {
        "qg_isa": (I, []),
        "qg_int8_mm": (I, _Q8_MM),
        "qg_q8_mm": (I, _Q8_MM),
        "qg_int4_mm": (I, _Q4_MM),
        "qg_int8_dequant": (None, [P, P, I64, I64, I64, P, I, I]),
        "qg_q8_dequant": (None, [P, P, I64, I64, I64, P, I, I]),
        "qg_int4_dequant": (None, [P, P, P, I64, I64, I64, P, I, I]),
        "qg_q8_rows": (None, [P, P, I64, I64, P, I64, P, I]),
        "qg_int4_rows": (None, [P, P, P, I64, I64, P, I64, P, I]),
    },
    "qgemm_n16": {
        "qn_q4_mm": (I, _Q4_MM),
        "qn_q8_mm": (I, _Q8_MM),
        "qn_q8_dequant_t": (None, [P, P, I64, I64, I64, P, I64, I, I]),  # (..., out, out row stride, ...)
        "qn_q4_dequant_t": (None, [P, P, P, I64, I64, I64, P, I64, I, I]),
        "qn_q8_rows": (None, [P, P, I64, I64, P, I64, P, I]),
        "qn_q4_rows": (None, [P, P, P, I64, I64, P, I64, P, I]),
        "qn_q4_repack": (None, [P, P, P, I64, I64, P, P, P, I]),
        "qn_q8_repack": (None, [P, P, I64, I64, P, P, I]),
    },
    "qgemm_amx": {
        "qa_q4_mm": (I, _Q4_MM),
        "qa_q8_mm": (I, _Q8_MM),
        "qa_wide_min_m": (I, []),
    },
    "paged_attn": {
        "pa_isa": (I, []),
        "pa_width": (I, []),
        "pa_max_group": (I, []),
        "pa_max_head_dim": (I, []),
        "pa_decode": (I, _DECODE),
    },
    "paged_attn_amx": {
        "pam_max_group": (I, []),
        "pam_decode": (I, _DECODE),
    },
    "fused_cpu": {
        "fz_isa": (I, []),
        "fz_add_rms_norm": (I, [P, P, P, I64, I64, F, I]),
        "fz_rms_norm": (I, [P, I64, P, P, I64, I64, F, I]),
        "fz_rotary_neox": (None, [P, I64, I64, I64, I64, I64, P, P, I]),
        "fz_gemv_bf16": (I, [P, I64, I64, P, I64, P, I]),
        "fz_gemv_f32": (I, [P, I64, I64, P, I64, P, I]),
        "fz_write_kv": (I64, [P, P, I64, P, P, P, I64, I64, I64, I, I]),
        # the fz_linear arguments are pointers to LinearSpec
        "fz_attn_in": (I, [P, P, I, P, F, I64, I64, P, I64, P, I64, I64, I64, I64, P, P, F, P, P, P, P, P, I64, I,
                           I, I, P]),
        "fz_attn_out": (I, [P, I64, P, P, P, P, F, I64, I64, I, I, P]),
        "fz_mlp_out": (I, [P, I64, P, P, P, P, F, I64, I64, P, I64, P, P, P, P, I, I, P]),
        "fz_lora_add": (I, [P, P, I64, I64, I64, P, P, I, I]),
        "fz_silu_mul_bf16": (I, [P, I64, I64, P, I]),
        "fz_silu_mul_f32": (I, [P, I64, I64, P, I]),
        "fz_decode_stack": (I, [P, I64, P, P, I, P, I64, I64, I64, I64, I64, I64, I64, I64, P, P, P, I64, P, P,
                                I64, P, I64, F, I64, I, I, P, P, P, P, P, I, P]),
    },
    "moe_cpu": {
        "moe_isa": (I, []),
        "moe_max_m": (I, []),
        # router, w13, w2: pointers to LinearSpec (one, and arrays of one per expert)
        "moe_decode": (I, [P, I64, I64, P, I64, I64, I, P, P, I64, P, P, P, I]),
    },
    "sample_cpu": {
        "sp_greedy": (I64, [P, I64, P, I64, I64, I, P, I]),
        "sp_draw": (I64, [P, I64, P, I64, I64, I, P, P, P, I]),
    },
}


def bind(lib: ctypes.CDLL, kernel: str) -> ctypes.CDLL:
    """Set restype and argtypes of every export of ``kernel``'s library from SIGNATURES."""
    for name, (restype, argtypes) in SIGNATURES[kernel].items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


class LinearSpec(ctypes.Structure):
    """csrc/exports.h's ``fz_linear``: one linear layer of the fused decode layer, plain rows in the
    activations' dtype (``KIND_PLAIN``: bf16 or fp32) or a packed q8_0 / q4_1 weight with the
    addresses of the kernels that read it; with multi-LoRA, its adapter slots (``fused.attach_lora``)."""

    _fields_ = [("kind", ctypes.c_int64), ("big_rows", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("mn", ctypes.c_void_p), ("small", ctypes.c_void_p),
                ("big", ctypes.c_void_p), ("lora_a", ctypes.c_void_p), ("lora_b", ctypes.c_void_p),
                ("lora_rank", ctypes.c_int64), ("lora_sections", ctypes.c_int64), ("lora_col", ctypes.c_int64 * 4),
                ("lora_dtype", ctypes.c_int64)]


class LayerSpec(ctypes.Structure):
    """csrc/exports.h's ``fz_layer``: one decoder layer as ``fz_decode_stack`` reads it (fp32 norm
    weights, the addresses of its four LinearSpecs, its K and V caches)."""

    _fields_ = [("w_in_norm", ctypes.c_void_p), ("w_post_norm", ctypes.c_void_p), ("eps_in", ctypes.c_float),
                ("eps_post", ctypes.c_float), ("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p),
                ("gu", ctypes.c_void_p), ("down", ctypes.c_void_p), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p)]


STRUCTS: dict[str, type[ctypes.Structure]] = {"fz_linear": LinearSpec, "fz_layer": LayerSpec}
