/* a[M][I] = silu(h[:, :I]) * h[:, I:] in fp32: the gated MLP's activation, shared by the fused dense
 * layer (fused_cpu.c) and the MoE experts' step (moe_cpu.c) so both round a row alike (exp.h's
 * exp256 on AVX2+FMA builds, libm's expf elsewhere). Included, so each library keeps its own copy. */
#ifndef PAGEDSERVE_SILU_H
#define PAGEDSERVE_SILU_H
#include <math.h>
#include <stdint.h>

#include "exp.h"

static void silu_mul_f32(const float *h, int64_t M, int64_t I, float *a) {
    for (int64_t m = 0; m < M; m++) {
        const float *g = h + m * 2 * I, *u = g + I;
        float *o = a + m * I;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

#endif
