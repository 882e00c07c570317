/* kernel_v6m.c: ARMv6-M (Cortex-M0, M0+, M1; Thumb-1, MULS 32 x 32 -> 32 only, no DSP).
 * Offset weights (qgru_rt.h QGRU_RT_LAYOUT_OFFSET): the interleaved order (each 16 bytes four
 * columns of the block's four rows), each byte u = W + 128 in [0, 255]. A group of four columns:
 * one LDM of the four int16 activations (two words, split by SXTH / ASRS #16), then per weight one
 * LDRB (immediate offset), a MULS and an ADD into the row's accumulator (r8-r11): 56 instructions
 * per 16 multiply-adds (the signed bytes of one word load took 68: SXTB / LSLS + ASRS to split
 * them; LDRSB has no immediate form). Each row sums S + 128 sum(a); corr = -128 sum(a)
 * (QGRU_RT_NEEDS_ASUM, the runtime's act_corr) starts every accumulator. Sums modulo 2^32 (MULS,
 * ADD wrap), exact because every true result fits int32 (the export's bound). */
#include "qgru_rt_kernel.h"

#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_V6M
const char qgru_rt_kernel_name[] = "v6m";

/* one row's four columns: its offset bytes u = W + 128 (LDRB takes immediate offsets; LDRSB only
 * register ones), each a MULS and an ADD into the row's accumulator */
#define QGRU_RT_V6M_MAC(off, x, acc)                                                               \
    "ldrb r6, [r0, #" #off "]\n\t"                                                                 \
    "muls r6, " #x "\n\t"                                                                          \
    "add " #acc ", r6\n\t"
#define QGRU_RT_V6M_ROW(o0, o1, o2, o3, acc)                                                       \
    QGRU_RT_V6M_MAC(o0, r3, acc) QGRU_RT_V6M_MAC(o1, r4, acc) QGRU_RT_V6M_MAC(o2, r1, acc) QGRU_RT_V6M_MAC(o3, r5, acc)

/* a group of four columns: the four int16 activations (LDM, split by SXTH / ASRS #16) against the
 * block's 16 weight bytes at r0 + o0 .. o15 */
#define QGRU_RT_V6M_GROUP(o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, o12, o13, o14, o15)  \
    "ldm r2!, {r3, r5}\n\t"                                                                        \
    "asrs r4, r3, #16\n\t"                                                                         \
    "sxth r3, r3\n\t"                                                                              \
    "sxth r1, r5\n\t"                                                                              \
    "asrs r5, r5, #16\n\t"                                                                         \
    QGRU_RT_V6M_ROW(o0, o1, o2, o3, r8) QGRU_RT_V6M_ROW(o4, o5, o6, o7, r9)                         \
    QGRU_RT_V6M_ROW(o8, o9, o10, o11, r10) QGRU_RT_V6M_ROW(o12, o13, o14, o15, r11)

/* r0 w, r1 stride (unused), r2 a, r3 k_pad (a multiple of 4), stack: init, corr, out (AAPCS) */
#define U_ __attribute__((unused)) /* a naked function names its arguments only in the asm */
__attribute__((naked)) void qgru_rt_dot4_a16(U_ const int8_t *w, U_ int32_t stride, U_ const int16_t *a, U_ int32_t k_pad,
                                             U_ const int32_t *init, U_ int32_t corr, U_ int32_t out[4])
{
    __asm__(".syntax unified\n\t"
            "push {r4, r5, r6, r7, lr}\n\t"
            "mov r4, r8\n\t"
            "mov r5, r9\n\t"
            "mov r6, r10\n\t"
            "mov r7, r11\n\t"
            "push {r4, r5, r6, r7}\n\t"
            "ldr r4, [sp, #36]\n\t" /* init */
            "ldr r5, [sp, #40]\n\t" /* corr */
            "mov r8, r5\n\t"
            "mov r9, r5\n\t"
            "mov r10, r5\n\t"
            "mov r11, r5\n\t"
            "cmp r4, #0\n\t"
            "beq 1f\n\t"
            "ldr r6, [r4, #0]\n\t"
            "add r8, r6\n\t"
            "ldr r6, [r4, #4]\n\t"
            "add r9, r6\n\t"
            "ldr r6, [r4, #8]\n\t"
            "add r10, r6\n\t"
            "ldr r6, [r4, #12]\n\t"
            "add r11, r6\n\t"
            "1:\n\t"
            "lsls r3, r3, #1\n\t"
            "adds r3, r2, r3\n\t"
            "mov r12, r3\n\t"
            "cmp r2, r3\n\t"
            "beq 3f\n\t"
            "2:\n\t"
            "ldm r2!, {r3, r5}\n\t" /* (a[k], a[k+1]), (a[k+2], a[k+3]) */
            "asrs r4, r3, #16\n\t"  /* x1 */
            "sxth r3, r3\n\t"       /* x0 */
            "sxth r1, r5\n\t"       /* x2 */
            "asrs r5, r5, #16\n\t"  /* x3 */
            QGRU_RT_V6M_ROW(0, 1, 2, 3, r8) QGRU_RT_V6M_ROW(4, 5, 6, 7, r9)
            QGRU_RT_V6M_ROW(8, 9, 10, 11, r10) QGRU_RT_V6M_ROW(12, 13, 14, 15, r11)
            "adds r0, #16\n\t"
            "cmp r2, r12\n\t"
            "bne 2b\n\t"
            "3:\n\t"
            "ldr r4, [sp, #44]\n\t" /* out */
            "mov r6, r8\n\t"
            "str r6, [r4, #0]\n\t"
            "mov r6, r9\n\t"
            "str r6, [r4, #4]\n\t"
            "mov r6, r10\n\t"
            "str r6, [r4, #8]\n\t"
            "mov r6, r11\n\t"
            "str r6, [r4, #12]\n\t"
            "pop {r4, r5, r6, r7}\n\t"
            "mov r8, r4\n\t"
            "mov r9, r5\n\t"
            "mov r10, r6\n\t"
            "mov r11, r7\n\t"
            "pop {r4, r5, r6, r7, pc}\n\t"
            ".syntax divided\n\t");
}

/* the three gates' blocks in one call (qgru_rt_kernel.h): the same loop per gate, two groups of
 * four columns a pass (53.5 instructions per 16 multiply-adds), gate g's weights at w + g gstride,
 * its accumulators from init + g istride (+ corr), out[g]; locals on the stack */
__attribute__((naked)) void qgru_rt_dot12_a16(U_ const int8_t *w, U_ int32_t gstride, U_ const int16_t *a, U_ int32_t k_pad,
                                              U_ const int32_t *init, U_ int32_t istride, U_ int32_t corr, U_ int32_t out[3][4])
{
    __asm__(".syntax unified\n\t"
            "push {r4, r5, r6, r7, lr}\n\t"
            "mov r4, r8\n\t"
            "mov r5, r9\n\t"
            "mov r6, r10\n\t"
            "mov r7, r11\n\t"
            "push {r4, r5, r6, r7}\n\t"
            "sub sp, #16\n\t" /* [sp] w of this gate, [sp + 4] gstride, [sp + 8] a, [sp + 12] gates left */
            "str r0, [sp, #0]\n\t"
            "str r1, [sp, #4]\n\t"
            "str r2, [sp, #8]\n\t"
            "lsls r3, r3, #1\n\t"
            "adds r3, r2, r3\n\t"
            "mov r12, r3\n\t" /* a + k_pad: the end (k_pad >= 4, a multiple of 4) */
            "movs r3, #3\n\t"
            "str r3, [sp, #12]\n\t"
            "4:\n\t"
            "ldr r4, [sp, #52]\n\t" /* init (this gate's) */
            "ldr r5, [sp, #60]\n\t" /* corr */
            "ldr r6, [r4, #0]\n\t"
            "adds r6, r6, r5\n\t"
            "mov r8, r6\n\t"
            "ldr r6, [r4, #4]\n\t"
            "adds r6, r6, r5\n\t"
            "mov r9, r6\n\t"
            "ldr r6, [r4, #8]\n\t"
            "adds r6, r6, r5\n\t"
            "mov r10, r6\n\t"
            "ldr r6, [r4, #12]\n\t"
            "adds r6, r6, r5\n\t"
            "mov r11, r6\n\t"
            "ldr r6, [sp, #56]\n\t" /* istride */
            "lsls r6, r6, #2\n\t"
            "adds r4, r4, r6\n\t"
            "str r4, [sp, #52]\n\t"
            "ldr r0, [sp, #0]\n\t"
            "ldr r2, [sp, #8]\n\t"
            /* two groups a pass; an odd number of groups enters at the second (w 16 bytes back) */
            "mov r6, r12\n\t"
            "subs r6, r6, r2\n\t"
            "lsls r6, r6, #28\n\t" /* bit 3 of 2 k_pad: (k_pad / 4) odd */
            "bpl 2f\n\t"
            "subs r0, #16\n\t"
            "b 3f\n\t"
            "2:\n\t"
            QGRU_RT_V6M_GROUP(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
            "3:\n\t"
            QGRU_RT_V6M_GROUP(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31)
            "adds r0, #32\n\t"
            "cmp r2, r12\n\t"
            "bne 2b\n\t"
            "ldr r4, [sp, #64]\n\t" /* out[g] */
            "mov r6, r8\n\t"
            "str r6, [r4, #0]\n\t"
            "mov r6, r9\n\t"
            "str r6, [r4, #4]\n\t"
            "mov r6, r10\n\t"
            "str r6, [r4, #8]\n\t"
            "mov r6, r11\n\t"
            "str r6, [r4, #12]\n\t"
            "adds r4, #16\n\t"
            "str r4, [sp, #64]\n\t"
            "ldr r0, [sp, #0]\n\t"
            "ldr r1, [sp, #4]\n\t"
            "adds r0, r0, r1\n\t"
            "str r0, [sp, #0]\n\t"
            "ldr r3, [sp, #12]\n\t"
            "subs r3, #1\n\t"
            "str r3, [sp, #12]\n\t"
            "beq 5f\n\t" /* (the loop is beyond a conditional branch's reach) */
            "b 4b\n\t"
            "5:\n\t"
            "add sp, #16\n\t"
            "pop {r4, r5, r6, r7}\n\t"
            "mov r8, r4\n\t"
            "mov r9, r5\n\t"
            "mov r10, r6\n\t"
            "mov r11, r7\n\t"
            "pop {r4, r5, r6, r7, pc}\n\t"
            ".syntax divided\n\t");
}

void qgru_rt_dot12_a8(const int8_t *w, int32_t gstride, const int8_t *a, int32_t k_pad, const int32_t *init,
                      int32_t istride, int32_t corr, int32_t out[3][4])
{
    (void)w, (void)gstride, (void)a, (void)k_pad, (void)init, (void)istride, (void)corr, (void)out; /* QGRU_RT_HAS_A8 is 0 */
}

void qgru_rt_dot4_a8(const int8_t *w, int32_t stride, const int8_t *a, int32_t k_pad, const int32_t *init,
                     int32_t corr, int32_t out[4])
{
    (void)w, (void)stride, (void)a, (void)k_pad, (void)init, (void)corr, (void)out; /* QGRU_RT_HAS_A8 is 0 */
}
#else
typedef int qgru_rt_kernel_v6m_unused; /* ISO C: a translation unit holds a declaration */
#endif
