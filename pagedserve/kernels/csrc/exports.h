/* Every function the kernel libraries export and every struct that crosses into Python, declared
 * once. Each source in this directory includes this header, so the compiler holds each definition
 * to its declaration here; kernels/abi.py mirrors it for ctypes, and tests/kernels/test_abi.py
 * holds that mirror to this file (argument types, struct sizes and field offsets). Change a
 * signature here, in its source and in kernels/abi.py together. */
#ifndef PAGEDSERVE_EXPORTS_H
#define PAGEDSERVE_EXPORTS_H
#include <stdint.h>

/* ---- qgemm.c (kernels/abi.py SIGNATURES["qgemm"]) */
int qg_isa(void);
int qg_int8_mm(const void *x, int64_t M, int64_t K, const int8_t *w8, const float *scale, const float *bias,
               void *y, int64_t N, int nthreads, int flags);
void qg_int8_dequant(const int8_t *w8, const float *scale, int64_t K, int64_t n0, int64_t n1, void *out,
                     int nthreads, int flags);
int qg_q8_mm(const void *x, int64_t M, int64_t K, const int8_t *w8, const uint16_t *d, const float *bias,
             void *y, int64_t N, int nthreads, int flags);
void qg_q8_dequant(const int8_t *w8, const uint16_t *d, int64_t K, int64_t n0, int64_t n1, void *out,
                   int nthreads, int flags);
int qg_int4_mm(const void *x, int64_t M, int64_t K, const uint8_t *w4, const uint16_t *d, const uint16_t *mn,
               const float *bias, void *y, int64_t N, int nthreads, int flags);
void qg_int4_dequant(const uint8_t *w4, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t n0,
                     int64_t n1, void *out, int nthreads, int flags);
void qg_q8_rows(const int8_t *w8, const uint16_t *d, int64_t K, int64_t N, const int64_t *ids, int64_t n_ids,
                void *out, int flags);
void qg_int4_rows(const uint8_t *w4, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t N,
                  const int64_t *ids, int64_t n_ids, void *out, int flags);

/* ---- qgemm_n16.c (kernels/abi.py SIGNATURES["qgemm_n16"]) */
int qn_q4_mm(const void *x, int64_t M, int64_t K, const uint16_t *w, const uint16_t *d, const uint16_t *mn,
             const float *bias, void *y, int64_t N, int nthreads, int flags);
int qn_q8_mm(const void *x, int64_t M, int64_t K, const int8_t *w, const uint16_t *d, const float *bias,
             void *y, int64_t N, int nthreads, int flags);
void qn_q4_dequant_t(const uint16_t *w, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t n0,
                     int64_t n1, void *out, int64_t ld, int nthreads, int flags);
void qn_q8_dequant_t(const int8_t *w, const uint16_t *d, int64_t K, int64_t n0, int64_t n1, void *out,
                     int64_t ld, int nthreads, int flags);
void qn_q4_rows(const uint16_t *w, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t N,
                const int64_t *ids, int64_t n_ids, void *out, int flags);
void qn_q8_rows(const int8_t *w, const uint16_t *d, int64_t K, int64_t N, const int64_t *ids, int64_t n_ids,
                void *out, int flags);
void qn_q4_repack(const uint8_t *w4, const uint16_t *d, const uint16_t *mn, int64_t N, int64_t K, uint16_t *w_out,
                  uint16_t *d_out, uint16_t *mn_out, int nthreads);
void qn_q8_repack(const int8_t *w8, const uint16_t *d, int64_t N, int64_t K, int8_t *w_out, uint16_t *d_out,
                  int nthreads);

/* ---- qgemm_amx.c (kernels/abi.py SIGNATURES["qgemm_amx"]) */
int qa_wide_min_m(void);
int qa_q4_mm(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, const uint16_t *d,
             const uint16_t *mn, const float *bias, void *y, int64_t N, int nthreads, int flags);
int qa_q8_mm(const uint16_t *x, int64_t M, int64_t K, const int8_t *w, const uint16_t *d, const float *bias,
             void *y, int64_t N, int nthreads, int flags);

/* ---- paged_attn.c (kernels/abi.py SIGNATURES["paged_attn"]) */
int pa_isa(void);
int pa_width(void);
int pa_max_group(void);
int pa_max_head_dim(void);
int pa_decode(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
              const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int64_t N, int64_t H,
              int64_t Hkv, int64_t D, int64_t BS, float scale, void *out, int64_t out_row_stride, int dtype,
              int64_t part_tokens, int nthreads);

/* ---- paged_attn_amx.c (kernels/abi.py SIGNATURES["paged_attn_amx"]) */
int pam_max_group(void);
int pam_decode(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
               const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int64_t N, int64_t H,
               int64_t Hkv, int64_t D, int64_t BS, float scale, void *out, int64_t out_row_stride, int dtype,
               int64_t part_tokens, int nthreads);

/* ---- fused_cpu.c (kernels/abi.py SIGNATURES["fused_cpu"]) */
/* One linear layer of the fused layer: plain rows (kind 0) or packed q8_0 / q4_1 weights (kinds 1,
 * 2) on the 16-channel layout, run by the quantized kernel whose address the caller passes
 * (csrc/qgemm_n16.c VNNI, csrc/qgemm_amx.c AMX). kernels/abi.py LinearSpec. */
typedef struct {
    int64_t kind;     /* 0 plain, 1 q8_0, 2 q4_1 */
    int64_t big_rows; /* from this many rows `big` runs instead of `small` (0: never) */
    const void *w, *d, *mn;
    void *small, *big;
    /* Multi-LoRA (lora_a NULL: none; kernels/fused.py attach_lora): per adapter slot, A of the S
     * sections stacked [S*R][K] and B^T block-diagonal [S*R][N] (scaling folded in), in the
     * adapter dtype lora_dtype (0 fp32, 1 bf16: --lora-dtype); section i's R rows feed output columns
     * lora_col[i] .. lora_col[i+1]. */
    const void *lora_a, *lora_b;
    int64_t lora_rank, lora_sections, lora_col[4], lora_dtype;
} fz_linear;

/* One decoder layer's weights and caches as fz_decode_stack reads them. kernels/abi.py LayerSpec. */
typedef struct {
    const float *w_in_norm, *w_post_norm;
    float eps_in, eps_post;
    const fz_linear *qkv, *o, *gu, *down;
    void *k_cache, *v_cache;
} fz_layer;

/* How fz_write_kv / fz_attn_in store K and V rows (kernels/kv_cache_dtype.py write_kind mirrors it). */
#define FZ_KV_SAME 0 /* the activations' dtype */
#define FZ_KV_FP8 1  /* fp8 e4m3 (csrc/fp8.h) */
#define FZ_KV_BF16 2 /* bf16, from fp32 rows */

int fz_isa(void);
int fz_add_rms_norm(void *x, void *residual, const float *w, int64_t M, int64_t H, float eps, int dtype);
int fz_rms_norm(const void *x, int64_t x_stride, const float *w, void *out, int64_t M, int64_t H, float eps,
                int dtype);
int64_t fz_write_kv(const char *k, const char *v, int64_t src_stride, char *k_cache, char *v_cache,
                    const int64_t *slots, int64_t T, int64_t row_elems, int64_t num_slots, int src_dtype,
                    int cache_kind);
void fz_rotary_neox(void *x, int64_t T, int64_t row_stride, int64_t heads, int64_t head_dim, int64_t rot,
                    const float *cs, const int64_t *positions, int dtype);
int fz_gemv_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, int64_t N, uint16_t *y,
                 int nthreads);
int fz_gemv_f32(const float *x, int64_t M, int64_t K, const float *W, int64_t N, float *y, int nthreads);
int fz_lora_add(const fz_linear *L, const void *x, int64_t M, int64_t K, int64_t N, void *y, const int32_t *rows,
                int nthreads, int dtype);
int fz_silu_mul_bf16(const uint16_t *h, int64_t M, int64_t I, uint16_t *a, int nthreads);
int fz_silu_mul_f32(const float *h, int64_t M, int64_t I, float *a, int nthreads);
int fz_attn_in(void *x, void *residual, int has_residual, const float *w_norm, float eps, int64_t M,
               int64_t H, const fz_linear *w_qkv, int64_t n_qkv, void *qkv, int64_t q_heads, int64_t kv_heads,
               int64_t head_dim, int64_t rot, const float *w_qn, const float *w_kn, float eps_qk,
               const float *cs, const int64_t *positions, void *k_cache, void *v_cache, const int64_t *slots,
               int64_t num_slots, int kv_kind, int nthreads, int dtype, const int32_t *lora_rows);
int fz_attn_out(const void *attn, int64_t A, const fz_linear *w_o, void *y, void *residual, const float *w_norm,
                float eps, int64_t M, int64_t H, int nthreads, int dtype, const int32_t *lora_rows);
int fz_mlp_out(const void *attn, int64_t A, const fz_linear *w_o, void *y, void *residual,
               const float *w_norm, float eps, int64_t M, int64_t H, const fz_linear *w_gu, int64_t I,
               void *h, void *a, const fz_linear *w_down, void *out, int nthreads, int dtype,
               const int32_t *lora_rows);
int fz_decode_stack(const fz_layer *layers, int64_t L, void *x, void *residual, int has_residual, void *out,
                    int64_t M, int64_t H, int64_t n_qkv, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                    int64_t rot, int64_t I, const float *cs, const int64_t *positions, const int64_t *slots,
                    int64_t num_slots, void *attn, const int32_t *tables, int64_t tables_stride,
                    const int32_t *seq_lens, int64_t block_size, float scale, int64_t part, int attn_threads,
                    int attn_dtype, void *qkv, void *att, void *y, void *h, void *a, int nthreads,
                    const int32_t *lora_rows);

/* ---- moe_cpu.c (kernels/abi.py SIGNATURES["moe_cpu"]) */
int moe_isa(void);
int moe_max_m(void);
int moe_decode(const float *x, int64_t M, int64_t H, const fz_linear *router, int64_t E, int64_t top_k,
               int renorm, const fz_linear *w13, const fz_linear *w2, int64_t I, float *out, float *route_w,
               int64_t *route_ids, int nthreads);

/* ---- sample_cpu.c (kernels/abi.py SIGNATURES["sample_cpu"]) */
int64_t sp_greedy(const void *logits, int64_t n, const int64_t *ids, int64_t cols, int64_t row_stride,
                  int dtype, int64_t *out, int nthreads);
int64_t sp_draw(const void *logits, int64_t n, const int64_t *ids, int64_t cols, int64_t row_stride,
                int dtype, const float *temps, const double *u, int64_t *out, int nthreads);

#endif
