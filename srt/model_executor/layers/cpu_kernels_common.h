/* srt's CPU kernels for the int8 model, built at first use by cpu_kernels.py with this machine's compiler
 * and -march=native (cpu_kernels.py's SOURCES into one library), and called through ctypes. This header
 * holds what the sources share: the instruction set, OpenMP, the vector and fp16 helpers.
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
 * exact integer per output (126 * level-1 dot + level-2 dot), dequantized once in fp32 in the PyTorch path's
 * order; no FMA contraction (built with -ffp-contract=off), round half to even (nearbyintf in the default
 * rounding mode, as torch.round). The norm, activation and attention kernels sum in their own fixed order
 * instead (see cpu_attention_kernels.c). Every row is computed on its own, so no result depends on the batch,
 * and attention gives a token the same bits in an extend step as in a decode step: the int8 model is batch-
 * invariant (test/unit/test_batch_invariance.py).
 */
#ifndef SRT_CPU_KERNELS_COMMON_H
#define SRT_CPU_KERNELS_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; }
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

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Reductions keep LANES independent partial results, which the compiler vectorizes (one running value
 * would be a serial chain: floating-point addition is not associative, so it may not reorder it). */
#define LANES 16

/* ---- Vector arithmetic and fp16, shared by the layer and attention kernels ---- */

/* Eight floats as one vector value (GCC/Clang vector extension: an AVX register where there is one, else
 * pairs of SSE registers or scalars; the arithmetic is elementwise IEEE either way). aligned(4): loads and
 * stores of any float address. */
typedef float v8f __attribute__((vector_size(32), aligned(4)));

static inline v8f v8f_splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

/* a where mask, else b (mask lanes all ones or all zeros, as vector comparisons give them) */
static inline v8f v8f_select(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

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
/* The kernels the decode layer loop (cpu_decode_kernels.c) calls, defined in the other sources. */
void srt_w8a8_linear(const float *x, int64_t m, int64_t k, int64_t x_stride, const int8_t *w,
                     const float *wscale, const float *bias, int64_t n, float *out, int8_t *q, float *qscale);
void srt_rmsnorm(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *w, float eps, float *out);
void srt_rope(float *x, int64_t n, int64_t row_stride, int64_t heads, int64_t head_dim, const float *cos,
              const float *sin, int64_t cs_stride);
void srt_store_kv(const float *qkv, int64_t m, int64_t row_stride, int64_t k_offset, int64_t v_offset,
                  int64_t width, const int64_t *loc, void *k_pool, void *v_pool, int half);
int srt_decode_attention(const float *q, int64_t bs, int64_t q_stride, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, const void *k_pool, const void *v_pool, int64_t kv_half,
                         const int64_t *slots, int64_t slots_stride, const int64_t *seq_lens, float scale,
                         float *out);
void srt_silu_mul(const float *gu, int64_t m, int64_t inter, int64_t gu_stride, float *out);
int srt_gguf_linear(const float *x, int64_t m, int64_t cols, int64_t x_stride, int64_t nparts, const int64_t *parts,
                    uint8_t *act, float *out, int64_t out_stride);
void srt_lora_add_segments(const float *x, int64_t k, int64_t x_stride, const int64_t *rows, int64_t nseg,
                           const int64_t *seg, const void *a, int64_t a_slot_stride, int64_t nsub,
                           const void *bt, int64_t bt_slot_stride, int64_t bt_stride, const int64_t *out_offset,
                           const int64_t *out_size, int64_t half, float *out, int64_t out_stride);
#endif /* SRT_CPU_KERNELS_COMMON_H */
