/* kernel_mve.c: Armv8.1-M Helium (MVE), e.g. Cortex-M55, M85. VMLADAVA sums the products of
 * two vectors into a scalar int32: 16 int8 products (int8 activations) or 8 int16 products (int16
 * activations, the weights sign-extended by VLDRB.S16) per instruction. Four rows share every
 * activation load. */
#include "qgru_rt_kernel.h"

#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_MVE
#include <arm_mve.h>

const char qgru_rt_kernel_name[] = "mve";

static inline __attribute__((always_inline)) void dot4_a8(const int8_t *w, int32_t stride, const int8_t *a, int32_t k_pad,
                                                          const int32_t *init, int32_t corr, int32_t out[4])
{
    const int8_t *w0 = w, *w1 = w + stride, *w2 = w + 2 * stride, *w3 = w + 3 * stride;
    int32_t s0 = init ? init[0] : 0, s1 = init ? init[1] : 0, s2 = init ? init[2] : 0, s3 = init ? init[3] : 0, k;
    (void)corr;
    for (k = 0; k < k_pad; k += 16) { /* past k_pad: zero activations (the runtime pads to 16) */
        const int8x16_t x = vldrbq_s8(a);
        s0 = vmladavaq_s8(s0, vldrbq_s8(w0), x);
        s1 = vmladavaq_s8(s1, vldrbq_s8(w1), x);
        s2 = vmladavaq_s8(s2, vldrbq_s8(w2), x);
        s3 = vmladavaq_s8(s3, vldrbq_s8(w3), x);
        a += 16, w0 += 16, w1 += 16, w2 += 16, w3 += 16; /* post-increment loads */
    }
    out[0] = s0;
    out[1] = s1;
    out[2] = s2;
    out[3] = s3;
}

static inline __attribute__((always_inline)) void dot4_a16(const int8_t *w, int32_t stride, const int16_t *a, int32_t k_pad,
                                                           const int32_t *init, int32_t corr, int32_t out[4])
{
    const int8_t *w0 = w, *w1 = w + stride, *w2 = w + 2 * stride, *w3 = w + 3 * stride;
    int32_t s0 = init ? init[0] : 0, s1 = init ? init[1] : 0, s2 = init ? init[2] : 0, s3 = init ? init[3] : 0, k;
    (void)corr;
    for (k = 0; k < k_pad; k += 8) {
        const int16x8_t x = vldrhq_s16(a);
        s0 = vmladavaq_s16(s0, vldrbq_s16(w0), x);
        s1 = vmladavaq_s16(s1, vldrbq_s16(w1), x);
        s2 = vmladavaq_s16(s2, vldrbq_s16(w2), x);
        s3 = vmladavaq_s16(s3, vldrbq_s16(w3), x);
        a += 8, w0 += 8, w1 += 8, w2 += 8, w3 += 8;
    }
    out[0] = s0;
    out[1] = s1;
    out[2] = s2;
    out[3] = s3;
}
void qgru_rt_dot4_a8(const int8_t *w, int32_t stride, const int8_t *a, int32_t k_pad, const int32_t *init,
                     int32_t corr, int32_t out[4])
{
    dot4_a8(w, stride, a, k_pad, init, corr, out);
}

void qgru_rt_dot4_a16(const int8_t *w, int32_t stride, const int16_t *a, int32_t k_pad, const int32_t *init,
                      int32_t corr, int32_t out[4])
{
    dot4_a16(w, stride, a, k_pad, init, corr, out);
}

void qgru_rt_dot12_a8(const int8_t *w, int32_t gstride, const int8_t *a, int32_t k_pad, const int32_t *init,
                      int32_t istride, int32_t corr, int32_t out[3][4])
{
    dot4_a8(w, k_pad, a, k_pad, init, corr, out[0]);
    dot4_a8(w + gstride, k_pad, a, k_pad, init + istride, corr, out[1]);
    dot4_a8(w + 2 * gstride, k_pad, a, k_pad, init + 2 * istride, corr, out[2]);
}

void qgru_rt_dot12_a16(const int8_t *w, int32_t gstride, const int16_t *a, int32_t k_pad, const int32_t *init,
                       int32_t istride, int32_t corr, int32_t out[3][4])
{
    dot4_a16(w, k_pad, a, k_pad, init, corr, out[0]);
    dot4_a16(w + gstride, k_pad, a, k_pad, init + istride, corr, out[1]);
    dot4_a16(w + 2 * gstride, k_pad, a, k_pad, init + 2 * istride, corr, out[2]);
}
#else
typedef int qgru_rt_kernel_mve_unused;
#endif
