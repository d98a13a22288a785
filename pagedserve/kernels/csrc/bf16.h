/* bf16 <-> fp32, shared by every kernel in this directory (included, so each library keeps its own
 * build). bf16 is the upper half of an fp32: widening is exact; narrowing rounds to nearest even
 * and keeps a NaN a (quiet) NaN, as torch does. The scalar forms everywhere; the vector widenings
 * where the including file is built for them: 8 lanes (AVX2), 16 lanes (AVX-512F), 16 lanes from a
 * masked load (AVX-512 BW+VL). */
#ifndef PAGEDSERVE_BF16_H
#define PAGEDSERVE_BF16_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                             /* nearest even */
    return (uint16_t)(u >> 16);
}

#if defined(__AVX2__)
/* 8 bf16 words (in a register, or at p) -> 8 fp32 lanes */
static inline __m256 bf16w8_to_ps(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
static inline __m256 bf16x8_to_ps(const uint16_t *p) { return bf16w8_to_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

#if defined(__AVX512F__)
/* 16 bf16 words (in a register, or at p) -> 16 fp32 lanes */
static inline __m512 bf16w16_to_ps(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
static inline __m512 bf16x16_to_ps(const uint16_t *p) { return bf16w16_to_ps(_mm256_loadu_si256((const __m256i *)p)); }
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* the lanes of m read from p (the others 0, their memory untouched) -> 16 fp32 lanes */
static inline __m512 bf16x16_maskz_to_ps(__mmask16 m, const uint16_t *p) {
    return bf16w16_to_ps(_mm256_maskz_loadu_epi16(m, p));
}
#endif
#endif
