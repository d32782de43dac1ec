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

int gemma3_layer(const decoder_layer_plan *p, const uint16_t *x, uint16_t *out, int64_t t, const uint16_t *cos,
                 const uint16_t *signed_sin, uint16_t *k_cache, uint16_t *v_cache, const int64_t *slot_mapping,
                 const int64_t *slots, const int64_t *offset, const int64_t *count, int threads) {
    const int64_t hidden = p->hidden, d = p->head_dim, hq = p->heads, hkv = p->kv_heads, ffn = p->ffn;
    const int64_t qkv_width = p->qkv.n, heads = hq + hkv;
    if (p->qkv.n != (hq + 2 * hkv) * d || p->o.k != hq * d || p->gate_up.n != 2 * ffn || p->down.k != ffn) return -1;
    /* h: the normed input, then o's product, then the normed input again, then down's product; the rest one each */
    size_t rows = (size_t)t, elems = rows * (size_t)(hidden + qkv_width + heads * d + hq * d + 3 * ffn);
    uint16_t *h = malloc(elems * sizeof *h);
    if (h == NULL) return -2;
    uint16_t *qkv = h + rows * hidden, *qk = qkv + rows * qkv_width, *attn = qk + rows * heads * d;
    uint16_t *gate_up = attn + rows * hq * d, *act = gate_up + rows * 2 * ffn;
    int status = 0;

    rms_norm(x, hidden, p->input_norm, h, t, hidden, p->eps);
    if ((status = project(&p->qkv, h, t, qkv, threads))) goto done;
    norm_rotary(qkv, qkv_width, p->qk_factor, cos, signed_sin, qk, t, heads, d, p->eps);
    for (int64_t r = 0; r < t; r++) { /* paged_attention.py's index_copy_ of k and v into the cache */
        size_t row = (size_t)(hkv * d) * sizeof *h;
        memcpy(k_cache + slot_mapping[r] * hkv * d, qk + (r * heads + hq) * d, row);
        memcpy(v_cache + slot_mapping[r] * hkv * d, qkv + r * qkv_width + heads * d, row);
    }
    if (paged_attention(qk, heads * d, k_cache, v_cache, slots, offset, count, t, hq, hkv, d, p->scale, p->softcap,
                        attn, threads)) {
        status = -1;
        goto done;
    }
    if ((status = project(&p->o, attn, t, h, threads))) goto done;
    add_rms_norm(x, h, p->post_attention_norm, out, t, hidden, p->eps);
    rms_norm(out, hidden, p->pre_feedforward_norm, h, t, hidden, p->eps);
    if ((status = project(&p->gate_up, h, t, gate_up, threads))) goto done;
    gelu_mul(gate_up, 2 * ffn, t, ffn, act, threads);
    if ((status = project(&p->down, act, t, h, threads))) goto done;
    add_rms_norm(out, h, p->post_feedforward_norm, out, t, hidden, p->eps); /* row by row, each read before written */
done:
    free(h);
    return status;
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
int llama_layer(const decoder_layer_plan *p, const uint16_t *x, uint16_t *out, int64_t t, const uint16_t *cos,
                const uint16_t *signed_sin, uint16_t *k_cache, uint16_t *v_cache, const int64_t *slot_mapping,
                const int64_t *slots, const int64_t *offset, const int64_t *count, int threads) {
    const int64_t hidden = p->hidden, d = p->head_dim, hq = p->heads, hkv = p->kv_heads, ffn = p->ffn;
    const int64_t qkv_width = p->qkv.n, heads = hq + hkv;
    if (p->qkv.n != (hq + 2 * hkv) * d || p->o.k != hq * d || p->gate_up.n != 2 * ffn || p->down.k != ffn) return -1;
    size_t rows = (size_t)t, elems = rows * (size_t)(hidden + qkv_width + heads * d + hq * d + 3 * ffn);
    uint16_t *h = malloc(elems * sizeof *h);
    if (h == NULL) return -2;
    uint16_t *qkv = h + rows * hidden, *qk = qkv + rows * qkv_width, *attn = qk + rows * heads * d;
    uint16_t *gate_up = attn + rows * hq * d, *act = gate_up + rows * 2 * ffn;
    int status = 0;

    weighted_rms_norm(x, hidden, p->input_norm, h, t, hidden, p->eps);
    if ((status = project(&p->qkv, h, t, qkv, threads))) goto done;
    if (p->qkv_bias != NULL) add_rows(qkv, qkv_width, p->qkv_bias, 0, qkv, t, qkv_width);
    rotary(qkv, qkv_width, cos, signed_sin, qk, t, heads, d);
    for (int64_t r = 0; r < t; r++) { /* paged_attention.py's index_copy_ of k and v into the cache */
        size_t row = (size_t)(hkv * d) * sizeof *h;
        memcpy(k_cache + slot_mapping[r] * hkv * d, qk + (r * heads + hq) * d, row);
        memcpy(v_cache + slot_mapping[r] * hkv * d, qkv + r * qkv_width + heads * d, row);
    }
    if (paged_attention(qk, heads * d, k_cache, v_cache, slots, offset, count, t, hq, hkv, d, p->scale, p->softcap,
                        attn, threads)) {
        status = -1;
        goto done;
    }
    if ((status = project(&p->o, attn, t, h, threads))) goto done;
    add_rows(x, hidden, h, hidden, out, t, hidden);
    weighted_rms_norm(out, hidden, p->post_attention_norm, h, t, hidden, p->eps);
    if ((status = project(&p->gate_up, h, t, gate_up, threads))) goto done;
    silu_mul(gate_up, 2 * ffn, t, ffn, act, threads);
    if ((status = project(&p->down, act, t, h, threads))) goto done;
    add_rows(out, hidden, h, hidden, out, t, hidden);
done:
    free(h);
    return status;
}
