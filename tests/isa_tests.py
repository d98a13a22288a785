"""The ISA-specific tests: what they run depends on the CPU's vector extensions. They force kernel
builds (PAGEDSERVE_ISA in a fresh process, or a level's library), are parametrized over the levels
this CPU runs (kernels.isa.levels_here), or skip where an extension is missing, so a machine without
AVX-512 or AMX skips part of them. tests/conftest.py marks them ``isa``; ``make test-isa`` runs
exactly these (README, "Tests": which need which CPU)."""
from __future__ import annotations

ISA_TESTS = (
    "tests/kernels/test_isa.py",  # the build table, and every build this CPU runs compiles
    "tests/kernels/test_build_all.py",
    "tests/kernels/test_abi.py",  # the ctypes mirror against each chosen build's exports
    "tests/kernels/test_cpu_attention.py",  # decode attention, every level this CPU runs
    "tests/kernels/test_kv_bf16.py",
    "tests/kernels/test_kv_fp8.py",
    "tests/kernels/test_attn_amx.py",  # AMX
    "tests/kernels/test_fused.py",  # AVX512-BF16 GEMV and SiLU
    "tests/kernels/test_fused_lora.py",  # the fused layer's LoRA delta in every build
    "tests/kernels/test_qgemm.py",  # row-layout quantized kernel: scalar, AVX2, AVX-512
    "tests/kernels/test_qgemm_n16.py",  # n16 layout: AVX2, VNNI, AMX
    "tests/kernels/test_sample_cpu.py",
    "tests/gpu/test_moe_c.py",  # the C MoE step in every build
    "tests/gpu/test_fast_decode.py",  # the fused decode layer and stack: bf16 on AVX512-BF16, VNNI kernels
    "tests/gpu/test_fused_model.py",
    "tests/gpu/test_packed_linear.py",
    "tests/gpu/test_auto_dtype.py",  # --dtype auto: bf16 where the CPU has it
    "tests/gpu/test_batch_invariance.py",  # gated on the AVX2 row kernel
)

# Every AVX-512 / AMX build of kernels/isa.py and the tests that check it against a portable (torch)
# reference wherever the CPU runs it: each forces the build, or is parametrized over the levels this
# CPU runs, or runs the build this CPU picks when no better one exists. tests/kernels/test_isa.py
# fails when a build is missing here.
BUILD_TESTS = {
    ("qgemm", "avx512"): ("tests/kernels/test_qgemm.py::test_every_path_is_right",
                          "tests/kernels/test_qgemm.py::test_every_path_of_the_row_layout_is_right"),
    ("qgemm_n16", "vnni"): ("tests/kernels/test_qgemm_n16.py::test_n16_matches_dequantize_then_matmul",
                            "tests/kernels/test_qgemm_n16.py::test_forced_paths_pick_their_kernel"),
    ("qgemm_amx", "amx"): ("tests/kernels/test_qgemm_n16.py::test_amx_bf16_batches_match_the_reference",),
    ("paged_attn", "avx512"): ("tests/kernels/test_cpu_attention.py::test_decode_matches_naive",),
    ("paged_attn", "avx512bf16"): ("tests/kernels/test_cpu_attention.py::test_decode_matches_naive",),
    ("paged_attn_amx", "amx"): ("tests/kernels/test_attn_amx.py::test_amx_matches_naive",),
    ("fused_cpu", "avx512bf16"): ("tests/kernels/test_fused.py::test_gemv_bf16_matches_fp32_matmul",
                                  "tests/kernels/test_fused_lora.py::test_avx512bf16_layer_with_lora_matches_torch"),
    ("moe_cpu", "avx512"): ("tests/gpu/test_moe_c.py::test_every_build_is_right",),
    ("sample_cpu", "avx512"): ("tests/kernels/test_sample_cpu.py::test_greedy_is_the_first_argmax_and_declines_non_finite_rows",
                               "tests/kernels/test_sample_cpu.py::test_draw_is_the_inverse_cdf_of_the_softmax"),
}
