/* What the C kernels and their Python side (tokenmill/kernels/ops.py, build.py) share: every exported function's
 * prototype and the size limits both sides check. The single truth for both:
 * - each .c file includes this header, so the compiler rejects a definition that drifts from its prototype;
 * - build.py reads the #defines below at import (a `#define NAME <integer>` per line), and
 *   tests/kernels/test_signatures.py checks build.py's ctypes table against these prototypes.
 * bfloat16 tensors are passed as uint16_t pointers (their bits); every pointer is a ctypes c_void_p on the Python side.
 */
#ifndef TOKENMILL_KERNELS_H
#define TOKENMILL_KERNELS_H
#include <stdint.h>

/* norm_rotary's largest head: its per-head float32 buffer lives on the stack (fused.c) */
#define MAX_HEAD_DIM 1024
/* paged_attention's largest head: the query heads of a group are held in registers (paged_attention.c) */
#define MAX_ATTENTION_HEAD_DIM 512
/* paged_attention's keys per chunk: a row over this many keys is computed chunk by chunk (paged_attention.c) */
#define ATTENTION_KEY_CHUNK 256
/* int8_matmul's weight tiles: output columns per tile, and the multiple its input width must be (int8_matmul.c) */
#define INT8_MATMUL_TILE 64
#define INT8_MATMUL_K_MULTIPLE 32
/* gguf_matmul's activation blocks: bytes per 32 inputs of a row quantised by gguf_quantize_rows (gguf_quantize.c) */
#define GGUF_XBLOCK_BYTES 48
/* gguf_matmul's output columns per regrouped group: a tensor's parts regrouped one after another join up only where
 * each but the last fills whole groups */
#define GGUF_GROUP 16
/* gguf_repack's own layout of a Q8_0 tensor's codes less their two low bits, for gguf_greedy_row (not a ggml type) */
#define GGUF_Q8_0_HIGH6 100

/* fused.c: the norms and q/k norm + rotary, row by row (always compiled in) */
void rms_norm(const uint16_t *x, int64_t stride, const float *factor, uint16_t *out, int64_t rows, int64_t dim,
              float eps);
void add_rms_norm(const uint16_t *residual, const uint16_t *y, const float *factor, uint16_t *out, int64_t rows,
                  int64_t dim, float eps);
void norm_rotary(const uint16_t *x, int64_t stride, const float *factor, const uint16_t *cos,
                 const uint16_t *signed_sin, uint16_t *out, int64_t rows, int64_t heads, int64_t dim, float eps);
void weighted_rms_norm(const uint16_t *x, int64_t stride, const float *weight, uint16_t *out, int64_t rows,
                       int64_t dim, float eps);
void rotary(const uint16_t *x, int64_t stride, const uint16_t *cos, const uint16_t *signed_sin, uint16_t *out,
            int64_t rows, int64_t heads, int64_t dim);

/* The threaded kernels: each says whether it was compiled in (1) or is a stub (0) that returns -1 or does nothing,
 * as its CPU features and OpenMP were or were not there at compile time. */
int int8_matmul_available(void);
int int8_matmul(const uint16_t *x, int64_t m, int64_t k, const int8_t *tiles, const float *scale, int64_t n,
                void *out, int float_out, int threads);

int gguf_matmul_available(void);
int gguf_quantize_rows(const uint16_t *x, int64_t stride, int64_t m, int64_t k, void *out, int threads);
int64_t gguf_packed_bytes(int type, int64_t n, int64_t k);
int gguf_dequantize_rows(int type, const uint8_t *table, int64_t k, const int64_t *ids, int64_t n, float *out);
int gguf_repack(int type, const uint8_t *w, int64_t n, int64_t k, uint8_t *out, int threads);
int gguf_repack_all(int64_t count, const int *types, const uint8_t *const *ws, const int64_t *ns, const int64_t *ks,
                    uint8_t *const *outs, const int64_t *release, int threads);
int gguf_matmul(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w, int64_t n,
                void *out, int64_t ldo, int float_out, int threads);
int gguf_matmul_gated(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w,
                      int64_t f, uint16_t *out, int64_t ldo, int gelu, int threads);
int gguf_matmul_gated_added(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w,
                            int64_t f, uint16_t *out, int64_t ldo, int gelu, const float *addend, const uint8_t *added,
                            int threads);
int gguf_matmul_logits(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, int type, const uint8_t *w,
                       int64_t n, float *out, int64_t ldo, int64_t *argmax, int32_t *finite, int threads);
/* A single greedy row's LM head from its HIGH6 copy, exactly: the argmax and the exact values of the groups that can
 * hold it (and of `keep`), -inf elsewhere; 1 where it cannot answer and gguf_matmul_logits must (gguf_greedy_row.c) */
int gguf_greedy_row(const uint16_t *x, int64_t k, const uint8_t *high6, const uint8_t *w, int64_t n,
                    const int64_t *keep, int64_t kept, float *out, int64_t *argmax, int threads);
/* Whether gguf_matmul multiplies on AMX tiles (compiled in, granted by the OS, and wanted); enable 0 or 1 sets the
 * wanting (the tests compare both paths), -1 only asks */
int gguf_amx(int enable);

int paged_attention_available(void);
/* kv_int8: the caches hold each (slot, KV head) row as d int8 codes, then a float16 scale for each KV_INT8_BLOCK of
 * them (d + 2 d / KV_INT8_BLOCK bytes, kv_quantize_rows; d a multiple of KV_INT8_BLOCK); else d bf16 values */
#define KV_INT8_BLOCK 32
int paged_attention(const uint16_t *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    const int64_t *slots, const int64_t *offset, const int64_t *count, int64_t rows, int64_t hq,
                    int64_t hkv, int64_t d, float scale, float softcap, int kv_int8, uint16_t *out, int threads);
/* `heads` rows of d bf16 values (src) to int8 cache rows (dst): per block of KV_INT8_BLOCK, scale = max |x| / 127 as
 * float16, code = x / scale rounded to nearest even (0 where the scale is 0); the codes, then the scales (a stub
 * that writes nothing where paged_attention is not compiled in) */
void kv_quantize_rows(const uint16_t *src, int64_t heads, int64_t d, int8_t *dst);

/* regions i of `bytes` bytes from address src[i] to dst[i], none overlapping (copy_regions.c; always compiled in) */
void copy_regions(const int64_t *src, const int64_t *dst, int64_t count, int64_t bytes, int threads);

int argmax_available(void);
int argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int threads);

int gelu_mul_available(void); /* and silu_mul's, compiled with it */
void gelu_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t f, uint16_t *out, int threads);
void silu_mul(const uint16_t *gate_up, int64_t stride, int64_t rows, int64_t f, uint16_t *out, int threads);
/* gelu_mul's (gelu != 0) or silu_mul's arithmetic on `rows` rows of 16: gate and up (rows, 16) contiguous, out rows
 * ldo apart (gguf_matmul_gated's epilogue, which checks gelu_mul_available first) */
void gated_block(const uint16_t *gate, const uint16_t *up, int64_t rows, uint16_t *out, int64_t ldo, int gelu);

/* decoder_layer.c: a Gemma 3 or a Llama-family layer on the bf16 + GGUF path in one call. Its plan mirrors
 * ops.DecoderLayerPlan (a ctypes Structure, the same fields in the same order; decoder_layer_plan_bytes lets Python
 * check the size). A projection is GgufLinear's parts: part i writes columns [at, at + n) of the (rows, n) output.
 * A Llama layer uses input_norm and post_attention_norm (its norm before the MLP) and, where not NULL, qkv_bias. */
#define GGUF_LINEAR_MAX_PARTS 3
typedef struct {
    int64_t type;
    const uint8_t *packed;
    int64_t n, at;
} gguf_part;
typedef struct {
    int64_t k, n, parts;
    gguf_part part[GGUF_LINEAR_MAX_PARTS];
} gguf_linear;
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, ffn;
    float eps, scale, softcap;
    int32_t kv_int8; /* the caches hold int8 rows (paged_attention's kv_int8); set for each step's caches */
    const float *input_norm, *post_attention_norm, *pre_feedforward_norm, *post_feedforward_norm, *qk_factor;
    const uint16_t *qkv_bias;
    gguf_linear qkv, o, gate_up, down;
} decoder_layer_plan;
int64_t decoder_layer_plan_bytes(void);
int gemma3_layer(const decoder_layer_plan *p, const uint16_t *x, uint16_t *out, int64_t t, const uint16_t *cos,
                 const uint16_t *signed_sin, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                 const int64_t *slots, const int64_t *offset, const int64_t *count, int threads);
int llama_layer(const decoder_layer_plan *p, const uint16_t *x, uint16_t *out, int64_t t, const uint16_t *cos,
                const uint16_t *signed_sin, void *k_cache, void *v_cache, const int64_t *slot_mapping,
                const int64_t *slots, const int64_t *offset, const int64_t *count, int threads);
/* decoder_stack: every layer of a step, each as gemma3_layer or llama_layer; a layer's kind picks its cos / sin and key
 * lists among the step's (ops.StackLayer and ops.StackKinds mirror these two) */
#define STACK_KINDS 2
typedef struct {
    const decoder_layer_plan *plan;
    void *k_cache, *v_cache;
    int64_t kind;
} stack_layer;
/* LoRA adapters on a step's rows (lora.c, model/lora.py): each adapter with rows in the step is a group; for a layer's
 * projection (LORA_PROJECTIONS of them, in the plan's order: qkv, o, gate_up, down) a group's update adds, to its rows
 * of the product, h · Bᵀ for each part, h = x · Aᵀ the shrink (float32), rounded to bf16 once. ops.LoraPart,
 * ops.LoraUpdate and ops.LoraStep mirror these. */
#define LORA_MAX_PARTS 3
#define LORA_PROJECTIONS 4
typedef struct {
    const uint16_t *bt; /* bf16 Bᵀ times the adapter's scale, in blocks of 16 columns: (ceil(n / 16), rank, 16) */
    int64_t at, n;      /* the output columns it adds to */
    int64_t r0, rank;   /* its columns of the shrink's output */
} lora_part;
typedef struct {
    const uint16_t *a; /* (rank, k) bf16: every part's A, stacked */
    int64_t k, rank, parts;
    lora_part part[LORA_MAX_PARTS];
} lora_update;
typedef struct {
    int64_t groups, layers;
    const int64_t *group_end; /* group g's rows: rows[g ? group_end[g - 1] : 0 .. group_end[g]) */
    const int64_t *rows;
    const lora_update *const *const *tables; /* per group: (layers × LORA_PROJECTIONS) updates, NULL where none */
} lora_step;
/* out (rows, out_stride) bf16 += every group's update of `layer`'s `projection` on its rows of x (rows, x_stride) */
void lora_add(const lora_step *l, int64_t layer, int64_t projection, const uint16_t *x, int64_t x_stride,
              uint16_t *out, int64_t out_stride, int threads);
/* one update on `count` rows (their indices in `rows`): lora_add's work for one group */
void lora_update_rows(const lora_update *u, const int64_t *rows, int64_t count, const uint16_t *x, int64_t x_stride,
                      uint16_t *out, int64_t out_stride, int threads);
/* lora_add's sums into float32 `delta` (rows, delta_stride) instead, for the rows that have an update (`added`: 1 for
 * those, 0 for the rest, which are left untouched), for gguf_matmul_gated_added to add before the activation */
void lora_deltas(const lora_step *l, int64_t layer, int64_t projection, const uint16_t *x, int64_t x_stride,
                 float *delta, int64_t delta_stride, uint8_t *added, int threads);
int lora_has(const lora_step *l, int64_t layer, int64_t projection);

typedef struct {
    const uint16_t *cos[STACK_KINDS], *signed_sin[STACK_KINDS];
    const int64_t *slots[STACK_KINDS], *offset[STACK_KINDS], *count[STACK_KINDS];
    const lora_step *lora; /* the step's adapters' updates; NULL: no row has one */
} stack_kinds;
int decoder_stack(int gemma, const stack_layer *layers, int64_t n, const stack_kinds *kinds, const uint16_t *x,
                  uint16_t *out, uint16_t *spare, int64_t t, const int64_t *slot_mapping, int threads);
/* decoder_forward: a step from its token ids to the final norm's output, in one call: the embedding's GGUF rows (times
 * Gemma's scale, in bf16), each kind's rotary rows picked by position from its tables, decoder_stack, the final norm.
 * ops.ForwardPlan mirrors forward_plan */
typedef struct {
    const uint8_t *embed; /* the embedding table's GGUF blocks, embed_rows rows of `hidden` weights */
    int64_t embed_rows;
    int64_t embed_type;
    float embed_scale;   /* 0: none; else each row times bf16(embed_scale), in bf16 (Gemma's sqrt(hidden)) */
    float norm_eps;
    const float *norm;   /* the final norm's float32 factor: Gemma's 1 + w (rms_norm) or Llama's w (weighted) */
    int64_t norm_weighted;
    const uint16_t *cos[STACK_KINDS], *signed_sin[STACK_KINDS]; /* per kind, every position's (rope_rows, head_dim) */
    int64_t rope_rows[STACK_KINDS];
} forward_plan;
/* a lone greedy row's LM head in the same call (gguf_greedy_row on the step's last row): its arguments, and its
 * status (gguf_greedy_row's return) and argmax once the call is done; ops.GreedyHead mirrors it */
typedef struct {
    const uint8_t *high6, *w;
    int64_t n;
    const int64_t *keep;
    int64_t kept;
    float *out;
    int64_t argmax, status;
} greedy_head;
int decoder_forward(int gemma, const forward_plan *f, const stack_layer *layers, int64_t n, const stack_kinds *kinds,
                    const int64_t *ids, const int64_t *positions, uint16_t *x, uint16_t *out, uint16_t *spare,
                    int64_t t, const int64_t *slot_mapping, greedy_head *head, int threads);

/* token_splits.c: every cut of a vocabulary's pieces (code points, piece i at codes[starts[i]], lengths[i] long) into
 * two of its pieces, piece by piece, the longer left piece first: (left[j], right[j]) for j < the count returned; -1
 * without memory, -2 if more than `capacity` (always compiled in) */
int64_t token_splits(const uint32_t *codes, const int64_t *starts, const int64_t *lengths, int64_t n, int64_t *left,
                     int64_t *right, int64_t capacity);

#endif
