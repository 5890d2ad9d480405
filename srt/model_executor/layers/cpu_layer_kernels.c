/* srt's CPU kernels for the decoder's elementwise steps and its K/V store (RMSNorm, rotary embedding,
 * SiLU x up, fp32 -> pool rows), built with the other kernel sources by cpu_kernels.py and called through
 * ctypes; cpu_kernels_common.h says why they exist and the numerics they keep. */

#include "cpu_kernels_common.h"

/* The decoder's elementwise steps, for the int8 path (cpu_kernels.py): one call each instead of a chain of
 * PyTorch ops. They are not bit-equal to PyTorch's (sums and exp in another order) and need not be: the
 * int8 model uses them at every batch size, so its results still do not depend on the batch. */

/* a . b in LANES partial sums (a loop the compiler vectorizes), then the tail, then the lanes */
static float dot_lanes(const float *a, const float *b, int64_t n) {
    float lane[LANES] = {0};
    int64_t i = 0;
#if defined(__AVX512F__)
    /* the same lanes in one register: GCC left the loop below scalar where it inlined it into an OpenMP
     * region (the LoRA shrink: a step's 120 adapted layers took 2.1 ms on one core, 1.0 ms so) */
    __m512 v = _mm512_setzero_ps();
    for (; i + LANES <= n; i += LANES) v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    _mm512_storeu_ps(lane, v);
#elif defined(__AVX__)
    __m256 v0 = _mm256_setzero_ps(), v1 = v0;
    for (; i + LANES <= n; i += LANES) {
        v0 = _mm256_add_ps(v0, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        v1 = _mm256_add_ps(v1, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
    }
    _mm256_storeu_ps(lane, v0);
    _mm256_storeu_ps(lane + 8, v1);
#endif
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int l = 0; l < LANES; l++) s += lane[l];
    return s;
}

static float sum_squares(const float *x, int64_t k) { return dot_lanes(x, x, k); }

/* RMSNorm of rows x [m, k] (row stride x_stride) into out [m, k] (contiguous): w * (x / sqrt(mean(x^2) + eps)),
 * with fp32 statistics as Hugging Face's. */
void srt_rmsnorm(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *w, float eps, float *out) {
#pragma omp parallel for if (m * k >= 65536) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * x_stride;
        const float inv = 1.0f / sqrtf(sum_squares(xr, k) / (float)k + eps);
        float *o = out + r * k;
        for (int64_t i = 0; i < k; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* Rotary embedding, in place, of the first `heads` heads of every row of x [n, row_stride] (a fused qkv
 * projection's output: q's heads, then k's), in the rotate-half layout: x1' = x1 cos - x2 sin,
 * x2' = x2 cos + x1 sin for the two halves of each head, cos and sin [n, head_dim / 2] (row stride
 * cs_stride). The same operations in the same order as PyTorch's, so the same bits. */
void srt_rope(float *x, int64_t n, int64_t row_stride, int64_t heads, int64_t head_dim, const float *cos,
              const float *sin, int64_t cs_stride) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (n * heads * head_dim >= 65536) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * row_stride + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* out [m, inter] = silu(gate) * up for gate_up [m, 2 * inter] (row stride gu_stride): the MLP's activation.
 * Eight lanes at a time through exp_v8 (the compiler left exp_vec's loop scalar: 10 % of a prefill), the
 * tail through exp_vec: the same operations, so every element gets the same bits wherever it falls. */
void srt_silu_mul(const float *gu, int64_t m, int64_t inter, int64_t gu_stride, float *out) {
    const int64_t whole = inter / 8 * 8;
#pragma omp parallel for if (m * inter >= 65536) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const float *g = gu + r * gu_stride, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < whole; i += 8) {
            const v8f gv = *(const v8f *)(g + i);
            *(v8f *)(o + i) = (gv / (1.0f + exp_v8(-gv))) * *(const v8f *)(u + i);
        }
        for (int64_t i = whole; i < inter; i++) o[i] = (g[i] / (1.0f + exp_vec(-g[i]))) * u[i];
    }
}

/* This step's K and V into the pool: row r of qkv [m, row_stride] holds k at k_offset and v at v_offset
 * (width floats each, after the rotary embedding), written to pool row loc[r] (fp32, or fp16 rounded as
 * PyTorch rounds). What the module path's set_kv_buffer does, in one call. */
void srt_store_kv(const float *qkv, int64_t m, int64_t row_stride, int64_t k_offset, int64_t v_offset,
                  int64_t width, const int64_t *loc, void *k_pool, void *v_pool, int half) {
    for (int64_t r = 0; r < m; r++) {
        const float *src[2] = {qkv + r * row_stride + k_offset, qkv + r * row_stride + v_offset};
        void *dst[2] = {k_pool, v_pool};
        for (int which = 0; which < 2; which++) {
            const float *x = src[which];
            if (!half) {
                memcpy((float *)dst[which] + loc[r] * width, x, sizeof(float) * (size_t)width);
                continue;
            }
            uint16_t *o = (uint16_t *)dst[which] + loc[r] * width;
            int64_t i = 0;
#if defined(__F16C__)
            for (; i + 8 <= width; i += 8)
                _mm_storeu_si128((__m128i *)(o + i),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
            for (; i < width; i++) o[i] = float_to_half(x[i]);
        }
    }
}

/* The shrunk rows a call keeps on its stack: its tokens go in groups of at most this many values. */
#define LORA_SHRUNK_MAX 4096
/* Output columns a thread updates at a time in the expand. */
#define LORA_COLUMN_BLOCK 128
/* Both halves split between the threads from this many shrink products on: an adapter's decode row reads
 * ~19 MB of fp32 factors a SmolLM2 step, and one core read them in 1.75 ms of a 9.3 ms step. */
#define LORA_PARALLEL_MIN 16384

/* A pool's factors are fp32, or fp16 (`HALF`, a constant after inlining: one copy of the loops per format)
 * widened to fp32 exactly as they are read; the products and sums are fp32 either way. */
ALWAYS_INLINE float factor(const void *p, int64_t i, const int HALF) {
    return HALF ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* x . a (a: n factors) as dot_lanes sums it, the factors widened first */
ALWAYS_INLINE float dot_factors(const float *x, const void *a, int64_t n, const int HALF) {
    if (!HALF) return dot_lanes(x, (const float *)a, n);
    const uint16_t *h = (const uint16_t *)a;
    float lane[LANES] = {0};
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 v = _mm512_setzero_ps();
    for (; i + LANES <= n; i += LANES)
        v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i)))));
    _mm512_storeu_ps(lane, v);
#elif defined(__F16C__)
    __m256 v0 = _mm256_setzero_ps(), v1 = v0;
    for (; i + LANES <= n; i += LANES) {
        v0 = _mm256_add_ps(v0, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i)))));
        v1 = _mm256_add_ps(v1, _mm256_mul_ps(_mm256_loadu_ps(x + i + 8), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i + 8)))));
    }
    _mm256_storeu_ps(lane, v0);
    _mm256_storeu_ps(lane + 8, v1);
#endif
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += x[i + l] * half_to_float(h[i + l]);
    float s = 0.0f;
    for (; i < n; i++) s += x[i] * half_to_float(h[i]);
    for (int l = 0; l < LANES; l++) s += lane[l];
    return s;
}

/* 16 factors from b + c, widened */
#if defined(__AVX512F__)
ALWAYS_INLINE __m512 factors16(const void *b, int64_t c, const int HALF) {
    return HALF ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)b + c)))
                : _mm512_loadu_ps((const float *)b + c);
}
#endif

/* acc[c] += s[q] * b[q * b_stride + c] for q = 0 .. r in turn, c in [0, n) (b: factors): each element's r
 * products added in order of q, so the same bits in any vector width. A vector of acc stays in a register
 * while its r products are added. */
ALWAYS_INLINE void expand_block(float *acc, const float *s, int64_t r, const void *b, int64_t b_stride, int64_t n,
                                const int HALF) {
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= n; c += 16) {
        __m512 v = _mm512_loadu_ps(acc + c);
        for (int64_t q = 0; q < r; q++)
            v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(s[q]), factors16(b, q * b_stride + c, HALF)));
        _mm512_storeu_ps(acc + c, v);
    }
#endif
    for (; c < n; c++) {
        float v = acc[c];
        for (int64_t q = 0; q < r; q++) v += s[q] * factor(b, q * b_stride + c, HALF);
        acc[c] = v;
    }
}

/* The output blocks of LORA_COLUMN_BLOCK columns a sub-module of `size` columns takes. */
static inline int64_t column_blocks(int64_t size) { return (size + LORA_COLUMN_BLOCK - 1) / LORA_COLUMN_BLOCK; }

/* Output block b (of LORA_COLUMN_BLOCK columns, counted over every sub-module) of one row: its sub-module i's
 * columns get (x A_i^T) B_i^T from the row's shrunk values (`shrunk`: nsub * r of them), added straight into
 * out when `direct`, else summed from zero and then added once. */
ALWAYS_INLINE void expand_row_block(float *out_row, int64_t b, const float *shrunk, int64_t r, const void *bt,
                                    int64_t bt_stride, const int64_t *out_offset, const int64_t *out_size,
                                    int64_t direct, const int HALF) {
    const int64_t size = HALF ? 2 : 4;
    int64_t i = 0;
    for (; b >= column_blocks(out_size[i]); i++) b -= column_blocks(out_size[i]);
    const int64_t c0 = b * LORA_COLUMN_BLOCK;
    const int64_t c1 = c0 + LORA_COLUMN_BLOCK < out_size[i] ? c0 + LORA_COLUMN_BLOCK : out_size[i];
    float *o = out_row + out_offset[i];
    float sum[LORA_COLUMN_BLOCK] = {0};
    float *acc = direct ? o + c0 : sum;
    expand_block(acc, shrunk + i * r, r, (const char *)bt + (out_offset[i] + c0) * size, bt_stride, c1 - c0, HALF);
    if (!direct)
        for (int64_t c = 0; c < c1 - c0; c++) o[c0 + c] += sum[c];
}

/* LoRA adapters' products, added to a layer's output. For each of the layer's nsub sub-modules i (q, k, v of
 * a fused qkv; one for a plain layer), out[row, off_i : off_i + size_i] += (x[row] A_i^T) B_i^T, A_i being rows
 * i*r .. (i+1)*r of the adapter's a [nsub * r, k] and B_i^T rows 0 .. r of its bt (row stride bt_stride),
 * columns off_i .. off_i + size_i, the scaling folded in. The expand runs as r vector updates of the output
 * row (B kept transposed for it). One call per adapted layer and step instead of a PyTorch matmul per
 * sub-module and adapter: an adapter's decode row was dispatch-bound (about 270 small matmuls a step, 4 ms of
 * a 12 ms step), and a step of several adapters spent ~80 us a layer in Python and index ops around the
 * products. The threads split the shrink's products and the expand's column blocks, so one token's call
 * uses every core. */

/* One adapter's rows of a step: tokens rows[t0 .. t0 + m) of x and out (rows NULL: tokens t0 .. t0 + m
 * themselves), each row's output `blocks` column blocks over every sub-module. Added straight into out when `direct`; otherwise each output block's delta is summed from zero
 * first and then added once, as a gather, expand into zeros and index_add would (the same bits). a and bt
 * hold fp32 factors, or fp16 ones when HALF. */
ALWAYS_INLINE void lora_rows(const float *x, const int64_t *rows, int64_t t0, int64_t m, int64_t k,
                             int64_t x_stride, const void *a, int64_t r, int64_t nsub, const void *bt,
                             int64_t bt_stride, const int64_t *out_offset, const int64_t *out_size, float *out,
                             int64_t out_stride, int64_t blocks, int direct, const int HALF) {
    const int64_t nr = nsub * r, size = HALF ? 2 : 4;
    const int64_t group = nr > 0 && nr < LORA_SHRUNK_MAX ? LORA_SHRUNK_MAX / nr : 1;
    float shrunk[nr > LORA_SHRUNK_MAX ? nr : LORA_SHRUNK_MAX];
    for (int64_t g0 = 0; g0 < m; g0 += group) {
        const int64_t tg = m - g0 < group ? m - g0 : group;
#pragma omp parallel if (tg * nr * k >= LORA_PARALLEL_MIN)
        {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < tg * nr; j++) {
                const int64_t t = t0 + g0 + j / nr, row = rows ? rows[t] : t;
                shrunk[j] = dot_factors(x + row * x_stride, (const char *)a + (j % nr) * k * size, k, HALF);
            }
            /* each output element adds its r products in the same order whichever thread owns its block */
#pragma omp for schedule(static)
            for (int64_t g = 0; g < tg * blocks; g++) {
                const int64_t t = g / blocks, row = rows ? rows[t0 + g0 + t] : t0 + g0 + t;
                expand_row_block(out + row * out_stride, g % blocks, shrunk + t * nr, r, bt, bt_stride, out_offset,
                                 out_size, direct, HALF);
            }
        }
    }
}

/* A step's segments together when all their shrunk rows fit one buffer (a decode step's): every segment's
 * shrink in one worksharing loop, then every segment's expand in another, in one parallel region. Segment by
 * segment, a 16-row step of four adapters opened four regions with two barriers each in every one of its 120
 * adapted layers. Each product and output element is computed as lora_rows computes it: the same bits. */
#define LORA_SEGMENTS_AT_ONCE 64

/* the segment whose range [off[s], off[s + 1]) holds i (empty segments hold nothing) */
static inline int64_t segment_of(const int64_t *off, int64_t i) {
    int64_t s = 0;
    while (i >= off[s + 1]) s++;
    return s;
}

ALWAYS_INLINE void lora_segments_at_once(const float *x, int64_t k, int64_t x_stride, const int64_t *rows,
                                         int64_t nseg, const int64_t *seg, const void *a, int64_t a_slot_stride,
                                         int64_t nsub, const void *bt, int64_t bt_slot_stride, int64_t bt_stride,
                                         const int64_t *out_offset, const int64_t *out_size, float *out,
                                         int64_t out_stride, const int64_t *shrunk_off, int64_t blocks,
                                         const int HALF) {
    const int64_t size = HALF ? 2 : 4, direct = rows == NULL;
    int64_t block_off[LORA_SEGMENTS_AT_ONCE + 1];
    block_off[0] = 0;
    for (int64_t s = 0; s < nseg; s++) block_off[s + 1] = block_off[s] + (seg[4 * s + 3] - seg[4 * s + 2]) * blocks;
    float shrunk[LORA_SHRUNK_MAX];
#pragma omp parallel if (shrunk_off[nseg] * k >= LORA_PARALLEL_MIN)
    {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < shrunk_off[nseg]; j++) {
            const int64_t s = segment_of(shrunk_off, j), nr = nsub * seg[4 * s + 1], local = j - shrunk_off[s];
            const int64_t t = seg[4 * s + 2] + local / nr, row = rows ? rows[t] : t;
            const char *as = (const char *)a + seg[4 * s] * a_slot_stride * size;
            shrunk[j] = dot_factors(x + row * x_stride, as + (local % nr) * k * size, k, HALF);
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < block_off[nseg]; g++) {
            const int64_t s = segment_of(block_off, g), r = seg[4 * s + 1], local = g - block_off[s];
            const int64_t t = local / blocks, row = rows ? rows[seg[4 * s + 2] + t] : seg[4 * s + 2] + t;
            expand_row_block(out + row * out_stride, local % blocks, shrunk + shrunk_off[s] + t * nsub * r, r,
                             (const char *)bt + seg[4 * s] * bt_slot_stride * size, bt_stride, out_offset, out_size,
                             direct, HALF);
        }
    }
}

/* Every adapter of a step in one call per layer: segment s (seg[4s..4s+3] = slot, rank, start, end) is the
 * adapter in pool slot `slot` for tokens rows[start .. end) (rows NULL: the tokens start .. end themselves,
 * every row adapted and already grouped, added straight into out). a [slots, nsub * max_rank, k] and
 * bt [slots, max_rank, bt_stride] are the layer's pool (a_slot_stride, bt_slot_stride: factors a slot), in
 * fp32, or in fp16 where `half` is set. */
void srt_lora_add_segments(const float *x, int64_t k, int64_t x_stride, const int64_t *rows, int64_t nseg,
                           const int64_t *seg, const void *a, int64_t a_slot_stride, int64_t nsub,
                           const void *bt, int64_t bt_slot_stride, int64_t bt_stride, const int64_t *out_offset,
                           const int64_t *out_size, int64_t half, float *out, int64_t out_stride) {
    const int64_t size = half ? 2 : 4;
    int64_t blocks = 0; /* column blocks of one row's output, over every sub-module */
    for (int64_t i = 0; i < nsub; i++) blocks += column_blocks(out_size[i]);
    if (nseg <= LORA_SEGMENTS_AT_ONCE) {
        int64_t shrunk_off[LORA_SEGMENTS_AT_ONCE + 1];
        shrunk_off[0] = 0;
        for (int64_t s = 0; s < nseg; s++)
            shrunk_off[s + 1] = shrunk_off[s] + (seg[4 * s + 3] - seg[4 * s + 2]) * nsub * seg[4 * s + 1];
        if (shrunk_off[nseg] <= LORA_SHRUNK_MAX) {
            if (half)
                lora_segments_at_once(x, k, x_stride, rows, nseg, seg, a, a_slot_stride, nsub, bt, bt_slot_stride,
                                      bt_stride, out_offset, out_size, out, out_stride, shrunk_off, blocks, 1);
            else
                lora_segments_at_once(x, k, x_stride, rows, nseg, seg, a, a_slot_stride, nsub, bt, bt_slot_stride,
                                      bt_stride, out_offset, out_size, out, out_stride, shrunk_off, blocks, 0);
            return;
        }
    }
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t slot = seg[4 * s], r = seg[4 * s + 1], start = seg[4 * s + 2], end = seg[4 * s + 3];
        const void *sa = (const char *)a + slot * a_slot_stride * size;
        const void *sb = (const char *)bt + slot * bt_slot_stride * size;
        if (half)
            lora_rows(x, rows, start, end - start, k, x_stride, sa, r, nsub, sb, bt_stride, out_offset, out_size,
                      out, out_stride, blocks, rows == NULL, 1);
        else
            lora_rows(x, rows, start, end - start, k, x_stride, sa, r, nsub, sb, bt_stride, out_offset, out_size,
                      out, out_stride, blocks, rows == NULL, 0);
    }
}
