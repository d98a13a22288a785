/* q8_0 / q4_1 matmul with AMX bf16 tiles for batches of rows (bf16 activations), on the same
 * 16-channel weight layout as qgemm_n16.c.
 *
 * Why: at 16 rows the VNNI kernel is bound by vpdpwssd (one per 32 multiply-adds) and took 1.4x
 * oneDNN's bf16 matmul. One tdpbf16ps does 16 x 16 x 32 multiply-adds: x (16 rows, one group of
 * 32 inputs, read in place as bf16) times the group's codes for 16 channels. The codes 0..15 (q4_1)
 * or -127..127 (q8_0) are exact in bf16 and so are bf16 activations, so each product is exact and
 * the group sums are fp32: no rounding of weights to bf16 (an unquantized bf16 model's error) and
 * none of activations to int16. Each group's 16 x 16 sums are then scaled by the channels' fp16
 * scales (and the q4_1 minimum times the group sums of x) in AVX-512 registers.
 *
 * That exact form pays, per group and 16 rows, a tile store and 32 FMAs for one 16-cycle tile product,
 * and each 16 rows widen the codes again: its time grows with M at ~6 ms per 16 rows for the default
 * model's linears. From QA_WIDE_MIN_M rows on, the widened form runs instead: each group's weights
 * d * code + m are rounded to bf16 once per call (as the large-batch path in kernels/qgemm.py
 * does, and as an unquantized bf16 model holds them) and every 16 rows reuse them; the C tiles
 * then accumulate over all of K with no scaling in between (2 x 2 blocking: two 16-row chunks times
 * two channel blocks, so each tile load feeds two products).
 * Measured on the default model's linears (loadtest/PERF.md, eighth session): 64 rows 21.0 -> 11.3
 * ms, 271 rows 57 -> 38 ms against widening blocks for oneDNN; at 16 rows the widening costs more
 * than it saves (5.9 -> 7.6 ms), so the exact form stays below QA_WIDE_MIN_M.
 *
 * Tiles (exact form): 0,1 = C (sums of an even / odd group), 2,3 = A (x), 4,5 = B (codes as bf16
 * pairs, the VNNI order the layout already has: row j = inputs 2j, 2j+1 of 16 channels).
 * Widened form: 0..3 = C (two row chunks x two channel blocks), 4,5 = A, 6,7 = B. Built with
 * -mamx-tile -mamx-bf16 -mavx512bf16 -mavx512f -mavx512bw -mf16c (kernels/qgemm_n16.py); the
 * loader asks Linux for the tile state (kernels/cbuild.py amx_tiles_granted) before the first call.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exports.h"

#define QA_GROUP 32
#define QA_Y_BF16 2
#define QA_WIDE_MIN_M 24 /* rows from which the widened form is faster (default model, both forms measured) */

int qa_wide_min_m(void) { return QA_WIDE_MIN_M; }


typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static void tiles_on(void) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* Exact form: B tile (16 rows of 64 bytes) of one q4_1 group of 16 channels, codes to bf16 by table. */
static inline void q4_btile(const uint16_t *wg, uint16_t *bt, __m512i table) {
    const __m512i lo4 = _mm512_set1_epi16(0x000F);
    for (int t = 0; t < 4; t++) {
        __m512i v = _mm512_loadu_si512((const void *)(wg + 32 * t));
        _mm512_store_si512((void *)(bt + 32 * (4 * t)), _mm512_permutexvar_epi16(_mm512_and_si512(v, lo4), table));
        _mm512_store_si512((void *)(bt + 32 * (4 * t + 1)),
                           _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 4), lo4), table));
        _mm512_store_si512((void *)(bt + 32 * (4 * t + 2)),
                           _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 8), lo4), table));
        _mm512_store_si512((void *)(bt + 32 * (4 * t + 3)), _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table));
    }
}

static inline void q8_btile(const int8_t *wg, uint16_t *bt) {
    for (int j = 0; j < 16; j++) {
        __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wg + 32 * j))));
        __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wg + 32 * j + 16))));
        _mm512_store_si512((void *)(bt + 32 * j), (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

/* facc[r] += C[r] * d (+ mn * xsum[r]) for the 16 rows of one stored C tile. */
static inline __attribute__((always_inline)) void scale_rows(__m512 facc[16], const float *cbuf, __m512 dv, __m512 mv,
                                                             const float *xsum, int64_t G, int has_min) {
    for (int r = 0; r < 16; r++) {
        facc[r] = _mm512_fmadd_ps(_mm512_load_ps(cbuf + 16 * r), dv, facc[r]);
        if (has_min) facc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[r * G]), facc[r]);
    }
}

/* Widened form: lane l of a B tile row holds channel l / 2 (the VNNI pairs), so each of the 16
 * channels' fp16 values goes to two lanes. */
static inline void lane_pairs(const uint16_t *h16, __m512 *lo, __m512 *hi) {
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h16));
    *lo = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
    *hi = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), v);
}

/* 32 codes (16-bit lanes) times d plus m (fp32, one rounding), as a B tile row of bf16 */
static inline __m512i widen_row(__m512i codes, __m512 dlo, __m512 dhi, __m512 mlo, __m512 mhi) {
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(codes)));
    __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(codes, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(b, dhi, mhi), _mm512_fmadd_ps(a, dlo, mlo));
}

/* Widened form: B tile of one q4_1 group of 16 channels, bf16(d * code + m). */
static inline void q4_wtile(const uint16_t *wg, const uint16_t *dg, const uint16_t *mg, uint16_t *bt) {
    const __m512i lo4 = _mm512_set1_epi16(0x000F);
    __m512 dlo, dhi, mlo, mhi;
    lane_pairs(dg, &dlo, &dhi);
    lane_pairs(mg, &mlo, &mhi);
    for (int t = 0; t < 4; t++) {
        __m512i v = _mm512_loadu_si512((const void *)(wg + 32 * t));
        for (int k = 0; k < 4; k++)
            _mm512_store_si512((void *)(bt + 32 * (4 * t + k)),
                               widen_row(_mm512_and_si512(_mm512_srli_epi16(v, 4 * k), lo4), dlo, dhi, mlo, mhi));
    }
}

/* Widened form: B tile of one q8_0 group of 16 channels, bf16(d * code). */
static inline void q8_wtile(const int8_t *wg, const uint16_t *dg, uint16_t *bt) {
    __m512 dlo, dhi;
    lane_pairs(dg, &dlo, &dhi);
    for (int j = 0; j < 16; j++) {
        __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wg + 32 * j))));
        __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wg + 32 * j + 16))));
        _mm512_store_si512((void *)(bt + 32 * j), (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(b, dhi), _mm512_mul_ps(a, dlo)));
    }
}

/* Rows m0 .. m0+15 (those below M) of y, channels n0 .. n0+15 (those below N): acc + bias, acc
 * being 16 rows of 16 fp32 (a stored C tile). */
static inline void store_rows(const float *acc, int64_t m0, int64_t M, int64_t N, int64_t n0,
                              const float *bias, void *y, int flags) {
    const int64_t rows = M - m0 < 16 ? M - m0 : 16;
    const int nv = (int)(N - n0 < 16 ? N - n0 : 16);
    const __mmask16 k = (__mmask16)((1u << nv) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        __m512 f = _mm512_add_ps(_mm512_load_ps(acc + 16 * r), bv);
        const int64_t o = (m0 + r) * N + n0;
        if (!(flags & QA_Y_BF16)) {
            _mm512_mask_storeu_ps((float *)y + o, k, f);
            continue;
        }
        __m256i h = (__m256i)_mm512_cvtneps_pbh(f);
        if (nv == 16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + o), h);
        } else {
            uint16_t t[16];
            _mm256_storeu_si256((__m256i *)t, h);
            memcpy((uint16_t *)y + o, t, sizeof(uint16_t) * (size_t)nv);
        }
    }
}

/* Widened form: the G B tiles of channel block b into bw. */
static inline void widen_block(int64_t b, int64_t G, const void *w, const uint16_t *d, const uint16_t *mn, int is_q4,
                               uint16_t *bw) {
    for (int64_t g = 0; g < G; g++) {
        if (is_q4)
            q4_wtile((const uint16_t *)w + (b * G + g) * 128, d + (b * G + g) * 16, mn + (b * G + g) * 16, bw + g * 512);
        else
            q8_wtile((const int8_t *)w + (b * G + g) * 512, d + (b * G + g) * 16, bw + g * 512);
    }
}

/* Widened form of amx_mm on x already padded to Mp rows (xb). */
static int amx_mm_wide(const uint16_t *xb, int64_t M, int64_t Mp, int64_t K, const void *w, const uint16_t *d,
                       const uint16_t *mn, const float *bias, void *y, int64_t N, int nthreads, int flags, int is_q4) {
    const int64_t G = K / QA_GROUP, NB = (N + 15) / 16, NP = (NB + 1) / 2, xstride = K * 2;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && N * K >= 65536)
    {
        /* two channel blocks' B tiles, widened once and used by every 16 rows of x */
        uint16_t *bw = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 1024 * (size_t)G);
        float c0[256] __attribute__((aligned(64)));
        if (!bw) {
#pragma omp atomic write
            failed = 1;
        }
        tiles_on();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < NP; p++) {
            if (!bw) continue;
            const int64_t b0 = 2 * p;
            const int two = b0 + 1 < NB;
            uint16_t *bw0 = bw, *bw1 = bw + 512 * G;
            widen_block(b0, G, w, d, mn, is_q4, bw0);
            if (two) widen_block(b0 + 1, G, w, d, mn, is_q4, bw1);
            for (int64_t m0 = 0; m0 < Mp;) {
                const uint16_t *x0 = xb + m0 * K, *x1 = x0 + 16 * K;
                const int pair = Mp - m0 >= 32;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t g = 0; g < G; g++) {
                    _tile_loadd(4, x0 + g * QA_GROUP, xstride);
                    _tile_loadd(6, bw0 + g * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, bw1 + g * 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (pair) {
                        _tile_loadd(5, x1 + g * QA_GROUP, xstride);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c0, 64);
                store_rows(c0, m0, M, N, b0 * 16, bias, y, flags);
                if (two) {
                    _tile_stored(1, c0, 64);
                    store_rows(c0, m0, M, N, b0 * 16 + 16, bias, y, flags);
                }
                if (pair) {
                    _tile_stored(2, c0, 64);
                    store_rows(c0, m0 + 16, M, N, b0 * 16, bias, y, flags);
                    if (two) {
                        _tile_stored(3, c0, 64);
                        store_rows(c0, m0 + 16, M, N, b0 * 16 + 16, bias, y, flags);
                    }
                }
                m0 += pair ? 32 : 16;
            }
        }
        _tile_release();
        free(bw);
    }
    return failed ? -1 : 0;
}

/* y[M][N] = x[M][K] @ W^T (+ bias), x bf16, W n16 q4_1 (is_q4) or q8_0. -1 when out of memory. */
static int amx_mm(const uint16_t *x, int64_t M, int64_t K, const void *w, const uint16_t *d, const uint16_t *mn,
                  const float *bias, void *y, int64_t N, int nthreads, int flags, int is_q4) {
    int64_t G = K / QA_GROUP, NB = (N + 15) / 16, Mp = (M + 15) & ~(int64_t)15;
    /* x padded with zero rows to a multiple of 16 */
    uint16_t *xb = (uint16_t *)aligned_alloc(64, ((size_t)(Mp * K) * 2 + 127) & ~(size_t)63);
    if (!xb) return -1;
    memcpy(xb, x, (size_t)(M * K) * 2);
    memset(xb + M * K, 0, (size_t)((Mp - M) * K) * 2);
    if (nthreads < 1) nthreads = 1;
    if (M >= QA_WIDE_MIN_M) {
        int rc = amx_mm_wide(xb, M, Mp, K, w, d, mn, bias, y, N, nthreads, flags, is_q4);
        free(xb);
        return rc;
    }
    /* exact form: (q4_1) the fp32 sums of each group of x */
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(Mp * G + 1));
    if (!xsum) {
        free(xb);
        return -1;
    }
    for (int64_t i = 0; i < Mp; i++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int j = 0; j < QA_GROUP; j++) {
                union { uint32_t u; float f; } c;
                c.u = (uint32_t)xb[i * K + g * QA_GROUP + j] << 16;
                s += c.f;
            }
            xsum[i * G + g] = s;
        }
    uint16_t tab[32];
    for (int i = 0; i < 32; i++) tab[i] = f32_to_bf16((float)(i & 15));
    const __m512i table = _mm512_loadu_si512((const void *)tab);
    const int64_t xstride = K * 2;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && N * K >= 65536)
    {
        uint16_t bt0[512] __attribute__((aligned(64))), bt1[512] __attribute__((aligned(64)));
        float c0[256] __attribute__((aligned(64))), c1[256] __attribute__((aligned(64)));
        tiles_on();
#pragma omp for schedule(static)
        for (int64_t b = 0; b < NB; b++) {
            for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
                __m512 facc[16];
                for (int r = 0; r < 16; r++) facc[r] = _mm512_setzero_ps();
                const uint16_t *xr = xb + m0 * K;
                const float *xs = xsum + m0 * G;
                int64_t g = 0;
                for (; g + 2 <= G; g += 2) {
                    const uint16_t *dg = d + (b * G + g) * 16;
                    if (is_q4) {
                        const uint16_t *wg = (const uint16_t *)w + (b * G + g) * 128;
                        q4_btile(wg, bt0, table);
                        q4_btile(wg + 128, bt1, table);
                    } else {
                        const int8_t *wg = (const int8_t *)w + (b * G + g) * 512;
                        q8_btile(wg, bt0);
                        q8_btile(wg + 512, bt1);
                    }
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_loadd(2, xr + g * QA_GROUP, xstride);
                    _tile_loadd(3, xr + (g + 1) * QA_GROUP, xstride);
                    _tile_loadd(4, bt0, 64);
                    _tile_loadd(5, bt1, 64);
                    _tile_dpbf16ps(0, 2, 4);
                    _tile_dpbf16ps(1, 3, 5);
                    _tile_stored(0, c0, 64);
                    _tile_stored(1, c1, 64);
                    __m512 dv0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dg));
                    __m512 dv1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dg + 16)));
                    if (is_q4) {
                        const uint16_t *mg = mn + (b * G + g) * 16;
                        __m512 mv0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mg));
                        __m512 mv1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mg + 16)));
                        scale_rows(facc, c0, dv0, mv0, xs + g, G, 1);
                        scale_rows(facc, c1, dv1, mv1, xs + g + 1, G, 1);
                    } else {
                        scale_rows(facc, c0, dv0, dv0, NULL, G, 0);
                        scale_rows(facc, c1, dv1, dv1, NULL, G, 0);
                    }
                }
                if (g < G) { /* an odd group count: the last one alone */
                    const uint16_t *dg = d + (b * G + g) * 16;
                    if (is_q4)
                        q4_btile((const uint16_t *)w + (b * G + g) * 128, bt0, table);
                    else
                        q8_btile((const int8_t *)w + (b * G + g) * 512, bt0);
                    _tile_zero(0);
                    _tile_loadd(2, xr + g * QA_GROUP, xstride);
                    _tile_loadd(4, bt0, 64);
                    _tile_dpbf16ps(0, 2, 4);
                    _tile_stored(0, c0, 64);
                    __m512 dv0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dg));
                    if (is_q4) {
                        __m512 mv0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + (b * G + g) * 16)));
                        scale_rows(facc, c0, dv0, mv0, xs + g, G, 1);
                    } else {
                        scale_rows(facc, c0, dv0, dv0, NULL, G, 0);
                    }
                }
                for (int r = 0; r < 16; r++) _mm512_store_ps(c0 + 16 * r, facc[r]);
                store_rows(c0, m0, M, N, b * 16, bias, y, flags);
            }
        }
        _tile_release();
    }
    free(xb);
    free(xsum);
    return 0;
}

int qa_q4_mm(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, const uint16_t *d, const uint16_t *mn,
             const float *bias, void *y, int64_t N, int nthreads, int flags) {
    return amx_mm(x, M, K, w, d, mn, bias, y, N, nthreads, flags, 1);
}

int qa_q8_mm(const uint16_t *x, int64_t M, int64_t K, const int8_t *w, const uint16_t *d, const float *bias, void *y,
             int64_t N, int nthreads, int flags) {
    return amx_mm(x, M, K, w, d, NULL, bias, y, N, nthreads, flags, 0);
}
