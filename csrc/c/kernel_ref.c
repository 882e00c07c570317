/* kernel_ref.c: the plain C kernel (any C99 compiler; Cortex-M3, hosts; -DQGRU_RT_KERNEL=QGRU_RT_KERNEL_REF elsewhere). Interleaved
 * weights: each 16 bytes hold four columns of the block's four rows. */
#include "qgru_rt_kernel.h"

#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_REF
const char qgru_rt_kernel_name[] = "ref";

#define QGRU_RT_REF_DOT4(A)                                                                        \
    int32_t s0 = init ? init[0] : 0, s1 = init ? init[1] : 0, s2 = init ? init[2] : 0, k;                \
    int32_t s3 = init ? init[3] : 0;                                                               \
    (void)stride, (void)corr;                                                                      \
    for (k = 0; k < k_pad; k += 4, w += 16) {                                                      \
        const int32_t x0 = (A)[k], x1 = (A)[k + 1], x2 = (A)[k + 2], x3 = (A)[k + 3];              \
        s0 += w[0] * x0 + w[1] * x1 + w[2] * x2 + w[3] * x3;                                       \
        s1 += w[4] * x0 + w[5] * x1 + w[6] * x2 + w[7] * x3;                                       \
        s2 += w[8] * x0 + w[9] * x1 + w[10] * x2 + w[11] * x3;                                     \
        s3 += w[12] * x0 + w[13] * x1 + w[14] * x2 + w[15] * x3;                                   \
    }                                                                                              \
    out[0] = s0;                                                                                   \
    out[1] = s1;                                                                                   \
    out[2] = s2;                                                                                   \
    out[3] = s3;

void qgru_rt_dot4_a16(const int8_t *w, int32_t stride, const int16_t *a, int32_t k_pad, const int32_t *init,
                     int32_t corr, int32_t out[4])
{
    QGRU_RT_REF_DOT4(a)
}

void qgru_rt_dot4_a8(const int8_t *w, int32_t stride, const int8_t *a, int32_t k_pad, const int32_t *init,
                     int32_t corr, int32_t out[4])
{
    QGRU_RT_REF_DOT4(a)
}
#else
typedef int qgru_rt_kernel_ref_unused; /* ISO C: a translation unit holds a declaration */
#endif
