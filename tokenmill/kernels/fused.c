/* Row-wise bfloat16 kernels for the small per-layer ops of a decoder layer (see ops.py).
 *
 * Each kernel does in one call what torch does in five to fifteen eager ops, with the same arithmetic: float32
 * inside, rounded to bfloat16 (nearest-even) wherever the torch path rounds. Rows are independent and always
 * computed in the same order, so a row's result never depends on the other rows of the batch.
 * Compiled with -ffp-contract=off: no fused multiply-adds that the torch path would not do either.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define LANES 16

/* 1 / sqrt(mean(x^2) + eps), the sum taken in LANES interleaved partial sums (vectorisable, fixed order). */
static float inv_rms(const bf16 *x, int64_t n, float eps) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            float v = bf16_to_float(x[i + l]);
            acc[l] += v * v;
        }
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) {
        float v = bf16_to_float(x[i]);
        s += v * v;
    }
    return 1.0f / sqrtf(s / (float)n + eps);
}

/* out = bf16(x * inv_rms(x) * factor), per row of `dim` values; rows `stride` apart in x, packed in out. */
void rms_norm(const bf16 *x, int64_t stride, const float *factor, bf16 *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *xr = x + r * stride;
        bf16 *o = out + r * dim;
        float inv = inv_rms(xr, dim, eps);
        for (int64_t i = 0; i < dim; i++) o[i] = float_to_bf16(bf16_to_float(xr[i]) * inv * factor[i]);
    }
}

/* out = bf16(weight * bf16(x * inv_rms(x))): Llama's RMSNorm as Hugging Face computes it in bf16 (normalised in
 * float32, cast back, then scaled by the bf16 weight), `weight` given as float32 (its bf16 values, exactly). */
void weighted_rms_norm(const bf16 *x, int64_t stride, const float *weight, bf16 *out, int64_t rows, int64_t dim,
                       float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *xr = x + r * stride;
        bf16 *o = out + r * dim;
        float inv = inv_rms(xr, dim, eps);
        for (int64_t i = 0; i < dim; i++) o[i] = float_to_bf16(weight[i] * bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * inv)));
    }
}

/* out = bf16(residual + rms_norm(y)): Gemma's "x + post_norm(sublayer(x))". */
void add_rms_norm(const bf16 *residual, const bf16 *y, const float *factor, bf16 *out, int64_t rows, int64_t dim,
                  float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *yr = y + r * dim, *xr = residual + r * dim;
        bf16 *o = out + r * dim;
        float inv = inv_rms(yr, dim, eps);
        for (int64_t i = 0; i < dim; i++) {
            float normed = bf16_to_float(float_to_bf16(bf16_to_float(yr[i]) * inv * factor[i]));
            o[i] = float_to_bf16(bf16_to_float(xr[i]) + normed);
        }
    }
}

/* Per row and head: RMSNorm over head_dim with that head's factor, then rotary ("rotate half" layout):
 * out = bf16(bf16(n * cos) + roll(n) * signed_sin), n the normed head rounded to bf16.
 * x: rows `stride` apart, heads `dim` apart; factor: (heads, dim) float32; cos, signed_sin: (rows, dim) bf16. */
void norm_rotary(const bf16 *x, int64_t stride, const float *factor, const bf16 *cos, const bf16 *signed_sin,
                 bf16 *out, int64_t rows, int64_t heads, int64_t dim, float eps) {
    float normed[MAX_HEAD_DIM];
    int64_t half = dim / 2;
    if (dim > MAX_HEAD_DIM) return; /* ops.norm_rotary never calls with a larger head */
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *c = cos + r * dim, *s = signed_sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            const bf16 *xh = x + r * stride + h * dim;
            const float *f = factor + h * dim;
            bf16 *o = out + (r * heads + h) * dim;
            float inv = inv_rms(xh, dim, eps);
            for (int64_t i = 0; i < dim; i++)
                normed[i] = bf16_to_float(float_to_bf16(bf16_to_float(xh[i]) * inv * f[i]));
            for (int64_t i = 0; i < half; i++) {  /* first half: rolled is the second half */
                float a = bf16_to_float(float_to_bf16(normed[i] * bf16_to_float(c[i])));
                o[i] = float_to_bf16(a + normed[i + half] * bf16_to_float(s[i]));
            }
            for (int64_t i = half; i < dim; i++) {
                float a = bf16_to_float(float_to_bf16(normed[i] * bf16_to_float(c[i])));
                o[i] = float_to_bf16(a + normed[i - half] * bf16_to_float(s[i]));
            }
        }
    }
}

/* Per row and head, rotary alone ("rotate half" layout), as layers.apply_rotary computes it in torch:
 * out = bf16(bf16(x * cos) + roll(x) * signed_sin). Shapes as norm_rotary's. */
void rotary(const bf16 *x, int64_t stride, const bf16 *cos, const bf16 *signed_sin, bf16 *out, int64_t rows,
            int64_t heads, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *c = cos + r * dim, *s = signed_sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            const bf16 *xh = x + r * stride + h * dim;
            bf16 *o = out + (r * heads + h) * dim;
            for (int64_t i = 0; i < dim; i++) {
                float a = bf16_to_float(float_to_bf16(bf16_to_float(xh[i]) * bf16_to_float(c[i])));
                float rolled = bf16_to_float(xh[i < half ? i + half : i - half]);
                o[i] = float_to_bf16(a + rolled * bf16_to_float(s[i]));
            }
        }
    }
}
