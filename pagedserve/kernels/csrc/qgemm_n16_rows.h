/* The n16 layout's portable readers (csrc/qgemm_n16.c, the VNNI build, and csrc/qgemm_n16_avx2.c):
 * one code or scale by position, a row widened to fp32, and the exported row lookups (embedding
 * rows of a quantized table), and the store of a block's 16-channel results. Included, so each
 * library keeps its own copy of the code. Needs QN_GROUP, QN_Y_BF16, bf16.h and F16C. */
#ifndef PAGEDSERVE_QGEMM_N16_ROWS_H
#define PAGEDSERVE_QGEMM_N16_ROWS_H

/* Rows [m0, m0 + mr) of a block's 16 channels (facc, 16 floats a row) + bias into y, fp32 or bf16. */
static inline void write_block(void *y, int64_t m0, int64_t mr, int64_t N, int64_t n0, const float *facc,
                               const float *bias, int flags) {
    int nv = (int)(N - n0 < 16 ? N - n0 : 16);
    for (int64_t r = 0; r < mr; r++) {
        const float *f = facc + 16 * r;
        int64_t o = (m0 + r) * N + n0;
        if (flags & QN_Y_BF16) {
            uint16_t *yo = (uint16_t *)y + o;
            for (int c = 0; c < nv; c++) yo[c] = f32_to_bf16(f[c] + (bias ? bias[n0 + c] : 0.0f));
        } else {
            float *yo = (float *)y + o;
            for (int c = 0; c < nv; c++) yo[c] = f[c] + (bias ? bias[n0 + c] : 0.0f);
        }
    }
}

static inline int q4_code(const uint16_t *w, int64_t G, int64_t n, int64_t k) {
    int64_t b = n >> 4, g = k >> 5;
    int c = (int)(n & 15), kk = (int)(k & 31), j = kk >> 1, e = kk & 1;
    uint16_t word = w[(b * G + g) * 128 + (j >> 2) * 32 + 2 * c + e];
    return (word >> (4 * (j & 3))) & 0xF;
}

static inline int q8_code(const int8_t *w, int64_t G, int64_t n, int64_t k) {
    int64_t b = n >> 4, g = k >> 5;
    int c = (int)(n & 15), kk = (int)(k & 31);
    return w[(b * G + g) * 512 + (kk >> 1) * 32 + 2 * c + (kk & 1)];
}

static inline float scale_at(const uint16_t *s, int64_t G, int64_t n, int64_t g) {
    return _cvtsh_ss(s[((n >> 4) * G + g) * 16 + (n & 15)]);
}

/* One row n of W (K values) as fp32 into buf. */
static void row_f32(const void *w, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t n, float *buf, int is_q4) {
    int64_t G = K / QN_GROUP;
    for (int64_t g = 0; g < G; g++) {
        float dg = scale_at(d, G, n, g), mg = is_q4 ? scale_at(mn, G, n, g) : 0.0f;
        for (int64_t k = g * QN_GROUP; k < (g + 1) * QN_GROUP; k++)
            buf[k] = is_q4 ? dg * (float)q4_code((const uint16_t *)w, G, n, k) + mg
                           : dg * (float)q8_code((const int8_t *)w, G, n, k);
    }
}

static void store_row(void *out, int64_t off, const float *buf, int64_t K, int flags) {
    if (flags & QN_Y_BF16) {
        uint16_t *o = (uint16_t *)out + off;
        for (int64_t k = 0; k < K; k++) o[k] = f32_to_bf16(buf[k]);
    } else {
        memcpy((float *)out + off, buf, sizeof(float) * (size_t)K);
    }
}

static void rows(const void *w, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t N, const int64_t *ids,
                 int64_t n_ids, void *out, int flags, int is_q4) {
    float *buf = (float *)calloc((size_t)K + 1, sizeof(float));
    if (!buf) return;
    for (int64_t i = 0; i < n_ids; i++) {
        int64_t r = ids[i];
        if (r < 0 || r >= N)
            memset(buf, 0, sizeof(float) * (size_t)K);
        else
            row_f32(w, d, mn, K, r, buf, is_q4);
        store_row(out, i * K, buf, K, flags);
    }
    free(buf);
}

void qn_q4_rows(const uint16_t *w, const uint16_t *d, const uint16_t *mn, int64_t K, int64_t N, const int64_t *ids,
                int64_t n_ids, void *out, int flags) {
    rows(w, d, mn, K, N, ids, n_ids, out, flags, 1);
}

void qn_q8_rows(const int8_t *w, const uint16_t *d, int64_t K, int64_t N, const int64_t *ids, int64_t n_ids, void *out,
                int flags) {
    rows(w, d, NULL, K, N, ids, n_ids, out, flags, 0);
}


/* The row layout (kernels/qgemm.py LAYOUTS: per row, per group of 32, q4_1 bytes j holding values j
 * and j + 16, or q8_0 bytes in order; fp16 scales [N][G]) re-laid as n16 at load time (the order
 * csrc/qgemm_n16.c documents; channels past N get zero codes and scales). Torch's permutes did
 * this in ~8 s for the default model, longer than the whole rest of a cold start. Every output
 * byte is written (the caller need not zero them). */
static inline void repack_scales(const uint16_t *s, int64_t N, int64_t G, int64_t b, uint16_t *out) {
    for (int64_t g = 0; g < G; g++)
        for (int c = 0; c < 16; c++) {
            int64_t n = 16 * b + c;
            out[(b * G + g) * 16 + c] = n < N ? s[n * G + g] : 0;
        }
}

void qn_q4_repack(const uint8_t *w4, const uint16_t *d, const uint16_t *mn, int64_t N, int64_t K, uint16_t *w_out,
                  uint16_t *d_out, uint16_t *mn_out, int nthreads) {
    const int64_t G = K / QN_GROUP, NB = (N + 15) / 16;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < NB; b++) {
        repack_scales(d, N, G, b, d_out);
        repack_scales(mn, N, G, b, mn_out);
        memset(w_out + b * G * 128, 0, sizeof(uint16_t) * (size_t)(G * 128));
        for (int c = 0; c < 16 && 16 * b + c < N; c++) {
            const uint8_t *row = w4 + (16 * b + c) * (K / 2);
            for (int64_t g = 0; g < G; g++) {
                uint16_t *wg = w_out + (b * G + g) * 128 + 2 * c;
                for (int jb = 0; jb < 16; jb++) { /* byte jb: values jb (low nibble) and jb + 16 */
                    const int e = jb & 1, j0 = jb >> 1, j1 = 8 + (jb >> 1); /* their input pairs */
                    const uint8_t byte = row[g * 16 + jb];
                    wg[(j0 >> 2) * 32 + e] |= (uint16_t)((byte & 0xF) << (4 * (j0 & 3)));
                    wg[(j1 >> 2) * 32 + e] |= (uint16_t)((byte >> 4) << (4 * (j1 & 3)));
                }
            }
        }
    }
}

void qn_q8_repack(const int8_t *w8, const uint16_t *d, int64_t N, int64_t K, int8_t *w_out, uint16_t *d_out,
                  int nthreads) {
    const int64_t G = K / QN_GROUP, NB = (N + 15) / 16;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < NB; b++) {
        repack_scales(d, N, G, b, d_out);
        memset(w_out + b * G * 512, 0, (size_t)(G * 512));
        for (int c = 0; c < 16 && 16 * b + c < N; c++) {
            const int8_t *row = w8 + (16 * b + c) * K;
            for (int64_t g = 0; g < G; g++)
                for (int kk = 0; kk < QN_GROUP; kk++)
                    w_out[(b * G + g) * 512 + (kk >> 1) * 32 + 2 * c + (kk & 1)] = row[g * QN_GROUP + kk];
        }
    }
}

#endif
