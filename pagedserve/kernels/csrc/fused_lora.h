/* The multi-LoRA delta of the fused decode layer's linears (csrc/fused_cpu.c; only it includes this).
 *
 * Why here: a decode step with adapter rows used to leave the fused C layer for the per-linear torch
 * path (whole layers run in C, with no hook between the qkv GEMV and rotary), ~5x slower on AVX2.
 * After each base GEMV, every row m that names an adapter slot s = rows[m] >= 0 gets
 *     y[m] += (x[m] @ A[s]^T) @ B[s]
 * with A, B as gpu/models/lora_layers.py stacks them (fz_linear.lora_*: exports.h). Rows without an
 * adapter are not touched, so they keep the base layer's bits.
 *
 * Why this shape (loadtest/PERF.md, "LoRA overhead, thirteenth session": the first form spent ~70 % of
 * its time in a per-row, per-rank axpy that loaded and stored y R times, and used one thread for a
 * one-adapter step):
 *  - rows are grouped by slot (up to FZ_LORA_GROUP a group), and each pass over A or B serves up to
 *    four rows of a group, so a slot's weights are read once per four rows, not once per row;
 *  - the expand keeps a 4-row x 16-column block of y in registers across the whole rank loop (y read
 *    and written once), and reads, for each section, only the R rows of B and the columns that section
 *    feeds (B is block-diagonal: the rest is zeros); ranks past the group's last non-zero t (a smaller
 *    adapter's zero padding) are not read;
 *  - the shrink (t = x A^T, fp32 accumulation, t rounded to the activations' dtype as torch's F.linear
 *    rounds it) and the expand are split over the threads by (group, range of A rows) and (group,
 *    range of columns) inside one parallel region, taken only when the step's delta is large enough to
 *    pay for it (a one-stream step stays on the calling thread);
 *  - scratch (the groups, t) lives on the stack for decode-sized steps: no malloc per call.
 * Adapter weights are fp32 or bf16 (fz_linear.lora_dtype), independently of the activations' dtype:
 * bf16 weights halve the bytes each step streams; widening bf16 is exact, so the sums are fp32 sums
 * of the weights as stored. */
#ifndef PAGEDSERVE_FUSED_LORA_H
#define PAGEDSERVE_FUSED_LORA_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exports.h"

#define FZ_LORA_GROUP 16         /* rows of one slot per group */
#define FZ_LORA_NOMEM (-3)       /* = FZ_KERNEL_FAILED: no memory for a (very large) step's scratch */
#define FZ_LORA_A_ROWS 16        /* rows of A per shrink work item */
#define FZ_LORA_COLS 256         /* output columns per expand work item (a multiple of 16) */
/* Fewer multiply-adds than this a call: no parallel region. A region costs a few us quiet and can cost
 * ms when a partner thread is descheduled on a busy box (PERF.md, twelfth session: a rank-64 one-stream
 * step at 1139 ms with three more regions a layer). 100 K keeps one-row calls up to rank 16 (<= ~68 K
 * on the default model) on the calling thread and splits every c=16 call at rank 16 (0.3-1.1 M): on a
 * quiet box 500 K (o serial at c=16) cost 19.5 % at c=16 with 4 rank-16 adapters, 100 K 14.5 %
 * (PERF.md, thirteenth session). */
#define FZ_LORA_PAR_MACS 100000
#define FZ_LORA_STACK_T 8192     /* floats of t kept on the stack (32 KB) */
#define FZ_LORA_STACK_GROUPS 32  /* groups kept on the stack */

typedef struct {
    int32_t slot, n;              /* adapter slot, rows in the group */
    int64_t row[FZ_LORA_GROUP];   /* the rows of x / y */
    float *t;                     /* [n][W] shrink results (fp32, rounded as the activations) */
} lora_group;

/* element i of a row of fp32 (dt 0) or bf16 (dt 1) values */
static inline float lora_ld1(const void *p, int64_t i, int dt) {
    return dt == 1 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if defined(__AVX2__) && defined(__FMA__)
/* 8 values from element i on, widened to fp32 */
static inline __attribute__((always_inline)) __m256 lora_ld8(const void *p, int64_t i, int dt) {
    return dt == 1 ? bf16x8_to_ps((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

static inline float lora_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* t[i][w] = x_i . a_w for MR rows (MR 1..4) of the group (xr their rows) and two rows of A (one
 * when w1 is -1). xdt / adt: the activations' / A's dtype. */
static inline __attribute__((always_inline)) void lora_dot(const void *const *xr, int MR, int64_t K, int xdt,
                                                          const void *a0, const void *a1, int adt,
                                                          float *out0, float *out1) {
    __m256 acc0[4], acc1[4];
    for (int i = 0; i < MR; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 w0 = lora_ld8(a0, k, adt), w1 = a1 ? lora_ld8(a1, k, adt) : w0;
        for (int i = 0; i < MR; i++) {
            __m256 xv = lora_ld8(xr[i], k, xdt);
            acc0[i] = _mm256_fmadd_ps(xv, w0, acc0[i]);
            if (a1) acc1[i] = _mm256_fmadd_ps(xv, w1, acc1[i]);
        }
    }
    for (int i = 0; i < MR; i++) {
        float s0 = lora_hsum(acc0[i]), s1 = a1 ? lora_hsum(acc1[i]) : 0.f;
        for (int64_t kk = k; kk < K; kk++) {
            float xv = lora_ld1(xr[i], kk, xdt);
            s0 += xv * lora_ld1(a0, kk, adt);
            if (a1) s1 += xv * lora_ld1(a1, kk, adt);
        }
        out0[i] = s0;
        if (a1) out1[i] = s1;
    }
}
#endif

/* Shrink, rows w0..w1 of the slot's A: t[i][w] = x[row i] . A[w] for every row of the group. */
static inline __attribute__((always_inline)) void lora_shrink_t(const lora_group *g, const void *x, int64_t K,
                                                               int xdt, const char *a_slot, int adt, int64_t W,
                                                               int64_t w0, int64_t w1) {
    const int64_t xes = xdt == 1 ? 2 : 4, aes = adt == 1 ? 2 : 4;
    for (int64_t m = 0; m < g->n; m += 4) {
        const int MR = g->n - m < 4 ? (int)(g->n - m) : 4;
        const void *xr[4];
        for (int i = 0; i < MR; i++) xr[i] = (const char *)x + (size_t)(g->row[m + i] * K) * xes;
#if defined(__AVX2__) && defined(__FMA__)
        float o0[4], o1[4];
        int64_t w = w0;
        for (; w + 2 <= w1; w += 2) {
            const char *a0 = a_slot + (size_t)(w * K) * aes, *a1 = a0 + (size_t)K * aes;
            switch (MR) { /* MR as a constant: the accumulators stay in registers */
            case 4: lora_dot(xr, 4, K, xdt, a0, a1, adt, o0, o1); break;
            case 3: lora_dot(xr, 3, K, xdt, a0, a1, adt, o0, o1); break;
            case 2: lora_dot(xr, 2, K, xdt, a0, a1, adt, o0, o1); break;
            default: lora_dot(xr, 1, K, xdt, a0, a1, adt, o0, o1);
            }
            for (int i = 0; i < MR; i++) {
                g->t[(m + i) * W + w] = o0[i];
                g->t[(m + i) * W + w + 1] = o1[i];
            }
        }
        if (w < w1) {
            const char *a0 = a_slot + (size_t)(w * K) * aes;
            switch (MR) {
            case 4: lora_dot(xr, 4, K, xdt, a0, NULL, adt, o0, o1); break;
            case 3: lora_dot(xr, 3, K, xdt, a0, NULL, adt, o0, o1); break;
            case 2: lora_dot(xr, 2, K, xdt, a0, NULL, adt, o0, o1); break;
            default: lora_dot(xr, 1, K, xdt, a0, NULL, adt, o0, o1);
            }
            for (int i = 0; i < MR; i++) g->t[(m + i) * W + w] = o0[i];
        }
#else
        for (int64_t w = w0; w < w1; w++) {
            const char *aw = a_slot + (size_t)(w * K) * aes;
            for (int i = 0; i < MR; i++) {
                float s = 0.f;
                for (int64_t k = 0; k < K; k++) s += lora_ld1(xr[i], k, xdt) * lora_ld1(aw, k, adt);
                g->t[(m + i) * W + w] = s;
            }
        }
#endif
    }
    if (xdt == 1) /* bf16 activations: t rounded as torch's bf16 F.linear rounds its output */
        for (int64_t i = 0; i < g->n; i++)
            for (int64_t w = w0; w < w1; w++) g->t[i * W + w] = bf16_to_f32(f32_to_bf16(g->t[i * W + w]));
}

/* the shrink with the dtypes as constants, so each pair gets its own loop */
static void lora_shrink(const lora_group *g, const void *x, int64_t K, int xdt, const char *a_slot, int adt,
                        int64_t W, int64_t w0, int64_t w1) {
    if (xdt == 0 && adt == 0) lora_shrink_t(g, x, K, 0, a_slot, 0, W, w0, w1);
    else if (xdt == 0) lora_shrink_t(g, x, K, 0, a_slot, 1, W, w0, w1);
    else if (adt == 0) lora_shrink_t(g, x, K, 1, a_slot, 0, W, w0, w1);
    else lora_shrink_t(g, x, K, 1, a_slot, 1, W, w0, w1);
}

#if defined(__AVX2__) && defined(__FMA__)
/* columns c0..c1 (a multiple of 16 apart) of MR rows: y rows yr, t rows tr (from the section's
 * first rank), B rows jr .. jr+nr; a 16-column block of each row kept in registers over the ranks */
static inline __attribute__((always_inline)) void lora_expand_cols(char *const *yr, const float *const *tr, int MR,
                                                                  int ydt, const char *b_slot, int bdt, int64_t N,
                                                                  int64_t jr, int64_t nr, int64_t c0, int64_t c1) {
    const int64_t bes = bdt == 1 ? 2 : 4;
    for (int64_t c = c0; c < c1; c += 16) {
        __m256 acc[4][2];
        for (int i = 0; i < MR; i++) {
            acc[i][0] = lora_ld8(yr[i], c, ydt);
            acc[i][1] = lora_ld8(yr[i], c + 8, ydt);
        }
        for (int64_t r = 0; r < nr; r++) {
            const char *br = b_slot + (size_t)((jr + r) * N) * bes;
            __m256 b0 = lora_ld8(br, c, bdt), b1 = lora_ld8(br, c + 8, bdt);
            for (int i = 0; i < MR; i++) {
                __m256 t = _mm256_broadcast_ss(tr[i] + r);
                acc[i][0] = _mm256_fmadd_ps(t, b0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(t, b1, acc[i][1]);
            }
        }
        for (int i = 0; i < MR; i++) {
            if (ydt == 1) {
                float v[16];
                _mm256_storeu_ps(v, acc[i][0]);
                _mm256_storeu_ps(v + 8, acc[i][1]);
                for (int q = 0; q < 16; q++) ((uint16_t *)yr[i])[c + q] = f32_to_bf16(v[q]);
            } else {
                _mm256_storeu_ps((float *)yr[i] + c, acc[i][0]);
                _mm256_storeu_ps((float *)yr[i] + c + 8, acc[i][1]);
            }
        }
    }
}
#endif

/* Expand, columns c0..c1 of section sec: y[row i][c] += sum_r t[i][sec*R + r] * B[sec*R + r][c] for
 * r < nr, in fp32 (each y value widened once, rounded back to `ydt` once). bdt: B's dtype. */
static inline __attribute__((always_inline)) void lora_expand_t(const lora_group *g, void *y, int64_t N, int ydt,
                                                               const char *b_slot, int bdt, int64_t W,
                                                               int64_t jr, int64_t nr, int64_t c0, int64_t c1) {
    const int64_t yes = ydt == 1 ? 2 : 4, bes = bdt == 1 ? 2 : 4;
    for (int64_t m = 0; m < g->n; m += 4) {
        const int MR = g->n - m < 4 ? (int)(g->n - m) : 4;
        char *yr[4];
        const float *tr[4];
        for (int i = 0; i < MR; i++) {
            yr[i] = (char *)y + (size_t)(g->row[m + i] * N) * yes;
            tr[i] = g->t + (m + i) * W + jr;
        }
        int64_t c = c0;
#if defined(__AVX2__) && defined(__FMA__)
        const int64_t c16 = c0 + (c1 - c0) / 16 * 16;
        switch (MR) { /* MR as a constant: the accumulators stay in registers */
        case 4: lora_expand_cols(yr, tr, 4, ydt, b_slot, bdt, N, jr, nr, c0, c16); break;
        case 3: lora_expand_cols(yr, tr, 3, ydt, b_slot, bdt, N, jr, nr, c0, c16); break;
        case 2: lora_expand_cols(yr, tr, 2, ydt, b_slot, bdt, N, jr, nr, c0, c16); break;
        default: lora_expand_cols(yr, tr, 1, ydt, b_slot, bdt, N, jr, nr, c0, c16);
        }
        c = c16;
#endif
        for (; c < c1; c++)
            for (int i = 0; i < MR; i++) {
                float s = lora_ld1(yr[i], c, ydt);
                for (int64_t r = 0; r < nr; r++) s += tr[i][r] * lora_ld1(b_slot + (size_t)((jr + r) * N) * bes, c, bdt);
                if (ydt == 1) ((uint16_t *)yr[i])[c] = f32_to_bf16(s);
                else ((float *)yr[i])[c] = s;
            }
    }
}

static void lora_expand(const lora_group *g, void *y, int64_t N, int ydt, const char *b_slot, int bdt, int64_t W,
                        int64_t jr, int64_t nr, int64_t c0, int64_t c1) {
    if (ydt == 0 && bdt == 0) lora_expand_t(g, y, N, 0, b_slot, 0, W, jr, nr, c0, c1);
    else if (ydt == 0) lora_expand_t(g, y, N, 0, b_slot, 1, W, jr, nr, c0, c1);
    else if (bdt == 0) lora_expand_t(g, y, N, 1, b_slot, 0, W, jr, nr, c0, c1);
    else lora_expand_t(g, y, N, 1, b_slot, 1, W, jr, nr, c0, c1);
}

/* The ranks of section sec the group needs: one past the last r whose t is non-zero in any row (a
 * smaller adapter's padded ranks give exact zeros, and read no B). */
static int64_t lora_live_ranks(const lora_group *g, int64_t W, int64_t R, int64_t sec) {
    int64_t nr = 0;
    for (int64_t i = 0; i < g->n; i++)
        for (int64_t r = R - 1; r >= nr; r--)
            if (g->t[i * W + sec * R + r] != 0.f) {
                nr = r + 1;
                break;
            }
    return nr;
}

/* Expand work item e of group g: columns [e*FZ_LORA_COLS, +FZ_LORA_COLS) of y, each section's part. */
static void lora_expand_item(const fz_linear *L, const lora_group *g, void *y, int64_t N, int ydt, int64_t e) {
    const int64_t R = L->lora_rank, W = R * L->lora_sections, bes = L->lora_dtype == 1 ? 2 : 4;
    const char *b_slot = (const char *)L->lora_b + (size_t)(g->slot * W * N) * bes;
    const int64_t c0 = e * FZ_LORA_COLS, c1 = c0 + FZ_LORA_COLS < N ? c0 + FZ_LORA_COLS : N;
    for (int64_t sec = 0; sec < L->lora_sections; sec++) {
        int64_t s0 = L->lora_col[sec] > c0 ? L->lora_col[sec] : c0;
        int64_t s1 = L->lora_col[sec + 1] < c1 ? L->lora_col[sec + 1] : c1;
        if (s0 >= s1) continue;
        int64_t nr = lora_live_ranks(g, W, R, sec);
        if (nr > 0) lora_expand(g, y, N, ydt, b_slot, (int)L->lora_dtype, W, sec * R, nr, s0, s1);
    }
}

/* y[M][N] += the LoRA delta of x[M][K] for the rows that name a slot (rows NULL or L without LoRA:
 * nothing). `dtype`: the activations' (0 fp32, 1 bf16); the adapter weights' is L->lora_dtype.
 * 0, or FZ_LORA_NOMEM. */
static int lora_add(const fz_linear *L, const void *x, int64_t M, int64_t K, int64_t N, void *y,
                    const int32_t *rows, int nthreads, int dtype) {
    if (L->lora_a == NULL || rows == NULL) return 0;
    const int64_t W = L->lora_rank * L->lora_sections, aes = L->lora_dtype == 1 ? 2 : 4;
    lora_group stack_groups[FZ_LORA_STACK_GROUPS], *groups = stack_groups;
    float stack_t[FZ_LORA_STACK_T], *t = stack_t;
    int64_t n_rows = 0;
    for (int64_t m = 0; m < M; m++) n_rows += rows[m] >= 0;
    if (n_rows == 0) return 0;
    /* n_rows is a bound on the groups too */
    if (n_rows > FZ_LORA_STACK_GROUPS) groups = malloc((size_t)n_rows * sizeof(lora_group));
    if (n_rows * W > FZ_LORA_STACK_T) t = malloc((size_t)(n_rows * W) * sizeof(float));
    int rc = 0;
    if (groups == NULL || t == NULL) {
        rc = FZ_LORA_NOMEM;
        goto out;
    }
    /* group the rows by slot, in the order their slots first appear; a slot's rows past the 16th open
     * another group */
    int64_t n_groups = 0;
    for (int64_t m = 0; m < M; m++) {
        if (rows[m] < 0) continue;
        int64_t gi = n_groups - 1;
        while (gi >= 0 && groups[gi].slot != rows[m]) gi--;
        if (gi < 0 || groups[gi].n == FZ_LORA_GROUP) {
            gi = n_groups++;
            groups[gi].slot = rows[m];
            groups[gi].n = 0;
        }
        groups[gi].row[groups[gi].n++] = m;
    }
    /* t rows: each group's n rows of W, packed in group order */
    int64_t t_used = 0;
    for (int64_t gi = 0; gi < n_groups; gi++) {
        groups[gi].t = t + t_used;
        t_used += groups[gi].n * W;
    }
    const int64_t a_items = (W + FZ_LORA_A_ROWS - 1) / FZ_LORA_A_ROWS, c_items = (N + FZ_LORA_COLS - 1) / FZ_LORA_COLS;
    const int par = nthreads > 1 && n_rows * W * (K + N / L->lora_sections) >= FZ_LORA_PAR_MACS;
#pragma omp parallel num_threads(nthreads) if (par)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_groups * a_items; it++) {
            const lora_group *g = &groups[it / a_items];
            int64_t w0 = (it % a_items) * FZ_LORA_A_ROWS, w1 = w0 + FZ_LORA_A_ROWS < W ? w0 + FZ_LORA_A_ROWS : W;
            lora_shrink(g, x, K, dtype, (const char *)L->lora_a + (size_t)(g->slot * W * K) * aes, (int)L->lora_dtype,
                        W, w0, w1);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_groups * c_items; it++)
            lora_expand_item(L, &groups[it / c_items], y, N, dtype, it % c_items);
    }
out:
    if (groups != stack_groups) free(groups);
    if (t != stack_t) free(t);
    return rc;
}
#endif
