/* LoRA adapters' low-rank updates, added to a projection's product row by row (model/lora.py's LoraLinear, in C for
 * the one-call layers of decoder_layer.c).
 *
 * For one adapter's rows (a group) and one projection: the shrink h = x · Aᵀ (rank columns, float32 sums of bf16
 * products), then for each part out[:, at:at+n] = bf16(out + h[:, r0:r0+rank] · Bᵀ), the sum over the rank taken
 * first (its even and odd ranks as two chains, added), then added to out. Bᵀ is kept in blocks of sixteen
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

/* The adapters' weights come from memory once a step, one sequential stream per thread: each unit of work asks for
 * the lines LORA_PREFETCH_AHEAD bytes past its own into L2 (prefetcht1, as gguf_packed.h's PREFETCH_AHEAD does for the
 * base weights: into L1 the requests would hold the core's few fill buffers). A hint past the end of an array only
 * warms a line; it never faults. */
#define LORA_PREFETCH_AHEAD 8192
static inline void prefetch_ahead(const void *used, int64_t bytes) {
    const char *at = (const char *)used + LORA_PREFETCH_AHEAD;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(at + b, 0, 2);
}

#define DOT_ROWS 4 /* rows a rank row of A is read for at once */

/* sums[r] = the sum over i < k of bf16 x[r][i] × bf16 a[i], in float32, for `count` <= DOT_ROWS rows: each row's as
 * four accumulators of 16 lanes (64 products a round, four chains of fused multiply-adds in flight), then the tail's
 * 16s in the first, then their fixed-order sum; the same whatever the count. a's 16 values are widened once for the
 * rows. */
static inline void dot_rows(const uint16_t *a, const uint16_t *const *x, int count, int64_t k, float *sums) {
    int64_t i = 0;
#if defined(VEC16)
    v16 acc[DOT_ROWS][4];
    for (int r = 0; r < count; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = v16_zero();
    for (; i + 64 <= k; i += 64)
        for (int q = 0; q < 4; q++) {
            v16 w = v16_load_bf16(a + i + 16 * q);
            for (int r = 0; r < count; r++) acc[r][q] = v16_fma(v16_load_bf16(x[r] + i + 16 * q), w, acc[r][q]);
        }
    for (; i + 16 <= k; i += 16) {
        v16 w = v16_load_bf16(a + i);
        for (int r = 0; r < count; r++) acc[r][0] = v16_fma(v16_load_bf16(x[r] + i), w, acc[r][0]);
    }
    for (int r = 0; r < count; r++)
        sums[r] = v16_reduce_add(v16_add(v16_add(acc[r][0], acc[r][1]), v16_add(acc[r][2], acc[r][3])));
#else
    for (int r = 0; r < count; r++) sums[r] = 0.0f;
#endif
    for (; i < k; i++)
        for (int r = 0; r < count; r++) sums[r] += bf16_to_float(x[r][i]) * bf16_to_float(a[i]);
}

#define EXPAND_ROWS 4 /* rows a block's weights are read for at once */

/* Where an expand's sums go: added to bf16 rows (out = bf16(out + sum)), or written to float32 rows as they are */
typedef struct {
    uint16_t *out[EXPAND_ROWS];
    float *delta[EXPAND_ROWS];
} expand_targets;

/* each of `count` <= EXPAND_ROWS rows: sum = h (rank) · block (rank rows of 16) over `width` columns, as two chains
 * (its even and its odd ranks) added at the end, the same whatever the count; then to its target */
static inline void expand_block(const float *const *h, const uint16_t *block, int64_t rank, int64_t width,
                                const expand_targets *to, int count) {
#if defined(VEC16)
    if (width == 16) {
        v16 even[EXPAND_ROWS], odd[EXPAND_ROWS];
        for (int r = 0; r < count; r++) even[r] = v16_zero(), odd[r] = v16_zero();
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
        for (int r = 0; r < count; r++) {
            v16 sum = v16_add(even[r], odd[r]);
            if (to->delta[r] != NULL)
                v16_store(to->delta[r], sum);
            else
                v16_store_bf16(to->out[r], v16_add(v16_load_bf16(to->out[r]), sum));
        }
        return;
    }
#endif
    for (int r = 0; r < count; r++)
        for (int64_t c = 0; c < width; c++) {
            float even = 0.0f, odd = 0.0f;
            for (int64_t j = 0; j < rank; j++) {
                const float product = h[r][j] * bf16_to_float(block[j * 16 + c]);
                if (j % 2)
                    odd += product;
                else
                    even += product;
            }
            if (to->delta[r] != NULL)
                to->delta[r][c] = even + odd;
            else
                to->out[r][c] = float_to_bf16(bf16_to_float(to->out[r][c]) + (even + odd));
        }
}

/* One projection's updates for `groups` groups: group g applies updates[g] to the rows rows[g][0 .. counts[g]), added
 * to out's rows, or where `delta` is not NULL written to its rows (out is then not touched) */
static void update_groups(const lora_update *const *updates, const int64_t *const *rows, const int64_t *counts,
                          int64_t groups, const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t out_stride,
                          float *delta, int threads) {
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
            prefetch_ahead(u->a + j * u->k, u->k * 2);
            for (int64_t r0 = 0; r0 < counts[g]; r0 += DOT_ROWS) {
                const int n = counts[g] - r0 < DOT_ROWS ? (int)(counts[g] - r0) : DOT_ROWS;
                const uint16_t *xs[DOT_ROWS];
                float sums[DOT_ROWS];
                for (int r = 0; r < n; r++) xs[r] = x + rows[g][r0 + r] * x_stride;
                dot_rows(u->a + j * u->k, xs, n, u->k, sums);
                for (int r = 0; r < n; r++) h[h_at[g] + (r0 + r) * u->rank + j] = sums[r];
            }
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
            prefetch_ahead(block, part->rank * 32);
            for (int64_t r0 = 0; r0 < counts[g]; r0 += EXPAND_ROWS) {
                const int n = counts[g] - r0 < EXPAND_ROWS ? (int)(counts[g] - r0) : EXPAND_ROWS;
                const float *hs[EXPAND_ROWS];
                expand_targets to;
                for (int r = 0; r < n; r++) {
                    const int64_t row = rows[g][r0 + r], at = row * out_stride + part->at + c;
                    hs[r] = h + h_at[g] + (r0 + r) * u->rank + part->r0;
                    to.out[r] = delta != NULL ? NULL : out + at;
                    to.delta[r] = delta != NULL ? delta + at : NULL;
                }
                expand_block(hs, block, part->rank, width, &to, n);
            }
        }
    }
    if (h != stack) free(h);
}

void lora_update_rows(const lora_update *u, const int64_t *rows, int64_t count, const uint16_t *x, int64_t x_stride,
                      uint16_t *out, int64_t out_stride, int threads) {
    update_groups(&u, &rows, &count, 1, x, x_stride, out, out_stride, NULL, threads);
}

/* lora_add into out, or (delta not NULL) lora_deltas into delta, marking the rows in `added` */
static void apply(const lora_step *l, int64_t layer, int64_t projection, const uint16_t *x, int64_t x_stride,
                  uint16_t *out, float *delta, int64_t stride, uint8_t *added, int threads) {
    if (l == NULL) return;
    const lora_update *updates[LORA_MAX_GROUPS];
    const int64_t *rows[LORA_MAX_GROUPS];
    int64_t counts[LORA_MAX_GROUPS], n = 0;
    for (int64_t g = 0; g < l->groups; g++) {
        const lora_update *u = l->tables[g][layer * LORA_PROJECTIONS + projection];
        const int64_t start = g ? l->group_end[g - 1] : 0;
        if (u == NULL) continue;
        updates[n] = u, rows[n] = l->rows + start, counts[n] = l->group_end[g] - start;
        for (int64_t r = 0; added != NULL && r < counts[n]; r++) added[rows[n][r]] = 1;
        if (++n == LORA_MAX_GROUPS) {
            update_groups(updates, rows, counts, n, x, x_stride, out, stride, delta, threads);
            n = 0;
        }
    }
    if (n) update_groups(updates, rows, counts, n, x, x_stride, out, stride, delta, threads);
}

void lora_add(const lora_step *l, int64_t layer, int64_t projection, const uint16_t *x, int64_t x_stride,
              uint16_t *out, int64_t out_stride, int threads) {
    apply(l, layer, projection, x, x_stride, out, NULL, out_stride, NULL, threads);
}

void lora_deltas(const lora_step *l, int64_t layer, int64_t projection, const uint16_t *x, int64_t x_stride,
                 float *delta, int64_t delta_stride, uint8_t *added, int threads) {
    apply(l, layer, projection, x, x_stride, NULL, delta, delta_stride, added, threads);
}
