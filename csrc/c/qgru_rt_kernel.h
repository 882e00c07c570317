/* qgru_rt_kernel.h: the matrix-vector kernels' interface and their compile-time choice.
 *
 * A kernel computes four int32 dot products (a block of four weight rows of k_pad columns, in
 * QGRU_RT_LAYOUT; `stride` = k_pad) against one activation vector: sum_k w[r][k] a[k], k < k_pad.
 * It may read weights up to 64 bytes past the block (the export pads the arrays) and activations up to qgru_rt_pad16(k_pad) (the
 * runtime zero-fills them). The runtime calls it only where the export proved every partial sum
 * fits int32 (docs/mcu.md), so any summation order gives the golden integers.
 *
 * QGRU_RT_KERNEL (override with -DQGRU_RT_KERNEL=...): chosen from the compiler's macros:
 *   QGRU_RT_KERNEL_MVE   Armv8.1-M Helium (Cortex-M55, M85): __ARM_FEATURE_MVE     kernel_mve.c
 *   QGRU_RT_KERNEL_NEON  AArch64 Advanced SIMD (SDOT with +dotprod)                 kernel_neon.c
 *   QGRU_RT_KERNEL_DSP   Cortex-M4, M7, M33 with DSP: SMLAD (__ARM_FEATURE_DSP)     kernel_dsp.c
 *   QGRU_RT_KERNEL_V6M   ARMv6-M (Cortex-M0, M0+): Thumb-1 MULS (__ARM_ARCH_6M__)   kernel_v6m.c
 *   QGRU_RT_KERNEL_REF   plain C (Cortex-M3, any host)                              kernel_ref.c
 */
#ifndef QGRU_RT_KERNEL_H_
#define QGRU_RT_KERNEL_H_

#include <stdint.h>

#include "qgru_rt.h"

#define QGRU_RT_KERNEL_REF 0
#define QGRU_RT_KERNEL_DSP 1
#define QGRU_RT_KERNEL_MVE 2
#define QGRU_RT_KERNEL_NEON 3
#define QGRU_RT_KERNEL_V6M 4

#ifndef QGRU_RT_KERNEL
#if defined(__ARM_FEATURE_MVE) && (__ARM_FEATURE_MVE & 1)
#define QGRU_RT_KERNEL QGRU_RT_KERNEL_MVE
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define QGRU_RT_KERNEL QGRU_RT_KERNEL_NEON
#elif defined(__ARM_FEATURE_DSP) && __ARM_FEATURE_DSP
#define QGRU_RT_KERNEL QGRU_RT_KERNEL_DSP
#elif defined(__ARM_ARCH_6M__) && (defined(__GNUC__) || defined(__clang__))
#define QGRU_RT_KERNEL QGRU_RT_KERNEL_V6M
#else
#define QGRU_RT_KERNEL QGRU_RT_KERNEL_REF
#endif
#endif

/* Where activation k is stored in the buffer the kernel reads (every kernel: in order) */
#define QGRU_RT_ACT_POS(k) (k)
#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_DSP || QGRU_RT_KERNEL == QGRU_RT_KERNEL_V6M
#define QGRU_RT_HAS_A8 0 /* int8 activations are widened to int16 (SMLAD's halfword pairs; v6m: LDM + SXTH) */
#define QGRU_RT_NEEDS_ASUM 1 /* the pairs and offset layouts need -128 sum(a) (qgru_rt.h QGRU_RT_LAYOUT_PAIRS, _OFFSET) */
#else
#define QGRU_RT_HAS_A8 (QGRU_RT_KERNEL != QGRU_RT_KERNEL_REF && QGRU_RT_KERNEL != QGRU_RT_KERNEL_V6M)
#define QGRU_RT_NEEDS_ASUM 0
#endif

/* the weight layout the kernel reads (the export writes it: export_mcu.write_mcu(layout=...)) */
#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_MVE
#define QGRU_RT_LAYOUT QGRU_RT_LAYOUT_ROWS
#elif QGRU_RT_KERNEL == QGRU_RT_KERNEL_DSP
#define QGRU_RT_LAYOUT QGRU_RT_LAYOUT_PAIRS
#elif QGRU_RT_KERNEL == QGRU_RT_KERNEL_V6M
#define QGRU_RT_LAYOUT QGRU_RT_LAYOUT_OFFSET
#else
#define QGRU_RT_LAYOUT QGRU_RT_LAYOUT_INTERLEAVED
#endif

#define qgru_rt_pad16(n) (((n) + 15) & ~15)

/* int16 activations (every kernel) and int8 activations (kernels with QGRU_RT_HAS_A8).
 * init: the four accumulators' start (0: zeros), in the layout's form (pairs: row 2i starts at
 * b[2i] + 256 b[2i+1], the export writes it); corr: -128 sum(a) where QGRU_RT_NEEDS_ASUM (pairs,
 * offset), else 0.
 * out[r] = init_r + sum_k w[r][k] a[k]. */
void qgru_rt_dot4_a16(const int8_t *w, int32_t stride, const int16_t *a, int32_t k_pad, const int32_t *init,
                      int32_t corr, int32_t out[4]);
void qgru_rt_dot4_a8(const int8_t *w, int32_t stride, const int8_t *a, int32_t k_pad, const int32_t *init,
                     int32_t corr, int32_t out[4]);

/* DSP, MVE, NEON, v6m: the three gates' blocks in one call (gate g's weights at w + g gstride, its
 * accumulators start at init + g istride, out[g][r]; the stride of rows is k_pad); init never 0 */
#if QGRU_RT_KERNEL != QGRU_RT_KERNEL_REF
#define QGRU_RT_HAS_DOT12 1
void qgru_rt_dot12_a16(const int8_t *w, int32_t gstride, const int16_t *a, int32_t k_pad, const int32_t *init,
                       int32_t istride, int32_t corr, int32_t out[3][4]);
void qgru_rt_dot12_a8(const int8_t *w, int32_t gstride, const int8_t *a, int32_t k_pad, const int32_t *init,
                      int32_t istride, int32_t corr, int32_t out[3][4]);
#else
#define QGRU_RT_HAS_DOT12 0
#endif

extern const char qgru_rt_kernel_name[];

#endif /* QGRU_RT_KERNEL_H_ */
