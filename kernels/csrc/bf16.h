/* bf16 <-> fp32 for one value, shared by every kernel in this directory (included, so each
 * library keeps its own build). bf16 is the upper half of an fp32: widening is exact; narrowing
 * rounds to nearest even and keeps a NaN a (quiet) NaN, as torch does. */
#ifndef PAGEDSERVE_BF16_H
#define PAGEDSERVE_BF16_H
#include <stdint.h>
#include <string.h>

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
#endif
