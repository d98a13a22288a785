/* Vector helpers more than one kernel uses (bf16 widening lives in bf16.h, fp8 in fp8.h, e^x in
 * exp.h), in the widths the including file is built for. */
#ifndef PAGEDSERVE_SIMD_H
#define PAGEDSERVE_SIMD_H
#if defined(__AVX2__)
#include <immintrin.h>

/* The sum of 8 fp32 lanes, always in this order ((0+4)+(2+6))+((1+5)+(3+7)), so every kernel's
 * AVX2 build sums a vector alike. */
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif
#endif
