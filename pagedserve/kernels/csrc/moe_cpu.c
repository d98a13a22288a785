/* A mixture-of-experts block's decode step in one call (kernels/moe_cpu.py): router logits, softmax,
 * top-k (optionally renormalised), and for every active expert its gate/up linear, SiLU-and-mul,
 * down linear and the weighted sum into the output rows.
 *
 * Why: on a 12-layer Qwen3-MoE GGUF model the eager block spent ~220 us a layer in the torch ops
 * between its kernel calls (routing, sort, bincount, index_select, chunk, silu, mul, index_add)
 * against ~190 us in the kernels themselves (loadtest/PERF.md, "Where a token goes"). Here the
 * only work besides the linears is a few loops over a few KB.
 *
 * The linears are not computed here: every one (the router's, each expert's gate/up and down) is a
 * fz_linear (csrc/exports.h) naming the kernel that reads its weight, passed by address from
 * Python: plain fp32 rows go to fused_cpu.c's fz_gemv_f32, packed q8_0 / q4_1 rows to qgemm.c's row
 * kernels (or qgemm_n16.c's 16-channel ones on VNNI CPUs). Each library keeps its own build and
 * flags, and this file links none of them. A kernel's result for a row does not depend on the other
 * rows of its call (design invariant), so grouping rows by expert changes no row's result.
 *
 * Same results as the eager block (gpu/models/moe.py), up to the order of float additions in the
 * softmax (the router's logits come from the same GEMV there: SparseMoeBlock.router_logits), the
 * experts' SiLU (torch's there, silu.h here) and fp32 experts' GEMM (torch's there, fz_gemv_f32
 * here): probabilities in fp32, the k largest in descending order (ties to the lower
 * expert id, where torch.topk's choice among equal values is unspecified), divided by their sum when
 * renormalising; experts visited in ascending id, tokens ascending within one, and each output row
 * accumulated as out += (y * w) in that order, as index_add_ does. Activations are fp32. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"
#include "exports.h"
#include "silu.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MOE_MAX_M 16 /* rows one call takes: decode batches (prefill runs the eager block) */
#define MOE_BAD_ARGS (-1)
#define MOE_NO_MEMORY (-2)
#define MOE_KERNEL_FAILED (-3) /* a linear's kernel found no memory for its scratch */

int moe_isa(void) {
#if defined(__AVX512F__)
    return 3;
#elif defined(__AVX2__) && defined(__FMA__)
    return 2;
#else
    return 0;
#endif
}

int moe_max_m(void) { return MOE_MAX_M; }

/* The signatures every linear of a fz_linear shares with its kind: fz_gemv_f32 (plain fp32 rows),
 * qg_q8_mm / qn_q8_mm, qg_int4_mm / qn_q4_mm. */
typedef int (*moe_f32_fn)(const float *, int64_t, int64_t, const float *, int64_t, float *, int);
typedef int (*moe_q8_fn)(const void *, int64_t, int64_t, const void *, const void *, const float *, void *,
                         int64_t, int, int);
typedef int (*moe_q4_fn)(const void *, int64_t, int64_t, const void *, const void *, const void *,
                         const float *, void *, int64_t, int, int);

/* y[M][N] = x[M][K] @ W^T in fp32 by the kernel L names. 0, or MOE_KERNEL_FAILED. */
static int linear(const fz_linear *L, const float *x, int64_t M, int64_t K, int64_t N, float *y, int nthreads) {
    void *fn = L->big != NULL && L->big_rows > 0 && M >= L->big_rows ? L->big : L->small;
    int rc;
    if (L->kind == 0)
        rc = ((moe_f32_fn)fn)(x, M, K, (const float *)L->w, N, y, nthreads);
    else if (L->kind == 1)
        rc = ((moe_q8_fn)fn)(x, M, K, L->w, L->d, NULL, y, N, nthreads, 0);
    else
        rc = ((moe_q4_fn)fn)(x, M, K, L->w, L->d, L->mn, NULL, y, N, nthreads, 0);
    return rc ? MOE_KERNEL_FAILED : 0;
}

/* One row's routing: probs = softmax(logits[E]) in place, then the k largest (descending, the
 * lower id first among equals) into ids[k] / w[k], divided by their sum when renorm. */
static void route_row(float *p, int64_t E, int64_t k, int renorm, unsigned char *taken, int64_t *ids, float *w) {
    float mx = p[0];
    for (int64_t e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
    float sum = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        p[e] = expf(p[e] - mx);
        sum += p[e];
    }
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    memset(taken, 0, (size_t)E);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = 1;
        ids[j] = best;
        w[j] = p[best];
    }
    if (renorm) {
        float s = 0.0f;
        for (int64_t j = 0; j < k; j++) s += w[j];
        for (int64_t j = 0; j < k; j++) w[j] /= s;
    }
}

/* out[M][H] = the block's output for x[M][H] (fp32, contiguous). router: [E] logits' linear (K = H,
 * N = E); w13[E] each expert's gate rows then up rows (K = H, N = 2I); w2[E] its down (K = I, N = H).
 * route_w [M][k] / route_ids [M][k], when not NULL, receive the routing (tests). Returns 0,
 * MOE_BAD_ARGS (M outside 1..MOE_MAX_M, k outside 1..E), MOE_NO_MEMORY, or MOE_KERNEL_FAILED. */
int moe_decode(const float *x, int64_t M, int64_t H, const fz_linear *router, int64_t E, int64_t top_k,
               int renorm, const fz_linear *w13, const fz_linear *w2, int64_t I, float *out, float *route_w,
               int64_t *route_ids, int nthreads) {
    if (M < 1 || M > MOE_MAX_M || top_k < 1 || top_k > E || H < 1 || I < 1) return MOE_BAD_ARGS;
    if (nthreads < 1) nthreads = 1;
    const int64_t P = M * top_k; /* (token, expert) pairs */
    /* one buffer: logits [M][E], pair weights [P], pair ids [P], pair order [P], counts [E], taken [E],
     * then per active expert: gathered rows [M][H], gate/up [M][2I], SiLU [M][I], down [M][H] */
    size_t floats = (size_t)(M * E + P + M * H + M * 2 * I + M * I + M * H);
    size_t bytes = sizeof(float) * floats + sizeof(int64_t) * (size_t)(2 * P + E) + (size_t)E + 64;
    char *buf = (char *)malloc(bytes);
    if (!buf) return MOE_NO_MEMORY;
    float *logits = (float *)buf, *pw = logits + M * E, *xe = pw + P, *h = xe + M * H, *a = h + M * 2 * I,
          *y = a + M * I;
    int64_t *pid = (int64_t *)(y + M * H), *order = pid + P, *counts = order + P;
    unsigned char *taken = (unsigned char *)(counts + E);
    int rc = linear(router, x, M, H, E, logits, nthreads);
    if (rc) goto done;
    for (int64_t m = 0; m < M; m++)
        route_row(logits + m * E, E, top_k, renorm, taken, pid + m * top_k, pw + m * top_k);
    if (route_w) memcpy(route_w, pw, sizeof(float) * (size_t)P);
    if (route_ids) memcpy(route_ids, pid, sizeof(int64_t) * (size_t)P);
    /* pairs sorted by expert, stable (a counting sort): expert e owns order[start_e .. start_e + counts[e]) */
    memset(counts, 0, sizeof(int64_t) * (size_t)E);
    for (int64_t p = 0; p < P; p++) counts[pid[p]]++;
    int64_t start = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t c = counts[e];
        counts[e] = start;
        start += c;
    }
    for (int64_t p = 0; p < P; p++) order[counts[pid[p]]++] = p;
    memset(out, 0, sizeof(float) * (size_t)(M * H));
    for (int64_t e = 0, s = 0; e < E; e++) { /* counts[e] is now the end of e's run */
        int64_t n = counts[e] - s;
        if (n == 0) continue;
        for (int64_t r = 0; r < n; r++) memcpy(xe + r * H, x + order[s + r] / top_k * H, sizeof(float) * (size_t)H);
        if ((rc = linear(&w13[e], xe, n, H, 2 * I, h, nthreads))) goto done;
        silu_mul_f32(h, n, I, a); /* (silu.h: the fused dense layer's rounding) */
        if ((rc = linear(&w2[e], a, n, I, H, y, nthreads))) goto done;
        for (int64_t r = 0; r < n; r++) {
            float wgt = pw[order[s + r]], *o = out + order[s + r] / top_k * H;
            const float *yr = y + r * H;
            for (int64_t i = 0; i < H; i++) {
                float t = yr[i] * wgt;
                o[i] += t;
            }
        }
        s = counts[e];
    }
done:
    free(buf);
    return rc;
}
