/* bfloat16 <-> float32 for 16 lanes at a time, shared by the AVX-512 kernels (int8_matmul.c, paged_attention.c). */
#ifndef TOKENMILL_BF16_AVX512_H
#define TOKENMILL_BF16_AVX512_H
#include <immintrin.h>
#include <stdint.h>

/* 16 bf16 -> float32 (exact: bf16 is float32's upper half) */
static inline __m512 load_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* float32 -> bf16, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN (quiet) */
static inline __m256i to_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

#endif
