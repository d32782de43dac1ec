/* The rows of x quantised to int8 in blocks of 32, as the GGUF kernels multiply them (gguf_packed.h's xblock): a
 * float32 scale per block and the codes, the arithmetic of gguf_quant.quantize_activations in torch. gguf_matmul and
 * gguf_greedy_row quantise their rows here first, into a scratch laid out for their passes; gguf_quantize_rows gives
 * the plain blocks to Python (the tests compare them with torch's). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "gguf_packed.h"
#include "kernels.h"

#if defined(WITH_SIMD)
/* One block of 32 inputs. amax = max |x|; not finite -> scale NaN and codes 0 (the row's outputs are NaN, as
 * torch's would be); 0 -> scale 0; else scale amax / 127 and codes round-half-even(x * (127 / amax)), clamped. */
#if defined(WITH_VNNI)
/* 16 lanes at a time: the same IEEE operations as the scalar version below, so the same codes and scales */
static void quantize_block(const uint16_t *src, xblock *o) {
    __m512 v[2] = {load_bf16(src), load_bf16(src + 16)};
    __m512 a0 = _mm512_abs_ps(v[0]), a1 = _mm512_abs_ps(v[1]);
    const __m512 big = _mm512_set1_ps(3.4028234663852886e38f);
    int finite = (_mm512_cmp_ps_mask(a0, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, big, _CMP_LE_OQ)) == 0xffff;
    memset(o, 0, sizeof *o);
    if (!finite) {
        o->d = NAN;
        return;
    }
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    if (amax == 0.0f) return;
    __m512 inv = _mm512_set1_ps(127.0f / amax);
    o->d = amax / 127.0f;
    for (int h = 0; h < 2; h++) {
        __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[h], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), r)); /* NaN stays NaN */
        __m512i q = _mm512_cvtps_epi32(r);
        _mm_storeu_si128((__m128i *)(o->q + 16 * h), _mm512_cvtepi32_epi8(q));
        o->halves[h] = _mm512_reduce_add_epi32(q);
    }
    o->sum = o->halves[0] + o->halves[1];
}
#else
static void quantize_block(const uint16_t *src, xblock *o) {
    float v[32], amax = 0.0f;
    int bad = 0;
    for (int i = 0; i < 32; i++) {
        v[i] = bf16_to_float(src[i]);
        float a = fabsf(v[i]);
        bad |= !(a <= 3.4028234663852886e38f);
        amax = a > amax ? a : amax;
    }
    memset(o, 0, sizeof *o);
    if (bad) {
        o->d = NAN;
        return;
    }
    if (amax == 0.0f) return;
    float inv = 127.0f / amax;
    o->d = amax / 127.0f;
    for (int i = 0; i < 32; i++) {
        float r = nearbyintf(v[i] * inv);
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        o->q[i] = (int8_t)r;
        o->halves[i / 16] += (int32_t)r;
    }
    o->sum = o->halves[0] + o->halves[1];
}
#endif

/* Shared out by block, so one row uses both cores */
void quantize_rows(const uint16_t *x, int64_t stride, int64_t m, int64_t k, xblock *out, block_layout layout) {
    int64_t nb = k / 32;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m * nb; i++) {
        int64_t row = i / nb, b = i % nb;
        xblock *o = out + (layout.block_major ? b * m + row : i);
        quantize_block(x + row * stride + 32 * b, o);
        if (layout.offset) o->halves[0] = -layout.offset * o->sum;
        if (layout.dsum) {
            float dsum = o->d * (float)o->sum;
            memcpy(&o->halves[1], &dsum, sizeof dsum);
        }
    }
}

int gguf_quantize_rows(const uint16_t *x, int64_t stride, int64_t m, int64_t k, void *out, int threads) {
    if (k % 32) return -1;
#pragma omp parallel num_threads(threads)
    quantize_rows(x, stride, m, k, out, (block_layout){0, 0, 0});
    return 0;
}
#else /* neither AVX-512 VNNI nor AVX2 (with F16C), or no OpenMP: linear.py keeps the torch path */
int gguf_quantize_rows(const uint16_t *x, int64_t stride, int64_t m, int64_t k, void *out, int threads) {
    (void)x, (void)stride, (void)m, (void)k, (void)out, (void)threads;
    return -1;
}
#endif
