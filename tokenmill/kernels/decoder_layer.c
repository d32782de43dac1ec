/* One Gemma 3 decoder layer (gemma3_layer) or one Llama-family layer (llama_layer) on the bf16 + GGUF path, as one
 * call: the same kernels, in the same order, with the same arguments as gemma3.py's and llama.py's modules call them
 * one by one from Python, so the same bits.
 *
 * Why: a decode step runs the layer's dozen kernels for every layer, and around each Python's module calls, tensor
 * views, allocations and a ctypes call cost more than a small kernel itself (a tenth of a batch-1 step on the default
 * model, profiled). Here Python makes one call per layer and the kernels run back to back.
 *
 * The layer, as Gemma3DecoderLayer.forward computes it (x: the residual stream, T rows of `hidden`):
 *   h = rms_norm(x, input_norm); qkv = h @ Wqkv; (q, k) = norm_rotary(qkv's q and k heads, qk_factor, cos, sin);
 *   the step's k and v rows written to their cache slots; a = paged_attention(q, caches, the rows' key lists);
 *   x = x + rms_norm(a @ Wo, post_attention_norm); h = rms_norm(x, pre_feedforward_norm);
 *   x = x + rms_norm(down(gelu_mul(h @ Wgate_up)), post_feedforward_norm).
 * The plan (decoder_layer_plan, kernels.h) holds what does not change between steps: shapes, norm factors, and each
 * projection's parts as GgufLinear keeps them (a type, its regrouped blocks, its columns of the output).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

int64_t decoder_layer_plan_bytes(void) { return (int64_t)sizeof(decoder_layer_plan); }

/* out (t, linear->n) bf16 = x (t, linear->k) @ the parts, each into its own columns (GgufLinear.forward) */
static int project(const gguf_linear *linear, const uint16_t *x, int64_t t, uint16_t *out, int threads) {
    for (int64_t i = 0; i < linear->parts; i++) {
        const gguf_part *p = &linear->part[i];
        int status = gguf_matmul(x, linear->k, t, linear->k, (int)p->type, p->packed, p->n, out + p->at, linear->n, 0,
                                 threads);
        if (status) return status;
    }
    return 0;
}

/* act (t, ffn) bf16 = the gated MLP's activations of x (t, gate_up.k): gelu_tanh (gelu != 0) or silu of the gate's
 * products times the up's. Where gate_up is one part (both halves of one type) the product and the activation are one
 * pass (gguf_matmul_gated); otherwise the products go to `products` (t, 2 ffn) and the activation is a pass of its
 * own. The same bits either way. Adapters' updates of gate_up (`lora`) are added to the products before the
 * activation: in the one pass where a step has few rows (their sums made first, LORA_FUSED_ROWS), else in the
 * products before the activation's pass; the same bits either way too. */
#define LORA_FUSED_ROWS 64
static int gated_mlp(const gguf_linear *gate_up, const uint16_t *x, int64_t t, int64_t ffn, uint16_t *products,
                     uint16_t *act, int gelu, const lora_step *lora, int64_t layer, int threads) {
    const gguf_part *p = &gate_up->part[0];
    const int adapted = lora_has(lora, layer, 2); /* adapters' updates go between the products and the activation */
    int status;
    if (gate_up->parts == 1 && p->at == 0 && p->n == 2 * ffn && !adapted) {
        status = gguf_matmul_gated(x, gate_up->k, t, gate_up->k, (int)p->type, p->packed, ffn, act, ffn, gelu, threads);
        if (status != -1) return status; /* -1: an ffn that is not a multiple of 16, or no activation kernels */
    }
    if (gate_up->parts == 1 && p->at == 0 && p->n == 2 * ffn && adapted && t <= LORA_FUSED_ROWS) {
        /* the updates' sums first, then added in the same pass as the products and the activation */
        float *delta = malloc((size_t)(t * 2 * ffn) * sizeof(float));
        uint8_t *added = calloc((size_t)t, 1);
        status = -2;
        if (delta != NULL && added != NULL) {
            lora_deltas(lora, layer, 2, x, gate_up->k, delta, 2 * ffn, added, threads);
            status = gguf_matmul_gated_added(x, gate_up->k, t, gate_up->k, (int)p->type, p->packed, ffn, act, ffn,
                                             gelu, delta, added, threads);
        }
        free(delta);
        free(added);
        if (status != -1) return status;
    }
    status = project(gate_up, x, t, products, threads);
    if (status) return status;
    lora_add(lora, layer, 2, x, gate_up->k, products, 2 * ffn, threads);
    (gelu ? gelu_mul : silu_mul)(products, 2 * ffn, t, ffn, act, threads);
    return 0;
}

/* A layer's scratch rows, one allocation (h first, the rest after it): h holds the normed input, then o's
 * product, then the normed input again, then down's product */
typedef struct {
    uint16_t *h, *qkv, *qk, *attn, *gate_up, *act;
} layer_scratch;

/* 0, or -1 where the plan's shapes disagree, -2 without memory */
static int scratch_for(const decoder_layer_plan *p, int64_t t, layer_scratch *s) {
    const int64_t hidden = p->hidden, d = p->head_dim, hq = p->heads, hkv = p->kv_heads, ffn = p->ffn;
    if (p->qkv.n != (hq + 2 * hkv) * d || p->o.k != hq * d || p->gate_up.n != 2 * ffn || p->down.k != ffn) return -1;
    size_t rows = (size_t)t, elems = rows * (size_t)(hidden + p->qkv.n + (hq + hkv) * d + hq * d + 3 * ffn);
    if ((s->h = malloc(elems * sizeof *s->h)) == NULL) return -2;
    s->qkv = s->h + rows * hidden;
    s->qk = s->qkv + rows * p->qkv.n;
    s->attn = s->qk + rows * (hq + hkv) * d;
    s->gate_up = s->attn + rows * hq * d;
    s->act = s->gate_up + rows * 2 * ffn;
    return 0;
}

/* The step's k (rotated, in qk) and v (in qkv) rows to their cache slots (attention.py's index_copy_), then
 * attention of the rotated q rows into s->attn */
static int attend(const decoder_layer_plan *p, const layer_scratch *s, int64_t t, void *k_cache, void *v_cache,
                  const int64_t *slot_mapping, const int64_t *slots, const int64_t *offset, const int64_t *count,
                  int threads) {
    const int64_t d = p->head_dim, hq = p->heads, hkv = p->kv_heads, heads = hq + hkv;
    const size_t row = (size_t)(hkv * d) * sizeof *s->h;
    const size_t slot = p->kv_int8 ? (size_t)(hkv * (d + 2 * d / KV_INT8_BLOCK)) : row; /* kv_quantize_rows' rows */
    for (int64_t r = 0; r < t; r++) {
        const uint16_t *k = s->qk + (r * heads + hq) * d, *v = s->qkv + r * p->qkv.n + heads * d;
        char *kc = (char *)k_cache + slot_mapping[r] * slot, *vc = (char *)v_cache + slot_mapping[r] * slot;
        if (p->kv_int8) {
            kv_quantize_rows(k, hkv, d, (int8_t *)kc);
            kv_quantize_rows(v, hkv, d, (int8_t *)vc);
        } else {
            memcpy(kc, k, row);
            memcpy(vc, v, row);
        }
    }
    return paged_attention(s->qk, heads * d, k_cache, v_cache, slots, offset, count, t, hq, hkv, d, p->scale,
                           p->softcap, p->kv_int8, s->attn, threads)
               ? -1
               : 0;
}

/* The row-wise kernels between the products (the norms, q/k norm and rotary, the residual adds) take the rows in
 * parallel where a step has a few: each row is computed as it would be alone, so the same bits. On one core they
 * were a twentieth of a 16-row step's layer, the other core waiting. */
#define PARALLEL_ROWS 4
#if defined(_OPENMP)
#define ROWS_IN_PARALLEL _Pragma("omp parallel for schedule(static) num_threads(threads) if (t >= PARALLEL_ROWS)")
#else
#define ROWS_IN_PARALLEL
#endif

/* the layer, with the updates of the adapters of the step's rows where `lora` is not NULL (it is layer `layer` of
 * the stack) */
static int gemma3_adapted(const decoder_layer_plan *p, const uint16_t *x, uint16_t *out, int64_t t, const uint16_t *cos,
                          const uint16_t *signed_sin, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                          const int64_t *slots, const int64_t *offset, const int64_t *count, const lora_step *lora,
                          int64_t layer, int threads) {
    const int64_t hidden = p->hidden, ffn = p->ffn;
    layer_scratch s;
    int status = scratch_for(p, t, &s);
    if (status) return status;

    const int64_t heads = p->heads + p->kv_heads, d = p->head_dim;
    ROWS_IN_PARALLEL
    for (int64_t r = 0; r < t; r++) rms_norm(x + r * hidden, hidden, p->input_norm, s.h + r * hidden, 1, hidden, p->eps);
    if ((status = project(&p->qkv, s.h, t, s.qkv, threads))) goto done;
    lora_add(lora, layer, 0, s.h, hidden, s.qkv, p->qkv.n, threads);
    ROWS_IN_PARALLEL
    for (int64_t r = 0; r < t; r++)
        norm_rotary(s.qkv + r * p->qkv.n, p->qkv.n, p->qk_factor, cos + r * d, signed_sin + r * d, s.qk + r * heads * d,
                    1, heads, d, p->eps);
    if ((status = attend(p, &s, t, k_cache, v_cache, slot_mapping, slots, offset, count, threads))) goto done;
    if ((status = project(&p->o, s.attn, t, s.h, threads))) goto done;
    lora_add(lora, layer, 1, s.attn, p->o.k, s.h, hidden, threads);
    ROWS_IN_PARALLEL
    for (int64_t r = 0; r < t; r++) {
        const int64_t at = r * hidden;
        add_rms_norm(x + at, s.h + at, p->post_attention_norm, out + at, 1, hidden, p->eps);
        rms_norm(out + at, hidden, p->pre_feedforward_norm, s.h + at, 1, hidden, p->eps);
    }
    if ((status = gated_mlp(&p->gate_up, s.h, t, ffn, s.gate_up, s.act, 1, lora, layer, threads))) goto done;
    if ((status = project(&p->down, s.act, t, s.h, threads))) goto done;
    lora_add(lora, layer, 3, s.act, ffn, s.h, hidden, threads);
    ROWS_IN_PARALLEL
    for (int64_t r = 0; r < t; r++) /* in place: a row is read before it is written */
        add_rms_norm(out + r * hidden, s.h + r * hidden, p->post_feedforward_norm, out + r * hidden, 1, hidden, p->eps);
done:
    free(s.h);
    return status;
}

int gemma3_layer(const decoder_layer_plan *p, const uint16_t *x, uint16_t *out, int64_t t, const uint16_t *cos,
                 const uint16_t *signed_sin, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                 const int64_t *slots, const int64_t *offset, const int64_t *count, int threads) {
    return gemma3_adapted(p, x, out, t, cos, signed_sin, k_cache, v_cache, slot_mapping, slots, offset, count, NULL, 0,
                          threads);
}

/* out = bf16(a + b) row by row, b's row repeated when b_stride is 0 (a bias): torch's bf16 add */
static void add_rows(const uint16_t *a, int64_t a_stride, const uint16_t *b, int64_t b_stride, uint16_t *out,
                     int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *ar = a + r * a_stride, *br = b + r * b_stride;
        uint16_t *o = out + r * a_stride;
        for (int64_t i = 0; i < dim; i++) o[i] = float_to_bf16(bf16_to_float(ar[i]) + bf16_to_float(br[i]));
    }
}

/* One Llama-family layer without q/k norms (Llama 2/3, Mistral, Qwen2, Phi-3), as LlamaDecoderLayer.forward computes
 * it: h = weighted_rms_norm(x, input_norm); qkv = h @ Wqkv (+ bias); (q, k) = rotary(qkv's q and k heads, cos, sin);
 * the step's k and v rows to their cache slots; a = paged_attention(q, ...); x = x + a @ Wo;
 * x = x + down(silu_mul(weighted_rms_norm(x, post_attention_norm) @ Wgate_up)). */
static int llama_adapted(const decoder_layer_plan *p, const uint16_t *x, uint16_t *out, int64_t t, const uint16_t *cos,
                         const uint16_t *signed_sin, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                         const int64_t *slots, const int64_t *offset, const int64_t *count, const lora_step *lora,
                         int64_t layer, int threads) {
    const int64_t hidden = p->hidden, ffn = p->ffn;
    layer_scratch s;
    int status = scratch_for(p, t, &s);
    if (status) return status;

    weighted_rms_norm(x, hidden, p->input_norm, s.h, t, hidden, p->eps);
    if ((status = project(&p->qkv, s.h, t, s.qkv, threads))) goto done;
    lora_add(lora, layer, 0, s.h, hidden, s.qkv, p->qkv.n, threads);
    if (p->qkv_bias != NULL) add_rows(s.qkv, p->qkv.n, p->qkv_bias, 0, s.qkv, t, p->qkv.n);
    rotary(s.qkv, p->qkv.n, cos, signed_sin, s.qk, t, p->heads + p->kv_heads, p->head_dim);
    if ((status = attend(p, &s, t, k_cache, v_cache, slot_mapping, slots, offset, count, threads))) goto done;
    if ((status = project(&p->o, s.attn, t, s.h, threads))) goto done;
    lora_add(lora, layer, 1, s.attn, p->o.k, s.h, hidden, threads);
    add_rows(x, hidden, s.h, hidden, out, t, hidden);
    weighted_rms_norm(out, hidden, p->post_attention_norm, s.h, t, hidden, p->eps);
    if ((status = gated_mlp(&p->gate_up, s.h, t, ffn, s.gate_up, s.act, 0, lora, layer, threads))) goto done;
    if ((status = project(&p->down, s.act, t, s.h, threads))) goto done;
    lora_add(lora, layer, 3, s.act, ffn, s.h, hidden, threads);
    add_rows(out, hidden, s.h, hidden, out, t, hidden);
done:
    free(s.h);
    return status;
}

int llama_layer(const decoder_layer_plan *p, const uint16_t *x, uint16_t *out, int64_t t, const uint16_t *cos,
                const uint16_t *signed_sin, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                const int64_t *slots, const int64_t *offset, const int64_t *count, int threads) {
    return llama_adapted(p, x, out, t, cos, signed_sin, k_cache, v_cache, slot_mapping, slots, offset, count, NULL, 0,
                         threads);
}

/* A step's whole stack of layers in one call: layer i runs as gemma3_layer (gemma != 0) or llama_layer would from
 * Python, reading the previous layer's output, with the cos / sin and key lists of its kind (kinds->..[layers[i].kind]:
 * Gemma 3's sliding-window layers and its global ones differ in both). Why: per layer, Python's module call, its
 * views and a ctypes call of 13 arguments cost a few percent of a single stream's step on the default model. The
 * outputs alternate between `out` and `spare` (t rows of hidden each), so that the last layer's lands in `out`. Where
 * kinds->lora is not NULL, each layer adds the updates of the adapters of the step's rows (lora.c).
 * Returns the first failing layer's status. */
int decoder_stack(int gemma, const stack_layer *layers, int64_t n, const stack_kinds *kinds, const uint16_t *x,
                  uint16_t *out, uint16_t *spare, int64_t t, const int64_t *slot_mapping, int threads) {
    const uint16_t *in = x;
    for (int64_t i = 0; i < n; i++) {
        const stack_layer *l = &layers[i];
        int64_t k = l->kind;
        if (k < 0 || k >= STACK_KINDS) return -1;
        uint16_t *dst = (n - 1 - i) % 2 == 0 ? out : spare;
        int status = (gemma ? gemma3_adapted : llama_adapted)(
            l->plan, in, dst, t, kinds->cos[k], kinds->signed_sin[k], l->k_cache, l->v_cache, slot_mapping,
            kinds->slots[k], kinds->offset[k], kinds->count[k], kinds->lora, i, threads);
        if (status) return status;
        in = dst;
    }
    return 0;
}

/* x: the embedding's rows of `ids` (rows checked in range), in bf16, times bf16(scale) where scale != 0: GgufEmbedding's
 * float32 rows cast to bf16, then Gemma's `x * tensor(scale, bf16)` (float product, rounded) */
static int embed_rows(const forward_plan *f, const int64_t *ids, int64_t t, int64_t hidden, uint16_t *x) {
    for (int64_t r = 0; r < t; r++)
        if (ids[r] < 0 || ids[r] >= f->embed_rows) return -3;
    float *rows = malloc((size_t)(t * hidden) * sizeof(float));
    if (!rows) return -2;
    int status = gguf_dequantize_rows((int)f->embed_type, f->embed, hidden, ids, t, rows);
    const float scale = bf16_to_float(float_to_bf16(f->embed_scale));
    for (int64_t i = 0; !status && i < t * hidden; i++) {
        bf16 v = float_to_bf16(rows[i]);
        x[i] = f->embed_scale != 0.0f ? float_to_bf16(bf16_to_float(v) * scale) : v;
    }
    free(rows);
    return status ? -1 : 0;
}

int decoder_forward(int gemma, const forward_plan *f, const stack_layer *layers, int64_t n, const stack_kinds *kinds,
                    const int64_t *ids, const int64_t *positions, uint16_t *x, uint16_t *out, uint16_t *spare,
                    int64_t t, const int64_t *slot_mapping, greedy_head *head, int threads) {
    if (n < 1) return -1;
    const int64_t hidden = layers[0].plan->hidden, head_dim = layers[0].plan->head_dim;
    int status = embed_rows(f, ids, t, hidden, x);
    if (status) return status;
    stack_kinds step = *kinds; /* the key lists as given; each kind's rotary rows picked from its tables */
    uint16_t *rope = malloc((size_t)(2 * STACK_KINDS * t * head_dim) * sizeof(uint16_t));
    if (!rope) return -2;
    for (int k = 0; k < STACK_KINDS; k++) {
        uint16_t *cos = rope + 2 * k * t * head_dim, *sin = cos + t * head_dim;
        step.cos[k] = cos, step.signed_sin[k] = sin;
        if (!f->cos[k]) continue; /* a kind no layer uses */
        for (int64_t r = 0; r < t && !status; r++) {
            if (positions[r] < 0 || positions[r] >= f->rope_rows[k]) {
                status = -3;
                break;
            }
            memcpy(cos + r * head_dim, f->cos[k] + positions[r] * head_dim, (size_t)head_dim * sizeof(uint16_t));
            memcpy(sin + r * head_dim, f->signed_sin[k] + positions[r] * head_dim, (size_t)head_dim * sizeof(uint16_t));
        }
    }
    if (!status) status = decoder_stack(gemma, layers, n, &step, x, out, spare, t, slot_mapping, threads);
    free(rope);
    if (status) return status;
    /* the final norm, into x (the stack no longer reads it) */
    if (f->norm_weighted)
        weighted_rms_norm(out, hidden, f->norm, x, t, hidden, f->norm_eps);
    else
        rms_norm(out, hidden, f->norm, x, t, hidden, f->norm_eps);
    /* the last row's greedy head, without going back to Python between the two (the caller reads its status) */
    if (head)
        head->status = gguf_greedy_row(x + (t - 1) * hidden, hidden, head->high6, head->w, head->n, head->keep,
                                       head->kept, head->out, &head->argmax, threads);
    return 0;
}

