/* The int8 linear layer: quantize a token's activations to two 7-bit levels, take the exact integer dot
 * products against the int8 weights, dequantize once (cpu_kernels_common.h says why and how exactly). */

#include "cpu_kernels_common.h"

#define ACTIVATION_MAX_F 63.0f /* activations: 7 bits a level (int8_linear.py says why) */
#define MIN_SCALE 1e-8f
#define RESIDUAL_LEVELS 126.0f
#define RESIDUAL_LEVELS_INT 126
/* The fused linear keeps up to this many activation rows (two per token) of up to MAX_K features on the
 * stack; larger calls bring their own scratch. */
#define MAX_ROWS 16
#define MAX_K 8192
/* Tokens whose quantized rows one pass over the weights multiplies: 2 * 32 rows of up to 1536 int8 features
 * (96 KiB) sit in a core's L2 next to its share of the weights. */
#define TOKEN_BLOCK 32
#define ROW_GROUP 4

int srt_isa(void) { return SRT_ISA; }
int srt_k_multiple(void) { return STEP; }
int srt_max_rows(void) { return MAX_ROWS; }
int srt_max_k(void) { return MAX_K; }

/* max |x|, exact (a maximum is the same in any order, so this equals torch's amax). Taken over the bit
 * patterns with the sign cleared: for non-negative floats their order is the integers' order, and a NaN
 * (above infinity) wins as it does in torch; integer maxima vectorize where float ones do not. */
static float absmax(const float *x, int64_t k) {
    uint32_t lane[LANES] = {0}, best = 0;
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES)
        for (int l = 0; l < LANES; l++) {
            uint32_t b;
            memcpy(&b, x + i + l, sizeof b);
            b &= 0x7fffffffu;
            lane[l] = b > lane[l] ? b : lane[l];
        }
    for (; i < k; i++) {
        uint32_t b;
        memcpy(&b, x + i, sizeof b);
        b &= 0x7fffffffu;
        best = b > best ? b : best;
    }
    for (int l = 0; l < LANES; l++) best = lane[l] > best ? lane[l] : best;
    float amax;
    memcpy(&amax, &best, sizeof amax);
    return amax;
}

/* One row's two levels: q1 = round(x / s), q2 = round((x / s - q1) * 126), s = max(absmax / 63, 1e-8). */
/* A row's scales: s = max(absmax / 63, 1e-8) for the first level, s / 126 for the residual; returns s. */
static inline float row_scales(const float *x, int64_t k, float *s1, float *s2) {
    float s = absmax(x, k) / ACTIVATION_MAX_F;
    if (!(s >= MIN_SCALE)) s = MIN_SCALE;
    *s1 = s;
    *s2 = s / RESIDUAL_LEVELS;
    return s;
}

/* x / s in two levels: *l1 = round(x / s), the returned residual level round((x / s - l1) * 126). */
static inline float levels(float x, float s, float *l1) {
    const float u = x / s, l = nearbyintf(u);
    *l1 = l;
    return nearbyintf((u - l) * RESIDUAL_LEVELS);
}

static void quantize_row(const float *x, int64_t k, int8_t *q1, int8_t *q2, float *s1, float *s2) {
    const float s = row_scales(x, k, s1, s2);
    for (int64_t i = 0; i < k; i++) {
        float l1;
        q2[i] = (int8_t)levels(x[i], s, &l1);
        q1[i] = (int8_t)l1;
    }
}

/* x [m, k] (row stride x_stride) -> q [2m, k] int8, scale [2m]: rows m..2m-1 hold the residual level. */
void srt_quantize_two_level(const float *x, int64_t m, int64_t k, int64_t x_stride, int8_t *q, float *scale) {
#pragma omp parallel for if (m * k >= 65536) schedule(static)
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * x_stride, k, q + r * k, q + (m + r) * k, scale + r, scale + m + r);
}

/* The one dequantization every linear-layer path shares: the two levels' exact integer dot products
 * become one integer (126 * level 1 + level 2: the residual level's unit is 1/126 of the first's), which
 * is converted to fp32 once and scaled by the channel's scale, then the residual level's scale s / 126
 * (the PyTorch path's order). */
static inline float dequantize_exact(int64_t exact, float wscale, float s2) {
    return ((float)exact * wscale) * s2;
}

static inline float dequantize(int64_t dot1, int64_t dot2, float wscale, float s2) {
    return dequantize_exact(dot1 * RESIDUAL_LEVELS_INT + dot2, wscale, s2);
}

/* out[r, j] = dequantize(acc[r, j], acc[m + r, j], wscale[j], scale[m + r]) (+ bias[j]) for the int32 products
 * acc [2m, n] of the quantized rows (first levels, then residuals) with the weight. */
void srt_combine_two_level(const int32_t *acc, const float *scale, const float *wscale, int64_t m, int64_t n,
                           const float *bias, float *out) {
#pragma omp parallel for if (m * n >= 65536) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const int32_t *a1 = acc + r * n, *a2 = acc + (m + r) * n;
        const float s2 = scale[m + r];
        float *o = out + r * n;
        for (int64_t j = 0; j < n; j++) {
            const float v = dequantize(a1[j], a2[j], wscale[j], s2);
            o[j] = bias ? v + bias[j] : v;
        }
    }
}

/* quantize_row's two levels of one token, written as v = 126 * q1 + q2 (the same operations). */
static void quantize_token16(const float *x, int64_t k, int16_t *v, float *s1, float *s2) {
    const float s = row_scales(x, k, s1, s2);
    for (int64_t i = 0; i < k; i++) {
        float l1;
        const int32_t l2 = (int32_t)levels(x[i], s, &l1);
        v[i] = (int16_t)((int32_t)l1 * RESIDUAL_LEVELS_INT + l2);
    }
}

/* The fused linear layer. Both SIMD forms multiply each token's two levels as one int16 activation,
 * v = 126 * q1 + q2 (|v| <= 8001), against the int8 weights widened to int16, summing pairs exactly into
 * int32: the exact integer 126 * dot1 + dot2 of the dequantization comes out of the products themselves, with
 * one horizontal sum a product instead of two. The portable loop multiplies the byte levels as they are
 * (dot_rows_n). All reach the same integers, so the same bits. */

#if SRT_ISA >= 1
/* What both SIMD forms share. Sums of up to K_CHUNK products are exact in int32 (8001 * 127 * 2048 < 2^31);
 * longer rows add their chunks in int64. */
#define K_CHUNK 2048
/* A thread takes its weight rows in chunks that stay in L2 while every token group of a block passes. */
#define WEIGHT_CHUNK_BYTES (96 * 1024)
/* ... and at least this many chunks a thread, handed out as threads come free (schedule(dynamic)): a core
 * this process shares (with the HTTP process, the detokenizer, a benchmark's client) no longer holds up a
 * block while the other core waits for its fixed half. Against equal static shares, alternating on a 2-core
 * AMD EPYC: a bs-64 decode step 115-134 ms against 155-159, a 512-token prefill 727-736 ms against 868-906. */
#define CHUNKS_PER_THREAD 4
#endif

#if SRT_ISA == 1
/* AVX2: one vpmaddwd multiplies 16 int16 activations by 16 widened weights, per 32 products two multiply
 * instructions where the byte levels took four (a vpmaddubsw and a vpmaddwd for each level). */
#define TILE_W 2 /* weight rows a tile multiplies at once */
#define TILE_A 4 /* activation rows (tokens) a tile multiplies at once */
#define TILE_STORES_ANY_ROWS 0 /* tile_store takes full tiles of TILE_A tokens only */
/* A tile reads two weight rows side by side, which the hardware prefetcher follows poorly: a decode step
 * streamed its weights at 2/3 of the speed of reading one row at a time. So the tiles prefetch the rows
 * ahead themselves (2 * i: how far into the pair of rows, which lie back to back, a tile has read; a
 * prefetch never faults, even past the weight's end). 4 KiB ahead measured best (2 KiB close, 8 KiB worse). */
#define WEIGHT_PREFETCH_BYTES 4096

static inline int32_t hsum8(__m256i c) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* The full tile, 2 weight rows x 4 activation rows over k <= K_CHUNK: the 8 dots, lane a * TILE_W + r.
 * Written in assembly because GCC 12 compiled the same intrinsics with a register copy per accumulator and step and
 * ran at 60 % of this loop's speed (2-core AMD EPYC). */
static inline __m256i tile_sums(const int16_t *a, int64_t a_stride, const int8_t *w, int64_t w_stride, int64_t k) {
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
            c31 = c00;
    const int8_t *w0 = w, *w1 = w + w_stride;
    const int16_t *a0 = a, *a1 = a + a_stride, *a2 = a + 2 * a_stride, *a3 = a + 3 * a_stride;
    for (int64_t i = 0; i < k; i += STEP) {
        _mm_prefetch((const char *)(w + 2 * i + WEIGHT_PREFETCH_BYTES), _MM_HINT_T0);
        __m256i x0, x1, t, u;
        __asm__("vpmovsxbw (%[w0],%[i]), %[x0]\n\t"
                "vpmovsxbw (%[w1],%[i]), %[x1]\n\t"
                "vpmaddwd (%[a0],%[i],2), %[x0], %[t]\n\t"
                "vpmaddwd (%[a0],%[i],2), %[x1], %[u]\n\t"
                "vpaddd %[t], %[c00], %[c00]\n\t"
                "vpaddd %[u], %[c01], %[c01]\n\t"
                "vpmaddwd (%[a1],%[i],2), %[x0], %[t]\n\t"
                "vpmaddwd (%[a1],%[i],2), %[x1], %[u]\n\t"
                "vpaddd %[t], %[c10], %[c10]\n\t"
                "vpaddd %[u], %[c11], %[c11]\n\t"
                "vpmaddwd (%[a2],%[i],2), %[x0], %[t]\n\t"
                "vpmaddwd (%[a2],%[i],2), %[x1], %[u]\n\t"
                "vpaddd %[t], %[c20], %[c20]\n\t"
                "vpaddd %[u], %[c21], %[c21]\n\t"
                "vpmaddwd (%[a3],%[i],2), %[x0], %[t]\n\t"
                "vpmaddwd (%[a3],%[i],2), %[x1], %[u]\n\t"
                "vpaddd %[t], %[c30], %[c30]\n\t"
                "vpaddd %[u], %[c31], %[c31]"
                : [c00] "+x"(c00), [c01] "+x"(c01), [c10] "+x"(c10), [c11] "+x"(c11), [c20] "+x"(c20),
                  [c21] "+x"(c21), [c30] "+x"(c30), [c31] "+x"(c31), [x0] "=&x"(x0), [x1] "=&x"(x1),
                  [t] "=&x"(t), [u] "=&x"(u)
                : [w0] "r"(w0), [w1] "r"(w1), [a0] "r"(a0), [a1] "r"(a1), [a2] "r"(a2), [a3] "r"(a3), [i] "r"(i)
                : "memory");
    }
    const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(c00, c01), _mm256_hadd_epi32(c10, c11));
    const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(c20, c21), _mm256_hadd_epi32(c30, c31));
    return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
}

static inline void tile_full(const int16_t *a, int64_t a_stride, const int8_t *w, int64_t w_stride, int64_t k,
                             int64_t *acc) {
    int32_t sums[8];
    _mm256_storeu_si256((__m256i *)sums, tile_sums(a, a_stride, w, w_stride, k));
    for (int x = 0; x < 8; x++) acc[x] += sums[x];
}

/* A full tile over a whole row of k <= K_CHUNK, dequantized and stored as vectors: the 8 exact int32 sums
 * (tokens a0..a0+3 x channels j, j+1) convert to fp32 as the int64 path does (exact integers, one
 * rounding), then (x channel scale) x residual scale (+ bias), the same operations in the same order. */
static inline void tile_store(const int16_t *a, int64_t k, int na, const int8_t *w, const float *wscale,
                              const float *s2, const float *bias, float *out, int64_t n) {
    (void)na; /* TILE_A: the caller stores only full tiles this way */
    const __m256 e = _mm256_cvtepi32_ps(tile_sums(a, k, w, k, k));
    double wpair, bpair;
    memcpy(&wpair, wscale, sizeof wpair);
    const __m256 ws = _mm256_castpd_ps(_mm256_set1_pd(wpair));
    const __m128 s = _mm_loadu_ps(s2);
    const __m256 ss = _mm256_set_m128(_mm_unpackhi_ps(s, s), _mm_unpacklo_ps(s, s));
    __m256 o = _mm256_mul_ps(_mm256_mul_ps(e, ws), ss);
    if (bias) {
        memcpy(&bpair, bias, sizeof bpair);
        o = _mm256_add_ps(o, _mm256_castpd_ps(_mm256_set1_pd(bpair)));
    }
    const __m128 lo = _mm256_castps256_ps128(o), hi = _mm256_extractf128_ps(o, 1);
    _mm_storel_pi((__m64 *)out, lo);
    _mm_storeh_pi((__m64 *)(out + n), lo);
    _mm_storel_pi((__m64 *)(out + 2 * n), hi);
    _mm_storeh_pi((__m64 *)(out + 3 * n), hi);
}

/* A partial tile (NA activation rows, NW weight rows, constants after inlining): the rows a block or a
 * chunk leaves over, and every decode step of fewer than 4 sequences. */
ALWAYS_INLINE void tile_part(const int16_t *a, int64_t a_stride, const int NA, const int8_t *w, int64_t w_stride,
                             const int NW, int64_t k, int64_t *acc) {
    __m256i c[TILE_A][TILE_W];
    for (int x = 0; x < NA; x++)
        for (int r = 0; r < NW; r++) c[x][r] = _mm256_setzero_si256();
    for (int64_t i = 0; i < k; i += STEP) {
        _mm_prefetch((const char *)(w + 2 * i + WEIGHT_PREFETCH_BYTES), _MM_HINT_T0);
        __m256i wv[TILE_W];
        for (int r = 0; r < NW; r++) wv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + r * w_stride + i)));
        for (int x = 0; x < NA; x++) {
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a + x * a_stride + i));
            for (int r = 0; r < NW; r++) c[x][r] = _mm256_add_epi32(c[x][r], _mm256_madd_epi16(av, wv[r]));
        }
    }
    for (int x = 0; x < NA; x++)
        for (int r = 0; r < NW; r++) acc[x * TILE_W + r] += hsum8(c[x][r]);
}

static inline void tile(const int16_t *a, int64_t a_stride, int na, const int8_t *w, int64_t w_stride, int nw,
                        int64_t k, int64_t *acc) {
    if (na == TILE_A && nw == TILE_W) {
        tile_full(a, a_stride, w, w_stride, k, acc);
    } else if (nw == TILE_W) {
        switch (na) {
        case 1: tile_part(a, a_stride, 1, w, w_stride, 2, k, acc); break;
        case 2: tile_part(a, a_stride, 2, w, w_stride, 2, k, acc); break;
        default: tile_part(a, a_stride, 3, w, w_stride, 2, k, acc); break;
        }
    } else {
        for (int x = 0; x < na; x++) tile_part(a + x * a_stride, a_stride, 1, w, w_stride, 1, k, acc + x * TILE_W);
    }
}

#elif SRT_ISA == 2
/* AVX-512 VNNI: one vpdpwssd multiplies 32 int16 activations by 32 widened weights and adds the pairs into
 * 16 int32 lanes. A tile is 4 weight rows x 4 tokens, 16 accumulators: each weight vector loaded serves 4
 * tokens, each activation vector 4 weight rows, and the 16 sums are reduced together (sum_four, sum_blocks:
 * 21 shuffles and adds for 16 dots, where one accumulator at a time takes about 8 each). The byte levels'
 * vpdpbusd, which this replaced, does as many products an instruction but needs two a token (one a level),
 * an unsigned offset and a reduction a level, with one weight row at a time: a decode step's 120 linear
 * layers at 8 tokens took 12.0 ms against 7.5-9.2 now, at 16 tokens 25 against 11.5 (2-core AMD EPYC
 * Zen 4, scripts/bench_int8_gemm.py). The tile's four rows are read side by side: the loop prefetches them
 * ahead as one stream (4 KiB measured best against 2, 8 and 16). */
#define TILE_W 4
#define TILE_A 4
#define TILE_STORES_ANY_ROWS 1 /* tile_store takes 1..TILE_A tokens */
#define WEIGHT_PREFETCH_BYTES 4096

/* a, b, c, d -> per 128-bit block [sum a, sum b, sum c, sum d] over that block's lanes */
static inline __m512i sum_four(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

/* g0..g3 (each as sum_four leaves it) -> block x holds g_x summed over its four blocks */
static inline __m512i sum_blocks(__m512i g0, __m512i g1, __m512i g2, __m512i g3) {
    const __m512i s01 = _mm512_add_epi32(_mm512_shuffle_i32x4(g0, g1, 0x44), _mm512_shuffle_i32x4(g0, g1, 0xee));
    const __m512i s23 = _mm512_add_epi32(_mm512_shuffle_i32x4(g2, g3, 0x44), _mm512_shuffle_i32x4(g2, g3, 0xee));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(s01, s23, 0x88), _mm512_shuffle_i32x4(s01, s23, 0xdd));
}

/* The NA x NW dots of a tile (constants after inlining) over k <= K_CHUNK, a multiple of STEP: lane
 * x * TILE_W + r is token x with weight row r (absent ones 0). The tile's weight rows lie back to back and
 * are read side by side, so the loop prefetches a line of each row ahead (4 * i: how far into the rows the
 * tile has read, as if they were one stream). */
ALWAYS_INLINE __m512i tile_sums(const int16_t *a, int64_t a_stride, const int NA, const int8_t *w, int64_t w_stride,
                                const int NW, int64_t k) {
    __m512i c[TILE_A][TILE_W];
#pragma GCC unroll 4
    for (int x = 0; x < TILE_A; x++)
#pragma GCC unroll 4
        for (int r = 0; r < TILE_W; r++) c[x][r] = _mm512_setzero_si512();
    for (int64_t i = 0; i < k; i += STEP) {
#pragma GCC unroll 4
        for (int r = 0; r < NW; r++)
            _mm_prefetch((const char *)(w + TILE_W * i + r * STEP + WEIGHT_PREFETCH_BYTES), _MM_HINT_T0);
#pragma GCC unroll 2
        for (int h = 0; h < STEP; h += STEP / 2) {
            __m512i wv[TILE_W];
#pragma GCC unroll 4
            for (int r = 0; r < NW; r++)
                wv[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + r * w_stride + i + h)));
#pragma GCC unroll 4
            for (int x = 0; x < NA; x++) {
                const __m512i av = _mm512_loadu_si512((const void *)(a + x * a_stride + i + h));
#pragma GCC unroll 4
                for (int r = 0; r < NW; r++) c[x][r] = _mm512_dpwssd_epi32(c[x][r], av, wv[r]);
            }
        }
    }
    return sum_blocks(sum_four(c[0][0], c[0][1], c[0][2], c[0][3]), sum_four(c[1][0], c[1][1], c[1][2], c[1][3]),
                      sum_four(c[2][0], c[2][1], c[2][2], c[2][3]), sum_four(c[3][0], c[3][1], c[3][2], c[3][3]));
}

ALWAYS_INLINE void tile_add(const int16_t *a, int64_t a_stride, const int NA, const int8_t *w, int64_t w_stride,
                            const int NW, int64_t k, int64_t *acc) {
    int32_t sums[TILE_A * TILE_W];
    _mm512_storeu_si512((void *)sums, tile_sums(a, a_stride, NA, w, w_stride, NW, k));
    for (int x = 0; x < TILE_A * TILE_W; x++) acc[x] += sums[x];
}

/* tile_add for any 1..TILE_A tokens and 1..TILE_W weight rows, each pair its own specialized copy. */
static inline void tile(const int16_t *a, int64_t a_stride, int na, const int8_t *w, int64_t w_stride, int nw,
                        int64_t k, int64_t *acc) {
#define TILE_CASE(NA, NW) \
    case (NA - 1) * TILE_W + NW - 1: tile_add(a, a_stride, NA, w, w_stride, NW, k, acc); break
    switch ((na - 1) * TILE_W + nw - 1) {
        TILE_CASE(1, 1); TILE_CASE(1, 2); TILE_CASE(1, 3); TILE_CASE(1, 4);
        TILE_CASE(2, 1); TILE_CASE(2, 2); TILE_CASE(2, 3); TILE_CASE(2, 4);
        TILE_CASE(3, 1); TILE_CASE(3, 2); TILE_CASE(3, 3); TILE_CASE(3, 4);
        TILE_CASE(4, 1); TILE_CASE(4, 2); TILE_CASE(4, 3);
        default: tile_add(a, a_stride, 4, w, w_stride, 4, k, acc); break;
    }
#undef TILE_CASE
}

/* A tile of NA tokens x TILE_W weight rows over a whole row of k <= K_CHUNK, dequantized and stored as
 * vectors: the exact int32 sums convert to fp32 as the int64 path does (exact integers, one rounding), then
 * (x channel scale) x residual scale (+ bias), the same operations in the same order. */
ALWAYS_INLINE void tile_store_n(const int16_t *a, int64_t k, const int NA, const int8_t *w, const float *wscale,
                                const float *s2, const float *bias, float *out, int64_t n) {
    const __m512 e = _mm512_cvtepi32_ps(tile_sums(a, k, NA, w, k, TILE_W, k));
    float s[TILE_A] = {0};
    for (int x = 0; x < NA; x++) s[x] = s2[x];
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512 ss = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(s)));
    __m512 o = _mm512_mul_ps(_mm512_mul_ps(e, _mm512_broadcast_f32x4(_mm_loadu_ps(wscale))), ss);
    if (bias) o = _mm512_add_ps(o, _mm512_broadcast_f32x4(_mm_loadu_ps(bias)));
    float res[TILE_A * TILE_W];
    _mm512_storeu_ps(res, o);
    for (int x = 0; x < NA; x++) memcpy(out + x * n, res + x * TILE_W, TILE_W * sizeof(float));
}

static inline void tile_store(const int16_t *a, int64_t k, int na, const int8_t *w, const float *wscale,
                              const float *s2, const float *bias, float *out, int64_t n) {
    switch (na) {
    case 1: tile_store_n(a, k, 1, w, wscale, s2, bias, out, n); break;
    case 2: tile_store_n(a, k, 2, w, wscale, s2, bias, out, n); break;
    case 3: tile_store_n(a, k, 3, w, wscale, s2, bias, out, n); break;
    default: tile_store_n(a, k, 4, w, wscale, s2, bias, out, n); break;
    }
}
#endif

#if SRT_ISA >= 1
/* srt_w8a8_linear with SIMD: v [m, k] int16 and vscale [2m] (s1, then s2 per token) are the scratch. */
static void linear16(const float *x, int64_t m, int64_t k, int64_t x_stride, const int8_t *w, const float *wscale,
                     const float *bias, int64_t n, float *out, int16_t *v, float *vscale) {
#pragma omp parallel if (m * n * k >= 32768)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++) quantize_token16(x + t * x_stride, k, v + t * k, vscale + t, vscale + m + t);
        const int64_t threads = omp_get_num_threads();
        int64_t chunks = (n * k + WEIGHT_CHUNK_BYTES - 1) / WEIGHT_CHUNK_BYTES;
        if (chunks < CHUNKS_PER_THREAD * threads) chunks = CHUNKS_PER_THREAD * threads;
        int64_t chunk = (n + chunks - 1) / chunks;
        chunk = (chunk + TILE_W - 1) / TILE_W * TILE_W;
        for (int64_t b0 = 0; b0 < m; b0 += TOKEN_BLOCK) {
            const int64_t tb = m - b0 < TOKEN_BLOCK ? m - b0 : TOKEN_BLOCK;
#pragma omp for schedule(dynamic, 1)
            for (int64_t j0 = 0; j0 < n; j0 += chunk) {
                const int64_t j1 = j0 + chunk < n ? j0 + chunk : n;
                for (int64_t a0 = b0; a0 < b0 + tb; a0 += TILE_A) {
                    const int na = b0 + tb - a0 < TILE_A ? (int)(b0 + tb - a0) : TILE_A;
                    int64_t j = j0;
                    if ((TILE_STORES_ANY_ROWS || na == TILE_A) && k <= K_CHUNK)
                        for (; j + TILE_W <= j1; j += TILE_W)
                            tile_store(v + a0 * k, k, na, w + j * k, wscale + j, vscale + m + a0, bias ? bias + j : NULL,
                                       out + a0 * n + j, n);
                    for (; j < j1; j += TILE_W) {
                        const int nw = j1 - j < TILE_W ? (int)(j1 - j) : TILE_W;
                        int64_t acc[TILE_A * TILE_W] = {0};
                        for (int64_t k0 = 0; k0 < k; k0 += K_CHUNK)
                            tile(v + a0 * k + k0, k, na, w + j * k + k0, k, nw, k - k0 < K_CHUNK ? k - k0 : K_CHUNK, acc);
                        for (int x2 = 0; x2 < na; x2++)
                            for (int r = 0; r < nw; r++) {
                                /* acc is already the exact integer 126 * dot1 + dot2 */
                                const float o = dequantize_exact(acc[x2 * TILE_W + r], wscale[j + r], vscale[m + a0 + x2]);
                                out[(a0 + x2) * n + j + r] = bias ? o + bias[j + r] : o;
                            }
                    }
                }
            }
        }
    }
}
#else
/* The portable form: dot products of R byte-level activation rows (each k bytes) with one weight row, R a
 * compile-time constant after inlining (see dot_rows). */
static inline __attribute__((always_inline)) void dot_rows_n(const uint8_t *a, int64_t k, const int R,
                                                             const int8_t *w, int32_t *res) {
    for (int r = 0; r < R; r++) {
        int32_t acc = 0;
        for (int64_t i = 0; i < k; i++) acc += (int32_t)(int8_t)a[r * k + i] * (int32_t)w[i];
        res[r] = acc;
    }
}

/* dot_rows_n for 1..ROW_GROUP rows, each count its own specialized copy. */
static inline void dot_rows(const uint8_t *a, int64_t k, int64_t rows, const int8_t *w, int32_t *res) {
    switch (rows) {
    case 1: dot_rows_n(a, k, 1, w, res); break;
    case 2: dot_rows_n(a, k, 2, w, res); break;
    case 3: dot_rows_n(a, k, 3, w, res); break;
    default: dot_rows_n(a, k, 4, w, res); break;
    }
}


#endif

/* The whole W8A8 linear layer: quantize x [m, k] in two levels, multiply by the int8 weight w [n, k]
 * (row-major, channel scales wscale [n]), dequantize and add the bias: out [m, n]. k must
 * be a multiple of srt_k_multiple(). Tokens go in blocks of TOKEN_BLOCK whose quantized rows stay in cache
 * while every weight row passes over them; each thread takes a share of the weight rows. Up to MAX_ROWS / 2
 * tokens (decode) the quantized rows live on the stack; more need the caller's scratch q [2m, k] and qscale
 * [2m]. Exact integer products and the one dequantization of the PyTorch path, so a token's bits depend
 * neither on m nor on its block. */
void srt_w8a8_linear(const float *x, int64_t m, int64_t k, int64_t x_stride, const int8_t *w,
                     const float *wscale, const float *bias, int64_t n, float *out, int8_t *q, float *qscale) {
    int8_t small_q[MAX_ROWS * MAX_K] __attribute__((aligned(64)));
    float small_scale[MAX_ROWS];
    if (2 * m <= MAX_ROWS && k <= MAX_K) {
        q = small_q;
        qscale = small_scale;
    }
#if SRT_ISA >= 1
    linear16(x, m, k, x_stride, w, wscale, bias, n, out, (int16_t *)(void *)q, qscale);
#else
#pragma omp parallel if (m * n * k >= 32768)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++) {
            /* token t of block b = t / TOKEN_BLOCK (tb tokens): its rows are 2 * b0 + (t - b0) and that + tb */
            const int64_t b0 = t - t % TOKEN_BLOCK, tb = m - b0 < TOKEN_BLOCK ? m - b0 : TOKEN_BLOCK;
            const int64_t r1 = 2 * b0 + (t - b0), r2 = r1 + tb;
            quantize_row(x + t * x_stride, k, q + r1 * k, q + r2 * k, qscale + r1, qscale + r2);
        }
        for (int64_t b0 = 0; b0 < m; b0 += TOKEN_BLOCK) {
            const int64_t tb = m - b0 < TOKEN_BLOCK ? m - b0 : TOKEN_BLOCK, rows = 2 * tb;
            const uint8_t *a = (const uint8_t *)q + 2 * b0 * k;
            const float *s = qscale + 2 * b0;
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n; j++) {
                const int8_t *wj = w + j * k;
                int32_t acc[2 * TOKEN_BLOCK];
                for (int64_t r = 0; r < rows; r += ROW_GROUP)
                    dot_rows(a + r * k, k, rows - r < ROW_GROUP ? rows - r : ROW_GROUP, wj, acc + r);
                for (int64_t r = 0; r < tb; r++) {
                    const float o = dequantize(acc[r], acc[tb + r], wscale[j], s[tb + r]);
                    out[(b0 + r) * n + j] = bias ? o + bias[j] : o;
                }
            }
        }
    }
#endif
}
