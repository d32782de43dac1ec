/* GGUF's quantised weights multiplied as they are: out (M, N) = x (M, K) @ W (N, K)^T, where W is a GGUF file's
 * Q4_0, Q5_0, Q8_0 (32 weights a block) or Q4_K, Q5_K, Q6_K (256 a super-block) tensor, regrouped once at load
 * (gguf_repack, the layout below) and never widened: a decode step reads every weight once, so on a memory-bound CPU
 * the bytes per weight are the speed.
 *
 * How: each row of x is first quantised to int8 in blocks of 32 (gguf_quantize_rows: a float32 scale per block, the
 * arithmetic of gguf_quant.quantize_activations in torch). Each 32-weight block's integer codes are then multiplied
 * with the activation block in integer dot products (AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd),
 * sixteen output columns to a vector, and the exact int32 block sums go to float32 once per block:
 * acc += float(sum) * (weight scale * x scale), the K-quants' minimums subtracted through the activation block's sum.
 *
 * Exactness, hence batch invariance and the same bits on both paths: the integer sums are exact (unsigned codes are
 * at most 63 and |x| at most 127, so AVX2's int16 pair sums cannot saturate; Q8_0's signed codes go through |w| and
 * x with w's sign on AVX2, +128 and the activation sum on AVX-512), and every (row, column) pair sees the same float
 * operations in the same order whatever the other rows, the thread, or the instruction set.
 *
 * AMX (further down): on CPUs that have it, whole tiles of 16 rows of every type but Q6_K take their exact block sums
 * from tile products instead, with the same float step: the same bits.
 *
 * Threads: OpenMP over the column groups, which resolves to torch's own libgomp when torch is loaded first. Each
 * thread streams its own even share of W, claimed a few groups at a time; a thread done with its share claims what is
 * left of the others', so a core the OS lent to another thread for a while (the server's event loop, a client on the
 * same machine, a neighbour on a shared host) delays the call by its share of the work, not by the whole wait. Which
 * thread computes a group never changes its bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "bf16.h"
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
/* a layout of our own, regrouped from a Q8_0 tensor: its codes less their two low bits (gguf_greedy_row) */
enum { HIGH6 = GGUF_Q8_0_HIGH6 };

#if defined(WITH_SIMD)
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>

#include "avx2_common.h"

int gguf_matmul_available(void) { return 1; }

/* One activation block: its scale, the exact sum of its codes and of each half's (for the codes' offsets and the
 * K-quants' minimums; Q6_K's scales cover 16 weights), and the 32 codes. */
typedef struct {
    float d;
    int32_t sum;
    int32_t halves[2];
    int8_t q[32];
} xblock;
_Static_assert(sizeof(xblock) == GGUF_XBLOCK_BYTES, "kernels.h states an activation block's size");

/* One block of 32 inputs. amax = max |x|; not finite -> scale NaN and codes 0 (the row's outputs are NaN, as
 * torch's would be); 0 -> scale 0; else scale amax / 127 and codes round-half-even(x * (127 / amax)), clamped. */
#if defined(WITH_VNNI)
#include "avx512_common.h"

/* 16 lanes at a time: the same IEEE operations as the scalar version below, so the same codes and scales */
static void quantize_block(const uint16_t *src, xblock *o) {
    __m512 v[2] = {load_bf16(src), load_bf16(src + 16)};
    __m512 a0 = _mm512_abs_ps(v[0]), a1 = _mm512_abs_ps(v[1]);
    const __m512 big = _mm512_set1_ps(3.4028234663852886e38f);
    int finite = (_mm512_cmp_ps_mask(a0, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, big, _CMP_LE_OQ)) == 0xffff;
    memset(o, 0, sizeof *o);
    if (!finite) {
        o->d = NAN;
        return;
    }
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    if (amax == 0.0f) return;
    __m512 inv = _mm512_set1_ps(127.0f / amax);
    o->d = amax / 127.0f;
    for (int h = 0; h < 2; h++) {
        __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[h], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), r)); /* NaN stays NaN */
        __m512i q = _mm512_cvtps_epi32(r);
        _mm_storeu_si128((__m128i *)(o->q + 16 * h), _mm512_cvtepi32_epi8(q));
        o->halves[h] = _mm512_reduce_add_epi32(q);
    }
    o->sum = o->halves[0] + o->halves[1];
}
#else
static void quantize_block(const uint16_t *src, xblock *o) {
    float v[32], amax = 0.0f;
    int bad = 0;
    for (int i = 0; i < 32; i++) {
        v[i] = bf16_to_float(src[i]);
        float a = fabsf(v[i]);
        bad |= !(a <= 3.4028234663852886e38f);
        amax = a > amax ? a : amax;
    }
    memset(o, 0, sizeof *o);
    if (bad) {
        o->d = NAN;
        return;
    }
    if (amax == 0.0f) return;
    float inv = 127.0f / amax;
    o->d = amax / 127.0f;
    for (int i = 0; i < 32; i++) {
        float r = nearbyintf(v[i] * inv);
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        o->q[i] = (int8_t)r;
        o->halves[i / 16] += (int32_t)r;
    }
    o->sum = o->halves[0] + o->halves[1];
}
#endif

/* How the blocks are laid out and what they carry besides (gguf_quantize_rows: plain blocks, row after row). The
 * matmul's scratch is block-major (block b of every row, then block b + 1, as a group's pass reads them) and holds
 * what each row's update needs of its block, made once per block rather than once per block, group and row (`halves`
 * being Q6_K's alone): with an `offset`, halves[0] = -offset * sum, the value the block's sums start from; with
 * `dsum` (Q4_K, Q5_K), halves[1] holds the float d * sum that scales the minimums. The same integers and the same
 * float product as computed in place, so the same bits. */
typedef struct {
    int block_major;
    int32_t offset;
    int dsum;
} block_layout;

/* rows (M, K), `stride` apart -> M * K / 32 blocks, laid out as `layout` says; shared out by block, so one row uses
 * both cores. Called inside a parallel region. */
static void quantize_rows(const uint16_t *x, int64_t stride, int64_t m, int64_t k, xblock *out, block_layout layout) {
    int64_t nb = k / 32;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m * nb; i++) {
        int64_t row = i / nb, b = i % nb;
        xblock *o = out + (layout.block_major ? b * m + row : i);
        quantize_block(x + row * stride + 32 * b, o);
        if (layout.offset) o->halves[0] = -layout.offset * o->sum;
        if (layout.dsum) {
            float dsum = o->d * (float)o->sum;
            memcpy(&o->halves[1], &dsum, sizeof dsum);
        }
    }
}

int gguf_quantize_rows(const uint16_t *x, int64_t stride, int64_t m, int64_t k, void *out, int threads) {
    if (k % 32) return -1;
#pragma omp parallel num_threads(threads)
    quantize_rows(x, stride, m, k, out, (block_layout){0, 0, 0});
    return 0;
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* bytes of one block of the file */
static inline int64_t block_bytes(int type) {
    switch (type) {
        case Q4_0: return 18;
        case Q5_0: return 22;
        case Q8_0:
        case HIGH6: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        default: return 210; /* Q6_K */
    }
}

static int64_t row_bytes_of(int type, int64_t k) {
    switch (type) {
        case Q4_0: return k / 32 * 18;
        case Q5_0: return k / 32 * 22;
        case Q8_0:
        case HIGH6: return k / 32 * 34;
        case Q4_K: return k % 256 ? -1 : k / 256 * 144;
        case Q5_K: return k % 256 ? -1 : k / 256 * 176;
        case Q6_K: return k % 256 ? -1 : k / 256 * 210;
        default: return -1;
    }
}

/* --- the repacked layout: sixteen columns in the lanes --------------------------------------------------------
 *
 * At load, gguf_repack regroups a weight's rows so that one integer dot product instruction serves sixteen output
 * columns. In a group of 16 columns, a 32-weight block's codes become eight 64-byte vectors, vector g holding
 * elements 4g..4g+3 of every column side by side (byte 4c + e = column c, element 4g + e). Against a broadcast of
 * the activation's elements 4g..4g+3, vpdpbusd adds column c's four products into int32 lane c; after the eight
 * vectors lane c is column c's exact block sum. No horizontal sums; the float work is one multiply-add per block
 * for sixteen columns. AVX-512 takes a vector in one register, AVX2 in two halves (columns 0-7 and 8-15).
 *
 * Per group, in order, per 32-weight block (Q4_0, Q5_0, Q8_0) or per 256-weight super-block (the K-quants):
 *   Q4_0 / Q5_0 / Q8_0: 16 fp16 d, then the codes of the block;
 *   Q4_K / Q5_K: 16 fp16 d, 16 fp16 dmin, 8 x 16 scales (u8), 8 x 16 mins (u8), then the 8 sub-blocks' codes;
 *   Q6_K: 16 fp16 d, 8 x 16 scales of elements 0-15 (i8), 8 x 16 of elements 16-31, the 8 sub-blocks' codes;
 * and a block's codes:
 *   4-bit part (all but Q8_0): 4 x 64 bytes, vector p in the low nibbles and vector p + 4 in the high ones;
 *   Q5_0 / Q5_K: then 64 bytes, bit g of byte i the fifth bit (16) of vector g's byte i;
 *   Q6_K: then 2 x 64 bytes, byte i of plane h holding bits 4 and 5 of vectors 4h..4h+3 (2 bits each, in order);
 *   Q8_0: 8 x 64 bytes, the signed codes.
 * HIGH6 (ours, gguf_greedy_row's copy of a Q8_0 tensor): per block 16 fp16 d, then the codes floor(q / 4) + 32 laid
 * out as Q6_K's (the 4-bit part, then the two 2-bit planes).
 * Column for column this is as many bytes as the file (the K-quants' 6-bit scales, 12 bytes per 256 weights,
 * become 16 bytes). Columns past N are zeros. Every (column, row) pair sees the same float operations in the same
 * order on every path, for any number of rows: the same bits, and batch invariance. */

#define GROUP GGUF_GROUP /* columns per group (16) */
/* Bytes ahead of the sub-block in use that each thread asks the memory for, into L2 (prefetcht1), a line at a time as
 * it goes, in a pass of two rows or more (a single row's pass goes without: packed_group_row): the weights are one
 * sequential stream per thread, and without the hint the rows' compute and the stream alternate rather than overlap.
 * Into L1 (prefetcht0) the requests hold the core's few L1 fill buffers, and the types with more decoding per byte
 * than Q8_0 streamed at a fifth less (the README has the figures; 4 to 32 KiB alike) */
#define PREFETCH_AHEAD 8192
#define ROW_PREFETCH_AHEAD 4096 /* the same for a single row's pass, where row_prefetch says it asks (2-8 KiB alike) */

/* Whether a single row's pass asks for its weights ahead (packed_group_row says why by vendor): 1 on Intel CPUs, 0
 * on others, -1 until the first matmul has read the CPU's vendor */
static int row_prefetch = -1;

static void read_row_prefetch(void) {
    if (__atomic_load_n(&row_prefetch, __ATOMIC_RELAXED) >= 0) return;
    unsigned a, b, c, d;
    int intel = __get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e; /* GenuineIntel */
    __atomic_store_n(&row_prefetch, intel, __ATOMIC_RELAXED);
}
#define ROW_CHUNK 64 /* rows per pass over a group's weights: their accumulators stay in L1 */
#define CLAIM_GROUPS 4 /* groups a thread claims at a time: few enough to even out the end, many enough to keep each
                          * claim's atomic add rare and its stream long */

/* Where the unclaimed part of one thread's share of the groups starts; a cache line each, so the owner's claims do not
 * contend with its neighbours' */
typedef struct {
    int64_t next;
    char pad[56];
} group_claims;

/* Where thread t's even share of `groups` starts (share t ends where share t + 1 starts) */
static inline int64_t share_start(int64_t groups, int64_t t, int64_t threads) { return groups * t / threads; }

/* A thread's next claim of `groups` shared out by `claims`: its own share first, then what is left of the others' (a
 * team smaller than asked for leaves whole shares). *v: the share it is taking from (0 to start); the claim is
 * [*first, *stop), and 0 is returned once every share is taken. */
static inline int next_claim(group_claims *claims, int64_t groups, int64_t threads, int64_t thread, int64_t *v,
                             int64_t *first, int64_t *stop) {
    for (; *v < threads; ++*v) {
        int64_t owner = (thread + *v) % threads, end = share_start(groups, owner + 1, threads);
        int64_t claim = __atomic_fetch_add(&claims[owner].next, CLAIM_GROUPS, __ATOMIC_RELAXED);
        if (claim < end) {
            *first = claim;
            *stop = claim + CLAIM_GROUPS < end ? claim + CLAIM_GROUPS : end;
            return 1;
        }
    }
    return 0;
}

static inline int is_k(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

/* bytes of one group's block (or super-block) */
static inline int64_t packed_unit_bytes(int type) {
    switch (type) {
        case Q4_0: return 32 + 256;
        case Q5_0: return 32 + 256 + 64;
        case Q8_0: return 32 + 512;
        case Q4_K: return 64 + 256 + 8 * 256;
        case Q5_K: return 64 + 256 + 8 * (256 + 64);
        case Q6_K: return 32 + 256 + 8 * (256 + 128);
        case HIGH6: return 32 + 256 + 128;
        default: return -1;
    }
}

/* bytes of one sub-block's codes: 4-bit part, then the fifth bits or Q6_K's 2-bit plane; Q8_0's bytes */
static inline int64_t code_bytes(int type) {
    if (type == Q8_0) return 512;
    return 256 + (type == Q5_0 || type == Q5_K ? 64 : type == Q6_K || type == HIGH6 ? 128 : 0);
}

/* --- repacking (plain C, once at load) --- */

/* Q4_0's or Q5_0's 32 codes, unsigned with the type's offset: elements 0-15 from the low nibbles of qs, 16-31 from
 * the high ones; Q5_0's fifth bits (bit e of the 32-bit qh for element e) as 16. Vectorised: the regrouping is part
 * of every start, and Q5_0 is most of a Gemma 3 file's weights. */
static inline __m256i q4_q5_codes(const uint8_t *qs, const uint8_t *qh) {
    __m128i q = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0f);
    __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
    if (qh == NULL) return codes;
    uint32_t bits;
    memcpy(&bits, qh, 4);
    /* byte e of each 128-bit lane gets byte e / 8 of its lane's quarter of qh (elements 0-15: bytes 0-1, 16-31:
     * 2-3), then is all ones where its bit e % 8 is set */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                            3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), bit), bit);
    return _mm256_or_si256(codes, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

/* The 32 codes of sub-block j of a file block, unsigned with the type's offset (Q8_0: signed, as bytes). One switch
 * per sub-block, not per element: the regrouping is part of every start. */
static void file_codes(int type, const uint8_t *blk, int j, uint8_t *codes) {
    switch (type) {
        case Q4_0:
        case Q5_0:
            _mm256_storeu_si256((__m256i *)codes, q4_q5_codes(blk + (type == Q5_0 ? 6 : 2), type == Q5_0 ? blk + 2 : NULL));
            return;
        case Q8_0: memcpy(codes, blk + 2, 32); return;
        case HIGH6: /* floor(code / 4) + 32: Q6_K's unsigned range */
            for (int e = 0; e < 32; e++) codes[e] = (uint8_t)(((int8_t)blk[2 + e] >> 2) + 32);
            return;
        case Q4_K:
        case Q5_K: {
            const uint8_t *qs = blk + (type == Q5_K ? 48 : 16) + 32 * (j / 2);
            for (int e = 0; e < 32; e++) {
                int lo = j & 1 ? qs[e] >> 4 : qs[e] & 0x0f;
                codes[e] = (uint8_t)(type == Q5_K ? lo | ((blk[16 + e] >> j) & 1) << 4 : lo);
            }
            return;
        }
        default: { /* Q6_K */
            int h = j / 4, q = j % 4;
            const uint8_t *ql = blk + 64 * h + 32 * (q % 2), *qh = blk + 128 + 32 * h;
            for (int e = 0; e < 32; e++)
                codes[e] = (uint8_t)((q < 2 ? ql[e] & 0x0f : ql[e] >> 4) | ((qh[e] >> (2 * q)) & 3) << 4);
            return;
        }
    }
}

/* one sub-block's codes for 16 columns (cols[c]: column c's file block) in the layout above */
static void repack_codes(int type, const uint8_t *const cols[GROUP], int j, uint8_t *out) {
    uint8_t codes[GROUP][32], vec[8][64];
    for (int c = 0; c < GROUP; c++) file_codes(type, cols[c], j, codes[c]);
    for (int g = 0; g < 8; g++)
        for (int c = 0; c < GROUP; c++) memcpy(&vec[g][4 * c], &codes[c][4 * g], 4);
    if (type == Q8_0) {
        memcpy(out, vec, 512);
        return;
    }
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < 64; i += 32) {
            __m256i a = _mm256_and_si256(load32(&vec[p][i]), low), b = _mm256_and_si256(load32(&vec[p + 4][i]), low);
            _mm256_storeu_si256((__m256i *)(out + 64 * p + i), _mm256_or_si256(a, _mm256_slli_epi16(b, 4)));
        }
    if (type == Q5_0 || type == Q5_K)
        for (int i = 0; i < 64; i += 32) { /* bit 4 of vector g's bytes as bit g of the plane's */
            __m256i b = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                __m256i fifth = _mm256_and_si256(_mm256_srli_epi16(load32(&vec[g][i]), 4), _mm256_set1_epi8(1));
                b = _mm256_or_si256(b, _mm256_slli_epi16(fifth, g));
            }
            _mm256_storeu_si256((__m256i *)(out + 256 + i), b);
        }
    if (type == Q6_K || type == HIGH6)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 64; i += 32) { /* bits 4-5 of vectors 4h..4h+3, two bits each */
                __m256i b = _mm256_setzero_si256();
                for (int v = 0; v < 4; v++) {
                    __m256i shifted = _mm256_srli_epi16(load32(&vec[4 * h + v][i]), 4);
                    __m256i two = _mm256_and_si256(shifted, _mm256_set1_epi8(3));
                    b = _mm256_or_si256(b, _mm256_slli_epi16(two, 2 * v));
                }
                _mm256_storeu_si256((__m256i *)(out + 256 + 64 * h + i), b);
            }
}

/* Q4_K / Q5_K: the 6-bit (scale, min) of sub-block j, as ggml's get_scale_min_k4 reads them */
static void k_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void repack_unit(int type, const uint8_t *const cols[GROUP], uint8_t *out) {
    uint8_t *p = out;
    for (int c = 0; c < GROUP; c++) memcpy(p + 2 * c, cols[c] + (type == Q6_K ? 208 : 0), 2); /* d */
    p += 32;
    if (type == Q4_K || type == Q5_K) {
        for (int c = 0; c < GROUP; c++) memcpy(p + 2 * c, cols[c] + 2, 2); /* dmin */
        p += 32;
        for (int j = 0; j < 8; j++)
            for (int c = 0; c < GROUP; c++) k_scale_min(cols[c] + 4, j, p + 16 * j + c, p + 128 + 16 * j + c);
        p += 256;
    } else if (type == Q6_K) {
        for (int j = 0; j < 8; j++)
            for (int c = 0; c < GROUP; c++) {
                const uint8_t *sc = cols[c] + 192 + 8 * (j / 4) + 2 * (j % 4);
                p[16 * j + c] = sc[0];
                p[128 + 16 * j + c] = sc[1];
            }
        p += 256;
    }
    for (int j = 0; j < (is_k(type) ? 8 : 1); j++) repack_codes(type, cols, j, p + j * code_bytes(type));
}

int64_t gguf_packed_bytes(int type, int64_t n, int64_t k) {
    if (packed_unit_bytes(type) < 0 || row_bytes_of(type, k) < 0) return -1;
    return (n + GROUP - 1) / GROUP * (k / (is_k(type) ? 256 : 32)) * packed_unit_bytes(type);
}

int gguf_repack(int type, const uint8_t *w, int64_t n, int64_t k, uint8_t *out, int threads) {
    int64_t unit = packed_unit_bytes(type), row_bytes = row_bytes_of(type, k);
    if (unit < 0 || row_bytes < 0) return -1;
    int64_t units = k / (is_k(type) ? 256 : 32);
    static const uint8_t zeros[256] = {0};
    /* groups handed out a few at a time, not in even shares: at load a tokenizer may be built on one of the cores */
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
    for (int64_t grp = 0; grp < (n + GROUP - 1) / GROUP; grp++)
        for (int64_t u = 0; u < units; u++) {
            const uint8_t *cols[GROUP];
            for (int c = 0; c < GROUP; c++) {
                int64_t col = GROUP * grp + c;
                cols[c] = col < n ? w + col * row_bytes + u * block_bytes(type) : zeros;
            }
            repack_unit(type, cols, out + (grp * units + u) * unit);
        }
    return 0;
}

/* --- the vectors: 16 lanes, one register on AVX-512, two halves on AVX2 --- */

#if defined(WITH_VNNI)
typedef __m512i ivec;
typedef __m512 fvec;
static inline ivec iv_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline ivec iv_zero(void) { return _mm512_setzero_si512(); }
static inline ivec iv_low4(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
static inline ivec iv_high4(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
/* u (4-bit codes) with the bits of h's bytes from bit `at` up, under `mask` once moved to bit 4 (Q5's fifth bit:
 * one bit, mask 0x10; Q6_K's two): h shifted in 16-bit lanes (a neighbour byte's bits only land outside the mask)
 * and merged in one ternary op, (h' & mask) | u */
static inline ivec iv_with_high_bits(ivec u, ivec h, int at, char mask) {
    ivec t = at < 4 ? _mm512_slli_epi16(h, 4 - at) : at > 4 ? _mm512_srli_epi16(h, at - 4) : h;
    return _mm512_ternarylogic_epi32(t, u, _mm512_set1_epi8(mask), 0xEC);
}
/* Q8_0's signed codes made unsigned (+128; subtracted back through the activation sums) */
static inline ivec iv_signed_codes(ivec v) { return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)); }
/* acc += u's unsigned bytes . the four signed bytes at x4, in each lane. The four bytes go as the instruction's own
 * broadcast operand (m32bcst): GCC's intrinsic with _mm512_set1_epi32 emits a separate vpbroadcastd before each
 * vpdpbusd, an extra instruction for every product of the many-row loops. The same integer sums. */
static inline ivec iv_dot(ivec acc, ivec u, const int8_t *x4) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)x4));
    return acc;
}
static inline ivec iv_magnitude(ivec v) { return v; } /* unused: the codes went unsigned */
static inline ivec iv_dot_signed(ivec acc, ivec u, ivec magnitude, const int8_t *x4) {
    (void)magnitude;
    return iv_dot(acc, u, x4);
}
/* two steps of unsigned codes at most 63 (every type but Q8_0) */
static inline ivec iv_dot2(ivec acc, ivec u0, const int8_t *x0, ivec u1, const int8_t *x1) {
    return iv_dot(iv_dot(acc, u0, x0), u1, x1);
}
#define Q8_0_OFFSET 128
static inline ivec iv_set1(int32_t s) { return _mm512_set1_epi32(s); }
static inline ivec iv_add(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
static inline ivec iv_i8_lanes(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline fvec fv_u8_lanes(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline fvec fv_fp16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline fvec fv_zero(void) { return _mm512_setzero_ps(); }
static inline fvec fv_set1(float f) { return _mm512_set1_ps(f); }
static inline fvec fv_cvt(ivec v) { return _mm512_cvtepi32_ps(v); }
static inline fvec fv_mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
static inline fvec fv_sub(fvec a, fvec b) { return _mm512_sub_ps(a, b); }
static inline fvec fv_fma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
static inline void fv_store(float *p, fvec v) { _mm512_storeu_ps(p, v); }
static inline fvec fv_load(const float *p) { return _mm512_loadu_ps(p); }
static inline fvec fv_add(fvec a, fvec b) { return _mm512_add_ps(a, b); }
static inline fvec fv_max(fvec a, fvec b) { return _mm512_max_ps(a, b); }
static inline fvec fv_abs(fvec a) { return _mm512_abs_ps(a); }
static inline int fv_any_ge(fvec a, fvec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ) != 0; }
static inline float fv_reduce_max(fvec a) { return _mm512_reduce_max_ps(a); }
static inline float fv_reduce_add(fvec a) { return _mm512_reduce_add_ps(a); }
static inline ivec iv_sub(ivec a, ivec b) { return _mm512_sub_epi32(a, b); }
static inline ivec iv_times8(ivec a) { return _mm512_slli_epi32(a, 3); }
/* 16 lanes to out as float32, or rounded to bf16 (nearest even, NaN kept) */
static inline void fv_store_out(void *out, fvec v, int float_out) {
    if (float_out)
        _mm512_storeu_ps(out, v);
    else
        _mm256_storeu_si256((__m256i *)out, to_bf16(v));
}
#define ROW_STEP 4 /* rows in flight per decoded sub-block: 8 codes + 4 sums + 4 accumulators of 32 registers */
#else
/* AVX2: the integer dot products by vpmaddubsw + vpmaddwd. Exact: the int16 pair sums cannot saturate, the
 * unsigned codes being at most 63 (2 * 128 * 127 would still fit), Q8_0's |w| at most 128 against |x| <= 127. */

/* lanes j = sum over i in [4j, 4j+4) of u[i] * x[i], for unsigned codes u */
static inline __m256i dot_unsigned(__m256i u, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

typedef struct {
    __m256i a, b;
} ivec;
typedef struct {
    __m256 a, b;
} fvec;
#define IV2(expr_a, expr_b) ((ivec){expr_a, expr_b})
#define FV2(expr_a, expr_b) ((fvec){expr_a, expr_b})
static inline ivec iv_load(const uint8_t *p) { return IV2(load32(p), load32(p + 32)); }
static inline ivec iv_zero(void) { return IV2(_mm256_setzero_si256(), _mm256_setzero_si256()); }
static inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
static inline ivec iv_low4(ivec v) { return IV2(low4(v.a), low4(v.b)); }
static inline ivec iv_high4(ivec v) { return IV2(low4(_mm256_srli_epi16(v.a, 4)), low4(_mm256_srli_epi16(v.b, 4))); }
/* as on AVX-512: h's bits from bit `at` moved to bit 4 in 16-bit lanes, (h' & mask) | u */
static inline __m256i with_high_bits(__m256i u, __m256i h, int at, char mask) {
    __m256i t = at < 4 ? _mm256_slli_epi16(h, 4 - at) : at > 4 ? _mm256_srli_epi16(h, at - 4) : h;
    return _mm256_or_si256(u, _mm256_and_si256(t, _mm256_set1_epi8(mask)));
}
static inline ivec iv_with_high_bits(ivec u, ivec h, int at, char mask) {
    return IV2(with_high_bits(u.a, h.a, at, mask), with_high_bits(u.b, h.b, at, mask));
}
static inline ivec iv_signed_codes(ivec v) { return v; }
/* the four signed bytes at p in every 32-bit lane */
static inline __m256i set1_four(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline ivec iv_dot(ivec acc, ivec u, const int8_t *x4) {
    __m256i x = set1_four(x4);
    return IV2(_mm256_add_epi32(acc.a, dot_unsigned(u.a, x)), _mm256_add_epi32(acc.b, dot_unsigned(u.b, x)));
}
/* two steps of unsigned codes at most 63 (every type but Q8_0): their int16 pair sums, each at most 2 * 63 * 127,
 * added before one widening to int32 (at most 32,004: exact) */
static inline __m256i dot2_unsigned(__m256i u0, __m256i x0, __m256i u1, __m256i x1) {
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, x0), _mm256_maddubs_epi16(u1, x1));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
static inline ivec iv_dot2(ivec acc, ivec u0, const int8_t *x0, ivec u1, const int8_t *x1) {
    __m256i a = set1_four(x0), b = set1_four(x1);
    return IV2(_mm256_add_epi32(acc.a, dot2_unsigned(u0.a, a, u1.a, b)),
               _mm256_add_epi32(acc.b, dot2_unsigned(u0.b, a, u1.b, b)));
}
/* signed codes w (Q8_0): |w| against x with w's sign (exact for every w, -128 included), |w| taken once per vector
 * for all the rows */
static inline ivec iv_magnitude(ivec w) { return IV2(_mm256_abs_epi8(w.a), _mm256_abs_epi8(w.b)); }
static inline ivec iv_dot_signed(ivec acc, ivec w, ivec magnitude, const int8_t *x4) {
    __m256i x = set1_four(x4);
    return IV2(_mm256_add_epi32(acc.a, dot_unsigned(magnitude.a, _mm256_sign_epi8(x, w.a))),
               _mm256_add_epi32(acc.b, dot_unsigned(magnitude.b, _mm256_sign_epi8(x, w.b))));
}
#define Q8_0_OFFSET 0
static inline ivec iv_add(ivec x, ivec y) { return IV2(_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)); }
static inline ivec iv_set1(int32_t s) { return IV2(_mm256_set1_epi32(s), _mm256_set1_epi32(s)); }
static inline ivec iv_i8_lanes(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return IV2(_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}
static inline fvec fv_u8_lanes(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    return FV2(lo, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}
static inline fvec fv_fp16(const uint8_t *p) {
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return FV2(lo, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16))));
}
static inline fvec fv_zero(void) { return FV2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline fvec fv_set1(float f) { return FV2(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
static inline fvec fv_cvt(ivec v) { return FV2(_mm256_cvtepi32_ps(v.a), _mm256_cvtepi32_ps(v.b)); }
static inline fvec fv_mul(fvec x, fvec y) { return FV2(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)); }
static inline fvec fv_sub(fvec x, fvec y) { return FV2(_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)); }
static inline fvec fv_fma(fvec x, fvec y, fvec z) {
    return FV2(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b));
}
static inline void fv_store(float *p, fvec v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
}
static inline fvec fv_load(const float *p) { return FV2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline fvec fv_add(fvec x, fvec y) { return FV2(_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)); }
static inline fvec fv_max(fvec x, fvec y) { return FV2(_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)); }
static inline fvec fv_abs(fvec x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return FV2(_mm256_andnot_ps(sign, x.a), _mm256_andnot_ps(sign, x.b));
}
static inline int fv_any_ge(fvec x, fvec y) {
    __m256 ge = _mm256_or_ps(_mm256_cmp_ps(x.a, y.a, _CMP_GE_OQ), _mm256_cmp_ps(x.b, y.b, _CMP_GE_OQ));
    return _mm256_movemask_ps(ge) != 0;
}
static inline float fv_reduce_max(fvec x) {
    float lanes[16], best = -INFINITY;
    fv_store(lanes, x);
    for (int l = 0; l < 16; l++) best = lanes[l] > best ? lanes[l] : best;
    return best;
}
static inline float fv_reduce_add(fvec x) {
    float lanes[16], sum = 0.0f;
    fv_store(lanes, x);
    for (int l = 0; l < 16; l++) sum += lanes[l];
    return sum;
}
static inline ivec iv_sub(ivec x, ivec y) { return IV2(_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)); }
static inline ivec iv_times8(ivec x) { return IV2(_mm256_slli_epi32(x.a, 3), _mm256_slli_epi32(x.b, 3)); }
static inline void fv_store_out(void *out, fvec v, int float_out) {
    if (float_out) {
        fv_store(out, v);
    } else {
        _mm_storeu_si128((__m128i *)out, to_bf16_8(v.a));
        _mm_storeu_si128((__m128i *)out + 1, to_bf16_8(v.b));
    }
}
#define ROW_STEP 2 /* 16 registers, each vector two of them */
#endif

/* --- the product: a group of 16 columns against R rows --- */

/* vector g of a sub-block's codes (unsigned; Q8_0 as iv_signed_codes leaves them) */
ALWAYS_INLINE ivec packed_vector(int type, const uint8_t *codes, int g) {
    if (type == Q8_0) return iv_signed_codes(iv_load(codes + 64 * g));
    ivec v = iv_load(codes + 64 * (g % 4));
    ivec u = g < 4 ? iv_low4(v) : iv_high4(v);
    if (type == Q5_0 || type == Q5_K) u = iv_with_high_bits(u, iv_load(codes + 256), g, 0x10);
    if (type == Q6_K || type == HIGH6) u = iv_with_high_bits(u, iv_load(codes + 256 + 64 * (g / 4)), 2 * (g % 4), 0x30);
    return u;
}

/* elements 4g..4g+3 of an activation block's codes */
static inline const int8_t *four(const xblock *xb, int g) { return xb->q + 4 * g; }

/* What a sub-block of one group needs besides its codes: the float factors per column, shared by the rows */
typedef struct {
    fvec scale, scale_hi, min; /* Q6_K: scale for elements 0-15, scale_hi for 16-31; min: Q4_K / Q5_K */
} factors;

/* The codes' offset a type's sums carry (unsigned codes stand for code - offset): offset * sum comes off */
static inline int32_t code_offset(int type) {
    return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q8_0 ? Q8_0_OFFSET : 0;
}

/* d * sum, as quantize_rows left it in a block of the matmul's scratch (Q4_K, Q5_K) */
static inline float block_dsum(const xblock *xb) {
    float v;
    memcpy(&v, &xb->halves[1], sizeof v);
    return v;
}

/* where a unit's codes start in the packed layout: past d (and the K-quants' dmin, scales and mins) */
static inline int64_t codes_at(int type) { return type == Q4_K || type == Q5_K ? 320 : type == Q6_K ? 288 : 32; }

/* sub-block j's float factors from its unit `blk`, whose d is `d` */
ALWAYS_INLINE factors sub_block_factors(int type, const uint8_t *blk, fvec d, int j) {
    factors f = {d, d, d};
    if (type == Q4_K || type == Q5_K) {
        f.scale = fv_mul(d, fv_u8_lanes(blk + 64 + 16 * j));
        f.min = fv_mul(fv_fp16(blk + 32), fv_u8_lanes(blk + 192 + 16 * j));
    } else if (type == Q6_K) { /* each half's int8 scale folded into the float factor */
        f.scale = fv_mul(d, fv_cvt(iv_i8_lanes(blk + 32 + 16 * j)));
        f.scale_hi = fv_mul(d, fv_cvt(iv_i8_lanes(blk + 160 + 16 * j)));
    }
    return f;
}

/* Each thread's weights are one stream: ask for its lines into L2 (prefetcht1), one at a time, up to `distance`
 * bytes past `used` (PREFETCH_AHEAD, or a single row's ROW_PREFETCH_AHEAD); *ahead is the next line to ask for */
static inline void prefetch_through(const char **ahead, const void *used, int64_t distance) {
    const char *end = (const char *)used + distance;
    for (; *ahead < end; *ahead += 64) _mm_prefetch(*ahead, _MM_HINT_T1);
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
 * (the README has the figures). */
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
     * and on the LM head (K = 640, every group a short pass) those calls were a few percent of a 16-row step (the
     * README has the figures). The other
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

static void any_packed_group(int type, const uint8_t *w, const xblock *x, int64_t nb, int64_t m, int64_t rows,
                             fvec *res) {
    switch (type) {
        case Q4_0: packed_group(Q4_0, w, x, nb, m, rows, res); break;
        case Q5_0: packed_group(Q5_0, w, x, nb, m, rows, res); break;
        case Q8_0: packed_group(Q8_0, w, x, nb, m, rows, res); break;
        case Q4_K: packed_group(Q4_K, w, x, nb, m, rows, res); break;
        case Q5_K: packed_group(Q5_K, w, x, nb, m, rows, res); break;
        default: packed_group(Q6_K, w, x, nb, m, rows, res); break;
    }
}

/* --- AMX: a sub-block's sums for 16 rows in one tile product -----------------------------------------------
 *
 * Where the CPU has AMX and Linux grants the process the tile state, the exact int32 sums of a sub-block for 16 rows
 * and the group's 16 columns come from one tile product: the rows' activation codes (16 rows of 32 bytes, their
 * xblocks' q, a block's rows side by side in the scratch) against the sub-block's eight code vectors, which are
 * already the layout AMX's second operand takes (vector g is tile row g: elements 4g..4g+3 of every column). Q8_0's
 * codes go signed as stored (tdpbssd; no +128 and back), Q4_0's and Q5_0's signed less their offset as they are
 * decoded (code - offset, where VNNI subtracts offset x sum), Q4_K's and Q5_K's unsigned (tdpbsud). The same
 * integers, then the same float step per row as rows_update, in the same order: the same bits as the VNNI and AVX2
 * paths. Only whole tiles of 16 rows go to AMX; the rows left over take the VNNI path, so a row's result still does
 * not depend on its batch. Q6_K stays on VNNI (its halves of 16 would need two products of half the depth and two
 * float steps a row).
 *
 * Where the time goes (the README has the figures): the dot products are nearly free here; what is left is the AMX
 * unit's own sequence of load, product and store, which it runs one instruction after another, the float step (three
 * vector operations a row and block, the 16 rows' accumulators in registers) and moving the sums out of the tiles
 * (tilestored, then a vector load a row). A tile load or a sum read straight behind the stores of its data waits for
 * them, so a group's codes are decoded once, by its first row tile, DECODE_AHEAD sub-blocks ahead of their product,
 * and each product goes out AMX_AHEAD sub-blocks ahead of its float step (a ring of sums), so that the AMX unit, the
 * vector units and the weight stream overlap. */
#if defined(WITH_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define WITH_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_ROWS 16 /* a tile product costs the same for one row as for 16: fewer rows take the VNNI path */
#define AMX_AHEAD 2 /* sub-blocks whose products go out ahead of the float step in hand */
/* Q4_0, Q5_0 and the K-quants: sub-blocks whose codes the first row tile decodes (for all the group's row tiles)
 * ahead of their product, so that a tile load does not wait for the stores of its data, and the decoding, which reads
 * the weights from memory, overlaps the tile work (a pass of its own before it did not, and at 16 rows lost to VNNI) */
#define DECODE_AHEAD (AMX_AHEAD + 2)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_wanted = 1, amx_granted = -1;

/* Linux hands a process the tile state on request (arch_prctl), once; a kernel that refuses leaves VNNI to run */
static int amx_ready(void) {
    int granted = __atomic_load_n(&amx_granted, __ATOMIC_ACQUIRE);
    if (granted < 0) {
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&amx_granted, granted, __ATOMIC_RELEASE);
    }
    return granted && __atomic_load_n(&amx_wanted, __ATOMIC_RELAXED);
}

int gguf_amx(int enable) {
    if (enable >= 0) __atomic_store_n(&amx_wanted, enable != 0, __ATOMIC_RELAXED);
    return amx_ready();
}

static inline int amx_takes(int type) { return type != Q6_K; }
/* codes that go to the tiles signed: Q8_0's as stored, Q4_0's and Q5_0's less their offset; the K-quants' unsigned */
static inline int amx_signed(int type) { return type == Q8_0 || type == Q4_0 || type == Q5_0; }

/* The tiles, two of each so that consecutive products need not wait on each other: sums (16 rows x 16 int32
 * columns), activation codes (16 rows x 32 bytes), weight codes (8 rows of 16 columns x 4). Tile numbers are
 * #defines: the intrinsics paste them into the instruction. */
#define SUM0 0
#define SUM1 1
#define X0 2
#define X1 3
#define W0 4
#define W1 5
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The tile shapes are per thread: each thread of the team loads them before its first product */
static void amx_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.colsb[SUM0] = c.colsb[SUM1] = 4 * GROUP, c.rows[SUM0] = c.rows[SUM1] = TILE_ROWS;
    c.colsb[X0] = c.colsb[X1] = 32, c.rows[X0] = c.rows[X1] = TILE_ROWS;
    c.colsb[W0] = c.colsb[W1] = 64, c.rows[W0] = c.rows[W1] = 8;
    _tile_loadconfig(&c);
}

/* Sub-block i's codes decoded into out + 512 i: packed_vector's eight vectors, Q4_0's and Q5_0's less their offset */
ALWAYS_INLINE void decode_block(int type, const uint8_t *w, int64_t i, const char **ahead, uint8_t *out) {
    const int S = is_k(type) ? 8 : 1;
    const uint8_t *codes = w + i / S * packed_unit_bytes(type) + codes_at(type) + i % S * code_bytes(type);
    prefetch_through(ahead, codes + code_bytes(type), PREFETCH_AHEAD);
    for (int g = 0; g < 8; g++) {
        ivec v = packed_vector(type, codes, g);
        if (amx_signed(type)) v = _mm512_sub_epi8(v, _mm512_set1_epi8((char)code_offset(type)));
        _mm512_store_si512(out + 512 * i + 64 * g, v);
    }
    /* the compiler does not know that a tile load reads these bytes (its intrinsic declares no memory operand):
     * keep the stores ahead of every later tile load */
    __asm__ volatile("" ::: "memory");
}

/* The exact sums of one sub-block's code vectors `wv` against 16 rows' activation blocks (`block`: the sub-block's
 * rows side by side) into sums; `odd` takes the other tiles */
ALWAYS_INLINE void tile_sums(int type, const uint8_t *wv, const xblock *block, int odd, int32_t *sums) {
/* one product on the tile set (sums, activations, weights): the intrinsics take tile numbers as literals */
#define TILE_PRODUCT(S, X, W)                                        \
    do {                                                             \
        _tile_loadd(W, wv, 64);                                      \
        _tile_zero(S);                                               \
        _tile_loadd(X, block->q, (int64_t)sizeof(xblock));           \
        if (amx_signed(type))                                        \
            _tile_dpbssd(S, X, W);                                   \
        else                                                         \
            _tile_dpbsud(S, X, W);                                   \
        _tile_stored(S, sums, 4 * GROUP);                            \
    } while (0)
    if (odd)
        TILE_PRODUCT(SUM1, X1, W1);
    else
        TILE_PRODUCT(SUM0, X0, W0);
#undef TILE_PRODUCT
}

/* The product of sub-block i for one row tile into sums (TILE_ROWS x GROUP int32). Q8_0's codes come straight from
 * the stream (prefetched ahead as packed_group does), the others' from the group's decoding. */
ALWAYS_INLINE void block_sums(int type, const uint8_t *w, const uint8_t *decoded, const xblock *x, int64_t m, int64_t i,
                              const char **ahead, int32_t *sums) {
    const uint8_t *wv = decoded + 512 * i;
    if (type == Q8_0) {
        wv = w + i * packed_unit_bytes(Q8_0) + codes_at(Q8_0);
        prefetch_through(ahead, wv + code_bytes(Q8_0), PREFETCH_AHEAD);
    }
    tile_sums(type, wv, x + i * m, (int)(i % 2), sums);
}

/* packed_group on AMX for one tile of 16 rows (block b of row r at x + b * m + r) into res[0..16): the same walk over
 * the sub-blocks, the same factors and the same float step as rows_update, the accumulators in registers. The
 * products run AMX_AHEAD sub-blocks ahead of the float steps, in a ring of sums. */
ALWAYS_INLINE void amx_group(int type, const uint8_t *w, uint8_t *decoded, int decode, const xblock *x, int64_t nb,
                             int64_t m, fvec *res) {
    const int S = is_k(type) ? 8 : 1;
    int32_t sums[AMX_AHEAD + 1][TILE_ROWS * GROUP] __attribute__((aligned(64)));
    fvec acc[TILE_ROWS], *mins = res; /* the K-quants' minimums wait in res: the accumulators keep the registers */
    for (int r = 0; r < TILE_ROWS; r++) acc[r] = mins[r] = fv_zero();
    const char *ahead = (const char *)w + PREFETCH_AHEAD;
    if (decode)
        for (int64_t i = 0; i < DECODE_AHEAD && i < nb; i++) decode_block(type, w, i, &ahead, decoded);
    for (int64_t i = 0; i < AMX_AHEAD && i < nb; i++) block_sums(type, w, decoded, x, m, i, &ahead, sums[i]);
    for (int64_t i = 0; i < nb; i++) {
        if (decode && i + DECODE_AHEAD < nb) decode_block(type, w, i + DECODE_AHEAD, &ahead, decoded);
        if (i + AMX_AHEAD < nb)
            block_sums(type, w, decoded, x, m, i + AMX_AHEAD, &ahead, sums[(i + AMX_AHEAD) % (AMX_AHEAD + 1)]);
        const uint8_t *blk = w + i / S * packed_unit_bytes(type);
        factors f = sub_block_factors(type, blk, fv_fp16(blk), (int)(i % S));
        const xblock *block = x + i * m;
        const int32_t *s = sums[i % (AMX_AHEAD + 1)];
        for (int r = 0; r < TILE_ROWS; r++) {
            ivec sum = _mm512_load_si512(s + GROUP * r);
            acc[r] = fv_fma(fv_cvt(sum), fv_mul(f.scale, fv_set1(block[r].d)), acc[r]);
        }
        if (type == Q4_K || type == Q5_K)
            for (int r = 0; r < TILE_ROWS; r++) mins[r] = fv_fma(f.min, fv_set1(block_dsum(block + r)), mins[r]);
    }
    for (int r = 0; r < TILE_ROWS; r++) res[r] = fv_sub(acc[r], mins[r]);
}

static void any_amx_group(int type, const uint8_t *w, uint8_t *decoded, int decode, const xblock *x, int64_t nb,
                          int64_t m, fvec *res) {
    switch (type) {
        case Q4_0: amx_group(Q4_0, w, decoded, decode, x, nb, m, res); break;
        case Q5_0: amx_group(Q5_0, w, decoded, decode, x, nb, m, res); break;
        case Q8_0: amx_group(Q8_0, w, decoded, 0, x, nb, m, res); break;
        case Q4_K: amx_group(Q4_K, w, decoded, decode, x, nb, m, res); break;
        default: amx_group(Q5_K, w, decoded, decode, x, nb, m, res); break;
    }
}
#else
int gguf_amx(int enable) {
    (void)enable;
    return 0;
}
#endif

/* --- the LM head's own pass over its logits: each row's largest value and whether all are finite ---------------
 *
 * Greedy decoding wants each row's argmax and the engine wants to know whether a row's logits are all finite (a row
 * that is not fails its request). As separate passes after the product those read the (rows, 262144) float32 logits
 * back from memory, cold (the README has the figures). Here each thread looks at the columns of each claim it has
 * just written, still in L1, and keeps per row and lane: the largest value so far and the group it came from, and
 * the sum of every value (finite unless a value was an infinity or NaN, or the sum overflowed: torch's check in
 * sample_step.non_finite_rows is the same). Most claims hold no value as large as the lanes' best so far, and cost a
 * max and an add per group; the others are walked group by group, where a later group wins a lane only if strictly
 * greater, or equal and earlier (a thread's claims need not come in column order). */
typedef struct {
    float best[GROUP];
    int32_t group[GROUP];
    float sum[GROUP];
} row_best;

#define NO_GROUP INT32_MAX

static void row_best_reset(row_best *s) {
    for (int l = 0; l < GROUP; l++) s->best[l] = -INFINITY, s->group[l] = NO_GROUP, s->sum[l] = 0.0f;
}

/* lane-wise: where v > best, or v == best from an earlier group, take v and g */
static inline void row_best_update(row_best *s, const float *v, int32_t g) {
#if defined(WITH_VNNI)
    __m512 x = _mm512_loadu_ps(v), best = _mm512_load_ps(s->best);
    __m512i group = _mm512_load_si512(s->group), gv = _mm512_set1_epi32(g);
    __mmask16 take = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ) |
                     (_mm512_cmp_ps_mask(x, best, _CMP_EQ_OQ) & _mm512_cmpgt_epi32_mask(group, gv));
    _mm512_store_ps(s->best, _mm512_mask_mov_ps(best, take, x));
    _mm512_store_si512(s->group, _mm512_mask_mov_epi32(group, take, gv));
#else
    __m256i gv = _mm256_set1_epi32(g);
    for (int h = 0; h < 2; h++) {
        __m256 x = _mm256_loadu_ps(v + 8 * h), best = _mm256_load_ps(s->best + 8 * h);
        __m256i group = _mm256_load_si256((const __m256i *)(s->group + 8 * h));
        __m256 take = _mm256_or_ps(_mm256_cmp_ps(x, best, _CMP_GT_OQ),
                                   _mm256_and_ps(_mm256_cmp_ps(x, best, _CMP_EQ_OQ),
                                                 _mm256_castsi256_ps(_mm256_cmpgt_epi32(group, gv))));
        _mm256_store_ps(s->best + 8 * h, _mm256_blendv_ps(best, x, take));
        __m256 taken = _mm256_blendv_ps(_mm256_castsi256_ps(group), _mm256_castsi256_ps(gv), take);
        _mm256_store_si256((__m256i *)(s->group + 8 * h), _mm256_castps_si256(taken));
    }
#endif
}

/* Groups [g0, g1) of one row of logits (`row`: the row's column 0; n columns in all), just written by this thread */
static void row_best_scan(row_best *s, const float *row, int64_t n, int64_t g0, int64_t g1) {
    int64_t whole = n / GROUP < g1 ? n / GROUP : g1; /* groups of 16 real columns */
    if (g0 < whole) {
#if defined(WITH_VNNI)
        __m512 top = _mm512_loadu_ps(row + GROUP * g0), sum = _mm512_load_ps(s->sum);
        sum = _mm512_add_ps(sum, top);
        for (int64_t g = g0 + 1; g < whole; g++) {
            __m512 v = _mm512_loadu_ps(row + GROUP * g);
            top = _mm512_max_ps(top, v);
            sum = _mm512_add_ps(sum, v);
        }
        _mm512_store_ps(s->sum, sum);
        int rare = _mm512_cmp_ps_mask(top, _mm512_load_ps(s->best), _CMP_GE_OQ) != 0;
#else
        int rare = 0;
        for (int h = 0; h < 2; h++) {
            __m256 top = _mm256_loadu_ps(row + GROUP * g0 + 8 * h), sum = _mm256_load_ps(s->sum + 8 * h);
            sum = _mm256_add_ps(sum, top);
            for (int64_t g = g0 + 1; g < whole; g++) {
                __m256 v = _mm256_loadu_ps(row + GROUP * g + 8 * h);
                top = _mm256_max_ps(top, v);
                sum = _mm256_add_ps(sum, v);
            }
            _mm256_store_ps(s->sum + 8 * h, sum);
            rare |= _mm256_movemask_ps(_mm256_cmp_ps(top, _mm256_load_ps(s->best + 8 * h), _CMP_GE_OQ)) != 0;
        }
#endif
        if (rare) /* a lane meets or beats its best: which group, exactly */
            for (int64_t g = g0; g < whole; g++) row_best_update(s, row + GROUP * g, (int32_t)g);
    }
    for (int64_t g = whole > g0 ? whole : g0; g < g1; g++) /* the last, partial group: its real lanes only */
        for (int64_t l = 0; l < n - GROUP * g; l++) {
            float v = row[GROUP * g + l];
            if (v > s->best[l] || (v == s->best[l] && g < s->group[l])) s->best[l] = v, s->group[l] = (int32_t)g;
            s->sum[l] += v;
        }
}

/* Row r's answer from every thread's lanes: the first column of the largest value; finite if every sum is */
static void row_best_merge(const row_best *states, int64_t threads, int64_t m, int64_t r, int64_t *argmax,
                           int32_t *finite) {
    float best = -INFINITY;
    int64_t at = INT64_MAX;
    int ok = 1;
    for (int64_t t = 0; t < threads; t++) {
        const row_best *s = states + t * m + r;
        for (int l = 0; l < GROUP; l++) {
            ok &= isfinite(s->sum[l]) != 0;
            if (s->group[l] == NO_GROUP) continue;
            int64_t col = (int64_t)s->group[l] * GROUP + l;
            if (s->best[l] > best || (s->best[l] == best && col < at)) best = s->best[l], at = col;
        }
    }
    argmax[r] = at == INT64_MAX ? 0 : at;
    finite[r] = ok;
}

/* Group g's 16 columns of out for all M rows (block b of row r at x + b * m + r): ROW_CHUNK rows a pass, whole
 * tiles of 16 on AMX where it is on (`decoded`: this thread's scratch for the group's decoded codes) */
static void group_product(int type, const uint8_t *w, const xblock *x, int64_t nb, int64_t m, int64_t n, int64_t g,
                          void *out, int64_t ldo, int float_out, uint8_t *decoded, int amx) {
    size_t elem = float_out ? sizeof(float) : sizeof(uint16_t);
    fvec res[ROW_CHUNK];
    int64_t c0 = GROUP * g, cols = n - c0 < GROUP ? n - c0 : GROUP;
    for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
        int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK;
#if defined(WITH_AMX)
        int64_t tiled = 0; /* rows done on AMX: whole tiles of 16 */
        if (amx) {
            for (; tiled + TILE_ROWS <= rows; tiled += TILE_ROWS) /* the first tile decodes the group's codes */
                any_amx_group(type, w, decoded, decoded && r0 + tiled == 0, x + r0 + tiled, nb, m, res + tiled);
        }
#else
        const int64_t tiled = 0;
        (void)decoded, (void)amx;
#endif
        if (tiled < rows)
            any_packed_group(type, w, x + r0 + tiled, nb, m, rows - tiled, res + tiled);
        for (int64_t r = 0; r < rows; r++) {
            char *at = (char *)out + ((r0 + r) * ldo + c0) * elem;
            if (cols == GROUP) {
                fv_store_out(at, res[r], float_out);
                continue;
            }
            float lanes[GROUP]; /* the last, partial group */
            fv_store(lanes, res[r]);
            for (int64_t c = 0; c < cols; c++) {
                if (float_out)
                    ((float *)at)[c] = lanes[c];
                else
                    ((uint16_t *)at)[c] = float_to_bf16(lanes[c]);
            }
        }
    }
}

/* What a unit of work writes: plain products (a group's 16 columns of out), or a gated MLP's activations (a pair of
 * groups, `gated` gelu or silu: group g of the gate's columns and group g of the up's, the part's two halves, their
 * products into the thread's scratch `pair` as bf16 and then gated_block's 16 columns of out) */
enum { PLAIN = 0, GATED_GELU = 1, GATED_SILU = 2 };

static void unit_product(int type, const uint8_t *w, int64_t group_bytes, const xblock *x, int64_t nb, int64_t m,
                         int64_t n, int64_t u, void *out, int64_t ldo, int float_out, int gated, uint16_t *pair,
                         uint8_t *decoded, int amx) {
    if (gated == PLAIN) {
        group_product(type, w + u * group_bytes, x, nb, m, n, u, out, ldo, float_out, decoded, amx);
        return;
    }
    int64_t half = n / 2 / GROUP; /* the gate's groups, then as many of the up's */
    group_product(type, w + u * group_bytes, x, nb, m, GROUP, 0, pair, GROUP, 0, decoded, amx);
    group_product(type, w + (half + u) * group_bytes, x, nb, m, GROUP, 0, pair + m * GROUP, GROUP, 0, decoded, amx);
    gated_block(pair, pair + m * GROUP, m, (uint16_t *)out + u * GROUP, ldo, gated == GATED_GELU);
}

/* gguf_matmul, or gguf_matmul_gated where `gated` says which activation: the rows quantised once, then the units
 * (groups, or pairs of groups) shared out among the threads. With `argmax` (plain products only), each row's argmax
 * and finiteness as gguf_matmul_logits says. */
static int matmul(const uint16_t *x_in, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w, int64_t n,
                  void *out, int64_t ldo, int float_out, int gated, int64_t *argmax, int32_t *finite, int threads) {
    if (type == HIGH6 || gguf_packed_bytes(type, n, k) < 0) return -1;
    if (threads < 1) threads = 1;
    read_row_prefetch();
    int64_t nb = k / 32, units = gated ? n / 2 / GROUP : (n + GROUP - 1) / GROUP;
#if defined(WITH_AMX)
    const int amx = m >= TILE_ROWS && amx_takes(type) && amx_ready();
    /* each thread's decoding of a group's codes (all but Q8_0, whose codes the tiles take as stored) */
    uint8_t *decoding = amx && type != Q8_0 ? aligned_alloc(64, (size_t)(threads * nb * 512)) : NULL;
    if (amx && type != Q8_0 && decoding == NULL) return -2;
#else
    uint8_t *decoding = NULL;
#endif
    xblock *x = malloc((size_t)(m * nb) * sizeof *x + 64);
    group_claims *claims = aligned_alloc(64, (size_t)threads * sizeof *claims);
    uint16_t *pairs = gated ? malloc((size_t)(threads * m * 2 * GROUP) * sizeof *pairs) : NULL;
    row_best *bests = argmax ? aligned_alloc(64, (size_t)(threads * m) * sizeof *bests) : NULL;
    if (x == NULL || claims == NULL || (gated && pairs == NULL) || (argmax && bests == NULL)) {
        free(x);
        free(claims);
        free(pairs);
        free(decoding);
        free(bests);
        return -2;
    }
    for (int64_t t = 0; t < threads; t++) claims[t].next = share_start(units, t, threads);
    for (int64_t i = 0; bests && i < threads * m; i++) row_best_reset(bests + i); /* all: the team may be smaller */
    int64_t group_bytes = nb / (is_k(type) ? 8 : 1) * packed_unit_bytes(type);
#pragma omp parallel num_threads(threads)
    {
    /* each thread asks for its share's first window of weights while the rows are quantised (not for one row: see
     * packed_group_row) */
    int64_t thread = omp_get_thread_num();
    int64_t first = share_start(units, thread, threads), last = share_start(units, thread + 1, threads);
    for (int64_t at = 0; m > 1 && first < last && at < PREFETCH_AHEAD; at += 64)
        _mm_prefetch((const char *)w + first * group_bytes + at, _MM_HINT_T1);
    quantize_rows(x_in, x_stride, m, k, x, (block_layout){1, code_offset(type), type == Q4_K || type == Q5_K});
#if defined(WITH_AMX)
    uint8_t *decoded = decoding ? decoding + thread * nb * 512 : NULL;
    if (amx) amx_configure();
#else
    uint8_t *decoded = NULL;
    const int amx = 0;
#endif
    uint16_t *pair = pairs ? pairs + thread * m * 2 * GROUP : NULL;
    row_best *rows_best = bests ? bests + thread * m : NULL;
    for (int64_t v = 0, claim, stop; next_claim(claims, units, threads, thread, &v, &claim, &stop);) {
        for (int64_t u = claim; u < stop; u++)
            unit_product(type, w, group_bytes, x, nb, m, n, u, out, ldo, float_out, gated, pair, decoded, amx);
        for (int64_t r = 0; rows_best && r < m; r++) /* the claim's logits, still in L1 */
            row_best_scan(rows_best + r, (const float *)out + r * ldo, n, claim, stop);
    }
#if defined(WITH_AMX)
    if (amx) _tile_release();
#endif
    }
    for (int64_t r = 0; bests && r < m; r++) row_best_merge(bests, threads, m, r, argmax, finite);
    free(x);
    free(claims);
    free(pairs);
    free(decoding);
    free(bests);
    return 0;
}

/* x: M rows of K bf16 inputs, x_stride apart; w: N columns repacked by gguf_repack; out: (M, ldo) bf16, or float32
 * if float_out, its columns [0, N) written. The rows are quantised first (as gguf_quantize_rows does), into a
 * scratch of M * K / 32 blocks, block-major (each block's rows side by side, as a group's pass reads them). Returns
 * 0, -1 for a type or width it does not take, -2 without memory. */
int gguf_matmul(const uint16_t *x_in, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w, int64_t n,
                void *out, int64_t ldo, int float_out, int threads) {
    return matmul(x_in, x_stride, m, k, type, w, n, out, ldo, float_out, PLAIN, NULL, NULL, threads);
}

/* gguf_matmul into float32 logits, and from the same pass each row's argmax (the first column of its largest value,
 * as torch.argmax) into argmax[M] and whether all its N values are finite (1, else 0) into finite[M]: greedy
 * decoding's choice and the engine's check, without reading the logits back. A row that is not finite has no
 * meaningful argmax. Returns as gguf_matmul does. */
int gguf_matmul_logits(const uint16_t *x_in, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w,
                       int64_t n, float *out, int64_t ldo, int64_t *argmax, int32_t *finite, int threads) {
    return matmul(x_in, x_stride, m, k, type, w, n, out, ldo, 1, PLAIN, argmax, finite, threads);
}

/* A gated MLP's first projection and its activation in one pass: w holds the gate's f columns and then the up's (one
 * part, 2f wide, f a multiple of 16); out (M, ldo) bf16 gets f columns, bf16(bf16(act(gate)) * up) with gelu_tanh
 * (gelu != 0) or silu, act(gate) and up being the bf16 products gguf_matmul would write. The same bits as
 * gguf_matmul into (M, 2f) then gelu_mul or silu_mul, without writing the 2f products out and reading them back, or
 * a pass of its own for the activation. Returns as gguf_matmul does, -1 also for an f that is not a multiple of 16
 * or where the activation kernels are not compiled in. */
int gguf_matmul_gated(const uint16_t *x_in, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w,
                      int64_t f, uint16_t *out, int64_t ldo, int gelu, int threads) {
    if (f <= 0 || f % GROUP || !gelu_mul_available()) return -1;
    return matmul(x_in, x_stride, m, k, type, w, 2 * f, out, ldo, 0, gelu ? GATED_GELU : GATED_SILU, NULL, NULL,
                  threads);
}


/* --- a single greedy row's LM head from a 6-bit copy, exactly ------------------------------------------------
 *
 * A single stream's decode step reads the whole LM head for one row: on the default model that is 60% of the step,
 * and memory-bound. Greedy decoding needs only the row's argmax (and, for a few ids a request's logit_bias or bans
 * touch, their values), so this pass reads a copy of a Q8_0 head whose codes lost their two low bits (HIGH6: 26
 * bytes a block of 32 instead of 34), bounds every column's exact logit from it, and computes exactly, with the
 * Q8_0 codes and the full pass's own loop (packed_group_row), only the groups of 16 columns that can hold the
 * largest value. The answer is the full pass's: the same argmax, the same bits for every column it computes.
 *
 * The bound: a Q8_0 code q is 4 h + l with h = floor(q / 4) and l in 0..3, so a block's exact integer sum
 * sum q x = 4 sum h x + sum l x lies within 1.5 sum |x| of 4 sum h x + 1.5 sum x. With the block's scales d (the
 * column's) and dx (the row's) the column's logit is within E = sum_b 1.5 |d| dx sum |x| of the estimate
 * A = sum_b d (dx / 2) (8 sum u x - 253 sum x), u = h + 32 being the stored unsigned code (8 sum h x + 3 sum x in
 * integers). Both float sums round; every term of the exact logit, of A and of E is within 253 / 1.5 of E's own
 * term, so widening E by (blocks + 2) * 2^-22 * 253 / 1.5 (and a thousandth) covers all their roundings. Then no
 * column whose A + E lies below floor = max over columns of (A - E) can be the argmax: the column that gives the floor
 * is at least that. Columns in `keep` (the ids a request's bias, bans or penalties change) are computed exactly
 * whatever their bound and left out of the floor, so that the largest untouched column is among those computed: the
 * sampler's adjusted argmax is then the full row's. */
#define GREEDY_MAX_BLOCKS 1024 /* rows of up to 32768 inputs: the widening above stays near 4% at most */
#define GREEDY_MOST_GROUPS 8  /* more than 1 / this of the groups to compute exactly: the full pass is cheaper */

/* The estimate A and the half-width E of a HIGH6 group's 16 columns against one row (`spread[b]` = 1.5 dx sum|x|) */
static void high6_group(const uint8_t *w, const xblock *x, const float *spread, int64_t nb, fvec *value, fvec *width) {
    const int64_t unit = packed_unit_bytes(HIGH6);
    const int prefetch = row_prefetch > 0; /* as packed_group_row */
    const char *ahead = (const char *)w + ROW_PREFETCH_AHEAD;
    fvec acc = fv_zero(), err = fv_zero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * unit, *codes = blk + 32;
        const xblock *xb = x + b;
        if (prefetch) prefetch_through(&ahead, blk + unit, ROW_PREFETCH_AHEAD);
        ivec c[4];
        for (int g = 0; g < 8; g += 2)
            c[g / 2] = iv_dot2(iv_zero(), packed_vector(HIGH6, codes, g), four(xb, g), packed_vector(HIGH6, codes, g + 1),
                               four(xb, g + 1));
        ivec sum = iv_add(iv_add(c[0], c[1]), iv_add(c[2], c[3]));
        ivec est = iv_sub(iv_times8(sum), iv_set1(253 * xb->sum));
        fvec d = fv_fp16(blk);
        acc = fv_fma(fv_cvt(est), fv_mul(d, fv_set1(0.5f * xb->d)), acc);
        err = fv_fma(fv_abs(d), fv_set1(spread[b]), err);
    }
    *value = acc;
    *width = err;
}

/* What each thread found in its groups: the largest lower bound, the groups that may hold the argmax as it went (a
 * group is noted while its largest upper bound reaches the thread's floor so far), and the sum of |A| + E */
typedef struct {
    float floor, magnitude;
    int64_t noted;
    int64_t *groups;
    float *tops;
} greedy_share;

/* x: one row of K bf16 inputs; high6, w: the head's N columns regrouped by gguf_repack as GGUF_Q8_0_HIGH6 and as
 * Q8_0; keep: `kept` sorted column ids to compute exactly. out (N floats): -inf but for the groups computed exactly,
 * which hold gguf_matmul_logits's values; *argmax: the first column of the largest of them (the full row's argmax).
 * Returns 0, or 1 where this pass cannot answer (the row or a bound not finite, or too many groups to compute) and
 * the caller takes gguf_matmul_logits; -1 for a width or keep it does not take, -2 without memory. */
int gguf_greedy_row(const uint16_t *x_in, int64_t k, const uint8_t *high6, const uint8_t *w, int64_t n,
                    const int64_t *keep, int64_t kept, float *out, int64_t *argmax, int threads) {
    if (k % 32 || k / 32 > GREEDY_MAX_BLOCKS || n <= 0) return -1;
    read_row_prefetch();
    for (int64_t i = 0; i < kept; i++)
        if (keep[i] < 0 || keep[i] >= n || (i && keep[i] <= keep[i - 1])) return -1;
    if (threads < 1) threads = 1;
    const int64_t nb = k / 32, groups = (n + GROUP - 1) / GROUP;
    const int64_t high6_bytes = nb * packed_unit_bytes(HIGH6), q8_bytes = nb * packed_unit_bytes(Q8_0);
    const float widen = 1.0f + (float)(nb + 2) * (253.0f / 1.5f) * 0x1p-22f + 1e-3f;
    xblock *x = malloc((size_t)nb * sizeof *x + 64);
    float *spread = malloc((size_t)nb * sizeof *spread);
    uint8_t *flagged = calloc((size_t)groups, 1); /* groups holding a kept column, or columns past N */
    int64_t *chosen = malloc((size_t)groups * sizeof *chosen);
    greedy_share *shares = calloc((size_t)threads, sizeof *shares);
    group_claims *claims = aligned_alloc(64, (size_t)threads * sizeof *claims);
    int64_t *noted = malloc((size_t)(threads * groups) * sizeof *noted); /* room for every group, per thread */
    float *tops = malloc((size_t)(threads * groups) * sizeof *tops);
    int status = 0;
    if (!x || !spread || !flagged || !chosen || !shares || !claims || !noted || !tops) {
        status = -2;
        goto done;
    }
    for (int64_t i = 0; i < kept; i++) flagged[keep[i] / GROUP] = 1;
    if (n % GROUP) flagged[groups - 1] = 1;
    for (int64_t t = 0; t < threads; t++) {
        claims[t].next = share_start(groups, t, threads);
        shares[t].floor = -INFINITY; /* a team smaller than asked for leaves some shares unset */
        shares[t].groups = noted + t * groups;
        shares[t].tops = tops + t * groups;
    }
    int64_t count = 0;
#pragma omp parallel num_threads(threads)
    {
        quantize_rows(x_in, k, 1, k, x, (block_layout){1, code_offset(Q8_0), 0}); /* as the full pass's */
#pragma omp single
        for (int64_t b = 0; b < nb; b++) {
            int32_t total = 0;
            for (int e = 0; e < 32; e++) total += x[b].q[e] < 0 ? -x[b].q[e] : x[b].q[e];
            spread[b] = 1.5f * x[b].d * (float)total;
        }
        int64_t thread = omp_get_thread_num();
        greedy_share *mine = &shares[thread];
        fvec lowest = fv_set1(-INFINITY), magnitude = fv_zero();
        float floor = -INFINITY;
        for (int64_t v = 0, claim, stop; next_claim(claims, groups, threads, thread, &v, &claim, &stop);) {
            for (int64_t g = claim; g < stop; g++) {
                fvec value, width;
                high6_group(high6 + g * high6_bytes, x, spread, nb, &value, &width);
                width = fv_mul(width, fv_set1(widen));
                fvec upper = fv_add(value, width), lower = fv_sub(value, width);
                magnitude = fv_add(magnitude, fv_add(fv_abs(value), width));
                if (flagged[g]) { /* kept columns and those past N set no floor */
                    float lanes[GROUP];
                    fv_store(lanes, lower);
                    int64_t i = 0, hi = kept; /* the first kept column in or past the group */
                    while (i < hi) {
                        int64_t mid = (i + hi) / 2;
                        if (keep[mid] < GROUP * g) i = mid + 1; else hi = mid;
                    }
                    for (int64_t l = 0; l < GROUP; l++) {
                        int64_t col = GROUP * g + l, kept_here = i < kept && keep[i] == col;
                        if (col >= n || kept_here) lanes[l] = -INFINITY;
                        i += kept_here;
                    }
                    lower = fv_load(lanes);
                }
                lowest = fv_max(lowest, lower);
                if (fv_any_ge(upper, fv_set1(floor))) {
                    mine->groups[mine->noted] = g;
                    mine->tops[mine->noted++] = fv_reduce_max(upper);
                }
            }
            floor = fv_reduce_max(lowest); /* once a claim: the groups after it are noted against it */
        }
        mine->floor = fv_reduce_max(lowest);
        mine->magnitude = fv_reduce_add(magnitude);
#pragma omp barrier
#pragma omp single
        {
            float top = -INFINITY, sum = 0.0f;
            for (int64_t t = 0; t < threads; t++) {
                top = shares[t].floor > top ? shares[t].floor : top;
                sum += shares[t].magnitude;
            }
            /* every value and the full pass's sum of them finite: |logit| <= |A| + E, summed well below FLT_MAX */
            if (!(isfinite(top) && sum < 1e37f)) status = 1;
            uint8_t *take = flagged; /* reused: 1 for a kept group, 2 once chosen */
            for (int64_t t = 0; t < threads && !status; t++)
                for (int64_t i = 0; i < shares[t].noted; i++)
                    if (shares[t].tops[i] >= top) take[shares[t].groups[i]] |= 2;
            for (int64_t i = 0; i < kept; i++) take[keep[i] / GROUP] |= 2;
            for (int64_t g = 0; g < groups && !status; g++)
                if (take[g] & 2) chosen[count++] = g;
            if (count == 0 || count > groups / GREEDY_MOST_GROUPS) status = 1;
        }
        if (status == 0) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) out[i] = -INFINITY;
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < count; i++) {
                int64_t g = chosen[i], cols = n - GROUP * g < GROUP ? n - GROUP * g : GROUP;
                fvec res;
                any_packed_group(Q8_0, w + g * q8_bytes, x, nb, 1, 1, &res);
                float lanes[GROUP];
                fv_store(lanes, res);
                memcpy(out + GROUP * g, lanes, (size_t)cols * sizeof *out);
            }
        }
    }
    if (status == 0) {
        float best = -INFINITY;
        int64_t at = -1;
        for (int64_t i = 0; i < count; i++) /* in column order: the first of equal largest values */
            for (int64_t col = GROUP * chosen[i]; col < n && col < GROUP * (chosen[i] + 1); col++)
                if (at < 0 || out[col] > best) best = out[col], at = col;
        *argmax = at;
    }
done:
    free(x);
    free(spread);
    free(flagged);
    free(chosen);
    free(shares);
    free(claims);
    free(noted);
    free(tops);
    return status;
}

#else /* neither AVX-512 VNNI nor AVX2 (with F16C), or no OpenMP: linear.py keeps the torch path */
int gguf_matmul_available(void) { return 0; }
int gguf_amx(int enable) {
    (void)enable;
    return 0;
}
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
int gguf_matmul(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w, int64_t n,
                void *out, int64_t ldo, int float_out, int threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)type, (void)w, (void)n, (void)out, (void)ldo, (void)float_out;
    (void)threads;
    return -1;
}
int gguf_matmul_gated(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w,
                      int64_t f, uint16_t *out, int64_t ldo, int gelu, int threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)type, (void)w, (void)f, (void)out, (void)ldo, (void)gelu;
    (void)threads;
    return -1;
}
int gguf_matmul_logits(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w,
                       int64_t n, float *out, int64_t ldo, int64_t *argmax, int32_t *finite, int threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)type, (void)w, (void)n, (void)out, (void)ldo, (void)argmax;
    (void)finite, (void)threads;
    return -1;
}
int gguf_greedy_row(const uint16_t *x, int64_t k, const uint8_t *high6, const uint8_t *w, int64_t n,
                    const int64_t *keep, int64_t kept, float *out, int64_t *argmax, int threads) {
    (void)x, (void)k, (void)high6, (void)w, (void)n, (void)keep, (void)kept, (void)out, (void)argmax, (void)threads;
    return -1;
}
#endif

/* gguf_repack for `count` tensors in one call: a loader holds no GIL from the first to the last, so a tokenizer built
 * on another Python thread meanwhile (which holds the GIL through its long native calls) cannot stall it between
 * tensors. Job i regroups ws[i] (ns[i] rows of ks[i] weights of types[i]) into outs[i]. Where release[i] is not 0,
 * ws[i] lies in a private, never-written mapping of a file and its release[i] bytes are dropped from the process as
 * soon as they are read (madvise DONTNEED: the page cache keeps them, and a page shared with a neighbour faults back in
 * from the file), so the file's copy and the regrouped one are never both resident. */
int gguf_repack_all(int64_t count, const int *types, const uint8_t *const *ws, const int64_t *ns, const int64_t *ks,
                    uint8_t *const *outs, const int64_t *release, int threads) {
    for (int64_t i = 0; i < count; i++) {
        if (gguf_repack(types[i], ws[i], ns[i], ks[i], outs[i], threads)) return -1;
#if defined(__linux__)
        if (release[i] > 0) {
            uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), begin = (uintptr_t)ws[i] / page * page;
            madvise((void *)begin, (uintptr_t)ws[i] + (uintptr_t)release[i] - begin, MADV_DONTNEED);
        }
#else
        (void)release;
#endif
    }
    return 0;
}
