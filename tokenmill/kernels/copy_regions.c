/* Many equal-sized regions of memory copied, each from its own address to its own.
 *
 * Why: the prefix cache's tiers (engine/kv_tiers.py) move a KV block as one region per layer and key or value, so a
 * 4,000-token prefix of the default model is 9,000 regions of 8 KiB; as tensor copies from Python the calls cost more
 * than the bytes. Here it is one call, split over the threads where OpenMP is there (always compiled in).
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define PARALLEL_BYTES (1 << 20) /* less than this in all: one thread, the team's start would cost more */

void copy_regions(const int64_t *src, const int64_t *dst, int64_t count, int64_t bytes, int threads) {
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) if (count * bytes >= PARALLEL_BYTES)
#endif
    for (int64_t i = 0; i < count; i++) memcpy((void *)(intptr_t)dst[i], (const void *)(intptr_t)src[i], (size_t)bytes);
    (void)threads;
}
