/* e^x on fp32 vectors, for every kernel in this directory (scalar code uses libm's expf).
 *
 * Cephes' expf polynomial, in two widths from one set of constants: exp256 (8 lanes, AVX2+FMA, 2^n
 * put together in the exponent bits) and exp512_nonpos (16 lanes, AVX-512F, x <= 0, 2^n by scalef).
 * For x in [-87, 0] both do the same operations lane by lane and 2^n is exact either way, so the
 * AVX2 and AVX-512 builds of the attention softmax (paged_attn.c, paged_attn_amx.c) and of the
 * sampling weights (sample_cpu.c) round alike; the fused fp32 SiLU (fused_cpu.c) uses exp256 too.
 *
 * exp512 (16 lanes, any x) is the bf16 SiLU's (fused_cpu.c, AVX512-BF16 builds): a degree-6 Taylor
 * form whose result is rounded to bf16. It is kept as it was rather than folded into the Cephes
 * form, which would move some bf16 SiLU outputs by one unit in the last place on those CPUs. */
#ifndef PAGEDSERVE_EXP_H
#define PAGEDSERVE_EXP_H
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f /* ln 2 = EXP_LN2_HI + EXP_LN2_LO, the first exact in few bits */
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500E-4f
#define EXP_P1 1.3981999507E-3f
#define EXP_P2 8.3334519073E-3f
#define EXP_P3 4.1665795894E-2f
#define EXP_P4 1.6666665459E-1f
#define EXP_P5 5.0000001201E-1f

#if defined(__AVX2__) && defined(__FMA__)
/* x clamped to [-87, 88] so 2^n stays a normal float (silu(-100) is then -100/e^88,
 * ~-6e-37, where torch gives -0). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
static inline __m512 exp512_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6 (rel. error ~2e-7, far below bf16's
 * 4e-3). Past ~88.7 scalef overflows to +inf as expf does (so silu(-100) is -0 as in torch); below
 * -88 the result stays at e^-88. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(127.0f)), _mm512_set1_ps(-88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
