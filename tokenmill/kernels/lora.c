/* LoRA adapters' low-rank updates, added to a projection's product row by row (model/lora.py's LoraLinear, in C for
 * the one-call layers of decoder_layer.c).
 *
 * For one adapter's rows (a group) and one projection: the shrink h = x · Aᵀ (rank columns, float32 sums of bf16
 * products), then for each part out[:, at:at+n] = bf16(out + h[:, r0:r0+rank] · Bᵀ). Bᵀ is kept (rank, n), so the
 * expand runs along the output's columns sixteen at a time, a column block's rank × 16 weights staying in L1 while
 * the group's rows pass. The base product runs once for every row of the step (the GGUF matmul); this only reads an
 * adapter's own A and B, once per group, which is why mixing adapters in a step costs little more than their bytes.
 *
 * Each row's result depends on that row alone (the sums run in a fixed order), whatever its neighbours.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"
#include "vec16.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#define LORA_PARALLEL_WORK 65536 /* multiply-adds below which one thread does a pass (a team costs more) */

int lora_has(const lora_step *l, int64_t layer, int64_t projection) {
    if (l == NULL) return 0;
    for (int64_t g = 0; g < l->groups; g++)
        if (l->tables[g][layer * LORA_PROJECTIONS + projection] != NULL) return 1;
    return 0;
}

/* sum over i < k of bf16 a[i] × bf16 b[i], in float32: 16 lanes, then their sum (a fixed order) */
static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t k) {
#if defined(VEC16)
    v16 acc = v16_zero();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) acc = v16_fma(v16_load_bf16(a + i), v16_load_bf16(b + i), acc);
    float sum = v16_reduce_add(acc);
#else
    float sum = 0.0f;
    int64_t i = 0;
#endif
    for (; i < k; i++) sum += bf16_to_float(a[i]) * bf16_to_float(b[i]);
    return sum;
}

/* out row's columns [c, c + width) += h (rank) · bt's columns there (rank rows `n` apart), rounded to bf16 */
static inline void expand_block(const float *h, const uint16_t *bt, int64_t n, int64_t rank, int64_t width,
                                uint16_t *out) {
#if defined(VEC16)
    if (width == 16) {
        v16 acc = v16_load_bf16(out);
        for (int64_t j = 0; j < rank; j++) acc = v16_fma(v16_set1(h[j]), v16_load_bf16(bt + j * n), acc);
        v16_store_bf16(out, acc);
        return;
    }
#endif
    for (int64_t c = 0; c < width; c++) {
        float acc = bf16_to_float(out[c]);
        for (int64_t j = 0; j < rank; j++) acc += h[j] * bf16_to_float(bt[j * n + c]);
        out[c] = float_to_bf16(acc);
    }
}

void lora_update_rows(const lora_update *u, const int64_t *rows, int64_t count, const uint16_t *x, int64_t x_stride,
                      uint16_t *out, int64_t out_stride, int threads) {
    const int64_t rank = u->rank, k = u->k;
    float *h = malloc((size_t)(count * rank) * sizeof(float));
    if (h == NULL) abort(); /* a few KB: no step can go on without it */
    /* the shrink: rank × count dots, each rank row of A read once for all the rows */
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(threads) if (count * rank * k >= LORA_PARALLEL_WORK)
#endif
    for (int64_t j = 0; j < rank; j++)
        for (int64_t r = 0; r < count; r++) h[r * rank + j] = dot_bf16(x + rows[r] * x_stride, u->a + j * k, k);
    /* the expand: each part's column blocks shared between the threads */
    for (int64_t p = 0; p < u->parts; p++) {
        const lora_part *part = &u->part[p];
        const int64_t blocks = (part->n + 15) / 16;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(threads) if (count * part->rank * part->n >= LORA_PARALLEL_WORK)
#endif
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t c = b * 16, width = part->n - c < 16 ? part->n - c : 16;
            for (int64_t r = 0; r < count; r++)
                expand_block(h + r * rank + part->r0, part->bt + c, part->n, part->rank, width,
                             out + rows[r] * out_stride + part->at + c);
        }
    }
    free(h);
}

void lora_add(const lora_step *l, int64_t layer, int64_t projection, const uint16_t *x, int64_t x_stride,
              uint16_t *out, int64_t out_stride, int threads) {
    if (l == NULL) return;
    for (int64_t g = 0; g < l->groups; g++) {
        const lora_update *u = l->tables[g][layer * LORA_PROJECTIONS + projection];
        const int64_t start = g ? l->group_end[g - 1] : 0;
        if (u != NULL) lora_update_rows(u, l->rows + start, l->group_end[g] - start, x, x_stride, out, out_stride, threads);
    }
}
