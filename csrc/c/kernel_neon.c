/* kernel_neon.c: AArch64 Advanced SIMD on interleaved weights (16 bytes: four columns of four
 * rows). int8 activations: SDOT by lane (Armv8.2 +dotprod, e.g. Cortex-A55, A76) sums four int8
 * products into the row's int32 lane; without dotprod (Cortex-A53, A72) SMULL gives exact int16
 * products (|w a| <= 2^14) and SADALP adds their pairs into int32 lanes. int16 activations: the
 * weights widened to int16 and SMLAL into int32 lanes. */
#include "qgru_rt_kernel.h"

#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_NEON
#include <arm_neon.h>
#include <string.h>

#if defined(__ARM_FEATURE_DOTPROD)
const char qgru_rt_kernel_name[] = "neon-dotprod";
#else
const char qgru_rt_kernel_name[] = "neon";
#endif

static inline int32x4_t start(const int32_t *init) { return init ? vld1q_s32(init) : vdupq_n_s32(0); }

static inline void reduce4(int32x4_t s0, int32x4_t s1, int32x4_t s2, int32x4_t s3, const int32_t *init, int32_t out[4])
{
    vst1q_s32(out, vaddq_s32(start(init), vpaddq_s32(vpaddq_s32(s0, s1), vpaddq_s32(s2, s3))));
}

static inline __attribute__((always_inline)) void dot4_a8(const int8_t *w, int32_t stride, const int8_t *a, int32_t k_pad,
                                                          const int32_t *init, int32_t corr, int32_t out[4])
{
    int32_t k;
    (void)stride, (void)corr;
#if defined(__ARM_FEATURE_DOTPROD)
    /* a group (16 bytes: four columns of the four rows) against four activations: one SDOT by
     * lane adds row r's four products to lane r; four groups per 16 activations. Past k_pad the
     * loads read the next block (or the 64 padding bytes) against zero activations. */
    int32x4_t s = start(init);
    for (k = 0; k < k_pad; k += 16, w += 64) {
        const int8x16_t x = vld1q_s8(a + k);
        s = vdotq_laneq_s32(s, vld1q_s8(w), x, 0);
        s = vdotq_laneq_s32(s, vld1q_s8(w + 16), x, 1);
        s = vdotq_laneq_s32(s, vld1q_s8(w + 32), x, 2);
        s = vdotq_laneq_s32(s, vld1q_s8(w + 48), x, 3);
    }
    vst1q_s32(out, s);
#else
    /* SMULL: exact int16 products of a group and its four activations (repeated), rows 0-1 in
     * the low half, 2-3 in the high half; SADALP adds their pairs into int32 lanes */
    int32x4_t s01 = vdupq_n_s32(0), s23 = s01;
    for (k = 0; k < k_pad; k += 4, w += 16) {
        int32_t x4;
        int8x16_t v = vld1q_s8(w), x;
        memcpy(&x4, a + k, 4);
        x = vreinterpretq_s8_s32(vdupq_n_s32(x4));
        s01 = vpadalq_s16(s01, vmull_s8(vget_low_s8(v), vget_low_s8(x)));
        s23 = vpadalq_s16(s23, vmull_high_s8(v, x));
    }
    vst1q_s32(out, vaddq_s32(start(init), vpaddq_s32(s01, s23)));
#endif
}

static inline __attribute__((always_inline)) void dot4_a16(const int8_t *w, int32_t stride, const int16_t *a, int32_t k_pad,
                                                           const int32_t *init, int32_t corr, int32_t out[4])
{
    /* a group's rows widened to int16, each SMLAL'd against the four activations lane by lane */
    int32x4_t s0 = vdupq_n_s32(0), s1 = s0, s2 = s0, s3 = s0;
    int32_t k;
    (void)stride, (void)corr;
    for (k = 0; k < k_pad; k += 4, w += 16) {
        const int8x16_t v = vld1q_s8(w);
        const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
        const int16x4_t x = vld1_s16(a + k);
        s0 = vmlal_s16(s0, vget_low_s16(lo), x);
        s1 = vmlal_s16(s1, vget_high_s16(lo), x);
        s2 = vmlal_s16(s2, vget_low_s16(hi), x);
        s3 = vmlal_s16(s3, vget_high_s16(hi), x);
    }
    reduce4(s0, s1, s2, s3, init, out);
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
#if defined(__ARM_FEATURE_DOTPROD)
    /* the three gates' blocks in one loop: each 16 activations loaded once for 12 SDOTs, each
     * gate's 64 bytes of weights one LD1 of four registers (post-incremented) */
    const int8_t *w0 = w, *w1 = w + gstride, *w2 = w + 2 * gstride;
    int32x4_t s0 = vld1q_s32(init), s1 = vld1q_s32(init + istride), s2 = vld1q_s32(init + 2 * istride);
    int32_t k;
    (void)corr;
    for (k = 0; k < k_pad; k += 16) {
        const int8x16_t x = vld1q_s8(a + k);
        const int8x16x4_t v0 = vld1q_s8_x4(w0), v1 = vld1q_s8_x4(w1), v2 = vld1q_s8_x4(w2);
        w0 += 64, w1 += 64, w2 += 64;
        s0 = vdotq_laneq_s32(s0, v0.val[0], x, 0);
        s1 = vdotq_laneq_s32(s1, v1.val[0], x, 0);
        s2 = vdotq_laneq_s32(s2, v2.val[0], x, 0);
        s0 = vdotq_laneq_s32(s0, v0.val[1], x, 1);
        s1 = vdotq_laneq_s32(s1, v1.val[1], x, 1);
        s2 = vdotq_laneq_s32(s2, v2.val[1], x, 1);
        s0 = vdotq_laneq_s32(s0, v0.val[2], x, 2);
        s1 = vdotq_laneq_s32(s1, v1.val[2], x, 2);
        s2 = vdotq_laneq_s32(s2, v2.val[2], x, 2);
        s0 = vdotq_laneq_s32(s0, v0.val[3], x, 3);
        s1 = vdotq_laneq_s32(s1, v1.val[3], x, 3);
        s2 = vdotq_laneq_s32(s2, v2.val[3], x, 3);
    }
    vst1q_s32(out[0], s0);
    vst1q_s32(out[1], s1);
    vst1q_s32(out[2], s2);
    return;
#else
    /* the three gates' blocks in one loop, 16 activations a pass (each four replicated by DUP of
     * a lane, for the three gates), each gate's 64 bytes one LD1 of four registers: SMULL / SMULL2
     * of each group and its four activations (exact int16 products), SADALP into int32 lanes as in
     * dot4_a8; past k_pad the loads read the next block (or the padding) against zero activations */
    const int8_t *w0 = w, *w1 = w + gstride, *w2 = w + 2 * gstride;
    int32x4_t s0 = vdupq_n_s32(0), t0 = s0, s1 = s0, t1 = s0, s2 = s0, t2 = s0;
    int32_t k, i;
    (void)corr;
    for (k = 0; k < k_pad; k += 16, w0 += 64, w1 += 64, w2 += 64) {
        const int32x4_t x = vreinterpretq_s32_s8(vld1q_s8(a + k));
        const int8x16x4_t v0 = vld1q_s8_x4(w0), v1 = vld1q_s8_x4(w1), v2 = vld1q_s8_x4(w2);
        int8x16_t xi[4];
        xi[0] = vreinterpretq_s8_s32(vdupq_laneq_s32(x, 0)), xi[1] = vreinterpretq_s8_s32(vdupq_laneq_s32(x, 1));
        xi[2] = vreinterpretq_s8_s32(vdupq_laneq_s32(x, 2)), xi[3] = vreinterpretq_s8_s32(vdupq_laneq_s32(x, 3));
        for (i = 0; i < 4; i++) {
            s0 = vpadalq_s16(s0, vmull_s8(vget_low_s8(v0.val[i]), vget_low_s8(xi[i])));
            t0 = vpadalq_s16(t0, vmull_high_s8(v0.val[i], xi[i]));
            s1 = vpadalq_s16(s1, vmull_s8(vget_low_s8(v1.val[i]), vget_low_s8(xi[i])));
            t1 = vpadalq_s16(t1, vmull_high_s8(v1.val[i], xi[i]));
            s2 = vpadalq_s16(s2, vmull_s8(vget_low_s8(v2.val[i]), vget_low_s8(xi[i])));
            t2 = vpadalq_s16(t2, vmull_high_s8(v2.val[i], xi[i]));
        }
    }
    vst1q_s32(out[0], vaddq_s32(vld1q_s32(init), vpaddq_s32(s0, t0)));
    vst1q_s32(out[1], vaddq_s32(vld1q_s32(init + istride), vpaddq_s32(s1, t1)));
    vst1q_s32(out[2], vaddq_s32(vld1q_s32(init + 2 * istride), vpaddq_s32(s2, t2)));
#endif
}

void qgru_rt_dot12_a16(const int8_t *w, int32_t gstride, const int16_t *a, int32_t k_pad, const int32_t *init,
                       int32_t istride, int32_t corr, int32_t out[3][4])
{
    dot4_a16(w, k_pad, a, k_pad, init, corr, out[0]);
    dot4_a16(w + gstride, k_pad, a, k_pad, init + istride, corr, out[1]);
    dot4_a16(w + 2 * gstride, k_pad, a, k_pad, init + 2 * istride, corr, out[2]);
}
#else
typedef int qgru_rt_kernel_neon_unused;
#endif
