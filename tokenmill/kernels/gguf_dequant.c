/* Rows of a GGUF table (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K blocks) widened to float32: an embedding lookup.
 *
 * Why: a decode step looks up one row per sequence, and the torch decoding of gguf_quant.py (its oracle) costs dozens
 * of small tensor ops for it, a sizeable part of what a single stream's step spends outside the kernels. Here it is
 * one plain loop per row. Bits: every weight is the float32 product gguf-py's dequantisation rounds, in its order
 * (`d * q`; `(d * sc) * q - dmin * m` for Q4_K/Q5_K; `(d * sc) * q` for Q6_K), compiled without contraction into FMAs
 * (build.py's -ffp-contract=off), so the rows equal gguf_quant.dequantize's. Plain C: no instruction set needed.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gguf_blocks.h"
#include "kernels.h"

enum { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* IEEE half -> float, exactly (a subnormal half is mant * 2^-24, a normal float) */
static float half(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
    float f;
    if (exp == 0) {
        f = ldexpf((float)mant, -24);
        return sign ? -f : f;
    }
    u = exp == 31 ? sign | 0x7f800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
    memcpy(&f, &u, 4);
    return f;
}

static void row_q4_0(const uint8_t *b, int64_t blocks, float *y) {
    for (int64_t i = 0; i < blocks; i++, b += 18, y += 32) {
        float d = half(b);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((b[2 + j] & 0x0f) - 8);
            y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
    }
}

static void row_q5_0(const uint8_t *b, int64_t blocks, float *y) {
    for (int64_t i = 0; i < blocks; i++, b += 22, y += 32) {
        float d = half(b);
        uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
        for (int j = 0; j < 16; j++) { /* bit j of qh is element j's fifth bit */
            int low = (b[6 + j] & 0x0f) | (int)(((qh >> j) & 1) << 4);
            int high = (b[6 + j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)(low - 16);
            y[j + 16] = d * (float)(high - 16);
        }
    }
}

static void row_q8_0(const uint8_t *b, int64_t blocks, float *y) {
    for (int64_t i = 0; i < blocks; i++, b += 34, y += 32) {
        float d = half(b);
        for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
    }
}

/* Q4_K (144 bytes) and Q5_K (176: the 32 qh bytes before the nibbles): in chunk c of 64 elements, the low nibbles of
 * its 32 bytes are sub-block 2c, the high ones 2c + 1; Q5_K's fifth bit of sub-block j is bit j of qh[l] */
static void row_k(const uint8_t *b, int64_t blocks, float *y, int five) {
    int size = five ? 176 : 144;
    for (int64_t i = 0; i < blocks; i++, b += size, y += 256) {
        float d = half(b), dmin = half(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
        for (int c = 0; c < 4; c++) {
            uint8_t sc0, m0, sc1, m1;
            k_scale_min(scales, 2 * c, &sc0, &m0);
            k_scale_min(scales, 2 * c + 1, &sc1, &m1);
            float d0 = d * (float)sc0, min0 = dmin * (float)m0, d1 = d * (float)sc1, min1 = dmin * (float)m1;
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * c + l] & 0x0f, hi = qs[32 * c + l] >> 4;
                if (five) {
                    lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
                y[64 * c + l] = d0 * (float)lo - min0;
                y[64 * c + 32 + l] = d1 * (float)hi - min1;
            }
        }
    }
}

/* Q6_K (210 bytes: ql[128], qh[64], 16 int8 scales, d): two halves of 128; in half h, element 32q + l (q < 4) has the
 * low nibble (q < 2) or high nibble (q >= 2) of ql[64h + 32(q % 2) + l] and bits 2q of qh[32h + l] on top */
static void row_q6_k(const uint8_t *b, int64_t blocks, float *y) {
    for (int64_t i = 0; i < blocks; i++, b += 210, y += 256) {
        float d = half(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            for (int l = 0; l < 32; l++)
                for (int q = 0; q < 4; q++) {
                    int low = q < 2 ? ql[32 * (q % 2) + l] & 0x0f : ql[32 * (q % 2) + l] >> 4;
                    int code = (low | ((qh[l] >> (2 * q)) & 3) << 4) - 32;
                    float scale = d * (float)sc[8 * h + 2 * q + l / 16];
                    y[128 * h + 32 * q + l] = scale * (float)code;
                }
        }
    }
}

int gguf_dequantize_rows(int type, const uint8_t *table, int64_t k, const int64_t *ids, int64_t n, float *out) {
    int64_t block = type == Q4_K || type == Q5_K || type == Q6_K ? 256 : 32, size;
    switch (type) {
    case Q4_0: size = 18; break;
    case Q5_0: size = 22; break;
    case Q8_0: size = 34; break;
    case Q4_K: size = 144; break;
    case Q5_K: size = 176; break;
    case Q6_K: size = 210; break;
    default: return -1;
    }
    if (k <= 0 || k % block) return -1;
    int64_t blocks = k / block;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *b = table + ids[r] * blocks * size;
        float *y = out + r * k;
        switch (type) {
        case Q4_0: row_q4_0(b, blocks, y); break;
        case Q5_0: row_q5_0(b, blocks, y); break;
        case Q8_0: row_q8_0(b, blocks, y); break;
        case Q4_K: row_k(b, blocks, y, 0); break;
        case Q5_K: row_k(b, blocks, y, 1); break;
        default: row_q6_k(b, blocks, y); break;
        }
    }
    return 0;
}
