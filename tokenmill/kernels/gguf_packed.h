/* What the GGUF kernels' files share: the instruction set they are compiled for, the activation blocks, the
 * regrouped layout of the weights and how a group's code vectors are read from it, and the functions one file calls
 * in another (GGUF_HIDDEN: shared inside the library, never exported from it). gguf_matmul.c says how the product
 * goes and why its bits are exact; the files, by role:
 *   gguf_quantize.c    the rows of x quantised to int8 blocks of 32 (gguf_quantize_rows, and each call's scratch);
 *   gguf_repack.c      a file's blocks regrouped into the layout below, once at load (gguf_repack, gguf_repack_all);
 *   gguf_dot.c         a group's 16 columns against rows: the exact integer block sums and the float step;
 *   gguf_amx.c         the same sums for whole tiles of 16 rows on AMX;
 *   gguf_matmul.c      the threads, their claims of groups, and the LM head's argmax pass (gguf_matmul*);
 *   gguf_greedy_row.c  a single greedy row's LM head from a 6-bit copy of a Q8_0 head (gguf_greedy_row). */
#ifndef TOKENMILL_GGUF_PACKED_H
#define TOKENMILL_GGUF_PACKED_H
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
#if defined(WITH_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define WITH_AMX 1
#endif

/* ggml's type numbers (gguf.GGMLQuantizationType) */
enum { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
/* a layout of our own, regrouped from a Q8_0 tensor: its codes less their two low bits (gguf_greedy_row) */
enum { HIGH6 = GGUF_Q8_0_HIGH6 };

#if defined(WITH_SIMD)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define GGUF_HIDDEN __attribute__((visibility("hidden"))) /* one GGUF file's function that another calls */

#include "gguf_lanes.h"

/* One activation block: its scale, the exact sum of its codes and of each half's (for the codes' offsets and the
 * K-quants' minimums; Q6_K's scales cover 16 weights), and the 32 codes. */
typedef struct {
    float d;
    int32_t sum;
    int32_t halves[2];
    int8_t q[32];
} xblock;
_Static_assert(sizeof(xblock) == GGUF_XBLOCK_BYTES, "kernels.h states an activation block's size");

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

/* rows (M, K), `stride` apart -> M * K / 32 blocks, laid out as `layout` says (gguf_quantize.c); called inside a
 * parallel region */
GGUF_HIDDEN void quantize_rows(const uint16_t *x, int64_t stride, int64_t m, int64_t k, xblock *out,
                               block_layout layout);

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

/* where a unit's codes start in the packed layout: past d (and the K-quants' dmin, scales and mins) */
static inline int64_t codes_at(int type) { return type == Q4_K || type == Q5_K ? 320 : type == Q6_K ? 288 : 32; }

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

/* Bytes ahead of the sub-block in use that each thread asks the memory for, into L2 (prefetcht1), a line at a time as
 * it goes, in a pass of two rows or more (a single row's pass goes without: packed_group_row): the weights are one
 * sequential stream per thread, and without the hint the rows' compute and the stream alternate rather than overlap.
 * Into L1 (prefetcht0) the requests hold the core's few L1 fill buffers, and the types with more decoding per byte
 * than Q8_0 streamed at a fifth less (docs/decisions/0010-prefetch-hints.md; 4 to 32 KiB alike) */
#define PREFETCH_AHEAD 8192
#define ROW_PREFETCH_AHEAD 4096 /* the same for a single row's pass, where row_prefetch says it asks (2-8 KiB alike) */

/* Each thread's weights are one stream: ask for its lines into L2 (prefetcht1), one at a time, up to `distance`
 * bytes past `used` (PREFETCH_AHEAD, or a single row's ROW_PREFETCH_AHEAD); *ahead is the next line to ask for */
static inline void prefetch_through(const char **ahead, const void *used, int64_t distance) {
    const char *end = (const char *)used + distance;
    for (; *ahead < end; *ahead += 64) _mm_prefetch(*ahead, _MM_HINT_T1);
}

/* Whether a single row's pass asks for its weights ahead (packed_group_row says why by vendor): 1 on Intel CPUs, 0
 * on others, -1 until read_row_prefetch has read the CPU's vendor, as each call does first (gguf_dot.c) */
GGUF_HIDDEN extern int row_prefetch;
GGUF_HIDDEN void read_row_prefetch(void);

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

/* The group's 16 columns of a type against `rows` rows (<= ROW_CHUNK; block b of row r at x + b * m + r) into
 * res[r] (gguf_dot.c) */
GGUF_HIDDEN void any_packed_group(int type, const uint8_t *w, const xblock *x, int64_t nb, int64_t m, int64_t rows,
                                  fvec *res);

#if defined(WITH_AMX)
#define TILE_ROWS 16 /* a tile product costs the same for one row as for 16: fewer rows take the VNNI path */

static inline int amx_takes(int type) { return type != Q6_K; }

/* gguf_amx.c: whether the tiles are granted and wanted; each thread's tile shapes, loaded before its first product
 * and released after its last; one tile of 16 rows of a group (`decode`: the group's first, which decodes its codes
 * into this thread's `decoded` for the others) */
GGUF_HIDDEN int amx_ready(void);
GGUF_HIDDEN void amx_configure(void);
GGUF_HIDDEN void amx_release(void);
GGUF_HIDDEN void any_amx_group(int type, const uint8_t *w, uint8_t *decoded, int decode, const xblock *x, int64_t nb,
                               int64_t m, fvec *res);
#endif
#endif
#endif
