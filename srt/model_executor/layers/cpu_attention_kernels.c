/* srt's CPU attention kernels: decode and extend steps straight out of the paged KV pool (fp32 or fp16),
 * built with the other kernel sources by cpu_kernels.py and called through ctypes; cpu_kernels_common.h says
 * why they exist. */

#include "cpu_kernels_common.h"

/* Attention. Both kernels below come to attend_rows, which fixes one order of operations per query head
 * over the keys it sees, t in [start, len) (start 0 without a sliding window; with a window of W keys,
 * start = max(0, len - W), so only the window's keys are read): score(t) = (sum over d, in order, of
 * q[d] k_t[d]) * scale, then, with a logit cap c, c * tanh(score / c) (softcap_v8); softmax_numerators
 * (a maximum, exp_v8, and a sum whose order depends on the number of keys only); then out[d] = (sum over
 * t, in order, of p_t v_t[d]) * (1 / sum). K and V come from an fp32 or fp16 pool, widened to fp32
 * exactly. The blocking over query rows, key tiles and head-dimension blocks only decides which of these
 * operations run side by side, never their order, so a token's attention is the same to the bit whether it
 * was computed in its prompt's prefill, in one chunk of it, after a prefix-cache hit, or in the decode step
 * at its position (with -ffp-contract=off, nothing is fused or reassociated). */
#define KEY_TILE 8   /* keys scored at once: one 8-float vector per query row */
#define ROW_BLOCK 6  /* query rows sharing one load of a key tile or value row */

/* One thread's scratch for attend_rows: up to `rows` query rows whose scores span up to `len` keys (see
 * scores_stride). */
typedef struct {
    const float **q;
    float **out;
    int64_t *starts, *lens;
    float *floats; /* scores [rows][len rounded up to KEY_TILE], key tile, a zero row, 1 / sum per row */
} attend_scratch;

static int attend_scratch_alloc(attend_scratch *w, int64_t rows, int64_t len, int64_t head_dim) {
    const int64_t padded = (len + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    w->q = malloc(sizeof(*w->q) * (size_t)rows);
    w->out = malloc(sizeof(*w->out) * (size_t)rows);
    w->starts = malloc(sizeof(*w->starts) * (size_t)rows);
    w->lens = malloc(sizeof(*w->lens) * (size_t)rows);
    w->floats = malloc(sizeof(float) * (size_t)(rows * padded + head_dim * KEY_TILE + head_dim + rows));
    return w->q && w->out && w->starts && w->lens && w->floats;
}

static void attend_scratch_free(attend_scratch *w) {
    free(w->q);
    free(w->out);
    free(w->starts);
    free(w->lens);
    free(w->floats);
}

/* The first key a query row at length len (its position + 1) sees: 0, or with a sliding window of
 * `window` keys (window > 0), the window's first. */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* The distance between the scores rows of attend_rows (keys starts[0] .. lens[rows - 1] - 1): the span,
 * rounded up to whole key tiles, and one tile more where a row starts past the first row's start (its
 * softmax writes whole vectors from its own start). attend_scratch_alloc's len must be at least this. */
static inline int64_t scores_stride(int64_t rows, const int64_t *starts, const int64_t *lens) {
    const int64_t span = (lens[rows - 1] - starts[0] + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    return starts[rows - 1] > starts[0] ? span + KEY_TILE : span;
}

/* element i of a pool row (or of a head's slice of one) */
ALWAYS_INLINE const void *kv_at(const void *base, int64_t i, const int half) {
    return half ? (const void *)((const uint16_t *)base + i) : (const void *)((const float *)base + i);
}

ALWAYS_INLINE float kv_load1(const void *p, const int half) {
    return half ? half_to_float(*(const uint16_t *)p) : *(const float *)p;
}

ALWAYS_INLINE v8f kv_load8(const void *p, const int half) {
    if (!half) return *(const v8f *)p;
#if defined(__F16C__)
    return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    v8f r;
    for (int l = 0; l < 8; l++) r[l] = half_to_float(((const uint16_t *)p)[l]);
    return r;
#endif
}

/* Only the rows whose keys include t (starts[j] <= t < lens[j]) add p_t v_t: the edges of a block of rows
 * whose key ranges differ. */
ALWAYS_INLINE void pv_edge_key(const int nr, const int nvec, const int half, int64_t t, const int64_t *starts,
                               const int64_t *lens, const float *scores, int64_t s_stride, const void *v_head,
                               int64_t kv_stride, const int64_t *idx, int64_t d0, v8f acc[ROW_BLOCK][2]) {
    const void *v = kv_at(v_head, idx[t] * kv_stride + d0, half);
    for (int j = 0; j < nr; j++)
        if (starts[j] <= t && t < lens[j])
            for (int c = 0; c < nvec; c++)
                acc[j][c] += scores[j * s_stride + t] * kv_load8(kv_at(v, 8 * c, half), half);
}

/* Columns [d0, d0 + 8 nvec) of the output of nr query rows (row j's score of key t at scores[j * s_stride +
 * t], keys idx[starts[j]..lens[j]), both non-decreasing in j): the sum over keys in order, each value row
 * loaded once for all nr rows. nr and nvec are constants where this is inlined (see pv_dispatch), so the
 * nr x nvec accumulators stay in registers. */
ALWAYS_INLINE void pv_columns(const int nr, const int nvec, const int half, const int64_t *starts,
                              const int64_t *lens, const float *scores, int64_t s_stride, const void *v_head,
                              int64_t kv_stride, const int64_t *idx, int64_t d0, const float *inv,
                              float *const *out) {
    v8f acc[ROW_BLOCK][2];
    for (int j = 0; j < nr; j++)
        for (int c = 0; c < nvec; c++) acc[j][c] = v8f_splat(0.0f);
    const int64_t first = starts[0], inner = starts[nr - 1], common = lens[0], last = lens[nr - 1];
    const int64_t head_end = inner < last ? inner : last, tail_start = inner > common ? inner : common;
    for (int64_t t = first; t < head_end; t++) /* window head: rows whose windows start by t */
        pv_edge_key(nr, nvec, half, t, starts, lens, scores, s_stride, v_head, kv_stride, idx, d0, acc);
    for (int64_t t = inner; t < common; t++) { /* every row sees key t */
        const void *v = kv_at(v_head, idx[t] * kv_stride + d0, half);
        v8f vv[2];
        for (int c = 0; c < nvec; c++) vv[c] = kv_load8(kv_at(v, 8 * c, half), half);
        for (int j = 0; j < nr; j++)
            for (int c = 0; c < nvec; c++) acc[j][c] += scores[j * s_stride + t] * vv[c];
    }
    for (int64_t t = tail_start; t < last; t++) /* causal tail: only the rows whose keys reach t */
        pv_edge_key(nr, nvec, half, t, starts, lens, scores, s_stride, v_head, kv_stride, idx, d0, acc);
    for (int j = 0; j < nr; j++)
        for (int c = 0; c < nvec; c++) *(v8f *)(out[j] + d0 + 8 * c) = acc[j][c] * inv[j];
}

#define PV_CASE(n, nvec) \
    case n: pv_columns(n, nvec, half, starts, lens, scores, s_stride, v_head, kv_stride, idx, d0, inv, out); break;

ALWAYS_INLINE void pv_dispatch(int nr, const int nvec, const int half, const int64_t *starts, const int64_t *lens,
                               const float *scores, int64_t s_stride, const void *v_head, int64_t kv_stride,
                               const int64_t *idx, int64_t d0, const float *inv, float *const *out) {
    if (nvec == 2) {
        switch (nr) { PV_CASE(1, 2) PV_CASE(2, 2) PV_CASE(3, 2) PV_CASE(4, 2) PV_CASE(5, 2) PV_CASE(6, 2) }
    } else {
        switch (nr) { PV_CASE(1, 1) PV_CASE(2, 1) PV_CASE(3, 1) PV_CASE(4, 1) PV_CASE(5, 1) PV_CASE(6, 1) }
    }
}

/* cap * tanh(s / cap), lane by lane (Gemma 2's attention logit soft-capping): tanh |x| = (1 - e) / (1 + e)
 * with e = e^(-2 |x|) <= 1 (exp_v8, so no overflow), to a few float ulp of |x| (absolute), the sign put
 * back after. */
static inline v8f softcap_v8(v8f s, float cap) {
    const v8f x = s / cap;
    const v8i negative = x < 0.0f;
    const v8f e = exp_v8(-2.0f * v8f_select(negative, -x, x));
    const v8f t = (1.0f - e) / (1.0f + e);
    return cap * v8f_select(negative, -t, t);
}

/* Scores of nr query rows against one transposed key tile ([d][key], KEY_TILE keys): each row's sum over d
 * in order, then the scale, then the soft-cap where cap > 0. nr is a constant where this is inlined (see
 * qk_dispatch). */
ALWAYS_INLINE void qk_tile(const int nr, const float *const *q, const float *tile, int64_t head_dim, float scale,
                           float cap, float *scores, int64_t s_stride) {
    v8f acc[ROW_BLOCK];
    for (int j = 0; j < nr; j++) acc[j] = v8f_splat(0.0f);
    for (int64_t d = 0; d < head_dim; d++) {
        const v8f kd = *(const v8f *)(tile + d * KEY_TILE);
        for (int j = 0; j < nr; j++) acc[j] += q[j][d] * kd;
    }
    if (cap > 0.0f)
        for (int j = 0; j < nr; j++) *(v8f *)(scores + j * s_stride) = softcap_v8(acc[j] * scale, cap);
    else
        for (int j = 0; j < nr; j++) *(v8f *)(scores + j * s_stride) = acc[j] * scale;
}

#define QK_CASE(n) \
    case n: qk_tile(n, q, tile, head_dim, scale, cap, scores, s_stride); break;

static void qk_dispatch(int nr, const float *const *q, const float *tile, int64_t head_dim, float scale, float cap,
                        float *scores, int64_t s_stride) {
    switch (nr) { QK_CASE(1) QK_CASE(2) QK_CASE(3) QK_CASE(4) QK_CASE(5) QK_CASE(6) }
}

/* s[0..len) <- exp(s - max) in place (the scores row is padded to a multiple of 8, so whole vectors are
 * written; lanes past len are never read); returns 1 / sum. The sum's order depends on len only. */
static inline float softmax_numerators(float *s, int64_t len) {
    const int64_t whole = len / 8 * 8;
    float mx = -INFINITY;
    v8f m8 = v8f_splat(-INFINITY);
    for (int64_t t = 0; t < whole; t += 8) {
        const v8f x = *(const v8f *)(s + t);
        m8 = v8f_select(x > m8, x, m8);
    }
    for (int l = 0; l < 8; l++) mx = m8[l] > mx ? m8[l] : mx;
    for (int64_t t = whole; t < len; t++) mx = s[t] > mx ? s[t] : mx; /* a maximum is the same in any order */
    v8f acc = v8f_splat(0.0f);
    for (int64_t t = 0; t < len; t += 8) {
        const v8f e = exp_v8(*(const v8f *)(s + t) - mx);
        *(v8f *)(s + t) = e;
        if (t + 8 <= len) acc += e;
    }
    float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (int64_t t = whole; t < len; t++) sum += s[t];
    return 1.0f / sum;
}

/* tile[d][u] = keys[u][d] for d < head_dim: KEY_TILE key rows transposed so that one vector holds a
 * feature of every key. Pure data movement: it decides no result's bits. */
ALWAYS_INLINE void transpose_key_tile(const void *const *keys, int64_t head_dim, float *tile, const int half) {
    int64_t d0 = 0;
#if SRT_ISA >= 1 && KEY_TILE == 8
    /* 8 x 8 blocks in registers: unpack pairs of rows, shuffle pairs of pairs, swap 128-bit halves */
    for (; d0 + 8 <= head_dim; d0 += 8) {
        __m256 r[8], t[8], u[8];
        for (int i = 0; i < 8; i++) r[i] = (__m256)kv_load8(kv_at(keys[i], d0, half), half);
        for (int i = 0; i < 8; i += 2) {
            t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
            t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
            u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
            u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
            u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
            u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
        }
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_ps(tile + (d0 + i) * 8, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
            _mm256_storeu_ps(tile + (d0 + i + 4) * 8, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
        }
    }
#endif
    for (; d0 < head_dim; d0++)
        for (int u = 0; u < KEY_TILE; u++) tile[d0 * KEY_TILE + u] = kv_load1(kv_at(keys[u], d0, half), half);
}

/* `rows` query rows (row r at q[r]) attending over the keys/values whose pool slots are idx[starts[r] ..
 * lens[r]) (starts[r] < lens[r]): k_head / v_head point at one KV head's features in slot 0 and slots are
 * kv_stride elements apart (fp16 if `half`). starts and lens must not decrease with r. Scores are scaled,
 * then soft-capped where cap > 0. out[r] receives the head_dim outputs of row r. `floats`: attend_scratch's,
 * allocated for a len of at least scores_stride. Only the keys from starts[0] on are read. */
ALWAYS_INLINE void attend_rows(const float *const *q, int64_t rows, const int64_t *starts, const int64_t *lens,
                               int64_t head_dim, const void *k_head, const void *v_head, int64_t kv_stride,
                               const int64_t *idx, float scale, float cap, float *const *out, float *floats,
                               const int half) {
    const int64_t base = starts[0], max_len = lens[rows - 1];
    const int64_t s_stride = scores_stride(rows, starts, lens);
    /* row r's score of key t at scores[r * s_stride + t - base] */
    float *scores = floats, *tile = scores + rows * s_stride, *zeros = tile + head_dim * KEY_TILE;
    float *inv = zeros + head_dim;
    for (int64_t d = 0; d < head_dim; d++) zeros[d] = 0.0f; /* all-zero bits: a zero row in either format */
    /* scores: a tile of KEY_TILE keys, transposed to [d][key], against ROW_BLOCK rows at a time */
    for (int64_t t0 = base; t0 < max_len; t0 += KEY_TILE) {
        const void *keys[KEY_TILE];
        for (int u = 0; u < KEY_TILE; u++)
            keys[u] = t0 + u < max_len ? kv_at(k_head, idx[t0 + u] * kv_stride, half) : (const void *)zeros;
        transpose_key_tile(keys, head_dim, tile, half);
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            const int64_t nr = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
            if (t0 >= lens[r0 + nr - 1] || t0 + KEY_TILE <= starts[r0]) continue; /* none of these rows' keys */
            qk_dispatch((int)nr, q + r0, tile, head_dim, scale, cap, scores + r0 * s_stride + (t0 - base),
                        s_stride);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        inv[r] = softmax_numerators(scores + r * s_stride + (starts[r] - base), lens[r] - starts[r]);
    /* out = p V, ROW_BLOCK rows and 16 (or 8) features at a time; a head_dim that is not a multiple of 8
     * ends with the same sums feature by feature. From here scores are addressed by key (t - base). */
    idx += base;
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        const int64_t nr = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
        const float *sb = scores + r0 * s_stride;
        int64_t st[ROW_BLOCK], ln[ROW_BLOCK]; /* the rows' key ranges, from base */
        for (int j = 0; j < nr; j++) {
            st[j] = starts[r0 + j] - base;
            ln[j] = lens[r0 + j] - base;
        }
        int64_t d0 = 0;
        for (; d0 + 16 <= head_dim; d0 += 16)
            pv_dispatch((int)nr, 2, half, st, ln, sb, s_stride, v_head, kv_stride, idx, d0, inv + r0, out + r0);
        for (; d0 + 8 <= head_dim; d0 += 8)
            pv_dispatch((int)nr, 1, half, st, ln, sb, s_stride, v_head, kv_stride, idx, d0, inv + r0, out + r0);
        for (; d0 < head_dim; d0++) {
            for (int j = 0; j < nr; j++) {
                float acc = 0.0f;
                for (int64_t t = st[j]; t < ln[j]; t++)
                    acc += sb[j * s_stride + t] * kv_load1(kv_at(v_head, idx[t] * kv_stride + d0, half), half);
                out[r0 + j][d0] = acc * inv[r0 + j];
            }
        }
    }
}

static void attend_rows_f32(const float *const *q, int64_t rows, const int64_t *starts, const int64_t *lens,
                            int64_t head_dim, const void *k_head, const void *v_head, int64_t kv_stride,
                            const int64_t *idx, float scale, float cap, float *const *out, float *floats) {
    attend_rows(q, rows, starts, lens, head_dim, k_head, v_head, kv_stride, idx, scale, cap, out, floats, 0);
}

static void attend_rows_f16(const float *const *q, int64_t rows, const int64_t *starts, const int64_t *lens,
                            int64_t head_dim, const void *k_head, const void *v_head, int64_t kv_stride,
                            const int64_t *idx, float scale, float cap, float *const *out, float *floats) {
    attend_rows(q, rows, starts, lens, head_dim, k_head, v_head, kv_stride, idx, scale, cap, out, floats, 1);
}

typedef void (*attend_fn)(const float *const *, int64_t, const int64_t *, const int64_t *, int64_t, const void *,
                          const void *, int64_t, const int64_t *, float, float, float *const *, float *);

/* attend_rows for the pool's format */
static attend_fn attend_for(int half) { return half ? attend_rows_f16 : attend_rows_f32; }

/* Decode attention straight out of the paged KV pool: one query token per sequence, each attending over its
 * own seq_lens[b] cached tokens, whose pool slots are slots[b * slots_stride + t]; with window > 0 only
 * over the last `window` of them (a sliding window: only those keys are read), and with logit_cap > 0 its
 * scaled scores soft-capped to logit_cap * tanh(score / logit_cap). q [bs, heads * head_dim] (row stride
 * q_stride), k_pool / v_pool [pool slots, kv_heads * head_dim] (fp16 if kv_half, else fp32), out
 * [bs, heads * head_dim].
 * Query heads g * group .. g * group + group - 1 share KV head g (grouped-query attention, as Hugging Face's
 * repeat_kv). Nothing is gathered into a padded copy first, and each (sequence, KV head) is computed the same
 * way whatever else is in the batch. Returns -1 (output incomplete) if a thread's scratch cannot be
 * allocated, else 0. */
int srt_decode_attention_windowed(const float *q, int64_t bs, int64_t q_stride, int64_t heads, int64_t kv_heads,
                                  int64_t head_dim, const void *k_pool, const void *v_pool, int64_t kv_half,
                                  const int64_t *slots, int64_t slots_stride, const int64_t *seq_lens, float scale,
                                  int64_t window, float logit_cap, float *out) {
    const int64_t group = heads / kv_heads, kv_stride = kv_heads * head_dim;
    const int half = kv_half != 0;
    const attend_fn attend = attend_for(half);
    int64_t max_keys = 0;
    for (int64_t b = 0; b < bs; b++) {
        const int64_t keys = seq_lens[b] - window_start(seq_lens[b], window);
        max_keys = keys > max_keys ? keys : max_keys;
    }
    int failed = 0;
#pragma omp parallel
    {
        attend_scratch w;
        const int ok = attend_scratch_alloc(&w, group, max_keys, head_dim); /* rows of one start: no extra tile */
#pragma omp atomic update
        failed |= !ok;
#pragma omp barrier
        if (!failed) { /* every thread or none reaches the loop below */
#pragma omp for collapse(2) schedule(dynamic, 1)
            for (int64_t b = 0; b < bs; b++) {
                for (int64_t g = 0; g < kv_heads; g++) {
                    for (int64_t j = 0; j < group; j++) {
                        w.q[j] = q + b * q_stride + (g * group + j) * head_dim;
                        w.out[j] = out + (b * heads + g * group + j) * head_dim;
                        w.starts[j] = window_start(seq_lens[b], window);
                        w.lens[j] = seq_lens[b];
                    }
                    if (seq_lens[b] > 0)
                        attend(w.q, group, w.starts, w.lens, head_dim, kv_at(k_pool, g * head_dim, half),
                               kv_at(v_pool, g * head_dim, half), kv_stride, slots + b * slots_stride, scale,
                               logit_cap, w.out, w.floats);
                }
            }
        }
        attend_scratch_free(&w);
    }
    return failed ? -1 : 0;
}

/* srt_decode_attention_windowed over every cached token, uncapped (full attention). */
int srt_decode_attention(const float *q, int64_t bs, int64_t q_stride, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, const void *k_pool, const void *v_pool, int64_t kv_half,
                         const int64_t *slots, int64_t slots_stride, const int64_t *seq_lens, float scale,
                         float *out) {
    return srt_decode_attention_windowed(q, bs, q_stride, heads, kv_heads, head_dim, k_pool, v_pool, kv_half,
                                         slots, slots_stride, seq_lens, scale, 0, 0.0f, out);
}

/* Query tokens of one sequence that share a pass over its keys in an extend step. */
#define EXTEND_TOKEN_BLOCK 16

/* Causal attention of one sequence's n new tokens (an extend step: a prompt, a chunk of one, or the part of
 * one past a cached prefix) straight out of the pool, where this step's K/V have already been written: new
 * token i attends over slots[0 .. prefix_len + i] (with window > 0, over the last `window` of those only;
 * with logit_cap > 0, with its scores soft-capped), exactly as the decode step at its position would (see
 * attend_rows). q [n, heads * head_dim] (row stride q_stride), out [n, heads * head_dim]. Returns -1 (output
 * incomplete) if a thread's scratch cannot be allocated, else 0. */
int srt_extend_attention(const float *q, int64_t n, int64_t q_stride, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, const void *k_pool, const void *v_pool, int64_t kv_half,
                         const int64_t *slots, int64_t prefix_len, float scale, int64_t window, float logit_cap,
                         float *out) {
    const int64_t group = heads / kv_heads, kv_stride = kv_heads * head_dim;
    const int half = kv_half != 0;
    const attend_fn attend = attend_for(half);
    const int64_t blocks = (n + EXTEND_TOKEN_BLOCK - 1) / EXTEND_TOKEN_BLOCK;
    /* a block's keys: from its first token's window start to its last token (see scores_stride) */
    int64_t span = prefix_len + n;
    if (window > 0 && window + EXTEND_TOKEN_BLOCK - 1 < span) span = window + EXTEND_TOKEN_BLOCK - 1;
    if (window > 0) span += KEY_TILE;
    int failed = 0;
#pragma omp parallel
    {
        attend_scratch w;
        const int ok = attend_scratch_alloc(&w, EXTEND_TOKEN_BLOCK * group, span, head_dim);
#pragma omp atomic update
        failed |= !ok;
#pragma omp barrier
        if (!failed) { /* every thread or none reaches the loop below */
#pragma omp for collapse(2) schedule(dynamic, 1)
            for (int64_t blk = blocks - 1; blk >= 0; blk--) { /* longest first: dynamic scheduling balances */
                for (int64_t g = 0; g < kv_heads; g++) {
                    const int64_t i0 = blk * EXTEND_TOKEN_BLOCK;
                    const int64_t nt = n - i0 < EXTEND_TOKEN_BLOCK ? n - i0 : EXTEND_TOKEN_BLOCK;
                    for (int64_t i = 0; i < nt; i++) {
                        const int64_t len = prefix_len + i0 + i + 1;
                        for (int64_t j = 0; j < group; j++) {
                            w.q[i * group + j] = q + (i0 + i) * q_stride + (g * group + j) * head_dim;
                            w.out[i * group + j] = out + ((i0 + i) * heads + g * group + j) * head_dim;
                            w.starts[i * group + j] = window_start(len, window);
                            w.lens[i * group + j] = len;
                        }
                    }
                    attend(w.q, nt * group, w.starts, w.lens, head_dim, kv_at(k_pool, g * head_dim, half),
                           kv_at(v_pool, g * head_dim, half), kv_stride, slots, scale, logit_cap, w.out,
                           w.floats);
                }
            }
        }
        attend_scratch_free(&w);
    }
    return failed ? -1 : 0;
}
