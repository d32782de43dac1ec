/* A single greedy row's LM head from a 6-bit copy, exactly.
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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_packed.h"
#include "kernels.h"

#if defined(WITH_SIMD)
#include <omp.h>

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

/* One call: its arguments, what it derives from them, its scratch, and what its steps decide */
typedef struct {
    const uint8_t *high6, *w;
    int64_t n;
    const int64_t *keep;
    int64_t kept, threads;
    int64_t nb, groups, high6_bytes, q8_bytes; /* blocks per row, groups of columns, bytes of a group of each copy */
    float widen;                               /* E's widening for the roundings (the bound above) */
    xblock *x;                                 /* the row quantised, as the full pass's */
    float *spread;                             /* per block, 1.5 dx sum |x| */
    uint8_t *flagged;                          /* groups holding a kept column, or columns past N */
    int64_t *chosen;                           /* the groups to compute exactly, in order */
    int64_t count;                             /* how many */
    greedy_share *shares;                      /* what each thread found */
    group_claims *claims;                      /* one per thread's share of the groups */
    int64_t *noted;                            /* the shares' noted groups: room for every group, per thread */
    float *tops;                               /* and their largest upper bounds */
    int status;                                /* 0; 1 where this pass cannot answer; -2 without memory */
} greedy_pass;

/* The pass's scratch, its groups flagged and each thread's share set; -2 without memory (the caller frees what was
 * allocated) */
static int greedy_alloc(greedy_pass *p) {
    int64_t threads = p->threads, groups = p->groups;
    p->x = malloc((size_t)p->nb * sizeof *p->x + 64);
    p->spread = malloc((size_t)p->nb * sizeof *p->spread);
    p->flagged = calloc((size_t)groups, 1);
    p->chosen = malloc((size_t)groups * sizeof *p->chosen);
    p->shares = calloc((size_t)threads, sizeof *p->shares);
    p->claims = aligned_alloc(64, (size_t)threads * sizeof *p->claims);
    p->noted = malloc((size_t)(threads * groups) * sizeof *p->noted);
    p->tops = malloc((size_t)(threads * groups) * sizeof *p->tops);
    if (!p->x || !p->spread || !p->flagged || !p->chosen || !p->shares || !p->claims || !p->noted || !p->tops)
        return -2;
    for (int64_t i = 0; i < p->kept; i++) p->flagged[p->keep[i] / GROUP] = 1;
    if (p->n % GROUP) p->flagged[groups - 1] = 1;
    for (int64_t t = 0; t < threads; t++) {
        p->claims[t].next = share_start(groups, t, threads);
        p->shares[t].floor = -INFINITY; /* a team smaller than asked for leaves some shares unset */
        p->shares[t].groups = p->noted + t * groups;
        p->shares[t].tops = p->tops + t * groups;
    }
    return 0;
}

static void greedy_free(greedy_pass *p) {
    free(p->x);
    free(p->spread);
    free(p->flagged);
    free(p->chosen);
    free(p->shares);
    free(p->claims);
    free(p->noted);
    free(p->tops);
}

/* Each block's 1.5 dx sum |x|: E's factor from the row */
static void block_spreads(greedy_pass *p) {
    for (int64_t b = 0; b < p->nb; b++) {
        int32_t total = 0;
        for (int e = 0; e < 32; e++) total += p->x[b].q[e] < 0 ? -p->x[b].q[e] : p->x[b].q[e];
        p->spread[b] = 1.5f * p->x[b].d * (float)total;
    }
}

/* A flagged group's lower bounds with its kept columns and those past N at -inf: they set no floor */
static fvec unfloored(const greedy_pass *p, int64_t g, fvec lower) {
    float lanes[GROUP];
    fv_store(lanes, lower);
    int64_t i = 0, hi = p->kept; /* the first kept column in or past the group */
    while (i < hi) {
        int64_t mid = (i + hi) / 2;
        if (p->keep[mid] < GROUP * g) i = mid + 1; else hi = mid;
    }
    for (int64_t l = 0; l < GROUP; l++) {
        int64_t col = GROUP * g + l, kept_here = i < p->kept && p->keep[i] == col;
        if (col >= p->n || kept_here) lanes[l] = -INFINITY;
        i += kept_here;
    }
    return fv_load(lanes);
}

/* One thread's claims of groups bounded from the HIGH6 copy: its floor, the sum of |A| + E, and the groups whose
 * upper bounds reach its floor so far (noted as it goes; the floor moves once a claim, and the groups after it are
 * noted against it) */
static void bound_groups(greedy_pass *p, int64_t thread) {
    greedy_share *mine = &p->shares[thread];
    fvec lowest = fv_set1(-INFINITY), magnitude = fv_zero();
    float floor = -INFINITY;
    for (int64_t v = 0, claim, stop; next_claim(p->claims, p->groups, p->threads, thread, &v, &claim, &stop);) {
        for (int64_t g = claim; g < stop; g++) {
            fvec value, width;
            high6_group(p->high6 + g * p->high6_bytes, p->x, p->spread, p->nb, &value, &width);
            width = fv_mul(width, fv_set1(p->widen));
            fvec upper = fv_add(value, width), lower = fv_sub(value, width);
            magnitude = fv_add(magnitude, fv_add(fv_abs(value), width));
            if (p->flagged[g]) lower = unfloored(p, g, lower);
            lowest = fv_max(lowest, lower);
            if (fv_any_ge(upper, fv_set1(floor))) {
                mine->groups[mine->noted] = g;
                mine->tops[mine->noted++] = fv_reduce_max(upper);
            }
        }
        floor = fv_reduce_max(lowest);
    }
    mine->floor = fv_reduce_max(lowest);
    mine->magnitude = fv_reduce_add(magnitude);
}

/* From every thread's share: the groups to compute exactly (those that can hold the argmax, and the kept ones), in
 * order, or status 1 where the bounds are not finite or leave too many */
static void choose_groups(greedy_pass *p) {
    float top = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < p->threads; t++) {
        top = p->shares[t].floor > top ? p->shares[t].floor : top;
        sum += p->shares[t].magnitude;
    }
    /* every value and the full pass's sum of them finite: |logit| <= |A| + E, summed well below FLT_MAX */
    if (!(isfinite(top) && sum < 1e37f)) {
        p->status = 1;
        return;
    }
    uint8_t *take = p->flagged; /* reused: 1 for a kept group, 2 once chosen */
    for (int64_t t = 0; t < p->threads; t++)
        for (int64_t i = 0; i < p->shares[t].noted; i++)
            if (p->shares[t].tops[i] >= top) take[p->shares[t].groups[i]] |= 2;
    for (int64_t i = 0; i < p->kept; i++) take[p->keep[i] / GROUP] |= 2;
    for (int64_t g = 0; g < p->groups; g++)
        if (take[g] & 2) p->chosen[p->count++] = g;
    if (p->count == 0 || p->count > p->groups / GREEDY_MOST_GROUPS) p->status = 1;
}

/* out: -inf, but for the chosen groups, computed exactly by the full pass's one-row loop. Called by every thread of
 * the team. */
static void exact_groups(const greedy_pass *p, float *out) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < p->n; i++) out[i] = -INFINITY;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < p->count; i++) {
        int64_t g = p->chosen[i], cols = p->n - GROUP * g < GROUP ? p->n - GROUP * g : GROUP;
        fvec res;
        any_packed_group(Q8_0, p->w + g * p->q8_bytes, p->x, p->nb, 1, 1, &res);
        float lanes[GROUP];
        fv_store(lanes, res);
        memcpy(out + GROUP * g, lanes, (size_t)cols * sizeof *out);
    }
}

/* The first column of the largest value among the chosen groups' */
static int64_t first_largest(const greedy_pass *p, const float *out) {
    float best = -INFINITY;
    int64_t at = -1;
    for (int64_t i = 0; i < p->count; i++) /* in column order: the first of equal largest values */
        for (int64_t col = GROUP * p->chosen[i]; col < p->n && col < GROUP * (p->chosen[i] + 1); col++)
            if (at < 0 || out[col] > best) best = out[col], at = col;
    return at;
}

/* Whether this pass takes a width of k inputs, n columns and `keep` (sorted, within the row, no repeats) */
static int greedy_takes(int64_t k, int64_t n, const int64_t *keep, int64_t kept) {
    if (k % 32 || k / 32 > GREEDY_MAX_BLOCKS || n <= 0) return 0;
    for (int64_t i = 0; i < kept; i++)
        if (keep[i] < 0 || keep[i] >= n || (i && keep[i] <= keep[i - 1])) return 0;
    return 1;
}

/* x: one row of K bf16 inputs; high6, w: the head's N columns regrouped by gguf_repack as GGUF_Q8_0_HIGH6 and as
 * Q8_0; keep: `kept` sorted column ids to compute exactly. out (N floats): -inf but for the groups computed exactly,
 * which hold gguf_matmul_logits's values; *argmax: the first column of the largest of them (the full row's argmax).
 * Returns 0, or 1 where this pass cannot answer (the row or a bound not finite, or too many groups to compute) and
 * the caller takes gguf_matmul_logits; -1 for a width or keep it does not take, -2 without memory. */
int gguf_greedy_row(const uint16_t *x_in, int64_t k, const uint8_t *high6, const uint8_t *w, int64_t n,
                    const int64_t *keep, int64_t kept, float *out, int64_t *argmax, int threads) {
    if (!greedy_takes(k, n, keep, kept)) return -1;
    read_row_prefetch();
    if (threads < 1) threads = 1;
    const int64_t nb = k / 32;
    greedy_pass p = {.high6 = high6, .w = w, .n = n, .keep = keep, .kept = kept,
                     .threads = threads, .nb = nb, .groups = (n + GROUP - 1) / GROUP,
                     .high6_bytes = nb * packed_unit_bytes(HIGH6), .q8_bytes = nb * packed_unit_bytes(Q8_0),
                     .widen = 1.0f + (float)(nb + 2) * (253.0f / 1.5f) * 0x1p-22f + 1e-3f};
    p.status = greedy_alloc(&p);
    if (p.status == 0) {
#pragma omp parallel num_threads(threads)
        {
            quantize_rows(x_in, k, 1, k, p.x, (block_layout){1, code_offset(Q8_0), 0}); /* as the full pass's */
#pragma omp single
            block_spreads(&p);
            bound_groups(&p, omp_get_thread_num());
#pragma omp barrier
#pragma omp single
            choose_groups(&p);
            if (p.status == 0) exact_groups(&p, out);
        }
        if (p.status == 0) *argmax = first_largest(&p, out);
    }
    greedy_free(&p);
    return p.status;
}
#else /* neither AVX-512 VNNI nor AVX2 (with F16C), or no OpenMP: linear.py keeps the torch path */
int gguf_greedy_row(const uint16_t *x, int64_t k, const uint8_t *high6, const uint8_t *w, int64_t n,
                    const int64_t *keep, int64_t kept, float *out, int64_t *argmax, int threads) {
    (void)x, (void)k, (void)high6, (void)w, (void)n, (void)keep, (void)kept, (void)out, (void)argmax, (void)threads;
    return -1;
}
#endif
