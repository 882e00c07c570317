/* kernel_dsp.c: Cortex-M4, M7, M33 (the DSP extension): SMLAD, two 16x16 products a cycle.
 *
 * Interleaved weights: a group is four words, one per row, each four int8 of that row (k0 k1 k2
 * k3); SXTB16 gives the halfword pair (k0, k2) and SXTB16 of the word rotated by 8 the pair (k1, k3). The activations are int16,
 * stored x0 x2 x1 x3 per group of four (QGRU_RT_ACT_POS), so each SMLAD adds two exact products
 * to an int32 sum; four rows share every activation load. */
#include "qgru_rt_kernel.h"

#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_DSP
#include <arm_acle.h>

const char qgru_rt_kernel_name[] = "dsp";

/* word loads of int8 / int16 arrays (the export aligns the weights to 16 bytes, the runtime's
 * activation buffers are word-aligned): a may_alias type keeps them legal under strict aliasing */
typedef uint32_t __attribute__((may_alias, aligned(4))) word;

static inline uint32_t ror8(uint32_t v) { return (v >> 8) | (v << 24); } /* folds into SXTB16's ROR #8 */

/* SXTB16 of v rotated right by 8: one instruction (gcc does not fold the rotation itself) */
static inline uint32_t sxtb16_ror8(uint32_t v)
{
    uint32_t r;
    __asm__("sxtb16 %0, %1, ror #8" : "=r"(r) : "r"(v));
    return r;
}

void qgru_rt_dot4_a16(const int8_t *w, int32_t stride, const int16_t *a, int32_t k_pad, int32_t out[4])
{
    const int16_t *end = a + k_pad;
    int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    (void)stride;
    while (a < end) { /* one group: four columns of the four rows, 16 bytes (one LDM) */
        const word *v = (const word *)(const void *)w, *x = (const word *)(const void *)a;
        const uint32_t x02 = x[0], x13 = x[1];
        s0 = __smlad(__sxtb16(v[0]), x02, s0);
        s0 = __smlad(sxtb16_ror8(v[0]), x13, s0);
        s1 = __smlad(__sxtb16(v[1]), x02, s1);
        s1 = __smlad(sxtb16_ror8(v[1]), x13, s1);
        s2 = __smlad(__sxtb16(v[2]), x02, s2);
        s2 = __smlad(sxtb16_ror8(v[2]), x13, s2);
        s3 = __smlad(__sxtb16(v[3]), x02, s3);
        s3 = __smlad(sxtb16_ror8(v[3]), x13, s3);
        a += 4;
        w += 16;
    }
    out[0] = s0;
    out[1] = s1;
    out[2] = s2;
    out[3] = s3;
}

void qgru_rt_dot4_a8(const int8_t *w, int32_t stride, const int8_t *a, int32_t k_pad, int32_t out[4])
{
    (void)w, (void)stride, (void)a, (void)k_pad, (void)out; /* QGRU_RT_HAS_A8 is 0: never called */
}
#else
typedef int qgru_rt_kernel_dsp_unused;
#endif
