/* Paged decode attention on CPU that reads K/V blocks where they lie in the cache.
 *
 * Why: the torch path gathers every request's blocks into a scratch buffer (a full copy of the
 * K/V it reads) and, in bf16, multiplies a block-diagonal query so GQA costs Hkv times the FLOPs.
 * Here one work item is (query row, KV head[, part of the sequence]): the G query heads that share
 * the KV head are attended together, so each K/V row is loaded once, from its block, for all G.
 * Softmax is online (running max and sum per head, one 16-token tile at a time), in fp32.
 *
 * Layouts (elements, not bytes):
 *   q, out        row n at n * row_stride, head h at + h * D (heads contiguous, D contiguous)
 *   caches        [num_blocks][BS][Hkv][D]: token t of a request is block_tables[n][t / BS],
 *                 slot t % BS; only slots below seq_lens[n] are read (unused slots may hold
 *                 anything, NaN included)
 *   block_tables  int32, row n at n * bt_stride
 * dtype 0 = fp32 (q, caches, out), 1 = bf16 (q, caches, out; arithmetic in fp32).
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

#define PA_MAX_G 16
#define PA_MAX_D 256
#define PA_TILE 16 /* tokens per softmax tile; a tile never crosses a block */

int pa_isa(void) { return PA_ISA; }
int pa_width(void) { return PA_W; }
int pa_max_group(void) { return PA_MAX_G; }
int pa_max_head_dim(void) { return PA_MAX_D; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ------------------------------------------------------------------ vector primitives */

#if PA_ISA == 3
typedef __m512 vf;
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf v_load_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline float v_hsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf v_exp(vf x) { /* x <= 0; Cephes expf polynomial, 2^n by scalef */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    vf p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#elif PA_ISA == 2
typedef __m256 vf;
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf v_load_bf16(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline float v_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf v_exp(vf x) { /* x <= 0 */
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    vf p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#else
typedef float vf;
static inline vf v_zero(void) { return 0.0f; }
static inline vf v_set1(float x) { return x; }
static inline vf v_load(const float *p) { return *p; }
static inline void v_store(float *p, vf v) { *p = v; }
static inline vf v_load_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
static inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline float v_hsum(vf v) { return v; }
static inline vf v_exp(vf x) { return expf(x); }
#endif

static inline __attribute__((always_inline)) vf load_row(const void *base, int64_t i, const int bf16) {
    return bf16 ? v_load_bf16((const uint16_t *)base + i) : v_load((const float *)base + i);
}

/* ------------------------------------------------------------------ one work item */

/* Attend G query heads (qf: G x D, fp32, already scaled) to tokens [t0, t1) of one request's KV
 * head; leave the running max m[g], sum l[g] and unnormalised output acc[g][D]. */
static inline __attribute__((always_inline)) void attend_range(
    const float *qf, const int G, const int64_t D, const void *k_cache, const void *v_cache,
    const int32_t *table, int64_t BS, int64_t tok_stride, int64_t head_off, int64_t t0, int64_t t1,
    float *m, float *l, float *acc, const int bf16) {
    float s[PA_MAX_G][PA_TILE];
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * (size_t)D);
    int64_t t = t0;
    while (t < t1) {
        int64_t off = t % BS;
        int64_t nt = BS - off;
        if (nt > PA_TILE) nt = PA_TILE;
        if (nt > t1 - t) nt = t1 - t;
        int64_t base = ((int64_t)table[t / BS] * BS + off) * tok_stride + head_off;

        /* scores: one pass over each K row for all G heads */
        for (int64_t i = 0; i < nt; i++) {
            int64_t row = base + i * tok_stride;
            vf d[PA_MAX_G];
            for (int g = 0; g < G; g++) d[g] = v_zero();
            for (int64_t c = 0; c < D; c += PA_W) {
                vf kv = load_row(k_cache, row + c, bf16);
                for (int g = 0; g < G; g++) d[g] = v_fma(v_load(qf + g * D + c), kv, d[g]);
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
                vf vv = load_row(v_cache, base + i * tok_stride + c, bf16);
                for (int g = 0; g < G; g++) a[g] = v_fma(v_set1(s[g][i]), vv, a[g]);
            }
            for (int g = 0; g < G; g++) v_store(acc + g * D + c, a[g]);
        }
        t += nt;
    }
}

/* Item (n, kh, part): attend, then write the normalised output (parts == 1) or the partial
 * (m, l, acc) to scratch for the combine pass. */
static inline __attribute__((always_inline)) void run_item(
    const int G, const int bf16, int64_t n, int64_t kh, int64_t part, int64_t nparts,
    const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int64_t Hkv, int64_t D,
    int64_t BS, float scale, void *out, int64_t out_row_stride, int64_t part_tokens, float *scratch) {
    float qf[PA_MAX_G * PA_MAX_D];
    float acc[PA_MAX_G * PA_MAX_D];
    float m[PA_MAX_G], l[PA_MAX_G];
    int64_t len = seq_lens[n];
    int64_t t0 = 0, t1 = len;
    if (nparts > 1) {
        t0 = part * part_tokens;
        t1 = t0 + part_tokens < len ? t0 + part_tokens : len;
    }
    int64_t qoff = n * q_row_stride + kh * G * D;
    for (int64_t i = 0; i < G * D; i++)
        qf[i] = scale * (bf16 ? bf16_to_f32(((const uint16_t *)q)[qoff + i]) : ((const float *)q)[qoff + i]);
    if (t0 < t1) {
        attend_range(qf, G, D, k_cache, v_cache, block_tables + n * bt_stride, BS, Hkv * D, kh * D, t0, t1,
                     m, l, acc, bf16);
    } else {
        for (int g = 0; g < G; g++) {
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * (size_t)G * (size_t)D);
    }
    if (nparts > 1) {
        float *dst = scratch + ((n * Hkv + kh) * nparts + part) * G * (D + 2);
        for (int g = 0; g < G; g++) {
            dst[g * (D + 2)] = m[g];
            dst[g * (D + 2) + 1] = l[g];
            memcpy(dst + g * (D + 2) + 2, acc + g * D, sizeof(float) * (size_t)D);
        }
        return;
    }
    int64_t ooff = n * out_row_stride + kh * G * D;
    for (int g = 0; g < G; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int64_t d = 0; d < D; d++) {
            float v = acc[g * D + d] * inv;
            if (bf16)
                ((uint16_t *)out)[ooff + g * D + d] = f32_to_bf16(v);
            else
                ((float *)out)[ooff + g * D + d] = v;
        }
    }
}

/* Sum the parts of (n, kh) into the output. */
static void combine(int64_t n, int64_t kh, int64_t nparts, int64_t G, int64_t Hkv, int64_t D,
                    const float *scratch, void *out, int64_t out_row_stride, int bf16) {
    const float *src = scratch + (n * Hkv + kh) * nparts * G * (D + 2);
    float acc[PA_MAX_D];
    for (int64_t g = 0; g < G; g++) {
        float mmax = -INFINITY;
        for (int64_t p = 0; p < nparts; p++) {
            float mp = src[(p * G + g) * (D + 2)];
            mmax = mp > mmax ? mp : mmax;
        }
        float total = 0.0f;
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (int64_t p = 0; p < nparts; p++) {
            const float *e = src + (p * G + g) * (D + 2);
            if (e[1] <= 0.0f) continue;
            float w = expf(e[0] - mmax);
            total += w * e[1];
            for (int64_t d = 0; d < D; d++) acc[d] += w * e[2 + d];
        }
        float inv = total > 0.0f ? 1.0f / total : 0.0f;
        int64_t ooff = n * out_row_stride + (kh * G + g) * D;
        for (int64_t d = 0; d < D; d++) {
            float v = acc[d] * inv;
            if (bf16)
                ((uint16_t *)out)[ooff + d] = f32_to_bf16(v);
            else
                ((float *)out)[ooff + d] = v;
        }
    }
}

#define PA_ITEM_ARGS                                                                                     \
    n, kh, part, nparts, q, q_row_stride, k_cache, v_cache, block_tables, bt_stride, seq_lens, Hkv, D, BS, \
        scale, out, out_row_stride, part_tokens, scratch

#define PA_CASE(GV)                                                                         \
    case GV:                                                                                \
        if (bf16)                                                                           \
            run_item(GV, 1, PA_ITEM_ARGS);                                                  \
        else                                                                                \
            run_item(GV, 0, PA_ITEM_ARGS);                                                  \
        break;

static void dispatch_item(int G, int bf16, int64_t n, int64_t kh, int64_t part, int64_t nparts, const void *q,
                          int64_t q_row_stride, const void *k_cache, const void *v_cache,
                          const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int64_t Hkv,
                          int64_t D, int64_t BS, float scale, void *out, int64_t out_row_stride,
                          int64_t part_tokens, float *scratch) {
    switch (G) { /* constant G: the per-head accumulators live in registers */
        PA_CASE(1) PA_CASE(2) PA_CASE(3) PA_CASE(4) PA_CASE(5) PA_CASE(6) PA_CASE(7) PA_CASE(8)
    default:
        if (bf16)
            run_item(G, 1, PA_ITEM_ARGS);
        else
            run_item(G, 0, PA_ITEM_ARGS);
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
    if (Hkv <= 0 || H % Hkv || D % PA_W || D > PA_MAX_D || BS <= 0 || (dtype != 0 && dtype != 1)) return -1;
    int64_t G = H / Hkv;
    if (G > PA_MAX_G) return -1;
    int bf16 = dtype == 1;
    int64_t nparts = 1;
    if (part_tokens > 0) {
        int64_t maxlen = 0;
        for (int64_t n = 0; n < N; n++) maxlen = seq_lens[n] > maxlen ? seq_lens[n] : maxlen;
        nparts = (maxlen + part_tokens - 1) / part_tokens;
        if (nparts < 1) nparts = 1;
    }
    float *scratch = NULL;
    if (nparts > 1) {
        scratch = (float *)malloc(sizeof(float) * (size_t)(N * Hkv * nparts * G * (D + 2)));
        if (!scratch) return -1;
    } else {
        part_tokens = 0;
    }
    int64_t items = N * Hkv * nparts;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1 && items > 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t part = it % nparts, nk = it / nparts;
        int64_t n = nk / Hkv, kh = nk % Hkv;
        dispatch_item((int)G, bf16, n, kh, part, nparts, q, q_row_stride, k_cache, v_cache, block_tables,
                      bt_stride, seq_lens, Hkv, D, BS, scale, out, out_row_stride, part_tokens, scratch);
    }
    if (nparts > 1) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && N * Hkv > 1)
        for (int64_t nk = 0; nk < N * Hkv; nk++)
            combine(nk / Hkv, nk % Hkv, nparts, G, Hkv, D, scratch, out, out_row_stride, bf16);
        free(scratch);
    }
    return 0;
}
