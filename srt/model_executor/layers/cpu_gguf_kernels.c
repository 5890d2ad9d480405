/* Matrix products over GGUF's block formats (ggml's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, and F32/F16/BF16
 * rows), read where they lie (a memory map of the file): gguf_linear.py checks every operand and calls these.
 *
 * One decoded form serves every block type. A weight row is decoded a chunk at a time (COL_CHUNK
 * elements, in L1) into unsigned bytes u, a float scale per lane of 4 elements (sc4) and a float offset per
 * group of 16 (mn16), with a per-type integer offset OFF: element i is sc4[i/4] * (u[i] - OFF) + mn16[i/16].
 * That is each format's own dequantization, in its own float operations (gguf-py's order: the dequantized
 * rows equal gguf.quants.dequantize to the bit), and the only code that differs by type (decode_*).
 *
 * Activations are quantized per block of 32 as ggml's Q8_0 (int8, scale amax / 127), once per call for all
 * parts of a fused layer (srt_gguf_quantize_rows), with per lane the block scale (d4) and the sum of the
 * lane's 4 int8 values (s4), and per group of 16 the scaled sum (m16). A weight lane's contribution is then
 * sc4 * d4 * (sum(u * a) - OFF * s4), an exact integer scaled once, and a group's offset mn16 * m16: the
 * integer dot of 4 bytes is one lane of vpdpbusd (AVX-512 VNNI) or of vpmaddubsw + vpmaddwd (AVX2), and the
 * decoded chunk is reused by every token of the call (a decode step of 16 sequences decodes each weight block
 * once, not 16 times). Compared with the exact product of the dequantized weight and the fp32 activations,
 * each output differs by at most sum_i |w_i| * d_block(i) / 2 (the rounding of a to the nearest int8 step):
 * gguf_linear.py's docstring says what that costs and what it buys.
 *
 * srt_gguf_matmul_exact keeps fp32 activations instead, with each chunk of a row dequantized exactly into L1:
 * F32, F16 and BF16 rows always take it (small tensors in the files srt runs: exact is free there), and any
 * quantized type where a caller wants the fp32 product (the reference of an end-to-end comparison).
 *
 * Results depend on a token's own row only (the order of a row's sums is fixed by cols), never on the batch. */

#include "cpu_kernels_common.h"

#if defined(__F16C__) && !defined(__AVX2__)
#include <immintrin.h>
#endif

/* ggml type numbers (gguf.GGMLQuantizationType) */
#define GGML_F32 0
#define GGML_F16 1
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q8_0 8
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14
#define GGML_BF16 30

#define QK 32       /* activation block (and Q4_0/Q4_1/Q8_0's weight block) */
#define QK_K 256    /* K-quant super-block */
#define LANE 4      /* elements of one int32 lane of the integer dot */
#define GROUP 16    /* elements of one weight offset (Q6_K's sub-block; coarser scales repeat) */
#define ACT_MAX 127.0f
/* Elements of a weight row decoded at once: u, sc4 and mn16 of one chunk take 4.6 KiB of L1. */
#define COL_CHUNK 2048
/* Tokens whose activations one pass over a decoded chunk multiplies, and one tile of them (the vector
 * accumulators of a tile stay in registers while each weight vector is loaded once for all of them). */
#define TOKEN_BLOCK 32
#define TOKEN_TILE 4
/* Rows of the weight one OpenMP task takes (schedule(dynamic): a core the process shares with others does
 * not hold up the call with a fixed half) and the least work worth a parallel region. */
#define ROW_TASK 16
#define PARALLEL_MIN_MACS 65536

/* ---- block layouts (ggml-common.h): bytes of one block, elements of one block ---- */

static int64_t type_bytes(int qtype) {
    switch (qtype) {
    case GGML_F32: return 4;
    case GGML_F16: return 2;
    case GGML_BF16: return 2;
    case GGML_Q4_0: return 2 + QK / 2;
    case GGML_Q4_1: return 4 + QK / 2;
    case GGML_Q8_0: return 2 + QK;
    case GGML_Q4_K: return 4 + 12 + QK_K / 2;
    case GGML_Q5_K: return 4 + 12 + QK_K / 8 + QK_K / 2;
    case GGML_Q6_K: return QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
    default: return 0;
    }
}

static int64_t type_elements(int qtype) {
    switch (qtype) {
    case GGML_F32: case GGML_F16: case GGML_BF16: return 1;
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q8_0: return QK;
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return QK_K;
    default: return 0;
    }
}

/* The ABI's sizes, for gguf_linear.py to check its tables against (0: a type this library cannot run). */
int64_t srt_gguf_type_bytes(int qtype) { return type_bytes(qtype); }
int64_t srt_gguf_type_elements(int qtype) { return type_elements(qtype); }
/* Bytes of one token's quantized activations (srt_gguf_quantize_rows): a [cols] int8, d4 [cols/4] float,
 * s4 [cols/4] int32, m16 [cols/16] float. */
int64_t srt_gguf_act_row_bytes(int64_t cols) { return cols + cols + cols + cols / 4; }

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return half_to_float(h);
#endif
}

static inline float bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---- decoding: nb blocks of one row into u, sc4, mn16 (see the top of the file) ---- */

static inline void fill(float *p, int n, float v) {
    for (int i = 0; i < n; i++) p[i] = v;
}

static void decode_q4_0(const uint8_t *b, int64_t nb, uint8_t *u, float *sc4, float *mn16) {
    for (int64_t k = 0; k < nb; k++, b += 2 + QK / 2, u += QK, sc4 += QK / LANE, mn16 += QK / GROUP) {
        const uint8_t *q = b + 2;
        for (int j = 0; j < QK / 2; j++) {
            u[j] = q[j] & 0x0f;
            u[j + QK / 2] = q[j] >> 4;
        }
        fill(sc4, QK / LANE, fp16(b));
        fill(mn16, QK / GROUP, 0.0f);
    }
}

static void decode_q4_1(const uint8_t *b, int64_t nb, uint8_t *u, float *sc4, float *mn16) {
    for (int64_t k = 0; k < nb; k++, b += 4 + QK / 2, u += QK, sc4 += QK / LANE, mn16 += QK / GROUP) {
        const uint8_t *q = b + 4;
        for (int j = 0; j < QK / 2; j++) {
            u[j] = q[j] & 0x0f;
            u[j + QK / 2] = q[j] >> 4;
        }
        fill(sc4, QK / LANE, fp16(b));
        fill(mn16, QK / GROUP, fp16(b + 2));
    }
}

static void decode_q8_0(const uint8_t *b, int64_t nb, uint8_t *u, float *sc4, float *mn16) {
    for (int64_t k = 0; k < nb; k++, b += 2 + QK, u += QK, sc4 += QK / LANE, mn16 += QK / GROUP) {
        for (int j = 0; j < QK; j++) u[j] = b[2 + j] ^ 0x80; /* int8 q as q + 128 */
        fill(sc4, QK / LANE, fp16(b));
        fill(mn16, QK / GROUP, 0.0f);
    }
}

/* Q4_K/Q5_K's 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32 (ggml's get_scale_min_k4) */
static inline void scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* Q4_K and Q5_K (HIGH: the fifth bit from qh): d and dmin fp16, scales, [qh,] qs; sub-block j of 32 takes
 * the low nibbles of qs[32 * (j / 2) ..] for even j, the high ones for odd j; value (d * sc) * q - dmin * m. */
ALWAYS_INLINE void decode_k45(const uint8_t *b, int64_t nb, uint8_t *u, float *sc4, float *mn16, const int HIGH) {
    const int64_t bytes = HIGH ? type_bytes(GGML_Q5_K) : type_bytes(GGML_Q4_K);
    for (int64_t k = 0; k < nb; k++, b += bytes, u += QK_K, sc4 += QK_K / LANE, mn16 += QK_K / GROUP) {
        const float d = fp16(b), dmin = fp16(b + 2);
        uint8_t sc[8], mn[8];
        scale_min_k4(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = b + 16 + (HIGH ? QK_K / 8 : 0);
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) {
                const uint8_t hi0 = HIGH ? ((qh[l] >> (2 * g)) & 1) << 4 : 0, hi1 = HIGH ? ((qh[l] >> (2 * g + 1)) & 1) << 4 : 0;
                u[64 * g + l] = (qs[32 * g + l] & 0x0f) | hi0;
                u[64 * g + 32 + l] = (qs[32 * g + l] >> 4) | hi1;
            }
        for (int j = 0; j < 8; j++) {
            fill(sc4 + 8 * j, 8, d * (float)sc[j]);
            fill(mn16 + 2 * j, 2, -(dmin * (float)mn[j]));
        }
    }
}

/* Q6_K: ql [128], qh [64], 16 int8 scales, d fp16. Element 128 h + i takes the low (i < 64) or high nibble of
 * ql[64 h + i % 64] and bits 2 (i / 32) of qh[32 h + i % 32] above them; value (d * sc) * (q - 32). */
static void decode_q6_k(const uint8_t *b, int64_t nb, uint8_t *u, float *sc4, float *mn16) {
    for (int64_t k = 0; k < nb; k++, b += type_bytes(GGML_Q6_K), u += QK_K, sc4 += QK_K / LANE, mn16 += QK_K / GROUP) {
        const uint8_t *ql = b, *qh = b + QK_K / 2;
        const int8_t *sc = (const int8_t *)(b + QK_K / 2 + QK_K / 4);
        const float d = fp16(b + QK_K / 2 + QK_K / 4 + QK_K / 16);
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t a = ql[64 * h + l], b2 = ql[64 * h + 32 + l], hb = qh[32 * h + l];
                u[128 * h + l] = (a & 0x0f) | ((hb & 3) << 4);
                u[128 * h + 32 + l] = (b2 & 0x0f) | (((hb >> 2) & 3) << 4);
                u[128 * h + 64 + l] = (a >> 4) | (((hb >> 4) & 3) << 4);
                u[128 * h + 96 + l] = (b2 >> 4) | (((hb >> 6) & 3) << 4);
            }
        for (int j = 0; j < QK_K / GROUP; j++) fill(sc4 + 4 * j, 4, d * (float)sc[j]);
        fill(mn16, QK_K / GROUP, 0.0f);
    }
}

/* The integer offset OFF of each type's decoded bytes (see the top of the file). */
#define OFF_Q4_0 8
#define OFF_Q8_0 128
#define OFF_Q6_K 32

/* Elements [c0, c0 + n) of one row (c0 and n multiples of the type's block) into u, sc4, mn16. */
ALWAYS_INLINE void decode(const int QTYPE, const uint8_t *row, int64_t c0, int64_t n, uint8_t *u, float *sc4,
                          float *mn16) {
    const int64_t per = type_elements(QTYPE), first = c0 / per, nb = n / per;
    const uint8_t *b = row + first * type_bytes(QTYPE);
    switch (QTYPE) {
    case GGML_Q4_0: decode_q4_0(b, nb, u, sc4, mn16); break;
    case GGML_Q4_1: decode_q4_1(b, nb, u, sc4, mn16); break;
    case GGML_Q8_0: decode_q8_0(b, nb, u, sc4, mn16); break;
    case GGML_Q4_K: decode_k45(b, nb, u, sc4, mn16, 0); break;
    case GGML_Q5_K: decode_k45(b, nb, u, sc4, mn16, 1); break;
    default: decode_q6_k(b, nb, u, sc4, mn16); break;
    }
}

/* ---- activations ---- */

/* x [m, cols] (row stride x_stride, cols a multiple of 32) -> act [m, srt_gguf_act_row_bytes(cols)]: per block
 * of 32, d = amax / 127 and a = round(x * 127 / amax) (|a| <= 127; an all-zero block has d = 0, a = 0; a
 * block with an infinity or NaN has d = NaN, so its outputs are NaN as an fp32 product's would be). */
void srt_gguf_quantize_rows(const float *x, int64_t m, int64_t cols, int64_t x_stride, uint8_t *act) {
    const int64_t row_bytes = srt_gguf_act_row_bytes(cols);
#pragma omp parallel for if (m * cols >= PARALLEL_MIN_MACS) schedule(static)
    for (int64_t t = 0; t < m; t++) {
        const float *xr = x + t * x_stride;
        uint8_t *base = act + t * row_bytes;
        int8_t *a = (int8_t *)base;
        float *d4 = (float *)(void *)(base + cols), *m16 = (float *)(void *)(base + 3 * cols);
        int32_t *s4 = (int32_t *)(void *)(base + 2 * cols);
        for (int64_t c = 0; c < cols; c += QK) {
            float amax = 0.0f;
            int finite = 1;
            for (int i = 0; i < QK; i++) {
                const float v = fabsf(xr[c + i]);
                finite &= v <= 3.40282347e38f; /* false for an infinity and a NaN */
                amax = v > amax ? v : amax;
            }
            const float d = finite ? amax / ACT_MAX : NAN, id = finite && amax > 0.0f ? ACT_MAX / amax : 0.0f;
            for (int i = 0; i < QK; i++) a[c + i] = finite ? (int8_t)nearbyintf(xr[c + i] * id) : 0;
            for (int l = 0; l < QK / LANE; l++) {
                const int8_t *al = a + c + LANE * l;
                d4[c / LANE + l] = d;
                s4[c / LANE + l] = al[0] + al[1] + al[2] + al[3];
            }
            for (int g = 0; g < QK / GROUP; g++) {
                const int32_t *sg = s4 + (c + GROUP * g) / LANE;
                m16[(c + GROUP * g) / GROUP] = d * (float)(sg[0] + sg[1] + sg[2] + sg[3]);
            }
        }
    }
}

/* One token's activations for the chunk [c0, ..) of a row */
typedef struct {
    const int8_t *a;
    const float *d4;
    const int32_t *s4;
    const float *m16;
} ActChunk;

static inline ActChunk act_chunk(const uint8_t *act_row, int64_t cols, int64_t c0) {
    ActChunk c;
    c.a = (const int8_t *)act_row + c0;
    c.d4 = (const float *)(const void *)(act_row + cols) + c0 / LANE;
    c.s4 = (const int32_t *)(const void *)(act_row + 2 * cols) + c0 / LANE;
    c.m16 = (const float *)(const void *)(act_row + 3 * cols) + c0 / GROUP;
    return c;
}

/* ---- the dot of a decoded chunk (n elements, a multiple of 32) with NT tokens' activations, added to acc ----
 * OFF: the type's integer offset; MIN: whether it has group offsets (mn16); SIGNED8: the bytes are int8
 * values + 128 (Q8_0), which the AVX2 form multiplies as signed (vpmaddubsw takes unsigned bytes below 64
 * only without saturating: 2 * 63 * 127 < 2^15; Q8_0's |q| <= 128 by sign, 2 * 128 * 127 < 2^15). */

#if SRT_ISA == 2
ALWAYS_INLINE void dot_tile(const uint8_t *u, const float *sc4, const float *mn16, int64_t n, const ActChunk *ac,
                            const int NT, const int OFF, const int MIN, const int SIGNED8, float *acc) {
    (void)SIGNED8;
    __m512 v[TOKEN_TILE], w[TOKEN_TILE];
    for (int t = 0; t < NT; t++) v[t] = w[t] = _mm512_setzero_ps();
    const int shift = OFF ? __builtin_ctz(OFF) : 0;
    for (int64_t i = 0; i < n; i += 64) {
        /* a chunk of 32 mod 64 ends with half a vector: its upper lanes load as zeros and add nothing */
        const __mmask64 mb = n - i >= 64 ? ~(__mmask64)0 : (__mmask64)0xffffffffu;
        const __mmask16 ml = n - i >= 64 ? (__mmask16)0xffff : (__mmask16)0xff;
        const __m512i uv = _mm512_maskz_loadu_epi8(mb, u + i);
        const __m512 sv = _mm512_maskz_loadu_ps(ml, sc4 + i / LANE);
        for (int t = 0; t < NT; t++) {
            __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), uv, _mm512_maskz_loadu_epi8(mb, ac[t].a + i));
            if (OFF) dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(_mm512_maskz_loadu_epi32(ml, ac[t].s4 + i / LANE), shift));
            const __m512 scale = _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(ml, ac[t].d4 + i / LANE));
            v[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, v[t]);
        }
    }
    if (MIN)
        for (int64_t g = 0; g < n / GROUP; g += 16) {
            const __mmask16 ml = n / GROUP - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n / GROUP - g)) - 1);
            const __m512 mv = _mm512_maskz_loadu_ps(ml, mn16 + g);
            for (int t = 0; t < NT; t++) w[t] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(ml, ac[t].m16 + g), w[t]);
        }
    for (int t = 0; t < NT; t++) acc[t] += _mm512_reduce_add_ps(v[t]) + _mm512_reduce_add_ps(w[t]);
}

#elif SRT_ISA == 1
static inline float hsum_ps8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 fmadd8(__m256 a, __m256 b, __m256 c) {
#ifdef __FMA__
    return _mm256_fmadd_ps(a, b, c);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}

ALWAYS_INLINE void dot_tile(const uint8_t *u, const float *sc4, const float *mn16, int64_t n, const ActChunk *ac,
                            const int NT, const int OFF, const int MIN, const int SIGNED8, float *acc) {
    __m256 v[TOKEN_TILE];
    float wsum[TOKEN_TILE];
    for (int t = 0; t < NT; t++) {
        v[t] = _mm256_setzero_ps();
        wsum[t] = 0.0f;
    }
    const int shift = OFF ? __builtin_ctz(OFF) : 0;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int64_t i = 0; i < n; i += 32) {
        __m256i uv = _mm256_loadu_si256((const __m256i *)(u + i)), q = uv;
        if (SIGNED8) {
            q = _mm256_xor_si256(uv, flip); /* the int8 values themselves */
            uv = _mm256_abs_epi8(q);
        }
        const __m256 sv = _mm256_loadu_ps(sc4 + i / LANE);
        for (int t = 0; t < NT; t++) {
            __m256i av = _mm256_loadu_si256((const __m256i *)(ac[t].a + i));
            if (SIGNED8) av = _mm256_sign_epi8(av, q);
            __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(uv, av), ones);
            if (OFF && !SIGNED8)
                dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(ac[t].s4 + i / LANE)), shift));
            const __m256 scale = _mm256_mul_ps(sv, _mm256_loadu_ps(ac[t].d4 + i / LANE));
            v[t] = fmadd8(_mm256_cvtepi32_ps(dot), scale, v[t]);
        }
    }
    if (MIN)
        for (int t = 0; t < NT; t++) {
            float lane[8] = {0};
            int64_t g = 0;
            for (; g + 8 <= n / GROUP; g += 8)
                for (int l = 0; l < 8; l++) lane[l] += mn16[g + l] * ac[t].m16[g + l];
            for (; g < n / GROUP; g++) lane[0] += mn16[g] * ac[t].m16[g];
            for (int l = 0; l < 8; l++) wsum[t] += lane[l];
        }
    for (int t = 0; t < NT; t++) acc[t] += hsum_ps8(v[t]) + wsum[t];
}

#else
/* Portable: the same lanes and the same integers, summed in LANES float partial sums. */
ALWAYS_INLINE void dot_tile(const uint8_t *u, const float *sc4, const float *mn16, int64_t n, const ActChunk *ac,
                            const int NT, const int OFF, const int MIN, const int SIGNED8, float *acc) {
    (void)SIGNED8;
    for (int t = 0; t < NT; t++) {
        float lane[LANES] = {0}, wl[LANES] = {0};
        for (int64_t l = 0; l < n / LANE; l++) {
            int32_t dot = 0;
            for (int i = 0; i < LANE; i++) dot += (int32_t)u[LANE * l + i] * (int32_t)ac[t].a[LANE * l + i];
            dot -= OFF * ac[t].s4[l];
            lane[l % LANES] += (float)dot * (sc4[l] * ac[t].d4[l]);
        }
        if (MIN)
            for (int64_t g = 0; g < n / GROUP; g++) wl[g % LANES] += mn16[g] * ac[t].m16[g];
        float s = 0.0f;
        for (int l = 0; l < LANES; l++) s += lane[l] + wl[l];
        acc[t] += s;
    }
}
#endif

/* dot_tile for 1..TOKEN_TILE tokens, each count its own specialized copy */
ALWAYS_INLINE void dot_tokens(const uint8_t *u, const float *sc4, const float *mn16, int64_t n, const ActChunk *ac,
                              int nt, const int OFF, const int MIN, const int SIGNED8, float *acc) {
    switch (nt) {
    case 1: dot_tile(u, sc4, mn16, n, ac, 1, OFF, MIN, SIGNED8, acc); break;
    case 2: dot_tile(u, sc4, mn16, n, ac, 2, OFF, MIN, SIGNED8, acc); break;
    case 3: dot_tile(u, sc4, mn16, n, ac, 3, OFF, MIN, SIGNED8, acc); break;
    default: dot_tile(u, sc4, mn16, n, ac, 4, OFF, MIN, SIGNED8, acc); break;
    }
}

/* out[t, j] for the rows [j0, j1) and tokens [b0, b0 + tb): each chunk of a row decoded once for the tokens */
ALWAYS_INLINE void rows_times_tokens(const int QTYPE, const uint8_t *act, int64_t b0, int64_t tb, const uint8_t *w,
                                     int64_t w_stride, int64_t j0, int64_t j1, int64_t cols, float *out,
                                     int64_t out_stride) {
    const int OFF = QTYPE == GGML_Q4_0 ? OFF_Q4_0 : QTYPE == GGML_Q8_0 ? OFF_Q8_0 : QTYPE == GGML_Q6_K ? OFF_Q6_K : 0;
    const int MIN = QTYPE == GGML_Q4_1 || QTYPE == GGML_Q4_K || QTYPE == GGML_Q5_K;
    const int SIGNED8 = QTYPE == GGML_Q8_0;
    const int64_t act_bytes = srt_gguf_act_row_bytes(cols);
    uint8_t u[COL_CHUNK] __attribute__((aligned(64)));
    float sc4[COL_CHUNK / LANE] __attribute__((aligned(64))), mn16[COL_CHUNK / GROUP] __attribute__((aligned(64)));
    for (int64_t j = j0; j < j1; j++) {
        float acc[TOKEN_BLOCK] = {0};
        for (int64_t c0 = 0; c0 < cols; c0 += COL_CHUNK) {
            const int64_t n = cols - c0 < COL_CHUNK ? cols - c0 : COL_CHUNK;
            decode(QTYPE, w + j * w_stride, c0, n, u, sc4, mn16);
            for (int64_t t0 = 0; t0 < tb; t0 += TOKEN_TILE) {
                const int nt = tb - t0 < TOKEN_TILE ? (int)(tb - t0) : TOKEN_TILE;
                ActChunk ac[TOKEN_TILE];
                for (int t = 0; t < nt; t++) ac[t] = act_chunk(act + (b0 + t0 + t) * act_bytes, cols, c0);
                dot_tokens(u, sc4, mn16, n, ac, nt, OFF, MIN, SIGNED8, acc + t0);
            }
        }
        for (int64_t t = 0; t < tb; t++) out[(b0 + t) * out_stride + j] = acc[t];
    }
}

ALWAYS_INLINE void matmul_type(const int QTYPE, const uint8_t *act, int64_t m, const uint8_t *w, int64_t w_stride,
                               int64_t rows, int64_t cols, float *out, int64_t out_stride) {
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (m * rows * cols >= PARALLEL_MIN_MACS)
    for (int64_t j0 = 0; j0 < rows; j0 += ROW_TASK)
        for (int64_t b0 = 0; b0 < m; b0 += TOKEN_BLOCK) {
            const int64_t j1 = j0 + ROW_TASK < rows ? j0 + ROW_TASK : rows;
            const int64_t tb = m - b0 < TOKEN_BLOCK ? m - b0 : TOKEN_BLOCK;
            rows_times_tokens(QTYPE, act, b0, tb, w, w_stride, j0, j1, cols, out, out_stride);
        }
}

/* out [m, rows] (row stride out_stride) = the activations act (srt_gguf_quantize_rows of x [m, cols]) times
 * the block matrix w [rows, cols] of type qtype (each row w_stride bytes apart). Returns 0, or -1 for a type
 * this function does not take (gguf_linear.py checks it first). */
int srt_gguf_matmul(int qtype, const uint8_t *act, int64_t m, const uint8_t *w, int64_t w_stride, int64_t rows,
                    int64_t cols, float *out, int64_t out_stride) {
    switch (qtype) {
    case GGML_Q4_0: matmul_type(GGML_Q4_0, act, m, w, w_stride, rows, cols, out, out_stride); return 0;
    case GGML_Q4_1: matmul_type(GGML_Q4_1, act, m, w, w_stride, rows, cols, out, out_stride); return 0;
    case GGML_Q8_0: matmul_type(GGML_Q8_0, act, m, w, w_stride, rows, cols, out, out_stride); return 0;
    case GGML_Q4_K: matmul_type(GGML_Q4_K, act, m, w, w_stride, rows, cols, out, out_stride); return 0;
    case GGML_Q5_K: matmul_type(GGML_Q5_K, act, m, w, w_stride, rows, cols, out, out_stride); return 0;
    case GGML_Q6_K: matmul_type(GGML_Q6_K, act, m, w, w_stride, rows, cols, out, out_stride); return 0;
    default: return -1;
    }
}

/* ---- exact fp32 activations: rows dequantized a chunk at a time (in L1), then fp32 dot products ---- */

/* Elements [c0, c0 + n) of a row as fp32, exactly as ggml (and gguf-py) dequantize them. */
ALWAYS_INLINE void dequantize_chunk_type(const int QTYPE, const uint8_t *row, int64_t c0, int64_t n, float *dst) {
    const int OFF = QTYPE == GGML_Q4_0 ? OFF_Q4_0 : QTYPE == GGML_Q8_0 ? OFF_Q8_0 : QTYPE == GGML_Q6_K ? OFF_Q6_K : 0;
    uint8_t u[COL_CHUNK];
    float sc4[COL_CHUNK / LANE], mn16[COL_CHUNK / GROUP];
    decode(QTYPE, row, c0, n, u, sc4, mn16);
    for (int64_t i = 0; i < n; i++) dst[i] = sc4[i / LANE] * (float)((int32_t)u[i] - OFF) + mn16[i / GROUP];
}

static void dequantize_chunk(int qtype, const uint8_t *row, int64_t c0, int64_t n, float *dst) {
    switch (qtype) {
    case GGML_Q4_0: dequantize_chunk_type(GGML_Q4_0, row, c0, n, dst); break;
    case GGML_Q4_1: dequantize_chunk_type(GGML_Q4_1, row, c0, n, dst); break;
    case GGML_Q8_0: dequantize_chunk_type(GGML_Q8_0, row, c0, n, dst); break;
    case GGML_Q4_K: dequantize_chunk_type(GGML_Q4_K, row, c0, n, dst); break;
    case GGML_Q5_K: dequantize_chunk_type(GGML_Q5_K, row, c0, n, dst); break;
    case GGML_Q6_K: dequantize_chunk_type(GGML_Q6_K, row, c0, n, dst); break;
    case GGML_F32: memcpy(dst, row + 4 * c0, (size_t)n * sizeof(float)); break;
    case GGML_BF16:
        for (int64_t i = 0; i < n; i++) dst[i] = bf16(row + 2 * (c0 + i));
        break;
    default: { /* F16 */
        int64_t i = 0;
#ifdef __F16C__
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * (c0 + i)))));
#endif
        for (; i < n; i++) dst[i] = fp16(row + 2 * (c0 + i));
    }
    }
}

/* a . b in LANES partial sums (explicit vectors where there are: GCC leaves such loops scalar inside OpenMP
 * regions, see cpu_layer_kernels.c's dot_lanes), then the tail, then the lanes */
static float dot_float(const float *a, const float *b, int64_t n) {
    float lane[LANES] = {0};
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 v = _mm512_setzero_ps();
    for (; i + LANES <= n; i += LANES) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), v);
    _mm512_storeu_ps(lane, v);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 v0 = _mm256_setzero_ps(), v1 = v0;
    for (; i + LANES <= n; i += LANES) {
        v0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v0);
        v1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), v1);
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

/* out [m, rows] (row stride out_stride) = x [m, cols] (row stride x_stride) times the matrix w [rows, cols]
 * of any type this library takes, dequantized exactly: the fp32 product up to summation order. Each chunk of
 * a row is dequantized once for a block of tokens. -1 for a type it does not take. */
int srt_gguf_matmul_exact(int qtype, const float *x, int64_t m, int64_t x_stride, const uint8_t *w, int64_t w_stride,
                          int64_t rows, int64_t cols, float *out, int64_t out_stride) {
    if (!type_bytes(qtype)) return -1;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (m * rows * cols >= PARALLEL_MIN_MACS)
    for (int64_t j0 = 0; j0 < rows; j0 += ROW_TASK)
        for (int64_t b0 = 0; b0 < m; b0 += TOKEN_BLOCK) {
            const int64_t j1 = j0 + ROW_TASK < rows ? j0 + ROW_TASK : rows;
            const int64_t b1 = b0 + TOKEN_BLOCK < m ? b0 + TOKEN_BLOCK : m;
            float buf[COL_CHUNK] __attribute__((aligned(64)));
            for (int64_t j = j0; j < j1; j++) {
                float acc[TOKEN_BLOCK] = {0};
                for (int64_t c0 = 0; c0 < cols; c0 += COL_CHUNK) {
                    const int64_t n = cols - c0 < COL_CHUNK ? cols - c0 : COL_CHUNK;
                    dequantize_chunk(qtype, w + j * w_stride, c0, n, buf);
                    for (int64_t t = b0; t < b1; t++) acc[t - b0] += dot_float(buf, x + t * x_stride + c0, n);
                }
                for (int64_t t = b0; t < b1; t++) out[t * out_stride + j] = acc[t - b0];
            }
        }
    return 0;
}

/* ---- rows of the matrix as fp32 (an embedding lookup) ---- */

/* out [n, cols] = the rows ids[0..n) of the matrix w (qtype, row stride w_stride), exactly as ggml (and gguf-py)
 * dequantize them. Returns 0, or -1 for a type this library does not take. */
int srt_gguf_dequantize_rows(int qtype, const uint8_t *w, int64_t w_stride, int64_t cols, const int64_t *ids, int64_t n,
                             float *out) {
    if (!type_bytes(qtype)) return -1;
#pragma omp parallel for if (n * cols >= PARALLEL_MIN_MACS) schedule(static)
    for (int64_t r = 0; r < n; r++)
        for (int64_t c0 = 0; c0 < cols; c0 += COL_CHUNK)
            dequantize_chunk(qtype, w + ids[r] * w_stride, c0, cols - c0 < COL_CHUNK ? cols - c0 : COL_CHUNK,
                             out + r * cols + c0);
    return 0;
}
