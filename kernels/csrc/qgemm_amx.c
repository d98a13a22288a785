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
 * Tiles: 0,1 = C (sums of an even / odd group), 2,3 = A (x), 4,5 = B (codes as bf16 pairs, the
 * VNNI order the layout already has: row j = inputs 2j, 2j+1 of 16 channels). Built with
 * -mamx-tile -mamx-bf16 -mavx512bf16 -mavx512f -mavx512bw -mf16c (kernels/qgemm_n16.py); the
 * loader asks Linux for the tile state (kernels/cbuild.py amx_tiles_granted) before the first call.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define QA_GROUP 32
#define QA_Y_BF16 2


typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static void tiles_on(void) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* B tile (16 rows of 64 bytes) of one q4_1 group of 16 channels: codes to bf16 by table. */
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

/* y[M][N] = x[M][K] @ W^T (+ bias), x bf16, W n16 q4_1 (is_q4) or q8_0. -1 when out of memory. */
static int amx_mm(const uint16_t *x, int64_t M, int64_t K, const void *w, const uint16_t *d, const uint16_t *mn,
                  const float *bias, void *y, int64_t N, int nthreads, int flags, int is_q4) {
    int64_t G = K / QA_GROUP, NB = (N + 15) / 16, Mp = (M + 15) & ~(int64_t)15;
    /* x padded with zero rows to a multiple of 16, and (q4_1) the fp32 sums of each group */
    uint16_t *xb = (uint16_t *)aligned_alloc(64, ((size_t)(Mp * K) * 2 + 127) & ~(size_t)63);
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(Mp * G + 1));
    if (!xb || !xsum) {
        free(xb);
        free(xsum);
        return -1;
    }
    memcpy(xb, x, (size_t)(M * K) * 2);
    memset(xb + M * K, 0, (size_t)((Mp - M) * K) * 2);
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
    if (nthreads < 1) nthreads = 1;
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
                int64_t n0 = b * 16, rows = M - m0 < 16 ? M - m0 : 16;
                int nv = (int)(N - n0 < 16 ? N - n0 : 16);
                for (int64_t r = 0; r < rows; r++) {
                    float f[16];
                    _mm512_storeu_ps(f, facc[r]);
                    int64_t o = (m0 + r) * N + n0;
                    if (flags & QA_Y_BF16) {
                        uint16_t *yo = (uint16_t *)y + o;
                        for (int c = 0; c < nv; c++) yo[c] = f32_to_bf16(f[c] + (bias ? bias[n0 + c] : 0.0f));
                    } else {
                        float *yo = (float *)y + o;
                        for (int c = 0; c < nv; c++) yo[c] = f[c] + (bias ? bias[n0 + c] : 0.0f);
                    }
                }
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
