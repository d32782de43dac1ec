/* Weight-only int8 matmul for bfloat16 activations: out (M, N) = x (M, K) @ (q (N, K) * scale (N,))^T, in bf16 (or
 * float32, for logits: no rounding and no conversion pass).
 *
 * Why not torch's `_weight_int8pack_mm`: it converts every weight to float and multiplies in float32, so with several
 * rows the conversions and float multiplies bound it, and the LM head (262,144 x 640) is the largest matmul of every
 * decode step. Here each row of x is quantised to int16 (a power-of-two scale per row, so every value of at least
 * 1/128 of the row's largest is kept exactly) and multiplied against the int8 weights with AVX-512 VNNI's int16 dot
 * product (vpdpwssd), each weight widened to int16 once per ROWS rows: at one row the kernel only streams the weights
 * from memory, at many rows each widened weight serves ROWS rows' dot products. docs/decisions/0005-int8-for-hugging-face.md
 * has the measurements against torch's kernel.
 *
 * Exactness, hence batch invariance: the int16 x int8 products are summed exactly in int32 over chunks of
 * CHUNK_PAIRS input pairs (256 * 32767 * 127 < 2^31), and the chunks' sums are added in float32 in chunk order.
 * A row's result is therefore the same whatever the other rows, the tiling or the thread that computed it.
 *
 * Weight layout ("tiles", made by TiledInt8Linear in linear.py): the output columns in tiles of TILE = 64, and within
 * a tile, for each pair of inputs (2p, 2p+1), the 64 columns' two weights side by side:
 *     tiles[t][p][c][j] = q[t * 64 + c][2p + j],  shape (N / 64, K / 2, 64, 2), N padded with zero rows.
 * So one 32-byte load per 16 columns, widened to int16, is exactly vpdpwssd's operand, with no horizontal sums.
 *
 * Without AVX-512 VNNI, an AVX2 path (vpmaddwd + add) computes the same bits, for x86-64 CPUs without AVX-512.
 *
 * Threads: OpenMP, which resolves to torch's own libgomp when torch is loaded first (one thread pool, no contention).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(_OPENMP)
#define WITH_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(_OPENMP)
#define WITH_AVX2 1
#endif

#if defined(WITH_AVX512) || defined(WITH_AVX2)
#include <immintrin.h>
#include <omp.h>

#include "avx2_common.h"

#define TILE INT8_MATMUL_TILE /* output columns per tile */
#define CHUNK_PAIRS 128        /* input pairs summed exactly in int32 before going to float32 */

int int8_matmul_available(void) { return 1; }

/* The int16 scale of a row whose largest |x| is amax: 2^e, a power of two with amax / 2^e <= 32767 (at most twice
 * the smallest such scale), 0 for a row of zeros, NaN for a row holding NaN or infinity (`bad`), so that its outputs
 * are NaN as torch's would be. Both paths' quantize_row take it from here. */
static float row_scale_of(float amax, int bad) {
    if (bad) return NAN;
    if (!(amax > 0.0f)) return 0.0f;
    int e;
    frexpf(amax / 32767.0f, &e);
    return ldexpf(1.0f, e);
}
#endif

#if defined(WITH_AVX512)
#include "avx512_common.h"

#define BLOCKS 4 /* 16-column blocks per tile (tile_sums names them: 0-3) */
#define ROWS 6   /* rows per register tile (tile_sums names them: 0-5): 24 accumulators + 4 weights + 1 */
_Static_assert(BLOCKS * 16 == TILE, "tile_sums covers a tile with BLOCKS blocks of 16 lanes");

/* One row of x (K,) -> int16 with row_scale_of's scale (K % 16 == 0); a bad row's int16 values are zeros. */
static void quantize_row(const uint16_t *row, int64_t k, int16_t *q, float *scale) {
    __m512 top = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t i = 0; i < k; i += 16) {
        __m512 v = _mm512_abs_ps(load_bf16(row + i));
        bad |= _mm512_cmp_ps_mask(v, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ); /* inf or NaN */
        top = _mm512_max_ps(top, v);
    }
    float s = *scale = row_scale_of(_mm512_reduce_max_ps(top), bad != 0);
    if (bad) {
        memset(q, 0, (size_t)k * sizeof *q);
        return;
    }
    __m512 inv = _mm512_set1_ps(s > 0.0f ? 1.0f / s : 0.0f); /* a power of two: x * inv is exact */
    for (int64_t i = 0; i < k; i += 16) {
        __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(row + i), inv)); /* nearest even */
        _mm256_storeu_si256((__m256i *)(q + i), _mm512_cvtsepi32_epi16(qi));
    }
}

/* acc += pairwise int16 dot products of x and w (vpdpwssd). In inline assembly because gcc 12's pattern for the
 * intrinsic keeps the accumulator in zmm0-15 and moved every accumulator in and out of those on each use. */
static inline __m512i dot_pairs(__m512i acc, __m512i x, __m512i w) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
    return acc;
}

static inline __m512i widen(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }

static inline void add_to(float *total, __m512i acc) {
    _mm512_storeu_ps(total, _mm512_add_ps(_mm512_loadu_ps(total), _mm512_cvtepi32_ps(acc)));
}

/* Rows [0, R) of q against one tile -> float32 sums[R][TILE]. R is a constant in each inlined copy; the ROWS x
 * BLOCKS accumulators are named variables (a0 0..a5 3) so that they live in registers; the float32 totals stay in
 * memory, as registers beside the accumulators they would spill those instead. */
#define ACCUMULATORS(r) __m512i a##r##0 = zero, a##r##1 = zero, a##r##2 = zero, a##r##3 = zero;
#define ROW_DOT(r)                                                                                                  \
    if (R > r) {                                                                                                    \
        int32_t pair;                                                                                               \
        memcpy(&pair, q + r * k + 2 * p, sizeof pair);                                                              \
        __m512i x = _mm512_set1_epi32(pair);                                                                        \
        a##r##0 = dot_pairs(a##r##0, x, w0);                                                                        \
        a##r##1 = dot_pairs(a##r##1, x, w1);                                                                        \
        a##r##2 = dot_pairs(a##r##2, x, w2);                                                                        \
        a##r##3 = dot_pairs(a##r##3, x, w3);                                                                        \
    }
#define ROW_FLUSH(r)                                                                                                \
    if (R > r) {                                                                                                    \
        add_to(sums + r * TILE, a##r##0);                                                                           \
        add_to(sums + r * TILE + 16, a##r##1);                                                                      \
        add_to(sums + r * TILE + 32, a##r##2);                                                                      \
        add_to(sums + r * TILE + 48, a##r##3);                                                                      \
    }

static inline __attribute__((always_inline)) void tile_sums(const int16_t *q, int64_t k, const int8_t *w,
                                                            float *sums, const int R) {
    int64_t pairs = k / 2;
    memset(sums, 0, sizeof(float) * R * TILE);
    for (int64_t p0 = 0; p0 < pairs; p0 += CHUNK_PAIRS) {
        int64_t p1 = p0 + CHUNK_PAIRS < pairs ? p0 + CHUNK_PAIRS : pairs;
        const __m512i zero = _mm512_setzero_si512();
        ACCUMULATORS(0) ACCUMULATORS(1) ACCUMULATORS(2) ACCUMULATORS(3) ACCUMULATORS(4) ACCUMULATORS(5)
        for (int64_t p = p0; p < p1; p++) {
            const int8_t *wp = w + p * 2 * TILE;
            __m512i w0 = widen(wp), w1 = widen(wp + 32), w2 = widen(wp + 64), w3 = widen(wp + 96);
            ROW_DOT(0) ROW_DOT(1) ROW_DOT(2) ROW_DOT(3) ROW_DOT(4) ROW_DOT(5)
        }
        ROW_FLUSH(0) ROW_FLUSH(1) ROW_FLUSH(2) ROW_FLUSH(3) ROW_FLUSH(4) ROW_FLUSH(5)
    }
}

/* One row of one tile: out[c] = sums[c] * (row_scale * scale[c]) for c < cols, in bf16 or float32 */
static void store_row(const float *sums, const float *scale, float row_scale, int64_t cols, void *out, int float_out) {
    __m512 rs = _mm512_set1_ps(row_scale);
    for (int b = 0; b < BLOCKS && b * 16 < cols; b++) {
        int64_t left = cols - b * 16;
        __mmask16 live = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512 w_scale = _mm512_maskz_loadu_ps(live, scale + b * 16);
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sums + b * 16), _mm512_mul_ps(rs, w_scale));
        if (float_out) _mm512_mask_storeu_ps((float *)out + b * 16, live, v);
        else _mm256_mask_storeu_epi16((uint16_t *)out + b * 16, live, to_bf16(v));
    }
}

#elif defined(WITH_AVX2)
/* The same arithmetic with AVX2: vpmaddwd (int16 pairs -> int32) and an add in place of vpdpwssd, 8 lanes, up to 6
 * rows of 2 blocks of 8 columns in registers. Same tiles, same exact int32 chunk sums, same float32 steps: the same
 * bits as the AVX-512 path (a test compares the two builds). */
#define ROWS 6 /* rows per register tile: 12 accumulators + 2 weights + 1 + 1 */

static void quantize_row(const uint16_t *row, int64_t k, int16_t *q, float *scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 top = _mm256_setzero_ps();
    int bad = 0;
    for (int64_t i = 0; i < k; i += 8) {
        __m256 v = _mm256_andnot_ps(sign, load_bf16_8(row + i));
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(v, inf, _CMP_NLT_UQ)); /* inf or NaN */
        top = _mm256_max_ps(top, v);
    }
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    float s = *scale = row_scale_of(amax, bad);
    if (bad) {
        memset(q, 0, (size_t)k * sizeof *q);
        return;
    }
    __m256 inv = _mm256_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
    for (int64_t i = 0; i < k; i += 8) {
        __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(load_bf16_8(row + i), inv)); /* nearest even */
        __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
        _mm_storeu_si128((__m128i *)(q + i), packed);
    }
}

static inline __m256i widen8(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }

static inline void add_to8(float *total, __m256i acc) {
    _mm256_storeu_ps(total, _mm256_add_ps(_mm256_loadu_ps(total), _mm256_cvtepi32_ps(acc)));
}

#define DOT8(r)                                                                                                     \
    if (R > r) {                                                                                                    \
        int32_t pair;                                                                                               \
        memcpy(&pair, q + r * k + 2 * p, sizeof pair);                                                              \
        __m256i x = _mm256_set1_epi32(pair);                                                                        \
        a##r##0 = _mm256_add_epi32(a##r##0, _mm256_madd_epi16(x, w0));                                              \
        a##r##1 = _mm256_add_epi32(a##r##1, _mm256_madd_epi16(x, w1));                                              \
    }
#define FLUSH8(r) if (R > r) add_to8(s0 + r * TILE, a##r##0), add_to8(s0 + r * TILE + 8, a##r##1);

/* rows [0, R) against a tile, a quarter (2 blocks of 8 columns) at a time: R x 2 accumulators */
static inline __attribute__((always_inline)) void tile_sums(const int16_t *q, int64_t k, const int8_t *w,
                                                            float *sums, const int R) {
    int64_t pairs = k / 2;
    memset(sums, 0, sizeof(float) * R * TILE);
    for (int quarter = 0; quarter < 4; quarter++)
        for (int64_t p0 = 0; p0 < pairs; p0 += CHUNK_PAIRS) {
            int64_t p1 = p0 + CHUNK_PAIRS < pairs ? p0 + CHUNK_PAIRS : pairs;
            __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
            __m256i a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
            for (int64_t p = p0; p < p1; p++) {
                const int8_t *wp = w + p * 2 * TILE + 32 * quarter;
                __m256i w0 = widen8(wp), w1 = widen8(wp + 16);
                DOT8(0) DOT8(1) DOT8(2) DOT8(3) DOT8(4) DOT8(5)
            }
            float *s0 = sums + 16 * quarter;
            FLUSH8(0) FLUSH8(1) FLUSH8(2) FLUSH8(3) FLUSH8(4) FLUSH8(5)
        }
}

static void store_row(const float *sums, const float *scale, float row_scale, int64_t cols, void *out, int float_out) {
    __m256 rs = _mm256_set1_ps(row_scale);
    for (int64_t c = 0; c < cols; c += 8) {
        int64_t left = cols - c < 8 ? cols - c : 8;
        float w_scale[8] = {0};
        memcpy(w_scale, scale + c, (size_t)left * sizeof(float));
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(sums + c), _mm256_mul_ps(rs, _mm256_loadu_ps(w_scale)));
        if (float_out) {
            float lanes[8];
            _mm256_storeu_ps(lanes, v);
            memcpy((float *)out + c, lanes, (size_t)left * sizeof(float));
        } else {
            uint16_t lanes[8];
            _mm_storeu_si128((__m128i *)lanes, to_bf16_8(v));
            memcpy((uint16_t *)out + c, lanes, (size_t)left * sizeof(uint16_t));
        }
    }
}

#endif

#if defined(WITH_AVX512) || defined(WITH_AVX2)
/* Rows [0, rows) of q (rows <= ROWS) against one tile, through the path's tile_sums */
_Static_assert(ROWS == 6, "row_tile_sums dispatches 1 to 6 rows");
static void row_tile_sums(const int16_t *q, int64_t k, const int8_t *w, float *sums, int rows) {
    switch (rows) {
        case 1: tile_sums(q, k, w, sums, 1); break;
        case 2: tile_sums(q, k, w, sums, 2); break;
        case 3: tile_sums(q, k, w, sums, 3); break;
        case 4: tile_sums(q, k, w, sums, 4); break;
        case 5: tile_sums(q, k, w, sums, 5); break;
        default: tile_sums(q, k, w, sums, 6); break;
    }
}

/* x (M, K) bf16, tiles as above, scale (N,) float32 -> out (M, N) bf16, or float32 if float_out. K is a multiple of
 * INT8_MATMUL_K_MULTIPLE. Returns 0, or -1 when the int16 scratch cannot be allocated. */
int int8_matmul(const uint16_t *x, int64_t m, int64_t k, const int8_t *tiles, const float *scale, int64_t n,
                void *out, int float_out, int threads) {
    int16_t *q = malloc((size_t)(m * k) * sizeof *q + 64);
    float *row_scale = malloc((size_t)m * sizeof *row_scale + 64);
    if (q == NULL || row_scale == NULL) {
        free(q);
        free(row_scale);
        return -1;
    }
    int64_t ntiles = (n + TILE - 1) / TILE;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) quantize_row(x + r * k, k, q + r * k, row_scale + r);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; t++) {
            int64_t cols = n - t * TILE < TILE ? n - t * TILE : TILE;
            float sums[ROWS * TILE];
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
                int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
                row_tile_sums(q + r0 * k, k, tiles + t * k * TILE, sums, rows);
                for (int r = 0; r < rows; r++) {
                    size_t at = (size_t)((r0 + r) * n + t * TILE) * (float_out ? sizeof(float) : sizeof(uint16_t));
                    store_row(sums + r * TILE, scale + t * TILE, row_scale[r0 + r], cols, (char *)out + at, float_out);
                }
            }
        }
    }
    free(q);
    free(row_scale);
    return 0;
}

#else /* neither AVX-512 VNNI nor AVX2, or no OpenMP: linear.py keeps torch's int8 kernel */
int int8_matmul_available(void) { return 0; }
int int8_matmul(const uint16_t *x, int64_t m, int64_t k, const int8_t *tiles, const float *scale, int64_t n,
                void *out, int float_out, int threads) {
    (void)x, (void)m, (void)k, (void)tiles, (void)scale, (void)n, (void)out, (void)float_out, (void)threads;
    return -1;
}
#endif
