/* q8_0 / q4_1 matmul on AVX2 over the n16 layout (16 output channels side by side, csrc/qgemm_n16.c
 * describes it): the same exported functions as the VNNI build, for CPUs without AVX-512.
 *
 * Why: the AVX2 row-layout kernel (csrc/qgemm_avx2.h) ends every weight row in horizontal sums and
 * a per-row tail (~35 % of a K=576 row at one row of x), and for batches it re-widens each weight
 * group for every chunk of 4 rows: ~11-14 multiply-adds a cycle where vpmaddwd alone allows 32
 * (two a cycle on Zen 3, measured). Here a vector lane is an output channel: a broadcast pair of
 * int16 activations times a register of 8 channels' code pairs (vpmaddwd) adds straight into the
 * channels' int32 group sums, and the group's scale is one vertical FMA per 8 channels and row.
 *   - up to 4 rows of x: each group's codes are widened in registers, a quarter (4 input pairs)
 *     at a time, and used by every row;
 *   - more rows: each group is widened once into a 1 KiB buffer that stays in L1 and is read by
 *     every chunk of 4 rows.
 * Both give every (channel, row) the same int32 group sums (exact) and the same float steps in
 * the same order, so a row's result does not depend on M or on which path ran (design invariant);
 * they are those of the VNNI build too, up to the group sums of x (summed in another order here).
 * Activations are rounded to int16 per row as in qgemm.c (x ~= xq * xs, 15 bits).
 * Built with -mavx2 -mfma -mf16c (kernels/isa.py).
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exports.h"
#include "simd.h"

#define QN_GROUP 32
#define QN_X_BF16 1
#define QN_Y_BF16 2
#define XQ_MAX 16383
#define QN_ROWS 64            /* rows of x per pass over a block: their accumulators (4 KiB) stay in L1 */
#define QN_WIDE_M 5           /* from this many rows, groups are widened once into an L1 buffer */
#define QN_PF 1024            /* bytes of weights prefetched ahead */
#define QN_KEEP (8u << 20)    /* per-thread activation scratch kept between calls up to this size */

#include "qgemm_n16_rows.h"

/* The activation scratch: one buffer per calling thread, kept between calls (a decode step makes
 * ~120 of them), freed and taken per call above QN_KEEP. */
static _Thread_local void *qn_buf;
static _Thread_local size_t qn_cap;

static void *qn_scratch(size_t bytes) {
    if (bytes > QN_KEEP) return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (bytes > qn_cap) {
        free(qn_buf);
        qn_cap = 0;
        size_t want = ((QN_KEEP < 2 * bytes ? QN_KEEP : 2 * bytes) + 63) & ~(size_t)63;
        qn_buf = aligned_alloc(64, want);
        if (!qn_buf) return NULL;
        qn_cap = want;
    }
    return qn_buf;
}

static void qn_release(void *p) {
    if (p != qn_buf) free(p);
}

typedef struct {
    int16_t *xq; /* [M][K] */
    float *xs;   /* [M]: NaN for a row holding NaN/inf, so its outputs become NaN */
    float *xsum; /* [M][G] fp32 sums of each group of x (q4_1's minimum multiplies them), or NULL */
    void *buf;
} xprep;

/* One row of x (fp32) rounded to int16 with its scale, and its group sums when wanted. */
static void prep_row(const float *xr, int64_t K, int16_t *q, float *xs, float *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vmax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) { /* K is a multiple of 32 */
        __m256 v = _mm256_loadu_ps(xr + k);
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    int bad = _mm256_movemask_ps(nan) != 0 || amax > FLT_MAX;
    if (bad) amax = 0.0f;
    float inv = amax > 0 ? (float)XQ_MAX / amax : 0.0f;
    *xs = bad ? NAN : amax > 0 ? amax / (float)XQ_MAX : 0.0f;
    __m256 vi = _mm256_set1_ps(inv);
    for (int64_t k = 0; k < K; k += 16) { /* round to nearest even, as lrintf */
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k), vi));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k + 8), vi));
        _mm256_storeu_si256((__m256i *)(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
    if (xsum)
        for (int64_t g = 0; g < K / QN_GROUP; g++) {
            const float *p = xr + g * QN_GROUP;
            __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
            xsum[g] = bad ? NAN : hsum256(v);
        }
}

static int xprep_make(xprep *p, const void *x, int64_t M, int64_t K, int flags, int want_sums) {
    int64_t G = K / QN_GROUP;
    size_t xq_bytes = ((size_t)(M * K) * 2 + 63) & ~(size_t)63;
    size_t bytes = xq_bytes + sizeof(float) * (size_t)(M + (want_sums ? M * G : 0) + ((flags & QN_X_BF16) ? K : 0) + 16);
    char *buf = (char *)qn_scratch(bytes);
    if (!buf) return -1;
    p->buf = buf;
    p->xq = (int16_t *)buf;
    p->xs = (float *)(buf + xq_bytes);
    p->xsum = want_sums ? p->xs + M : NULL;
    float *row = p->xs + M + (want_sums ? M * G : 0);
    for (int64_t i = 0; i < M; i++) {
        const float *xr = (const float *)x + i * K;
        if (flags & QN_X_BF16) {
            const uint16_t *h = (const uint16_t *)x + i * K;
            for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(row + k, bf16x8_to_ps(h + k));
            xr = row;
        }
        prep_row(xr, K, p->xq + i * K, p->xs + i, want_sums ? p->xsum + i * G : NULL);
    }
    return 0;
}

/* The 8 code pairs of channels 8h..8h+7 for input pairs 4t+s (s = 0..3) of one q4_1 group
 * (128 words at wg): one 32-byte load, nibble s of every word. */
static inline __attribute__((always_inline)) void q4_quarter(const uint16_t *wg, int t, int h, __m256i w[4]) {
    const __m256i lo4 = _mm256_set1_epi16(0x000F);
    __m256i v = _mm256_loadu_si256((const __m256i *)(wg + 32 * t + 16 * h));
    w[0] = _mm256_and_si256(v, lo4);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(v, 8), lo4);
    w[3] = _mm256_srli_epi16(v, 12);
}

/* The same for q8_0 (512 bytes a group: input pair j of 16 channels is 32 bytes at 32j). */
static inline __attribute__((always_inline)) __m256i q8_pair(const int8_t *wg, int j, int h) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wg + 32 * j + 16 * h)));
}

/* The group's end for R rows: facc[r] (16 channels) += float(acc) * (d * xs[r]), then (q4_1)
 * += m * xsum[r]: the steps, and their order, of the VNNI build. */
static inline __attribute__((always_inline)) void group_end(__m256i acc[][2], int R, const float *xs,
                                                            const float *xsum, int64_t G, const __m256 dv[2],
                                                            const __m256 mv[2], int has_min, float *facc) {
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) {
            __m256 f = _mm256_loadu_ps(facc + 16 * r + 8 * h);
            f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_mul_ps(dv[h], _mm256_set1_ps(xs[r])), f);
            if (has_min) f = _mm256_fmadd_ps(mv[h], _mm256_set1_ps(xsum[r * G]), f);
            _mm256_storeu_ps(facc + 16 * r + 8 * h, f);
        }
}

/* Few rows (R <= 4, constant after inlining): one group of q4_1 (is_q4) or q8_0, widened in
 * registers a quarter or a pair at a time, for rows xg, xg + K, ... */
static inline __attribute__((always_inline)) void group_regs(const void *wg, int is_q4, const int16_t *xg,
                                                             int64_t K, int R, __m256i acc[][2]) {
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    if (is_q4) {
        for (int t = 0; t < 4; t++) {
            __m256i wa[4], wb[4];
            q4_quarter((const uint16_t *)wg, t, 0, wa);
            q4_quarter((const uint16_t *)wg, t, 1, wb);
            for (int s = 0; s < 4; s++)
                for (int r = 0; r < R; r++) {
                    __m256i xp = _mm256_set1_epi32(((const int32_t *)(xg + r * K))[4 * t + s]);
                    acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(wa[s], xp));
                    acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(wb[s], xp));
                }
        }
    } else {
        for (int j = 0; j < 16; j++) {
            __m256i wa = q8_pair((const int8_t *)wg, j, 0), wb = q8_pair((const int8_t *)wg, j, 1);
            for (int r = 0; r < R; r++) {
                __m256i xp = _mm256_set1_epi32(((const int32_t *)(xg + r * K))[j]);
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(wa, xp));
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(wb, xp));
            }
        }
    }
}

/* Many rows: R (<= 4) rows against one group already widened into wide[16][2] (pair j, half h). */
static inline __attribute__((always_inline)) void group_wide(const __m256i *wide, const int16_t *xg, int64_t K,
                                                             int R, __m256i acc[][2]) {
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < 16; j++) {
        __m256i wa = _mm256_load_si256(wide + 2 * j), wb = _mm256_load_si256(wide + 2 * j + 1);
        for (int r = 0; r < R; r++) {
            __m256i xp = _mm256_set1_epi32(((const int32_t *)(xg + r * K))[j]);
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(wa, xp));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(wb, xp));
        }
    }
}

static void widen_group(const void *wg, int is_q4, __m256i *wide) {
    if (is_q4) {
        for (int t = 0; t < 4; t++)
            for (int h = 0; h < 2; h++) {
                __m256i w[4];
                q4_quarter((const uint16_t *)wg, t, h, w);
                for (int s = 0; s < 4; s++) _mm256_store_si256(wide + 2 * (4 * t + s) + h, w[s]);
            }
    } else {
        for (int j = 0; j < 16; j++)
            for (int h = 0; h < 2; h++) _mm256_store_si256(wide + 2 * j + h, q8_pair((const int8_t *)wg, j, h));
    }
}

/* One row of x against a whole block (decode): the steps of group_regs and group_end for R = 1
 * with the 16 channels' sums in registers across the groups instead of in facc (spilled arrays
 * cost ~20 % of the one-row time); the same operations in the same order, so the same result. */
static void block_one_row(const void *wb, int is_q4, const int16_t *xq, float xs, const float *xsum, int64_t G,
                          const uint16_t *db, const uint16_t *mb, float out[16]) {
    const int64_t gbytes = is_q4 ? 256 : 512;
    const __m256 xsv = _mm256_set1_ps(xs);
    __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const char *wg = (const char *)wb + g * gbytes;
        for (int c = 0; c < gbytes; c += 64) _mm_prefetch(wg + QN_PF + c, _MM_HINT_T0);
        __m256i acc[1][2];
        group_regs(wg, is_q4, xq + g * QN_GROUP, 0, 1, acc);
        __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + g * 16)));
        __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(db + g * 16 + 8)));
        f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[0][0]), _mm256_mul_ps(d0, xsv), f0);
        f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[0][1]), _mm256_mul_ps(d1, xsv), f1);
        if (is_q4) {
            __m256 xm = _mm256_set1_ps(xsum[g]);
            f0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mb + g * 16))), xm, f0);
            f1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mb + g * 16 + 8))), xm, f1);
        }
    }
    _mm256_storeu_ps(out, f0);
    _mm256_storeu_ps(out + 8, f1);
}

/* Rows [m0, m0 + mr) of x against one group g of block b, accumulating into facc. */
static inline __attribute__((always_inline)) void block_group(const void *wg, int is_q4, const xprep *p, int64_t K,
                                                              int64_t G, int64_t g, int64_t m0, int64_t mr,
                                                              const __m256 dv[2], const __m256 mv[2], float *facc,
                                                              __m256i *wide) {
    const int16_t *xg = p->xq + m0 * K + g * QN_GROUP;
    const float *xs = p->xs + m0, *xsum = is_q4 ? p->xsum + m0 * G + g : NULL;
    __m256i acc[4][2];
#define QN_ROWS_AT(r, R, BODY)                                                                          \
    do {                                                                                                \
        BODY;                                                                                           \
        group_end(acc, R, xs + (r), xsum ? xsum + (r) * G : NULL, G, dv, mv, is_q4, facc + 16 * (r)); \
    } while (0)
    if (mr < QN_WIDE_M) {
        switch (mr) { /* constant R: the loops unroll into registers */
        case 1: QN_ROWS_AT(0, 1, group_regs(wg, is_q4, xg, K, 1, acc)); break;
        case 2: QN_ROWS_AT(0, 2, group_regs(wg, is_q4, xg, K, 2, acc)); break;
        case 3: QN_ROWS_AT(0, 3, group_regs(wg, is_q4, xg, K, 3, acc)); break;
        default: QN_ROWS_AT(0, 4, group_regs(wg, is_q4, xg, K, 4, acc)); break;
        }
        return;
    }
    widen_group(wg, is_q4, wide);
    int64_t r = 0;
    for (; r + 4 <= mr; r += 4) QN_ROWS_AT(r, 4, group_wide(wide, xg + r * K, K, 4, acc));
    switch (mr - r) {
    case 3: QN_ROWS_AT(r, 3, group_wide(wide, xg + r * K, K, 3, acc)); break;
    case 2: QN_ROWS_AT(r, 2, group_wide(wide, xg + r * K, K, 2, acc)); break;
    case 1: QN_ROWS_AT(r, 1, group_wide(wide, xg + r * K, K, 1, acc)); break;
    default: break;
    }
#undef QN_ROWS_AT
}

/* y[M][N] = x[M][K] @ W^T (+ bias): blocks of 16 channels split over the threads. */
static int qn_mm(const void *x, int64_t M, int64_t K, const void *w, const uint16_t *d, const uint16_t *mn,
                 const float *bias, void *y, int64_t N, int nthreads, int flags, int is_q4) {
    int64_t G = K / QN_GROUP, NB = (N + 15) / 16;
    const int64_t gbytes = is_q4 ? 256 : 512;
    xprep p;
    if (xprep_make(&p, x, M, K, flags, is_q4)) return -1;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t b = 0; b < NB; b++) {
        float facc[QN_ROWS * 16] __attribute__((aligned(64)));
        __m256i wide[32];
        const char *wb = (const char *)w + b * G * gbytes;
        if (M == 1) {
            if (is_q4)
                block_one_row(wb, 1, p.xq, p.xs[0], p.xsum, G, d + b * G * 16, mn + b * G * 16, facc);
            else
                block_one_row(wb, 0, p.xq, p.xs[0], NULL, G, d + b * G * 16, NULL, facc);
            write_block(y, 0, 1, N, b * 16, facc, bias, flags);
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += QN_ROWS) {
            int64_t mr = M - m0 < QN_ROWS ? M - m0 : QN_ROWS;
            memset(facc, 0, sizeof(float) * 16 * (size_t)mr);
            for (int64_t g = 0; g < G; g++) {
                const char *wg = wb + g * gbytes;
                for (int c = 0; c < gbytes; c += 64) _mm_prefetch(wg + QN_PF + c, _MM_HINT_T0);
                const uint16_t *dg = d + (b * G + g) * 16;
                __m256 dv[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dg)),
                                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dg + 8)))};
                __m256 mv[2] = {dv[0], dv[1]};
                if (is_q4) {
                    const uint16_t *mg = mn + (b * G + g) * 16;
                    mv[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mg));
                    mv[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mg + 8)));
                    block_group(wg, 1, &p, K, G, g, m0, mr, dv, mv, facc, wide);
                } else {
                    block_group(wg, 0, &p, K, G, g, m0, mr, dv, mv, facc, wide);
                }
            }
            write_block(y, m0, mr, N, b * 16, facc, bias, flags);
        }
    }
    qn_release(p.buf);
    return 0;
}

/* y[M][N] = x[M][K] @ W^T (+ bias) for n16 q4_1 weights. Returns 0, or -1 (no memory). */
int qn_q4_mm(const void *x, int64_t M, int64_t K, const uint16_t *w, const uint16_t *d, const uint16_t *mn,
             const float *bias, void *y, int64_t N, int nthreads, int flags) {
    return qn_mm(x, M, K, w, d, mn, bias, y, N, nthreads, flags, 1);
}

/* y[M][N] = x[M][K] @ W^T (+ bias) for n16 q8_0 weights. Returns 0, or -1 (no memory). */
int qn_q8_mm(const void *x, int64_t M, int64_t K, const int8_t *w, const uint16_t *d, const float *bias, void *y,
             int64_t N, int nthreads, int flags) {
    return qn_mm(x, M, K, w, d, NULL, bias, y, N, nthreads, flags, 0);
}

/* ---------------------------------------------------------------- dequantize / rows ------ */

/* W^T of rows n0..n1 into out [K][ld] (ld >= n1 - n0; 0 means n1 - n0), fp32 or bf16: prefill's
 * dequantize-then-matmul where a caller wants it (on AVX2 the kernel above takes every M). */
static void dequant_t(const void *w, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t n0, int64_t n1,
                      void *out, int64_t ld, int nthreads, int flags, int is_q4) {
    if (ld < n1 - n0) ld = n1 - n0;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)K);
#pragma omp for schedule(static)
        for (int64_t n = n0; n < n1; n++) {
            if (!buf) continue;
            row_f32(w, d, mn, K, n, buf, is_q4);
            for (int64_t k = 0; k < K; k++) {
                if (flags & QN_Y_BF16)
                    ((uint16_t *)out)[k * ld + (n - n0)] = f32_to_bf16(buf[k]);
                else
                    ((float *)out)[k * ld + (n - n0)] = buf[k];
            }
        }
        free(buf);
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
