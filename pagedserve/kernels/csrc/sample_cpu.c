/* Token choice for plain rows, one pass (or two) over the logits in their own dtype: no fp32 copy,
 * no [rows, vocab] temporaries (kernels/sample_cpu.py; gpu/sampler.py decides which rows are plain).
 *
 * Why: the general path (fp32 copy, divide by the temperature, finiteness amax, softmax, chunk sums,
 * float64 cumsums, searchsorted) makes ~8 passes over a [rows, 49k] fp32 tensor: 2.3 ms of a 64-row
 * decode step of the default model, 0.6 s of the offline workload W1 (loadtest/PERF.md, eighth
 * session). Here each row is read twice (its maximum, then its weights) and one 256-token chunk a
 * third time.
 *
 * Both take fp32 or bf16 (dtype 0 / 1) logits, rows `row_stride` elements apart, and the row
 * indices to serve (`ids`, or NULL for rows 0 .. n-1). A row holding a NaN, or whose largest value
 * is +inf or -inf, is declined (out = -1): the caller's general path repairs such rows.
 * Built with AVX-512 F/BW/VL or with AVX2+FMA (kernels/sample_cpu.py); elsewhere the caller's torch
 * path runs.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "exports.h"
#include "simd.h"

/* The vector layer: SP_W lanes of fp32 (16 with AVX-512 F/BW/VL, 8 with AVX2+FMA), loads of up
 * to SP_W values from fp32 or bf16 rows with the lanes past the row masked off. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SP_W 16
typedef __m512 vf;
typedef __mmask16 vmask;

static inline vmask tail_mask(int64_t left) { return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u); }

static inline vf load_v(const void *row, int dtype, int64_t j, vmask m) {
    if (dtype == 1)
        return bf16x16_maskz_to_ps(m, (const uint16_t *)row + j);
    return _mm512_maskz_loadu_ps(m, (const float *)row + j);
}

static inline float hsum_v(vf v) { return _mm512_reduce_add_ps(v); }

/* The row's largest value and first index of it; *nan set when the row holds a NaN. */
static float row_max(const void *row, int dtype, int64_t cols, int64_t *arg, int *nan) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i bidx = _mm512_setzero_si512(), idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __mmask16 un = 0;
    for (int64_t j = 0; j < cols; j += 16) {
        __mmask16 k = tail_mask(cols - j);
        __m512 x = load_v(row, dtype, j, k);
        un |= _mm512_mask_cmp_ps_mask(k, x, x, _CMP_UNORD_Q);
        __mmask16 gt = _mm512_mask_cmp_ps_mask(k, x, best, _CMP_GT_OQ); /* strict: a lane keeps its first max */
        best = _mm512_mask_mov_ps(best, gt, x);
        bidx = _mm512_mask_mov_epi32(bidx, gt, idx);
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
    }
    float m = _mm512_reduce_max_ps(best);
    __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
    *arg = m == -INFINITY ? 0 : _mm512_mask_reduce_min_epi32(at_max, bidx);
    *nan = un != 0;
    return m;
}

/* w_j = e^((x_j - m) / T) for the lanes at j; 0 outside the row and below e^-87 (exp512_nonpos clamps
 * there; a -inf logit must weigh exactly 0) */
static inline vf weights_v(const void *row, int dtype, int64_t j, int64_t cols, vf mv, vf inv_t) {
    __mmask16 k = tail_mask(cols - j);
    __m512 a = _mm512_mul_ps(_mm512_sub_ps(load_v(row, dtype, j, k), mv), inv_t);
    k = _mm512_mask_cmp_ps_mask(k, a, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(k, exp512_nonpos(a));
}

#define set1_v _mm512_set1_ps
#define setzero_v _mm512_setzero_ps
#define add_v _mm512_add_ps
#define store_v _mm512_store_ps
#else /* AVX2 + FMA */
#define SP_W 8
typedef __m256 vf;
typedef __m256i vmask;

static inline vmask tail_mask(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left >= 8 ? 8 : (int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline vf load_v(const void *row, int dtype, int64_t j, vmask m) {
    if (dtype == 1) {
        uint16_t h[8] = {0};
        int n = __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(m))); /* lanes in the row */
        memcpy(h, (const uint16_t *)row + j, (size_t)n * 2);
        return bf16x8_to_ps(h);
    }
    return _mm256_maskload_ps((const float *)row + j, m); /* masked-off lanes read as 0, touch no memory */
}

static inline float hsum_v(vf v) { return hsum256(v); }

/* The row's largest value and first index of it; *nan set when the row holds a NaN. */
static float row_max(const void *row, int dtype, int64_t cols, int64_t *arg, int *nan) {
    __m256 best = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    __m256i bidx = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t j = 0; j < cols; j += 8) {
        __m256i k = tail_mask(cols - j);
        __m256 x = load_v(row, dtype, j, k);
        __m256 valid = _mm256_castsi256_ps(k);
        un = _mm256_or_ps(un, _mm256_and_ps(valid, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
        __m256 gt = _mm256_and_ps(valid, _mm256_cmp_ps(x, best, _CMP_GT_OQ)); /* strict: a lane keeps its first max */
        best = _mm256_blendv_ps(best, x, gt);
        bidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bidx), _mm256_castsi256_ps(idx), gt));
        idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
    }
    float lanes[8];
    int32_t lidx[8];
    _mm256_storeu_ps(lanes, best);
    _mm256_storeu_si256((__m256i *)lidx, bidx);
    float m = lanes[0];
    for (int l = 1; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    int64_t a = INT64_MAX;
    for (int l = 0; l < 8; l++)
        if (lanes[l] == m && lidx[l] < a) a = lidx[l];
    *arg = m == -INFINITY ? 0 : a;
    *nan = _mm256_movemask_ps(un) != 0;
    return m;
}

/* w_j = e^((x_j - m) / T) for the lanes at j; 0 outside the row and below e^-87 (exp256 clamps
 * there; a -inf logit must weigh exactly 0) */
static inline vf weights_v(const void *row, int dtype, int64_t j, int64_t cols, vf mv, vf inv_t) {
    __m256i k = tail_mask(cols - j);
    __m256 a = _mm256_mul_ps(_mm256_sub_ps(load_v(row, dtype, j, k), mv), inv_t);
    __m256 keep = _mm256_and_ps(_mm256_castsi256_ps(k), _mm256_cmp_ps(a, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
    return _mm256_and_ps(keep, exp256(a));
}

#define set1_v _mm256_set1_ps
#define setzero_v _mm256_setzero_ps
#define add_v _mm256_add_ps
#define store_v _mm256_store_ps
#endif

#define SP_CHUNK 256 /* tokens a chunk: the draw finds the chunk first, then the token in it */

static inline const void *row_at(const void *logits, int dtype, int64_t row_stride, const int64_t *ids, int64_t i) {
    int64_t r = ids ? ids[i] : i;
    return (const char *)logits + r * row_stride * (dtype == 1 ? 2 : 4);
}

/* Greedy tokens: out[i] = the first index of row ids[i]'s largest value (as argmax and torch's
 * max(dim).indices). Returns the number of rows declined. */
int64_t sp_greedy(const void *logits, int64_t n, const int64_t *ids, int64_t cols, int64_t row_stride, int dtype,
                  int64_t *out, int nthreads) {
    int64_t bad = 0;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : bad) if (nthreads > 1 && n > 1)
    for (int64_t i = 0; i < n; i++) {
        int64_t arg;
        int nan;
        float m = row_max(row_at(logits, dtype, row_stride, ids, i), dtype, cols, &arg, &nan);
        int declined = nan || isinf(m);
        out[i] = declined ? -1 : arg;
        bad += declined;
    }
    return bad;
}

/* Temperature draws: out[i] = the token of row ids[i] whose cumulative weight first exceeds
 * u[i] * (sum of weights), weights w_j = e^((x_j - max) / temps[i]) in fp32, sums in float64:
 * inverse-CDF sampling with the row's one uniform number, as gpu/sampling_draws.draw_full_vocab
 * does over softmax probabilities (the same token except where rounding moves a boundary).
 * Chunk sums first (SP_CHUNK tokens), then the chosen chunk's weights again, token by token.
 * Returns the number of rows declined, or -1 without memory. */
int64_t sp_draw(const void *logits, int64_t n, const int64_t *ids, int64_t cols, int64_t row_stride, int dtype,
                const float *temps, const double *u, int64_t *out, int nthreads) {
    const int64_t nchunks = (cols + SP_CHUNK - 1) / SP_CHUNK;
    int64_t bad = 0;
    int failed = 0;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && n > 1)
    {
        double *mass = (double *)malloc(sizeof(double) * (size_t)nchunks);
        float w[SP_CHUNK] __attribute__((aligned(64)));
        if (!mass) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) reduction(+ : bad)
        for (int64_t i = 0; i < n; i++) {
            if (!mass) continue;
            const void *row = row_at(logits, dtype, row_stride, ids, i);
            int64_t arg;
            int nan;
            float m = row_max(row, dtype, cols, &arg, &nan);
            if (nan || isinf(m)) {
                out[i] = -1;
                bad++;
                continue;
            }
            const vf mv = set1_v(m), inv_t = set1_v(1.0f / temps[i]);
            double total = 0.0;
            for (int64_t c = 0; c < nchunks; c++) {
                vf s = setzero_v();
                int64_t end = (c + 1) * SP_CHUNK < cols ? (c + 1) * SP_CHUNK : cols;
                for (int64_t j = c * SP_CHUNK; j < end; j += SP_W) s = add_v(s, weights_v(row, dtype, j, end, mv, inv_t));
                mass[c] = (double)hsum_v(s);
                total += mass[c];
            }
            /* total >= 1: the largest value's weight is e^0 */
            const double x = u[i] * total;
            double before = 0.0;
            int64_t c = 0, last = 0;
            for (; c < nchunks; c++) {
                if (mass[c] > 0.0) last = c;
                if (before + mass[c] > x && mass[c] > 0.0) break;
                before += mass[c];
            }
            if (c == nchunks) c = last, before = total - mass[last]; /* x rounded onto the total */
            int64_t j0 = c * SP_CHUNK, end = j0 + SP_CHUNK < cols ? j0 + SP_CHUNK : cols;
            for (int64_t j = j0; j < end; j += SP_W) store_v(w + (j - j0), weights_v(row, dtype, j, end, mv, inv_t));
            int64_t tok = -1, last_pos = -1;
            double cum = before;
            for (int64_t j = j0; j < end; j++) {
                if (w[j - j0] <= 0.0f) continue;
                last_pos = j;
                cum += (double)w[j - j0];
                if (cum > x) {
                    tok = j;
                    break;
                }
            }
            out[i] = tok >= 0 ? tok : last_pos; /* the chunk's mass is > 0, so last_pos >= 0 */
        }
        free(mass);
    }
    return failed ? -1 : bad;
}
