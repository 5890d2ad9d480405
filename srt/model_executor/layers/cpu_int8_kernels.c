/* srt's CPU kernels for the int8 model, built at first use by cpu_kernels.py with this machine's compiler
 * and -march=native, and called through ctypes.
 *
 * Why they exist: at decode sizes a W8A8 linear layer through PyTorch is a dozen small ops (quantize,
 * matmul, rescale, combine the two activation levels, bias) and oneDNN's packed int8 linear has a fixed
 * cost of ~25 us per call; together they made int8 decode overhead-bound. Here one call does the whole layer
 * for a few rows, and two more calls replace the quantize and combine op chains around oneDNN's kernel at
 * larger sizes. The decoder's other op chains (RMSNorm, SiLU x up, rotary embedding, attention over the
 * paged pool for extend and decode steps) get one call each as well.
 *
 * Numerics: the linear-layer functions and the rotary embedding reproduce the PyTorch ops they replace to
 * the bit (checked at load on a probe and by the tests): a linear layer's two activation levels meet in one
 * exact integer per output (126 * level-1 dot + level-2 dot), dequantized once in fp32 in the PyTorch
 * path's order; no FMA contraction (built with -ffp-contract=off), round half to even (nearbyintf in the
 * default rounding mode, as torch.round). The norm, activation and
 * attention kernels sum in their own fixed order instead (see below). Every row is computed on its own, so
 * no result depends on the batch, and attention gives a token the same bits in an extend step as in a
 * decode step: the int8 model is batch-invariant (test/unit/test_batch_invariance.py).
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_num_threads(void) { return 1; }
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SRT_ISA 2 /* 64-byte steps with vpdpbusd */
#define STEP 64
#elif defined(__AVX2__)
#include <immintrin.h>
#define SRT_ISA 1 /* 16 int16 activations a step, vpmaddwd against widened int8 weights */
#define STEP 16
#else
#define SRT_ISA 0 /* portable loop: correct, not fast (cpu_kernels.py does not use it for speed) */
#define STEP 1
#endif

#define ACTIVATION_MAX_F 63.0f /* activations: 7 bits a level (int8_linear.py says why) */
#define MIN_SCALE 1e-8f
#define RESIDUAL_LEVELS 126.0f
#define RESIDUAL_LEVELS_INT 126
#define ACTIVATION_OFFSET 64 /* VNNI: 7-bit activations + 64 are unsigned bytes of at most 127 */
/* The fused linear keeps up to this many activation rows (two per token) of up to MAX_K features on the
 * stack; larger calls bring their own scratch. */
#define MAX_ROWS 16
#define MAX_K 8192
/* Tokens whose quantized rows one pass over the weights multiplies: 2 * 32 rows of up to 1536 int8 features
 * (96 KiB) sit in a core's L2 next to its share of the weights. */
#define TOKEN_BLOCK 32
#define ROW_GROUP 4
/* How far ahead of the weight rows being read the VNNI loop prefetches: a thread streams its share of the
 * rows in order, and without the hint a decode step read its weights at ~15 GB/s. */
#define PREFETCH_BYTES 8192

#define ALWAYS_INLINE static inline __attribute__((always_inline))

int srt_isa(void) { return SRT_ISA; }
int srt_k_multiple(void) { return STEP; }
int srt_max_rows(void) { return MAX_ROWS; }
int srt_max_k(void) { return MAX_K; }

/* Reductions keep LANES independent partial results, which the compiler vectorizes (one running value
 * would be a serial chain: floating-point addition is not associative, so it may not reorder it). */
#define LANES 16

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

static float sum_squares(const float *x, int64_t k) {
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += x[i + l] * x[i + l];
    float ss = 0.0f;
    for (; i < k; i++) ss += x[i] * x[i];
    for (int l = 0; l < LANES; l++) ss += lane[l];
    return ss;
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

/* The fused linear layer, in two forms: AVX2 multiplies each token's two levels as one int16 activation
 * (below); VNNI and the portable loop multiply the byte levels as they are (dot_rows_n). Both reach the
 * same integers, so the same bits. */

#if SRT_ISA == 1
/* AVX2. A token's two 7-bit levels are one int16, v = 126 * q1 + q2 (|v| <= 8001), and one vpmaddwd
 * multiplies 16 of them by 16 weights widened to int16, summing pairs exactly into int32: per 32 products
 * that is two multiply instructions where the byte levels took four (a vpmaddubsw and a vpmaddwd for each
 * level), and the products need no offset. The weights stay int8 in memory, so a decode step reads as many
 * bytes as before. Sums of up to K_CHUNK products are exact in int32 (8001 * 127 * 2048 < 2^31); longer
 * rows add their chunks in int64. */
#define K_CHUNK 2048
#define TILE_W 2 /* weight rows a tile multiplies at once */
#define TILE_A 4 /* activation rows a tile multiplies at once */
/* A thread takes its weight rows in chunks that stay in L2 while every token group of a block passes. */
#define WEIGHT_CHUNK_BYTES (96 * 1024)
/* A tile reads two weight rows side by side, which the hardware prefetcher follows poorly: a decode step
 * streamed its weights at 2/3 of the speed of reading one row at a time. So the tiles prefetch the rows
 * ahead themselves (2 * i: how far into the pair of rows, which lie back to back, a tile has read; a
 * prefetch never faults, even past the weight's end). 4 KiB ahead measured best (2 KiB close, 8 KiB worse). */
#define WEIGHT_PREFETCH_BYTES 4096

/* quantize_row's two levels of one token, written as v = 126 * q1 + q2 (the same operations). */
static void quantize_token16(const float *x, int64_t k, int16_t *v, float *s1, float *s2) {
    const float s = row_scales(x, k, s1, s2);
    for (int64_t i = 0; i < k; i++) {
        float l1;
        const int32_t l2 = (int32_t)levels(x[i], s, &l1);
        v[i] = (int16_t)((int32_t)l1 * RESIDUAL_LEVELS_INT + l2);
    }
}

static inline int32_t hsum8(__m256i c) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* The full tile, 2 weight rows x 4 activation rows over k <= K_CHUNK: acc[a * TILE_W + r] += dot. Written in
 * assembly because GCC 12 compiled the same intrinsics with a register copy per accumulator and step and
 * ran at 60 % of this loop's speed (2-core AMD EPYC). */
static inline void tile_full(const int16_t *a, int64_t a_stride, const int8_t *w, int64_t w_stride, int64_t k,
                             int64_t *acc) {
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
    int32_t sums[8];
    _mm256_storeu_si256((__m256i *)sums, _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20),
                                                          _mm256_permute2x128_si256(g0, g1, 0x31)));
    for (int x = 0; x < 8; x++) acc[x] += sums[x];
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

/* srt_w8a8_linear on AVX2: v [m, k] int16 and vscale [2m] (s1, then s2 per token) are the scratch. */
static void linear16(const float *x, int64_t m, int64_t k, int64_t x_stride, const int8_t *w, const float *wscale,
                     const float *bias, int64_t n, float *out, int16_t *v, float *vscale) {
#pragma omp parallel if (m * n * k >= 32768)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++) quantize_token16(x + t * x_stride, k, v + t * k, vscale + t, vscale + m + t);
        /* Chunks of whole tiles, small enough to stay in L2, as many for every thread: the static schedule
         * then gives the threads equal shares (uneven ones left a thread idle for a quarter of a decode step). */
        const int64_t threads = omp_get_num_threads();
        int64_t chunks = (n * k + WEIGHT_CHUNK_BYTES - 1) / WEIGHT_CHUNK_BYTES;
        chunks = (chunks + threads - 1) / threads * threads;
        int64_t chunk = (n + chunks - 1) / chunks;
        chunk = (chunk + TILE_W - 1) / TILE_W * TILE_W;
        for (int64_t b0 = 0; b0 < m; b0 += TOKEN_BLOCK) {
            const int64_t tb = m - b0 < TOKEN_BLOCK ? m - b0 : TOKEN_BLOCK;
#pragma omp for schedule(static)
            for (int64_t j0 = 0; j0 < n; j0 += chunk) {
                const int64_t j1 = j0 + chunk < n ? j0 + chunk : n;
                for (int64_t a0 = b0; a0 < b0 + tb; a0 += TILE_A) {
                    const int na = b0 + tb - a0 < TILE_A ? (int)(b0 + tb - a0) : TILE_A;
                    for (int64_t j = j0; j < j1; j += TILE_W) {
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
/* Dot products of R activation rows (each k bytes, `a` laid out as the ISA wants) with one weight row,
 * R a compile-time constant after inlining (see dot_rows), so the R accumulators live in registers and no
 * work is spent on absent rows. With VNNI the 7-bit activations are stored offset to unsigned (q + 64, at
 * most 127), as vpdpbusd multiplies u8 by s8; the caller removes the offset's share, 64 * sum(w). */
static inline __attribute__((always_inline)) void dot_rows_n(const uint8_t *a, int64_t k, const int R,
                                                             const int8_t *w, int32_t *res) {
#if SRT_ISA == 2
    __m512i c[ROW_GROUP];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) c[r] = _mm512_setzero_si512();
    for (int64_t i = 0; i < k; i += STEP) {
        _mm_prefetch((const char *)(w + i + PREFETCH_BYTES), _MM_HINT_T0);
        const __m512i wv = _mm512_loadu_si512((const void *)(w + i));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            c[r] = _mm512_dpbusd_epi32(c[r], _mm512_loadu_si512((const void *)(a + r * k + i)), wv);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) res[r] = _mm512_reduce_add_epi32(c[r]);
#else
    for (int r = 0; r < R; r++) {
        int32_t acc = 0;
        for (int64_t i = 0; i < k; i++) acc += (int32_t)(int8_t)a[r * k + i] * (int32_t)w[i];
        res[r] = acc;
    }
#endif
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

/* One token's two quantized rows, each laid out as dot_rows_n reads them (offset to unsigned with VNNI). */
static inline void quantize_token(const float *x, int64_t k, int8_t *q1, int8_t *q2, float *s1, float *s2) {
    quantize_row(x, k, q1, q2, s1, s2);
#if SRT_ISA == 2
    for (int64_t i = 0; i < k; i++) {
        q1[i] = (int8_t)(q1[i] + ACTIVATION_OFFSET);
        q2[i] = (int8_t)(q2[i] + ACTIVATION_OFFSET);
    }
#endif
}
#endif

/* The whole W8A8 linear layer: quantize x [m, k] in two levels, multiply by the int8 weight w [n, k]
 * (row-major, channel scales wscale [n], row sums wsum [n]), dequantize and add the bias: out [m, n]. k must
 * be a multiple of srt_k_multiple(). Tokens go in blocks of TOKEN_BLOCK whose quantized rows stay in cache
 * while every weight row passes over them; each thread takes a share of the weight rows. Up to MAX_ROWS / 2
 * tokens (decode) the quantized rows live on the stack; more need the caller's scratch q [2m, k] and qscale
 * [2m]. Exact integer products and the one dequantization of the PyTorch path, so a token's bits depend
 * neither on m nor on its block. */
void srt_w8a8_linear(const float *x, int64_t m, int64_t k, int64_t x_stride, const int8_t *w,
                     const float *wscale, const int32_t *wsum, const float *bias, int64_t n, float *out,
                     int8_t *q, float *qscale) {
    int8_t small_q[MAX_ROWS * MAX_K] __attribute__((aligned(64)));
    float small_scale[MAX_ROWS];
    if (2 * m <= MAX_ROWS && k <= MAX_K) {
        q = small_q;
        qscale = small_scale;
    }
#if SRT_ISA == 1
    (void)wsum;
    linear16(x, m, k, x_stride, w, wscale, bias, n, out, (int16_t *)(void *)q, qscale);
#else
#if SRT_ISA == 2
    const int32_t offset = ACTIVATION_OFFSET;
#else
    const int32_t offset = 0;
#endif
#pragma omp parallel if (m * n * k >= 32768)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++) {
            /* token t of block b = t / TOKEN_BLOCK (tb tokens): its rows are 2 * b0 + (t - b0) and that + tb */
            const int64_t b0 = t - t % TOKEN_BLOCK, tb = m - b0 < TOKEN_BLOCK ? m - b0 : TOKEN_BLOCK;
            const int64_t r1 = 2 * b0 + (t - b0), r2 = r1 + tb;
            quantize_token(x + t * x_stride, k, q + r1 * k, q + r2 * k, qscale + r1, qscale + r2);
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
                const int64_t off = (int64_t)offset * wsum[j];
                for (int64_t r = 0; r < tb; r++) {
                    const float o = dequantize(acc[r] - off, acc[tb + r] - off, wscale[j], s[tb + r]);
                    out[(b0 + r) * n + j] = bias ? o + bias[j] : o;
                }
            }
        }
    }
#endif
}

/* The decoder's elementwise steps, for the int8 path (cpu_kernels.py): one call each instead of a chain of
 * PyTorch ops. They are not bit-equal to PyTorch's (sums and exp in another order) and need not be: the
 * int8 model uses them at every batch size, so its results still do not depend on the batch. */

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

/* e^x to about 2 ulp in a form the compiler vectorizes (libm's expf is a scalar call): x = n ln2 + r with
 * ln2 split in two for an exact reduction, then a degree-6 polynomial for e^r on |r| <= ln2 / 2 (the
 * classic single-precision minimax coefficients), scaled by 2^n through the exponent bits. */
static inline float exp_vec(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
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

/* Attention. Both kernels below come to attend_rows, which fixes one order of operations per query head:
 * score(t) = (sum over d, in order, of q[d] k_t[d]) * scale; softmax_numerators (a maximum, exp_v8, and a
 * sum whose order depends on the length only); then out[d] = (sum over t, in order, of p_t v_t[d]) *
 * (1 / sum). K and V come from an fp32 or fp16 pool, widened to fp32 exactly. The blocking over query
 * rows, key tiles and head-dimension blocks only decides which of these operations run side by side, never
 * their order, so a token's attention is the same to the bit whether it was computed in its prompt's
 * prefill, in one chunk of it, after a prefix-cache hit, or in the decode step at its position (with
 * -ffp-contract=off, nothing is fused or reassociated). */
#define KEY_TILE 8   /* keys scored at once: one 8-float vector per query row */
#define ROW_BLOCK 6  /* query rows sharing one load of a key tile or value row */

/* One thread's scratch for attend_rows: up to `rows` query rows over up to `len` keys. */
typedef struct {
    const float **q;
    float **out;
    int64_t *lens;
    float *floats; /* scores [rows][len rounded up to KEY_TILE], key tile, a zero row, 1 / sum per row */
} attend_scratch;

static int attend_scratch_alloc(attend_scratch *w, int64_t rows, int64_t len, int64_t head_dim) {
    const int64_t padded = (len + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    w->q = malloc(sizeof(*w->q) * (size_t)rows);
    w->out = malloc(sizeof(*w->out) * (size_t)rows);
    w->lens = malloc(sizeof(*w->lens) * (size_t)rows);
    w->floats = malloc(sizeof(float) * (size_t)(rows * padded + head_dim * KEY_TILE + head_dim + rows));
    return w->q && w->out && w->lens && w->floats;
}

static void attend_scratch_free(attend_scratch *w) {
    free(w->q);
    free(w->out);
    free(w->lens);
    free(w->floats);
}

/* Eight floats as one vector value (GCC/Clang vector extension: an AVX register where there is one, else
 * pairs of SSE registers or scalars; the arithmetic is elementwise IEEE either way). aligned(4): loads and
 * stores of any float address. */
typedef float v8f __attribute__((vector_size(32), aligned(4)));

static inline v8f v8f_splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* The pool holds K/V in fp32 or fp16 (`half`, a constant wherever it is tested: every function that reads
 * the pool is inlined into one copy per format). fp16 becomes fp32 exactly, by F16C where the CPU has it,
 * else bit by bit: both give the same floats. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, nan */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        uint32_t shifts = 0;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            shifts++;
        }
        bits = sign | ((113u - shifts) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* fp32 -> fp16, rounding to nearest even as PyTorch's conversion does (NaNs aside: any NaN stays a NaN). */
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);   /* nan */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* inf, or rounds up to it (>= 65520) */
    if (ax < 0x38800000u) {                                    /* below 2^-14: a subnormal half (or 0) */
        float a;
        memcpy(&a, &ax, sizeof a);
        return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f)); /* in units of 2^-24, exact scaling */
    }
    const uint32_t rebiased = ax - 0x38000000u; /* exponent bias 127 -> 15 */
    return (uint16_t)(sign | ((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13));
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

/* Columns [d0, d0 + 8 nvec) of the output of nr query rows (scores row j at scores + j * s_stride, keys
 * idx[0..lens[j])): the sum over keys in order, each value row loaded once for all nr rows. nr and nvec are
 * constants where this is inlined (see pv_dispatch), so the nr x nvec accumulators stay in registers. */
ALWAYS_INLINE void pv_columns(const int nr, const int nvec, const int half, const int64_t *lens,
                              const float *scores, int64_t s_stride, const void *v_head, int64_t kv_stride,
                              const int64_t *idx, int64_t d0, const float *inv, float *const *out) {
    v8f acc[ROW_BLOCK][2];
    for (int j = 0; j < nr; j++)
        for (int c = 0; c < nvec; c++) acc[j][c] = v8f_splat(0.0f);
    const int64_t common = lens[0], last = lens[nr - 1];
    for (int64_t t = 0; t < common; t++) {
        const void *v = kv_at(v_head, idx[t] * kv_stride + d0, half);
        v8f vv[2];
        for (int c = 0; c < nvec; c++) vv[c] = kv_load8(kv_at(v, 8 * c, half), half);
        for (int j = 0; j < nr; j++)
            for (int c = 0; c < nvec; c++) acc[j][c] += scores[j * s_stride + t] * vv[c];
    }
    for (int64_t t = common; t < last; t++) { /* causal tail: only the rows whose keys reach t */
        const void *v = kv_at(v_head, idx[t] * kv_stride + d0, half);
        for (int j = 0; j < nr; j++)
            if (t < lens[j])
                for (int c = 0; c < nvec; c++)
                    acc[j][c] += scores[j * s_stride + t] * kv_load8(kv_at(v, 8 * c, half), half);
    }
    for (int j = 0; j < nr; j++)
        for (int c = 0; c < nvec; c++) *(v8f *)(out[j] + d0 + 8 * c) = acc[j][c] * inv[j];
}

#define PV_CASE(n, nvec) \
    case n: pv_columns(n, nvec, half, lens, scores, s_stride, v_head, kv_stride, idx, d0, inv, out); break;

ALWAYS_INLINE void pv_dispatch(int nr, const int nvec, const int half, const int64_t *lens, const float *scores,
                               int64_t s_stride, const void *v_head, int64_t kv_stride, const int64_t *idx,
                               int64_t d0, const float *inv, float *const *out) {
    if (nvec == 2) {
        switch (nr) { PV_CASE(1, 2) PV_CASE(2, 2) PV_CASE(3, 2) PV_CASE(4, 2) PV_CASE(5, 2) PV_CASE(6, 2) }
    } else {
        switch (nr) { PV_CASE(1, 1) PV_CASE(2, 1) PV_CASE(3, 1) PV_CASE(4, 1) PV_CASE(5, 1) PV_CASE(6, 1) }
    }
}

/* Scores of nr query rows against one transposed key tile ([d][key], KEY_TILE keys): each row's sum over d
 * in order, then the scale. nr is a constant where this is inlined (see qk_dispatch). */
ALWAYS_INLINE void qk_tile(const int nr, const float *const *q, const float *tile, int64_t head_dim, float scale,
                           float *scores, int64_t s_stride) {
    v8f acc[ROW_BLOCK];
    for (int j = 0; j < nr; j++) acc[j] = v8f_splat(0.0f);
    for (int64_t d = 0; d < head_dim; d++) {
        const v8f kd = *(const v8f *)(tile + d * KEY_TILE);
        for (int j = 0; j < nr; j++) acc[j] += q[j][d] * kd;
    }
    for (int j = 0; j < nr; j++) *(v8f *)(scores + j * s_stride) = acc[j] * scale;
}

#define QK_CASE(n) \
    case n: qk_tile(n, q, tile, head_dim, scale, scores, s_stride); break;

static void qk_dispatch(int nr, const float *const *q, const float *tile, int64_t head_dim, float scale,
                        float *scores, int64_t s_stride) {
    switch (nr) { QK_CASE(1) QK_CASE(2) QK_CASE(3) QK_CASE(4) QK_CASE(5) QK_CASE(6) }
}

typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

/* a where mask, else b (mask lanes all ones or all zeros, as vector comparisons give them) */
static inline v8f v8f_select(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* exp_vec on eight lanes: the same operations, with round-to-nearest-even done by adding and subtracting
 * 1.5 * 2^23 (exact for |x| < 2^22, which the clamp guarantees) instead of a call to nearbyintf. */
static inline v8f exp_v8(v8f x) {
    const v8f lo = v8f_splat(-87.0f), hi = v8f_splat(88.0f), shifter = v8f_splat(12582912.0f);
    x = v8f_select(x < lo, lo, x);
    x = v8f_select(x > hi, hi, x);
    const v8f n = (x * 1.44269504088896341f + shifter) - shifter;
    v8f r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v8f p = v8f_splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8f)bits;
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

/* `rows` query rows (row r at q[r]) attending over the keys/values whose pool slots are idx[0..lens[r]):
 * k_head / v_head point at one KV head's features in slot 0 and slots are kv_stride elements apart (fp16
 * if `half`). lens must not decrease with r. out[r] receives the head_dim outputs of row r. `floats`:
 * attend_scratch's. */
ALWAYS_INLINE void attend_rows(const float *const *q, int64_t rows, const int64_t *lens, int64_t head_dim,
                               const void *k_head, const void *v_head, int64_t kv_stride, const int64_t *idx,
                               float scale, float *const *out, float *floats, const int half) {
    const int64_t max_len = lens[rows - 1];
    const int64_t s_stride = (max_len + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    float *scores = floats, *tile = scores + rows * s_stride, *zeros = tile + head_dim * KEY_TILE;
    float *inv = zeros + head_dim;
    for (int64_t d = 0; d < head_dim; d++) zeros[d] = 0.0f; /* all-zero bits: a zero row in either format */
    /* scores: a tile of KEY_TILE keys, transposed to [d][key], against ROW_BLOCK rows at a time */
    for (int64_t t0 = 0; t0 < max_len; t0 += KEY_TILE) {
        const void *keys[KEY_TILE];
        for (int u = 0; u < KEY_TILE; u++)
            keys[u] = t0 + u < max_len ? kv_at(k_head, idx[t0 + u] * kv_stride, half) : (const void *)zeros;
        transpose_key_tile(keys, head_dim, tile, half);
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            const int64_t nr = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
            if (t0 >= lens[r0 + nr - 1]) continue; /* past every key of these rows */
            qk_dispatch((int)nr, q + r0, tile, head_dim, scale, scores + r0 * s_stride + t0, s_stride);
        }
    }
    for (int64_t r = 0; r < rows; r++) inv[r] = softmax_numerators(scores + r * s_stride, lens[r]);
    /* out = p V, ROW_BLOCK rows and 16 (or 8) features at a time; a head_dim that is not a multiple of 8
     * ends with the same sums feature by feature */
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        const int64_t nr = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
        const float *sb = scores + r0 * s_stride;
        int64_t d0 = 0;
        for (; d0 + 16 <= head_dim; d0 += 16)
            pv_dispatch((int)nr, 2, half, lens + r0, sb, s_stride, v_head, kv_stride, idx, d0, inv + r0, out + r0);
        for (; d0 + 8 <= head_dim; d0 += 8)
            pv_dispatch((int)nr, 1, half, lens + r0, sb, s_stride, v_head, kv_stride, idx, d0, inv + r0, out + r0);
        for (; d0 < head_dim; d0++) {
            for (int j = 0; j < nr; j++) {
                float acc = 0.0f;
                for (int64_t t = 0; t < lens[r0 + j]; t++)
                    acc += sb[j * s_stride + t] * kv_load1(kv_at(v_head, idx[t] * kv_stride + d0, half), half);
                out[r0 + j][d0] = acc * inv[r0 + j];
            }
        }
    }
}

static void attend_rows_f32(const float *const *q, int64_t rows, const int64_t *lens, int64_t head_dim,
                            const void *k_head, const void *v_head, int64_t kv_stride, const int64_t *idx,
                            float scale, float *const *out, float *floats) {
    attend_rows(q, rows, lens, head_dim, k_head, v_head, kv_stride, idx, scale, out, floats, 0);
}

static void attend_rows_f16(const float *const *q, int64_t rows, const int64_t *lens, int64_t head_dim,
                            const void *k_head, const void *v_head, int64_t kv_stride, const int64_t *idx,
                            float scale, float *const *out, float *floats) {
    attend_rows(q, rows, lens, head_dim, k_head, v_head, kv_stride, idx, scale, out, floats, 1);
}

typedef void (*attend_fn)(const float *const *, int64_t, const int64_t *, int64_t, const void *, const void *,
                          int64_t, const int64_t *, float, float *const *, float *);

/* attend_rows for the pool's format */
static attend_fn attend_for(int half) { return half ? attend_rows_f16 : attend_rows_f32; }

/* Decode attention straight out of the paged KV pool: one query token per sequence, each attending over its
 * own seq_lens[b] cached tokens, whose pool slots are slots[b * slots_stride + t]. q [bs, heads * head_dim]
 * (row stride q_stride), k_pool / v_pool [pool slots, kv_heads * head_dim] (fp16 if kv_half, else fp32),
 * out [bs, heads * head_dim].
 * Query heads g * group .. g * group + group - 1 share KV head g (grouped-query attention, as Hugging Face's
 * repeat_kv). Nothing is gathered into a padded copy first, and each (sequence, KV head) is computed the same
 * way whatever else is in the batch. Returns -1 (output incomplete) if a thread's scratch cannot be
 * allocated, else 0. */
int srt_decode_attention(const float *q, int64_t bs, int64_t q_stride, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, const void *k_pool, const void *v_pool, int64_t kv_half,
                         const int64_t *slots, int64_t slots_stride, const int64_t *seq_lens, float scale,
                         float *out) {
    const int64_t group = heads / kv_heads, kv_stride = kv_heads * head_dim;
    const int half = kv_half != 0;
    const attend_fn attend = attend_for(half);
    int64_t max_len = 0;
    for (int64_t b = 0; b < bs; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int failed = 0;
#pragma omp parallel
    {
        attend_scratch w;
        const int ok = attend_scratch_alloc(&w, group, max_len, head_dim);
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
                        w.lens[j] = seq_lens[b];
                    }
                    if (seq_lens[b] > 0)
                        attend(w.q, group, w.lens, head_dim, kv_at(k_pool, g * head_dim, half),
                               kv_at(v_pool, g * head_dim, half), kv_stride, slots + b * slots_stride, scale, w.out,
                               w.floats);
                }
            }
        }
        attend_scratch_free(&w);
    }
    return failed ? -1 : 0;
}

/* Query tokens of one sequence that share a pass over its keys in an extend step. */
#define EXTEND_TOKEN_BLOCK 16

/* Causal attention of one sequence's n new tokens (an extend step: a prompt, a chunk of one, or the part of
 * one past a cached prefix) straight out of the pool, where this step's K/V have already been written: new
 * token i attends over slots[0 .. prefix_len + i], exactly as the decode step at its position would (see
 * attend_rows). q [n, heads * head_dim] (row stride q_stride), out [n, heads * head_dim]. Returns -1 (output
 * incomplete) if a thread's scratch cannot be allocated, else 0. */
int srt_extend_attention(const float *q, int64_t n, int64_t q_stride, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, const void *k_pool, const void *v_pool, int64_t kv_half,
                         const int64_t *slots, int64_t prefix_len, float scale, float *out) {
    const int64_t group = heads / kv_heads, kv_stride = kv_heads * head_dim;
    const int half = kv_half != 0;
    const attend_fn attend = attend_for(half);
    const int64_t blocks = (n + EXTEND_TOKEN_BLOCK - 1) / EXTEND_TOKEN_BLOCK;
    int failed = 0;
#pragma omp parallel
    {
        attend_scratch w;
        const int ok = attend_scratch_alloc(&w, EXTEND_TOKEN_BLOCK * group, prefix_len + n, head_dim);
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
                        for (int64_t j = 0; j < group; j++) {
                            w.q[i * group + j] = q + (i0 + i) * q_stride + (g * group + j) * head_dim;
                            w.out[i * group + j] = out + ((i0 + i) * heads + g * group + j) * head_dim;
                            w.lens[i * group + j] = prefix_len + i0 + i + 1;
                        }
                    }
                    attend(w.q, nt * group, w.lens, head_dim, kv_at(k_pool, g * head_dim, half),
                           kv_at(v_pool, g * head_dim, half), kv_stride, slots, scale, w.out, w.floats);
                }
            }
        }
        attend_scratch_free(&w);
    }
    return failed ? -1 : 0;
}
