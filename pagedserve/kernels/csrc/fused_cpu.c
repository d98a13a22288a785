/* Fused CPU ops for small-batch decode: each replaces 3-8 eager torch ops (one allocation and
 * one dispatch each, ~5-40 us apiece at batch 1) with one pass over a few KB.
 *
 *   fz_add_rms_norm    residual += x; x = rms_norm(residual) * w      (in place, both)
 *   fz_rms_norm        out = rms_norm(x) * w
 *   fz_rotary_neox     q/k heads rotated in place, cos/sin read from the fp32 table by position
 *   fz_write_kv        new K/V rows copied into the paged caches at their slots (torch's
 *                      index_copy_ opened an OpenMP region per call: ~3 ms of a 16-row step)
 *   fz_gemv_bf16       y = x @ W^T for M <= 16 rows, bf16 in/out, fp32 accumulation
 *                      (AVX512-BF16 only: torch's bf16 GEMV reads weights at about half the
 *                      rate of its fp32 one on these CPUs; see loadtest/PERF.md)
 *
 * Element types: dtype 0 = fp32, 1 = bf16 (stored as uint16, rounded to nearest even like torch).
 * Arithmetic is fp32. The build is compiled with -ffp-contract=off so that a*b - c*d rounds the
 * way the eager torch ops it replaces do (fp32 greedy outputs are tested against transformers).
 * Vector width comes from the compiler flags (AVX-512 or AVX2 auto-vectorisation of the
 * `omp simd` loops); the portable build has the same results up to summation order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "exports.h"
#include "fp8.h"
#include "fused_lora.h"
#include "silu.h"
#include "simd.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define FZ_BF16_GEMV 1
#else
#define FZ_BF16_GEMV 0
#endif

/* 2 = AVX512-BF16 GEMV available, 1 = vectorised elementwise only, 0 = portable */
int fz_isa(void) {
#if FZ_BF16_GEMV
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

#define FZ_MAXH 16384 /* hidden sizes up to this use a stack row buffer */
#define FZ_CHUNK_F32 64 /* weight rows per work item of the fp32 GEMV */

static inline void load_row(const void *src, int dtype, int64_t n, float *dst) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)n * 4);
    } else {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

static inline void store_row(void *dst, int dtype, int64_t n, const float *src) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)n * 4);
    } else {
        uint16_t *d = (uint16_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    }
}

/* One row: out = v * rsqrt(mean(v^2) + eps) * w, in the order torch's rms_norm rounds
 * (normalise, round to the input dtype for bf16, then scale by the weight). */
static inline void norm_row(const float *v, const float *w, int64_t H, float eps, int dtype, void *out) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; i++) ss += v[i] * v[i];
    float r = 1.0f / sqrtf(ss / (float)H + eps);
    float buf[FZ_MAXH];
#pragma omp simd
    for (int64_t i = 0; i < H; i++) buf[i] = v[i] * r * w[i];
    store_row(out, dtype, H, buf);
}

/* residual[M][H] += x[M][H]; x = rms_norm(residual) * w. w is fp32 [H]. Rows are contiguous. */
int fz_add_rms_norm(void *x, void *residual, const float *w, int64_t M, int64_t H, float eps, int dtype) {
    if (H > FZ_MAXH) return -1;
    size_t es = dtype == 0 ? 4 : 2;
    float a[FZ_MAXH], b[FZ_MAXH];
    for (int64_t m = 0; m < M; m++) {
        char *xr = (char *)x + (size_t)m * H * es, *rr = (char *)residual + (size_t)m * H * es;
        load_row(xr, dtype, H, a);
        load_row(rr, dtype, H, b);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) a[i] += b[i];
        store_row(rr, dtype, H, a);
        if (dtype) load_row(rr, dtype, H, a); /* normalise the sum as stored (rounded to bf16) */
        norm_row(a, w, H, eps, dtype, xr);
    }
    return 0;
}

/* out[M][H] = rms_norm(x[M][H]) * w; x rows are `x_stride` elements apart. */
int fz_rms_norm(const void *x, int64_t x_stride, const float *w, void *out, int64_t M, int64_t H, float eps,
                int dtype) {
    if (H > FZ_MAXH) return -1;
    size_t es = dtype == 0 ? 4 : 2;
    float a[FZ_MAXH];
    for (int64_t m = 0; m < M; m++) {
        load_row((const char *)x + (size_t)m * x_stride * es, dtype, H, a);
        norm_row(a, w, H, eps, dtype, (char *)out + (size_t)m * H * es);
    }
    return 0;
}

/* Copy row t of k and of v (row_elems values of src_dtype each, rows src_stride bytes apart) to
 * row slots[t] of k_cache / v_cache: as they are (cache_kind FZ_KV_SAME), encoded to fp8 e4m3
 * (FZ_KV_FP8, fp8.h), or rounded from fp32 to bf16 (FZ_KV_BF16: a bf16 cache under fp32
 * activations); a negative slot skips the row. Returns the number of slots past num_slots (nothing
 * is written for them: the caller raises). */
int64_t fz_write_kv(const char *k, const char *v, int64_t src_stride, char *k_cache, char *v_cache,
                    const int64_t *slots, int64_t T, int64_t row_elems, int64_t num_slots, int src_dtype,
                    int cache_kind) {
    if (cache_kind == FZ_KV_BF16 && src_dtype == 1) cache_kind = FZ_KV_SAME; /* bf16 rows: already the cache's */
    const int64_t es = src_dtype == 1 ? 2 : 4;
    const int64_t row_bytes = cache_kind == FZ_KV_FP8 ? row_elems : cache_kind == FZ_KV_BF16 ? row_elems * 2 : row_elems * es;
    int64_t bad = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slots[t];
        if (slot < 0)
            continue;
        if (slot >= num_slots) {
            bad++;
            continue;
        }
        if (cache_kind == FZ_KV_FP8) {
            fp8_encode_row(k + t * src_stride, src_dtype == 1, row_elems, (uint8_t *)k_cache + slot * row_bytes);
            fp8_encode_row(v + t * src_stride, src_dtype == 1, row_elems, (uint8_t *)v_cache + slot * row_bytes);
        } else if (cache_kind == FZ_KV_BF16) {
            store_row(k_cache + slot * row_bytes, 1, row_elems, (const float *)(k + t * src_stride));
            store_row(v_cache + slot * row_bytes, 1, row_elems, (const float *)(v + t * src_stride));
        } else {
            memcpy(k_cache + slot * row_bytes, k + t * src_stride, (size_t)row_bytes);
            memcpy(v_cache + slot * row_bytes, v + t * src_stride, (size_t)row_bytes);
        }
    }
    return bad;
}

/* Rotate heads in place (neox layout: element i pairs with i + rot/2 within the first `rot`
 * elements of each head). x: T rows `row_stride` elements apart, each holding `heads` heads of
 * `head_dim` elements back to back. cs: fp32 table [P][rot] (cos half, then sin half). */
void fz_rotary_neox(void *x, int64_t T, int64_t row_stride, int64_t heads, int64_t head_dim, int64_t rot,
                    const float *cs, const int64_t *positions, int dtype) {
    int64_t half = rot / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cs + positions[t] * rot, *s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            int64_t off = t * row_stride + h * head_dim;
            if (dtype == 0) {
                float *x1 = (float *)x + off, *x2 = x1 + half;
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    float a = x1[i], b = x2[i];
                    float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
                    x1[i] = ac - bs;
                    x2[i] = bc + as;
                }
            } else {
                uint16_t *x1 = (uint16_t *)x + off, *x2 = x1 + half;
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
                    float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
                    x1[i] = f32_to_bf16(ac - bs);
                    x2[i] = f32_to_bf16(bc + as);
                }
            }
        }
    }
}

#if FZ_BF16_GEMV
/* rows n0..n1 of y[M][N] = x[M][K] @ W[N][K]^T, M <= 16. FZ_ROWS weight rows at a time share
 * each activation load; K is walked in 32-element (64-byte) steps, the tail masked. */
#ifndef FZ_ROWS
#define FZ_ROWS 4
#endif
#ifndef FZ_CHUNK
#define FZ_CHUNK 16 /* rows of W per work item: each thread one contiguous run of near-equal length (64-row items left o_proj and down_proj, 9 items, split 5/4: the 121 GEMVs of a token 8.72 -> 8.66 ms, 8.88 -> 8.68) */
#endif
#ifndef FZ_PREFETCH
#define FZ_PREFETCH 12288 /* bytes ahead; 4 rows + 12 KiB measured best of 2/4/8 rows, 2-16 KiB (PERF.md) */
#endif
static void gemv_rows(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, int64_t N, uint16_t *y,
                      int64_t n0, int64_t n1) {
    int64_t kfull = K & ~(int64_t)31;
    __mmask32 tail = (__mmask32)((1ull << (K - kfull)) - 1);
    int64_t n = n0;
    for (; n + FZ_ROWS <= n1; n += FZ_ROWS) {
        const uint16_t *w0 = W + n * K;
        __m512 acc[16][FZ_ROWS];
        for (int64_t m = 0; m < M; m++)
            for (int r = 0; r < FZ_ROWS; r++) acc[m][r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < kfull; k += 32) {
            __m512bh wv[FZ_ROWS];
            for (int r = 0; r < FZ_ROWS; r++) {
                _mm_prefetch((const char *)(w0 + r * K + k) + FZ_PREFETCH, _MM_HINT_T0);
                wv[r] = (__m512bh)_mm512_loadu_si512(w0 + r * K + k);
            }
            for (int64_t m = 0; m < M; m++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
                for (int r = 0; r < FZ_ROWS; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
            }
        }
        if (tail) {
            __m512bh wv[FZ_ROWS];
            for (int r = 0; r < FZ_ROWS; r++) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w0 + r * K + kfull);
            for (int64_t m = 0; m < M; m++) {
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + kfull);
                for (int r = 0; r < FZ_ROWS; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
            }
        }
        for (int64_t m = 0; m < M; m++)
            for (int r = 0; r < FZ_ROWS; r++) y[m * N + n + r] = f32_to_bf16(_mm512_reduce_add_ps(acc[m][r]));
    }
    for (; n < n1; n++) {
        const uint16_t *w0 = W + n * K;
        for (int64_t m = 0; m < M; m++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t k = 0; k < kfull; k += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w0 + k),
                                       (__m512bh)_mm512_loadu_si512(x + m * K + k));
            if (tail)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, w0 + kfull),
                                       (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + kfull));
            y[m * N + n] = f32_to_bf16(_mm512_reduce_add_ps(acc));
        }
    }
}
#endif

/* y[M][N] (bf16) = x[M][K] (bf16) @ W[N][K]^T (bf16). Returns -1 when this build lacks the
 * AVX512-BF16 path or M > 16 (the caller then uses torch). Rows of W split over threads in
 * 64-row chunks. */
int fz_gemv_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, int64_t N, uint16_t *y,
                 int nthreads) {
#if FZ_BF16_GEMV
    if (M < 1 || M > 16) return -1;
    int64_t chunks = (N + FZ_CHUNK - 1) / FZ_CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n0 = c * FZ_CHUNK, n1 = n0 + FZ_CHUNK < N ? n0 + FZ_CHUNK : N;
        gemv_rows(x, M, K, W, N, y, n0, n1);
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)W; (void)N; (void)y; (void)nthreads;
    return -1;
#endif
}

/* y[M][N] = x[M][K] @ W[N][K]^T in fp32, for the few rows of an fp32 decode step: one weight row at a
 * time, read front to back (a single stream the hardware prefetcher follows: four rows interleaved
 * read memory at ~60 % of torch's GEMV on this AVX2 box), two activation rows against each weight
 * load, two accumulators per activation row (16 floats a step), fp32 FMA. The fp32 counterpart of
 * fz_gemv_bf16: the step's weights are read once from memory, and again from L1/L2 for each further
 * pair of rows. Rows of W split over threads in FZ_CHUNK_F32 runs. */
#if defined(__AVX2__) && defined(__FMA__)
/* weight row n against x rows m .. m+MR (MR 1 or 2) */
static inline __attribute__((always_inline)) void gemv_f32_row(const float *x, int64_t K, const float *W, int64_t N,
                                                               float *y, int64_t n, int64_t m, int MR) {
    const float *wr = W + n * K;
    __m256 acc[2][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + 8);
        for (int i = 0; i < MR; i++) {
            const float *xr = x + (m + i) * K + k;
            acc[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[i][1]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 w0 = _mm256_loadu_ps(wr + k);
        for (int i = 0; i < MR; i++) acc[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (m + i) * K + k), acc[i][0]);
    }
    for (int i = 0; i < MR; i++) {
        float s = hsum256(_mm256_add_ps(acc[i][0], acc[i][1]));
        for (int64_t kk = k; kk < K; kk++) s += x[(m + i) * K + kk] * wr[kk];
        y[(m + i) * N + n] = s;
    }
}
#endif

int fz_gemv_f32(const float *x, int64_t M, int64_t K, const float *W, int64_t N, float *y, int nthreads) {
    if (M < 1 || M > 16) return -1;
    if (nthreads < 1) nthreads = 1;
    int64_t chunks = (N + FZ_CHUNK_F32 - 1) / FZ_CHUNK_F32;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t n0 = c * FZ_CHUNK_F32, n1 = n0 + FZ_CHUNK_F32 < N ? n0 + FZ_CHUNK_F32 : N;
#if defined(__AVX2__) && defined(__FMA__)
        for (int64_t m = 0; m < M; m += 2)
            for (int64_t n = n0; n < n1; n++) {
                if (m + 1 < M) gemv_f32_row(x, K, W, N, y, n, m, 2);
                else gemv_f32_row(x, K, W, N, y, n, m, 1);
            }
#else
        for (int64_t n = n0; n < n1; n++)
            for (int64_t m = 0; m < M; m++) {
                float s = 0.f;
                for (int64_t k = 0; k < K; k++) s += x[m * K + k] * W[n * K + k];
                y[m * N + n] = s;
            }
#endif
    }
    return 0;
}

/* ---- one decoder layer around attention, for a few bf16 rows (AVX512-BF16 builds) ----------
 * A batch-1 decode step spent ~4 ms of ~20 in the Python and torch glue between the C calls of
 * its 30 layers (loadtest/PERF.md); these two calls do a Llama layer's work before and after
 * attention with the same C pieces the eager path calls one by one (so the same roundings). */
#if FZ_BF16_GEMV
static inline void store16_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

/* a[M][I] = silu(h[:, :I]) * h[:, I:], rounded to bf16 after the silu and after the product
 * as torch's F.silu(gate).mul_(up) rounds them. */
static void silu_mul_bf16(const uint16_t *h, int64_t M, int64_t I, uint16_t *a) {
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = h + m * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i += 16) {
            __mmask16 k = I - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (I - i)) - 1);
            __m512 gv = bf16x16_maskz_to_ps(k, g + i);
            __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            s = bf16w16_to_ps((__m256i)_mm512_cvtneps_pbh(s));
            store16_bf16(a + m * I + i, _mm512_mul_ps(s, bf16x16_maskz_to_ps(k, u + i)), k);
        }
    }
}
#endif

/* a[M][I] = silu(h[:, :I]) * h[:, I:] for the eager layer's large batches (prefill), rows split
 * over the threads; -1 when this build has no AVX512-BF16 path. */
int fz_silu_mul_bf16(const uint16_t *h, int64_t M, int64_t I, uint16_t *a, int nthreads) {
#if FZ_BF16_GEMV
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && M * I >= 65536)
    for (int64_t m = 0; m < M; m++) silu_mul_bf16(h + m * 2 * I, 1, I, a + m * I);
    return 0;
#else
    (void)h; (void)M; (void)I; (void)a; (void)nthreads;
    return -1;
#endif
}

/* a[M][I] = silu(h[:, :I]) * h[:, I:] in fp32 for the eager layer too (every batch size), rows split
 * over the threads: the fused layer and the eager one then give a row the same bits, whichever
 * path its step takes. */
int fz_silu_mul_f32(const float *h, int64_t M, int64_t I, float *a, int nthreads) {
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && M * I >= 65536)
    for (int64_t m = 0; m < M; m++) silu_mul_f32(h + m * 2 * I, 1, I, a + m * I);
    return 0;
}

/* One linear layer of the fused layer: plain bf16 rows (kind 0, read by fz_gemv_bf16) or packed
 * q8_0 / q4_1 weights (kinds 1, 2) in the 16-channel layout, run by the quantized kernel whose
 * address the caller passes (csrc/qgemm_n16.c VNNI, csrc/qgemm_amx.c AMX): both libraries keep
 * their own builds and flags, and this file never links them. Layout shared with kernels/fused.py. */
typedef int (*fz_q8_fn)(const void *, int64_t, int64_t, const void *, const void *, const float *, void *,
                        int64_t, int, int);
typedef int (*fz_q4_fn)(const void *, int64_t, int64_t, const void *, const void *, const void *,
                        const float *, void *, int64_t, int, int);
/* (fz_linear: csrc/exports.h) */

#define FZ_KERNEL_FAILED (-3) /* the quantized kernel could not allocate its activation scratch */

/* y[M][N] = x[M][K] @ W^T, activations in and out in `dtype` (0 fp32, 1 bf16). Plain rows (kind 0)
 * are weights of the activations' dtype: bf16 on AVX512-BF16 builds only (-1 elsewhere: the
 * binder never hands them over), fp32 anywhere. */
static int linear_base(const fz_linear *L, const void *x, int64_t M, int64_t K, int64_t N, void *y, int nthreads,
                       int dtype) {
    if (L->kind == 0)
        return dtype == 1 ? fz_gemv_bf16((const uint16_t *)x, M, K, (const uint16_t *)L->w, N, (uint16_t *)y, nthreads)
                          : fz_gemv_f32((const float *)x, M, K, (const float *)L->w, N, (float *)y, nthreads);
    void *fn = L->big != NULL && L->big_rows > 0 && M >= L->big_rows ? L->big : L->small;
    const int flags = dtype == 1 ? 3 : 0; /* the kernels' X_BF16 | Y_BF16, or fp32 in and out */
    int rc = L->kind == 1 ? ((fz_q8_fn)fn)(x, M, K, L->w, L->d, NULL, y, N, nthreads, flags)
                          : ((fz_q4_fn)fn)(x, M, K, L->w, L->d, L->mn, NULL, y, N, nthreads, flags);
    return rc ? FZ_KERNEL_FAILED : 0;
}

/* The base linear, then the LoRA delta of the rows that name an adapter slot in lora_rows
 * (csrc/fused_lora.h; NULL lora_rows or a linear without LoRA slots: the base alone). */
static int linear_run(const fz_linear *L, const void *x, int64_t M, int64_t K, int64_t N, void *y, int nthreads,
                      int dtype, const int32_t *lora_rows) {
    int rc = linear_base(L, x, M, K, N, y, nthreads, dtype);
    return rc ? rc : lora_add(L, x, M, K, N, y, lora_rows, nthreads, dtype);
}

/* The LoRA delta alone, y[M][N] += x[M][K]'s adapter rows' deltas: for the steps the fused layer does
 * not run (prefill chunks through the per-linear path, gpu/models/lora_layers.py), so every CPU step
 * adds a row's delta with the same arithmetic, and a slot's weights are read once per four rows
 * instead of every slot's over every row (the torch form). 0, or FZ_KERNEL_FAILED (no memory). */
int fz_lora_add(const fz_linear *L, const void *x, int64_t M, int64_t K, int64_t N, void *y, const int32_t *rows,
                int nthreads, int dtype) {
    return lora_add(L, x, M, K, N, y, rows, nthreads, dtype);
}

/* Before attention: [residual += x;] x = rms_norm(residual) * w_norm (without a residual yet:
 * residual = x first); qkv = x @ w_qkv^T; [each q head and k head rms-normed by w_qn / w_kn with
 * eps_qk (Qwen3; NULL: none);] the q and k heads rotated; k and v written into the caches at slots
 * as fz_write_kv writes them for kv_kind (FZ_KV_SAME, FZ_KV_FP8, FZ_KV_BF16). Activations in `dtype` (0 fp32, 1 bf16). lora_rows (NULL: none):
 * each row's adapter slot (-1: none); the qkv delta lands before the norms and rotary. 0 on
 * success, -1 when this build cannot run that dtype's linears, -2 for a slot past the cache, -3
 * when a quantized kernel had no memory. */
int fz_attn_in(void *x, void *residual, int has_residual, const float *w_norm, float eps,
               int64_t M, int64_t H, const fz_linear *w_qkv, int64_t n_qkv, void *qkv,
               int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t rot, const float *w_qn,
               const float *w_kn, float eps_qk, const float *cs,
               const int64_t *positions, void *k_cache, void *v_cache, const int64_t *slots,
               int64_t num_slots, int kv_kind, int nthreads, int dtype, const int32_t *lora_rows) {
    const size_t es = dtype == 1 ? 2 : 4;
    if (has_residual) {
        if (fz_add_rms_norm(x, residual, w_norm, M, H, eps, dtype)) return -1;
    } else {
        memcpy(residual, x, (size_t)(M * H) * es);
        if (fz_rms_norm(residual, H, w_norm, x, M, H, eps, dtype)) return -1;
    }
    int rc = linear_run(w_qkv, x, M, H, n_qkv, qkv, nthreads, dtype, lora_rows);
    if (rc) return rc;
    if (w_qn != NULL) /* Qwen3: every q head and k head RMS-normed (in place) before the rotation */
        for (int64_t m = 0; m < M; m++) {
            char *q = (char *)qkv + (size_t)(m * n_qkv) * es, *k = q + (size_t)(q_heads * head_dim) * es;
            if (fz_rms_norm(q, head_dim, w_qn, q, q_heads, head_dim, eps_qk, dtype) ||
                fz_rms_norm(k, head_dim, w_kn, k, kv_heads, head_dim, eps_qk, dtype))
                return -1;
        }
    fz_rotary_neox(qkv, M, n_qkv, q_heads + kv_heads, head_dim, rot, cs, positions, dtype);
    int64_t kv = kv_heads * head_dim;
    const char *k = (const char *)qkv + (size_t)(q_heads * head_dim) * es, *v = k + (size_t)kv * es;
    if (kv_kind == FZ_KV_BF16 && dtype != 0) return -1; /* bf16 caches are written from fp32 rows only */
    if (fz_write_kv(k, v, n_qkv * (int64_t)es, (char *)k_cache, (char *)v_cache, slots, M, kv, num_slots, dtype,
                    kv_kind))
        return -2;
    return 0;
}

/* After attention, for a layer whose feed-forward is not the gated MLP (a MoE block, run next by
 * the caller): y = attn @ w_o^T (+ each row's LoRA delta, lora_rows as fz_attn_in); residual += y;
 * y = rms_norm(residual) * w_norm. */
int fz_attn_out(const void *attn, int64_t A, const fz_linear *w_o, void *y, void *residual, const float *w_norm,
                float eps, int64_t M, int64_t H, int nthreads, int dtype, const int32_t *lora_rows) {
    int rc = linear_run(w_o, attn, M, A, H, y, nthreads, dtype, lora_rows);
    if (rc) return rc;
    return fz_add_rms_norm(y, residual, w_norm, M, H, eps, dtype) ? -1 : 0;
}

/* After attention: y = attn @ w_o^T; residual += y; y = rms_norm(residual) * w_norm;
 * h = y @ w_gu^T; a = silu(gate) * up; out = a @ w_down^T. y [M][H], h [M][2I], a [M][I] are
 * scratch, all in `dtype`. lora_rows as fz_attn_in (deltas after o, gate/up and down). 0 on success,
 * -1 when this build cannot run that dtype, -3 as fz_attn_in. */
int fz_mlp_out(const void *attn, int64_t A, const fz_linear *w_o, void *y, void *residual,
               const float *w_norm, float eps, int64_t M, int64_t H, const fz_linear *w_gu, int64_t I,
               void *h, void *a, const fz_linear *w_down, void *out, int nthreads, int dtype,
               const int32_t *lora_rows) {
#if !FZ_BF16_GEMV
    if (dtype == 1) return -1; /* the bf16 SiLU is AVX512-BF16 code */
#endif
    int rc = linear_run(w_o, attn, M, A, H, y, nthreads, dtype, lora_rows);
    if (rc) return rc;
    if (fz_add_rms_norm(y, residual, w_norm, M, H, eps, dtype)) return -1;
    if ((rc = linear_run(w_gu, y, M, H, 2 * I, h, nthreads, dtype, lora_rows))) return rc;
#if FZ_BF16_GEMV
    if (dtype == 1)
        silu_mul_bf16((const uint16_t *)h, M, I, (uint16_t *)a);
    else
#endif
        silu_mul_f32((const float *)h, M, I, (float *)a);
    return linear_run(w_down, a, M, I, H, out, nthreads, dtype, lora_rows);
}

/* The decode attention kernels' entry point (csrc/paged_attn.c pa_decode, csrc/paged_attn_amx.c
 * pam_decode: same arguments), called by address like the quantized kernels. */
typedef int (*fz_attn_fn)(const void *, int64_t, const void *, const void *, const int32_t *, int64_t,
                          const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float, void *, int64_t, int,
                          int64_t, int);

/* fz_layer, one decoder layer's weights and caches as fz_decode_stack reads them: csrc/exports.h. */

#define FZ_ATTN_FAILED (-4) /* the attention kernel rejected its arguments or had no memory */

/* A decode-only step through L layers in one call: per layer fz_attn_in, the decode attention
 * kernel (one query row per request, q read in place from qkv), fz_mlp_out. Removes the Python
 * between the layers' calls (~45 us a layer) and the attention dispatch (~35 us a layer) of the
 * per-layer path; the arithmetic is the same calls in the same order. x [M][H] is clobbered;
 * the last layer's output lands in out [M][H], the residual stream in residual [M][H]. Scratch:
 * qkv [M][n_qkv], att [M][q_heads*head_dim], y [M][H], h [M][2I], a [M][I]. attn_dtype: the
 * attention kernel's dtype argument (bit 0: bf16 activations; 2: fp8 caches, 4: bf16 caches under
 * fp32 activations, which fz_attn_in then writes in that form). lora_rows: each row's adapter slot or -1 (NULL: no LoRA), passed to every layer's calls.
 * 0 on success, else fz_attn_in / fz_mlp_out's codes or FZ_ATTN_FAILED. */
int fz_decode_stack(const fz_layer *layers, int64_t L, void *x, void *residual, int has_residual,
                    void *out, int64_t M, int64_t H, int64_t n_qkv, int64_t q_heads, int64_t kv_heads,
                    int64_t head_dim, int64_t rot, int64_t I, const float *cs, const int64_t *positions,
                    const int64_t *slots, int64_t num_slots, void *attn, const int32_t *tables,
                    int64_t tables_stride, const int32_t *seq_lens, int64_t block_size, float scale,
                    int64_t part, int attn_threads, int attn_dtype, void *qkv, void *att, void *y,
                    void *h, void *a, int nthreads, const int32_t *lora_rows) {
    const int dtype = attn_dtype & 1; /* activations: 0 fp32, 1 bf16 (bit 1: fp8 caches) */
    int64_t A = q_heads * head_dim;
    void *cur = x, *next = out;
    for (int64_t l = 0; l < L; l++) {
        const fz_layer *ly = &layers[l];
        int rc = fz_attn_in(cur, residual, has_residual || l > 0, ly->w_in_norm, ly->eps_in, M, H, ly->qkv, n_qkv,
                            qkv, q_heads, kv_heads, head_dim, rot, NULL, NULL, 0.0f, cs, positions, ly->k_cache,
                            ly->v_cache, slots, num_slots,
                            attn_dtype & 2 ? FZ_KV_FP8 : attn_dtype & 4 ? FZ_KV_BF16 : FZ_KV_SAME, nthreads, dtype,
                            lora_rows);
        if (rc) return rc;
        if (((fz_attn_fn)attn)(qkv, n_qkv, ly->k_cache, ly->v_cache, tables, tables_stride, seq_lens, M, q_heads,
                               kv_heads, head_dim, block_size, scale, att, A, attn_dtype, part, attn_threads))
            return FZ_ATTN_FAILED;
        rc = fz_mlp_out(att, A, ly->o, y, residual, ly->w_post_norm, ly->eps_post, M, H, ly->gu, I, h, a,
                        ly->down, next, nthreads, dtype, lora_rows);
        if (rc) return rc;
        void *t = cur; cur = next; next = t;
    }
    if (cur != out) memcpy(out, cur, (size_t)(M * H) * (dtype == 1 ? 2 : 4));
    return 0;
}
