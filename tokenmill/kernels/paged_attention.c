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

#include "vec16.h"

#if defined(VEC16) && defined(_OPENMP)
#include <math.h>
#include <omp.h>

int paged_attention_available(void) { return 1; }

/* Up to GROUP query heads that share one KV head, for one query row, over `count` keys -> out (gs, d) bf16.
 * Each head's numbers come from the same loops whatever the grouping: the dot product over d in 16 lanes (one FMA
 * chain per lane), reduced in a fixed order; the softmax and the weighted sum of values in key order. The grouping
 * only shares the loads of keys and values (and computes two keys at a time to keep the FMA units busy), as does
 * the number of 16-lane vectors of output summed at a time (more in AVX-512's 32 registers than in AVX2's 16). */
#define GROUP 4
#if defined(VEC16_WIDE)
#define OUT_VECTORS 4
#else
#define OUT_VECTORS 2
#endif
static inline __attribute__((always_inline)) void attend_group(
    const uint16_t *q, int64_t q_head_stride, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *slots, int64_t count, int64_t slot_stride, int64_t d, float scale, float softcap, float *scores,
    uint16_t *out, const int GS) {
    v16 qf[GROUP][MAX_ATTENTION_HEAD_DIM / 16];
    int64_t lanes = d / 16;
    for (int g = 0; g < GS; g++)
        for (int64_t i = 0; i < lanes; i++) qf[g][i] = v16_load_bf16(q + g * q_head_stride + 16 * i);
    float *s[GROUP];
    for (int g = 0; g < GS; g++) s[g] = scores + g * (count + 16);
    int64_t j = 0;
#if defined(VEC16_WIDE)
    /* 16 keys at a time, their dot products' lanes summed together (v16_sum16: the same sums as one at a time) */
    for (; j + 16 <= count; j += 16) {
        v16 dots[GROUP][16];
        for (int at = 0; at < 16; at += 2) {
            const uint16_t *k0 = k_cache + slots[j + at] * slot_stride, *k1 = k_cache + slots[j + at + 1] * slot_stride;
            v16 a0[GROUP], a1[GROUP];
            for (int g = 0; g < GS; g++) a0[g] = a1[g] = v16_zero();
            for (int64_t i = 0; i < lanes; i++) {
                v16 x0 = v16_load_bf16(k0 + 16 * i), x1 = v16_load_bf16(k1 + 16 * i);
                for (int g = 0; g < GS; g++) {
                    a0[g] = v16_fma(qf[g][i], x0, a0[g]);
                    a1[g] = v16_fma(qf[g][i], x1, a1[g]);
                }
            }
            for (int g = 0; g < GS; g++) {
                dots[g][v16_sum16_slot(at)] = a0[g];
                dots[g][v16_sum16_slot(at + 1)] = a1[g];
            }
        }
        for (int g = 0; g < GS; g++) v16_store(s[g] + j, v16_mul(v16_sum16(dots[g]), v16_set1(scale)));
    }
#endif
    for (; j + 2 <= count; j += 2) {
        const uint16_t *k0 = k_cache + slots[j] * slot_stride, *k1 = k_cache + slots[j + 1] * slot_stride;
        v16 a0[GROUP], a1[GROUP];
        for (int g = 0; g < GS; g++) a0[g] = a1[g] = v16_zero();
        for (int64_t i = 0; i < lanes; i++) {
            v16 x0 = v16_load_bf16(k0 + 16 * i), x1 = v16_load_bf16(k1 + 16 * i);
            for (int g = 0; g < GS; g++) {
                a0[g] = v16_fma(qf[g][i], x0, a0[g]);
                a1[g] = v16_fma(qf[g][i], x1, a1[g]);
            }
        }
        for (int g = 0; g < GS; g++) {
            s[g][j] = v16_reduce_add(a0[g]) * scale;
            s[g][j + 1] = v16_reduce_add(a1[g]) * scale;
        }
    }
    for (; j < count; j++) {
        const uint16_t *k0 = k_cache + slots[j] * slot_stride;
        v16 a0[GROUP];
        for (int g = 0; g < GS; g++) a0[g] = v16_zero();
        for (int64_t i = 0; i < lanes; i++) {
            v16 x0 = v16_load_bf16(k0 + 16 * i);
            for (int g = 0; g < GS; g++) a0[g] = v16_fma(qf[g][i], x0, a0[g]);
        }
        for (int g = 0; g < GS; g++) s[g][j] = v16_reduce_add(a0[g]) * scale;
    }
    if (softcap > 0) /* Gemma 2: s_j = softcap * tanh(s_j / softcap), before the softmax */
        for (int g = 0; g < GS; g++)
            for (int64_t t = 0; t < count; t++) s[g][t] = softcap * tanhf(s[g][t] / softcap);
    float inv[GROUP];
    for (int g = 0; g < GS; g++) { /* p_j = exp(s_j - max), in place; inv = 1 / sum p */
        v16 top = v16_set1(-INFINITY);
        for (int64_t t = 0; t < count; t += 16) top = v16_max(top, v16_load_first(s[g] + t, count - t, -INFINITY));
        v16 shift = v16_set1(v16_reduce_max(top)), sum = v16_zero();
        for (int64_t t = 0; t < count; t += 16) { /* lanes past the end: e^-inf = 0, adding nothing to the sum */
            v16 p = v16_exp_nonpositive(v16_sub(v16_load_first(s[g] + t, count - t, -INFINITY), shift));
            v16_store_first(s[g] + t, count - t, p);
            sum = v16_add(sum, p);
        }
        inv[g] = 1.0f / v16_reduce_add(sum);
    }
    for (int64_t c = 0; c < lanes; c += OUT_VECTORS) { /* OUT_VECTORS x 16 output dims of every head at a time */
        int width = lanes - c < OUT_VECTORS ? (int)(lanes - c) : OUT_VECTORS;
        v16 acc[GROUP][OUT_VECTORS];
        for (int g = 0; g < GS; g++)
            for (int i = 0; i < OUT_VECTORS; i++) acc[g][i] = v16_zero();
        for (int64_t t = 0; t < count; t++) {
            const uint16_t *v = v_cache + slots[t] * slot_stride + 16 * c;
            v16 x[OUT_VECTORS];
            for (int i = 0; i < OUT_VECTORS; i++) x[i] = i < width ? v16_load_bf16(v + 16 * i) : v16_zero();
            for (int g = 0; g < GS; g++) {
                v16 p = v16_set1(s[g][t]);
                for (int i = 0; i < OUT_VECTORS; i++) acc[g][i] = v16_fma(p, x[i], acc[g][i]);
            }
        }
        for (int g = 0; g < GS; g++) {
            v16 norm = v16_set1(inv[g]);
            for (int i = 0; i < width; i++) v16_store_bf16(out + g * d + 16 * (c + i), v16_mul(acc[g][i], norm));
        }
    }
}

/* A thread's items' key and value rows are asked into L2 (prefetcht1) up to PREFETCH_BYTES ahead of the item in hand,
 * a row at a time. Why: a decode step finds each layer's cache cold (the step streams all the weights between two
 * visits of a layer), and the loops' own loads, a key at a time, kept too few lines in flight: 16 rows of 70 keys took
 * 3x as long cold as hot (`scripts/attention_speed.py --cold`; the README has the figures). Asking for each item's rows
 * just before it, or for the budget's rows in one tight loop, gained less than this, measured. */
#define PREFETCH_BYTES (512 << 10)
typedef struct {
    int64_t item, key, bytes; /* the next row to ask for; the bytes asked for so far */
} prefetch_cursor;

/* the bytes of an item's rows (a part of a KV head's query heads after its first reads the same rows) */
static inline int64_t item_bytes(const int64_t *count, int64_t r, int64_t part, int64_t d) {
    return part ? 0 : count[r] * 4 * d;
}

/* asks for rows from the cursor on until `upto` bytes have been asked for, or the items up to `end` are all asked */
static void prefetch_rows(prefetch_cursor *c, int64_t upto, int64_t end, const uint16_t *k_cache,
                          const uint16_t *v_cache, const int64_t *slots, const int64_t *offset, const int64_t *count,
                          int64_t hkv, int64_t parts, int64_t d) {
    while (c->bytes < upto && c->item < end) {
        int64_t r = c->item / (hkv * parts), kv = c->item / parts % hkv;
        if (c->item % parts || c->key >= count[r]) { /* a later part of the same rows, or the item's rows done */
            c->item++, c->key = 0;
            continue;
        }
        int64_t slot = slots[offset[r] + c->key++];
        for (int64_t b = 0; b < 2 * d; b += 64) {
            _mm_prefetch((const char *)(k_cache + (slot * hkv + kv) * d) + b, _MM_HINT_T1);
            _mm_prefetch((const char *)(v_cache + (slot * hkv + kv) * d) + b, _MM_HINT_T1);
        }
        c->bytes += 4 * d;
    }
}

/* q (rows, hq, d) with row stride q_stride; caches (slots, hkv, d); out (rows, hq, d) contiguous. Returns 0, or -1
 * for an unsupported head size or no memory for the scores. */
int paged_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                    const int64_t *slots, const int64_t *offset, const int64_t *count, int64_t rows, int64_t hq,
                    int64_t hkv, int64_t d, float scale, float softcap, uint16_t *out, int threads) {
    if (d % 16 || d > MAX_ATTENTION_HEAD_DIM || hq % hkv) return -1;
    /* Query heads a KV head's item computes together: GROUP, or fewer where the items would leave a thread idle (a
     * single stream's step has one row, and Gemma 3 one KV head): each head's numbers do not depend on its group */
    int64_t group = hq / hkv, size = GROUP;
    while (size > 1 && rows * hkv * ((group + size - 1) / size) < threads) size /= 2;
    int64_t longest = 1, parts = (group + size - 1) / size;
    for (int64_t r = 0; r < rows; r++) longest = count[r] > longest ? count[r] : longest;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc((size_t)(GROUP * (longest + 16)) * sizeof *scores);
        if (scores == NULL) failed = 1;
        /* this thread's items, as schedule(static) deals them (one run of consecutive items), with their cache rows
         * asked for ahead of them */
        int64_t items = rows * hkv * parts, team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t first = items * me / team, end = items * (me + 1) / team;
        prefetch_cursor ahead = {first, 0, 0};
        int64_t used = 0;
        for (int64_t item = first; item < end; item++) { /* (row, KV head, part of its query heads) */
            if (scores == NULL) continue;
            int64_t r = item / (hkv * parts), kv = item / parts % hkv, h = kv * group + item % parts * size;
            prefetch_rows(&ahead, used + PREFETCH_BYTES, end, k_cache, v_cache, slots, offset, count, hkv, parts, d);
            used += item_bytes(count, r, item % parts, d);
            int64_t gs = group - item % parts * size < size ? group - item % parts * size : size;
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

#else /* neither AVX-512 nor AVX2 + FMA, or no OpenMP: attention.py keeps its torch path */
int paged_attention_available(void) { return 0; }
int paged_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                    const int64_t *slots, const int64_t *offset, const int64_t *count, int64_t rows, int64_t hq,
                    int64_t hkv, int64_t d, float scale, float softcap, uint16_t *out, int threads) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)slots, (void)offset, (void)count, (void)rows;
    (void)hq, (void)hkv, (void)d, (void)scale, (void)softcap, (void)out, (void)threads;
    return -1;
}
#endif
