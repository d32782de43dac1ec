/* Row-wise argmax of float32 logits: greedy decoding's choice, over a 262,144-token vocabulary per row.
 *
 * Why: torch's CPU argmax over such rows is far slower than its own amax over the same memory, so the cost is its
 * index bookkeeping, not the reads; this is one vectorised pass that keeps an index per lane, split over the threads
 * (docs/decisions/0012-head-argmax-in-its-pass.md has the measurements). Same answer as torch.argmax: the first index of the
 * largest value, and a row holding NaN gives its first NaN. Rows are cut into fixed segments merged in order, so a
 * row's answer never depends on the other rows (nor could it: the answer is exact).
 */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#include "vec16.h"

#if defined(VEC16) && defined(_OPENMP)
#include <math.h>
#include <omp.h>

#define SEGMENT 32768 /* elements per work item */

int argmax_available(void) { return 1; }

/* x[lo, hi) -> the first index of its largest value, or of its first NaN (*nan = 1) */
static int64_t scan(const float *x, int64_t lo, int64_t hi, int *nan) {
    v16 best = v16_set1(-INFINITY);
    v16i at = v16i_iota(); /* lane l: element lo + l, until a greater value comes */
    int unordered = 0;
    for (int64_t i = lo; i < hi; i += 16) {
        v16 v = v16_load_first(x + i, hi - i, -INFINITY);
        unordered |= v16_any_nan(v);
        v16_keep_greater(v, v16i_add(v16i_iota(), (int32_t)(i - lo)), &best, &at); /* strictly: a lane's first */
    }
    if (unordered) {
        for (int64_t i = lo; i < hi; i++)
            if (isnan(x[i])) {
                *nan = 1;
                return i;
            }
    }
    *nan = 0;
    float value[16];
    int32_t where[16];
    v16_store(value, best);
    v16i_store(where, at);
    int pick = 0; /* the largest lane, and among equals the one whose element comes first */
    for (int l = 1; l < 16; l++)
        if (value[l] > value[pick] || (value[l] == value[pick] && where[l] < where[pick])) pick = l;
    return lo + where[pick];
}

/* x (rows, n) float32, contiguous -> out (rows,) int64. Returns 0, or -1 when out of memory. */
int argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int threads) {
    int64_t segments = (n + SEGMENT - 1) / SEGMENT;
    int64_t *where = malloc((size_t)(rows * segments) * sizeof *where);
    int *nan = malloc((size_t)(rows * segments) * sizeof *nan);
    if (where == NULL || nan == NULL) {
        free(where);
        free(nan);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t item = 0; item < rows * segments; item++) {
        int64_t r = item / segments, s = item % segments;
        int64_t lo = s * SEGMENT, hi = lo + SEGMENT < n ? lo + SEGMENT : n;
        where[item] = scan(x + r * n, lo, hi, &nan[item]) + r * n;
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t pick = where[r * segments];
        int picked_nan = nan[r * segments];
        for (int64_t s = 1; s < segments && !picked_nan; s++) {
            int64_t i = r * segments + s;
            if (nan[i] || x[where[i]] > x[pick]) pick = where[i], picked_nan = nan[i];
        }
        out[r] = pick - r * n;
    }
    free(where);
    free(nan);
    return 0;
}

#else /* neither AVX-512 nor AVX2 + FMA, or no OpenMP: the sampler keeps torch.argmax */
int argmax_available(void) { return 0; }
int argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int threads) {
    (void)x, (void)rows, (void)n, (void)out, (void)threads;
    return -1;
}
#endif
