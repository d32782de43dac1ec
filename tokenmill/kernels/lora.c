/* LoRA adapters' low-rank updates, added to a projection's product row by row (model/lora.py's LoraLinear, in C for
 * the one-call layers of decoder_layer.c).
 *
 * For one adapter's rows (a group) and one projection: the shrink h = x · Aᵀ (rank columns, float32 sums of bf16
 * products), then for each part out[:, at:at+n] = bf16(out + h[:, r0:r0+rank] · Bᵀ). Bᵀ is kept in blocks of sixteen
 * columns, each block's rank × 16 weights side by side (lora_part.bt), so the expand runs along the output's columns
 * sixteen at a time reading one contiguous stream, a block staying in L1 while the group's rows pass. The base product
 * runs once for every row of the step (the GGUF matmul); this reads only the adapters' own A and B, once per group:
 * mixing adapters in a step costs about their bytes. All the groups of a projection are one team of threads, its
 * shrinks first, then its expands.
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

#define LORA_PARALLEL_WORK 16384 /* multiply-adds below which one thread does both passes (a team costs more) */
#define LORA_MAX_GROUPS 64       /* adapters in one call (more: one call per LORA_MAX_GROUPS) */
#define LORA_STACK_FLOATS 4096   /* shrink outputs kept on the stack; more are allocated */

int lora_has(const lora_step *l, int64_t layer, int64_t projection) {
    if (l == NULL) return 0;
    for (int64_t g = 0; g < l->groups; g++)
        if (l->tables[g][layer * LORA_PROJECTIONS + projection] != NULL) return 1;
    return 0;
}

/* sum over i < k of bf16 a[i] × bf16 b[i], in float32: four accumulators of 16 lanes (64 products a round, so four
 * chains of fused multiply-adds in flight), then the tail's 16s in the first, then their fixed-order sum */
static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t k) {
#if defined(VEC16)
    v16 acc0 = v16_zero(), acc1 = v16_zero(), acc2 = v16_zero(), acc3 = v16_zero();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        acc0 = v16_fma(v16_load_bf16(a + i), v16_load_bf16(b + i), acc0);
        acc1 = v16_fma(v16_load_bf16(a + i + 16), v16_load_bf16(b + i + 16), acc1);
        acc2 = v16_fma(v16_load_bf16(a + i + 32), v16_load_bf16(b + i + 32), acc2);
        acc3 = v16_fma(v16_load_bf16(a + i + 48), v16_load_bf16(b + i + 48), acc3);
    }
    for (; i + 16 <= k; i += 16) acc0 = v16_fma(v16_load_bf16(a + i), v16_load_bf16(b + i), acc0);
    float sum = v16_reduce_add(v16_add(v16_add(acc0, acc1), v16_add(acc2, acc3)));
#else
    float sum = 0.0f;
    int64_t i = 0;
#endif
    for (; i < k; i++) sum += bf16_to_float(a[i]) * bf16_to_float(b[i]);
    return sum;
}

#define EXPAND_ROWS 4 /* rows a block's weights are read for at once */

/* out rows' `width` columns += h (rank) · block (rank rows of 16), rounded to bf16, for `count` <= EXPAND_ROWS rows:
 * each row's sum as two chains (its even and its odd ranks) added at the end, the same whatever the count */
static inline void expand_block(const float *const *h, const uint16_t *block, int64_t rank, int64_t width,
                                uint16_t *const *out, int count) {
#if defined(VEC16)
    if (width == 16) {
        v16 even[EXPAND_ROWS], odd[EXPAND_ROWS];
        for (int r = 0; r < count; r++) even[r] = v16_load_bf16(out[r]), odd[r] = v16_zero();
        int64_t j = 0;
        for (; j + 2 <= rank; j += 2) {
            v16 w0 = v16_load_bf16(block + j * 16), w1 = v16_load_bf16(block + (j + 1) * 16);
            for (int r = 0; r < count; r++) {
                even[r] = v16_fma(v16_set1(h[r][j]), w0, even[r]);
                odd[r] = v16_fma(v16_set1(h[r][j + 1]), w1, odd[r]);
            }
        }
        if (j < rank) {
            v16 w0 = v16_load_bf16(block + j * 16);
            for (int r = 0; r < count; r++) even[r] = v16_fma(v16_set1(h[r][j]), w0, even[r]);
        }
        for (int r = 0; r < count; r++) v16_store_bf16(out[r], v16_add(even[r], odd[r]));
        return;
    }
#endif
    for (int r = 0; r < count; r++)
        for (int64_t c = 0; c < width; c++) {
            float even = bf16_to_float(out[r][c]), odd = 0.0f;
            for (int64_t j = 0; j < rank; j++) {
                const float product = h[r][j] * bf16_to_float(block[j * 16 + c]);
                if (j % 2) odd += product;
                else even += product;
            }
            out[r][c] = float_to_bf16(even + odd);
        }
}

/* One projection's updates for `groups` groups: group g applies updates[g] to the rows rows[g][0 .. counts[g]). */
static void update_groups(const lora_update *const *updates, const int64_t *const *rows, const int64_t *counts,
                          int64_t groups, const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t out_stride,
                          int threads) {
    int64_t h_at[LORA_MAX_GROUPS + 1], dots = 0, blocks = 0, work = 0, floats = 0;
    for (int64_t g = 0; g < groups; g++) {
        const lora_update *u = updates[g];
        h_at[g] = floats;
        floats += counts[g] * u->rank;
        dots += u->rank; /* shrink items: (group, rank row), each for all the group's rows */
        work += counts[g] * u->rank * u->k;
        for (int64_t p = 0; p < u->parts; p++) {
            blocks += (u->part[p].n + 15) / 16; /* expand items: (group, part, column block) */
            work += counts[g] * u->part[p].rank * u->part[p].n;
        }
    }
    float stack[LORA_STACK_FLOATS], *h = floats <= LORA_STACK_FLOATS ? stack : malloc((size_t)floats * sizeof(float));
    if (h == NULL) abort(); /* no step can go on without it */
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (work >= LORA_PARALLEL_WORK)
#endif
    {
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (int64_t item = 0; item < dots; item++) {
            int64_t g = 0, j = item;
            while (j >= updates[g]->rank) j -= updates[g++]->rank;
            const lora_update *u = updates[g];
            for (int64_t r = 0; r < counts[g]; r++)
                h[h_at[g] + r * u->rank + j] = dot_bf16(x + rows[g][r] * x_stride, u->a + j * u->k, u->k);
        }
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (int64_t item = 0; item < blocks; item++) {
            int64_t g = 0, p = 0, b = item;
            for (;;) {
                const int64_t here = (updates[g]->part[p].n + 15) / 16;
                if (b < here) break;
                b -= here;
                if (++p == updates[g]->parts) p = 0, g++;
            }
            const lora_update *u = updates[g];
            const lora_part *part = &u->part[p];
            const int64_t c = b * 16, width = part->n - c < 16 ? part->n - c : 16;
            const uint16_t *block = part->bt + b * part->rank * 16;
            for (int64_t r0 = 0; r0 < counts[g]; r0 += EXPAND_ROWS) {
                const int n = counts[g] - r0 < EXPAND_ROWS ? (int)(counts[g] - r0) : EXPAND_ROWS;
                const float *hs[EXPAND_ROWS];
                uint16_t *outs[EXPAND_ROWS];
                for (int r = 0; r < n; r++) {
                    hs[r] = h + h_at[g] + (r0 + r) * u->rank + part->r0;
                    outs[r] = out + rows[g][r0 + r] * out_stride + part->at + c;
                }
                expand_block(hs, block, part->rank, width, outs, n);
            }
        }
    }
    if (h != stack) free(h);
}

void lora_update_rows(const lora_update *u, const int64_t *rows, int64_t count, const uint16_t *x, int64_t x_stride,
                      uint16_t *out, int64_t out_stride, int threads) {
    update_groups(&u, &rows, &count, 1, x, x_stride, out, out_stride, threads);
}

void lora_add(const lora_step *l, int64_t layer, int64_t projection, const uint16_t *x, int64_t x_stride,
              uint16_t *out, int64_t out_stride, int threads) {
    if (l == NULL) return;
    const lora_update *updates[LORA_MAX_GROUPS];
    const int64_t *rows[LORA_MAX_GROUPS];
    int64_t counts[LORA_MAX_GROUPS], n = 0;
    for (int64_t g = 0; g < l->groups; g++) {
        const lora_update *u = l->tables[g][layer * LORA_PROJECTIONS + projection];
        const int64_t start = g ? l->group_end[g - 1] : 0;
        if (u == NULL) continue;
        updates[n] = u, rows[n] = l->rows + start, counts[n] = l->group_end[g] - start;
        if (++n == LORA_MAX_GROUPS) {
            update_groups(updates, rows, counts, n, x, x_stride, out, out_stride, threads);
            n = 0;
        }
    }
    if (n) update_groups(updates, rows, counts, n, x, x_stride, out, out_stride, threads);
}
