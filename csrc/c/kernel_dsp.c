/* kernel_dsp.c: Cortex-M4, M7, M33 (the DSP extension): SMLAD, two 16x16 products a cycle.
 *
 * Pairs layout (qgru_rt.h QGRU_RT_LAYOUT_PAIRS): a group of a block is four words, each two rows'
 * two columns as bytes (W[r][k] + 128, W[r+1][k], W[r][k+1] + 128, W[r+1][k+1]). Read as signed
 * halfwords a word is (u + 256 w') per column, u = W[r] + 128 in [0, 255] and w' = W[r+1], so one
 * SMLAD against the activation pair (a[k], a[k+1]) adds sum u a + 256 sum w' a, and SXTB16 of the
 * word rotated by 8 gives (W[r+1][k], W[r+1][k+1]) for a second SMLAD: four products in three
 * instructions. Over the row, A = S_r + 128 sum(a) + 256 S_{r+1} and B = S_{r+1}; A starts at
 * b_r + 256 b_{r+1} - 128 sum(a) (init and corr), B at b_{r+1}, so row r is A - 256 B. The sums are
 * modulo 2^32 (SMLAD wraps), exact because every true result fits int32 (the export's bound). */
#include "qgru_rt_kernel.h"

#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_DSP
#include <arm_acle.h>

const char qgru_rt_kernel_name[] = "dsp";

/* word loads of int8 / int16 arrays (the export aligns the weights to 16 bytes, the runtime's
 * activation buffers are word-aligned): a may_alias type keeps them legal under strict aliasing */
typedef uint32_t __attribute__((may_alias, aligned(4))) word;

/* SXTB16 of v rotated right by 8: one instruction (gcc does not fold the rotation itself) */
static inline uint32_t sxtb16_ror8(uint32_t v)
{
    uint32_t r;
    __asm__("sxtb16 %0, %1, ror #8" : "=r"(r) : "r"(v));
    return r;
}

#define QGRU_RT_DSP_PAIR(wv, xv, A, B)                                                             \
    do {                                                                                           \
        A = __smlad((wv), (xv), A);                                                                \
        B = __smlad(sxtb16_ror8(wv), (xv), B);                                                     \
    } while (0)

/* one group (four columns of the four rows): one LDRD of activations, one LDM of four weight
 * words, two SMLADs and an SXTB16 per word */
#define QGRU_RT_DSP_GROUP \
    "ldrd %[x01], %[x23], [%[a]], #8\n\t" \
    "ldmia %[w]!, {r8, r9, r10, r11}\n\t" \
    "smlad %[a0], r8, %[x01], %[a0]\n\t" \
    "sxtb16 r8, r8, ror #8\n\t" \
    "smlad %[b1], r8, %[x01], %[b1]\n\t" \
    "smlad %[a2], r9, %[x01], %[a2]\n\t" \
    "sxtb16 r9, r9, ror #8\n\t" \
    "smlad %[b3], r9, %[x01], %[b3]\n\t" \
    "smlad %[a0], r10, %[x23], %[a0]\n\t" \
    "sxtb16 r10, r10, ror #8\n\t" \
    "smlad %[b1], r10, %[x23], %[b1]\n\t" \
    "smlad %[a2], r11, %[x23], %[a2]\n\t" \
    "sxtb16 r11, r11, ror #8\n\t" \
    "smlad %[b3], r11, %[x23], %[b3]\n\t"

static inline __attribute__((always_inline)) void dot4(const int8_t *w, const int16_t *a, int32_t k_pad,
                                                        const int32_t *init, int32_t corr, int32_t out[4])
{
    const int16_t *end = a + k_pad;
    int32_t a0 = corr, b1 = 0, a2 = corr, b3 = 0;
    if (init) {
        a0 += init[0];
        b1 = init[1];
        a2 += init[2];
        b3 = init[3];
    }
    if ((k_pad & 4) != 0) { /* k_pad is a multiple of 4: one odd group first */
        const word *v = (const word *)(const void *)w, *x = (const word *)(const void *)a;
        const uint32_t x01 = x[0], x23 = x[1];
        QGRU_RT_DSP_PAIR(v[0], x01, a0, b1);
        QGRU_RT_DSP_PAIR(v[1], x01, a2, b3);
        QGRU_RT_DSP_PAIR(v[2], x23, a0, b1);
        QGRU_RT_DSP_PAIR(v[3], x23, a2, b3);
        a += 4;
        w += 16;
    }
    if (a < end) { /* two groups a pass (eight columns of the four rows): one LDRD of activations
                    * and one LDM of four weight words a group, three instructions per four products */
        uint32_t x01, x23;
        __asm__("1:\n\t" QGRU_RT_DSP_GROUP QGRU_RT_DSP_GROUP
                "cmp %[a], %[end]\n\t"
                "bne 1b"
                : [a0] "+r"(a0), [b1] "+r"(b1), [a2] "+r"(a2), [b3] "+r"(b3), [a] "+r"(a), [w] "+r"(w),
                  [x01] "=&r"(x01), [x23] "=&r"(x23)
                : [end] "r"(end)
                : "r8", "r9", "r10", "r11", "cc", "memory");
    }
    out[0] = (int32_t)((uint32_t)a0 - ((uint32_t)b1 << 8));
    out[1] = b1;
    out[2] = (int32_t)((uint32_t)a2 - ((uint32_t)b3 << 8));
    out[3] = b3;
}

void qgru_rt_dot4_a16(const int8_t *w, int32_t stride, const int16_t *a, int32_t k_pad, const int32_t *init,
                      int32_t corr, int32_t out[4])
{
    (void)stride;
    dot4(w, a, k_pad, init, corr, out);
}

void qgru_rt_dot12_a16(const int8_t *w, int32_t gstride, const int16_t *a, int32_t k_pad, const int32_t *init,
                       int32_t istride, int32_t corr, int32_t out[3][4])
{
    dot4(w, a, k_pad, init, corr, out[0]);
    dot4(w + gstride, a, k_pad, init + istride, corr, out[1]);
    dot4(w + 2 * gstride, a, k_pad, init + 2 * istride, corr, out[2]);
}

void qgru_rt_dot4_a8(const int8_t *w, int32_t stride, const int8_t *a, int32_t k_pad, const int32_t *init,
                     int32_t corr, int32_t out[4])
{
    (void)w, (void)stride, (void)a, (void)k_pad, (void)init, (void)corr, (void)out; /* QGRU_RT_HAS_A8 is 0 */
}

void qgru_rt_dot12_a8(const int8_t *w, int32_t gstride, const int8_t *a, int32_t k_pad, const int32_t *init,
                      int32_t istride, int32_t corr, int32_t out[3][4])
{
    (void)w, (void)gstride, (void)a, (void)k_pad, (void)init, (void)istride, (void)corr, (void)out; /* never called */
}
#else
typedef int qgru_rt_kernel_dsp_unused;
#endif
