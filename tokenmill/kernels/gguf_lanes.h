/* The sixteen lanes of the GGUF kernels (gguf_packed.h includes this): a group's 16 output columns as int32 sums
 * (ivec) and float32 accumulators (fvec), one register on AVX-512 (WITH_VNNI), two halves on AVX2 (columns 0-7 and
 * 8-15). The integer products are exact on both, and every float operation is the same IEEE operation lane by lane:
 * the same bits (gguf_matmul.c says why the sums are exact). */
#ifndef TOKENMILL_GGUF_LANES_H
#define TOKENMILL_GGUF_LANES_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx2_common.h"

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

#if defined(WITH_VNNI)
#include "avx512_common.h"

typedef __m512i ivec;
typedef __m512 fvec;
static inline ivec iv_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline ivec iv_zero(void) { return _mm512_setzero_si512(); }
static inline ivec iv_low4(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
static inline ivec iv_high4(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
/* u (4-bit codes) with the bits of h's bytes from bit `at` up, under `mask` once moved to bit 4 (Q5's fifth bit:
 * one bit, mask 0x10; Q6_K's two): h shifted in 16-bit lanes (a neighbour byte's bits only land outside the mask)
 * and merged in one ternary op, (h' & mask) | u */
static inline ivec iv_with_high_bits(ivec u, ivec h, int at, char mask) {
    ivec t = at < 4 ? _mm512_slli_epi16(h, 4 - at) : at > 4 ? _mm512_srli_epi16(h, at - 4) : h;
    return _mm512_ternarylogic_epi32(t, u, _mm512_set1_epi8(mask), 0xEC);
}
/* Q8_0's signed codes made unsigned (+128; subtracted back through the activation sums) */
static inline ivec iv_signed_codes(ivec v) { return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)); }
/* acc += u's unsigned bytes . the four signed bytes at x4, in each lane. The four bytes go as the instruction's own
 * broadcast operand (m32bcst): GCC's intrinsic with _mm512_set1_epi32 emits a separate vpbroadcastd before each
 * vpdpbusd, an extra instruction for every product of the many-row loops. The same integer sums. */
static inline ivec iv_dot(ivec acc, ivec u, const int8_t *x4) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)x4));
    return acc;
}
static inline ivec iv_magnitude(ivec v) { return v; } /* unused: the codes went unsigned */
static inline ivec iv_dot_signed(ivec acc, ivec u, ivec magnitude, const int8_t *x4) {
    (void)magnitude;
    return iv_dot(acc, u, x4);
}
/* two steps of unsigned codes at most 63 (every type but Q8_0) */
static inline ivec iv_dot2(ivec acc, ivec u0, const int8_t *x0, ivec u1, const int8_t *x1) {
    return iv_dot(iv_dot(acc, u0, x0), u1, x1);
}
#define Q8_0_OFFSET 128
static inline ivec iv_set1(int32_t s) { return _mm512_set1_epi32(s); }
static inline ivec iv_add(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
static inline ivec iv_i8_lanes(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline fvec fv_u8_lanes(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline fvec fv_fp16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline fvec fv_zero(void) { return _mm512_setzero_ps(); }
static inline fvec fv_set1(float f) { return _mm512_set1_ps(f); }
static inline fvec fv_cvt(ivec v) { return _mm512_cvtepi32_ps(v); }
static inline fvec fv_mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
static inline fvec fv_sub(fvec a, fvec b) { return _mm512_sub_ps(a, b); }
static inline fvec fv_fma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
static inline void fv_store(float *p, fvec v) { _mm512_storeu_ps(p, v); }
static inline fvec fv_load(const float *p) { return _mm512_loadu_ps(p); }
static inline fvec fv_add(fvec a, fvec b) { return _mm512_add_ps(a, b); }
static inline fvec fv_max(fvec a, fvec b) { return _mm512_max_ps(a, b); }
static inline fvec fv_abs(fvec a) { return _mm512_abs_ps(a); }
static inline int fv_any_ge(fvec a, fvec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ) != 0; }
static inline float fv_reduce_max(fvec a) { return _mm512_reduce_max_ps(a); }
static inline float fv_reduce_add(fvec a) { return _mm512_reduce_add_ps(a); }
static inline ivec iv_sub(ivec a, ivec b) { return _mm512_sub_epi32(a, b); }
static inline ivec iv_times8(ivec a) { return _mm512_slli_epi32(a, 3); }
/* 16 lanes to out as float32, or rounded to bf16 (nearest even, NaN kept) */
static inline void fv_store_out(void *out, fvec v, int float_out) {
    if (float_out)
        _mm512_storeu_ps(out, v);
    else
        _mm256_storeu_si256((__m256i *)out, to_bf16(v));
}
#define ROW_STEP 4 /* rows in flight per decoded sub-block: 8 codes + 4 sums + 4 accumulators of 32 registers */
#else
/* AVX2: the integer dot products by vpmaddubsw + vpmaddwd. Exact: the int16 pair sums cannot saturate, the
 * unsigned codes being at most 63 (2 * 128 * 127 would still fit), Q8_0's |w| at most 128 against |x| <= 127. */

/* lanes j = sum over i in [4j, 4j+4) of u[i] * x[i], for unsigned codes u */
static inline __m256i dot_unsigned(__m256i u, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

typedef struct {
    __m256i a, b;
} ivec;
typedef struct {
    __m256 a, b;
} fvec;
#define IV2(expr_a, expr_b) ((ivec){expr_a, expr_b})
#define FV2(expr_a, expr_b) ((fvec){expr_a, expr_b})
static inline ivec iv_load(const uint8_t *p) { return IV2(load32(p), load32(p + 32)); }
static inline ivec iv_zero(void) { return IV2(_mm256_setzero_si256(), _mm256_setzero_si256()); }
static inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
static inline ivec iv_low4(ivec v) { return IV2(low4(v.a), low4(v.b)); }
static inline ivec iv_high4(ivec v) { return IV2(low4(_mm256_srli_epi16(v.a, 4)), low4(_mm256_srli_epi16(v.b, 4))); }
/* as on AVX-512: h's bits from bit `at` moved to bit 4 in 16-bit lanes, (h' & mask) | u */
static inline __m256i with_high_bits(__m256i u, __m256i h, int at, char mask) {
    __m256i t = at < 4 ? _mm256_slli_epi16(h, 4 - at) : at > 4 ? _mm256_srli_epi16(h, at - 4) : h;
    return _mm256_or_si256(u, _mm256_and_si256(t, _mm256_set1_epi8(mask)));
}
static inline ivec iv_with_high_bits(ivec u, ivec h, int at, char mask) {
    return IV2(with_high_bits(u.a, h.a, at, mask), with_high_bits(u.b, h.b, at, mask));
}
static inline ivec iv_signed_codes(ivec v) { return v; }
/* the four signed bytes at p in every 32-bit lane */
static inline __m256i set1_four(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline ivec iv_dot(ivec acc, ivec u, const int8_t *x4) {
    __m256i x = set1_four(x4);
    return IV2(_mm256_add_epi32(acc.a, dot_unsigned(u.a, x)), _mm256_add_epi32(acc.b, dot_unsigned(u.b, x)));
}
/* two steps of unsigned codes at most 63 (every type but Q8_0): their int16 pair sums, each at most 2 * 63 * 127,
 * added before one widening to int32 (at most 32,004: exact) */
static inline __m256i dot2_unsigned(__m256i u0, __m256i x0, __m256i u1, __m256i x1) {
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, x0), _mm256_maddubs_epi16(u1, x1));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
static inline ivec iv_dot2(ivec acc, ivec u0, const int8_t *x0, ivec u1, const int8_t *x1) {
    __m256i a = set1_four(x0), b = set1_four(x1);
    return IV2(_mm256_add_epi32(acc.a, dot2_unsigned(u0.a, a, u1.a, b)),
               _mm256_add_epi32(acc.b, dot2_unsigned(u0.b, a, u1.b, b)));
}
/* signed codes w (Q8_0): |w| against x with w's sign (exact for every w, -128 included), |w| taken once per vector
 * for all the rows */
static inline ivec iv_magnitude(ivec w) { return IV2(_mm256_abs_epi8(w.a), _mm256_abs_epi8(w.b)); }
static inline ivec iv_dot_signed(ivec acc, ivec w, ivec magnitude, const int8_t *x4) {
    __m256i x = set1_four(x4);
    return IV2(_mm256_add_epi32(acc.a, dot_unsigned(magnitude.a, _mm256_sign_epi8(x, w.a))),
               _mm256_add_epi32(acc.b, dot_unsigned(magnitude.b, _mm256_sign_epi8(x, w.b))));
}
#define Q8_0_OFFSET 0
static inline ivec iv_add(ivec x, ivec y) { return IV2(_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)); }
static inline ivec iv_set1(int32_t s) { return IV2(_mm256_set1_epi32(s), _mm256_set1_epi32(s)); }
static inline ivec iv_i8_lanes(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return IV2(_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}
static inline fvec fv_u8_lanes(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    return FV2(lo, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}
static inline fvec fv_fp16(const uint8_t *p) {
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return FV2(lo, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16))));
}
static inline fvec fv_zero(void) { return FV2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline fvec fv_set1(float f) { return FV2(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
static inline fvec fv_cvt(ivec v) { return FV2(_mm256_cvtepi32_ps(v.a), _mm256_cvtepi32_ps(v.b)); }
static inline fvec fv_mul(fvec x, fvec y) { return FV2(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)); }
static inline fvec fv_sub(fvec x, fvec y) { return FV2(_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)); }
static inline fvec fv_fma(fvec x, fvec y, fvec z) {
    return FV2(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b));
}
static inline void fv_store(float *p, fvec v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
}
static inline fvec fv_load(const float *p) { return FV2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline fvec fv_add(fvec x, fvec y) { return FV2(_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)); }
static inline fvec fv_max(fvec x, fvec y) { return FV2(_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)); }
static inline fvec fv_abs(fvec x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return FV2(_mm256_andnot_ps(sign, x.a), _mm256_andnot_ps(sign, x.b));
}
static inline int fv_any_ge(fvec x, fvec y) {
    __m256 ge = _mm256_or_ps(_mm256_cmp_ps(x.a, y.a, _CMP_GE_OQ), _mm256_cmp_ps(x.b, y.b, _CMP_GE_OQ));
    return _mm256_movemask_ps(ge) != 0;
}
static inline float fv_reduce_max(fvec x) {
    float lanes[16], best = -INFINITY;
    fv_store(lanes, x);
    for (int l = 0; l < 16; l++) best = lanes[l] > best ? lanes[l] : best;
    return best;
}
static inline float fv_reduce_add(fvec x) {
    float lanes[16], sum = 0.0f;
    fv_store(lanes, x);
    for (int l = 0; l < 16; l++) sum += lanes[l];
    return sum;
}
static inline ivec iv_sub(ivec x, ivec y) { return IV2(_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)); }
static inline ivec iv_times8(ivec x) { return IV2(_mm256_slli_epi32(x.a, 3), _mm256_slli_epi32(x.b, 3)); }
static inline void fv_store_out(void *out, fvec v, int float_out) {
    if (float_out) {
        fv_store(out, v);
    } else {
        _mm_storeu_si128((__m128i *)out, to_bf16_8(v.a));
        _mm_storeu_si128((__m128i *)out + 1, to_bf16_8(v.b));
    }
}
#define ROW_STEP 2 /* 16 registers, each vector two of them */
#endif

#endif
