/* srt's CPU kernels for the int8 model, built at first use by cpu_kernels.py with this machine's compiler
 * and -march=native (cpu_int8_linear_kernels.c and cpu_layer_kernels.c into one library), and called
 * through ctypes. This header holds what both sources share: the instruction set, OpenMP, the helpers.
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
 * instead (see cpu_layer_kernels.c). Every row is computed on its own, so no result depends on the batch,
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

#endif /* SRT_CPU_KERNELS_COMMON_H */
