/* GGUF's quantised weights multiplied as they are in the file: out (M, N) = x (M, K) @ W (N, K)^T, where W's rows
 * are the file's own blocks of Q4_0, Q5_0, Q8_0 (32 weights each) or Q4_K, Q5_K, Q6_K (256 weights each), never
 * widened in memory. A decode step reads every weight once, so on a memory-bound CPU fewer bytes per weight is speed.
 *
 * How: each row of x is first quantised to int8 in blocks of 32 (gguf_quantize_rows: a float32 scale per block, the
 * arithmetic of gguf_quant.quantize_activations in torch), then every 32-weight block is decoded to its integer codes
 * in a 256-bit register and multiplied with the activation block in integer dot products (AVX-512 VNNI's vpdpbusd,
 * or AVX2's vpmaddubsw + vpmaddwd): eight int32 lanes, each the exact sum of four products. Per block, the lanes go
 * to float32 and are accumulated as lanes += float(lanes) * (x scale * weight scale); the K-quants' minimums are
 * subtracted through the activation block's exact sum. After the last block the eight lanes are added in one fixed
 * order.
 *
 * Exactness, hence batch invariance and the same bits on both paths: the integer lanes are exact (no saturation: the
 * unsigned codes are at most 63 and |x| at most 127, or, for Q8_0's signed codes, |w| * |x| <= 128 * 127), and every
 * float operation on a (row, column) pair is the same, in the same order, whatever the other rows, the thread, or
 * the instruction set. Rows are processed ROWS at a time so that a decoded weight block serves several rows.
 *
 * Threads: OpenMP over the output columns (each thread streams its own rows of W), which resolves to torch's own
 * libgomp when torch is loaded first.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__) && defined(_OPENMP)
#define WITH_VNNI 1
#define WITH_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(_OPENMP)
#define WITH_SIMD 1
#endif

/* ggml's type numbers (gguf.GGMLQuantizationType) */
enum { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#if defined(WITH_SIMD)
#include <immintrin.h>
#include <omp.h>

#define ROWS 4 /* activation rows per pass over a column's blocks */

int gguf_matmul_available(void) { return 1; }

/* One activation block: its scale, the exact sum of its codes, the sums of each group of four (one per int32 lane
 * of the dot product, for the codes' offsets), and the 32 codes. */
typedef struct {
    float d;
    int32_t sum;
    int32_t lanes[8];
    int8_t q[32];
} xblock;
_Static_assert(sizeof(xblock) == GGUF_XBLOCK_BYTES, "kernels.h states an activation block's size");

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bf16, round to nearest even; NaN stays NaN (quiet) */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return (uint16_t)((u | 0x400000u) >> 16);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One row (K,) -> K / 32 blocks. Per block: amax = max |x|; not finite -> scale NaN and codes 0 (the row's outputs
 * are NaN, as torch's would be); 0 -> scale 0; else scale amax / 127 and codes round-half-even(x * (127 / amax)). */
static void quantize_row(const uint16_t *row, int64_t k, xblock *out) {
    for (int64_t b = 0; b < k / 32; b++) {
        float v[32], amax = 0.0f;
        int bad = 0;
        for (int i = 0; i < 32; i++) {
            v[i] = bf16_to_float(row[32 * b + i]);
            float a = fabsf(v[i]);
            bad |= !(a <= 3.4028234663852886e38f);
            amax = a > amax ? a : amax;
        }
        xblock *o = out + b;
        memset(o, 0, sizeof *o);
        if (bad) {
            o->d = NAN;
            continue;
        }
        if (amax == 0.0f) continue;
        float inv = 127.0f / amax;
        o->d = amax / 127.0f;
        for (int i = 0; i < 32; i++) {
            float r = nearbyintf(v[i] * inv);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            o->q[i] = (int8_t)r;
            o->sum += (int32_t)r;
            o->lanes[i / 4] += (int32_t)r;
        }
    }
}

int gguf_quantize_rows(const uint16_t *x, int64_t stride, int64_t m, int64_t k, void *out, int threads) {
    if (k % 32) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < m; r++) quantize_row(x + r * stride, k, (xblock *)out + r * (k / 32));
    return 0;
}

/* --- the integer dot products: the only place the two paths differ, and they agree exactly ---------------------- */

/* lanes j = sum over i in [4j, 4j+4) of u[i] * x[i], for u unsigned codes <= 128 (AVX2's vpmaddubsw saturates its
 * int16 pair sums: 2 * 128 * 127 fits) */
static inline __m256i dot_unsigned(__m256i u, __m256i x) {
#if defined(WITH_VNNI)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

/* the same for signed codes w (Q8_0): |w| against x with w's sign (exact for every w, -128 included) */
static inline __m256i dot_signed(__m256i w, __m256i x) {
    return dot_unsigned(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 16 bytes of nibbles -> 32 codes: the low nibbles are elements 0-15, the high ones 16-31 (ggml's order) */
static inline __m256i nibbles16(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0f));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
    return _mm256_set_m128i(hi, lo);
}

/* 32 bits -> 32 bytes: byte i is `value` where bit i is set, else 0 */
static inline __m256i bits_to_bytes(uint32_t bits, char value) {
#if defined(WITH_VNNI)
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(value));
#else
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(value));
#endif
}

/* the eight lanes added in one fixed order, the same on both paths */
static inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* lanes (int32) * scale accumulated into acc, the one float step per block */
static inline __m256 accumulate(__m256 acc, __m256i lanes, float scale) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(scale), acc);
}

/* codes with an offset (value = code - 2^shift): the dot product less the offset times each lane's activation sum */
static inline __m256i dot_offset(__m256i u, const xblock *xb, int shift) {
    return _mm256_sub_epi32(dot_unsigned(u, load32(xb->q)), _mm256_slli_epi32(load32(xb->lanes), shift));
}

/* --- a tile of C columns against R rows ------------------------------------------------------------------- */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline int64_t block_bytes(int type) {
    switch (type) {
        case Q4_0: return 18;
        case Q5_0: return 22;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        default: return 210; /* Q6_K */
    }
}

/* 32-weight blocks per scale group: the K-quants' 256-weight super-blocks hold 8 */
static inline int group_blocks(int type) { return type == Q4_K || type == Q5_K || type == Q6_K ? 8 : 1; }

/* Q4_K and Q5_K: eight 6-bit (scale, min) pairs per 256, packed in 12 bytes as ggml's get_scale_min_k4 reads them;
 * sub-block j's weights are (d * scale_j) * code - (dmin * min_j) */
static inline void k_scales(const uint8_t *blk, float *scale, float *min) {
    float d = fp16(blk), dmin = fp16(blk + 2);
    const uint8_t *q = blk + 4;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        if (j < 4) {
            sc = q[j] & 63;
            m = q[j + 4] & 63;
        } else {
            sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
            m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
        scale[j] = d * (float)sc;
        min[j] = dmin * (float)m;
    }
}

/* A group's float scale per 32 weights (and the K-quants' minimums): Q4_0/Q5_0/Q8_0 and Q6_K have one d per group
 * (Q6_K's 16-weight int8 scales are applied in the integer lanes instead) */
ALWAYS_INLINE void group_scales(int type, const uint8_t *blk, float *scale, float *min) {
    if (type == Q4_K || type == Q5_K)
        k_scales(blk, scale, min);
    else
        scale[0] = fp16(type == Q6_K ? blk + 208 : blk);
}

/* Block j of a group -> its 32 codes, unsigned (offset types, K-quants) or signed (Q8_0), in element order.
 * Q4_0: 16 bytes of nibbles after d; Q5_0: plus bit i of qh as 16; Q8_0: the int8 codes.
 * Q4_K: the low (even j) or high (odd j) nibbles of the 32 bytes at qs + 32 * (j / 2); Q5_K adds bit j of qh[l].
 * Q6_K: two halves of 128; in half h, quarter q: the low (q < 2) or high nibbles of ql[64h + 32(q % 2) + l], and
 * bits 2q, 2q+1 of qh[32h + l] as 16 and 32. */
ALWAYS_INLINE __m256i codes(int type, const uint8_t *blk, int j) {
    switch (type) {
        case Q4_0: return nibbles16(blk + 2);
        case Q5_0: {
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            return _mm256_or_si256(nibbles16(blk + 6), bits_to_bytes(qh, 0x10));
        }
        case Q8_0: return load32(blk + 2);
        case Q4_K:
        case Q5_K: {
            const uint8_t *qs = blk + (type == Q5_K ? 48 : 16);
            __m256i v = load32(qs + 32 * (j / 2));
            __m256i u = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
            if (type == Q5_K) {
                __m256i h = _mm256_and_si256(_mm256_srli_epi16(load32(blk + 16), j), _mm256_set1_epi8(1));
                u = _mm256_or_si256(u, _mm256_slli_epi16(h, 4));
            }
            return u;
        }
        default: { /* Q6_K */
            int h = j / 4, q = j % 4;
            __m256i v = load32(blk + 64 * h + 32 * (q % 2));
            __m256i lo = _mm256_and_si256(q < 2 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
            __m256i hb = _mm256_and_si256(_mm256_srli_epi16(load32(blk + 128 + 32 * h), 2 * q), _mm256_set1_epi8(3));
            return _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
        }
    }
}

/* Q6_K's int8 scales of block j: one per 16 weights, i.e. lanes 0-3 and 4-7 */
static inline __m256i q6_lane_scales(const uint8_t *blk, int j) {
    const int8_t *sc = (const int8_t *)(blk + 192) + 8 * (j / 4) + 2 * (j % 4);
    return _mm256_setr_epi32(sc[0], sc[0], sc[0], sc[0], sc[1], sc[1], sc[1], sc[1]);
}

/* The exact integer lanes of one block's codes against one activation block. Offsets: Q4_0 8, Q5_0 16, Q6_K 32. */
ALWAYS_INLINE __m256i block_lanes(int type, __m256i u, __m256i lane_scales, const xblock *xb) {
    switch (type) {
        case Q4_0: return dot_offset(u, xb, 3);
        case Q5_0: return dot_offset(u, xb, 4);
        case Q8_0: return dot_signed(u, load32(xb->q));
        case Q6_K: return _mm256_mullo_epi32(dot_offset(u, xb, 5), lane_scales);
        default: return dot_unsigned(u, load32(xb->q)); /* Q4_K, Q5_K: the minimums go through xb->sum */
    }
}

/* C columns (rows of W, row_bytes apart) against R rows of x (row r at x + r * nb): res[r * C + c]. Every float
 * operation on a (column, row) pair is the same whatever C and R are, so neither changes a bit of the result. */
ALWAYS_INLINE void tile(int type, const uint8_t *w, int64_t row_bytes, const xblock *x, int64_t nb, float *res,
                        const int C, const int R) {
    const int G = group_blocks(type);
    const int has_min = type == Q4_K || type == Q5_K;
    __m256 acc[C][R];
    float mins[C][R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) {
            acc[c][r] = _mm256_setzero_ps();
            mins[c][r] = 0.0f;
        }
    for (int64_t g = 0; g < nb / G; g++) {
        for (int c = 0; c < C; c++) {
            const uint8_t *blk = w + c * row_bytes + g * block_bytes(type);
            float scale[8], min[8];
            group_scales(type, blk, scale, min);
            for (int j = 0; j < G; j++) {
                __m256i u = codes(type, blk, j);
                __m256i lane_scales = type == Q6_K ? q6_lane_scales(blk, j) : _mm256_setzero_si256();
                float wscale = has_min ? scale[j] : scale[0];
                for (int r = 0; r < R; r++) {
                    const xblock *xb = x + r * nb + g * G + j;
                    acc[c][r] = accumulate(acc[c][r], block_lanes(type, u, lane_scales, xb), xb->d * wscale);
                    if (has_min) mins[c][r] += xb->d * min[j] * (float)xb->sum;
                }
            }
        }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) res[r * C + c] = sum_lanes(acc[c][r]) - mins[c][r];
}

#define COLS 4 /* columns per tile: independent accumulators, and a column's loop overhead shared */

/* a tile of `cols` (COLS, or 1 for the last few) against `rows` (<= ROWS): the type and shape constant in each copy */
ALWAYS_INLINE void typed_tile(int type, const uint8_t *w, int64_t row_bytes, const xblock *x, int64_t nb, float *res,
                              int cols, int rows) {
    if (cols == 1) {
        switch (rows) {
            case 1: tile(type, w, row_bytes, x, nb, res, 1, 1); break;
            case 2: tile(type, w, row_bytes, x, nb, res, 1, 2); break;
            case 3: tile(type, w, row_bytes, x, nb, res, 1, 3); break;
            default: tile(type, w, row_bytes, x, nb, res, 1, 4); break;
        }
        return;
    }
    switch (rows) { /* at most 8 accumulators: AVX2 has 16 registers */
        case 1: tile(type, w, row_bytes, x, nb, res, COLS, 1); break;
        case 2: tile(type, w, row_bytes, x, nb, res, COLS, 2); break;
        case 3: /* two tiles of two columns */
            tile(type, w, row_bytes, x, nb, res, 2, 3);
            {
                float more[6];
                tile(type, w + 2 * row_bytes, row_bytes, x, nb, more, 2, 3);
                for (int r = 2; r >= 0; r--) {
                    res[r * COLS + 3] = more[r * 2 + 1];
                    res[r * COLS + 2] = more[r * 2];
                    res[r * COLS + 1] = res[r * 2 + 1];
                    res[r * COLS + 0] = res[r * 2];
                }
            }
            break;
        default:
            tile(type, w, row_bytes, x, nb, res, 2, 4);
            {
                float more[8];
                tile(type, w + 2 * row_bytes, row_bytes, x, nb, more, 2, 4);
                for (int r = 3; r >= 0; r--) {
                    res[r * COLS + 3] = more[r * 2 + 1];
                    res[r * COLS + 2] = more[r * 2];
                    res[r * COLS + 1] = res[r * 2 + 1];
                    res[r * COLS + 0] = res[r * 2];
                }
            }
            break;
    }
}

_Static_assert(ROWS == 4, "typed_tile dispatches 1 to 4 rows");
static void any_tile(int type, const uint8_t *w, int64_t row_bytes, const xblock *x, int64_t nb, float *res,
                     int cols, int rows) {
    switch (type) {
        case Q4_0: typed_tile(Q4_0, w, row_bytes, x, nb, res, cols, rows); break;
        case Q5_0: typed_tile(Q5_0, w, row_bytes, x, nb, res, cols, rows); break;
        case Q8_0: typed_tile(Q8_0, w, row_bytes, x, nb, res, cols, rows); break;
        case Q4_K: typed_tile(Q4_K, w, row_bytes, x, nb, res, cols, rows); break;
        case Q5_K: typed_tile(Q5_K, w, row_bytes, x, nb, res, cols, rows); break;
        default: typed_tile(Q6_K, w, row_bytes, x, nb, res, cols, rows); break;
    }
}

static int64_t row_bytes_of(int type, int64_t k) {
    switch (type) {
        case Q4_0: return k / 32 * 18;
        case Q5_0: return k / 32 * 22;
        case Q8_0: return k / 32 * 34;
        case Q4_K: return k % 256 ? -1 : k / 256 * 144;
        case Q5_K: return k % 256 ? -1 : k / 256 * 176;
        case Q6_K: return k % 256 ? -1 : k / 256 * 210;
        default: return -1;
    }
}

/* xq: M rows of K / 32 blocks (gguf_quantize_rows); w: N rows of `type` blocks; out: (M, ldo) bf16, or float32 if
 * float_out, columns [0, N) written. Returns 0, or -1 for a type or width this kernel does not take. */
int gguf_matmul(const void *xq, int64_t m, int64_t k, int type, const uint8_t *w, int64_t n, void *out, int64_t ldo,
                int float_out, int threads) {
    int64_t row_bytes = row_bytes_of(type, k);
    if (row_bytes < 0 || k % 32) return -1;
    const xblock *x = xq;
    int64_t nb = k / 32, tiles = (n + COLS - 1) / COLS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t c0 = t * COLS;
        int cols = n - c0 < COLS ? 1 : COLS;
        for (int64_t c = c0; c < c0 + COLS && c < n; c += cols) {
            float res[ROWS * COLS];
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
                int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
                any_tile(type, w + c * row_bytes, row_bytes, x + r0 * nb, nb, res, cols, rows);
                for (int r = 0; r < rows; r++)
                    for (int j = 0; j < cols; j++) {
                        int64_t at = (r0 + r) * ldo + c + j;
                        if (float_out)
                            ((float *)out)[at] = res[r * cols + j];
                        else
                            ((uint16_t *)out)[at] = float_to_bf16(res[r * cols + j]);
                    }
            }
        }
    }
    return 0;
}

/* --- the 32-weight types repacked: eight columns in the lanes ---------------------------------------------------
 *
 * Q4_0, Q5_0 and Q8_0 rows are regrouped once at load (gguf_repack) so that one integer dot product instruction
 * serves eight output columns: in a group of 8 columns, block b's codes are held as eight 32-byte vectors, vector g
 * holding elements 4g..4g+3 of each column side by side (byte 4c + e = column c, element 4g + e). Against a
 * broadcast of the activation's four elements 4g..4g+3, vpdpbusd then adds column c's four products into lane c,
 * and after the eight vectors lane c holds column c's exact block sum: no horizontal sums, one float multiply-add
 * per block for eight columns. Per group and block, bytes as in the file, in this order:
 *   8 fp16 scales (column order), then the codes:
 *   Q4_0: 4 x 32 bytes, vector p in the low nibbles and vector p + 4 in the high ones (codes 0..15, offset 8);
 *   Q5_0: the same, then 8 x uint32: bit i of word g is the fifth bit (16) of vector g's byte i (offset 16);
 *   Q8_0: 8 x 32 bytes, the vectors as they are (signed).
 * Columns past N are zeros (a group is padded), so every group is whole. The float operations per (column, row)
 * are the same whatever the rows, groups or instruction set: every path gives the same bits. */

static inline int64_t packed_block_bytes(int type) {
    switch (type) {
        case Q4_0: return 16 + 128;
        case Q5_0: return 16 + 128 + 32;
        case Q8_0: return 16 + 256;
        default: return -1;
    }
}

/* the integer code of element e of a file block (Q4_0 / Q5_0 unsigned with their offsets, Q8_0 signed) */
static inline int file_code(int type, const uint8_t *blk, int e) {
    switch (type) {
        case Q4_0: return e < 16 ? blk[2 + e] & 0x0f : blk[2 + e - 16] >> 4;
        case Q5_0: {
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            int lo = e < 16 ? blk[6 + e] & 0x0f : blk[6 + e - 16] >> 4;
            return lo | (int)((qh >> e) & 1) << 4;
        }
        default: return (int8_t)blk[2 + e];
    }
}

static void repack_block(int type, const uint8_t *const cols[8], uint8_t *out) {
    for (int c = 0; c < 8; c++) memcpy(out + 2 * c, cols[c], 2); /* d */
    uint8_t *codes = out + 16;
    uint8_t vec[8][32];
    for (int g = 0; g < 8; g++)
        for (int c = 0; c < 8; c++)
            for (int e = 0; e < 4; e++) vec[g][4 * c + e] = (uint8_t)file_code(type, cols[c], 4 * g + e);
    if (type == Q8_0) {
        memcpy(codes, vec, 256);
        return;
    }
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < 32; i++) codes[32 * p + i] = (uint8_t)((vec[p][i] & 0x0f) | (vec[p + 4][i] & 0x0f) << 4);
    if (type == Q5_0)
        for (int g = 0; g < 8; g++) {
            uint32_t bits = 0;
            for (int i = 0; i < 32; i++) bits |= (uint32_t)((vec[g][i] >> 4) & 1) << i;
            memcpy(codes + 128 + 4 * g, &bits, 4);
        }
}

int64_t gguf_packed_bytes(int type, int64_t n, int64_t k) {
    if (packed_block_bytes(type) < 0 || k % 32) return -1;
    return (n + 7) / 8 * (k / 32) * packed_block_bytes(type);
}

int gguf_repack(int type, const uint8_t *w, int64_t n, int64_t k, uint8_t *out, int threads) {
    int64_t bytes = packed_block_bytes(type), row_bytes = row_bytes_of(type, k), nb = k / 32;
    if (bytes < 0 || k % 32) return -1;
    const uint8_t zeros[34] = {0};
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t grp = 0; grp < (n + 7) / 8; grp++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *cols[8];
            for (int c = 0; c < 8; c++) {
                int64_t col = 8 * grp + c;
                cols[c] = col < n ? w + col * row_bytes + b * block_bytes(type) : zeros;
            }
            repack_block(type, cols, out + (grp * nb + b) * bytes);
        }
    return 0;
}

/* block b of a group: its eight code vectors, as the dot product takes them (Q8_0 with VNNI: offset by 128) */
ALWAYS_INLINE void packed_codes(int type, const uint8_t *codes, __m256i *vec) {
    if (type == Q8_0) {
        for (int g = 0; g < 8; g++) {
            vec[g] = load32(codes + 32 * g);
#if defined(WITH_VNNI)
            vec[g] = _mm256_xor_si256(vec[g], _mm256_set1_epi8((char)0x80));
#endif
        }
        return;
    }
    for (int p = 0; p < 4; p++) {
        __m256i v = load32(codes + 32 * p);
        vec[p] = _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
        vec[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
    }
    if (type == Q5_0)
        for (int g = 0; g < 8; g++) {
            uint32_t bits;
            memcpy(&bits, codes + 128 + 4 * g, 4);
            vec[g] = _mm256_or_si256(vec[g], bits_to_bytes(bits, 0x10));
        }
}

/* lane c: column c's exact block sum against one activation block (offsets applied) */
ALWAYS_INLINE __m256i packed_lanes(int type, const __m256i *vec, const xblock *xb) {
    __m256i even = _mm256_setzero_si256(), odd = even;
    for (int g = 0; g < 8; g += 2) {
        int32_t x0, x1;
        memcpy(&x0, xb->q + 4 * g, 4);
        memcpy(&x1, xb->q + 4 * g + 4, 4);
        __m256i b0 = _mm256_set1_epi32(x0), b1 = _mm256_set1_epi32(x1);
#if defined(WITH_VNNI)
        even = _mm256_dpbusd_epi32(even, vec[g], b0);
        odd = _mm256_dpbusd_epi32(odd, vec[g + 1], b1);
#else
        if (type == Q8_0) {
            even = _mm256_add_epi32(even, dot_signed(vec[g], b0));
            odd = _mm256_add_epi32(odd, dot_signed(vec[g + 1], b1));
        } else {
            even = _mm256_add_epi32(even, dot_unsigned(vec[g], b0));
            odd = _mm256_add_epi32(odd, dot_unsigned(vec[g + 1], b1));
        }
#endif
    }
    __m256i sum = _mm256_add_epi32(even, odd);
    int offset = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
#if defined(WITH_VNNI)
    if (type == Q8_0) offset = 128;
#endif
    return offset ? _mm256_sub_epi32(sum, _mm256_set1_epi32(offset * xb->sum)) : sum;
}

/* groups [0, G) of 8 columns (consecutive in `w`) against R rows: acc lanes are the columns */
ALWAYS_INLINE void packed_tile(int type, const uint8_t *w, int64_t group_bytes, const xblock *x, int64_t nb,
                               __m256 *out, const int G, const int R) {
    const int64_t bytes = packed_block_bytes(type);
    __m256 acc[G][R];
    for (int gi = 0; gi < G; gi++)
        for (int r = 0; r < R; r++) acc[gi][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int gi = 0; gi < G; gi++) {
            const uint8_t *blk = w + gi * group_bytes + b * bytes;
            __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            __m256i vec[8];
            packed_codes(type, blk + 16, vec);
            for (int r = 0; r < R; r++) {
                const xblock *xb = x + r * nb + b;
                __m256 scale = _mm256_mul_ps(wd, _mm256_set1_ps(xb->d));
                acc[gi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(packed_lanes(type, vec, xb)), scale, acc[gi][r]);
            }
        }
    for (int gi = 0; gi < G; gi++)
        for (int r = 0; r < R; r++) out[r * G + gi] = acc[gi][r];
}

ALWAYS_INLINE void typed_packed_tile(int type, const uint8_t *w, int64_t group_bytes, const xblock *x, int64_t nb,
                                     __m256 *out, int groups, int rows) {
    if (groups == 2) { /* one row: two groups for independent work */
        packed_tile(type, w, group_bytes, x, nb, out, 2, 1);
        return;
    }
    switch (rows) {
        case 1: packed_tile(type, w, group_bytes, x, nb, out, 1, 1); break;
        case 2: packed_tile(type, w, group_bytes, x, nb, out, 1, 2); break;
        case 3: packed_tile(type, w, group_bytes, x, nb, out, 1, 3); break;
        default: packed_tile(type, w, group_bytes, x, nb, out, 1, 4); break;
    }
}

static void any_packed_tile(int type, const uint8_t *w, int64_t group_bytes, const xblock *x, int64_t nb,
                            __m256 *out, int groups, int rows) {
    switch (type) {
        case Q4_0: typed_packed_tile(Q4_0, w, group_bytes, x, nb, out, groups, rows); break;
        case Q5_0: typed_packed_tile(Q5_0, w, group_bytes, x, nb, out, groups, rows); break;
        default: typed_packed_tile(Q8_0, w, group_bytes, x, nb, out, groups, rows); break;
    }
}

static void store_lanes(__m256 v, int64_t cols, void *out, int float_out) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int64_t c = 0; c < cols; c++) {
        if (float_out)
            ((float *)out)[c] = lanes[c];
        else
            ((uint16_t *)out)[c] = float_to_bf16(lanes[c]);
    }
}

/* as gguf_matmul, with w repacked by gguf_repack (n columns, padded to a multiple of 8) */
int gguf_matmul_packed(const void *xq, int64_t m, int64_t k, int type, const uint8_t *w, int64_t n, void *out,
                       int64_t ldo, int float_out, int threads) {
    if (packed_block_bytes(type) < 0 || k % 32) return -1;
    const xblock *x = xq;
    int64_t nb = k / 32, groups = (n + 7) / 8, group_bytes = nb * packed_block_bytes(type);
    size_t elem = float_out ? sizeof(float) : sizeof(uint16_t);
    int per_tile = m == 1 ? 2 : 1; /* groups per tile */
    int64_t tiles = (groups + per_tile - 1) / per_tile;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t g0 = t * per_tile;
        int g = groups - g0 < per_tile ? 1 : per_tile;
        for (int64_t gi = g0; gi < g0 + per_tile && gi < groups; gi += g) {
            __m256 res[ROWS * 2];
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
                int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
                any_packed_tile(type, w + gi * group_bytes, group_bytes, x + r0 * nb, nb, res, g, rows);
                for (int r = 0; r < rows; r++)
                    for (int j = 0; j < g; j++) {
                        int64_t c = 8 * (gi + j), cols = n - c < 8 ? n - c : 8;
                        store_lanes(res[r * g + j], cols, (char *)out + ((r0 + r) * ldo + c) * elem, float_out);
                    }
            }
        }
    }
    return 0;
}

#else /* neither AVX-512 VNNI nor AVX2 (with F16C), or no OpenMP: linear.py keeps the torch path */
int gguf_matmul_available(void) { return 0; }
int gguf_quantize_rows(const uint16_t *x, int64_t stride, int64_t m, int64_t k, void *out, int threads) {
    (void)x, (void)stride, (void)m, (void)k, (void)out, (void)threads;
    return -1;
}
int64_t gguf_packed_bytes(int type, int64_t n, int64_t k) {
    (void)type, (void)n, (void)k;
    return -1;
}
int gguf_repack(int type, const uint8_t *w, int64_t n, int64_t k, uint8_t *out, int threads) {
    (void)type, (void)w, (void)n, (void)k, (void)out, (void)threads;
    return -1;
}
int gguf_matmul_packed(const void *xq, int64_t m, int64_t k, int type, const uint8_t *w, int64_t n, void *out,
                       int64_t ldo, int float_out, int threads) {
    (void)xq, (void)m, (void)k, (void)type, (void)w, (void)n, (void)out, (void)ldo, (void)float_out, (void)threads;
    return -1;
}
int gguf_matmul(const void *xq, int64_t m, int64_t k, int type, const uint8_t *w, int64_t n, void *out, int64_t ldo,
                int float_out, int threads) {
    (void)xq, (void)m, (void)k, (void)type, (void)w, (void)n, (void)out, (void)ldo, (void)float_out, (void)threads;
    return -1;
}
#endif
