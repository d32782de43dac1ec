/* bfloat16 <-> float32 one value at a time, for the scalar paths (the SIMD ones are in avx512_common.h and
 * avx2_common.h). bfloat16 values travel as their uint16_t bits. */
#ifndef TOKENMILL_BF16_H
#define TOKENMILL_BF16_H
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

/* exact: bf16 is float32's upper half */
static inline float bf16_to_float(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN (quiet) */
static inline bf16 float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

#endif
