/* fp8 e4m3fn, the element of an 8-bit KV cache (--kv-cache-dtype fp8): 1 sign, 4 exponent bits
 * (bias 7), 3 mantissa bits, no infinities, 0x7f / 0xff NaN, largest finite 448, subnormal step
 * 2^-9. Encoding rounds to nearest even and saturates at +-448 (infinities too), as torch's
 * .to(torch.float8_e4m3fn) does, so the C writers and the torch writer store the same bytes.
 * Decoding is exact: AVX-512 builds the bf16 bits with integer ops (fp8_words_to_bf16); AVX2 moves
 * the byte's bits into an fp16's (exponent bias 15: the value times 2^-8) for vcvtph2ps, which
 * converts fp16 subnormals exactly (no DAZ).
 *
 * Vector forms where the including file is built for them: AVX-512 (16 or 32 lanes), AVX2 with
 * F16C (8 lanes); the scalar forms everywhere.
 */
#ifndef PAGEDSERVE_FP8_H
#define PAGEDSERVE_FP8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define FP8_MAX_BITS 0x43e00000u  /* 448.0f */
#define FP8_MIN_NORMAL 0x3c800000u /* 2^-6 */

static inline uint8_t fp8_from_f32(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    uint32_t s = (b >> 24) & 0x80, a = b & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(s | 0x7f); /* NaN */
    if (a >= FP8_MAX_BITS) return (uint8_t)(s | 0x7e);
    if (a < FP8_MIN_NORMAL) { /* subnormal: a multiple of 2^-9; 8 of them is the smallest normal */
        float f;
        memcpy(&f, &a, 4);
        return (uint8_t)(s | (uint32_t)lrintf(f * 512.0f));
    }
    a += 0x7ffffu + ((a >> 20) & 1); /* round the 20 dropped mantissa bits to nearest even */
    return (uint8_t)(s | ((a - (120u << 23)) >> 20));
}

static inline float fp8_to_f32(uint8_t x) {
    float m = ldexpf((float)(x & 7), -3), v;
    int e = (x >> 3) & 15;
    v = e ? ldexpf(1.0f + m, e - 7) : ldexpf(m, -6);
    return x & 0x80 ? -v : v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* 16 fp32 -> 16 fp8 bytes */
static inline __m128i fp8x16_from_ps(__m512 x) {
    const __m512i b = _mm512_castps_si512(x), one = _mm512_set1_epi32(1);
    const __m512i s = _mm512_and_si512(_mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80));
    const __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
    __m512i r = _mm512_add_epi32(a, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff),
                                                     _mm512_and_si512(_mm512_srli_epi32(a, 20), one)));
    r = _mm512_srli_epi32(_mm512_sub_epi32(r, _mm512_set1_epi32(120 << 23)), 20);
    __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((int)FP8_MIN_NORMAL)), sub);
    r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32((int)FP8_MAX_BITS)),
                              _mm512_set1_epi32(0x7e));
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(r, s));
}

/* fp8 bytes in 16-bit lanes (zero-extended) -> the bf16 bits of their values, exactly (3 mantissa bits
 * fit in 7), with integer ops: a normal value's bf16 is its exponent and mantissa bits shifted up by 4
 * plus the exponent bias difference (120 << 7); the 8 subnormal magnitudes come from a table; the
 * sign moves to bit 15. 9 operations for 32 values (an fp16 route with vcvtph2ps took ~14, and the
 * AMX kernel converts every K and V element). Lanes holding 0 give 0. */
static inline __m512i fp8_words_to_bf16(__m512i w) {
    const __m512i sub = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0x3c60, 0x3c40, 0x3c20, 0x3c00, 0x3bc0, 0x3b80, 0x3b00, 0); /* m * 2^-9 */
    __m512i em = _mm512_and_si512(w, _mm512_set1_epi16(0x7f));
    __m512i r = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(0x3c00));
    r = _mm512_mask_permutexvar_epi16(r, _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8)), em, sub);
    const __m512i sign = _mm512_set1_epi16((short)0x8000);
    return _mm512_ternarylogic_epi32(sign, _mm512_slli_epi16(w, 8), r, 0xca); /* sign bit from w << 8, rest r */
}

/* 32 fp8 bytes -> 32 bf16, in order */
static inline __m512i fp8x32_to_bf16(const uint8_t *p) {
    return fp8_words_to_bf16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p)));
}

/* 16 fp8 bytes -> 16 fp32: each byte in the low word of a dword lane (the high words give bf16 0,
 * shifted out), then bf16 -> fp32 is a shift */
static inline __m512 fp8x16_to_ps(const uint8_t *p) {
    __m512i b = fp8_words_to_bf16(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
/* 8 fp8 bytes -> 8 fp32 */
static inline __m256 fp8x8_to_ps(const uint8_t *p) {
    __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                             _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
#endif

/* n fp32 or bf16 (src_bf16) values -> n fp8 bytes */
static inline void fp8_encode_row(const void *src, int src_bf16, int64_t n, uint8_t *dst) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; i + 16 <= n; i += 16) {
        __m512 x;
        if (src_bf16) {
            x = bf16x16_to_ps((const uint16_t *)src + i);
        } else {
            x = _mm512_loadu_ps((const float *)src + i);
        }
        _mm_storeu_si128((__m128i *)(dst + i), fp8x16_from_ps(x));
    }
#endif
    for (; i < n; i++) {
        float x;
        if (src_bf16) {
            uint32_t b = (uint32_t)((const uint16_t *)src)[i] << 16;
            memcpy(&x, &b, 4);
        } else {
            x = ((const float *)src)[i];
        }
        dst[i] = fp8_from_f32(x);
    }
}

#endif
