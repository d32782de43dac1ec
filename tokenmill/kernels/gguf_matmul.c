/* GGUF's quantised weights multiplied as they are: out (M, N) = x (M, K) @ W (N, K)^T, where W is a GGUF file's
 * Q4_0, Q5_0, Q8_0 (32 weights a block) or Q4_K, Q5_K, Q6_K (256 a super-block) tensor, regrouped once at load
 * (gguf_repack, the layout gguf_packed.h draws) and never widened: a decode step reads every weight once, so on a
 * memory-bound CPU the bytes per weight are the speed.
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
 * AMX (gguf_amx.c): on CPUs that have it, whole tiles of 16 rows of every type but Q6_K take their exact block sums
 * from tile products instead, with the same float step: the same bits.
 *
 * Threads: OpenMP over the column groups, which resolves to torch's own libgomp when torch is loaded first. Each
 * thread streams its own even share of W, claimed a few groups at a time; a thread done with its share claims what is
 * left of the others', so a core the OS lent to another thread for a while (the server's event loop, a client on the
 * same machine, a neighbour on a shared host) delays the call by its share of the work, not by the whole wait. Which
 * thread computes a group never changes its bits.
 *
 * This file: the threads, their claims, and the LM head's argmax pass; gguf_packed.h lists the other files by role.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "gguf_packed.h"
#include "kernels.h"

#if defined(WITH_SIMD)
#include <omp.h>

int gguf_matmul_available(void) { return 1; }

/* --- the LM head's own pass over its logits: each row's largest value and whether all are finite ---------------
 *
 * Greedy decoding wants each row's argmax and the engine wants to know whether a row's logits are all finite (a row
 * that is not fails its request). As separate passes after the product those read the (rows, 262144) float32 logits
 * back from memory, cold (docs/decisions/0012-head-argmax-in-its-pass.md). Here each thread looks at the columns of each claim it has
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

/* One call of gguf_matmul*: its arguments, its units (groups, or pairs of groups) and its scratch, shared by the
 * threads */
typedef struct {
    const uint16_t *x_in;
    int64_t x_stride, m, k;
    int type;
    const uint8_t *w;
    int64_t n;
    void *out;
    int64_t ldo;
    int float_out, gated, threads;
    const float *addend;            /* gated: added to the marked rows' bf16 products before the activation, or NULL */
    const uint8_t *added;           /* which rows (m flags) */
    int64_t nb, units, group_bytes; /* blocks per row, units of work, bytes of one group's weights */
    int amx;                        /* whole tiles of 16 rows go to AMX */
    xblock *x;                      /* the rows quantised, block-major */
    group_claims *claims;           /* one per thread's share of the units */
    uint16_t *pairs;                /* gated: each thread's bf16 products of its pair of groups */
    uint8_t *decoding;              /* AMX: each thread's decoding of a group's codes (all but Q8_0, which the tiles
                                     * take as stored) */
    row_best *bests;                /* argmax: each thread's lanes for every row */
} matmul_job;

static void job_free(matmul_job *job) {
    free(job->x);
    free(job->claims);
    free(job->pairs);
    free(job->decoding);
    free(job->bests);
}

/* The job's scratch, its claims set to each thread's share and its rows' lanes reset; -2 without memory (the caller
 * frees what was allocated) */
static int job_alloc(matmul_job *job, int argmax) {
    int64_t threads = job->threads, m = job->m;
#if defined(WITH_AMX)
    job->amx = m >= TILE_ROWS && amx_takes(job->type) && amx_ready();
    if (job->amx && job->type != Q8_0) {
        job->decoding = aligned_alloc(64, (size_t)(threads * job->nb * 512));
        if (job->decoding == NULL) return -2;
    }
#endif
    job->x = malloc((size_t)(m * job->nb) * sizeof *job->x + 64);
    job->claims = aligned_alloc(64, (size_t)threads * sizeof *job->claims);
    job->pairs = job->gated ? malloc((size_t)(threads * m * 2 * GROUP) * sizeof *job->pairs) : NULL;
    job->bests = argmax ? aligned_alloc(64, (size_t)(threads * m) * sizeof *job->bests) : NULL;
    if (!job->x || !job->claims || (job->gated && !job->pairs) || (argmax && !job->bests)) return -2;
    for (int64_t t = 0; t < threads; t++) job->claims[t].next = share_start(job->units, t, threads);
    /* every thread's lanes, of the team asked for: the team may be smaller */
    for (int64_t i = 0; job->bests && i < threads * m; i++) row_best_reset(job->bests + i);
    return 0;
}

/* a marked row's gate and up products of unit u += their addend, each rounded to bf16 (what lora.c's lora_add does
 * to the products gguf_matmul writes: the same bits as the unfused path) */
static void add_to_pair(const matmul_job *job, int64_t u, uint16_t *pair) {
    const int64_t m = job->m, f = job->n / 2;
    for (int64_t r = 0; r < m; r++) {
        if (!job->added[r]) continue;
        const float *gate = job->addend + r * 2 * f + u * GROUP, *up = gate + f;
        uint16_t *g = pair + r * GROUP, *v = pair + (m + r) * GROUP;
        for (int c = 0; c < GROUP; c++) {
            g[c] = float_to_bf16(bf16_to_float(g[c]) + gate[c]);
            v[c] = float_to_bf16(bf16_to_float(v[c]) + up[c]);
        }
    }
}

static void unit_product(const matmul_job *job, int64_t u, uint16_t *pair, uint8_t *decoded) {
    int type = job->type, amx = job->amx;
    int64_t nb = job->nb, m = job->m, group_bytes = job->group_bytes;
    if (job->gated == PLAIN) {
        group_product(type, job->w + u * group_bytes, job->x, nb, m, job->n, u, job->out, job->ldo, job->float_out,
                      decoded, amx);
        return;
    }
    int64_t half = job->n / 2 / GROUP; /* the gate's groups, then as many of the up's */
    group_product(type, job->w + u * group_bytes, job->x, nb, m, GROUP, 0, pair, GROUP, 0, decoded, amx);
    group_product(type, job->w + (half + u) * group_bytes, job->x, nb, m, GROUP, 0, pair + m * GROUP, GROUP, 0,
                  decoded, amx);
    if (job->addend != NULL) add_to_pair(job, u, pair);
    gated_block(pair, pair + m * GROUP, m, (uint16_t *)job->out + u * GROUP, job->ldo, job->gated == GATED_GELU);
}

/* One thread's part, called by every thread of the team: its share's first window of weights asked for while the
 * rows are quantised (not for one row: see packed_group_row), then its claims of units, each claim's logits scanned
 * for the argmax while they are in L1 */
static void job_thread(const matmul_job *job, int64_t thread) {
    int64_t m = job->m, first = share_start(job->units, thread, job->threads);
    int64_t last = share_start(job->units, thread + 1, job->threads);
    for (int64_t at = 0; m > 1 && first < last && at < PREFETCH_AHEAD; at += 64)
        _mm_prefetch((const char *)job->w + first * job->group_bytes + at, _MM_HINT_T1);
    int type = job->type;
    quantize_rows(job->x_in, job->x_stride, m, job->k, job->x,
                  (block_layout){1, code_offset(type), type == Q4_K || type == Q5_K});
    uint8_t *decoded = job->decoding ? job->decoding + thread * job->nb * 512 : NULL;
#if defined(WITH_AMX)
    if (job->amx) amx_configure();
#endif
    uint16_t *pair = job->pairs ? job->pairs + thread * m * 2 * GROUP : NULL;
    row_best *rows_best = job->bests ? job->bests + thread * m : NULL;
    for (int64_t v = 0, claim, stop; next_claim(job->claims, job->units, job->threads, thread, &v, &claim, &stop);) {
        for (int64_t u = claim; u < stop; u++) unit_product(job, u, pair, decoded);
        for (int64_t r = 0; rows_best && r < m; r++) /* the claim's logits, still in L1 */
            row_best_scan(rows_best + r, (const float *)job->out + r * job->ldo, job->n, claim, stop);
    }
#if defined(WITH_AMX)
    if (job->amx) amx_release();
#endif
}

/* gguf_matmul, or gguf_matmul_gated where `gated` says which activation: the rows quantised once, then the units
 * (groups, or pairs of groups) shared out among the threads. With `argmax` (plain products only), each row's argmax
 * and finiteness as gguf_matmul_logits says. */
static int matmul(const uint16_t *x_in, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w, int64_t n,
                  void *out, int64_t ldo, int float_out, int gated, int64_t *argmax, int32_t *finite,
                  const float *addend, const uint8_t *added, int threads) {
    if (type == HIGH6 || gguf_packed_bytes(type, n, k) < 0) return -1;
    if (threads < 1) threads = 1;
    read_row_prefetch();
    matmul_job job = {.x_in = x_in, .x_stride = x_stride, .m = m, .k = k, .type = type, .w = w, .n = n, .out = out,
                      .ldo = ldo, .float_out = float_out, .gated = gated, .threads = threads, .nb = k / 32,
                      .addend = addend, .added = added};
    job.units = gated ? n / 2 / GROUP : (n + GROUP - 1) / GROUP;
    job.group_bytes = job.nb / (is_k(type) ? 8 : 1) * packed_unit_bytes(type);
    int status = job_alloc(&job, argmax != NULL);
    if (status == 0) {
#pragma omp parallel num_threads(threads)
        job_thread(&job, omp_get_thread_num());
        for (int64_t r = 0; job.bests && r < m; r++) row_best_merge(job.bests, threads, m, r, argmax, finite);
    }
    job_free(&job);
    return status;
}

/* x: M rows of K bf16 inputs, x_stride apart; w: N columns repacked by gguf_repack; out: (M, ldo) bf16, or float32
 * if float_out, its columns [0, N) written. The rows are quantised first (as gguf_quantize_rows does), into a
 * scratch of M * K / 32 blocks, block-major (each block's rows side by side, as a group's pass reads them). Returns
 * 0, -1 for a type or width it does not take, -2 without memory. */
int gguf_matmul(const uint16_t *x_in, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w, int64_t n,
                void *out, int64_t ldo, int float_out, int threads) {
    return matmul(x_in, x_stride, m, k, type, w, n, out, ldo, float_out, PLAIN, NULL, NULL, NULL, NULL, threads);
}

/* gguf_matmul into float32 logits, and from the same pass each row's argmax (the first column of its largest value,
 * as torch.argmax) into argmax[M] and whether all its N values are finite (1, else 0) into finite[M]: greedy
 * decoding's choice and the engine's check, without reading the logits back. A row that is not finite has no
 * meaningful argmax. Returns as gguf_matmul does. */
int gguf_matmul_logits(const uint16_t *x_in, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w,
                       int64_t n, float *out, int64_t ldo, int64_t *argmax, int32_t *finite, int threads) {
    return matmul(x_in, x_stride, m, k, type, w, n, out, ldo, 1, PLAIN, argmax, finite, NULL, NULL, threads);
}

/* A gated MLP's first projection and its activation in one pass: w holds the gate's f columns and then the up's (one
 * part, 2f wide, f a multiple of 16); out (M, ldo) bf16 gets f columns, bf16(bf16(act(gate)) * up) with gelu_tanh
 * (gelu != 0) or silu, act(gate) and up being the bf16 products gguf_matmul would write. The same bits as
 * gguf_matmul into (M, 2f) then gelu_mul or silu_mul, without writing the 2f products out and reading them back, or
 * a pass of its own for the activation. Returns as gguf_matmul does, -1 also for an f that is not a multiple of 16
 * or where the activation kernels are not compiled in. */
int gguf_matmul_gated(const uint16_t *x_in, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w,
                      int64_t f, uint16_t *out, int64_t ldo, int gelu, int threads) {
    return gguf_matmul_gated_added(x_in, x_stride, m, k, type, w, f, out, ldo, gelu, NULL, NULL, threads);
}

/* gguf_matmul_gated with `addend` (M, 2f) float32 added to the gate and up products of the rows `added` marks, each
 * rounded to bf16, before the activation: an adapter's low-rank update of gate_up (lora.c's lora_deltas), the same
 * bits as gguf_matmul, lora_add and the activation's pass */
int gguf_matmul_gated_added(const uint16_t *x_in, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w,
                            int64_t f, uint16_t *out, int64_t ldo, int gelu, const float *addend, const uint8_t *added,
                            int threads) {
    if (f <= 0 || f % GROUP || !gelu_mul_available()) return -1;
    return matmul(x_in, x_stride, m, k, type, w, 2 * f, out, ldo, 0, gelu ? GATED_GELU : GATED_SILU, NULL, NULL,
                  addend, added, threads);
}
#else /* neither AVX-512 VNNI nor AVX2 (with F16C), or no OpenMP: linear.py keeps the torch path */
int gguf_matmul_available(void) { return 0; }
int gguf_matmul(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w, int64_t n,
                void *out, int64_t ldo, int float_out, int threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)type, (void)w, (void)n, (void)out, (void)ldo, (void)float_out;
    (void)threads;
    return -1;
}
int gguf_matmul_gated_added(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w,
                            int64_t f, uint16_t *out, int64_t ldo, int gelu, const float *addend, const uint8_t *added,
                            int threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)type, (void)w, (void)f, (void)out, (void)ldo, (void)gelu;
    (void)addend, (void)added, (void)threads;
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
#endif
