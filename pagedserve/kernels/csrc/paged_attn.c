/* Paged decode attention on CPU that reads K/V blocks where they lie in the cache.
 *
 * Why: the torch path gathers every request's blocks into a scratch buffer (a full copy of the
 * K/V it reads) and, in bf16, multiplies a block-diagonal query so GQA costs Hkv times the FLOPs.
 * Here one work item is (query row[, part of its tokens]); per KV head, the G query heads that
 * share it are attended together, so each K/V row is loaded once, from its block, for all G.
 * Softmax is online (running max and sum per head, one 16-token tile at a time), in fp32.
 *
 * Layouts (elements, not bytes):
 *   q, out        row n at n * row_stride, head h at + h * D (heads contiguous, D contiguous)
 *   caches        [num_blocks][BS][Hkv][D]: token t of a request is block_tables[n][t / BS],
 *                 slot t % BS; only slots below seq_lens[n] are read (unused slots may hold
 *                 anything, NaN included)
 *   block_tables  int32, row n at n * bt_stride
 * dtype 0 = fp32 (q, caches, out), 1 = bf16 (q, caches, out; arithmetic in fp32); plus 2 when
 * the caches hold fp8 e4m3 (csrc/fp8.h; --kv-cache-dtype fp8): 2 = fp32 q and out, 3 = bf16;
 * 4 = fp32 q and out with bf16 caches (--kv-cache-dtype bfloat16 under fp32 activations).
 *
 * The build has exactly one vector width (pa_width()): AVX-512 (16 fp32 lanes) when compiled with
 * -mavx512f -mavx512bw, AVX2+FMA (8 lanes), or portable scalar code (1); D must be a multiple of
 * it and at most PA_MAX_D, and G = H / Hkv at most PA_MAX_G (the caller checks pa_width and falls
 * back to torch otherwise).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "exports.h"
#include "fp8.h"
#include "simd.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PA_ISA 3
#define PA_W 16
#elif defined(__AVX2__) && defined(__FMA__)
#define PA_ISA 2
#define PA_W 8
#else
#define PA_ISA 0
#define PA_W 1
#endif

#if PA_ISA == 3 && defined(__AVX512BF16__)
#define PA_BF16DP 1 /* bf16 dot products (vdpbf16ps) for bf16 caches */
#else
#define PA_BF16DP 0
#endif

#define PA_MAX_G 16
#define PA_MAX_D 256
#define PA_MAX_H 256 /* query heads */
#define PA_TILE 16 /* tokens per softmax tile; a tile never crosses a block */

int pa_isa(void) { return PA_ISA + PA_BF16DP; } /* 4: AVX-512 with bf16 dot products */
int pa_width(void) { return PA_W; }
int pa_max_group(void) { return PA_MAX_G; }
int pa_max_head_dim(void) { return PA_MAX_D; }

/* ------------------------------------------------------------------ vector primitives */

#if PA_ISA == 3
typedef __m512 vf;
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf v_load_bf16(const uint16_t *p) { return bf16x16_to_ps(p); }
static inline vf v_load_fp8(const uint8_t *p) { return fp8x16_to_ps(p); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline float v_hsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf v_exp(vf x) { return exp512_nonpos(x); } /* x <= 0 */
#elif PA_ISA == 2
typedef __m256 vf;
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf v_load_bf16(const uint16_t *p) { return bf16x8_to_ps(p); }
static inline vf v_load_fp8(const uint8_t *p) { return fp8x8_to_ps(p); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline float v_hsum(vf v) { return hsum256(v); }
static inline vf v_exp(vf x) { return exp256(x); } /* x <= 0: exp256's upper clamp changes nothing */
#else
typedef float vf;
static inline vf v_zero(void) { return 0.0f; }
static inline vf v_set1(float x) { return x; }
static inline vf v_load(const float *p) { return *p; }
static inline void v_store(float *p, vf v) { *p = v; }
static inline vf v_load_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
static inline vf v_load_fp8(const uint8_t *p) { return fp8_to_f32(*p); }
static inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline float v_hsum(vf v) { return v; }
static inline vf v_exp(vf x) { return expf(x); }
#endif

/* Cache element kinds (compile-time constants in each instance): */
#define KV_F32 0
#define KV_BF16 1
#define KV_FP8 2

static inline __attribute__((always_inline)) vf load_row(const void *base, int64_t i, const int kv) {
    return kv == KV_FP8    ? v_load_fp8((const uint8_t *)base + i)
           : kv == KV_BF16 ? v_load_bf16((const uint16_t *)base + i)
                           : v_load((const float *)base + i);
}

/* ------------------------------------------------------------------ one work item */

/* One tile (nt <= PA_TILE consecutive tokens of one block) of one KV head: update the running
 * max m[g], sum l[g] and unnormalised output acc[g][D] of its G query heads (qf: G x D, fp32,
 * scaled). base is the element index of the tile's first K/V row of this head. */
static inline __attribute__((always_inline)) void attend_tile(
    const float *qf, const int G, const int64_t D, const void *k_cache, const void *v_cache, int64_t base,
    int64_t tok_stride, int64_t nt, float *m, float *l, float *acc, const int kv) {
    float s[PA_MAX_G][PA_TILE];

    /* scores: one pass over each K row for all G heads */
    for (int64_t i = 0; i < nt; i++) {
        int64_t row = base + i * tok_stride;
        vf d[PA_MAX_G];
        for (int g = 0; g < G; g++) d[g] = v_zero();
        for (int64_t c = 0; c < D; c += PA_W) {
            vf kr = load_row(k_cache, row + c, kv);
            for (int g = 0; g < G; g++) d[g] = v_fma(v_load(qf + g * D + c), kr, d[g]);
        }
        for (int g = 0; g < G; g++) s[g][i] = v_hsum(d[g]);
    }

    /* online softmax update, per head */
    float corr[PA_MAX_G];
    for (int g = 0; g < G; g++) {
        float mt = s[g][0];
        for (int64_t i = 1; i < nt; i++) mt = s[g][i] > mt ? s[g][i] : mt;
        float mnew = mt > m[g] ? mt : m[g];
        corr[g] = m[g] == -INFINITY ? 0.0f : expf(m[g] - mnew);
        m[g] = mnew;
        for (int64_t i = nt; i < PA_TILE; i++) s[g][i] = mnew;
        vf mv = v_set1(mnew);
        for (int i = 0; i < PA_TILE; i += PA_W) v_store(&s[g][i], v_exp(v_sub(v_load(&s[g][i]), mv)));
        float sum = 0.0f;
        for (int64_t i = 0; i < nt; i++) sum += s[g][i];
        l[g] = l[g] * corr[g] + sum;
    }

    /* acc = acc * corr + P @ V, one D-chunk of all G heads in registers at a time */
    for (int64_t c = 0; c < D; c += PA_W) {
        vf a[PA_MAX_G];
        for (int g = 0; g < G; g++) a[g] = v_mul(v_load(acc + g * D + c), v_set1(corr[g]));
        for (int64_t i = 0; i < nt; i++) {
            vf vv = load_row(v_cache, base + i * tok_stride + c, kv);
            for (int g = 0; g < G; g++) a[g] = v_fma(v_set1(s[g][i]), vv, a[g]);
        }
        for (int g = 0; g < G; g++) v_store(acc + g * D + c, a[g]);
    }
}

#if PA_ISA == 3
/* 16 vectors -> one vector of their 16 horizontal sums, in order (45 instructions instead of 16
 * separate reductions). */
static inline __m512 hsum16(const __m512 *p) {
    __m512 q1[8], q2[4];
    for (int k = 0; k < 8; k++)
        q1[k] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * k], p[2 * k + 1]), _mm512_unpackhi_ps(p[2 * k], p[2 * k + 1]));
    for (int k = 0; k < 4; k++) { /* 128-bit block b of q2[k]: block-b sums of tokens 4k..4k+3 */
        __m512d c = _mm512_castps_pd(q1[2 * k]), d = _mm512_castps_pd(q1[2 * k + 1]);
        q2[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    __m512 g1 = _mm512_add_ps(_mm512_shuffle_f32x4(q2[0], q2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(q2[0], q2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 g2 = _mm512_add_ps(_mm512_shuffle_f32x4(q2[2], q2[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(q2[2], q2[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(g1, g2, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(g1, g2, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* attend_tile for AVX-512: scores of 16 tokens come out as one vector per head (hsum16), softmax
 * is vectorised, and with dp (bf16 cache, vdpbf16ps available, D % 32 == 0) both Q.K and P.V run
 * as bf16 dot products: qb is the head's unscaled bf16 query; P.V multiplies token pairs, with
 * each 32-dim chunk of acc kept in the lane order of unpack{lo,hi}_epi16 (see unpermute_acc). */
static inline __attribute__((always_inline)) void attend_tile512(
    const float *qf, const uint16_t *qb, float scale, const int G, const int64_t D, const void *k_cache,
    const void *v_cache, int64_t base, int64_t tok_stride, int64_t nt, float *m, float *l, float *acc,
    const int kv, const int dp) {
    float s[PA_MAX_G][PA_TILE];
    uint32_t pairs[PA_MAX_G][PA_TILE / 2];
    const __mmask16 valid = (__mmask16)((1u << nt) - 1u);
    float corr[PA_MAX_G];
    for (int g = 0; g < G; g++) {
        __m512 p[PA_TILE];
        for (int i = 0; i < PA_TILE; i++) {
            __m512 d = _mm512_setzero_ps();
            if (i < nt) {
                int64_t row = base + i * tok_stride;
#if PA_BF16DP
                if (dp) {
                    for (int64_t c = 0; c < D; c += 32)
                        d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_loadu_si512(qb + g * D + c),
                                             (__m512bh)_mm512_loadu_si512((const uint16_t *)k_cache + row + c));
                } else
#endif
                {
                    for (int64_t c = 0; c < D; c += 16)
                        d = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + c), load_row(k_cache, row + c, kv), d);
                }
            }
            p[i] = d;
        }
        __m512 sv = hsum16(p);
        if (dp) sv = _mm512_mul_ps(sv, _mm512_set1_ps(scale));
        float mt = _mm512_mask_reduce_max_ps(valid, sv);
        float mnew = mt > m[g] ? mt : m[g];
        corr[g] = mnew == m[g] ? 1.0f : m[g] == -INFINITY ? 0.0f : expf(m[g] - mnew);
        m[g] = mnew;
        __m512 pv = _mm512_maskz_mov_ps(valid, v_exp(_mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
        l[g] = l[g] * corr[g] + _mm512_reduce_add_ps(pv);
#if PA_BF16DP
        if (dp) {
            _mm256_storeu_si256((__m256i *)pairs[g], (__m256i)_mm512_cvtneps_pbh(pv));
            continue;
        }
#endif
        _mm512_storeu_ps(s[g], pv);
    }
#if PA_BF16DP
    if (dp) {
        for (int64_t c = 0; c < D; c += 32) {
            __m512 lo[PA_MAX_G], hi[PA_MAX_G];
            for (int g = 0; g < G; g++) {
                __m512 cg = _mm512_set1_ps(corr[g]);
                lo[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c), cg);
                hi[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c + 16), cg);
            }
            for (int64_t i = 0; i < nt; i += 2) {
                const uint16_t *vr = (const uint16_t *)v_cache + base + i * tok_stride + c;
                __m512i v0 = _mm512_loadu_si512(vr);
                __m512i v1 = i + 1 < nt ? _mm512_loadu_si512(vr + tok_stride) : _mm512_setzero_si512();
                __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
                __m512bh vhi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
                for (int g = 0; g < G; g++) {
                    __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pairs[g][i / 2]);
                    lo[g] = _mm512_dpbf16_ps(lo[g], vlo, pp);
                    hi[g] = _mm512_dpbf16_ps(hi[g], vhi, pp);
                }
            }
            for (int g = 0; g < G; g++) {
                _mm512_storeu_ps(acc + g * D + c, lo[g]);
                _mm512_storeu_ps(acc + g * D + c + 16, hi[g]);
            }
        }
        return;
    }
#endif
    for (int64_t c = 0; c < D; c += 16) {
        __m512 a[PA_MAX_G];
        for (int g = 0; g < G; g++) a[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c), _mm512_set1_ps(corr[g]));
        for (int64_t i = 0; i < nt; i++) {
            __m512 vv = load_row(v_cache, base + i * tok_stride + c, kv);
            for (int g = 0; g < G; g++) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(s[g][i]), vv, a[g]);
        }
        for (int g = 0; g < G; g++) _mm512_storeu_ps(acc + g * D + c, a[g]);
    }
}
#endif

/* Undo the P.V lane order of the dp path: in each 32-dim chunk, acc lane 4b+e (b = 0..3, e = 0..3)
 * holds dim 8b+e and lane 16+4b+e holds dim 8b+4+e. */
static void unpermute_acc(float *acc, int64_t rows, int64_t D) {
    float tmp[32];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < D; c += 32) {
            float *a = acc + r * D + c;
            for (int b = 0; b < 4; b++)
                for (int e = 0; e < 4; e++) {
                    tmp[8 * b + e] = a[4 * b + e];
                    tmp[8 * b + 4 + e] = a[16 + 4 * b + e];
                }
            memcpy(a, tmp, sizeof tmp);
        }
}

static inline void prefetch_rows(const void *cache, int64_t first, int64_t count, int64_t esz) {
    const char *p = (const char *)cache + first * esz;
    for (int64_t b = 0; b < count * esz; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* Tokens [t0, t1) of request n, all KV heads: tile by tile (a tile never crosses a block), and
 * within a tile every KV head in turn, so a block's K and V are read front to back while the
 * next block is being prefetched. State per query head h: m[h], l[h], acc[h][D]. */
static inline __attribute__((always_inline)) void attend_range(
    const float *qf, const uint16_t *qb, float scale, const int G, const int64_t Hkv, const int64_t D,
    const void *k_cache, const void *v_cache, const int32_t *table, int64_t BS, int64_t t0, int64_t t1, float *m,
    float *l, float *acc, const int kv, const int dp) {
    const int64_t H = Hkv * G, tok_stride = Hkv * D, esz = kv == KV_FP8 ? 1 : kv == KV_BF16 ? 2 : 4;
    for (int64_t h = 0; h < H; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)H * (size_t)D);
    int64_t t = t0;
    while (t < t1) {
        int64_t off = t % BS;
        int64_t nt = BS - off;
        if (nt > PA_TILE) nt = PA_TILE;
        if (nt > t1 - t) nt = t1 - t;
        int64_t first = (int64_t)table[t / BS] * BS + off; /* flat cache row of token t */
        int64_t tn = t + nt;                                  /* prefetch the next tile */
        if (tn < t1) {
            int64_t nn = BS - tn % BS;
            if (nn > PA_TILE) nn = PA_TILE;
            if (nn > t1 - tn) nn = t1 - tn;
            int64_t nfirst = (int64_t)table[tn / BS] * BS + tn % BS;
            prefetch_rows(k_cache, nfirst * tok_stride, nn * tok_stride, esz);
            prefetch_rows(v_cache, nfirst * tok_stride, nn * tok_stride, esz);
        }
        for (int64_t kh = 0; kh < Hkv; kh++) {
#if PA_ISA == 3
            attend_tile512(qf + kh * G * D, qb + kh * G * D, scale, G, D, k_cache, v_cache,
                           first * tok_stride + kh * D, tok_stride, nt, m + kh * G, l + kh * G, acc + kh * G * D,
                           kv, dp);
#else
            (void)qb, (void)scale, (void)dp;
            attend_tile(qf + kh * G * D, G, D, k_cache, v_cache, first * tok_stride + kh * D, tok_stride, nt,
                        m + kh * G, l + kh * G, acc + kh * G * D, kv);
#endif
        }
        t = tn;
    }
}

/* Item (n, part): attend, then write the normalised output (nparts == 1) or the partial
 * (m, l, acc per head) to scratch for the combine pass. work: 2 * H * D floats. dt: pa_decode's
 * dtype (bit 0: bf16 q and out; bit 1: fp8 caches). */
static inline __attribute__((always_inline)) void run_item(
    const int Gc, const int dt, const int64_t D, int64_t n, int64_t part, int64_t nparts, const void *q,
    int64_t q_row_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables, int64_t bt_stride,
    const int32_t *seq_lens, int64_t Hkv, int64_t D_unused, int64_t Grt, int64_t BS, float scale, void *out,
    int64_t out_row_stride, int64_t part_tokens, float *scratch, float *work) {
    (void)D_unused;
    const int G = Gc ? Gc : (int)Grt; /* Gc: compile-time group size, 0 = use the runtime one */
    const int bf16 = dt & 1, kv = dt & 2 ? KV_FP8 : bf16 || dt & 4 ? KV_BF16 : KV_F32;
    const int64_t H = Hkv * G;
    float *qf = work, *acc = work + H * D;
    float m[PA_MAX_H], l[PA_MAX_H];
    int64_t len = seq_lens[n];
    int64_t t0 = 0, t1 = len;
    if (nparts > 1) {
        t0 = part * part_tokens;
        t1 = t0 + part_tokens < len ? t0 + part_tokens : len;
    }
    int64_t qoff = n * q_row_stride;
    for (int64_t i = 0; i < H * D; i++)
        qf[i] = scale * (bf16 ? bf16_to_f32(((const uint16_t *)q)[qoff + i]) : ((const float *)q)[qoff + i]);
    if (t1 < t0) t1 = t0;
    const int32_t *table = block_tables + n * bt_stride;
    const uint16_t *qb = (const uint16_t *)q + qoff; /* read only on the dp path (bf16) */
    if (PA_BF16DP && bf16 && kv == KV_BF16 && D % 32 == 0) {
        attend_range(qf, qb, scale, G, Hkv, D, k_cache, v_cache, table, BS, t0, t1, m, l, acc, kv, 1);
        unpermute_acc(acc, H, D);
    } else {
        attend_range(qf, qb, scale, G, Hkv, D, k_cache, v_cache, table, BS, t0, t1, m, l, acc, kv, 0);
    }
    if (nparts > 1) {
        float *dst = scratch + (n * nparts + part) * H * (D + 2);
        for (int64_t h = 0; h < H; h++) {
            dst[h * (D + 2)] = m[h];
            dst[h * (D + 2) + 1] = l[h];
            memcpy(dst + h * (D + 2) + 2, acc + h * D, sizeof(float) * (size_t)D);
        }
        return;
    }
    int64_t ooff = n * out_row_stride;
    for (int64_t h = 0; h < H; h++) {
        float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t d = 0; d < D; d++) {
            float v = acc[h * D + d] * inv;
            if (bf16)
                ((uint16_t *)out)[ooff + h * D + d] = f32_to_bf16(v);
            else
                ((float *)out)[ooff + h * D + d] = v;
        }
    }
}

/* Sum the parts of request n into its output row. */
static void combine(int64_t n, int64_t nparts, int64_t H, int64_t D, const float *scratch, void *out,
                    int64_t out_row_stride, int bf16, float *acc) {
    const float *src = scratch + n * nparts * H * (D + 2);
    for (int64_t h = 0; h < H; h++) {
        float mmax = -INFINITY;
        for (int64_t p = 0; p < nparts; p++) {
            float mp = src[(p * H + h) * (D + 2)];
            mmax = mp > mmax ? mp : mmax;
        }
        float total = 0.0f;
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (int64_t p = 0; p < nparts; p++) {
            const float *e = src + (p * H + h) * (D + 2);
            if (e[1] <= 0.0f) continue;
            float w = expf(e[0] - mmax);
            total += w * e[1];
            for (int64_t d = 0; d < D; d++) acc[d] += w * e[2 + d];
        }
        float inv = total > 0.0f ? 1.0f / total : 0.0f;
        int64_t ooff = n * out_row_stride + h * D;
        for (int64_t d = 0; d < D; d++) {
            float v = acc[d] * inv;
            if (bf16)
                ((uint16_t *)out)[ooff + d] = f32_to_bf16(v);
            else
                ((float *)out)[ooff + d] = v;
        }
    }
}

#define PA_ITEM_ARGS                                                                                         \
    n, part, nparts, q, q_row_stride, k_cache, v_cache, block_tables, bt_stride, seq_lens, Hkv, D, G, BS, scale, \
        out, out_row_stride, part_tokens, scratch, work

/* constant G (per-head accumulators in registers) and constant D (inner loops unrolled) for the
 * usual group and head sizes; anything else runs the generic instance (all runtime) */
#define PA_CASE_DT(GV, DT)                                       \
    case GV:                                                     \
        if (D == 64)                                             \
            run_item(GV, DT, 64, PA_ITEM_ARGS);                  \
        else if (D == 128)                                       \
            run_item(GV, DT, 128, PA_ITEM_ARGS);                 \
        else                                                     \
            run_item(0, DT, D, PA_ITEM_ARGS);                    \
        break;
#define PA_SWITCH(DT)                                                                                          \
    switch (G) {                                                                                               \
        PA_CASE_DT(1, DT) PA_CASE_DT(2, DT) PA_CASE_DT(3, DT) PA_CASE_DT(4, DT) PA_CASE_DT(6, DT) PA_CASE_DT(8, DT) \
    default:                                                                                                   \
        run_item(0, DT, D, PA_ITEM_ARGS);                                                                      \
    }

static void dispatch_item(int G, int dt, int64_t n, int64_t part, int64_t nparts, const void *q,
                          int64_t q_row_stride, const void *k_cache, const void *v_cache,
                          const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int64_t Hkv,
                          int64_t D, int64_t BS, float scale, void *out, int64_t out_row_stride,
                          int64_t part_tokens, float *scratch, float *work) {
    switch (dt) {
    case 0: PA_SWITCH(0) break;
    case 1: PA_SWITCH(1) break;
    case 2: PA_SWITCH(2) break;
    case 3: PA_SWITCH(3) break;
    default: PA_SWITCH(4)
    }
}

/* Decode attention of N query rows (one token each, at the last position of its request).
 * part_tokens > 0 splits each request's tokens into parts of that many (flash-decoding), so a
 * small batch still gives every thread work. Returns 0, or -1 for bad arguments / no memory. */
int pa_decode(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
              const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int64_t N, int64_t H,
              int64_t Hkv, int64_t D, int64_t BS, float scale, void *out, int64_t out_row_stride, int dtype,
              int64_t part_tokens, int nthreads) {
    if (N <= 0) return 0;
    if (Hkv <= 0 || H % Hkv || H > PA_MAX_H || D % PA_W || D > PA_MAX_D || BS <= 0 || dtype < 0 || dtype > 4)
        return -1;
    int64_t G = H / Hkv;
    if (G > PA_MAX_G) return -1;
    int bf16 = dtype & 1;
    int64_t nparts = 1;
    if (part_tokens > 0) {
        int64_t maxlen = 0;
        for (int64_t n = 0; n < N; n++) maxlen = seq_lens[n] > maxlen ? seq_lens[n] : maxlen;
        nparts = (maxlen + part_tokens - 1) / part_tokens;
        if (nparts < 1) nparts = 1;
    }
    float *scratch = NULL;
    if (nparts > 1) {
        scratch = (float *)malloc(sizeof(float) * (size_t)(N * nparts * H * (D + 2)));
        if (!scratch) return -1;
    } else {
        part_tokens = 0;
    }
    int64_t items = N * nparts;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > items) nthreads = (int)items;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *work = (float *)malloc(sizeof(float) * (size_t)(2 * H * D));
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!work) continue;
            int64_t part = it % nparts, n = it / nparts;
            dispatch_item((int)G, dtype, n, part, nparts, q, q_row_stride, k_cache, v_cache, block_tables, bt_stride,
                          seq_lens, Hkv, D, BS, scale, out, out_row_stride, part_tokens, scratch, work);
        }
        if (nparts > 1 && work) {
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) combine(n, nparts, H, D, scratch, out, out_row_stride, bf16, work);
        }
        free(work);
    }
    free(scratch);
    return failed ? -1 : 0;
}
