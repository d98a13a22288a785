/* q8_0 / q4_1 matmul on AVX-512 VNNI with weights re-laid 16 output channels side by side.
 *
 * Why a second layout: in the row layout (qgemm.c) every group of 32 weights of one output
 * channel ends in a horizontal int32 sum that is converted, scaled by the group's fp16 scale and
 * added, once per row of x: about 12 instructions per 32 multiply-adds, so decode ran at half the
 * memory bandwidth and a 16-row batch spent 3x the time of oneDNN's bf16 matmul. Here a vector
 * lane is an output channel: one group of 16 channels is widened once into 16 registers of int16
 * pairs and then, for every row of x, 16 vpdpwssd with a broadcast pair of activations give the
 * 16 channels' int32 group sums directly; the scale is one vector FMA per group and row.
 *
 * Layout "n16" (blocks of 16 output channels b, groups of 32 inputs g, G = K/32, N padded to 16):
 *   q4_1: w[b][g][4][32] uint16 words: word (t, l) holds in nibble s (bits 4s..4s+3) the code of
 *         channel 16b + l/2 at input 32g + 2(4t+s) + (l&1); d[b][g][16], m[b][g][16] fp16
 *   q8_0: w[b][g][16][32] int8: byte (j, l) is channel 16b + l/2 at input 32g + 2j + (l&1);
 *         d[b][g][16] fp16
 * Activations are rounded to int16 per row, as in qgemm.c (x ~= xq * xs, 15 bits), so results
 * match its accuracy; the q4_1 minimum multiplies the fp32 group sums of x.
 * Built with -mavx512f -mavx512bw -mavx512vnni -mavx2 -mfma -mf16c (kernels/qgemm_n16.py).
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exports.h"

#define QN_GROUP 32
#define QN_X_BF16 1
#define QN_Y_BF16 2
#define XQ_MAX 16383
#ifndef QN_PF4
#define QN_PF4 3072 /* bytes of q4 weights prefetched ahead (1, 2, 3 KiB measured: 3 best, PERF.md) */
#endif
#ifndef QN_PF8
#define QN_PF8 2048 /* bytes of q8 weights prefetched ahead */
#endif
#define QN_ROWS 64 /* rows of x per pass: their accumulators (4 KiB) stay in L1 */

#include "qgemm_n16_rows.h"

/* xq[M][K] int16, xs[M] (NaN for a row holding NaN/inf: its outputs become NaN), and for q4_1
 * xsum[M][G] (fp32 sums of each group of x). 0, or -1 when out of memory. */
typedef struct {
    int16_t *xq;
    float *xs, *xsum;
} xprep;

static int xprep_make(xprep *p, const void *x, int64_t M, int64_t K, int flags, int want_sums) {
    int64_t G = K / QN_GROUP;
    p->xq = (int16_t *)aligned_alloc(64, (sizeof(int16_t) * (size_t)(M * K) + 127) & ~(size_t)63);
    p->xs = (float *)malloc(sizeof(float) * (size_t)(M + 1));
    p->xsum = want_sums ? (float *)malloc(sizeof(float) * (size_t)(M * G + 1)) : NULL;
    float *row = (float *)malloc(sizeof(float) * (size_t)(K + 16));
    if (!p->xq || !p->xs || (want_sums && !p->xsum) || !row) {
        free(p->xq);
        free(p->xs);
        free(p->xsum);
        free(row);
        return -1;
    }
    for (int64_t i = 0; i < M; i++) {
        const float *xr;
        if (flags & QN_X_BF16) {
            const uint16_t *h = (const uint16_t *)x + i * K;
            int64_t k = 0;
            for (; k + 16 <= K; k += 16) {
                _mm512_storeu_ps(row + k, bf16x16_to_ps(h + k));
            }
            for (; k < K; k++) {
                union { uint32_t u; float f; } c;
                c.u = (uint32_t)h[k] << 16;
                row[k] = c.f;
            }
            xr = row;
        } else {
            xr = (const float *)x + i * K;
        }
        float amax = 0.0f;
        int bad = 0;
        for (int64_t k = 0; k < K; k++) {
            float a = fabsf(xr[k]);
            bad |= !(a <= FLT_MAX); /* NaN or inf */
            amax = a > amax ? a : amax;
        }
        if (bad) amax = 0.0f;
        float inv = amax > 0 ? (float)XQ_MAX / amax : 0.0f;
        p->xs[i] = bad ? NAN : amax > 0 ? amax / (float)XQ_MAX : 0.0f;
        int16_t *q = p->xq + i * K;
        for (int64_t k = 0; k < K; k++) q[k] = (int16_t)lrintf(xr[k] * inv);
        if (want_sums)
            for (int64_t g = 0; g < G; g++) {
                float s = 0.0f;
                for (int j = 0; j < QN_GROUP; j++) s += xr[g * QN_GROUP + j];
                p->xsum[i * G + g] = bad ? NAN : s;
            }
    }
    free(row);
    return 0;
}

static void xprep_free(xprep *p) {
    free(p->xq);
    free(p->xs);
    free(p->xsum);
}

/* One group, R rows of x from row m (R constant after inlining): facc[r] += d * xs * sum_j w[j] .
 * x pairs, + mn * xsum. Two accumulators per row keep 2R vpdpwssd chains in flight. */
static inline __attribute__((always_inline)) void rows_group(const __m512i w[16], const int16_t *xg, int64_t K,
                                                             const float *xs, const float *xsum, int64_t G,
                                                             __m512 dv, __m512 mv, int has_min, float *facc, int R) {
    __m512i acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int j = 0; j < 16; j += 2)
        for (int r = 0; r < R; r++) {
            const int32_t *xp = (const int32_t *)(xg + r * K);
            acc[r][0] = _mm512_dpwssd_epi32(acc[r][0], w[j], _mm512_set1_epi32(xp[j]));
            acc[r][1] = _mm512_dpwssd_epi32(acc[r][1], w[j + 1], _mm512_set1_epi32(xp[j + 1]));
        }
    for (int r = 0; r < R; r++) {
        __m512 f = _mm512_loadu_ps(facc + 16 * r);
        __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[r][0], acc[r][1]));
        f = _mm512_fmadd_ps(s, _mm512_mul_ps(dv, _mm512_set1_ps(xs[r])), f);
        if (has_min) f = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[r * G]), f);
        _mm512_storeu_ps(facc + 16 * r, f);
    }
}

/* All rows [0, M) for one group: chunks of 4, then 2, then 1 (each a constant R). */
static inline __attribute__((always_inline)) void all_rows_group(const __m512i w[16], const int16_t *xg, int64_t K,
                                                                 const float *xs, const float *xsum, int64_t G,
                                                                 __m512 dv, __m512 mv, int has_min, float *facc,
                                                                 int64_t M) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4)
        rows_group(w, xg + r * K, K, xs + r, xsum ? xsum + r * G : NULL, G, dv, mv, has_min, facc + 16 * r, 4);
    if (r + 2 <= M) {
        rows_group(w, xg + r * K, K, xs + r, xsum ? xsum + r * G : NULL, G, dv, mv, has_min, facc + 16 * r, 2);
        r += 2;
    }
    if (r < M) rows_group(w, xg + r * K, K, xs + r, xsum ? xsum + r * G : NULL, G, dv, mv, has_min, facc + 16 * r, 1);
}

/* y[M][N] = x[M][K] @ W^T (+ bias) for n16 q4_1 weights. Returns 0, or -1 (no memory). */
int qn_q4_mm(const void *x, int64_t M, int64_t K, const uint16_t *w, const uint16_t *d, const uint16_t *mn,
             const float *bias, void *y, int64_t N, int nthreads, int flags) {
    int64_t G = K / QN_GROUP, NB = (N + 15) / 16;
    xprep p;
    if (xprep_make(&p, x, M, K, flags, 1)) return -1;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t b = 0; b < NB; b++) {
        float facc[QN_ROWS * 16] __attribute__((aligned(64)));
        const __m512i lo4 = _mm512_set1_epi16(0x000F);
        for (int64_t m0 = 0; m0 < M; m0 += QN_ROWS) {
            int64_t mr = M - m0 < QN_ROWS ? M - m0 : QN_ROWS;
            memset(facc, 0, sizeof(float) * 16 * (size_t)mr);
            const uint16_t *wb = w + b * G * 128;
            for (int64_t g = 0; g < G; g++) {
                const uint16_t *wg = wb + g * 128;
                for (int c = 0; c < 4; c++) _mm_prefetch((const char *)wg + QN_PF4 + 64 * c, _MM_HINT_T0);
                __m512i wv[16];
                for (int t = 0; t < 4; t++) {
                    __m512i v = _mm512_loadu_si512((const void *)(wg + 32 * t));
                    wv[4 * t] = _mm512_and_si512(v, lo4);
                    wv[4 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                    wv[4 * t + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 8), lo4);
                    wv[4 * t + 3] = _mm512_srli_epi16(v, 12);
                }
                __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + (b * G + g) * 16)));
                __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + (b * G + g) * 16)));
                all_rows_group(wv, p.xq + m0 * K + g * QN_GROUP, K, p.xs + m0, p.xsum + m0 * G + g, G, dv, mv, 1,
                               facc, mr);
            }
            write_block(y, m0, mr, N, b * 16, facc, bias, flags);
        }
    }
    xprep_free(&p);
    return 0;
}

/* y[M][N] = x[M][K] @ W^T (+ bias) for n16 q8_0 weights. Returns 0, or -1 (no memory). */
int qn_q8_mm(const void *x, int64_t M, int64_t K, const int8_t *w, const uint16_t *d, const float *bias, void *y,
             int64_t N, int nthreads, int flags) {
    int64_t G = K / QN_GROUP, NB = (N + 15) / 16;
    xprep p;
    if (xprep_make(&p, x, M, K, flags, 0)) return -1;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t b = 0; b < NB; b++) {
        float facc[QN_ROWS * 16] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < M; m0 += QN_ROWS) {
            int64_t mr = M - m0 < QN_ROWS ? M - m0 : QN_ROWS;
            memset(facc, 0, sizeof(float) * 16 * (size_t)mr);
            const int8_t *wb = w + b * G * 512;
            for (int64_t g = 0; g < G; g++) {
                const int8_t *wg = wb + g * 512;
                for (int c = 0; c < 8; c++) _mm_prefetch((const char *)(wg + QN_PF8 + 64 * c), _MM_HINT_T0);
                __m512i wv[16];
                for (int j = 0; j < 16; j++) wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wg + 32 * j)));
                __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + (b * G + g) * 16)));
                all_rows_group(wv, p.xq + m0 * K + g * QN_GROUP, K, p.xs + m0, NULL, G, dv, dv, 0, facc, mr);
            }
            write_block(y, m0, mr, N, b * 16, facc, bias, flags);
        }
    }
    xprep_free(&p);
    return 0;
}

/* ---------------------------------------------------------------- dequantize / rows ------
 * The n16 weights widened back to rows (prefill's dequantize-then-matmul, embedding lookups),
 * so a layer keeps only this layout in memory. */

/* W^T for rows [n0, n1) of W (n0 a multiple of 16): out[k][n - n0], row stride n1 - n0, fp32 or
 * bf16. Transposed because the n16 lanes already hold 16 channels at one input: even int16 lanes
 * of register j are input 2j, odd ones 2j+1, so each is one 16-value run of W^T (~0.5 instructions
 * per weight; the row order would need a 16 x 16 transpose per group). Prefill's matmul reads it
 * as x @ W^T. */
static inline void store16(void *out, int64_t off, __m512 v, int nv, int flags) {
    __mmask16 mk = (__mmask16)((1u << nv) - 1u);
    if (flags & QN_Y_BF16) {
        __m512i u = _mm512_castps_si512(v); /* round to nearest even (finite values: fp16 scales) */
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)out + off, mk, _mm512_srli_epi32(r, 16));
    } else {
        _mm512_mask_storeu_ps((float *)out + off, mk, v);
    }
}

/* W^T of rows n0..n1 into out [K][ld] (ld >= n1 - n0; 0 means n1 - n0). Each store is 16 columns of
 * one row of W^T: with ld * 2 a multiple of 1 KB every row of a group maps to the same L1 sets and the
 * widening runs at a third of its speed (gate_up of the default model, 2048 columns: 10.9 GB/s
 * written against 28.7 at 2032), so callers pad ld (kernels/qgemm.py _blocked). */
static void dequant_t(const void *w, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t n0, int64_t n1,
                      void *out, int64_t ld, int nthreads, int flags, int is_q4) {
    int64_t G = K / QN_GROUP;
    if (ld < n1 - n0) ld = n1 - n0;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
    for (int64_t b = n0 / 16; b < (n1 + 15) / 16; b++)
        for (int64_t g = 0; g < G; g++) {
            int nv = (int)(n1 - 16 * b < 16 ? n1 - 16 * b : 16);
            __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + (b * G + g) * 16)));
            __m512 mv = is_q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + (b * G + g) * 16)))
                              : _mm512_setzero_ps();
            for (int j = 0; j < 16; j++) {
                __m512i v, ev, od;
                if (is_q4) {
                    __m512i wd = _mm512_loadu_si512((const void *)((const uint16_t *)w + (b * G + g) * 128 + (j >> 2) * 32));
                    v = _mm512_and_si512(_mm512_srli_epi16(wd, 4 * (j & 3)), _mm512_set1_epi16(0x000F));
                    ev = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF));
                    od = _mm512_srli_epi32(v, 16);
                } else {
                    v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const int8_t *)w + (b * G + g) * 512 + 32 * j)));
                    ev = _mm512_srai_epi32(_mm512_slli_epi32(v, 16), 16);
                    od = _mm512_srai_epi32(v, 16);
                }
                int64_t k = g * QN_GROUP + 2 * j, col = 16 * b - n0;
                store16(out, k * ld + col, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ev), dv), mv), nv, flags);
                store16(out, (k + 1) * ld + col, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(od), dv), mv), nv, flags);
            }
        }
}

void qn_q4_dequant_t(const uint16_t *w, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t n0, int64_t n1,
                     void *out, int64_t ld, int nthreads, int flags) {
    dequant_t(w, d, mn, K, n0, n1, out, ld, nthreads, flags, 1);
}

void qn_q8_dequant_t(const int8_t *w, const uint16_t *d, int64_t K, int64_t n0, int64_t n1, void *out, int64_t ld,
                     int nthreads, int flags) {
    dequant_t(w, d, NULL, K, n0, n1, out, ld, nthreads, flags, 0);
}
