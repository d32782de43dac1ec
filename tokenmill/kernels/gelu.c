/* The gated MLP activations. Gemma's: out (T, F) = bf16(bf16(gelu_tanh(gate)) * up), gate and up the halves of (T, 2F);
 * Llama's (silu_mul, at the end): the same with silu.
 *
 * Why: torch runs it as three ops (chunk, gelu, mul) with a bf16 intermediate, each a pass over memory with its own
 * fixed cost, in every layer of every step (see the README's Performance section). Here it is one pass with the same
 * roundings: gelu_tanh(g) = g/2 (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), in float32, rounded to bf16, times
 * up in float32, rounded to bf16. Elementwise, so a row's result never depends on the others. (For large negative g
 * this is more accurate than torch's, whose 1 + tanh(u) cancels: there the two differ by more than a rounding, on
 * values under ~1e-4.)
 */
#include <stdint.h>

#include "kernels.h"

#if defined(__AVX512F__) && defined(_OPENMP)
#include <immintrin.h>
#include <math.h>
#include <omp.h>

#include "avx512_common.h"

int gelu_mul_available(void) { return 1; }

/* g/2 (1 + tanh(u)) = g / (1 + e^(-2u)), taken as g e / (1 + e) for u < 0 and g / (1 + e) for u >= 0 with
 * e = e^(-2|u|) <= 1: no cancellation in 1 + tanh(u) where tanh(u) is near -1 */
static inline __m512 gelu_tanh(__m512 g) {
    __m512 g3 = _mm512_mul_ps(g, _mm512_mul_ps(g, g));
    __m512 inner = _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), g3));
    __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), inner); /* sqrt(2 / pi) */
    __m512 e = exp_nonpositive(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(u)));
    __m512 numerator = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ), g, e);
    return _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* gate_up (rows, 2f) bf16, rows `stride` apart -> out (rows, f) bf16 contiguous. f % 16 == 0. */
void gelu_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t f, uint16_t *out, int threads) {
    int64_t per_row = f / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * f >= 8192)
    for (int64_t item = 0; item < rows * per_row; item++) {
        int64_t r = item / per_row, i = item % per_row * 16;
        const uint16_t *g = gate_up + r * stride + i;
        __m512 activated = load_bf16_rounded(gelu_tanh(load_bf16(g)));
        __m512 v = _mm512_mul_ps(activated, load_bf16(g + f));
        _mm256_storeu_si256((__m256i *)(out + r * f + i), to_bf16(v));
    }
}

/* silu(g) = g / (1 + e^(-g)), taken as g e / (1 + e) for g < 0 and g / (1 + e) for g >= 0 with e = e^(-|g|) <= 1 */
static inline __m512 silu(__m512 g) {
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __m512 numerator = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, e);
    return _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* Llama's gated MLP activation, as gelu_mul: out = bf16(bf16(silu(gate)) * up). */
void silu_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t f, uint16_t *out, int threads) {
    int64_t per_row = f / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * f >= 8192)
    for (int64_t item = 0; item < rows * per_row; item++) {
        int64_t r = item / per_row, i = item % per_row * 16;
        const uint16_t *g = gate_up + r * stride + i;
        __m512 activated = load_bf16_rounded(silu(load_bf16(g)));
        __m512 v = _mm512_mul_ps(activated, load_bf16(g + f));
        _mm256_storeu_si256((__m256i *)(out + r * f + i), to_bf16(v));
    }
}

#else /* no AVX-512 or no OpenMP: layers.gelu_mul and layers.silu_mul keep torch's ops */
int gelu_mul_available(void) { return 0; }
void gelu_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t f, uint16_t *out, int threads) {
    (void)gate_up, (void)stride, (void)rows, (void)f, (void)out, (void)threads;
}
void silu_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t f, uint16_t *out, int threads) {
    (void)gate_up, (void)stride, (void)rows, (void)f, (void)out, (void)threads;
}
#endif
