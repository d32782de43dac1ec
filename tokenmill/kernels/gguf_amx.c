/* The GGUF product on AMX: a sub-block's sums for 16 rows in one tile product
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
 * Where the time goes (docs/decisions/0007-amx-tiles.md): the dot products are nearly free here; what is left is the AMX
 * unit's own sequence of load, product and store, which it runs one instruction after another, the float step (three
 * vector operations a row and block, the 16 rows' accumulators in registers) and moving the sums out of the tiles
 * (tilestored, then a vector load a row). A tile load or a sum read straight behind the stores of its data waits for
 * them, so a group's codes are decoded once, by its first row tile, DECODE_AHEAD sub-blocks ahead of their product,
 * and each product goes out AMX_AHEAD sub-blocks ahead of its float step (a ring of sums), so that the AMX unit, the
 * vector units and the weight stream overlap. */
#include <stdint.h>
#include <string.h>

#include "gguf_packed.h"
#include "kernels.h"

#if defined(WITH_AMX)
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_AHEAD 2 /* sub-blocks whose products go out ahead of the float step in hand */
/* Q4_0, Q5_0 and the K-quants: sub-blocks whose codes the first row tile decodes (for all the group's row tiles)
 * ahead of their product, so that a tile load does not wait for the stores of its data, and the decoding, which reads
 * the weights from memory, overlaps the tile work (a pass of its own before it did not, and at 16 rows lost to VNNI) */
#define DECODE_AHEAD (AMX_AHEAD + 2)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_wanted = 1, amx_granted = -1;

/* Linux hands a process the tile state on request (arch_prctl), once; a kernel that refuses leaves VNNI to run */
int amx_ready(void) {
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
_Static_assert(sizeof(tile_config) == 64, "ldtilecfg reads 64 bytes");

/* The tile shapes are per thread: each thread of the team loads them before its first product */
void amx_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.colsb[SUM0] = c.colsb[SUM1] = 4 * GROUP, c.rows[SUM0] = c.rows[SUM1] = TILE_ROWS;
    c.colsb[X0] = c.colsb[X1] = 32, c.rows[X0] = c.rows[X1] = TILE_ROWS;
    c.colsb[W0] = c.colsb[W1] = 64, c.rows[W0] = c.rows[W1] = 8;
    /* not _tile_loadconfig: GCC 12's declares only the config's first 8 bytes as what it reads, so the compiler may
     * drop the stores of the rest, and ldtilecfg then faults on stale stack bytes; this operand is all 64 */
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
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

void any_amx_group(int type, const uint8_t *w, uint8_t *decoded, int decode, const xblock *x, int64_t nb, int64_t m,
                   fvec *res) {
    switch (type) {
        case Q4_0: amx_group(Q4_0, w, decoded, decode, x, nb, m, res); break;
        case Q5_0: amx_group(Q5_0, w, decoded, decode, x, nb, m, res); break;
        case Q8_0: amx_group(Q8_0, w, decoded, 0, x, nb, m, res); break;
        case Q4_K: amx_group(Q4_K, w, decoded, decode, x, nb, m, res); break;
        default: amx_group(Q5_K, w, decoded, decode, x, nb, m, res); break;
    }
}

void amx_release(void) { _tile_release(); }
#else
int gguf_amx(int enable) {
    (void)enable;
    return 0;
}
#endif
