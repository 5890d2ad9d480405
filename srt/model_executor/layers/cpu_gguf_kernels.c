/* Matrix products over GGUF's block formats (ggml's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F32/F16/BF16
 * rows), read where they lie (a memory map of the file): gguf_linear.py checks every operand and calls these.
 *
 * One decoded form serves every block type. A weight row is decoded a chunk at a time (COL_CHUNK elements,
 * in L1) into signed bytes w, and per group of 16 elements a float scale sc16 and a float offset mn16:
 * element i is sc16[i/16] * w[i] + mn16[i/16]. That is each format's own dequantization, in its own float
 * operations (gguf-py's order: the dequantized rows equal gguf.quants.dequantize to the bit), and the only
 * code that differs by type (decode_*); |w| <= 128 for every type.
 *
 * Activations are quantized per block of 32 as ggml's Q8_0 (int8 a, scale d = amax / 127), once per call for
 * all parts of a fused layer (srt_gguf_quantize_rows), kept as unsigned bytes a + 128, with per lane of 4
 * elements the block scale (d4) and per group of 16 the scaled sum d * sum(a) (m16, for the offsets). A lane's
 * integer dot sum(w * a) is exact: with AVX-512 VNNI, vpdpbusd of (a + 128) and w started from
 * -128 * sum(w) (which depends on the weight only, so a tile of tokens shares it); with AVX2, vpmaddubsw of
 * |w| and a signed as w, then vpmaddwd (no pair reaches 2^15: 2 * 128 * 127); a portable loop elsewhere.
 * Each lane is then scaled once in fp32 (sc16 * d4), and the offsets add sum(mn16 * m16). A decoded chunk is
 * reused by every token of the call (a decode step of 16 sequences decodes each weight block once, not 16
 * times); a single token with AVX-512 VNNI makes the same form in registers instead (fused_chunk), in the
 * same lanes and order. Compared with the exact product of the dequantized weight and the fp32 activations, each output
 * differs by at most sum_i |w_i| * d_block(i) / 2 (the rounding of a to the nearest int8 step):
 * gguf_linear.py's docstring says what that costs and what it buys.
 *
 * srt_gguf_matmul_exact keeps fp32 activations instead, with each chunk of a row dequantized exactly into L1:
 * F32, F16 and BF16 rows always take it (small tensors in the files srt runs: exact is free there), and any
 * quantized type where a caller wants the fp32 product (the reference of an end-to-end comparison).
 *
 * srt_gguf_linear runs a fused layer (parts of any of these types, stacked along the output) in one call.
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
#define GGML_Q5_0 6
#define GGML_Q5_1 7
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
/* Elements of a weight row decoded at once: w, sc16 and mn16 of one chunk take 3 KiB of L1. */
#define COL_CHUNK 2048
/* Tokens whose activations one pass over a decoded chunk multiplies, and one tile of them (the vector
 * accumulators of a tile stay in registers while each weight vector is loaded once for all of them). */
#define TOKEN_BLOCK 32
#define TOKEN_TILE 4
/* Rows of the weight one OpenMP task takes (schedule(dynamic): a core the process shares with others does
 * not hold up the call with a fixed half) and the least work worth a parallel region. */
#define ROW_TASK 16
/* A row's blocks are prefetched this many rows ahead of its decoding: the hardware prefetcher alone left a
 * batch-1 product waiting on the last-level cache (Q8_0 2048 x 2048 on one core of a Xeon: 15 cycles per 64
 * elements, most of them at the first load of a block). */
#define PREFETCH_ROWS 2
#define CACHE_LINE 64
#define PARALLEL_MIN_MACS 65536

/* ---- block layouts (ggml-common.h): bytes of one block, elements of one block ---- */

static int64_t type_bytes(int qtype) {
    switch (qtype) {
    case GGML_F32: return 4;
    case GGML_F16: return 2;
    case GGML_BF16: return 2;
    case GGML_Q4_0: return 2 + QK / 2;
    case GGML_Q4_1: return 4 + QK / 2;
    case GGML_Q5_0: return 2 + 4 + QK / 2;
    case GGML_Q5_1: return 4 + 4 + QK / 2;
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
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_Q8_0: return QK;
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return QK_K;
    default: return 0;
    }
}

/* The ABI's sizes, for gguf_linear.py to check its tables against (0: a type this library cannot run). */
int64_t srt_gguf_type_bytes(int qtype) { return type_bytes(qtype); }
int64_t srt_gguf_type_elements(int qtype) { return type_elements(qtype); }
/* Bytes of one token's quantized activations (srt_gguf_quantize_rows): a + 128 [cols] uint8, d4 [cols/4] and
 * m16 [cols/16] float, then for the single-token path a [cols] int8, n4 [cols/4] int32 (-128 times the sum
 * of each lane's four a) and d32 [cols/32] float (each block's d once). */
int64_t srt_gguf_act_row_bytes(int64_t cols) { return cols + cols + cols / 4 + cols + cols + cols / 8; }

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

/* ---- decoding: nb blocks of one row into w, sc16, mn16 (see the top of the file) ---- */

static inline void fill(float *p, int n, float v) {
    for (int i = 0; i < n; i++) p[i] = v;
}

/* 16 bytes as one vector value (GCC/Clang vector extension: an SSE2 or NEON register, else scalars; the
 * compiler does not vectorize the byte loops below by itself), loaded and stored at any address. */
typedef uint8_t u8x16 __attribute__((vector_size(16)));

static inline u8x16 load16(const uint8_t *p) {
    u8x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(int8_t *p, u8x16 v) { memcpy(p, &v, sizeof v); }

/* ... and 32 (one AVX2 register, two SSE2 ones), for the K-quants' 32-byte runs */
typedef uint8_t u8x32 __attribute__((vector_size(32)));

static inline u8x32 load32(const uint8_t *p) {
    u8x32 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store32(int8_t *p, u8x32 v) { memcpy(p, &v, sizeof v); }

typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef float v16f __attribute__((vector_size(64), aligned(4)));

static void decode_q4_0(const uint8_t *restrict b, int64_t nb, int8_t *restrict w, float *restrict sc16,
                        float *restrict mn16) {
    for (int64_t k = 0; k < nb; k++, b += 2 + QK / 2, w += QK, sc16 += QK / GROUP, mn16 += QK / GROUP) {
        const u8x16 q = load16(b + 2);
        store16(w, (q & 0x0f) - 8);
        store16(w + QK / 2, (q >> 4) - 8);
        sc16[0] = sc16[1] = fp16(b);
        mn16[0] = mn16[1] = 0.0f;
    }
}

static void decode_q4_1(const uint8_t *restrict b, int64_t nb, int8_t *restrict w, float *restrict sc16,
                        float *restrict mn16) {
    for (int64_t k = 0; k < nb; k++, b += 4 + QK / 2, w += QK, sc16 += QK / GROUP, mn16 += QK / GROUP) {
        const u8x16 q = load16(b + 4);
        store16(w, q & 0x0f);
        store16(w + QK / 2, q >> 4);
        sc16[0] = sc16[1] = fp16(b);
        mn16[0] = mn16[1] = fp16(b + 2);
    }
}

/* Q5_0 and Q5_1 (ONE): d [, m] fp16, 32 bits qh, 16 bytes of nibbles; element j < 16 takes the low nibble of
 * qs[j], j >= 16 the high one of qs[j - 16], and bit j of qh above it; value d * (q - 16), or d * q + m. */
ALWAYS_INLINE void decode_q5(const uint8_t *restrict b, int64_t nb, int8_t *restrict w, float *restrict sc16,
                             float *restrict mn16, const int ONE) {
    const int64_t head = ONE ? 4 : 2, bytes = head + 4 + QK / 2;
    const u8x16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    for (int64_t k = 0; k < nb; k++, b += bytes, w += QK, sc16 += QK / GROUP, mn16 += QK / GROUP) {
        const uint8_t *h = b + head;
        const u8x16 q = load16(b + head + 4);
        const u8x16 h0 = {h[0], h[0], h[0], h[0], h[0], h[0], h[0], h[0], h[1], h[1], h[1], h[1], h[1], h[1], h[1], h[1]};
        const u8x16 h1 = {h[2], h[2], h[2], h[2], h[2], h[2], h[2], h[2], h[3], h[3], h[3], h[3], h[3], h[3], h[3], h[3]};
        const u8x16 hi0 = (u8x16)((h0 & bit) != 0) & 16, hi1 = (u8x16)((h1 & bit) != 0) & 16;
        const uint8_t offset = ONE ? 0 : 16;
        store16(w, ((q & 0x0f) | hi0) - offset);
        store16(w + QK / 2, ((q >> 4) | hi1) - offset);
        sc16[0] = sc16[1] = fp16(b);
        mn16[0] = mn16[1] = ONE ? fp16(b + 2) : 0.0f;
    }
}

static void decode_q8_0(const uint8_t *restrict b, int64_t nb, int8_t *restrict w, float *restrict sc16,
                        float *restrict mn16) {
    for (int64_t k = 0; k < nb; k++, b += 2 + QK, w += QK, sc16 += QK / GROUP, mn16 += QK / GROUP) {
        memcpy(w, b + 2, QK);
        sc16[0] = sc16[1] = fp16(b);
        mn16[0] = mn16[1] = 0.0f;
    }
}

/* Q4_K/Q5_K's 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32 (ggml's get_scale_min_k4), four at a
 * time in 32-bit words: sub-blocks 0-3 keep the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 take
 * the nibbles of bytes 8-11 with the top 2 bits of bytes 0-3 / 4-7 above them. */
static inline void scale_min_k4(const uint8_t *restrict s, uint8_t *restrict sc, uint8_t *restrict mn) {
    uint32_t v[3], r[4];
    memcpy(v, s, sizeof v);
    r[0] = v[0] & 0x3f3f3f3fu;
    r[1] = (v[2] & 0x0f0f0f0fu) | (((v[0] >> 6) & 0x03030303u) << 4);
    r[2] = v[1] & 0x3f3f3f3fu;
    r[3] = ((v[2] >> 4) & 0x0f0f0f0fu) | (((v[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, r, 8);
    memcpy(mn, r + 2, 8);
}

/* Q4_K and Q5_K (HIGH: the fifth bit from qh): d and dmin fp16, scales, [qh,] qs; sub-block j of 32 takes
 * the low nibbles of qs[32 * (j / 2) ..] for even j, the high ones for odd j, and bit j of qh[0..31] above
 * them; value (d * sc) * q - dmin * m. */
ALWAYS_INLINE void decode_k45(const uint8_t *restrict b, int64_t nb, int8_t *restrict w, float *restrict sc16,
                              float *restrict mn16, const int HIGH) {
    const int64_t bytes = HIGH ? type_bytes(GGML_Q5_K) : type_bytes(GGML_Q4_K);
    for (int64_t k = 0; k < nb; k++, b += bytes, w += QK_K, sc16 += QK_K / GROUP, mn16 += QK_K / GROUP) {
        const float d = fp16(b), dmin = fp16(b + 2);
        uint8_t sc[8], mn[8];
        scale_min_k4(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = b + 16 + (HIGH ? QK_K / 8 : 0); /* qh: Q5_K only */
        const u8x32 h = HIGH ? load32(qh) : (u8x32){0};
        for (int g = 0; g < 4; g++) {
            const u8x32 q = load32(qs + 32 * g);
            if (HIGH) {
                store32(w + 64 * g, (q & 0x0f) | (((h >> (2 * g)) & 1) << 4));
                store32(w + 64 * g + 32, (q >> 4) | (((h >> (2 * g + 1)) & 1) << 4));
            } else {
                store32(w + 64 * g, q & 0x0f);
                store32(w + 64 * g + 32, q >> 4);
            }
        }
        /* the 8 scales and mins as vectors: the compiler converts bytes to floats one at a time otherwise */
        u8x8 scv, mnv;
        memcpy(&scv, sc, sizeof scv);
        memcpy(&mnv, mn, sizeof mnv);
        const v8f s = v8f_splat(d) * __builtin_convertvector(scv, v8f);
        const v8f o = -(v8f_splat(dmin) * __builtin_convertvector(mnv, v8f));
        /* each sub-block's value for its two groups of 16, in 8-lane halves (a 16-lane shuffle went through
         * the stack on AVX2) */
        const v8f s_lo = __builtin_shufflevector(s, s, 0, 0, 1, 1, 2, 2, 3, 3), s_hi = __builtin_shufflevector(s, s, 4, 4, 5, 5, 6, 6, 7, 7);
        const v8f o_lo = __builtin_shufflevector(o, o, 0, 0, 1, 1, 2, 2, 3, 3), o_hi = __builtin_shufflevector(o, o, 4, 4, 5, 5, 6, 6, 7, 7);
        memcpy(sc16, &s_lo, sizeof s_lo);
        memcpy(sc16 + 8, &s_hi, sizeof s_hi);
        memcpy(mn16, &o_lo, sizeof o_lo);
        memcpy(mn16 + 8, &o_hi, sizeof o_hi);
    }
}

/* Q6_K: ql [128], qh [64], 16 int8 scales, d fp16. Element 128 h + 32 k + l (k < 4, l < 32) takes the low
 * (k < 2) or high nibble of ql[64 h + 32 (k % 2) + l] and bits 2k of qh[32 h + l] above them; value
 * (d * sc) * (q - 32). */
static void decode_q6_k(const uint8_t *restrict b, int64_t nb, int8_t *restrict w, float *restrict sc16,
                        float *restrict mn16) {
    for (int64_t k = 0; k < nb; k++, b += type_bytes(GGML_Q6_K), w += QK_K, sc16 += QK_K / GROUP, mn16 += QK_K / GROUP) {
        const uint8_t *ql = b, *qh = b + QK_K / 2;
        const int8_t *sc = (const int8_t *)(b + QK_K / 2 + QK_K / 4);
        const float d = fp16(b + QK_K / 2 + QK_K / 4 + QK_K / 16);
        for (int h = 0; h < 2; h++) {
            const u8x32 a = load32(ql + 64 * h), b2 = load32(ql + 64 * h + 32), hb = load32(qh + 32 * h);
            store32(w + 128 * h, ((a & 0x0f) | ((hb & 3) << 4)) - 32);
            store32(w + 128 * h + 32, ((b2 & 0x0f) | (((hb >> 2) & 3) << 4)) - 32);
            store32(w + 128 * h + 64, ((a >> 4) | (((hb >> 4) & 3) << 4)) - 32);
            store32(w + 128 * h + 96, ((b2 >> 4) | (((hb >> 6) & 3) << 4)) - 32);
        }
        i8x16 scv;
        memcpy(&scv, sc, sizeof scv);
        const v16f s = (v16f){d, d, d, d, d, d, d, d, d, d, d, d, d, d, d, d} * __builtin_convertvector(scv, v16f);
        memcpy(sc16, &s, sizeof s);
        fill(mn16, QK_K / GROUP, 0.0f);
    }
}

/* Elements [c0, c0 + n) of one row (c0 and n multiples of the type's block) into w, sc16, mn16. */
ALWAYS_INLINE void decode(const int QTYPE, const uint8_t *row, int64_t c0, int64_t n, int8_t *w, float *sc16,
                          float *mn16) {
    const int64_t per = type_elements(QTYPE), first = c0 / per, nb = n / per;
    const uint8_t *b = row + first * type_bytes(QTYPE);
    switch (QTYPE) {
    case GGML_Q4_0: decode_q4_0(b, nb, w, sc16, mn16); break;
    case GGML_Q4_1: decode_q4_1(b, nb, w, sc16, mn16); break;
    case GGML_Q5_0: decode_q5(b, nb, w, sc16, mn16, 0); break;
    case GGML_Q5_1: decode_q5(b, nb, w, sc16, mn16, 1); break;
    case GGML_Q8_0: decode_q8_0(b, nb, w, sc16, mn16); break;
    case GGML_Q4_K: decode_k45(b, nb, w, sc16, mn16, 0); break;
    case GGML_Q5_K: decode_k45(b, nb, w, sc16, mn16, 1); break;
    default: decode_q6_k(b, nb, w, sc16, mn16); break;
    }
}

/* ---- activations ---- */

#if SRT_ISA == 2
/* One block of 32 of srt_gguf_quantize_rows, 16 lanes at a time, to the same bytes and floats as its scalar
 * loop (the same max, products and sums; vcvtps2dq rounds to nearest even as nearbyintf does in the default
 * rounding mode): 1 us rather than 15 for a decode step's 4096 inputs, which the other threads wait for. */
static inline void quantize_block(const float *xb, uint8_t *au, int8_t *as, int32_t *n4, float *d4, float *m16,
                                  float *d32) {
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 a0f = _mm512_abs_ps(x0), a1f = _mm512_abs_ps(x1), top = _mm512_set1_ps(3.40282347e38f);
    /* ordered <= is false for an infinity and a NaN */
    const int finite = (_mm512_cmp_ps_mask(a0f, top, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1f, top, _CMP_LE_OQ)) == 0xffff;
    const float amax = finite ? _mm512_reduce_max_ps(_mm512_max_ps(a0f, a1f)) : 0.0f;
    const float d = finite ? amax / ACT_MAX : NAN, id = finite && amax > 0.0f ? ACT_MAX / amax : 0.0f;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0;
    if (finite) {
        a0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
        a1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
    }
    const __m256i bytes = _mm256_set_m128i(_mm512_cvtepi32_epi8(a1), _mm512_cvtepi32_epi8(a0));
    _mm256_storeu_si256((__m256i *)(void *)as, bytes);
    _mm256_storeu_si256((__m256i *)(void *)au, _mm256_xor_si256(bytes, _mm256_set1_epi8((char)0x80)));
    /* each lane's sum of four, times -128 */
    const __m512i lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), _mm512_zextsi256_si512(bytes));
    _mm256_storeu_si256((__m256i *)(void *)n4,
                        _mm512_castsi512_si256(_mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(lanes, 7))));
    _mm256_storeu_ps(d4, _mm256_set1_ps(d));
    *d32 = d;
    m16[0] = d * (float)_mm512_reduce_add_epi32(a0);
    m16[1] = d * (float)_mm512_reduce_add_epi32(a1);
}
#endif

/* x [m, cols] (row stride x_stride, cols a multiple of 32) -> act [m, srt_gguf_act_row_bytes(cols)]: per block
 * of 32, d = amax / 127 and a = round(x * 127 / amax) (|a| <= 127; an all-zero block has d = 0, a = 0; a
 * block with an infinity or NaN has d = NaN, so its outputs are NaN as an fp32 product's would be). */
void srt_gguf_quantize_rows(const float *x, int64_t m, int64_t cols, int64_t x_stride, uint8_t *act) {
    const int64_t row_bytes = srt_gguf_act_row_bytes(cols);
#pragma omp parallel for if (m * cols >= PARALLEL_MIN_MACS) schedule(static)
    for (int64_t t = 0; t < m; t++) {
        const float *xr = x + t * x_stride;
        uint8_t *au = act + t * row_bytes;
        float *d4 = (float *)(void *)(au + cols), *m16 = d4 + cols / LANE;
        int8_t *as = (int8_t *)(void *)(m16 + cols / GROUP);
        int32_t *n4 = (int32_t *)(void *)(as + cols);
        float *d32 = (float *)(void *)(n4 + cols / LANE);
        for (int64_t c = 0; c < cols; c += QK) {
#if SRT_ISA == 2
            quantize_block(xr + c, au + c, as + c, n4 + c / LANE, d4 + c / LANE, m16 + c / GROUP, d32 + c / QK);
#else
            float amax = 0.0f;
            int finite = 1;
            for (int i = 0; i < QK; i++) {
                const float v = fabsf(xr[c + i]);
                finite &= v <= 3.40282347e38f; /* false for an infinity and a NaN */
                amax = v > amax ? v : amax;
            }
            const float d = finite ? amax / ACT_MAX : NAN, id = finite && amax > 0.0f ? ACT_MAX / amax : 0.0f;
            int32_t sum[QK / GROUP] = {0}, lane[QK / LANE] = {0};
            for (int i = 0; i < QK; i++) {
                const int32_t a = finite ? (int32_t)nearbyintf(xr[c + i] * id) : 0;
                au[c + i] = (uint8_t)(a + 128);
                as[c + i] = (int8_t)a;
                sum[i / GROUP] += a;
                lane[i / LANE] += a;
            }
            for (int l = 0; l < QK / LANE; l++) n4[c / LANE + l] = -128 * lane[l];
            fill(d4 + c / LANE, QK / LANE, d);
            d32[c / QK] = d;
            for (int g = 0; g < QK / GROUP; g++) m16[c / GROUP + g] = d * (float)sum[g];
#endif
        }
    }
}

/* One token's activations for the chunk [c0, ..) of a row */
typedef struct {
    const uint8_t *au;
    const float *d4;
    const float *m16;
    const int8_t *as;
    const int32_t *n4;
    const float *d32;
} ActChunk;

static inline ActChunk act_chunk(const uint8_t *act_row, int64_t cols, int64_t c0) {
    ActChunk c;
    const float *d4 = (const float *)(const void *)(act_row + cols);
    const int8_t *as = (const int8_t *)(const void *)(d4 + cols / LANE + cols / GROUP);
    c.au = act_row + c0;
    c.d4 = d4 + c0 / LANE;
    c.m16 = d4 + cols / LANE + c0 / GROUP;
    c.as = as + c0;
    c.n4 = (const int32_t *)(const void *)(as + cols) + c0 / LANE;
    c.d32 = (const float *)(const void *)(c.n4 - c0 / LANE + cols / LANE) + c0 / QK;
    return c;
}

/* ---- the dot of a decoded chunk (n elements, a multiple of 32) with NT tokens' activations, added to acc ----
 * MIN: whether the type has offsets (mn16). */

#if SRT_ISA == 2
/* One step of 64 elements (MASKED: the half vector a chunk of 32 mod 64 ends with; its upper lanes load as
 * zeros and add nothing): wv the weights, sv their lanes' scales. */
ALWAYS_INLINE void fused_step(__m512i wv, __m512 sv, const ActChunk *ac, int64_t i, const int NT, const int MASKED,
                              __m512 *v) {
    const __mmask64 mb = MASKED ? (__mmask64)0xffffffffu : ~(__mmask64)0;
    const __mmask16 ml = MASKED ? (__mmask16)0xff : (__mmask16)0xffff;
    /* -128 * sum(w) per lane: the start that makes the dot of a + 128 the dot of a */
    const __m512i init = _mm512_sub_epi32(_mm512_setzero_si512(),
                                          _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), wv));
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        const __m512i dot = _mm512_dpbusd_epi32(init, _mm512_maskz_loadu_epi8(mb, ac[t].au + i), wv);
        const __m512 scale = _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(ml, ac[t].d4 + i / LANE));
        v[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, v[t]);
    }
}

/* lanes 4k..4k+3 take v[first + k] */
static inline __m512 spread4(__m512 v, int first) {
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(first),
                                                  _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)), v);
}

ALWAYS_INLINE void dot_step(const int8_t *w, const float *sc16, int64_t i, const ActChunk *ac, const int NT,
                            const int MASKED, __m512 *v) {
    const __m512i wv = _mm512_maskz_loadu_epi8(MASKED ? (__mmask64)0xffffffffu : ~(__mmask64)0, w + i);
    const __m512 sv = spread4(_mm512_castps128_ps512(_mm_maskz_loadu_ps(MASKED ? 0x3 : 0xf, sc16 + i / GROUP)), 0);
    fused_step(wv, sv, ac, i, NT, MASKED, v);
}

/* The offsets: 16 groups a vector, added once per chunk (o) */
ALWAYS_INLINE void dot_tile(const int8_t *w, const float *sc16, const float *mn16, int64_t n, const ActChunk *ac,
                            const int NT, const int MIN, float *acc) {
    __m512 v[TOKEN_TILE], o[TOKEN_TILE];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) v[t] = o[t] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) dot_step(w, sc16, i, ac, NT, 0, v);
    if (i < n) dot_step(w, sc16, i, ac, NT, 1, v);
    if (MIN) {
        const int64_t groups = n / GROUP;
        for (int64_t g = 0; g < groups; g += 16) {
            const __mmask16 ml = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1);
            const __m512 mv = _mm512_maskz_loadu_ps(ml, mn16 + g);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) o[t] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(ml, ac[t].m16 + g), o[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] += _mm512_reduce_add_ps(_mm512_add_ps(v[t], o[t]));
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

ALWAYS_INLINE void dot_tile(const int8_t *w, const float *sc16, const float *mn16, int64_t n, const ActChunk *ac,
                            const int NT, const int MIN, float *acc) {
    __m256 v[TOKEN_TILE];
    float offsets[TOKEN_TILE];
    #pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        v[t] = _mm256_setzero_ps();
        offsets[t] = 0.0f;
    }
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    const __m256i spread = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
    for (int64_t i = 0; i < n; i += 32) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + i)), aw = _mm256_abs_epi8(wv);
        double pair;
        memcpy(&pair, sc16 + i / GROUP, sizeof pair);
        const __m256 sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_set_sd(pair))), spread);
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const __m256i a = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(ac[t].au + i)), flip);
            const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(a, wv)), ones);
            v[t] = fmadd8(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sv, _mm256_loadu_ps(ac[t].d4 + i / LANE)), v[t]);
        }
    }
    if (MIN)
        #pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            float lane[8] = {0};
            int64_t g = 0;
            for (; g + 8 <= n / GROUP; g += 8)
                for (int l = 0; l < 8; l++) lane[l] += mn16[g + l] * ac[t].m16[g + l];
            for (; g < n / GROUP; g++) lane[0] += mn16[g] * ac[t].m16[g];
            for (int l = 0; l < 8; l++) offsets[t] += lane[l];
        }
    #pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] += hsum_ps8(v[t]) + offsets[t];
}

#elif SRT_ISA == 0
/* Portable: the same lanes and the same integers, summed in LANES float partial sums. */
ALWAYS_INLINE void dot_tile(const int8_t *w, const float *sc16, const float *mn16, int64_t n, const ActChunk *ac,
                            const int NT, const int MIN, float *acc) {
    #pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        float lane[LANES] = {0}, ol[LANES] = {0};
        for (int64_t l = 0; l < n / LANE; l++) {
            int32_t dot = 0;
            for (int i = 0; i < LANE; i++) dot += (int32_t)w[LANE * l + i] * ((int32_t)ac[t].au[LANE * l + i] - 128);
            lane[l % LANES] += (float)dot * (sc16[l / (GROUP / LANE)] * ac[t].d4[l]);
        }
        if (MIN)
            for (int64_t g = 0; g < n / GROUP; g++) ol[g % LANES] += mn16[g] * ac[t].m16[g];
        float s = 0.0f;
        for (int l = 0; l < LANES; l++) s += lane[l] + ol[l];
        acc[t] += s;
    }
}
#endif

/* dot_tile for 1..TOKEN_TILE tokens, each count its own specialized copy */
ALWAYS_INLINE void dot_tokens(const int8_t *w, const float *sc16, const float *mn16, int64_t n, const ActChunk *ac,
                              int nt, const int MIN, float *acc) {
    if (nt == TOKEN_TILE) {
        dot_tile(w, sc16, mn16, n, ac, TOKEN_TILE, MIN, acc);
    } else { /* a partial tile one token at a time: two specialized copies a type, not four (build time) */
        for (int t = 0; t < nt; t++) dot_tile(w, sc16, mn16, n, ac + t, 1, MIN, acc + t);
    }
}

#if SRT_ISA == 2
/* ---- AVX-512 VNNI, one token: each chunk of a row decoded in registers, 64 elements at a time ----
 * A decode step (one sequence) has nothing to share a decoded chunk with, and writing it to L1 and reading
 * it back cost more than the arithmetic (Q4_K 2048 x 2048 on one core of a Xeon: 21 cycles per 64 elements
 * with the decoded form, 11 here). The weights, scales and offsets are the decoded form's, made in registers,
 * and the steps, lanes and sums are dot_tile's, in its order: a token gets the same bits alone as in a batch.
 * Only a lane's integer dot is reached another way, to the same integer: the weights as unsigned bytes (those
 * of the types with offsets, Q4_1, Q5_1, Q4_K and Q5_K, are unsigned as they are, the others take + 128) times
 * the signed activations a, started from 0 or from n4 = -128 * sum(a) (per token, made once per call): one
 * vpdpbusd a step where dot_tile's needs two for -128 * sum(w), which a batch shares and one token does not
 * (scripts/bench_gguf_gemm.py --cpu-time, one core of a busy 2-core Xeon, 4096 x 4096 streamed from memory,
 * medians: Q4_K 1.48 -> 1.19 ms, Q6_K 1.63 -> 1.52 ms). */

/* One step of 64 elements of one token: wu the weights as unsigned bytes (w, or w + 128 unless ZERO_START),
 * scale their lanes' weight scale times activation scale (fused_step's sv * d4, multiplied once a block
 * where a block's lanes share them: the same products); MASKED as in fused_step. */
ALWAYS_INLINE void token_step(__m512i wu, __m512 scale, const ActChunk *ac, int64_t i, const int ZERO_START,
                              const int MASKED, __m512 *v) {
    const __mmask64 mb = MASKED ? (__mmask64)0xffffffffu : ~(__mmask64)0;
    const __mmask16 ml = MASKED ? (__mmask16)0xff : (__mmask16)0xffff;
    const __m512i start = ZERO_START ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi32(ml, ac->n4 + i / LANE);
    const __m512i dot = _mm512_dpbusd_epi32(start, wu, _mm512_maskz_loadu_epi8(mb, ac->as + i));
    *v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *v);
}

static inline __m512 two_scales(float lo, float hi) { /* lanes 0-7 lo, 8-15 hi */
    return _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(lo), _mm512_set1_ps(hi));
}

/* 32 bytes -> 64 weights: the low nibbles, then the high ones */
static inline __m512i nibbles64(__m256i q) {
    const __m256i m = _mm256_set1_epi8(0x0f);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, m)),
                              _mm256_and_si256(_mm256_srli_epi16(q, 4), m), 1);
}

/* two 16-byte blocks of nibbles -> [a low, a high, b low, b high] */
static inline __m512i nibble_blocks(const uint8_t *a, const uint8_t *b) {
    const __m512i z = nibbles64(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)b), _mm_loadu_si128((const __m128i *)a)));
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}

/* The 64 weights of blocks x and y of a 32-element type as decode_* makes them, as unsigned bytes: + 128 for
 * the types without offsets (Q4_0, Q5_0, Q8_0: signed as decoded), as they are for Q4_1, Q5_1 */
ALWAYS_INLINE __m512i weights_of_two_blocks(const int QTYPE, const uint8_t *x, const uint8_t *y) {
    if (QTYPE == GGML_Q8_0)
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x + 2))),
                                                   _mm256_loadu_si256((const __m256i *)(y + 2)), 1),
                                _mm512_set1_epi8((char)0x80));
    if (QTYPE == GGML_Q4_0) return _mm512_add_epi8(nibble_blocks(x + 2, y + 2), _mm512_set1_epi8(128 - 8));
    if (QTYPE == GGML_Q4_1) return nibble_blocks(x + 4, y + 4);
    /* Q5_0, Q5_1: bit j of a block's qh is its element j's fifth bit */
    const int64_t head = QTYPE == GGML_Q5_1 ? 4 : 2;
    uint32_t hx, hy;
    memcpy(&hx, x + head, sizeof hx);
    memcpy(&hy, y + head, sizeof hy);
    const __m512i high = _mm512_maskz_mov_epi8((__mmask64)hx | ((__mmask64)hy << 32), _mm512_set1_epi8(16));
    const __m512i q = _mm512_or_si512(nibble_blocks(x + head + 4, y + head + 4), high);
    return QTYPE == GGML_Q5_1 ? q : _mm512_add_epi8(q, _mm512_set1_epi8(128 - 16));
}

/* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: the nb blocks of 32 at b, two a step (the last alone in a masked half step
 * when nb is odd). Q4_1's and Q5_1's offsets m go into o as dot_tile adds them: 16 groups (8 blocks) a
 * vector, a partial last vector masked. */
ALWAYS_INLINE void fused_blocks32(const int QTYPE, const uint8_t *b, int64_t nb, const ActChunk *ac, __m512 *v,
                                  __m512 *o) {
    const int MIN = QTYPE == GGML_Q4_1 || QTYPE == GGML_Q5_1;
    const int64_t bytes = type_bytes(QTYPE);
    float offsets[2 * 8] __attribute__((aligned(64)));
    for (int64_t k = 0; k < nb; k += 2) {
        const int pair = k + 1 < nb;
        const uint8_t *x = b + k * bytes, *y = pair ? x + bytes : x;
        const __m512i wu = weights_of_two_blocks(QTYPE, x, y);
        if (pair)
            token_step(wu, two_scales(fp16(x) * ac->d32[k], fp16(y) * ac->d32[k + 1]), ac, k * QK, MIN, 0, v);
        else
            token_step(wu, two_scales(fp16(x) * ac->d32[k], 0.0f), ac, k * QK, MIN, 1, v);
        if (MIN) {
            const int at = 2 * (int)(k % 8);
            offsets[at] = offsets[at + 1] = fp16(x + 2);
            if (pair) offsets[at + 2] = offsets[at + 3] = fp16(y + 2);
            const int64_t last = pair ? k + 1 : k;
            if (last % 8 == 7 || last == nb - 1) {
                const int lanes = 2 * (int)(last % 8 + 1);
                const __mmask16 ml = lanes == 16 ? (__mmask16)0xffff : (__mmask16)((1u << lanes) - 1);
                *o = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(ml, offsets),
                                     _mm512_maskz_loadu_ps(ml, ac->m16 + 2 * (last - last % 8)), *o);
            }
        }
    }
}

/* Q4_K, Q5_K, Q6_K: the nb super-blocks of 256 at b, four steps each */
ALWAYS_INLINE void fused_k(const int QTYPE, const uint8_t *b0, int64_t nb, const ActChunk *ac, __m512 *v, __m512 *o) {
    const int64_t bytes = type_bytes(QTYPE);
    for (int64_t k = 0; k < nb; k++) {
        const uint8_t *b = b0 + k * bytes;
        const int64_t i0 = k * QK_K;
        if (QTYPE == GGML_Q6_K) {
            const uint8_t *ql = b, *qh = b + QK_K / 2;
            const float d = fp16(b + QK_K / 2 + QK_K / 4 + QK_K / 16);
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + QK_K / 2 + QK_K / 4)));
            const __m512 d16 = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                                     _mm512_castps256_ps512(_mm256_loadu_ps(ac->d32 + k * (QK_K / QK))));
            const __m512 scales = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sc)), d16);
            for (int h = 0; h < 2; h++) {
                const __m512i lv = _mm512_loadu_si512((const void *)(ql + 64 * h));
                const __m512i hv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
                for (int part = 0; part < 2; part++) {
                    const int s = 2 * h + part;
                    /* the first 32 take bits 4 part of qh, the second 32 bits 4 part + 2 */
                    const __m512i shifts = _mm512_mask_blend_epi16(
                        (__mmask32)0xffff0000u, _mm512_set1_epi16((short)(4 * part)), _mm512_set1_epi16((short)(4 * part + 2)));
                    const __m512i low = _mm512_and_si512(part ? _mm512_srli_epi16(lv, 4) : lv, _mm512_set1_epi8(0x0f));
                    const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(hv, shifts), _mm512_set1_epi8(3));
                    /* q - 32 + 128 */
                    const __m512i wu = _mm512_add_epi8(_mm512_or_si512(low, _mm512_slli_epi16(high, 4)), _mm512_set1_epi8(96));
                    token_step(wu, spread4(scales, 4 * s), ac, i0 + 64 * s, 0, 0, v);
                }
            }
        } else {
            const int HIGH = QTYPE == GGML_Q5_K;
            const float d = fp16(b), dmin = fp16(b + 2);
            uint8_t sc[8], mn[8];
            scale_min_k4(b + 4, sc, mn);
            const __m256 scf = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc))));
            /* -(dmin * m), as decode_k45 computes it */
            const __m256 mnf = _mm256_xor_ps(_mm256_set1_ps(-0.0f), _mm256_mul_ps(_mm256_set1_ps(dmin),
                                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)))));
            const __m512 scales = _mm512_castps256_ps512(_mm256_mul_ps(scf, _mm256_loadu_ps(ac->d32 + k * (QK_K / QK))));
            const __m512 offsets = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                                         _mm512_castps256_ps512(mnf));
            const uint8_t *qh = b + 16, *qs = b + 16 + (HIGH ? QK_K / 8 : 0); /* qh: Q5_K only */
            const __m256i h = HIGH ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
            for (int g = 0; g < 4; g++) {
                /* nibbles64 without its lane crossing: the 32 bytes broadcast to both halves from memory, the
                 * upper half shifted down a nibble */
                const __m512i q2 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * g)));
                __m512i wv = _mm512_and_si512(_mm512_mask_srli_epi16(q2, (__mmask32)0xffff0000u, q2, 4), _mm512_set1_epi8(0x0f));
                if (HIGH) {
                    const __m256i one = _mm256_set1_epi8(1);
                    const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(h, 2 * g), one);
                    const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(h, 2 * g + 1), one);
                    wv = _mm512_or_si512(wv, _mm512_slli_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1), 4));
                }
                /* sub-blocks 2g and 2g + 1: eight lanes each */
                const __m512 sv = _mm512_permutexvar_ps(
                    _mm512_add_epi32(_mm512_set1_epi32(2 * g), _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)), scales);
                token_step(wv, sv, ac, i0 + 64 * g, 1, 0, v);
            }
            *o = _mm512_fmadd_ps(offsets, _mm512_loadu_ps(ac->m16 + k * (QK_K / GROUP)), *o);
        }
    }
}

/* acc += the dot of elements [c0, c0 + n) of a row with one token's activations (ac at c0) */
ALWAYS_INLINE void fused_chunk(const int QTYPE, const uint8_t *row, int64_t c0, int64_t n, const ActChunk *ac, float *acc) {
    __m512 v = _mm512_setzero_ps(), o = _mm512_setzero_ps();
    const int64_t per = type_elements(QTYPE);
    const uint8_t *b = row + c0 / per * type_bytes(QTYPE);
    if (per == QK)
        fused_blocks32(QTYPE, b, n / QK, ac, &v, &o);
    else
        fused_k(QTYPE, b, n / QK_K, ac, &v, &o);
    *acc += _mm512_reduce_add_ps(_mm512_add_ps(v, o));
}
#endif

/* out[t, j] for the rows [j0, j1) and tokens [b0, b0 + tb): each chunk of a row decoded once for the tokens */
ALWAYS_INLINE void rows_times_tokens(const int QTYPE, const uint8_t *act, int64_t b0, int64_t tb, const uint8_t *w,
                                     int64_t w_stride, int64_t j0, int64_t j1, int64_t rows, int64_t cols, float *out,
                                     int64_t out_stride) {
    const int MIN = QTYPE == GGML_Q4_1 || QTYPE == GGML_Q5_1 || QTYPE == GGML_Q4_K || QTYPE == GGML_Q5_K;
    const int64_t act_bytes = srt_gguf_act_row_bytes(cols);
    int8_t q[COL_CHUNK] __attribute__((aligned(64)));
    float sc16[COL_CHUNK / GROUP] __attribute__((aligned(64))), mn16[COL_CHUNK / GROUP] __attribute__((aligned(64)));
    const int64_t row_bytes = cols / type_elements(QTYPE) * type_bytes(QTYPE);
    for (int64_t j = j0; j < j1; j++) {
        float acc[TOKEN_BLOCK] = {0};
        if (j + PREFETCH_ROWS < rows)
            for (int64_t p = 0; p < row_bytes; p += CACHE_LINE) __builtin_prefetch(w + (j + PREFETCH_ROWS) * w_stride + p);
        for (int64_t c0 = 0; c0 < cols; c0 += COL_CHUNK) {
            const int64_t n = cols - c0 < COL_CHUNK ? cols - c0 : COL_CHUNK;
#if SRT_ISA == 2
            if (tb == 1) {
                const ActChunk ac = act_chunk(act + b0 * act_bytes, cols, c0);
                fused_chunk(QTYPE, w + j * w_stride, c0, n, &ac, acc);
                continue;
            }
#endif
            decode(QTYPE, w + j * w_stride, c0, n, q, sc16, mn16);
            for (int64_t t0 = 0; t0 < tb; t0 += TOKEN_TILE) {
                const int nt = tb - t0 < TOKEN_TILE ? (int)(tb - t0) : TOKEN_TILE;
                ActChunk ac[TOKEN_TILE];
                for (int t = 0; t < nt; t++) ac[t] = act_chunk(act + (b0 + t0 + t) * act_bytes, cols, c0);
                dot_tokens(q, sc16, mn16, n, ac, nt, MIN, acc + t0);
            }
        }
        for (int64_t t = 0; t < tb; t++) out[(b0 + t) * out_stride + j] = acc[t];
    }
}

/* One task of a product with quantized activations: rows_times_tokens for a quantized type's matrix */
static void quantized_task(int qtype, const uint8_t *act, int64_t b0, int64_t tb, const uint8_t *w, int64_t w_stride,
                           int64_t j0, int64_t j1, int64_t rows, int64_t cols, float *out, int64_t out_stride) {
    switch (qtype) {
    case GGML_Q4_0: rows_times_tokens(GGML_Q4_0, act, b0, tb, w, w_stride, j0, j1, rows, cols, out, out_stride); break;
    case GGML_Q4_1: rows_times_tokens(GGML_Q4_1, act, b0, tb, w, w_stride, j0, j1, rows, cols, out, out_stride); break;
    case GGML_Q5_0: rows_times_tokens(GGML_Q5_0, act, b0, tb, w, w_stride, j0, j1, rows, cols, out, out_stride); break;
    case GGML_Q5_1: rows_times_tokens(GGML_Q5_1, act, b0, tb, w, w_stride, j0, j1, rows, cols, out, out_stride); break;
    case GGML_Q8_0: rows_times_tokens(GGML_Q8_0, act, b0, tb, w, w_stride, j0, j1, rows, cols, out, out_stride); break;
    case GGML_Q4_K: rows_times_tokens(GGML_Q4_K, act, b0, tb, w, w_stride, j0, j1, rows, cols, out, out_stride); break;
    case GGML_Q5_K: rows_times_tokens(GGML_Q5_K, act, b0, tb, w, w_stride, j0, j1, rows, cols, out, out_stride); break;
    default: rows_times_tokens(GGML_Q6_K, act, b0, tb, w, w_stride, j0, j1, rows, cols, out, out_stride); break;
    }
}

/* ---- exact fp32 activations: rows dequantized a chunk at a time (in L1), then fp32 dot products ---- */

/* Elements [c0, c0 + n) of a row as fp32, exactly as ggml (and gguf-py) dequantize them. */
ALWAYS_INLINE void dequantize_chunk_type(const int QTYPE, const uint8_t *row, int64_t c0, int64_t n, float *dst) {
    int8_t q[COL_CHUNK];
    float sc16[COL_CHUNK / GROUP], mn16[COL_CHUNK / GROUP];
    decode(QTYPE, row, c0, n, q, sc16, mn16);
    for (int64_t g = 0; g < n / GROUP; g++) {
        const float s = sc16[g], o = mn16[g];
        for (int i = 0; i < GROUP; i++) dst[GROUP * g + i] = s * (float)q[GROUP * g + i] + o;
    }
}

static void dequantize_chunk(int qtype, const uint8_t *row, int64_t c0, int64_t n, float *dst) {
    switch (qtype) {
    case GGML_Q4_0: dequantize_chunk_type(GGML_Q4_0, row, c0, n, dst); break;
    case GGML_Q4_1: dequantize_chunk_type(GGML_Q4_1, row, c0, n, dst); break;
    case GGML_Q5_0: dequantize_chunk_type(GGML_Q5_0, row, c0, n, dst); break;
    case GGML_Q5_1: dequantize_chunk_type(GGML_Q5_1, row, c0, n, dst); break;
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

/* One task of a product with exact activations: the rows [j0, j1) times the tokens [b0, b1), each chunk of a
 * row dequantized once for them */
static void exact_task(int qtype, const float *x, int64_t x_stride, int64_t b0, int64_t b1, const uint8_t *w,
                       int64_t w_stride, int64_t j0, int64_t j1, int64_t cols, float *out, int64_t out_stride);

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

static void exact_task(int qtype, const float *x, int64_t x_stride, int64_t b0, int64_t b1, const uint8_t *w,
                       int64_t w_stride, int64_t j0, int64_t j1, int64_t cols, float *out, int64_t out_stride) {
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

#define PART_WORDS 4 /* a part: ggml type, address of its first row, bytes from one row to the next, rows */

/* out [m, sum of rows] = the nparts block matrices of parts [nparts, PART_WORDS] (each writing its columns
 * of out in turn) times x, with the activations act (srt_gguf_quantize_rows of x) for the quantized parts
 * where act is given, else x in fp32. One parallel region for all the parts: tasks of ROW_TASK rows and
 * TOKEN_BLOCK tokens, the parts' in turn, taken as threads come free (a region a part cost a fused qkv three
 * fork-joins, and a joining thread the process shares a core with can hold a join up for a time slice). */
static void products(const float *x, int64_t x_stride, const uint8_t *act, int64_t m, int64_t cols, int64_t nparts,
                     const int64_t *parts, float *out, int64_t out_stride) {
    const int64_t token_blocks = (m + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
    int64_t tasks = 0, rows = 0;
    for (int64_t p = 0; p < nparts; p++) {
        rows += parts[PART_WORDS * p + 3];
        tasks += (parts[PART_WORDS * p + 3] + ROW_TASK - 1) / ROW_TASK * token_blocks;
    }
#pragma omp parallel for schedule(dynamic, 1) if (m * rows * cols >= PARALLEL_MIN_MACS)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t p = 0, first = task, column = 0; /* the task's part, its number there, the part's first column */
        for (;; p++) {
            const int64_t in_part = (parts[PART_WORDS * p + 3] + ROW_TASK - 1) / ROW_TASK * token_blocks;
            if (first < in_part) break;
            first -= in_part;
            column += parts[PART_WORDS * p + 3];
        }
        const int64_t *part = parts + PART_WORDS * p;
        const int qtype = (int)part[0];
        const uint8_t *w = (const uint8_t *)(uintptr_t)part[1];
        const int64_t part_rows = part[3], j0 = first / token_blocks * ROW_TASK, b0 = first % token_blocks * TOKEN_BLOCK;
        const int64_t j1 = j0 + ROW_TASK < part_rows ? j0 + ROW_TASK : part_rows;
        const int64_t tb = m - b0 < TOKEN_BLOCK ? m - b0 : TOKEN_BLOCK;
        if (act && type_elements(qtype) > 1)
            quantized_task(qtype, act, b0, tb, w, part[2], j0, j1, part_rows, cols, out + column, out_stride);
        else
            exact_task(qtype, x, x_stride, b0, b0 + tb, w, part[2], j0, j1, cols, out + column, out_stride);
    }
}

/* out [m, rows] (row stride out_stride) = the activations act (srt_gguf_quantize_rows of x [m, cols]) times
 * the block matrix w [rows, cols] of type qtype (each row w_stride bytes apart). Returns 0, or -1 for a type
 * this function does not take (gguf_linear.py checks it first). */
int srt_gguf_matmul(int qtype, const uint8_t *act, int64_t m, const uint8_t *w, int64_t w_stride, int64_t rows,
                    int64_t cols, float *out, int64_t out_stride) {
    if (type_elements(qtype) <= 1) return -1;
    const int64_t part[PART_WORDS] = {qtype, (int64_t)(uintptr_t)w, w_stride, rows};
    products(NULL, 0, act, m, cols, 1, part, out, out_stride);
    return 0;
}

/* out [m, rows] (row stride out_stride) = x [m, cols] (row stride x_stride) times the matrix w [rows, cols]
 * of any type this library takes, dequantized exactly: the fp32 product up to summation order. Each chunk of
 * a row is dequantized once for a block of tokens. -1 for a type it does not take. */
int srt_gguf_matmul_exact(int qtype, const float *x, int64_t m, int64_t x_stride, const uint8_t *w, int64_t w_stride,
                          int64_t rows, int64_t cols, float *out, int64_t out_stride) {
    if (!type_bytes(qtype)) return -1;
    const int64_t part[PART_WORDS] = {qtype, (int64_t)(uintptr_t)w, w_stride, rows};
    products(x, x_stride, NULL, m, cols, 1, part, out, out_stride);
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

/* ---- a whole layer in one call: x times block matrices stacked along the output ---- */

/* out [m, sum of rows] (row stride out_stride) = x [m, cols] (row stride x_stride) times the nparts block
 * matrices described by parts [nparts, PART_WORDS], each writing its columns of out in turn: a fused layer
 * (qkv, gate_up) whose parts may differ in type, with the activations quantized once into act (m *
 * srt_gguf_act_row_bytes(cols) bytes), or kept in fp32 for every part where act is NULL (exact). One call a
 * layer for gguf_linear.py, and one a projection for a decode loop in C. Returns 0, or -1 before writing
 * anything if a part's type is not one this library takes or cols is not a multiple of its block. */
int srt_gguf_linear(const float *x, int64_t m, int64_t cols, int64_t x_stride, int64_t nparts, const int64_t *parts,
                    uint8_t *act, float *out, int64_t out_stride) {
    int quantized = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const int qtype = (int)parts[PART_WORDS * p];
        if (!type_bytes(qtype) || cols % type_elements(qtype)) return -1;
        quantized |= type_elements(qtype) > 1;
    }
    if (quantized && act) srt_gguf_quantize_rows(x, m, cols, x_stride, act);
    products(x, x_stride, quantized ? act : NULL, m, cols, nparts, parts, out, out_stride);
    return 0;
}
