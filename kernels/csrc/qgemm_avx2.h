/* The AVX2 q8_0 / q4_1 matmuls of qgemm.c for 1..FUSED_MAX_M rows (decode), included by qgemm.c
 * in AVX2 builds (not the opt-in AVX-512 one).
 *
 * Why a second form: the first AVX2 kernel ran a decode step's q4_1 linears at ~6 GB/s of weights
 * on one core with hot caches, and 16 rows at 0.4 GB/s (loadtest/PERF.md, ninth session): it
 * allocated three buffers and summed x per group serially on every call, converted each group's
 * fp16 scale on its own, reduced the q4_1 minimum term one group at a time, and for every pair of
 * rows unpacked the whole weight row again. Here:
 *   - the activation scratch (int16 rows, row scales, per-group sums of x) is one buffer per
 *     thread, kept between calls, and filled with vector loops straight from fp32 or bf16;
 *   - a weight row's scales are widened 8 at a time into a stack buffer, its minimum term is an
 *     8-lane dot product of the minima with the group sums;
 *   - rows of x go through in chunks of up to 4 that share each unpacked weight group, and the
 *     weight rows in blocks of QA_NB, so a block's packed weights stay in L1/L2 while every chunk
 *     of x passes over them (16 rows read the weights from memory once).
 * Each (weight row, x row) result is the same sequence of operations whatever M is and whichever
 * chunk the row falls in: a row's output does not depend on the batch (design invariant).
 * Activations are rounded to int16 per row exactly as before (quantize_rows), so the results are
 * those of the first form up to the order of float additions. */
#ifndef PAGEDSERVE_QGEMM_AVX2_H
#define PAGEDSERVE_QGEMM_AVX2_H

#define QA_NB 32    /* weight rows per cache block */
#define QA_RC 4     /* x rows per chunk: each unpacked weight group feeds this many dot products */
#define QA_GC 256   /* groups whose widened scales sit in a stack buffer at a time */
#define QA_KEEP (8u << 20) /* per-thread scratch kept between calls up to this size */

/* One buffer per calling thread for the activation scratch, grown as needed (freed and taken per
 * call above QA_KEEP, so a rare huge call does not pin its memory). NULL on no memory. */
static _Thread_local void *qa_buf;
static _Thread_local size_t qa_cap;

static void *qa_scratch(size_t bytes) {
    if (bytes > QA_KEEP) return malloc(bytes);
    if (bytes > qa_cap) {
        free(qa_buf);
        qa_cap = 0;
        qa_buf = malloc(QA_KEEP < 2 * bytes ? QA_KEEP : 2 * bytes);
        if (!qa_buf) return NULL;
        qa_cap = QA_KEEP < 2 * bytes ? QA_KEEP : 2 * bytes;
    }
    return qa_buf;
}

static void qa_release(void *p) {
    if (p != qa_buf) free(p);
}

/* The activations as the kernels read them: xq[M][K] int16, xs[M] row scales, and (sums != NULL)
 * sums[M][G] the plain sum of x over each group of 32, which q4_1's group minimum multiplies.
 * bf16 rows are widened into `row` (K floats) first. */
static void qa_prepare(const void *x, int64_t M, int64_t K, int flags, float *row, int16_t *xq, float *xs,
                       float *sums) {
    int64_t G = K / QG_GROUP;
    for (int64_t i = 0; i < M; i++) {
        const float *xr;
        if (flags & QG_X_BF16) {
            const uint16_t *h = (const uint16_t *)x + i * K;
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) {
                __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + k)));
                _mm256_storeu_ps(row + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
            }
            for (; k < K; k++) row[k] = bf16_to_f32(h[k]);
            xr = row;
        } else {
            xr = (const float *)x + i * K;
        }
        quantize_rows(xr, 1, K, K, xq + i * K, xs + i);
        if (sums) {
            for (int64_t g = 0; g < G; g++) {
                const float *p = xr + g * QG_GROUP;
                __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                         _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
                sums[i * G + g] = hsum8(s);
            }
        }
    }
}

/* dw[0..n) = the fp16 scales h[0..n) as fp32, 8 at a time. */
static inline void qa_widen(const uint16_t *h, int64_t n, float *dw) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dw + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
    for (; j < n; j++) dw[j] = h2f(h[j]);
}

/* sum_g m[g] * s[g] over G groups (q4_1's minimum term for one weight row and one x row). */
static inline float qa_min_dot(const uint16_t *m, const float *s, int64_t G) {
    __m256 a = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8)
        a = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g))), _mm256_loadu_ps(s + g), a);
    float r = hsum8(a);
    for (; g < G; g++) r += h2f(m[g]) * s[g];
    return r;
}

/* R rows of x (xq rows K apart) against one weight row: out[r] = sum_g d[g] * dot(codes_g, xq_g)
 * (q4 != 0: q4_1 codes wq, else q8_0 codes), before the row scale and the minimum term. */
static inline __attribute__((always_inline)) void qa_rows(const void *wq, const uint16_t *d, const int16_t *xq,
                                                          int64_t K, int R, int q4, int prefetch, float *out) {
    int64_t G = K / QG_GROUP;
    __m256 acc[QA_RC];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    float dw[QA_GC];
    for (int64_t g0 = 0; g0 < G; g0 += QA_GC) {
        int64_t g1 = g0 + QA_GC < G ? g0 + QA_GC : G;
        qa_widen(d + g0, g1 - g0, dw);
        for (int64_t g = g0; g < g1; g++) {
            __m256i lo, hi;
            if (q4) {
                const uint8_t *p = (const uint8_t *)wq + g * 16;
                if (prefetch && !(g & 3)) _mm_prefetch((const char *)(p + QG_PREFETCH), _MM_HINT_T0);
                q4_unpack16(p, &lo, &hi);
            } else {
                const int8_t *p = (const int8_t *)wq + g * QG_GROUP;
                if (prefetch && !(g & 1)) _mm_prefetch((const char *)(p + QG_PREFETCH), _MM_HINT_T0);
                lo = w8x16(p);
                hi = w8x16(p + 16);
            }
            __m256 sc = _mm256_broadcast_ss(dw + (g - g0));
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_ps(q4_group_dot(lo, hi, xq + r * K + g * QG_GROUP), sc, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

/* y[M][N] = x @ W^T + bias for a q8_0 (q4 = 0: w = w8) or q4_1 (q4 = 1: w = w4, mn the minima)
 * weight. Returns 0, or -1 when the activation scratch cannot be had. */
static inline __attribute__((always_inline)) int qa_mm(const void *x, int64_t M, int64_t K, const void *w, const uint16_t *d, const uint16_t *mn,
                 const float *bias, void *y, int64_t N, int nthreads, int flags, int q4) {
    int64_t G = K / QG_GROUP;
    size_t xq_bytes = ((size_t)(M * K) * 2 + 63) & ~(size_t)63;
    size_t bytes = xq_bytes + sizeof(float) * (size_t)(M + (q4 ? M * G : 0) + ((flags & QG_X_BF16) ? K : 0) + 16);
    char *buf = (char *)qa_scratch(bytes);
    if (!buf) return -1;
    int16_t *xq = (int16_t *)buf;
    float *xs = (float *)(buf + xq_bytes), *sums = q4 ? xs + M : NULL, *row = xs + M + (q4 ? M * G : 0);
    qa_prepare(x, M, K, flags, row, xq, xs, sums);
    int64_t row_bytes = q4 ? K / 2 : K;
    int64_t blocks = (N + QA_NB - 1) / QA_NB;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * QA_NB, n1 = n0 + QA_NB < N ? n0 + QA_NB : N;
        for (int64_t m0 = 0; m0 < M; m0 += QA_RC) {
            int R = (int)(M - m0 < QA_RC ? M - m0 : QA_RC);
            const int16_t *xc = xq + m0 * K;
            int prefetch = m0 == 0; /* the first chunk streams the block from memory */
            for (int64_t n = n0; n < n1; n++) {
                const char *wr = (const char *)w + n * row_bytes;
                const uint16_t *dr = d + n * G;
                float out[QA_RC];
                switch (R) { /* constant R: the chunk loop unrolls into registers */
                case 1: qa_rows(wr, dr, xc, K, 1, q4, prefetch, out); break;
                case 2: qa_rows(wr, dr, xc, K, 2, q4, prefetch, out); break;
                case 3: qa_rows(wr, dr, xc, K, 3, q4, prefetch, out); break;
                default: qa_rows(wr, dr, xc, K, 4, q4, prefetch, out); break;
                }
                float bn = bias ? bias[n] : 0.0f;
                for (int r = 0; r < R; r++) {
                    int64_t i = m0 + r;
                    float v = out[r] * xs[i] + bn;
                    if (q4) v += qa_min_dot(mn + n * G, sums + i * G, G);
                    put(y, i * N + n, v, flags);
                }
            }
        }
    }
    qa_release(buf);
    return 0;
}


static int qa_mm_q8(const void *x, int64_t M, int64_t K, const int8_t *w8, const uint16_t *d, const float *bias,
                    void *y, int64_t N, int nthreads, int flags) {
    return qa_mm(x, M, K, w8, d, NULL, bias, y, N, nthreads, flags, 0);
}

static int qa_mm_q4(const void *x, int64_t M, int64_t K, const uint8_t *w4, const uint16_t *d, const uint16_t *mn,
                    const float *bias, void *y, int64_t N, int nthreads, int flags) {
    return qa_mm(x, M, K, w4, d, mn, bias, y, N, nthreads, flags, 1);
}

#endif
