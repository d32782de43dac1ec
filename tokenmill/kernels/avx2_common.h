/* What the AVX2 paths share: float32 -> bfloat16 rounding, 8 lanes at a time. */
#ifndef TOKENMILL_AVX2_COMMON_H
#define TOKENMILL_AVX2_COMMON_H
#include <immintrin.h>

/* float32 -> bf16 for 8 lanes, round to nearest even; NaN stays NaN */
static inline __m128i to_bf16_8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    __m256i high = _mm256_srli_epi32(rounded, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}

#endif
