/* Sixteen float32 lanes, for the kernels written once for AVX-512 and AVX2 (paged_attention.c, gelu.c, argmax.c):
 * one __m512 on AVX-512F, two __m256 halves (lanes 0-7 and 8-15) on AVX2 + FMA.
 *
 * Same bits on both: every operation is, lane by lane, the same IEEE float32 operation (the same multiply, add,
 * fused multiply-add, division, rounding to bfloat16, and e^x by the same steps: scalef(p, n) on AVX-512 and p times
 * 2^n built from n's bits on AVX2 are both p * 2^n rounded once), and the sum of the lanes follows GCC's
 * _mm512_reduce_add_ps on both: the halves added, then the quarters, then lanes (0 + 2) + (1 + 3). The kernels'
 * tests hold an AVX2 build (-march=haswell) equal to the native one.
 *
 * VEC16 is defined where one of the two is compiled in (and VEC16_WIDE on AVX-512, where a kernel may keep more
 * vectors in its 32 registers than in AVX2's 16: that changes which loads are shared, never a lane's arithmetic). */
#ifndef TOKENMILL_VEC16_H
#define TOKENMILL_VEC16_H
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define VEC16 1
#define VEC16_WIDE 1
#include "avx512_common.h"

typedef __m512 v16;
typedef __m512i v16i; /* sixteen int32 lanes */

static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_set1(float f) { return _mm512_set1_ps(f); }
static inline v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
/* the first n lanes of p (n may be under 16: the rest read nothing and hold `fill`) */
static inline v16 v16_load_first(const float *p, int64_t n, float fill) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first_lanes(n), p);
}
static inline void v16_store_first(float *p, int64_t n, v16 v) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
static inline v16 v16_load_bf16(const uint16_t *p) { return load_bf16(p); }
/* sixteen int8 codes as floats (exact) */
static inline v16 v16_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline void v16_store_bf16(uint16_t *p, v16 v) { _mm256_storeu_si256((__m256i *)p, to_bf16(v)); }
static inline v16 v16_round_bf16(v16 v) { return load_bf16_rounded(v); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v16_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
static inline v16 v16_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_abs(v16 v) { return _mm512_abs_ps(v); }
/* lanes where `x` < 0 take a, the others b */
static inline v16 v16_where_negative(v16 x, v16 a, v16 b) {
    return _mm512_mask_mov_ps(b, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), a);
}
static inline float v16_reduce_add(v16 v) { return _mm512_reduce_add_ps(v); }
/* Sixteen v16_reduce_adds at once: lane l of the result is the sum of v[v16_sum16_slot(l)], with the same additions
 * in the same pairs (lanes i + i + 8, then i + i + 4, then (0 + 2) + (1 + 3)), so the same bits, in 15 vector adds
 * and 30 shuffles where one at a time takes 16 x 4 adds and as many extracts and shuffles. Each step adds pairs of
 * vectors' partial sums side by side; after the last, the lanes come out as a 4 x 4 transpose of the inputs. */
static inline int v16_sum16_slot(int l) { return l % 4 * 4 + l / 4; }
static inline v16 v16_sum16(const v16 *v) {
    __m512 eight[8], four[4], two[2];
    for (int p = 0; p < 8; p++) /* lanes 0-7: v[2p]'s i + i + 8; lanes 8-15: v[2p + 1]'s */
        eight[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int p = 0; p < 4; p++) /* quarter q: v[4p + q]'s i + i + 4 */
        four[p] = _mm512_add_ps(_mm512_shuffle_f32x4(eight[2 * p], eight[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(eight[2 * p], eight[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int p = 0; p < 2; p++) /* quarter q: (0 + 2, 1 + 3) of v[8p + q], then of v[8p + 4 + q] */
        two[p] = _mm512_add_ps(_mm512_shuffle_ps(four[2 * p], four[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(four[2 * p], four[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* quarter q: the sums of v[q], v[4 + q], v[8 + q], v[12 + q] */
    return _mm512_add_ps(_mm512_shuffle_ps(two[0], two[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(two[0], two[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline float v16_reduce_max(v16 v) { return _mm512_reduce_max_ps(v); }
static inline v16 v16_exp_nonpositive(v16 x) { return exp_nonpositive(x); }

/* argmax's running best: lanes where v > best take v and index `at` */
static inline v16i v16i_iota(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline v16i v16i_add(v16i a, int32_t b) { return _mm512_add_epi32(a, _mm512_set1_epi32(b)); }
static inline void v16i_store(int32_t *p, v16i v) { _mm512_storeu_si512(p, v); }
static inline void v16_keep_greater(v16 v, v16i at, v16 *best, v16i *best_at) {
    __mmask16 greater = _mm512_cmp_ps_mask(v, *best, _CMP_GT_OQ);
    *best = _mm512_mask_mov_ps(*best, greater, v);
    *best_at = _mm512_mask_mov_epi32(*best_at, greater, at);
}
static inline int v16_any_nan(v16 v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }

#elif defined(__AVX2__) && defined(__FMA__)
#define VEC16 1
#include "avx2_common.h"

typedef struct {
    __m256 lo, hi;
} v16;
typedef struct {
    __m256i lo, hi;
} v16i;
#define V16(lo, hi) ((v16){lo, hi})

static inline v16 v16_zero(void) { return V16(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline v16 v16_set1(float f) { return V16(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
static inline v16 v16_load(const float *p) { return V16(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void v16_store(float *p, v16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline v16 v16_load_first(const float *p, int64_t n, float fill) {
    if (n >= 16) return v16_load(p);
    float lanes[16];
    for (int l = 0; l < 16; l++) lanes[l] = l < n ? p[l] : fill;
    return v16_load(lanes);
}
static inline void v16_store_first(float *p, int64_t n, v16 v) {
    if (n >= 16) {
        v16_store(p, v);
        return;
    }
    float lanes[16];
    v16_store(lanes, v);
    for (int l = 0; l < n; l++) p[l] = lanes[l];
}
static inline v16 v16_load_bf16(const uint16_t *p) { return V16(load_bf16_8(p), load_bf16_8(p + 8)); }
static inline __m256 load_i8_8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* sixteen int8 codes as floats (exact) */
static inline v16 v16_load_i8(const int8_t *p) { return V16(load_i8_8(p), load_i8_8(p + 8)); }
static inline void v16_store_bf16(uint16_t *p, v16 v) {
    _mm_storeu_si128((__m128i *)p, to_bf16_8(v.lo));
    _mm_storeu_si128((__m128i *)(p + 8), to_bf16_8(v.hi));
}
static inline v16 v16_round_bf16(v16 v) { return V16(round_bf16_8(v.lo), round_bf16_8(v.hi)); }
static inline v16 v16_add(v16 a, v16 b) { return V16(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline v16 v16_sub(v16 a, v16 b) { return V16(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline v16 v16_mul(v16 a, v16 b) { return V16(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline v16 v16_div(v16 a, v16 b) { return V16(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
static inline v16 v16_max(v16 a, v16 b) { return V16(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) {
    return V16(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline v16 v16_abs(v16 v) {
    __m256 sign = _mm256_set1_ps(-0.0f);
    return V16(_mm256_andnot_ps(sign, v.lo), _mm256_andnot_ps(sign, v.hi));
}
static inline __m256 where_negative_8(__m256 x, __m256 a, __m256 b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}
static inline v16 v16_where_negative(v16 x, v16 a, v16 b) {
    return V16(where_negative_8(x.lo, a.lo, b.lo), where_negative_8(x.hi, a.hi, b.hi));
}
/* GCC's _mm512_reduce_add_ps order: (hi + lo), its upper quarter + its lower, then (0 + 2) + (1 + 3) */
static inline float v16_reduce_add(v16 v) {
    __m256 eight = _mm256_add_ps(v.hi, v.lo);
    __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
    __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, _MM_SHUFFLE(0, 0, 0, 1))));
}
static inline float v16_reduce_max(v16 v) {
    __m256 eight = _mm256_max_ps(v.hi, v.lo);
    __m128 four = _mm_max_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
    __m128 two = _mm_max_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ss(two, _mm_shuffle_ps(two, two, _MM_SHUFFLE(0, 0, 0, 1))));
}
static inline v16 v16_exp_nonpositive(v16 x) { return V16(exp_nonpositive_8(x.lo), exp_nonpositive_8(x.hi)); }

static inline v16i v16i_iota(void) {
    return (v16i){_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
}
static inline v16i v16i_add(v16i a, int32_t b) {
    __m256i s = _mm256_set1_epi32(b);
    return (v16i){_mm256_add_epi32(a.lo, s), _mm256_add_epi32(a.hi, s)};
}
static inline void v16i_store(int32_t *p, v16i v) {
    _mm256_storeu_si256((__m256i *)p, v.lo);
    _mm256_storeu_si256((__m256i *)(p + 8), v.hi);
}
static inline void keep_greater_8(__m256 v, __m256i at, __m256 *best, __m256i *best_at) {
    __m256 greater = _mm256_cmp_ps(v, *best, _CMP_GT_OQ);
    *best = _mm256_blendv_ps(*best, v, greater);
    *best_at = _mm256_blendv_epi8(*best_at, at, _mm256_castps_si256(greater));
}
static inline void v16_keep_greater(v16 v, v16i at, v16 *best, v16i *best_at) {
    keep_greater_8(v.lo, at.lo, &best->lo, &best_at->lo);
    keep_greater_8(v.hi, at.hi, &best->hi, &best_at->hi);
}
static inline int v16_any_nan(v16 v) {
    __m256 nan = _mm256_or_ps(_mm256_cmp_ps(v.lo, v.lo, _CMP_UNORD_Q), _mm256_cmp_ps(v.hi, v.hi, _CMP_UNORD_Q));
    return _mm256_movemask_ps(nan) != 0;
}
#endif

#endif
