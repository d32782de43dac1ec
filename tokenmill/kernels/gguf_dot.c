/* The GGUF product's core: a group of 16 columns against a chunk of rows, from its regrouped codes (gguf_packed.h)
 * and the rows' int8 blocks. Each sub-block's codes are decoded into eight vectors, multiplied with the rows' blocks
 * in exact integer dot products (sixteen columns to a vector), and each row's int32 sums go to float32 in one float
 * step per sub-block. gguf_matmul.c shares the groups out among the threads; gguf_amx.c takes whole tiles of 16 rows
 * where it can, with the same float step. */
#include <stdint.h>

#include "gguf_packed.h"
#include "kernels.h"

#if defined(WITH_SIMD)
#include <cpuid.h>

int row_prefetch = -1;

void read_row_prefetch(void) {
    if (__atomic_load_n(&row_prefetch, __ATOMIC_RELAXED) >= 0) return;
    unsigned a, b, c, d;
    /* GenuineIntel */
    int intel = __get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e;
    __atomic_store_n(&row_prefetch, intel, __ATOMIC_RELAXED);
}

/* One row's float step for a sub-block, from its exact int32 sums (Q6_K: `half` holds elements 0-15, `sum` 16-31):
 * every path (many rows, one row, AMX) ends a sub-block with these operations in this order, so the same bits */
ALWAYS_INLINE void float_step(int type, ivec sum, ivec half, factors f, const xblock *xb, fvec *acc, fvec *mins) {
    fvec xd = fv_set1(xb->d);
    if (type == Q4_K || type == Q5_K) {
        *acc = fv_fma(fv_cvt(sum), fv_mul(f.scale, xd), *acc);
        *mins = fv_fma(f.min, fv_set1(block_dsum(xb)), *mins);
    } else if (type == Q6_K) { /* the halves' sums already less their codes' offset (q6_start) */
        *acc = fv_fma(fv_cvt(half), fv_mul(f.scale, xd), *acc);
        *acc = fv_fma(fv_cvt(sum), fv_mul(f.scale_hi, xd), *acc);
    } else {
        *acc = fv_fma(fv_cvt(sum), fv_mul(f.scale, xd), *acc);
    }
}

/* Where Q6_K's sums of half h (elements 16h..16h+15) start: -32 times the activation half's sum, so that they end as
 * the sums of (code - 32) * x, the codes' offset taken off without a subtraction per row and sub-block */
static inline ivec q6_start(const xblock *xb, int h) { return iv_set1(-32 * xb->halves[h]); }

/* One row's exact int32 sums of a sub-block: two chains of dot products (each waits on the last), joined exactly
 * (Q6_K: *half holds elements 0-15, *sum 16-31, each less its codes' offset). The code vectors are vec[] and mag[]
 * (decoded once for many rows) or, where vec is NULL, decoded from `codes` just before their products: for a single
 * row, decoding all eight first is more vectors (with Q8_0's magnitudes) than AVX2 has registers, and the rest went
 * to the stack and back. */
ALWAYS_INLINE void one_row_sums(int type, const uint8_t *codes, const ivec *vec, const ivec *mag, const xblock *xb,
                                ivec *sum, ivec *half) {
    ivec chain[2][2] = {{code_offset(type) ? iv_set1(xb->halves[0]) : iv_zero(), iv_zero()}, {iv_zero(), iv_zero()}};
    if (type == Q6_K) chain[0][0] = q6_start(xb, 0), chain[1][0] = q6_start(xb, 1);
    for (int g = 0; g < 8; g += 2) {
        ivec *c = &chain[g / 4][g / 2 % 2];
        ivec v0 = vec ? vec[g] : packed_vector(type, codes, g);
        ivec v1 = vec ? vec[g + 1] : packed_vector(type, codes, g + 1);
        if (type == Q8_0)
            *c = iv_dot_signed(iv_dot_signed(*c, v0, vec ? mag[g] : iv_magnitude(v0), four(xb, g)), v1,
                               vec ? mag[g + 1] : iv_magnitude(v1), four(xb, g + 1));
        else
            *c = iv_dot2(*c, v0, four(xb, g), v1, four(xb, g + 1));
    }
    ivec lo = iv_add(chain[0][0], chain[0][1]), hi = iv_add(chain[1][0], chain[1][1]);
    *half = lo;
    *sum = type == Q6_K ? hi : iv_add(lo, hi);
}

/* R rows' update by one sub-block: the exact int32 sums of the decoded vectors against each row's block (from the
 * offset quantize_rows left), then one float step per row (K-quants' minimums in `mins`). Q6_K's halves (elements
 * 0-15, 16-31) are summed apart. */
ALWAYS_INLINE void rows_update(int type, const ivec *vec, const ivec *mag, factors f, const xblock *const *xb,
                               fvec *acc, fvec *mins, const int R) {
    ivec sum[ROW_STEP], half[ROW_STEP];
    if (R == 1) {
        one_row_sums(type, NULL, vec, mag, xb[0], &sum[0], &half[0]);
    } else {
        for (int r = 0; r < R; r++) {
            sum[r] = type == Q6_K ? q6_start(xb[r], 0) : code_offset(type) ? iv_set1(xb[r]->halves[0]) : iv_zero();
            half[r] = iv_zero();
        }
        for (int g = 0; g < 8; g += 2) {
            if (type == Q6_K && g == 4)
                for (int r = 0; r < R; r++) {
                    half[r] = sum[r];
                    sum[r] = q6_start(xb[r], 1);
                }
            for (int r = 0; r < R; r++)
                sum[r] = type == Q8_0 ? iv_dot_signed(iv_dot_signed(sum[r], vec[g], mag[g], four(xb[r], g)), vec[g + 1],
                                                      mag[g + 1], four(xb[r], g + 1))
                                      : iv_dot2(sum[r], vec[g], four(xb[r], g), vec[g + 1], four(xb[r], g + 1));
        }
    }
    for (int r = 0; r < R; r++) float_step(type, sum[r], half[r], f, xb[r], &acc[r], &mins[r]);
}

/* The group's 16 columns against one row (a single stream's decode step, or the last row of a batch of 64k + 1):
 * one_row_sums decoding each vector as its products come, the accumulators in registers. A loop of its own rather
 * than a branch in packed_group's: there the accumulators live in memory beside the rows' and Q6_K's one-row calls ran
 * at half the speed (kernel_speed.py). The same sums and float step as a row among many: the same bits. Block b of
 * the row is at x + b * m, m the batch's rows (its blocks lie among the other rows'). Prefetch hints by vendor
 * (row_prefetch): on the AMD Zen 4 machine one row consumed the stream fast enough for the CPU's own prefetcher, and
 * asking for the lines ahead as well held the pass at five sixths of the memory's speed whenever the memory was fast;
 * on the Intel Xeon (AMX) machine the pass without them read at ~80% of the memory's speed and with them at ~100%
 * (docs/decisions/0010-prefetch-hints.md). */
ALWAYS_INLINE void packed_group_row(int type, const uint8_t *w, const xblock *x, int64_t nb, int64_t m, fvec *res) {
    const int S = is_k(type) ? 8 : 1;
    const int64_t unit = packed_unit_bytes(type);
    fvec acc = fv_zero(), mins = fv_zero();
    const int prefetch = row_prefetch > 0;
    const char *ahead = (const char *)w + ROW_PREFETCH_AHEAD; /* the next line to ask for, where it asks */
    for (int64_t u = 0; u < nb / S; u++) {
        const uint8_t *blk = w + u * unit;
        fvec d = fv_fp16(blk);
        const uint8_t *codes = blk + codes_at(type);
        for (int j = 0; j < S; j++) {
            factors f = sub_block_factors(type, blk, d, j);
            const xblock *xb = x + (u * S + j) * m;
            ivec sum, half;
            if (prefetch) prefetch_through(&ahead, codes + (j + 1) * code_bytes(type), ROW_PREFETCH_AHEAD);
            one_row_sums(type, codes + j * code_bytes(type), NULL, NULL, xb, &sum, &half);
            float_step(type, sum, half, f, xb, &acc, &mins);
        }
    }
    res[0] = fv_sub(acc, mins);
}

/* The group's 16 columns against `rows` rows (<= ROW_CHUNK; block b of row r at x + b * m + r) into res[r]. Block by
 * block: each sub-block's codes are decoded once for all the rows, and the weights stream from memory while the
 * rows compute (the accumulators live in L1). */
ALWAYS_INLINE void packed_group(int type, const uint8_t *w, const xblock *x, int64_t nb, int64_t m, int64_t rows,
                                fvec *res) {
    if (rows == 1) {
        packed_group_row(type, w, x, nb, m, res);
        return;
    }
    const int S = is_k(type) ? 8 : 1; /* sub-blocks per unit */
    const int64_t unit = packed_unit_bytes(type);
    const int has_mins = type == Q4_K || type == Q5_K;
    fvec mins[ROW_CHUNK];
    /* Zeroed a row at a time in registers: written as a plain loop, the compiler calls memset for the rows' 1-4 KiB,
     * and on the LM head (K = 640, every group a short pass) those calls were a few percent of a 16-row step. The other
     * types leave `mins` alone (their float step never reads it) and subtract nothing: x - 0 is x, the same bits. */
    for (int64_t r = 0; r < rows; r++) {
        fvec zero = fv_zero();
        __asm__("" : "+m"(res[r]));
        res[r] = zero;
        if (has_mins) mins[r] = zero;
    }
    const char *ahead = (const char *)w + PREFETCH_AHEAD; /* the next line to ask for */
    for (int64_t u = 0; u < nb / S; u++) {
        const uint8_t *blk = w + u * unit;
        fvec d = fv_fp16(blk);
        const uint8_t *codes = blk + codes_at(type);
        for (int j = 0; j < S; j++) {
            factors f = sub_block_factors(type, blk, d, j);
            prefetch_through(&ahead, codes + (j + 1) * code_bytes(type), PREFETCH_AHEAD);
            ivec vec[8], mag[8]; /* mag: Q8_0's |codes| (AVX2's signed products) */
            for (int g = 0; g < 8; g++) vec[g] = packed_vector(type, codes + j * code_bytes(type), g);
            if (type == Q8_0)
                for (int g = 0; g < 8; g++) mag[g] = iv_magnitude(vec[g]);
            const xblock *block = x + (u * S + j) * m; /* this sub-block's rows, side by side */
            int64_t r = 0;
            for (; r + ROW_STEP <= rows; r += ROW_STEP) {
                const xblock *xb[ROW_STEP];
                for (int i = 0; i < ROW_STEP; i++) xb[i] = block + r + i;
                rows_update(type, vec, mag, f, xb, res + r, mins + r, ROW_STEP);
            }
            for (; r < rows; r++) {
                const xblock *xb = block + r;
                rows_update(type, vec, mag, f, &xb, res + r, mins + r, 1);
            }
        }
    }
    if (has_mins)
        for (int64_t r = 0; r < rows; r++) res[r] = fv_sub(res[r], mins[r]);
}

void any_packed_group(int type, const uint8_t *w, const xblock *x, int64_t nb, int64_t m, int64_t rows, fvec *res) {
    switch (type) {
        case Q4_0: packed_group(Q4_0, w, x, nb, m, rows, res); break;
        case Q5_0: packed_group(Q5_0, w, x, nb, m, rows, res); break;
        case Q8_0: packed_group(Q8_0, w, x, nb, m, rows, res); break;
        case Q4_K: packed_group(Q4_K, w, x, nb, m, rows, res); break;
        case Q5_K: packed_group(Q5_K, w, x, nb, m, rows, res); break;
        default: packed_group(Q6_K, w, x, nb, m, rows, res); break;
    }
}
#endif
