/* Softmax attention of bfloat16 query rows over their keys in the paged KV cache, one (row, head) at a time.
 *
 * Why: in torch, attention over a paged cache is ~40 eager ops per layer (gathers, float32 copies, masked chunked
 * matmuls, cumulative sums) whose fixed costs dominate a decode step's attention; here it is one call per layer.
 *
 * Batch invariance: each (query row, head) is computed by itself, from its own query and the keys it sees, by the
 * same loops whatever else is in the call: a row gets the same bits decoded alone, beside other sequences, or inside
 * a prompt's prefill. Arithmetic in float32: s_j = scale * q . k_j (16 partial sums per dot, reduced in a fixed
 * order), p_j = exp(s_j - max s), out = (sum_j p_j v_j) / (sum_j p_j), rounded to bfloat16 (nearest even).
 *
 * Row r sees the keys at cache slots slots[offset[r]], ..., slots[offset[r] + count[r] - 1] (its visible positions,
 * in position order); attention.py builds these from each sequence's block table and the layer's window.
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(_OPENMP)
#include <immintrin.h>
#include <math.h>
#include <omp.h>

int paged_attention_available(void) { return 1; }

static inline __m512 load_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline __m256i to_bf16(__m512 v) { /* round to nearest even; NaN stays NaN */
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* e^x for x <= 0 (Cephes' expf polynomial on x - n ln2, then scaled by 2^n): within ~2 ulp; below -87 it is 0 */
static inline __m512 exp_nonpositive(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    __m512 e = _mm512_scalef_ps(p, n);
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), _mm512_setzero_ps());
}

/* One query row's head: q (d,) bf16 over `count` keys -> out (d,) bf16. d % 16 == 0, d <= MAX_HEAD_DIM. */
#define MAX_HEAD_DIM 512
static void attend_one(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *slots,
                       int64_t count, int64_t slot_stride, int64_t d, float scale, float *scores, uint16_t *out) {
    __m512 qf[MAX_HEAD_DIM / 16];
    int64_t lanes = d / 16;
    for (int64_t i = 0; i < lanes; i++) qf[i] = load_bf16(q + 16 * i);
    float top = -INFINITY;
    for (int64_t j = 0; j < count; j++) {
        const uint16_t *k = k_cache + slots[j] * slot_stride;
        __m512 acc = _mm512_mul_ps(qf[0], load_bf16(k));
        for (int64_t i = 1; i < lanes; i++) acc = _mm512_add_ps(acc, _mm512_mul_ps(qf[i], load_bf16(k + 16 * i)));
        float s = _mm512_reduce_add_ps(acc) * scale;
        scores[j] = s;
        top = s > top ? s : top;
    }
    __m512 sum = _mm512_setzero_ps(), shift = _mm512_set1_ps(top);
    for (int64_t j = 0; j < count; j += 16) {
        __mmask16 live = count - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - j)) - 1);
        __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + j), shift));
        p = _mm512_maskz_mov_ps(live, p);
        _mm512_mask_storeu_ps(scores + j, live, p);
        sum = _mm512_add_ps(sum, p);
    }
    float inv = 1.0f / _mm512_reduce_add_ps(sum);
    __m512 acc[MAX_HEAD_DIM / 16];
    for (int64_t i = 0; i < lanes; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; j++) {
        const uint16_t *v = v_cache + slots[j] * slot_stride;
        __m512 p = _mm512_set1_ps(scores[j]);
        for (int64_t i = 0; i < lanes; i++) acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(p, load_bf16(v + 16 * i)));
    }
    __m512 norm = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < lanes; i++) _mm256_storeu_si256((__m256i *)(out + 16 * i), to_bf16(_mm512_mul_ps(acc[i], norm)));
}

/* q (rows, hq, d) with row stride q_stride; caches (slots, hkv, d); out (rows, hq, d) contiguous. Returns 0, or -1
 * for an unsupported head size or no memory for the scores. */
int paged_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                    const int64_t *slots, const int64_t *offset, const int64_t *count, int64_t rows, int64_t hq,
                    int64_t hkv, int64_t d, float scale, uint16_t *out, int threads) {
    if (d % 16 || d > MAX_HEAD_DIM || hq % hkv) return -1;
    int64_t longest = 1;
    for (int64_t r = 0; r < rows; r++) longest = count[r] > longest ? count[r] : longest;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc((size_t)(longest + 16) * sizeof *scores);
        if (scores == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < rows * hq; item++) {
            if (scores == NULL) continue;
            int64_t r = item / hq, h = item % hq, kv = h / (hq / hkv);
            attend_one(q + r * q_stride + h * d, k_cache + kv * d, v_cache + kv * d, slots + offset[r], count[r],
                       hkv * d, d, scale, scores, out + (r * hq + h) * d);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

#else /* no AVX-512 or no OpenMP: attention.py keeps its torch path */
int paged_attention_available(void) { return 0; }
int paged_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                    const int64_t *slots, const int64_t *offset, const int64_t *count, int64_t rows, int64_t hq,
                    int64_t hkv, int64_t d, float scale, uint16_t *out, int threads) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)slots, (void)offset, (void)count, (void)rows;
    (void)hq, (void)hkv, (void)d, (void)scale, (void)out, (void)threads;
    return -1;
}
#endif
