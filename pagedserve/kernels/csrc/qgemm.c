/* Weight-only quantized matmul for CPU decode: y[M,N] = x[M,K] @ dequant(W)[N,K]^T (+ bias).
 *
 * Why hand-written: PyTorch's packed int8/int4 CPU kernels are slower than a plain fp32 GEMV
 * (see loadtest/PERF.md). Single-stream decode is bound by the bytes of weights read per token,
 * so the weights stay packed in memory and are widened in registers right before the multiply.
 *
 * Layouts (row n = output channel, contiguous along K; G = K/32 groups per row):
 *   int8c (per channel): w8[N][K] int8, scale[N] fp32; W[n][k] = scale[n] * w8[n][k]
 *   q8_0 (GGUF Q8_0):    w8[N][K] int8, d[N][G] fp16;  W[n][32g+i] = d[n][g] * w8[n][32g+i]
 *   q4_1 (GGUF Q4_1):    w4[N][K/2] uint8, d[N][G], m[N][G] fp16; byte j of a group holds value j
 *                        in its low nibble and value j+16 in its high nibble; W = d * q + m, q 0..15
 *                        (GGUF Q4_0 loads as q4_1 with m = -8 d)
 *
 * Activations x (fp32 or bf16, flag QG_X_BF16) are rounded to int16 per row (x ~= xq * xs) so the
 * inner loop is integer multiply-adds (vpmaddwd); outputs are written as fp32 or bf16 (QG_Y_BF16).
 *
 * Paths: QG_AVX512 (AVX-512 F+BW, -mavx512f -mavx512bw: one 512-bit multiply-add per group of 32),
 * QG_AVX2 (AVX2+FMA), else portable scalar loops. qg_isa() says which one this build is. The
 * loader passes the -m flags only when the CPU has them. Rows of W are split over OpenMP threads;
 * the caller passes the thread count (torch.get_num_threads()).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exports.h"
#include "simd.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define QG_AVX2 1
#else
#define QG_AVX2 0
#endif
#if QG_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define QG_AVX512 1
#else
#define QG_AVX512 0
#endif

#define QG_GROUP 32
#define QG_X_BF16 1
#define QG_Y_BF16 2

int qg_isa(void) { return QG_AVX512 ? 3 : QG_AVX2 ? 2 : 0; }

/* ---------------------------------------------------------------- conversions ---------- */

static inline void put(void *y, int64_t idx, float v, int flags) {
    if (flags & QG_Y_BF16)
        ((uint16_t *)y)[idx] = f32_to_bf16(v);
    else
        ((float *)y)[idx] = v;
}

/* n values of buf to out[off..] as fp32 or bf16: straight loops the compiler vectorizes (the
 * prefill path widens every weight through here; per-element put() measured ~5 ns/weight). */
static inline void store_run(void *out, int64_t off, const float *buf, int n, int flags) {
    if (flags & QG_Y_BF16) {
        uint16_t *o = (uint16_t *)out + off;
        const uint32_t *u = (const uint32_t *)buf;
        for (int j = 0; j < n; j++) {
            uint32_t r = (u[j] + 0x7fffu + ((u[j] >> 16) & 1u)) >> 16;
            o[j] = (uint16_t)(((u[j] & 0x7fffffffu) > 0x7f800000u) ? ((u[j] >> 16) | 0x40u) : r);
        }
    } else {
        memcpy((float *)out + off, buf, sizeof(float) * (size_t)n);
    }
}

/* IEEE half to float. Without F16C: shifting the 15 exponent+mantissa bits into float position
 * and scaling by 2^112 rebiases the exponent and handles subnormals; inf/NaN get the all-ones
 * exponent back. */
static inline float h2f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);  /* one vcvtph2ps: the bit trick below costs int4 ~40 % on AVX2 */
#else
    union { uint32_t u; float f; } v;
    uint32_t em = h & 0x7fffu;
    v.u = em << 13;
    v.f *= 0x1p112f;
    if (em >= 0x7c00u) v.u |= 0x7f800000u;
    v.u |= (uint32_t)(h & 0x8000u) << 16;
    return v.f;
#endif
}

/* x as fp32: the input itself, or a converted copy in *owned (caller frees). NULL on no memory. */
static const float *x_as_f32(const void *x, int64_t M, int64_t K, int flags, float **owned) {
    *owned = NULL;
    if (!(flags & QG_X_BF16)) return (const float *)x;
    float *f = (float *)malloc(sizeof(float) * (size_t)(M * K + 1));
    if (!f) return NULL;
    const uint16_t *h = (const uint16_t *)x;
    for (int64_t i = 0; i < M * K; i++) f[i] = bf16_to_f32(h[i]);
    *owned = f;
    return f;
}

/* Activations are rounded to int16 per row (x[i][k] ~= xq[i][k] * xs[i]). With 15 bits the
 * rounding error is at most 3e-5 of the row's largest value, far below the int8 weight rounding
 * (about 4e-3), so the result stays weight-only quality. */
#define XQ_MAX 16383
/* int32 lane sums stay below 2^31: KCHUNK/16 pair sums of at most 2*127*16383 each */
#define KCHUNK 4096
/* bytes ahead of the current weight read to prefetch (measured best of 256/1024/4096) */
#define QG_PREFETCH 1024

#if QG_AVX2

/* xq[M][Kp] (zero padded to Kp, a multiple of 16) and xs[M]. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t Kp, int16_t *xq, float *xs) {
    for (int64_t i = 0; i < M; i++) {
        const float *xr = x + i * K;
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 vmax = _mm256_setzero_ps();
        int64_t k = 0;
        __m256 nan = _mm256_setzero_ps();
        for (; k + 8 <= K; k += 8) {
            __m256 v = _mm256_loadu_ps(xr + k);
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        int bad = _mm256_movemask_ps(nan) != 0;
        for (; k < K; k++) {
            float a = xr[k] < 0 ? -xr[k] : xr[k];
            amax = a > amax ? a : amax;
            bad |= xr[k] != xr[k];
        }
        bad |= amax > FLT_MAX;
        if (bad) amax = 0.0f;  /* the row's outputs become NaN below, as they would in fp32 */
        float inv = amax > 0 ? (float)XQ_MAX / amax : 0.0f;
        xs[i] = bad ? NAN : amax > 0 ? amax / (float)XQ_MAX : 0.0f;
        int16_t *q = xq + i * Kp;
        k = 0;
        __m256 vi = _mm256_set1_ps(inv);
        for (; k + 8 <= K; k += 8) {
            __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k), vi));  /* round to nearest */
            __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storeu_si128((__m128i *)(q + k), p);
        }
        for (; k < K; k++) {
            float f = xr[k] * inv;
            q[k] = (int16_t)(f < 0 ? f - 0.5f : f + 0.5f);
        }
        for (; k < Kp; k++) q[k] = 0;
    }
}

/* The scratch every SIMD matmul needs: x as fp32 (converted from bf16 if need be), rounded to
 * int16 rows of Kp values, and the row scales. Returns 0 or -1 (no memory). */
typedef struct {
    float *xf_owned;
    int16_t *xq;
    float *xs;
} xscratch;

static int xscratch_make(xscratch *s, const void *x, int64_t M, int64_t K, int64_t Kp, int flags) {
    s->xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * Kp + 32));
    s->xs = (float *)malloc(sizeof(float) * (size_t)(M + 1));
    const float *xf = x_as_f32(x, M, K, flags, &s->xf_owned);
    if (!s->xq || !s->xs || !xf) {
        free(s->xq);
        free(s->xs);
        free(s->xf_owned);
        return -1;
    }
    quantize_rows(xf, M, K, Kp, s->xq, s->xs);
    free(s->xf_owned);
    s->xf_owned = NULL;
    return 0;
}

static void xscratch_free(xscratch *s) {
    free(s->xq);
    free(s->xs);
}

static inline __m256i w8x16(const int8_t *p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

/* Integer dot products of one row of w8 with rows [m0, m0+mr) of xq (mr 1 or 2), into out[mr]
 * (unscaled). One weight row at a time, read front to back, with a software prefetch ahead:
 * measured on a loaded AVX2 VM, this streams DRAM about 2x faster than interleaving four rows
 * (the hardware prefetcher alone keeps too few lines in flight for one byte per weight). */
static void i8_row(const int16_t *xq, int64_t Kp, int64_t K, const int8_t *wr, int64_t m0, int mr, float out[2]) {
    int64_t kv = K & ~(int64_t)31;
    const int16_t *x0 = xq + m0 * Kp, *x1 = x0 + Kp;
    out[0] = out[1] = 0.0f;
    for (int64_t kc = 0; kc < kv; kc += KCHUNK) {
        int64_t ke = kc + KCHUNK < kv ? kc + KCHUNK : kv;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0;
        if (mr == 2) {
            for (int64_t k = kc; k < ke; k += 32) {
                if (!(k & 63)) _mm_prefetch((const char *)(wr + k + QG_PREFETCH), _MM_HINT_T0);
                __m256i v0 = w8x16(wr + k), v1 = w8x16(wr + k + 16);
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(v0, _mm256_loadu_si256((const __m256i *)(x0 + k))));
                a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(v1, _mm256_loadu_si256((const __m256i *)(x0 + k + 16))));
                b0 = _mm256_add_epi32(b0, _mm256_madd_epi16(v0, _mm256_loadu_si256((const __m256i *)(x1 + k))));
                b1 = _mm256_add_epi32(b1, _mm256_madd_epi16(v1, _mm256_loadu_si256((const __m256i *)(x1 + k + 16))));
            }
            out[1] += hsum256(_mm256_add_ps(_mm256_cvtepi32_ps(b0), _mm256_cvtepi32_ps(b1)));
        } else {
            for (int64_t k = kc; k < ke; k += 32) {
                if (!(k & 63)) _mm_prefetch((const char *)(wr + k + QG_PREFETCH), _MM_HINT_T0);
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w8x16(wr + k), _mm256_loadu_si256((const __m256i *)(x0 + k))));
                a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(w8x16(wr + k + 16),
                                                            _mm256_loadu_si256((const __m256i *)(x0 + k + 16))));
            }
        }
        out[0] += hsum256(_mm256_add_ps(_mm256_cvtepi32_ps(a0), _mm256_cvtepi32_ps(a1)));
    }
    for (int i = 0; i < mr; i++) { /* the K tail, fewer than 32 values */
        const int16_t *xr = xq + (m0 + i) * Kp;
        int32_t s = 0;
        for (int64_t k = kv; k < K; k++) s += (int32_t)xr[k] * wr[k];
        out[i] += (float)s;
    }
}
#endif

/* ---------------------------------------------------------------- int8c (per channel) -- */

/* Returns 0, or -1 when the activation scratch cannot be allocated. */
int qg_int8_mm(const void *x, int64_t M, int64_t K, const int8_t *w8, const float *scale,
               const float *bias, void *y, int64_t N, int nthreads, int flags) {
    if (nthreads < 1) nthreads = 1;
#if QG_AVX2
    int64_t Kp = (K + 15) & ~(int64_t)15;
    xscratch s;
    if (xscratch_make(&s, x, M, K, Kp, flags)) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w8 + n * K;
        float out[2];
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            int mr = (int)(M - m0 < 2 ? M - m0 : 2);
            i8_row(s.xq, Kp, K, wr, m0, mr, out);
            for (int i = 0; i < mr; i++)
                put(y, (m0 + i) * N + n, out[i] * s.xs[m0 + i] * scale[n] + (bias ? bias[n] : 0.0f), flags);
        }
    }
    xscratch_free(&s);
#else
    float *owned;
    const float *xf = x_as_f32(x, M, K, flags, &owned);
    if (!xf) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w8 + n * K;
        for (int64_t i = 0; i < M; i++) {
            const float *xr = xf + i * K;
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += xr[k] * (float)wr[k];
            put(y, i * N + n, s * scale[n] + (bias ? bias[n] : 0.0f), flags);
        }
    }
    free(owned);
#endif
    return 0;
}

void qg_int8_dequant(const int8_t *w8, const float *scale, int64_t K, int64_t n0, int64_t n1, void *out,
                     int nthreads, int flags) {
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wr = w8 + n * K;
        float s = scale[n], buf[64];
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            int c = (int)(K - k0 < 64 ? K - k0 : 64);
            for (int j = 0; j < c; j++) buf[j] = s * (float)wr[k0 + j];
            store_run(out, (n - n0) * K + k0, buf, c, flags);
        }
    }
}

/* ---------------------------------------------------------------- q8_0 (grouped) -------- */

#if QG_AVX512
/* One group of 32 int8 weights against 32 int16 activations: 16 int32 lane sums as fp32. */
static inline __m512 q8_group_dot512(const int8_t *wg, const int16_t *xg) {
    __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)wg));
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512((const void *)xg)));
}
#endif

#if QG_AVX2 && !QG_AVX512
static int qa_mm_q8(const void *x, int64_t M, int64_t K, const int8_t *w8, const uint16_t *d, const float *bias,
                    void *y, int64_t N, int nthreads, int flags); /* qgemm_avx2.h */
#endif

int qg_q8_mm(const void *x, int64_t M, int64_t K, const int8_t *w8, const uint16_t *d,
             const float *bias, void *y, int64_t N, int nthreads, int flags) {
    int64_t G = K / QG_GROUP;
    if (nthreads < 1) nthreads = 1;
#if QG_AVX2 && !QG_AVX512
    return qa_mm_q8(x, M, K, w8, d, bias, y, N, nthreads, flags);
#endif
#if QG_AVX2
    xscratch s;
    if (xscratch_make(&s, x, M, K, K, flags)) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w8 + n * K;
        const uint16_t *dr = d + n * G;
        for (int64_t i = 0; i < M; i += 2) {
            const int16_t *x0 = s.xq + i * K;
            const int two = i + 1 < M;
            const int16_t *x1 = two ? x0 + K : x0;
#if QG_AVX512
            __m512 a0 = _mm512_setzero_ps(), a1 = a0;
            for (int64_t g = 0; g < G; g++) {
                if (!(g & 1)) _mm_prefetch((const char *)(wr + g * 32 + QG_PREFETCH), _MM_HINT_T0);
                __m512 dg = _mm512_set1_ps(h2f(dr[g]));
                __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + g * 32)));
                a0 = _mm512_fmadd_ps(dg, _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(x0 + g * 32))), a0);
                if (two)
                    a1 = _mm512_fmadd_ps(dg, _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(x1 + g * 32))), a1);
            }
            float r0 = _mm512_reduce_add_ps(a0), r1 = _mm512_reduce_add_ps(a1);
#else
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            for (int64_t g = 0; g < G; g++) {
                if (!(g & 1)) _mm_prefetch((const char *)(wr + g * 32 + QG_PREFETCH), _MM_HINT_T0);
                __m256 dg = _mm256_set1_ps(h2f(dr[g]));
                __m256i v0 = w8x16(wr + g * 32), v1 = w8x16(wr + g * 32 + 16);
                __m256i p = _mm256_add_epi32(_mm256_madd_epi16(v0, _mm256_loadu_si256((const __m256i *)(x0 + g * 32))),
                                             _mm256_madd_epi16(v1, _mm256_loadu_si256((const __m256i *)(x0 + g * 32 + 16))));
                a0 = _mm256_fmadd_ps(dg, _mm256_cvtepi32_ps(p), a0);
                if (two) {
                    p = _mm256_add_epi32(_mm256_madd_epi16(v0, _mm256_loadu_si256((const __m256i *)(x1 + g * 32))),
                                         _mm256_madd_epi16(v1, _mm256_loadu_si256((const __m256i *)(x1 + g * 32 + 16))));
                    a1 = _mm256_fmadd_ps(dg, _mm256_cvtepi32_ps(p), a1);
                }
            }
            float r0 = hsum256(a0), r1 = hsum256(a1);
#endif
            float b = bias ? bias[n] : 0.0f;
            put(y, i * N + n, r0 * s.xs[i] + b, flags);
            if (two) put(y, (i + 1) * N + n, r1 * s.xs[i + 1] + b, flags);
        }
    }
    xscratch_free(&s);
#else
    float *owned;
    const float *xf = x_as_f32(x, M, K, flags, &owned);
    if (!xf) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w8 + n * K;
        for (int64_t i = 0; i < M; i++) {
            const float *xr = xf + i * K;
            float s = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                float sg = 0.0f;
                for (int j = 0; j < QG_GROUP; j++) sg += xr[g * QG_GROUP + j] * (float)wr[g * QG_GROUP + j];
                s += h2f(d[n * G + g]) * sg;
            }
            put(y, i * N + n, s + (bias ? bias[n] : 0.0f), flags);
        }
    }
    free(owned);
#endif
    return 0;
}

void qg_q8_dequant(const int8_t *w8, const uint16_t *d, int64_t K, int64_t n0, int64_t n1, void *out,
                   int nthreads, int flags) {
    int64_t G = K / QG_GROUP;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wr = w8 + n * K;
        float buf[QG_GROUP];
        for (int64_t g = 0; g < G; g++) {
            float dg = h2f(d[n * G + g]);
            for (int j = 0; j < QG_GROUP; j++) buf[j] = dg * (float)wr[g * QG_GROUP + j];
            store_run(out, (n - n0) * K + g * QG_GROUP, buf, QG_GROUP, flags);
        }
    }
}

/* ---------------------------------------------------------------- q4_1 ------------------ */

/* sum_k x[k] * q[k] over one group, q the raw 0..15 codes (scalar build). */
static inline float q4_group_dot_scalar(const float *xg, const uint8_t *p) {
    float s = 0.0f;
    for (int j = 0; j < 16; j++) {
        s += xg[j] * (float)(p[j] & 0x0F);
        s += xg[j + 16] * (float)(p[j] >> 4);
    }
    return s;
}

#if QG_AVX2
/* The codes of one packed group widened to int16: lo = values 0..15, hi = values 16..31. */
static inline void q4_unpack16(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    *lo = _mm256_cvtepu8_epi16(_mm_and_si128(v, mask));
    *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), mask));
}

/* Integer dot of one group's codes with 32 int16 activations, as 8 fp32 lane sums. */
static inline __m256 q4_group_dot(__m256i lo, __m256i hi, const int16_t *xg) {
    __m256i a = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xg));
    __m256i b = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xg + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(a, b));
}
#endif

#if QG_AVX512
/* One group's 32 codes as 32 int16 in value order (low nibbles, then high nibbles). */
static inline __m512i q4_unpack32(const uint8_t *p) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m256i b = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
    return _mm512_cvtepu8_epi16(b);
}
#endif

#if QG_AVX2 && !QG_AVX512
#include "qgemm_avx2.h"
#endif

/* Returns 0, or -1 when the scratch for the activations cannot be allocated. */
int qg_int4_mm(const void *x, int64_t M, int64_t K, const uint8_t *w4, const uint16_t *d, const uint16_t *mn,
               const float *bias, void *y, int64_t N, int nthreads, int flags) {
#if QG_AVX2 && !QG_AVX512
    return qa_mm_q4(x, M, K, w4, d, mn, bias, y, N, nthreads < 1 ? 1 : nthreads, flags);
#endif
    int64_t G = K / QG_GROUP;
    float *owned;
    const float *xf = x_as_f32(x, M, K, flags, &owned);
    /* per x row and group: the plain sum of x, which the group minimum multiplies */
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(M * G + 1));
    if (!xsum || !xf) {
        free(xsum);
        free(owned);
        return -1;
    }
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int j = 0; j < QG_GROUP; j++) s += xf[i * K + g * QG_GROUP + j];
            xsum[i * G + g] = s;
        }
#if QG_AVX2
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * K + 32));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(M + 1));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        free(xsum);
        free(owned);
        return -1;
    }
    quantize_rows(xf, M, K, K, xq, xs);  /* K is a multiple of 32: no padding */
#endif
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wr = w4 + n * (K / 2);
        const uint16_t *dr = d + n * G, *mr = mn + n * G;
        float b = bias ? bias[n] : 0.0f;
        int64_t i = 0;
#if QG_AVX512
        for (; i < M; i += 2) {
            const int two = i + 1 < M;
            const int16_t *x0 = xq + i * K, *x1 = two ? x0 + K : x0;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0;
            for (int64_t g = 0; g < G; g++) {
                if (!(g & 3)) _mm_prefetch((const char *)(wr + g * 16 + QG_PREFETCH), _MM_HINT_T0);
                __m512i w = q4_unpack32(wr + g * 16);
                __m512 dg = _mm512_set1_ps(h2f(dr[g]));
                a0 = _mm512_fmadd_ps(dg, _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(x0 + g * 32))), a0);
                if (two)
                    a1 = _mm512_fmadd_ps(dg, _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(x1 + g * 32))), a1);
            }
            float m0 = 0.0f, m1 = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                float mg = h2f(mr[g]);
                m0 += mg * xsum[i * G + g];
                if (two) m1 += mg * xsum[(i + 1) * G + g];
            }
            put(y, i * N + n, _mm512_reduce_add_ps(a0) * xs[i] + m0 + b, flags);
            if (two) put(y, (i + 1) * N + n, _mm512_reduce_add_ps(a1) * xs[i + 1] + m1 + b, flags);
        }
#elif QG_AVX2
        for (; i + 2 <= M; i += 2) {
            const int16_t *x0 = xq + i * K, *x1 = x0 + K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            for (int64_t g = 0; g < G; g++) {
                __m256i lo, hi;
                if (!(g & 3)) _mm_prefetch((const char *)(wr + g * 16 + QG_PREFETCH), _MM_HINT_T0);
                q4_unpack16(wr + g * 16, &lo, &hi);
                __m256 dg = _mm256_set1_ps(h2f(dr[g]));
                a0 = _mm256_fmadd_ps(dg, q4_group_dot(lo, hi, x0 + g * QG_GROUP), a0);
                a1 = _mm256_fmadd_ps(dg, q4_group_dot(lo, hi, x1 + g * QG_GROUP), a1);
            }
            float m0 = 0.0f, m1 = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                m0 += h2f(mr[g]) * xsum[i * G + g];
                m1 += h2f(mr[g]) * xsum[(i + 1) * G + g];
            }
            put(y, i * N + n, hsum256(a0) * xs[i] + m0 + b, flags);
            put(y, (i + 1) * N + n, hsum256(a1) * xs[i + 1] + m1 + b, flags);
        }
        for (; i < M; i++) {
            const int16_t *x0 = xq + i * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            int64_t g = 0;
            for (; g + 2 <= G; g += 2) { /* two groups in flight: hides the FMA latency */
                __m256i lo, hi, lo2, hi2;
                if (!(g & 3)) _mm_prefetch((const char *)(wr + g * 16 + QG_PREFETCH), _MM_HINT_T0);
                q4_unpack16(wr + g * 16, &lo, &hi);
                q4_unpack16(wr + g * 16 + 16, &lo2, &hi2);
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(h2f(dr[g])), q4_group_dot(lo, hi, x0 + g * QG_GROUP), a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(h2f(dr[g + 1])), q4_group_dot(lo2, hi2, x0 + (g + 1) * QG_GROUP), a1);
            }
            for (; g < G; g++) {
                __m256i lo, hi;
                q4_unpack16(wr + g * 16, &lo, &hi);
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(h2f(dr[g])), q4_group_dot(lo, hi, x0 + g * QG_GROUP), a0);
            }
            float m0 = 0.0f;
            for (g = 0; g < G; g++) m0 += h2f(mr[g]) * xsum[i * G + g];
            put(y, i * N + n, hsum256(_mm256_add_ps(a0, a1)) * xs[i] + m0 + b, flags);
        }
#else
        for (; i < M; i++) {
            const float *x0 = xf + i * K;
            float s = 0.0f;
            for (int64_t g = 0; g < G; g++)
                s += h2f(dr[g]) * q4_group_dot_scalar(x0 + g * QG_GROUP, wr + g * 16) + h2f(mr[g]) * xsum[i * G + g];
            put(y, i * N + n, s + b, flags);
        }
#endif
    }
#if QG_AVX2
    free(xq);
    free(xs);
#endif
    free(xsum);
    free(owned);
    return 0;
}

void qg_int4_dequant(const uint8_t *w4, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t n0, int64_t n1,
                     void *out, int nthreads, int flags) {
    int64_t G = K / QG_GROUP;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wr = w4 + n * (K / 2);
        int64_t o = (n - n0) * K;
        float buf[QG_GROUP];
        for (int64_t g = 0; g < G; g++) {
            float dg = h2f(d[n * G + g]), mg = h2f(mn[n * G + g]);
            const uint8_t *p = wr + g * 16;
            for (int j = 0; j < 16; j++) {
                buf[j] = dg * (float)(p[j] & 0x0F) + mg;
                buf[j + 16] = dg * (float)(p[j] >> 4) + mg;
            }
            store_run(out, o + g * QG_GROUP, buf, QG_GROUP, flags);
        }
    }
}

/* ---------------------------------------------------------------- embedding rows -------- */

/* out[i] = dequantized row ids[i] of a q8_0 / q4_1 table (a quantized embedding's lookup).
 * Ids outside [0, N) give zero rows (the tensor-parallel caller masks them anyway). */
void qg_q8_rows(const int8_t *w8, const uint16_t *d, int64_t K, int64_t N, const int64_t *ids, int64_t n_ids,
                void *out, int flags) {
    int64_t G = K / QG_GROUP;
    for (int64_t i = 0; i < n_ids; i++) {
        int64_t r = ids[i];
        if (r < 0 || r >= N) {
            for (int64_t k = 0; k < K; k++) put(out, i * K + k, 0.0f, flags);
            continue;
        }
        for (int64_t g = 0; g < G; g++) {
            float dg = h2f(d[r * G + g]);
            for (int j = 0; j < QG_GROUP; j++)
                put(out, i * K + g * QG_GROUP + j, dg * (float)w8[r * K + g * QG_GROUP + j], flags);
        }
    }
}

void qg_int4_rows(const uint8_t *w4, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t N,
                  const int64_t *ids, int64_t n_ids, void *out, int flags) {
    int64_t G = K / QG_GROUP;
    for (int64_t i = 0; i < n_ids; i++) {
        int64_t r = ids[i];
        if (r < 0 || r >= N) {
            for (int64_t k = 0; k < K; k++) put(out, i * K + k, 0.0f, flags);
            continue;
        }
        for (int64_t g = 0; g < G; g++) {
            float dg = h2f(d[r * G + g]), mg = h2f(mn[r * G + g]);
            const uint8_t *p = w4 + r * (K / 2) + g * 16;
            for (int j = 0; j < 16; j++) {
                put(out, i * K + g * QG_GROUP + j, dg * (float)(p[j] & 0x0F) + mg, flags);
                put(out, i * K + g * QG_GROUP + j + 16, dg * (float)(p[j] >> 4) + mg, flags);
            }
        }
    }
}
