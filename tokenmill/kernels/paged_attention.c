/* Softmax attention of bfloat16 query rows over their keys in the paged KV cache, one (row, head) at a time.
 *
 * Why: in torch, attention over a paged cache is dozens of eager ops per layer (gathers, float32 copies, masked chunked
 * matmuls, cumulative sums) whose fixed costs dominate a decode step's attention; here it is one call per layer.
 *
 * Batch invariance: each (query row, head) is computed from its own query and the keys it sees, by the same loops
 * whatever else is in the call: a row gets the same bits decoded alone, beside other sequences, or inside a prompt's
 * prefill. Arithmetic in float32: s_j = scale * q . k_j (16 partial sums per dot, reduced in a fixed order),
 * (softcap > 0, Gemma 2: s_j = softcap * tanh(s_j / softcap)), p_j = exp(s_j - max s), out = (sum_j p_j v_j) / (sum_j p_j), rounded to bfloat16 (nearest even). The query heads
 * that share a KV head are computed together, which shares the loads of their keys and values, not their numbers.
 *
 * A row over more than KEY_CHUNK keys takes them in chunks of KEY_CHUNK (the last one shorter), each chunk's softmax
 * against its own largest score: m_c, l_c = sum p_j, o_c = sum p_j v_j; then, in chunk order, M = max m_c,
 * w_c = exp(m_c - M), out = (sum_c w_c o_c) / (sum_c w_c l_c). Why: a single stream's step has one row, and Gemma 3 one
 * KV head, so without chunks one thread read a long context's keys and values while the other waited; the chunks go
 * to both (and a few rows' to the threads evenly). Where a row's chunks are computed (which thread, beside what) never
 * changes its numbers: they depend on its key count alone, so a row gets the same bits alone, batched or in a prefill.
 *
 * Row r sees the keys at cache slots slots[offset[r]], ..., slots[offset[r] + count[r] - 1] (its visible positions,
 * in position order); attention.py builds these from each sequence's block table and the layer's window.
 *
 * An 8-bit cache (kv_int8) holds a (slot, KV head) row as d int8 codes and a float16 scale per 32 of them (llama.cpp's
 * q8_0, kv_quantize_rows): a key's or value's lanes are its codes times their block's scale, as floats, and the rest
 * is the same arithmetic. The codes are the same whatever the batch, so the same invariance.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#include "vec16.h"

#if defined(VEC16) && defined(_OPENMP)
#include <math.h>
#include <omp.h>

int paged_attention_available(void) { return 1; }

/* Up to GROUP query heads that share one KV head, for one query row, over `count` keys -> out (gs, d) bf16, or, for
 * a chunk of a longer row's keys, `partial` (gs, PARTIAL(d)) float32: each head's o_c (sum p_j v_j), m_c and l_c.
 * Each head's numbers come from the same loops whatever the grouping: the dot product over d in 16 lanes (one FMA
 * chain per lane), reduced in a fixed order; the softmax and the weighted sum of values in key order. The grouping
 * only shares the loads of keys and values (and computes two keys at a time to keep the FMA units busy), as does
 * the number of 16-lane vectors of output summed at a time (more in AVX-512's 32 registers than in AVX2's 16). */
#define GROUP 4
#define KEY_CHUNK ATTENTION_KEY_CHUNK /* keys a chunk of a longer row (kernels.h): a multiple of 16 */
#define PARTIAL(d) ((d) + 2) /* floats of one head's chunk result: o_c, then m_c and l_c */
#define ROW_BLOCK 8            /* a prompt's rows taken together over each chunk of keys (attend_rows) */
#if defined(VEC16_WIDE)
#define OUT_VECTORS 4
#else
#define OUT_VECTORS 2
#endif
/* key or value row `row` (d bf16 values, or KV8: d int8 codes, then a float16 scale per 32), lanes 16 i .. 16 i + 15,
 * as floats */
static inline __attribute__((always_inline)) v16 kv_lanes(const char *row, int64_t i, int64_t d, const int KV8) {
    if (!KV8) return v16_load_bf16((const uint16_t *)row + 16 * i);
    uint16_t half;
    memcpy(&half, row + d + 2 * (i / 2), sizeof half);
    return v16_mul(v16_load_i8((const int8_t *)row + 16 * i), v16_set1(_cvtsh_ss(half)));
}

static inline __attribute__((always_inline)) void attend_group(
    const uint16_t *q, int64_t q_head_stride, const char *k_cache, const char *v_cache, const int64_t *slots,
    int64_t count, int64_t slot_stride, int64_t d, float scale, float softcap, float *scores, uint16_t *out,
    float *partial, const int GS, const int KV8) {
    v16 qf[GROUP][MAX_ATTENTION_HEAD_DIM / 16];
    int64_t lanes = d / 16;
    for (int g = 0; g < GS; g++)
        for (int64_t i = 0; i < lanes; i++) qf[g][i] = v16_load_bf16(q + g * q_head_stride + 16 * i);
    float *s[GROUP];
    for (int g = 0; g < GS; g++) s[g] = scores + g * (count + 16);
    int64_t j = 0;
#if defined(VEC16_WIDE)
    /* 16 keys at a time, their dot products' lanes summed together (v16_sum16: the same sums as one at a time) */
    for (; j + 16 <= count; j += 16) {
        v16 dots[GROUP][16];
        for (int at = 0; at < 16; at += 2) {
            const char *k0 = k_cache + slots[j + at] * slot_stride, *k1 = k_cache + slots[j + at + 1] * slot_stride;
            v16 a0[GROUP], a1[GROUP];
            for (int g = 0; g < GS; g++) a0[g] = a1[g] = v16_zero();
            for (int64_t i = 0; i < lanes; i++) {
                v16 x0 = kv_lanes(k0, i, d, KV8), x1 = kv_lanes(k1, i, d, KV8);
                for (int g = 0; g < GS; g++) {
                    a0[g] = v16_fma(qf[g][i], x0, a0[g]);
                    a1[g] = v16_fma(qf[g][i], x1, a1[g]);
                }
            }
            for (int g = 0; g < GS; g++) {
                dots[g][v16_sum16_slot(at)] = a0[g];
                dots[g][v16_sum16_slot(at + 1)] = a1[g];
            }
        }
        for (int g = 0; g < GS; g++) v16_store(s[g] + j, v16_mul(v16_sum16(dots[g]), v16_set1(scale)));
    }
#endif
    for (; j + 2 <= count; j += 2) {
        const char *k0 = k_cache + slots[j] * slot_stride, *k1 = k_cache + slots[j + 1] * slot_stride;
        v16 a0[GROUP], a1[GROUP];
        for (int g = 0; g < GS; g++) a0[g] = a1[g] = v16_zero();
        for (int64_t i = 0; i < lanes; i++) {
            v16 x0 = kv_lanes(k0, i, d, KV8), x1 = kv_lanes(k1, i, d, KV8);
            for (int g = 0; g < GS; g++) {
                a0[g] = v16_fma(qf[g][i], x0, a0[g]);
                a1[g] = v16_fma(qf[g][i], x1, a1[g]);
            }
        }
        for (int g = 0; g < GS; g++) {
            s[g][j] = v16_reduce_add(a0[g]) * scale;
            s[g][j + 1] = v16_reduce_add(a1[g]) * scale;
        }
    }
    for (; j < count; j++) {
        const char *k0 = k_cache + slots[j] * slot_stride;
        v16 a0[GROUP];
        for (int g = 0; g < GS; g++) a0[g] = v16_zero();
        for (int64_t i = 0; i < lanes; i++) {
            v16 x0 = kv_lanes(k0, i, d, KV8);
            for (int g = 0; g < GS; g++) a0[g] = v16_fma(qf[g][i], x0, a0[g]);
        }
        for (int g = 0; g < GS; g++) s[g][j] = v16_reduce_add(a0[g]) * scale;
    }
    if (softcap > 0) /* Gemma 2: s_j = softcap * tanh(s_j / softcap), before the softmax */
        for (int g = 0; g < GS; g++)
            for (int64_t t = 0; t < count; t++) s[g][t] = softcap * tanhf(s[g][t] / softcap);
    float inv[GROUP];
    for (int g = 0; g < GS; g++) { /* p_j = exp(s_j - max), in place; inv = 1 / sum p */
        v16 top = v16_set1(-INFINITY);
        for (int64_t t = 0; t < count; t += 16) top = v16_max(top, v16_load_first(s[g] + t, count - t, -INFINITY));
        float largest = v16_reduce_max(top);
        v16 shift = v16_set1(largest), sum = v16_zero();
        for (int64_t t = 0; t < count; t += 16) { /* lanes past the end: e^-inf = 0, adding nothing to the sum */
            v16 p = v16_exp_nonpositive(v16_sub(v16_load_first(s[g] + t, count - t, -INFINITY), shift));
            v16_store_first(s[g] + t, count - t, p);
            sum = v16_add(sum, p);
        }
        if (partial) {
            partial[g * PARTIAL(d) + d] = largest;
            partial[g * PARTIAL(d) + d + 1] = v16_reduce_add(sum);
        } else {
            inv[g] = 1.0f / v16_reduce_add(sum);
        }
    }
    for (int64_t c = 0; c < lanes; c += OUT_VECTORS) { /* OUT_VECTORS x 16 output dims of every head at a time */
        int width = lanes - c < OUT_VECTORS ? (int)(lanes - c) : OUT_VECTORS;
        v16 acc[GROUP][OUT_VECTORS];
        for (int g = 0; g < GS; g++)
            for (int i = 0; i < OUT_VECTORS; i++) acc[g][i] = v16_zero();
        for (int64_t t = 0; t < count; t++) {
            const char *v = v_cache + slots[t] * slot_stride;
            v16 x[OUT_VECTORS];
            for (int i = 0; i < OUT_VECTORS; i++) x[i] = i < width ? kv_lanes(v, c + i, d, KV8) : v16_zero();
            for (int g = 0; g < GS; g++) {
                v16 p = v16_set1(s[g][t]);
                for (int i = 0; i < OUT_VECTORS; i++) acc[g][i] = v16_fma(p, x[i], acc[g][i]);
            }
        }
        for (int g = 0; g < GS; g++) {
            if (partial) {
                for (int i = 0; i < width; i++) v16_store(partial + g * PARTIAL(d) + 16 * (c + i), acc[g][i]);
                continue;
            }
            v16 norm = v16_set1(inv[g]);
            for (int i = 0; i < width; i++) v16_store_bf16(out + g * d + 16 * (c + i), v16_mul(acc[g][i], norm));
        }
    }
}

/* exp(x) for x <= 0 as the softmax takes it (every lane the same) */
static inline float exp_nonpositive1(float x) { return v16_reduce_max(v16_exp_nonpositive(v16_set1(x))); }

/* One head's chunk results merged into its bf16 output, in chunk order (see the top): `partial` is the head's result
 * for the first chunk, `stride` floats before the next chunk's */
static void merge_chunks(const float *partial, int64_t chunks, int64_t stride, int64_t d, uint16_t *out) {
    float top = -INFINITY;
    for (int64_t c = 0; c < chunks; c++) top = partial[c * stride + d] > top ? partial[c * stride + d] : top;
    v16 acc[MAX_ATTENTION_HEAD_DIM / 16];
    int64_t lanes = d / 16;
    for (int64_t i = 0; i < lanes; i++) acc[i] = v16_zero();
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        const float *part = partial + c * stride;
        float w = exp_nonpositive1(part[d] - top);
        total += part[d + 1] * w;
        for (int64_t i = 0; i < lanes; i++) acc[i] = v16_fma(v16_load(part + 16 * i), v16_set1(w), acc[i]);
    }
    v16 norm = v16_set1(1.0f / total);
    for (int64_t i = 0; i < lanes; i++) v16_store_bf16(out + 16 * i, v16_mul(acc[i], norm));
}

static inline int64_t key_chunks(int64_t count) { return count > KEY_CHUNK ? (count + KEY_CHUNK - 1) / KEY_CHUNK : 1; }

/* the keys of chunk k of a row of `count` */
static inline int64_t chunk_keys(int64_t count, int64_t k) {
    return count - k * KEY_CHUNK < KEY_CHUNK ? count - k * KEY_CHUNK : KEY_CHUNK;
}

/* A unit of work: query heads [h, h + gs) of row r (the `part`-th group of KV head kv's) over the row's keys
 * [key, key + keys). chunk < 0: the unit is the row's whole softmax, the row's chunks one after another where it has
 * several, and writes the heads' outputs; `rows` > 1: the same for rows r .. r + rows - 1 together, chunk by chunk
 * (attend_rows); else it is chunk `chunk` of the row's `chunks` and writes its results at `at` in the call's shared
 * scratch, merged after the team's barrier. */
typedef struct {
    int64_t r, kv, part, h, gs, key, keys, chunk, chunks, at, rows;
} unit;

/* The call's inputs, as paged_attention takes them */
typedef struct {
    const uint16_t *q;
    const char *k_cache, *v_cache;
    const int64_t *slots, *offset, *count;
    int64_t q_stride, hq, hkv, d;
    float scale, softcap;
    int kv_int8;
    int64_t row_bytes; /* one (slot, KV head) row of a cache: 2 d bytes, or d + 4 with kv_int8 */
    uint16_t *out;
} call;

/* heads [h, h + gs) of row r over its keys [key, key + keys) -> out (gs, d) bf16, or partial (gs, PARTIAL(d)) */
static void attend(const call *c, int64_t r, int64_t kv, int64_t h, int64_t gs, int64_t key, int64_t keys,
                   float *scores, uint16_t *out, float *partial) {
    const uint16_t *q = c->q + r * c->q_stride + h * c->d;
    const char *kc = c->k_cache + kv * c->row_bytes, *vc = c->v_cache + kv * c->row_bytes;
    const int64_t *sl = c->slots + c->offset[r] + key, stride = c->hkv * c->row_bytes, d = c->d;
    const float sc = c->scale, cap = c->softcap;
#define ATTEND_GROUP(GS, KV8) attend_group(q, d, kc, vc, sl, keys, stride, d, sc, cap, scores, out, partial, GS, KV8)
    if (c->kv_int8) {
        switch (gs) {
            case 1: ATTEND_GROUP(1, 1); break;
            case 2: ATTEND_GROUP(2, 1); break;
            case 3: ATTEND_GROUP(3, 1); break;
            default: ATTEND_GROUP(4, 1); break;
        }
        return;
    }
    switch (gs) {
        case 1: ATTEND_GROUP(1, 0); break;
        case 2: ATTEND_GROUP(2, 0); break;
        case 3: ATTEND_GROUP(3, 0); break;
        default: ATTEND_GROUP(4, 0); break;
    }
#undef ATTEND_GROUP
}

/* A thread's units' key and value rows are asked into L2 (prefetcht1) up to PREFETCH_BYTES ahead of the unit in hand,
 * a row at a time. Why: a decode step finds each layer's cache cold (the step streams all the weights between two
 * visits of a layer), and the loops' own loads, a key at a time, kept too few lines in flight: 16 rows of 70 keys took
 * 3x as long cold as hot (`scripts/attention_speed.py --cold`; docs/decisions/0014-attention-key-chunks.md). Asking for each item's rows
 * just before it, or for the budget's rows in one tight loop, gained less than this, measured. */
#define PREFETCH_BYTES (512 << 10)
typedef struct {
    int64_t unit, key, bytes; /* the next row to ask for; the bytes asked for so far */
} prefetch_cursor;

/* asks for rows from the cursor on until `upto` bytes have been asked for, or the units up to `end` are all asked */
static void prefetch_rows(prefetch_cursor *cur, int64_t upto, int64_t end, const unit *units, const call *c) {
    while (cur->bytes < upto && cur->unit < end) {
        const unit *u = &units[cur->unit];
        if (u->part || cur->key >= u->keys) { /* a later part of the same rows, or the unit's rows done */
            cur->unit++, cur->key = 0;
            continue;
        }
        int64_t slot = c->slots[c->offset[u->r] + u->key + cur->key++], row = (slot * c->hkv + u->kv) * c->row_bytes;
        for (int64_t b = 0; b < c->row_bytes; b += 64) {
            _mm_prefetch(c->k_cache + row + b, _MM_HINT_T1);
            _mm_prefetch(c->v_cache + row + b, _MM_HINT_T1);
        }
        cur->bytes += 2 * c->row_bytes;
    }
}

/* A thread's asking ahead: its cursor, the bytes of the work it has begun, and where its units end */
typedef struct {
    prefetch_cursor cursor;
    int64_t used, end;
    const unit *units;
} asking;

/* Before `keys` of unit u's rows are read (the unit's, or one chunk's): rows asked for up to PREFETCH_BYTES past them.
 * A later part of a KV head's query heads reads the rows its first part read. */
static void ask_ahead(asking *a, const unit *u, int64_t keys, const call *c) {
    prefetch_rows(&a->cursor, a->used + PREFETCH_BYTES, a->end, a->units, c);
    a->used += u->part ? 0 : keys * 2 * c->row_bytes;
}

/* A whole row's unit: its softmax in one pass, or chunk by chunk into `own` (this thread's scratch) and merged. Rows
 * are asked for ahead of each chunk, as of each unit: a long row's were otherwise asked for only PREFETCH_BYTES in. */
static void attend_row(const call *c, const unit *u, float *scores, float *own, asking *ahead) {
    uint16_t *out = c->out + (u->r * c->hq + u->h) * c->d;
    if (u->chunks == 1) {
        ask_ahead(ahead, u, u->keys, c);
        attend(c, u->r, u->kv, u->h, u->gs, u->key, u->keys, scores, out, NULL);
        return;
    }
    int64_t each = u->gs * PARTIAL(c->d);
    for (int64_t k = 0; k < u->chunks; k++) {
        ask_ahead(ahead, u, chunk_keys(u->keys, k), c);
        attend(c, u->r, u->kv, u->h, u->gs, k * KEY_CHUNK, chunk_keys(u->keys, k), scores, NULL, own + k * each);
    }
    for (int64_t g = 0; g < u->gs; g++) merge_chunks(own + g * PARTIAL(c->d), u->chunks, each, c->d, out + g * c->d);
}

/* A block of consecutive rows' unit (`rows` > 1): chunk k of every row that has one, then chunk k + 1, ..., each
 * into `own` (row i's chunk k at (i * most + k) * each), then each row's chunks merged; a row of one chunk is computed
 * whole, as attend_row does it. Why: a prompt's rows see the same keys, so a chunk's keys and values (KEY_CHUNK rows
 * of both) stay in L2 for the block's rows instead of coming from L3 or memory for every row. Each row's numbers are
 * attend_row's: the same chunks, each computed alone, merged in chunk order. */
static void attend_rows(const call *c, const unit *u, float *scores, float *own, asking *ahead) {
    int64_t each = u->gs * PARTIAL(c->d), most = 1;
    for (int64_t i = 0; i < u->rows; i++) {
        int64_t chunks = key_chunks(c->count[u->r + i]);
        most = chunks > most ? chunks : most;
    }
    ask_ahead(ahead, u, u->keys, c);
    for (int64_t k = 0; k < most; k++)
        for (int64_t i = 0; i < u->rows; i++) {
            int64_t r = u->r + i, count = c->count[r], chunks = key_chunks(count);
            if (chunks == 1) {
                if (k == 0)
                    attend(c, r, u->kv, u->h, u->gs, 0, count, scores, c->out + (r * c->hq + u->h) * c->d, NULL);
                continue;
            }
            if (k < chunks)
                attend(c, r, u->kv, u->h, u->gs, k * KEY_CHUNK, chunk_keys(count, k), scores, NULL,
                       own + (i * most + k) * each);
        }
    for (int64_t i = 0; i < u->rows; i++) {
        int64_t r = u->r + i, chunks = key_chunks(c->count[r]);
        if (chunks == 1) continue;
        for (int64_t g = 0; g < u->gs; g++)
            merge_chunks(own + i * most * each + g * PARTIAL(c->d), chunks, each, c->d,
                         c->out + (r * c->hq + u->h + g) * c->d);
    }
}

/* The call's units into units (NULL: only counted): (row, KV head, part of its query heads of `size`), each whole,
 * or with `split` each chunk of a row over KEY_CHUNK keys a unit of its own. Returns how many, and in *scratch how
 * many heads' chunk results (PARTIAL(d) floats each) the chunk units write to the shared scratch. */
static int64_t plan_units(const int64_t *offset, const int64_t *count, int64_t rows, int64_t hq, int64_t hkv,
                          int64_t size, int split, int64_t block, unit *units, int64_t *scratch) {
    int64_t group = hq / hkv, n = 0, at = 0, nr;
    for (int64_t r = 0; r < rows; r += nr) {
        /* a block: up to `block` rows that follow one another in one prompt (each sees what the last saw, and one
         * more key; a window's start moves by one at most), so they read the same keys */
        for (nr = 1; nr < block && r + nr < rows; nr++) {
            int64_t moved = offset[r + nr] - offset[r + nr - 1], grew = count[r + nr] - count[r + nr - 1];
            if (moved < 0 || moved > 1 || grew < 0 || grew > 1) break;
        }
        for (int64_t kv = 0; kv < hkv; kv++)
            for (int64_t part = 0; part * size < group; part++) {
                int64_t h = kv * group + part * size, gs = group - part * size < size ? group - part * size : size;
                int64_t chunks = key_chunks(count[r]);
                if (!split || chunks == 1) {
                    if (units) units[n] = (unit){r, kv, part, h, gs, 0, count[r], -1, chunks, 0, nr};
                    n++;
                    continue;
                }
                for (int64_t k = 0; k < chunks; k++, n++) {
                    int64_t keys = chunk_keys(count[r], k);
                    if (units) units[n] = (unit){r, kv, part, h, gs, k * KEY_CHUNK, keys, k, chunks, at, 1};
                    at += gs;
                }
            }
    }
    *scratch = at;
    return n;
}

/* q (rows, hq, d) with row stride q_stride; caches (slots, hkv, d); out (rows, hq, d) contiguous. Returns 0, or -1
 * for an unsupported head size or no memory for the work's plan. */
int paged_attention(const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    const int64_t *slots, const int64_t *offset, const int64_t *count, int64_t rows, int64_t hq,
                    int64_t hkv, int64_t d, float scale, float softcap, int kv_int8, uint16_t *out, int threads) {
    if (d % 16 || d > MAX_ATTENTION_HEAD_DIM || hq % hkv || (kv_int8 && d % KV_INT8_BLOCK)) return -1;
    const int64_t row_bytes = kv_int8 ? d + 2 * d / KV_INT8_BLOCK : 2 * d;
    const call c = {q, k_cache, v_cache, slots, offset, count, q_stride, hq, hkv, d, scale, softcap, kv_int8,
                    row_bytes, out};
    /* Work for every thread: rows' whole softmaxes where they share out evenly (GROUP query heads a KV head
     * together, sharing their loads); else, with a few rows (a single stream's step has one row, and Gemma 3 one KV
     * head; three rows on two threads left one idle half the time), long rows' chunks apart, and a KV head's query
     * heads in smaller groups until the units would not leave a thread idle. Neither changes a head's numbers. */
    int64_t size = GROUP, need = 0, longest = 1, group = hq / hkv;
    int64_t items = rows * hkv * ((group + GROUP - 1) / GROUP);
    int split = items < threads || (items < 4 * threads && items % threads);
    for (int64_t r = 0; r < rows; r++) longest = count[r] > longest ? count[r] : longest;
    /* a prompt's rows over several chunks of keys: blocks of up to ROW_BLOCK of them (attend_rows), where there are
     * enough blocks to share out */
    int64_t block = !split && key_chunks(longest) > 1 ? ROW_BLOCK : 1;
    int64_t n = plan_units(offset, count, rows, hq, hkv, size, split, block, NULL, &need);
    if (block > 1 && n < 4 * threads) /* too few blocks to share out: rows one at a time */
        n = plan_units(offset, count, rows, hq, hkv, size, split, block = 1, NULL, &need);
    while (n < threads && size > 1)
        n = plan_units(offset, count, rows, hq, hkv, size /= 2, split, block, NULL, &need);
    unit *units = malloc((size_t)n * sizeof *units);
    float *shared = need ? malloc((size_t)(need * PARTIAL(d)) * sizeof *shared) : NULL;
    if (units == NULL || (need && shared == NULL)) {
        free(units);
        free(shared);
        return -1;
    }
    plan_units(offset, count, rows, hq, hkv, size, split, block, units, &need);
    /* a whole row's chunks (a block's rows' chunks), where a row has several and its units are whole rows */
    int64_t own_floats = !split && key_chunks(longest) > 1 ? block * key_chunks(longest) * GROUP * PARTIAL(d) : 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float scores[GROUP * (KEY_CHUNK + 16)];
        float *own = own_floats ? malloc((size_t)own_floats * sizeof *own) : NULL;
        if (own_floats && own == NULL) failed = 1;
        /* this thread's units, as schedule(static) deals them (one run of consecutive units), with their cache rows
         * asked for ahead of them */
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t first = n * me / team, end = n * (me + 1) / team;
        asking ahead = {{first, 0, 0}, 0, end, units};
        for (int64_t i = first; i < end && !failed; i++) {
            const unit *u = &units[i];
            if (u->chunk < 0) {
                if (u->rows > 1)
                    attend_rows(&c, u, scores, own, &ahead);
                else
                    attend_row(&c, u, scores, own, &ahead);
                continue;
            }
            ask_ahead(&ahead, u, u->keys, &c);
            attend(&c, u->r, u->kv, u->h, u->gs, u->key, u->keys, scores, NULL, shared + u->at * PARTIAL(d));
        }
        free(own);
        if (need) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) { /* each chunked row's first chunk unit merges its heads */
                const unit *u = &units[i];
                if (u->chunk != 0) continue;
                for (int64_t g = 0; g < u->gs; g++)
                    merge_chunks(shared + (u->at + g) * PARTIAL(d), u->chunks, u->gs * PARTIAL(d), d,
                                 out + (u->r * hq + u->h + g) * d);
            }
        }
    }
    free(units);
    free(shared);
    return failed ? -1 : 0;
}

/* x's d bf16 values -> row's d int8 codes, then d / 32 float16 scales: per block of 32, scale = max |x| / 127 rounded to
 * float16 (nearest even), code = x / scale rounded to nearest even and kept within +-127 (0 where the scale is 0) */
void kv_quantize_rows(const uint16_t *src, int64_t heads, int64_t d, int8_t *dst) {
    for (int64_t h = 0; h < heads; h++) {
        const uint16_t *x = src + h * d;
        int8_t *row = dst + h * (d + 2 * d / KV_INT8_BLOCK);
        for (int64_t b = 0; b < d / KV_INT8_BLOCK; b++) {
            const uint16_t *xb = x + b * KV_INT8_BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < KV_INT8_BLOCK; i++) {
                float a = fabsf(bf16_to_float(xb[i]));
                amax = a > amax ? a : amax;
            }
            uint16_t half = _cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT);
            float scale = _cvtsh_ss(half);
            for (int i = 0; i < KV_INT8_BLOCK; i++) {
                float code = scale > 0.0f ? nearbyintf(bf16_to_float(xb[i]) / scale) : 0.0f;
                row[b * KV_INT8_BLOCK + i] = (int8_t)(code > 127.0f ? 127.0f : code < -127.0f ? -127.0f : code);
            }
            memcpy(row + d + 2 * b, &half, sizeof half);
        }
    }
}

#else /* neither AVX-512 nor AVX2 + FMA, or no OpenMP: attention.py keeps its torch path */
int paged_attention_available(void) { return 0; }
int paged_attention(const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    const int64_t *slots, const int64_t *offset, const int64_t *count, int64_t rows, int64_t hq,
                    int64_t hkv, int64_t d, float scale, float softcap, int kv_int8, uint16_t *out, int threads) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)slots, (void)offset, (void)count, (void)rows;
    (void)hq, (void)hkv, (void)d, (void)scale, (void)softcap, (void)kv_int8, (void)out, (void)threads;
    return -1;
}
void kv_quantize_rows(const uint16_t *src, int64_t heads, int64_t d, int8_t *dst) {
    (void)src, (void)heads, (void)d, (void)dst;
}
#endif
