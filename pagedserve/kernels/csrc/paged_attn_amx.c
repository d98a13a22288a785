/* Paged decode attention with AMX bf16 tiles (bf16 caches only); same contract and arguments as
 * pa_decode in paged_attn.c, which stays the path everywhere else.
 *
 * Why: the AVX-512 kernel is compute bound at ~170 cycles per context token (default model): a
 * vdpbf16ps issues every 2 cycles here and every (head, 16 tokens) needs a transpose-add of 16
 * dot products. One tdpbf16ps does a whole 16 x G x 32 block of multiply-adds. Measured: ~2x the
 * AVX-512 kernel with the caches in L2/L3, ~1.3x when a step's caches come from DRAM (then both
 * wait on memory; loadtest/PERF.md, "AMX decode attention").
 *
 * One work item is a request (or a part of its tokens, for flash-decoding), in three passes:
 *  1. scores, transposed: S^T[16 tokens][G] = K[16 tokens][32 dims] . Q^T[32 dims][G] per KV head,
 *     the A tile loaded straight from the cache (row stride Hkv*D), Q^T re-laid once per item into
 *     the VNNI pair layout; each 16 x G tile is gathered into per-head rows and scaled.
 *  2. softmax per query head over the whole item, AVX-512: max, exp, sum; P rounded to bf16.
 *  3. O[G][D] = P[G][tokens] . V[tokens][D], 32 tokens per step: the A tile is P in place, V is
 *     re-laid into token pairs (vpunpck{l,h}wd: the output columns come out in that lane order and
 *     are put back at the end). The C tiles accumulate over the whole item: two passes need no
 *     rescaling of partial sums (the online softmax would need a tile store and load per step).
 * Memory per thread: scores and P of the longest item (H x tokens). Tokens past seq_len (or the
 * part's end) are never used: their score rows are masked, their V rows and P columns are zeros
 * (a NaN in an unused slot times a zero would still be a NaN).
 *
 * fp8 caches (dtype 3, csrc/fp8.h): K rows are converted to bf16 into the per-thread tile buffer
 * (as rows that cross a block are copied), V rows as they are laid into pairs; the arithmetic is
 * then the bf16 caches' (the conversion is exact).
 *
 * Tiles (palette 1): each pass loads its own config (tiles_scores, tiles_values), in every OpenMP
 * thread. Built with -mamx-tile -mamx-bf16 -mavx512bf16 -mavx512f -mavx512bw (kernels/attn_amx.py),
 * which asks Linux for the tile state once per process (kernels/cbuild.py amx_tiles_granted).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "exports.h"
#include "fp8.h"

#define PAM_MAX_G 16 /* Q^T tile: 4G bytes a row */
#define PAM_MAX_D 256
#define PAM_MAX_H 256

int pam_max_group(void) { return PAM_MAX_G; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* Pass 1 (scores) and pass 3 (P.V) use the tiles differently: each loads its own config. */
static void tiles_scores(int G) { /* 0,1 = S^T (16 x 4G); 2,3 = K rows (16 x 64); 4,5 = Q^T (16 x 4G) */
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) c.rows[t] = 16, c.colsb[t] = (uint16_t)(t == 2 || t == 3 ? 64 : 4 * G);
    _tile_loadconfig(&c);
}

static void tiles_values(int G) { /* 0 = P (G x 64); 1,2 = V pairs (16 x 64); 4..7 = O (G x 64) */
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = t == 1 || t == 2 ? 16 : (uint8_t)G, c.colsb[t] = 64;
    c.rows[3] = 0, c.colsb[3] = 0;
    _tile_loadconfig(&c);
}

static inline __m512 v_exp(__m512 x) { return exp512_nonpos(x); } /* x <= 0 */

typedef struct { /* one call's arguments that every item reads */
    const uint16_t *q;
    const char *k, *v; /* caches: 2 bytes an element, or 1 (fp8) */
    int64_t esz;
    const int32_t *tables, *seq_lens;
    int64_t q_stride, bt_stride, H, Hkv, G, D, BS, out_stride, part_tokens, nparts, Tp;
    float scale;
    uint16_t *out;
    float *scratch;
} call_t;

typedef struct { /* per-thread buffers */
    float *st;     /* [Hkv][Tp][G]: S^T as the tiles store it */
    float *s;      /* [H][Tp] scaled scores */
    uint16_t *p;   /* [H][Tp] probabilities, bf16, zero past the item's tokens */
    uint16_t *qt;  /* [Hkv][D/32][16 rows][G][2]: Q^T in VNNI pairs */
    uint16_t *kt;  /* [2][16][D]: K rows of a tile that crosses a block (zeros past the end), per KV head parity */
    uint16_t *vt;  /* [2][4][16 rows][32]: two steps' V pairs, 64 output columns */
    int64_t *rows; /* [Tp]: cache row (element index, head 0) of each of the item's tokens */
    float *acc;    /* [H][D] */
} bufs_t;

/* S^T of KV head kh += K rows (tile A) . Q^T (tile B) over the head's D dims, into tile C; two
 * (A, B) pairs alternate so a tile load does not wait for the previous product to read it. */
#define PAM_SCORE(C, a, astride, qt, G, D)                       \
    do {                                                         \
        _tile_zero(C);                                           \
        int64_t d = 0;                                           \
        for (; d + 64 <= (D); d += 64) {                         \
            _tile_loadd(2, (a) + d, astride);                    \
            _tile_loadd(4, (qt) + (d / 32) * 32 * (G), 4 * (G)); \
            _tile_dpbf16ps(C, 2, 4);                             \
            _tile_loadd(3, (a) + d + 32, astride);               \
            _tile_loadd(5, (qt) + (d / 32 + 1) * 32 * (G), 4 * (G)); \
            _tile_dpbf16ps(C, 3, 5);                             \
        }                                                        \
        if (d < (D)) {                                           \
            _tile_loadd(2, (a) + d, astride);                    \
            _tile_loadd(4, (qt) + (d / 32) * 32 * (G), 4 * (G)); \
            _tile_dpbf16ps(C, 2, 4);                             \
        }                                                        \
    } while (0)

/* K row of token t (relative to the item's first) at dims of KV head kh, as bf16 into dst[D]. */
#define PAM_INLINE static inline __attribute__((always_inline))

PAM_INLINE void k_row_bf16(const call_t *c, const bufs_t *b, int64_t i, int64_t kh, uint16_t *dst,
                           const int64_t esz) {
    const char *src = c->k + (b->rows[i] + kh * c->D) * esz;
    if (esz == 2) {
        memcpy(dst, src, (size_t)c->D * 2);
        return;
    }
    for (int64_t d = 0; d < c->D; d += 32) _mm512_storeu_si512(dst + d, fp8x32_to_bf16((const uint8_t *)src + d));
}

/* Pass 1: b->st[kh][t - t0][g] = q_(kh,g) . k_t for t in [t0, t1) (rows past t1: anything).
 * esz (bytes a cache element) is a constant in each inlined instance (run_item). */
PAM_INLINE void scores(const call_t *c, int64_t t0, int64_t t1, bufs_t *b, const int64_t esz) {
    const int64_t G = c->G, D = c->D, Hkv = c->Hkv, ts = Hkv * D, Tp = c->Tp;
    tiles_scores((int)G);
    for (int64_t t = t0; t < t1; t += 16) {
        int64_t nt = t1 - t < 16 ? t1 - t : 16;
        /* 16 bf16 rows in one block: load them in place */
        int direct = esz == 2 && t % c->BS + 16 <= c->BS;
        const uint16_t *base = (const uint16_t *)(c->k + b->rows[t - t0] * esz);
        if (t + 16 < t1) { /* next tile's rows */
            const char *nx = c->k + b->rows[t + 16 - t0] * esz;
            int64_t nn = t1 - t - 16 < 16 ? t1 - t - 16 : 16;
            if ((t + 16) % c->BS + nn <= c->BS)
                for (int64_t i = 0; i < nn * ts * esz; i += 64) _mm_prefetch(nx + i, _MM_HINT_T0);
        }
        for (int64_t kh = 0; kh < Hkv; kh++) {
            const uint16_t *a = base + kh * D;
            int64_t astride = ts * 2;
            if (!direct) {
                uint16_t *kt = b->kt + (kh & 1) * 16 * D;
                for (int64_t i = 0; i < 16; i++) {
                    if (i < nt)
                        k_row_bf16(c, b, t + i - t0, kh, kt + i * D, esz);
                    else
                        memset(kt + i * D, 0, (size_t)D * 2);
                }
                a = kt, astride = D * 2;
            }
            const uint16_t *qt = b->qt + kh * (D / 32) * 32 * G;
            float *dst = b->st + (kh * Tp + (t - t0)) * G;
            if (kh & 1) {
                PAM_SCORE(1, a, astride, qt, G, D);
                _tile_stored(1, dst, 4 * G);
            } else {
                PAM_SCORE(0, a, astride, qt, G, D);
                _tile_stored(0, dst, 4 * G);
            }
        }
    }
}

/* Pass 2: per head, scaled scores gathered into b->s, softmax numerators as bf16 in b->p (zero
 * past the item's tokens); m, l out. */
static void softmax(const call_t *c, int64_t T, bufs_t *b, float *m, float *l) {
    const int64_t Tp = c->Tp, G = c->G;
    const __m512i gidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)G));
    const __m512 sc = _mm512_set1_ps(c->scale);
    for (int64_t h = 0; h < c->H; h++) {
        float *s = b->s + h * Tp;
        const float *st = b->st + (h / G) * Tp * G + h % G;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < T; i += 16) {
            __mmask16 k = T - i >= 16 ? 0xffff : (__mmask16)((1u << (T - i)) - 1u);
            __m512 v = _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, gidx, st + i * G, 4), sc);
            _mm512_store_ps(s + i, v);
            mv = _mm512_mask_max_ps(mv, k, mv, v);
        }
        float mx = _mm512_reduce_max_ps(mv);
        __m512 mb = _mm512_set1_ps(mx), sum = _mm512_setzero_ps();
        uint16_t *p = b->p + h * Tp;
        for (int64_t i = 0; i < Tp; i += 16) {
            __mmask16 k = i >= T ? 0 : T - i >= 16 ? 0xffff : (__mmask16)((1u << (T - i)) - 1u);
            __m512 e = _mm512_maskz_mov_ps(k, v_exp(_mm512_sub_ps(_mm512_maskz_load_ps(k, s + i), mb)));
            sum = _mm512_add_ps(sum, e);
            _mm256_store_si256((__m256i *)(p + i), (__m256i)_mm512_cvtneps_pbh(e));
        }
        m[h] = T > 0 ? mx : -INFINITY;
        l[h] = T > 0 ? _mm512_reduce_add_ps(sum) : 0.0f;
    }
}

/* 32 cache elements at p as bf16 */
PAM_INLINE __m512i v_bf16x32(const char *p, const int64_t esz) {
    return esz == 2 ? _mm512_loadu_si512(p) : fp8x32_to_bf16((const uint8_t *)p);
}

/* V rows of tokens [t, t + 32) (zeros at and past t1), dims d0 .. d0 + 32 * halves, as token pairs:
 * row j of tile 2s + lo/hi holds tokens t + 2j, t + 2j + 1 of unpack{lo,hi}_epi16 of dims d0 + 32s.
 * vbase: the cache (bytes) at KV head kh, dim d0, token row 0. */
PAM_INLINE void relay_values(const bufs_t *b, int64_t t0, int64_t t, int64_t t1, const char *vbase,
                                const int64_t esz, int halves, uint16_t *vt) {
    for (int64_t j = 0; j < 16; j++) {
        int64_t ta = t + 2 * j, tb = ta + 1;
        const char *ra = ta < t1 ? vbase + b->rows[ta - t0] * esz : NULL;
        const char *rb = tb < t1 ? vbase + b->rows[tb - t0] * esz : NULL;
        for (int s = 0; s < halves; s++) {
            __m512i x = ra ? v_bf16x32(ra + 32 * s * esz, esz) : _mm512_setzero_si512();
            __m512i y = rb ? v_bf16x32(rb + 32 * s * esz, esz) : _mm512_setzero_si512();
            _mm512_store_si512(vt + (2 * s) * 512 + j * 32, _mm512_unpacklo_epi16(x, y));
            _mm512_store_si512(vt + (2 * s + 1) * 512 + j * 32, _mm512_unpackhi_epi16(x, y));
        }
    }
}

/* Pass 3: b->acc[h][D] = sum_t p[h][t] v_t (unnormalised; columns in the pair lane order). The
 * next step's V pairs are laid out (other half of b->vt) before this step's products are issued,
 * so the tile loads do not wait for just-made stores. */
PAM_INLINE void weighted_values(const call_t *c, int64_t t0, int64_t t1, bufs_t *b, const int64_t esz) {
    const int64_t G = c->G, D = c->D, Tp = c->Tp;
    tiles_values((int)G);
    for (int64_t kh = 0; kh < c->Hkv; kh++) {
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int halves = D - d0 >= 64 ? 2 : 1; /* 32-dim halves in this chunk: 2 C tiles each */
            const char *vbase = c->v + (kh * D + d0) * esz;
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            relay_values(b, t0, t0, t1, vbase, esz, halves, b->vt);
            for (int64_t t = t0, step = 0; t < t1; t += 32, step++) {
                uint16_t *vt = b->vt + (step & 1) * 2048;
                if (t + 32 < t1)
                    relay_values(b, t0, t + 32, t1, vbase, esz, halves, b->vt + ((step + 1) & 1) * 2048);
                _tile_loadd(0, b->p + kh * G * Tp + (t - t0), Tp * 2);
                _tile_loadd(1, vt, 64);
                _tile_dpbf16ps(4, 0, 1);
                _tile_loadd(2, vt + 512, 64);
                _tile_dpbf16ps(5, 0, 2);
                if (halves == 2) {
                    _tile_loadd(1, vt + 1024, 64);
                    _tile_dpbf16ps(6, 0, 1);
                    _tile_loadd(2, vt + 1536, 64);
                    _tile_dpbf16ps(7, 0, 2);
                }
            }
            float *o = b->acc + kh * G * D + d0;
            _tile_stored(4, o, D * 4);
            _tile_stored(5, o + 16, D * 4);
            if (halves == 2) {
                _tile_stored(6, o + 32, D * 4);
                _tile_stored(7, o + 48, D * 4);
            }
        }
    }
}

/* Undo the pair lane order: in each 32-column chunk, lane 4b+e holds dim 8b+e and lane 16+4b+e
 * holds dim 8b+4+e (as unpermute_acc in paged_attn.c). */
static void unpermute(float *acc, int64_t rows, int64_t D) {
    const __m512i i0 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i i1 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int64_t i = 0; i < rows * D; i += 32) {
        __m512 lo = _mm512_loadu_ps(acc + i), hi = _mm512_loadu_ps(acc + i + 16);
        _mm512_storeu_ps(acc + i, _mm512_permutex2var_ps(lo, i0, hi));
        _mm512_storeu_ps(acc + i + 16, _mm512_permutex2var_ps(lo, i1, hi));
    }
}

static void run_item(const call_t *c, int64_t n, int64_t part, bufs_t *b) {
    const int64_t H = c->H, G = c->G, D = c->D;
    int64_t len = c->seq_lens[n], t0 = 0, t1 = len;
    if (c->nparts > 1) {
        t0 = part * c->part_tokens;
        t1 = t0 + c->part_tokens < len ? t0 + c->part_tokens : len;
        if (t1 < t0) t1 = t0;
    }
    const int32_t *table = c->tables + n * c->bt_stride;
    const uint16_t *q = c->q + n * c->q_stride;
    /* Q^T pairs: row j of chunk d holds dims d+2j, d+2j+1 of the G heads (a dword transpose) */
    const __m512i jg = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32((int)G));
    for (int64_t kh = 0; kh < c->Hkv; kh++)
        for (int64_t d = 0; d < D; d += 32)
            for (int64_t g = 0; g < G; g++)
                _mm512_i32scatter_epi32(b->qt + (kh * (D / 32) + d / 32) * 32 * G + 2 * g, jg,
                                        _mm512_loadu_si512(q + (kh * G + g) * D + d), 4);
    for (int64_t t = t0; t < t1;) { /* cache rows, block by block (no division per token) */
        int64_t off = t % c->BS, row = ((int64_t)table[t / c->BS] * c->BS + off) * c->Hkv * D;
        for (; off < c->BS && t < t1; off++, t++, row += c->Hkv * D) b->rows[t - t0] = row;
    }
    float m[PAM_MAX_H], l[PAM_MAX_H];
    if (c->esz == 2)
        scores(c, t0, t1, b, 2);
    else
        scores(c, t0, t1, b, 1);
    softmax(c, t1 - t0, b, m, l);
    if (t1 > t0) {
        if (c->esz == 2)
            weighted_values(c, t0, t1, b, 2);
        else
            weighted_values(c, t0, t1, b, 1);
        unpermute(b->acc, H, D);
    } else {
        memset(b->acc, 0, sizeof(float) * (size_t)(H * D));
    }
    if (c->nparts > 1) {
        float *dst = c->scratch + (n * c->nparts + part) * H * (D + 2);
        for (int64_t h = 0; h < H; h++) {
            dst[h * (D + 2)] = m[h];
            dst[h * (D + 2) + 1] = l[h];
            memcpy(dst + h * (D + 2) + 2, b->acc + h * D, sizeof(float) * (size_t)D);
        }
        return;
    }
    uint16_t *o = c->out + n * c->out_stride;
    for (int64_t h = 0; h < H; h++) {
        __m512 inv = _mm512_set1_ps(l[h] > 0.0f ? 1.0f / l[h] : 0.0f);
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(o + h * D + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(b->acc + h * D + d), inv)));
    }
}

/* Sum the parts of request n into its output row (as combine in paged_attn.c, bf16 out). */
static void combine(const call_t *c, int64_t n, float *acc) {
    const int64_t H = c->H, D = c->D, nparts = c->nparts;
    const float *src = c->scratch + n * nparts * H * (D + 2);
    for (int64_t h = 0; h < H; h++) {
        float mmax = -INFINITY, total = 0.0f;
        for (int64_t p = 0; p < nparts; p++) {
            float mp = src[(p * H + h) * (D + 2)];
            mmax = mp > mmax ? mp : mmax;
        }
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (int64_t p = 0; p < nparts; p++) {
            const float *e = src + (p * H + h) * (D + 2);
            if (e[1] <= 0.0f) continue;
            float w = expf(e[0] - mmax);
            total += w * e[1];
            for (int64_t d = 0; d < D; d++) acc[d] += w * e[2 + d];
        }
        float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < D; d++) c->out[n * c->out_stride + h * D + d] = f32_to_bf16(acc[d] * inv);
    }
}

static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) & ~(size_t)63); }

/* pa_decode's signature; dtype must be 1 (bf16) or 3 (bf16 q and out, fp8 caches), D a multiple
 * of 32, G at most PAM_MAX_G.
 * Returns 0, or -1 for arguments it does not take or no memory. */
int pam_decode(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
               const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int64_t N, int64_t H,
               int64_t Hkv, int64_t D, int64_t BS, float scale, void *out, int64_t out_row_stride, int dtype,
               int64_t part_tokens, int nthreads) {
    if (N <= 0) return 0;
    if ((dtype != 1 && dtype != 3) || Hkv <= 0 || H % Hkv || H > PAM_MAX_H || D % 32 || D <= 0 || D > PAM_MAX_D ||
        BS <= 0 ||
        H / Hkv > PAM_MAX_G)
        return -1;
    call_t c = {q, k_cache, v_cache, dtype == 3 ? 1 : 2, block_tables, seq_lens, q_row_stride, bt_stride, H, Hkv,
                H / Hkv, D, BS, out_row_stride, part_tokens, 1, 0, scale, out, NULL};
    int64_t maxlen = 0;
    for (int64_t n = 0; n < N; n++) maxlen = seq_lens[n] > maxlen ? seq_lens[n] : maxlen;
    if (part_tokens > 0) {
        c.nparts = (maxlen + part_tokens - 1) / part_tokens;
        if (c.nparts < 1) c.nparts = 1;
    }
    if (c.nparts > 1) {
        c.scratch = (float *)malloc(sizeof(float) * (size_t)(N * c.nparts * H * (D + 2)));
        if (!c.scratch) return -1;
        maxlen = part_tokens;
    } else {
        c.part_tokens = 0;
    }
    c.Tp = (maxlen + 31) & ~(int64_t)31;
    if (c.Tp < 32) c.Tp = 32;
    int64_t items = N * c.nparts;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > items) nthreads = (int)items;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        bufs_t b;
        b.st = (float *)alloc64(sizeof(float) * (size_t)(H * c.Tp));
        b.s = (float *)alloc64(sizeof(float) * (size_t)(H * c.Tp));
        b.rows = (int64_t *)alloc64(sizeof(int64_t) * (size_t)c.Tp);
        b.p = (uint16_t *)alloc64(2 * (size_t)(H * c.Tp));
        b.qt = (uint16_t *)alloc64(2 * (size_t)(H * D));
        b.kt = (uint16_t *)alloc64(2 * (size_t)(2 * 16 * D));
        b.vt = (uint16_t *)alloc64(2 * 2 * 4 * 512);
        b.acc = (float *)alloc64(sizeof(float) * (size_t)(H * D));
        int ok = b.st && b.s && b.p && b.qt && b.kt && b.vt && b.acc && b.rows;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++)
            if (ok) run_item(&c, it / c.nparts, it % c.nparts, &b);
        if (c.nparts > 1 && ok) {
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) combine(&c, n, b.acc);
        }
        _tile_release();
        free(b.st), free(b.s), free(b.p), free(b.qt), free(b.kt), free(b.vt), free(b.acc), free(b.rows);
    }
    free(c.scratch);
    return failed ? -1 : 0;
}
