/* The multi-LoRA delta of the fused decode layer's linears (csrc/fused_cpu.c; only it includes this).
 *
 * Why here: a decode step with adapter rows used to leave the fused C layer for the per-linear torch
 * path (whole layers run in C, with no hook between the qkv GEMV and rotary), ~5x slower on AVX2.
 * After each base GEMV, every row m that names an adapter slot s = rows[m] >= 0 gets
 *     y[m] += (x[m] @ A[s]^T) @ B[s]
 * with A, B as gpu/models/lora_layers.py stacks them (fz_linear.lora_*: exports.h). Rows of one slot
 * share each pass over that slot's A: the shrink is one fz_gemv_* call per up to 16 of them (t rounded
 * to the activations' dtype, as torch's F.linear rounds it); the expand reads, for each section, only
 * the R rows of B and the output columns that section feeds (B is block-diagonal: the rest is zeros),
 * and skips a t that is exactly zero (the padded ranks of a smaller adapter). Rows without an adapter
 * are not touched, so they keep the base layer's bits. */
#ifndef PAGEDSERVE_FUSED_LORA_H
#define PAGEDSERVE_FUSED_LORA_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exports.h"

#define FZ_LORA_GROUP 16 /* rows per shrink call: fz_gemv_f32 / fz_gemv_bf16 take 1 to 16 */
#define FZ_LORA_NOMEM (-3) /* = FZ_KERNEL_FAILED: no memory for the scratch rows */

/* yf[c0..c1) += t * b[c0..c1), b a row of B in `dtype` (0 fp32, 1 bf16) */
static inline void lora_axpy(float *yf, float t, const void *b, int64_t c0, int64_t c1, int dtype) {
    if (dtype == 0) {
        const float *bf = (const float *)b;
#pragma omp simd
        for (int64_t c = c0; c < c1; c++) yf[c] += t * bf[c];
    } else {
        const uint16_t *bh = (const uint16_t *)b;
#pragma omp simd
        for (int64_t c = c0; c < c1; c++) yf[c] += t * bf16_to_f32(bh[c]);
    }
}

/* One row's expand: y_row [N] += t_row [S*R] @ B_slot [S*R][N], section by section, in fp32 (yf [N]
 * scratch), rounded back to `dtype` once. */
static void lora_expand_row(const fz_linear *L, const void *t_row, const char *b_slot, void *y_row, int64_t N,
                            float *yf, int dtype) {
    const int64_t R = L->lora_rank, es = dtype == 1 ? 2 : 4;
    if (dtype == 1) {
        for (int64_t c = 0; c < N; c++) yf[c] = bf16_to_f32(((const uint16_t *)y_row)[c]);
    } else {
        memcpy(yf, y_row, (size_t)N * 4);
    }
    for (int64_t i = 0; i < L->lora_sections; i++) {
        for (int64_t r = 0; r < R; r++) {
            int64_t j = i * R + r;
            float t = dtype == 1 ? bf16_to_f32(((const uint16_t *)t_row)[j]) : ((const float *)t_row)[j];
            if (t != 0.f) lora_axpy(yf, t, b_slot + (size_t)(j * N) * es, L->lora_col[i], L->lora_col[i + 1], dtype);
        }
    }
    if (dtype == 1) {
        for (int64_t c = 0; c < N; c++) ((uint16_t *)y_row)[c] = f32_to_bf16(yf[c]);
    } else {
        memcpy(y_row, yf, (size_t)N * 4);
    }
}

/* Every row of slot s (rows[m] == s, m >= m0; m0 is the first), in groups of up to 16: gather them,
 * shrink (one fz_gemv_* over the slot's A), expand into their rows of y. Scratch: xs [16][K], ts [16][W],
 * yf [N]. 0 or the GEMV's -1. */
static int lora_slot(const fz_linear *L, const void *x, int64_t m0, int64_t M, int64_t K, int64_t N, void *y,
                     const int32_t *rows, int nthreads, int dtype, char *xs, char *ts, float *yf) {
    const int32_t s = rows[m0];
    const int64_t W = L->lora_rank * L->lora_sections, es = dtype == 1 ? 2 : 4;
    const char *a = (const char *)L->lora_a + (size_t)(s * W * K) * es;
    const char *b = (const char *)L->lora_b + (size_t)(s * W * N) * es;
    int64_t idx[FZ_LORA_GROUP];
    for (int64_t m = m0; m < M;) {
        int64_t n = 0;
        for (; m < M && n < FZ_LORA_GROUP; m++) {
            if (rows[m] != s) continue;
            idx[n] = m;
            memcpy(xs + (size_t)(n * K) * es, (const char *)x + (size_t)(m * K) * es, (size_t)K * es);
            n++;
        }
        if (n == 0) break;
        int rc = dtype == 1 ? fz_gemv_bf16((const uint16_t *)xs, n, K, (const uint16_t *)a, W, (uint16_t *)ts, nthreads)
                            : fz_gemv_f32((const float *)xs, n, K, (const float *)a, W, (float *)ts, nthreads);
        if (rc) return rc;
        for (int64_t i = 0; i < n; i++)
            lora_expand_row(L, ts + (size_t)(i * W) * es, b, (char *)y + (size_t)(idx[i] * N) * es, N, yf, dtype);
    }
    return 0;
}

/* y[M][N] += the LoRA delta of x[M][K] for the rows that name a slot (rows NULL or L without LoRA:
 * nothing). The distinct slots of the step are shared out over the threads (their rows of y are
 * disjoint); each slot's GEMV runs on its one thread: at LoRA ranks it is tens of us, less than an
 * OpenMP region costs on a busy box (a region waits for a descheduled partner: one step with three
 * more regions a layer, rank 64, one stream: median step CPU time 1139 ms, 33 ms without them). 0, FZ_LORA_NOMEM, or the GEMV's -1
 * (a dtype this build cannot multiply). */
static int lora_add(const fz_linear *L, const void *x, int64_t M, int64_t K, int64_t N, void *y,
                    const int32_t *rows, int nthreads, int dtype) {
    if (L->lora_a == NULL || rows == NULL) return 0;
    const int64_t W = L->lora_rank * L->lora_sections, es = dtype == 1 ? 2 : 4;
    int64_t *first = malloc((size_t)M * sizeof(int64_t)); /* the first row of each distinct slot */
    if (first == NULL) return FZ_LORA_NOMEM;
    int64_t n_slots = 0;
    for (int64_t m = 0; m < M; m++) {
        int seen = rows[m] < 0;
        for (int64_t i = 0; i < n_slots && !seen; i++) seen = rows[first[i]] == rows[m];
        if (!seen) first[n_slots++] = m;
    }
    if (nthreads < 1) nthreads = 1;
    const int split = n_slots > 1 && nthreads > 1;
    int rc = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(min : rc) if (split)
    for (int64_t i = 0; i < n_slots; i++) {
        char *xs = malloc((size_t)(FZ_LORA_GROUP * K) * es), *ts = malloc((size_t)(FZ_LORA_GROUP * W) * es);
        float *yf = malloc((size_t)N * 4);
        int r = xs && ts && yf ? lora_slot(L, x, first[i], M, K, N, y, rows, 1, dtype, xs, ts, yf)
                               : FZ_LORA_NOMEM;
        if (r < rc) rc = r;
        free(xs);
        free(ts);
        free(yf);
    }
    free(first);
    return rc;
}
#endif
