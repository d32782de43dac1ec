/* Row-wise argmax of float32 logits: greedy decoding's choice, over a 262,144-token vocabulary per row.
 *
 * Why: torch's CPU argmax over such rows is far slower than its own amax over the same memory, so the cost is its
 * index bookkeeping, not the reads; this is one vectorised pass that keeps an index per lane, split over the threads
 * (the README's Performance section has the measurements). Same answer as torch.argmax: the first index of the
 * largest value, and a row holding NaN gives its first NaN. Rows are cut into fixed segments merged in order, so a
 * row's answer never depends on the other rows (nor could it: the answer is exact).
 */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#if defined(__AVX512F__) && defined(_OPENMP)
#include <immintrin.h>
#include <math.h>
#include <omp.h>

#define SEGMENT 32768 /* elements per work item */

int argmax_available(void) { return 1; }

/* x[lo, hi) -> the first index of its largest value, or of its first NaN (*nan = 1) */
static int64_t scan(const float *x, int64_t lo, int64_t hi, int *nan) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    __m512 best = neg_inf;
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); /* lane l: element l */
    __m512i iota = at;
    __mmask16 unordered = 0;
    for (int64_t i = lo; i < hi; i += 16) {
        __mmask16 live = hi - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hi - i)) - 1);
        __m512 v = _mm512_mask_loadu_ps(neg_inf, live, x + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ); /* strictly: a lane keeps its first maximum */
        best = _mm512_mask_mov_ps(best, greater, v);
        at = _mm512_mask_mov_epi32(at, greater, _mm512_add_epi32(iota, _mm512_set1_epi32((int32_t)(i - lo))));
    }
    if (unordered) {
        for (int64_t i = lo; i < hi; i++)
            if (isnan(x[i])) {
                *nan = 1;
                return i;
            }
    }
    *nan = 0;
    float top = _mm512_reduce_max_ps(best);
    __mmask16 tied = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    return lo + _mm512_mask_reduce_min_epi32(tied, at);
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

#else /* no AVX-512 or no OpenMP: the sampler keeps torch.argmax */
int argmax_available(void) { return 0; }
int argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int threads) {
    (void)x, (void)rows, (void)n, (void)out, (void)threads;
    return -1;
}
#endif
