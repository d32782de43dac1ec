/* Softmax attention of bfloat16 query rows over their keys in the paged KV cache, one (row, head) at a time.
 *
 * Why: in torch, attention over a paged cache is dozens of eager ops per layer (gathers, float32 copies, masked chunked
 * matmuls, cumulative sums) whose fixed costs dominate a decode step's attention; here it is one call per layer.
 *
 * Batch invariance: each (query row, head) is computed from its own query and the keys it sees, by the same loops
 * whatever else is in the call: a row gets the same bits decoded alone, beside other sequences, or inside a prompt's
 * prefill. Arithmetic in float32: s_j = scale * q . k_j (16 partial sums per dot, reduced in a fixed order),
 * (softcap > 0, Gemma 2: s_j = softcap * tanh(s_j / softcap)), p_j = exp(s_j - max s), out = (sum_j p_j v_j) / (sum_j p_j), rounded to bfloat16 (nearest even). The query heads
 * that share a KV head are computed together, which shares the loads of their keys and values, not their numbers.
 *
 * Row r sees the keys at cache slots slots[offset[r]], ..., slots[offset[r] + count[r] - 1] (its visible positions,
 * in position order); attention.py builds these from each sequence's block table and the layer's window.
 */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#if defined(__AVX512F__) && defined(_OPENMP)
#include <immintrin.h>
#include <math.h>
#include <omp.h>

#include "avx512_common.h"

int paged_attention_available(void) { return 1; }

/* Up to GROUP query heads that share one KV head, for one query row, over `count` keys -> out (gs, d) bf16.
 * Each head's numbers come from the same loops whatever the grouping: the dot product over d in 16 lanes (one FMA
 * chain per lane), reduced in a fixed order; the softmax and the weighted sum of values in key order. The grouping
 * only shares the loads of keys and values (and computes two keys at a time to keep the FMA units busy). */
#define GROUP 4
static inline __attribute__((always_inline)) void attend_group(
    const uint16_t *q, int64_t q_head_stride, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *slots, int64_t count, int64_t slot_stride, int64_t d, float scale, float softcap, float *scores,
    uint16_t *out, const int GS) {
    __m512 qf[GROUP][MAX_ATTENTION_HEAD_DIM / 16];
    int64_t lanes = d / 16;
    for (int g = 0; g < GS; g++)
        for (int64_t i = 0; i < lanes; i++) qf[g][i] = load_bf16(q + g * q_head_stride + 16 * i);
    float *s[GROUP];
    for (int g = 0; g < GS; g++) s[g] = scores + g * (count + 16);
    int64_t j = 0;
    for (; j + 2 <= count; j += 2) {
        const uint16_t *k0 = k_cache + slots[j] * slot_stride, *k1 = k_cache + slots[j + 1] * slot_stride;
        __m512 a0[GROUP], a1[GROUP];
        for (int g = 0; g < GS; g++) a0[g] = a1[g] = _mm512_setzero_ps();
        for (int64_t i = 0; i < lanes; i++) {
            __m512 x0 = load_bf16(k0 + 16 * i), x1 = load_bf16(k1 + 16 * i);
            for (int g = 0; g < GS; g++) {
                a0[g] = _mm512_fmadd_ps(qf[g][i], x0, a0[g]);
                a1[g] = _mm512_fmadd_ps(qf[g][i], x1, a1[g]);
            }
        }
        for (int g = 0; g < GS; g++) {
            s[g][j] = _mm512_reduce_add_ps(a0[g]) * scale;
            s[g][j + 1] = _mm512_reduce_add_ps(a1[g]) * scale;
        }
    }
    for (; j < count; j++) {
        const uint16_t *k0 = k_cache + slots[j] * slot_stride;
        __m512 a0[GROUP];
        for (int g = 0; g < GS; g++) a0[g] = _mm512_setzero_ps();
        for (int64_t i = 0; i < lanes; i++) {
            __m512 x0 = load_bf16(k0 + 16 * i);
            for (int g = 0; g < GS; g++) a0[g] = _mm512_fmadd_ps(qf[g][i], x0, a0[g]);
        }
        for (int g = 0; g < GS; g++) s[g][j] = _mm512_reduce_add_ps(a0[g]) * scale;
    }
    if (softcap > 0) /* Gemma 2: s_j = softcap * tanh(s_j / softcap), before the softmax */
        for (int g = 0; g < GS; g++)
            for (int64_t t = 0; t < count; t++) s[g][t] = softcap * tanhf(s[g][t] / softcap);
    float inv[GROUP];
    for (int g = 0; g < GS; g++) { /* p_j = exp(s_j - max), in place; inv = 1 / sum p */
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < count; t += 16) {
            __mmask16 live = count - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - t)) - 1);
            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, s[g] + t));
        }
        __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top)), sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < count; t += 16) {
            __mmask16 live = count - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - t)) - 1);
            __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, s[g] + t), shift);
            __m512 p = _mm512_maskz_mov_ps(live, exp_nonpositive(x));
            _mm512_mask_storeu_ps(s[g] + t, live, p);
            sum = _mm512_add_ps(sum, p);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    for (int64_t c = 0; c < lanes; c += 4) { /* 64 output dims of every head at a time: GS x 4 accumulators */
        int width = lanes - c < 4 ? (int)(lanes - c) : 4;
        __m512 acc[GROUP][4];
        for (int g = 0; g < GS; g++)
            for (int i = 0; i < 4; i++) acc[g][i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < count; t++) {
            const uint16_t *v = v_cache + slots[t] * slot_stride + 16 * c;
            __m512 x[4];
            for (int i = 0; i < 4; i++) x[i] = i < width ? load_bf16(v + 16 * i) : _mm512_setzero_ps();
            for (int g = 0; g < GS; g++) {
                __m512 p = _mm512_set1_ps(s[g][t]);
                for (int i = 0; i < 4; i++) acc[g][i] = _mm512_fmadd_ps(p, x[i], acc[g][i]);
            }
        }
        for (int g = 0; g < GS; g++) {
            __m512 norm = _mm512_set1_ps(inv[g]);
            for (int i = 0; i < width; i++)
                _mm256_storeu_si256((__m256i *)(out + g * d + 16 * (c + i)), to_bf16(_mm512_mul_ps(acc[g][i], norm)));
        }
    }
}

/* q (rows, hq, d) with row stride q_stride; caches (slots, hkv, d); out (rows, hq, d) contiguous. Returns 0, or -1
 * for an unsupported head size or no memory for the scores. */
int paged_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                    const int64_t *slots, const int64_t *offset, const int64_t *count, int64_t rows, int64_t hq,
                    int64_t hkv, int64_t d, float scale, float softcap, uint16_t *out, int threads) {
    if (d % 16 || d > MAX_ATTENTION_HEAD_DIM || hq % hkv) return -1;
    int64_t longest = 1, group = hq / hkv, parts = (group + GROUP - 1) / GROUP;
    for (int64_t r = 0; r < rows; r++) longest = count[r] > longest ? count[r] : longest;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc((size_t)(GROUP * (longest + 16)) * sizeof *scores);
        if (scores == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < rows * hkv * parts; item++) { /* (row, KV head, part of its query heads) */
            if (scores == NULL) continue;
            int64_t r = item / (hkv * parts), kv = item / parts % hkv, h = kv * group + item % parts * GROUP;
            int64_t gs = group - item % parts * GROUP < GROUP ? group - item % parts * GROUP : GROUP;
            const uint16_t *qh = q + r * q_stride + h * d, *kc = k_cache + kv * d, *vc = v_cache + kv * d;
            const int64_t *sl = slots + offset[r];
            uint16_t *o = out + (r * hq + h) * d;
            switch (gs) {
                case 1: attend_group(qh, d, kc, vc, sl, count[r], hkv * d, d, scale, softcap, scores, o, 1); break;
                case 2: attend_group(qh, d, kc, vc, sl, count[r], hkv * d, d, scale, softcap, scores, o, 2); break;
                case 3: attend_group(qh, d, kc, vc, sl, count[r], hkv * d, d, scale, softcap, scores, o, 3); break;
                default: attend_group(qh, d, kc, vc, sl, count[r], hkv * d, d, scale, softcap, scores, o, 4); break;
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

#else /* no AVX-512 or no OpenMP: attention.py keeps its torch path */
int paged_attention_available(void) { return 0; }
int paged_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                    const int64_t *slots, const int64_t *offset, const int64_t *count, int64_t rows, int64_t hq,
                    int64_t hkv, int64_t d, float scale, float softcap, uint16_t *out, int threads) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)slots, (void)offset, (void)count, (void)rows;
    (void)hq, (void)hkv, (void)d, (void)scale, (void)softcap, (void)out, (void)threads;
    return -1;
}
#endif
