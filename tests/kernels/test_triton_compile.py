"""The Triton kernels compile for a CUDA target (sm_80) down to cubin, without a GPU.

The interpreter tests check the numerics; this catches what only real compilation sees (types,
tl.dot minimum shapes, layouts). It runs in a subprocess because the kernels must be decorated
without TRITON_INTERPRET, which the interpreter tests set.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.needs import on_x86_64, require_installed

require_installed("triton", in_test_extra=on_x86_64())

_ATTENTION_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, dtype)
    (9, 3, 64, 16, "bf16"),
    (8, 8, 128, 8, "fp16"),
    (32, 8, 96, 32, "fp32"),
]


def compile_all() -> list[str]:
    """Compile every kernel variant; returns the artifact kinds of the last one."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedserve.kernels import triton_attention as ta
    from pagedserve.kernels import triton_elementwise as te
    from pagedserve.kernels import triton_prefill as tp

    target = GPUTarget("cuda", 80, 32)
    torch_dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

    def build(fn, pointer_args: dict[str, str], int_args: dict[str, str], consts: dict[str, object]):
        given = {**pointer_args, **int_args, **{k: "constexpr" for k in consts}}
        sig = {n: given[n] for n in fn.arg_names}  # in the kernel's parameter order
        names = list(sig)
        constexprs = {(names.index(k),): v for k, v in consts.items()}
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=target)

    kinds: list[str] = []
    for heads, kv_heads, dim, block, dt in _ATTENTION_CASES:
        pointers = {n: f"*{dt}" for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
        pointers |= {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "token_request_ptr")}
        scalars = {"num_requests": "i32", "scale": "fp32"}
        for n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cache_block", "stride_cache_slot",
                  "stride_cache_head", "stride_table"):
            scalars[n] = "i64"
        pointers |= {n: "*fp32" for n in ("part_m_ptr", "part_l_ptr", "part_acc_ptr")}
        consts = ta.attention_constexprs(heads, kv_heads, dim, block, torch_dtypes[dt])
        for splits in (1, 8):  # one program per (token, KV head), and split-K decode
            kinds = list(build(ta._paged_attention_kernel, pointers, scalars,
                               {**consts, "BLOCK_N": ta.DECODE_BLOCK_N, "NUM_SPLITS": splits}).asm)
        tile_ptrs = {n: "*i32" for n in ("block_tables_ptr", "tile_request_ptr", "tile_token_ptr", "tile_count_ptr",
                                         "tile_first_pos_ptr")}
        build(tp._prefill_attention_kernel, {n: f"*{dt}" for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
              | tile_ptrs, {k: v for k, v in scalars.items() if k not in ("num_requests",)},
              {**consts, "GROUP_PAD": triton.next_power_of_2(consts["GROUP"]), "BLOCK_M": tp.PREFILL_BLOCK_M})
        build(ta._merge_splits_kernel, {"out_ptr": f"*{dt}"} | {n: "*fp32" for n in ("part_m_ptr", "part_l_ptr",
                                                                                        "part_acc_ptr")},
              {"stride_ot": "i64", "stride_oh": "i64"},
              {"NUM_HEADS": heads, "HEAD_DIM": dim, "DIM_PAD": consts["DIM_PAD"], "NUM_SPLITS": 8})
        pointers = {n: f"*{dt}" for n in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")} | {"slot_ptr": "*i64"}
        scalars = {n: "i64" for n in ("stride_kt", "stride_kh", "stride_vt", "stride_vh")}
        consts = {"NUM_KV_HEADS": kv_heads, "HEAD_DIM": dim, "ROW_PAD": triton.next_power_of_2(kv_heads * dim)}
        build(ta._write_kv_cache_kernel, pointers, scalars, consts)
        # the decoder's elementwise kernels (kernels/triton_elementwise.py) in this dtype
        for residual in (False, True):
            build(te._rms_norm_kernel, {"out_ptr": f"*{dt}", "x_ptr": f"*{dt}", "residual_ptr": f"*{dt}",
                                        "weight_ptr": "*fp32"},
                  {"n": "i32", "eps": "fp32", "stride_out": "i64", "stride_x": "i64", "stride_res": "i64"},
                  {"HAS_RESIDUAL": residual, "BLOCK": triton.next_power_of_2(heads * dim)})
        build(te._rotary_neox_kernel, {"x_ptr": f"*{dt}", "cos_sin_ptr": "*fp32", "positions_ptr": "*i64"},
              {"num_heads": "i32", "max_position": "i32", "stride_t": "i64", "stride_h": "i64"},
              {"HALF": dim // 2, "HALF_PAD": triton.next_power_of_2(dim // 2),
               "HEADS_PAD": triton.next_power_of_2(heads + kv_heads)})
        build(te._silu_and_mul_kernel, {"out_ptr": f"*{dt}", "x_ptr": f"*{dt}"},
              {"n": "i32", "stride_out": "i64", "stride_x": "i64"}, {"BLOCK": te.SILU_BLOCK})
    return kinds


def test_kernels_compile_to_cubin(tmp_path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    code = "from tests.kernels.test_triton_compile import compile_all; print(' '.join(compile_all()))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cubin" in proc.stdout.split(), proc.stdout
