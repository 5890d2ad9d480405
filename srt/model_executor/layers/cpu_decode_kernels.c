/* The decoder's layer loop for one fused decode step (models/cpu_decode.py) on int8 or GGUF weights: the same
 * kernel calls on the same operands in the same order as the model's modules, so the same bits, in one call a
 * step instead of nine ctypes calls a layer (~0.5 ms of a 6.3 ms batch-1 SmolLM2 step on a 2-core AMD EPYC
 * Zen 4). */

#include "cpu_kernels_common.h"

/* How a linear layer's weight is held, as its linear method gives it (cpu_decode.py's LINEAR_* constants):
 * the int8 method's weight and per-channel scales (srt_w8a8_linear), or a GGUF file's blocks, the parts of
 * a fused layer each in its own type (srt_gguf_linear on the method's BlockParts table). */
enum { LINEAR_W8A8 = 0, LINEAR_GGUF = 1 };

/* One linear layer and one decoder layer as cpu_decode.py lays them out: every field an int64 (an address,
 * 0 for no bias, or a size), in the order of its `_Linear` and `_Layer` dataclasses' fields. `weight` and
 * `scale` by kind: W8A8, the int8 weight [n, k] and its scales [n]; GGUF, the parts table (PART_WORDS
 * words a part) and the number of parts. */
typedef struct {
    int64_t kind, weight, scale, bias, n, k;
} DecodeLinear;

typedef struct {
    int64_t input_norm, post_norm;
    DecodeLinear qkv, o, gate_up, down;
    int64_t k_pool, v_pool;
} DecodeLayer;

/* How many int64 words one layer's entry takes (cpu_decode.py checks its layout against it). */
int64_t srt_decode_layer_words(void) { return (int64_t)(sizeof(DecodeLayer) / sizeof(int64_t)); }

/* One linear layer's adapter pool as srt_lora_add_segments reads it (`LayerLoRAWeights.segment_args`), a 0
 * when the layer has none; a layer's four (qkv, o, gate_up, down) follow each other. */
typedef struct {
    int64_t a, a_slot_stride, nsub, bt, bt_slot_stride, bt_stride, out_offset, out_size, half;
} DecodeAdapters;

int64_t srt_decode_adapter_words(void) { return (int64_t)(sizeof(DecodeAdapters) / sizeof(int64_t)); }

/* The step's adapter segments (LoRABatchInfo.kernel_segments), shared by every adapted layer. */
typedef struct {
    const DecodeAdapters *pools; /* [layers][4], NULL: no adapter row in the step */
    const int64_t *rows, *seg;
    int64_t nseg;
} StepAdapters;

static inline void adapt(const StepAdapters *s, const DecodeAdapters *p, const float *x, int64_t k, float *out,
                         int64_t n) {
    if (s->pools == NULL || p->a == 0) return;
    srt_lora_add_segments(x, k, k, s->rows, s->nseg, s->seg, (const void *)(intptr_t)p->a, p->a_slot_stride,
                          p->nsub, (const void *)(intptr_t)p->bt, p->bt_slot_stride, p->bt_stride,
                          (const int64_t *)(intptr_t)p->out_offset, (const int64_t *)(intptr_t)p->out_size, p->half,
                          out, n);
}

/* The linear kernels' scratch: the int8 kernel's quantized rows (q, qscale; NULL: its stack) and the GGUF
 * kernel's quantized activations (act, m * srt_gguf_act_row_bytes(k) bytes; NULL without GGUF layers). */
typedef struct {
    int8_t *q;
    float *qscale;
    uint8_t *act;
} LinearScratch;

/* out [m, n] = x [m, k] times the layer's weight, plus its bias: the call its method's apply makes (the GGUF
 * method adds the bias after the product, as here). */
static inline void linear(const DecodeLinear *l, const float *x, int64_t m, float *out, const LinearScratch *s) {
    const float *bias = l->bias ? (const float *)(intptr_t)l->bias : NULL;
    if (l->kind == LINEAR_W8A8) {
        srt_w8a8_linear(x, m, l->k, l->k, (const int8_t *)(intptr_t)l->weight, (const float *)(intptr_t)l->scale,
                        bias, l->n, out, s->q, s->qscale);
        return;
    }
    srt_gguf_linear(x, m, l->k, l->k, l->scale, (const int64_t *)(intptr_t)l->weight, s->act, out, l->n);
    if (bias)
        for (int64_t t = 0; t < m; t++)
            for (int64_t j = 0; j < l->n; j++) out[t * l->n + j] += bias[j];
}

static inline void add_rows(float *h, const float *d, int64_t count) {
    for (int64_t i = 0; i < count; i++) h[i] += d[i];
}

/* Every layer of a decode step of m rows: hidden [m, hidden_size] in and out, in place; the other buffers are
 * the step's scratch (qkv [m, q_size + 2 kv_size], gate_up [m, 2 inter], ...); q and qscale the int8 linear
 * kernel's scratch (NULL: its stack), act_q the GGUF kernel's (LinearScratch). With `adapters` ([layers][4] pools, NULL for a step without adapter
 * rows) and the step's segments, each linear layer's adapter products are added after its kernel, as the
 * module path's linear method adds them. Returns 1 where the attention kernel had no memory for its scores,
 * else 0. */
int srt_decode_layers(const int64_t *layers, const int64_t *adapters, const int64_t *adapter_rows,
                      int64_t adapter_nseg, const int64_t *adapter_seg, int64_t num_layers, int64_t m,
                      float *hidden, float *normed,
                      float *qkv, float *attn, float *delta, float *gate_up, float *act, int8_t *q, float *qscale,
                      uint8_t *act_q,
                      const float *cos, const float *sin, const int64_t *loc, const int64_t *slots,
                      int64_t slots_stride, const int64_t *seq_lens, int64_t hidden_size, int64_t q_size,
                      int64_t kv_size, int64_t inter, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps,
                      float scale, int64_t half) {
    const DecodeLayer *table = (const DecodeLayer *)(const void *)layers;
    const StepAdapters step = {(const DecodeAdapters *)(const void *)adapters, adapter_rows, adapter_seg,
                               adapter_nseg};
    const LinearScratch scratch = {q, qscale, act_q};
    const int64_t width = q_size + 2 * kv_size;
    for (int64_t i = 0; i < num_layers; i++) {
        const DecodeLayer *l = table + i;
        const DecodeAdapters *p = step.pools ? step.pools + 4 * i : NULL;
        void *k_pool = (void *)(intptr_t)l->k_pool, *v_pool = (void *)(intptr_t)l->v_pool;
        srt_rmsnorm(hidden, m, hidden_size, hidden_size, (const float *)(intptr_t)l->input_norm, eps, normed);
        linear(&l->qkv, normed, m, qkv, &scratch);
        adapt(&step, p, normed, hidden_size, qkv, width);
        srt_rope(qkv, m, width, heads + kv_heads, head_dim, cos, sin, head_dim / 2);
        srt_store_kv(qkv, m, width, q_size, q_size + kv_size, kv_size, loc, k_pool, v_pool, (int)half);
        if (srt_decode_attention(qkv, m, width, heads, kv_heads, head_dim, k_pool, v_pool, half, slots, slots_stride,
                                 seq_lens, scale, attn))
            return 1;
        linear(&l->o, attn, m, delta, &scratch);
        adapt(&step, p + 1, attn, q_size, delta, hidden_size);
        add_rows(hidden, delta, m * hidden_size);
        srt_rmsnorm(hidden, m, hidden_size, hidden_size, (const float *)(intptr_t)l->post_norm, eps, normed);
        linear(&l->gate_up, normed, m, gate_up, &scratch);
        adapt(&step, p + 2, normed, hidden_size, gate_up, 2 * inter);
        srt_silu_mul(gate_up, m, inter, 2 * inter, act);
        linear(&l->down, act, m, delta, &scratch);
        adapt(&step, p + 3, act, inter, delta, hidden_size);
        add_rows(hidden, delta, m * hidden_size);
    }
    return 0;
}
