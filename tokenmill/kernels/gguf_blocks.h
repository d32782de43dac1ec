/* What reading a GGUF file's own blocks needs in more than one kernel (gguf_repack.c regroups them, gguf_dequant.c
 * widens them): plain C, no instruction set. */
#ifndef TOKENMILL_GGUF_BLOCKS_H
#define TOKENMILL_GGUF_BLOCKS_H
#include <stdint.h>

/* Q4_K / Q5_K: the 6-bit (scale, min) of sub-block j from the block's 12 scale bytes, as ggml's get_scale_min_k4 reads
 * them: bytes 0-3 hold scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits; scales and mins 4-7 keep their low 4
 * bits in the nibbles of bytes 8-11 and their top 2 bits in the top 2 bits of bytes 0-3 and 4-7 */
static inline void k_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

#endif
