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

/* q4_1 reads x in the order its cheapest unpack yields the codes (qa_rows_q4): per pair of groups
 * (g, g+1), four runs of 16 int16, each 8 values of g then 8 of g+1: values 0,2,..,14; 16,18,..,30;
 * 1,3,..,15; 17,19,..,31 (an odd last group paired with zeros). QA_Q4_LEN(K) values a row. */
#define QA_Q4_PAIRS(K) (((K) / QG_GROUP + 1) / 2)
#define QA_Q4_LEN(K) (QA_Q4_PAIRS(K) * 64)

static void qa_q4_permute(const int16_t *q, int64_t G, int16_t *dst) {
    static const int start[4] = {0, 16, 1, 17};
    for (int64_t p = 0; p < (G + 1) / 2; p++)
        for (int run = 0; run < 4; run++)
            for (int half = 0; half < 2; half++) {
                int64_t g = 2 * p + half;
                int16_t *o = dst + p * 64 + run * 16 + half * 8;
                for (int j = 0; j < 8; j++) o[j] = g < G ? q[g * QG_GROUP + start[run] + 2 * j] : 0;
            }
}

/* The activations as the kernels read them: xs[M] row scales and xq, the rows rounded to int16:
 * q8_0 (q4 = 0) K values a row in order; q4_1 QA_Q4_LEN(K) a row permuted as above (through
 * `tmp`, K int16), plus sums[M][2 * pairs] the plain sum of x over each group of 32 (0 for the
 * padding group), which the group minimum multiplies. bf16 rows are widened into `row` first. */
static void qa_prepare(const void *x, int64_t M, int64_t K, int flags, float *row, int16_t *xq, float *xs,
                       float *sums, int16_t *tmp, int q4) {
    int64_t G = K / QG_GROUP, Gp = 2 * QA_Q4_PAIRS(K);
    for (int64_t i = 0; i < M; i++) {
        const float *xr;
        if (flags & QG_X_BF16) {
            const uint16_t *h = (const uint16_t *)x + i * K;
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) {
                _mm256_storeu_ps(row + k, bf16x8_to_ps(h + k));
            }
            for (; k < K; k++) row[k] = bf16_to_f32(h[k]);
            xr = row;
        } else {
            xr = (const float *)x + i * K;
        }
        if (!q4) {
            quantize_rows(xr, 1, K, K, xq + i * K, xs + i);
            continue;
        }
        quantize_rows(xr, 1, K, K, tmp, xs + i);
        qa_q4_permute(tmp, G, xq + i * QA_Q4_LEN(K));
        for (int64_t g = 0; g < Gp; g++) {
            if (g == G) {
                sums[i * Gp + g] = 0.0f;
                continue;
            }
            const float *p = xr + g * QG_GROUP;
            __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
            sums[i * Gp + g] = hsum256(v);
        }
    }
}

/* dw[0..n) = the fp16 scales h[0..n) as fp32, 8 at a time. */
static inline void qa_widen(const uint16_t *h, int64_t n, float *dw) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dw + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
    for (; j < n; j++) dw[j] = h2f(h[j]);
}

/* The codes of group g of a weight row, widened to int16: lo = values 0..15, hi = values 16..31. */
static inline __attribute__((always_inline)) void qa_codes(const void *wq, int64_t g, int q4, __m256i *lo, __m256i *hi) {
    if (q4) {
        q4_unpack16((const uint8_t *)wq + g * 16, lo, hi);
    } else {
        const int8_t *p = (const int8_t *)wq + g * QG_GROUP;
        *lo = w8x16(p);
        *hi = w8x16(p + 16);
    }
}

/* R rows of x (xq rows K apart) against one weight row: out[r] = sum_g d[g] * dot(codes_g, xq_g)
 * (q4 != 0: q4_1 codes wq, else q8_0 codes), before the row scale and the minimum term. Two
 * groups an iteration into two accumulators per row (even and odd groups: the FMA chain no
 * longer sets the pace), summed at the end; the same order for a row whatever R is. */
static inline __attribute__((always_inline)) void qa_rows(const void *wq, const uint16_t *d, const int16_t *xq,
                                                          int64_t K, int R, int q4, float *out) {
    int64_t G = K / QG_GROUP;
    const int64_t gbytes = q4 ? 16 : QG_GROUP;
    __m256 acc[QA_RC][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    float dw[QA_GC];
    for (int64_t g0 = 0; g0 < G; g0 += QA_GC) {
        int64_t g1 = g0 + QA_GC < G ? g0 + QA_GC : G;
        qa_widen(d + g0, g1 - g0, dw);
        int64_t g = g0;
        for (; g + 2 <= g1; g += 2) {
            _mm_prefetch((const char *)wq + g * gbytes + QG_PREFETCH, _MM_HINT_T0);
            __m256i lo0, hi0, lo1, hi1;
            qa_codes(wq, g, q4, &lo0, &hi0);
            qa_codes(wq, g + 1, q4, &lo1, &hi1);
            __m256 s0 = _mm256_broadcast_ss(dw + (g - g0)), s1 = _mm256_broadcast_ss(dw + (g + 1 - g0));
            for (int r = 0; r < R; r++) {
                const int16_t *xr = xq + r * K + g * QG_GROUP;
                acc[r][0] = _mm256_fmadd_ps(q4_group_dot(lo0, hi0, xr), s0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(q4_group_dot(lo1, hi1, xr + QG_GROUP), s1, acc[r][1]);
            }
        }
        if (g < g1) { /* an odd group left in this run */
            __m256i lo0, hi0;
            qa_codes(wq, g, q4, &lo0, &hi0);
            __m256 s0 = _mm256_broadcast_ss(dw + (g - g0));
            for (int r = 0; r < R; r++)
                acc[r][0] = _mm256_fmadd_ps(q4_group_dot(lo0, hi0, xq + r * K + g * QG_GROUP), s0, acc[r][0]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* Two groups g, g+1 of one pair (32 bytes of codes at wp) into accumulator set `a` with their scales
 * `sc` (lanes 0-3 group g, 4-7 group g+1) already laid out: the codes' int32 dot products with R
 * rows of permuted x. */
static inline __attribute__((always_inline)) void qa_pair_dots(const uint8_t *wp, const int16_t *xq, int64_t len,
                                                               int R, int64_t g, __m256 sc, __m256 acc[][2], int a) {
    const __m256i m4 = _mm256_set1_epi16(0x000F);
    _mm_prefetch((const char *)(wp + QG_PREFETCH), _MM_HINT_T0);
    __m256i v = _mm256_loadu_si256((const __m256i *)wp);
    __m256i e0 = _mm256_and_si256(v, m4), e1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    __m256i e2 = _mm256_and_si256(_mm256_srli_epi16(v, 8), m4), e3 = _mm256_srli_epi16(v, 12);
    for (int r = 0; r < R; r++) {
        const int16_t *xp = xq + r * len + (g >> 1) * 64;
        __m256i t = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(e0, _mm256_loadu_si256((const __m256i *)xp)),
                             _mm256_madd_epi16(e1, _mm256_loadu_si256((const __m256i *)(xp + 16)))),
            _mm256_add_epi32(_mm256_madd_epi16(e2, _mm256_loadu_si256((const __m256i *)(xp + 32))),
                             _mm256_madd_epi16(e3, _mm256_loadu_si256((const __m256i *)(xp + 48)))));
        acc[r][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sc, acc[r][a]);
    }
}

/* One pair of groups (g, g+1; g+1 absent when g is the odd last group) into accumulator set `a`, its
 * own scales and minima widened here: the last 1..7 groups of a row, after the runs of eight. */
static inline __attribute__((always_inline)) void qa_pair_q4(const uint8_t *wq, const uint16_t *d, const uint16_t *mn,
                                                             const int16_t *xq, const float *sums, int64_t G,
                                                             int64_t len, int64_t Gp, int R, int64_t g,
                                                             __m256 acc[][2], __m128 *accm, int a) {
    const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const uint8_t *wp = wq + g * 16;
    uint8_t pad[32];
    __m128i dh, mh;
    if (g + 2 <= G) {
        int32_t d2, m2;
        memcpy(&d2, d + g, 4);
        memcpy(&m2, mn + g, 4);
        dh = _mm_cvtsi32_si128(d2);
        mh = _mm_cvtsi32_si128(m2);
    } else { /* the odd last group; its pair's other half is zero codes, zero x, zero sums */
        memset(pad + 16, 0, 16);
        memcpy(pad, wp, 16);
        wp = pad;
        dh = _mm_cvtsi32_si128(d[g]);
        mh = _mm_cvtsi32_si128(mn[g]);
    }
    qa_pair_dots(wp, xq, len, R, g, _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(dh)), halves), acc, a);
    __m128 mf = _mm_cvtph_ps(mh); /* lanes 0, 1: the pair's minima; 2, 3: zero */
    for (int r = 0; r < R; r++) {
        __m128 s2 = _mm_castpd_ps(_mm_load_sd((const double *)(sums + r * Gp + g)));
        accm[r] = _mm_fmadd_ps(mf, s2, accm[r]);
    }
}

/* q4_1: R rows of permuted x (rows QA_Q4_LEN(K) apart, group sums 2 * pairs apart) against one
 * weight row: out[r] = sum_g d[g] * dot(codes_g, xq_g), mins[r] = sum_g m[g] * sums_g. A pair of
 * groups is one 32-byte load whose 16-bit words give all 64 codes with in-lane shifts and masks
 * (word k = bytes 2k, 2k+1: its nibbles are values 2k, 2k+16, 2k+1, 2k+17 of the group in that
 * lane): widening bytes to words (vpmovzxbw) went through the shuffle unit twice a group and set
 * the pace. Eight groups at a time share one widening of their eight scales and eight minima
 * (one 16-byte load and one vcvtph2ps each; a pair's scale layout is one lane permute), and the
 * minimum term is one 8-lane FMA of the minima with the group sums per row: that shared work was
 * ~40 % of a 1-row call's instructions when it was done per pair. Pairs alternate between two
 * accumulator sets (constant indices, so they stay in registers); a row's order of operations does
 * not depend on R. */
static inline __attribute__((always_inline)) void qa_rows_q4(const uint8_t *wq, const uint16_t *d, const uint16_t *mn,
                                                             const int16_t *xq, const float *sums, int64_t K, int R,
                                                             float *out, float *mins) {
    const int64_t G = K / QG_GROUP, len = QA_Q4_LEN(K), Gp = 2 * QA_Q4_PAIRS(K);
    __m256 acc[QA_RC][2], accm[QA_RC];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = accm[r] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + g)));
        __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + g)));
        for (int r = 0; r < R; r++)
            accm[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sums + r * Gp + g), accm[r]);
        qa_pair_dots(wq + (g) * 16, xq, len, R, g, _mm256_permutevar8x32_ps(d8, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)), acc, 0);
        qa_pair_dots(wq + (g + 2) * 16, xq, len, R, g + 2, _mm256_permutevar8x32_ps(d8, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)), acc, 1);
        qa_pair_dots(wq + (g + 4) * 16, xq, len, R, g + 4, _mm256_permutevar8x32_ps(d8, _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5)), acc, 0);
        qa_pair_dots(wq + (g + 6) * 16, xq, len, R, g + 6, _mm256_permutevar8x32_ps(d8, _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)), acc, 1);
    }
    __m128 accm_tail[QA_RC];
    for (int r = 0; r < R; r++) accm_tail[r] = _mm_setzero_ps();
    for (; g < G; g += 2) qa_pair_q4(wq, d, mn, xq, sums, G, len, Gp, R, g, acc, accm_tail, 0);
    for (int r = 0; r < R; r++) {
        out[r] = hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
        mins[r] = hsum256(accm[r]) + _mm_cvtss_f32(_mm_add_ss(accm_tail[r], _mm_movehdup_ps(accm_tail[r])));
    }
}

/* Weight rows [n0, n1) of y for every row of x, chunk by chunk (q4 a compile-time constant in each
 * of the two instances below, so the group loop has no branch on it). */
static inline __attribute__((always_inline)) void qa_block(const void *w, const uint16_t *d, const uint16_t *mn,
                                                           const float *bias, const int16_t *xq, const float *xs,
                                                           const float *sums, int64_t M, int64_t K, int64_t N,
                                                           void *y, int flags, int64_t n0, int64_t n1, int q4) {
    const int64_t G = K / QG_GROUP, row_bytes = q4 ? K / 2 : K, len = q4 ? QA_Q4_LEN(K) : K;
    const int64_t Gp = 2 * QA_Q4_PAIRS(K);
    for (int64_t m0 = 0; m0 < M; m0 += QA_RC) {
        int R = (int)(M - m0 < QA_RC ? M - m0 : QA_RC);
        const int16_t *xc = xq + m0 * len;
        for (int64_t n = n0; n < n1; n++) {
            const char *wr = (const char *)w + n * row_bytes;
            const uint16_t *dr = d + n * G;
            float out[QA_RC], mins[QA_RC] = {0};
            if (q4) {
                const uint8_t *w4 = (const uint8_t *)wr;
                const uint16_t *mr = mn + n * G;
                const float *sc = sums + m0 * Gp;
                switch (R) { /* constant R: the chunk loop unrolls into registers */
                case 1: qa_rows_q4(w4, dr, mr, xc, sc, K, 1, out, mins); break;
                case 2: qa_rows_q4(w4, dr, mr, xc, sc, K, 2, out, mins); break;
                case 3: qa_rows_q4(w4, dr, mr, xc, sc, K, 3, out, mins); break;
                default: qa_rows_q4(w4, dr, mr, xc, sc, K, 4, out, mins); break;
                }
            } else {
                switch (R) {
                case 1: qa_rows(wr, dr, xc, K, 1, 0, out); break;
                case 2: qa_rows(wr, dr, xc, K, 2, 0, out); break;
                case 3: qa_rows(wr, dr, xc, K, 3, 0, out); break;
                default: qa_rows(wr, dr, xc, K, 4, 0, out); break;
                }
            }
            float bn = bias ? bias[n] : 0.0f;
            for (int r = 0; r < R; r++)
                put(y, (m0 + r) * N + n, out[r] * xs[m0 + r] + mins[r] + bn, flags);
        }
    }
}

static void qa_block_q4(const void *w, const uint16_t *d, const uint16_t *mn, const float *bias, const int16_t *xq,
                        const float *xs, const float *sums, int64_t M, int64_t K, int64_t N, void *y, int flags,
                        int64_t n0, int64_t n1) {
    qa_block(w, d, mn, bias, xq, xs, sums, M, K, N, y, flags, n0, n1, 1);
}

static void qa_block_q8(const void *w, const uint16_t *d, const uint16_t *mn, const float *bias, const int16_t *xq,
                        const float *xs, const float *sums, int64_t M, int64_t K, int64_t N, void *y, int flags,
                        int64_t n0, int64_t n1) {
    qa_block(w, d, mn, bias, xq, xs, sums, M, K, N, y, flags, n0, n1, 0);
}

/* y[M][N] = x @ W^T + bias for a q8_0 (q4 = 0: w = w8) or q4_1 (q4 = 1: w = w4, mn the minima)
 * weight. Returns 0, or -1 when the activation scratch cannot be had. */
static int qa_mm(const void *x, int64_t M, int64_t K, const void *w, const uint16_t *d, const uint16_t *mn,
                 const float *bias, void *y, int64_t N, int nthreads, int flags, int q4) {
    const int64_t len = q4 ? QA_Q4_LEN(K) : K, Gp = q4 ? 2 * QA_Q4_PAIRS(K) : 0;
    size_t xq_bytes = ((size_t)(M * len) * 2 + 63) & ~(size_t)63, tmp_bytes = q4 ? ((size_t)K * 2 + 63) & ~(size_t)63 : 0;
    size_t bytes = xq_bytes + tmp_bytes + sizeof(float) * (size_t)(M + M * Gp + ((flags & QG_X_BF16) ? K : 0) + 16);
    char *buf = (char *)qa_scratch(bytes);
    if (!buf) return -1;
    int16_t *xq = (int16_t *)buf, *tmp = (int16_t *)(buf + xq_bytes);
    float *xs = (float *)(buf + xq_bytes + tmp_bytes), *sums = xs + M, *row = sums + M * Gp;
    qa_prepare(x, M, K, flags, row, xq, xs, sums, tmp, q4);
    int64_t blocks = (N + QA_NB - 1) / QA_NB;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && N * K >= 65536)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * QA_NB, n1 = n0 + QA_NB < N ? n0 + QA_NB : N;
        if (q4)
            qa_block_q4(w, d, mn, bias, xq, xs, sums, M, K, N, y, flags, n0, n1);
        else
            qa_block_q8(w, d, mn, bias, xq, xs, sums, M, K, N, y, flags, n0, n1);
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
