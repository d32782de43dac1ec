/* The gated MLP activations. Gemma's: out (T, F) = bf16(bf16(gelu_tanh(gate)) * up), gate and up the halves of (T, 2F);
 * Llama's (silu_mul, at the end): the same with silu.
 *
 * Why: torch runs it as three ops (chunk, gelu, mul) with a bf16 intermediate, each a pass over memory with its own
 * fixed cost, in every layer of every step (docs/decisions/0013-one-call-decoder-layer.md). Here it is one pass with the same
 * roundings: gelu_tanh(g) = g/2 (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), in float32, rounded to bf16, times
 * up in float32, rounded to bf16. Elementwise, so a row's result never depends on the others. (For large negative g
 * this is more accurate than torch's, whose 1 + tanh(u) cancels: there the two differ by more than a rounding, on
 * values under ~1e-4.)
 */
#include <stdint.h>

#include "kernels.h"
#include "vec16.h"

#if defined(VEC16) && defined(_OPENMP)
#include <omp.h>

int gelu_mul_available(void) { return 1; }

/* g/2 (1 + tanh(u)) = g / (1 + e^(-2u)), taken as g e / (1 + e) for u < 0 and g / (1 + e) for u >= 0 with
 * e = e^(-2|u|) <= 1: no cancellation in 1 + tanh(u) where tanh(u) is near -1 */
static inline v16 gelu_tanh(v16 g) {
    v16 g3 = v16_mul(g, v16_mul(g, g));
    v16 inner = v16_add(g, v16_mul(v16_set1(0.044715f), g3));
    v16 u = v16_mul(v16_set1(0.7978845608028654f), inner); /* sqrt(2 / pi) */
    v16 e = v16_exp_nonpositive(v16_mul(v16_set1(-2.0f), v16_abs(u)));
    v16 numerator = v16_where_negative(u, v16_mul(g, e), g);
    return v16_div(numerator, v16_add(v16_set1(1.0f), e));
}

/* silu(g) = g / (1 + e^(-g)), taken as g e / (1 + e) for g < 0 and g / (1 + e) for g >= 0 with e = e^(-|g|) <= 1 */
static inline v16 silu(v16 g) {
    v16 e = v16_exp_nonpositive(v16_sub(v16_zero(), v16_abs(g)));
    v16 numerator = v16_where_negative(g, v16_mul(g, e), g);
    return v16_div(numerator, v16_add(v16_set1(1.0f), e));
}

/* 16 outputs: out = bf16(bf16(activation(gate)) * up), the activation gelu_tanh or silu (a constant where inlined) */
static inline __attribute__((always_inline)) void gated16(const uint16_t *gate, const uint16_t *up, uint16_t *out,
                                                          const int gelu) {
    v16 x = v16_load_bf16(gate);
    v16 activated = v16_round_bf16(gelu ? gelu_tanh(x) : silu(x));
    v16_store_bf16(out, v16_mul(activated, v16_load_bf16(up)));
}

/* gate_up (rows, 2f) bf16, rows `stride` apart -> out (rows, f) bf16 contiguous, f % 16 == 0 */
static inline __attribute__((always_inline)) void gated(const uint16_t *gate_up, int64_t stride, int64_t rows,
                                                        int64_t f, uint16_t *out, int threads, const int gelu) {
    int64_t per_row = f / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * f >= 8192)
    for (int64_t item = 0; item < rows * per_row; item++) {
        int64_t r = item / per_row, i = item % per_row * 16;
        const uint16_t *g = gate_up + r * stride + i;
        gated16(g, g + f, out + r * f + i, gelu);
    }
}

void gated_block(const uint16_t *gate, const uint16_t *up, int64_t rows, uint16_t *out, int64_t ldo, int gelu) {
    for (int64_t r = 0; r < rows; r++) {
        if (gelu)
            gated16(gate + 16 * r, up + 16 * r, out + r * ldo, 1);
        else
            gated16(gate + 16 * r, up + 16 * r, out + r * ldo, 0);
    }
}

void gelu_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t f, uint16_t *out, int threads) {
    gated(gate_up, stride, rows, f, out, threads, 1);
}

/* Llama's gated MLP activation, as gelu_mul: out = bf16(bf16(silu(gate)) * up). */
void silu_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t f, uint16_t *out, int threads) {
    gated(gate_up, stride, rows, f, out, threads, 0);
}

#else /* neither AVX-512 nor AVX2 + FMA, or no OpenMP: layers.gelu_mul and layers.silu_mul keep torch's ops */
int gelu_mul_available(void) { return 0; }
void gelu_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t f, uint16_t *out, int threads) {
    (void)gate_up, (void)stride, (void)rows, (void)f, (void)out, (void)threads;
}
void silu_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t f, uint16_t *out, int threads) {
    (void)gate_up, (void)stride, (void)rows, (void)f, (void)out, (void)threads;
}
void gated_block(const uint16_t *gate, const uint16_t *up, int64_t rows, uint16_t *out, int64_t ldo, int gelu) {
    (void)gate, (void)up, (void)rows, (void)out, (void)ldo, (void)gelu;
}
#endif
