/* qgru_rt.c: the driver of the qgru runtime (qgru_rt.h): layers, directions, time steps, and the
 * cell of golden.gru_step, unit by unit. The matrix-vector products are the kernel's
 * (qgru_rt_kernel.h); everything else is here, the same on every target. docs/mcu.md. */
#include <float.h>
#include <string.h>

#include "qgru_rt.h"
#include "qgru_rt_fixed.h"
#include "qgru_rt_kernel.h"
#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_NEON
#include <arm_neon.h>
#endif

/* activations of one GEMM operand: int8 when its grid has <= 8 bits and the kernel takes int8 */
typedef struct {
    int8_t *a8;
    int16_t *a16;
} act_buf;

static int use_a8(int bits) { return QGRU_RT_HAS_A8 && bits <= 8; }

/* zeros past n up to qgru_rt_pad16(n) (what the kernels read beyond the operand); every caller
 * writes all n values itself */
static void act_clear(act_buf b, int32_t n)
{
    const size_t z = (size_t)(qgru_rt_pad16(n) - n);
    if (!z)
        return;
    if (b.a8)
        memset(b.a8 + n, 0, z);
    else
        memset(b.a16 + n, 0, sizeof(int16_t) * z);
}

static void act_put(act_buf b, int32_t k, int32_t v)
{
    if (b.a8)
        b.a8[k] = (int8_t)v;
    else
        b.a16[QGRU_RT_ACT_POS(k)] = (int16_t)v;
}

/* W.x's bias and rescale per channel [3H]: the direction's own, or those of an x level */
typedef struct {
    const int32_t *bias;
    const int64_t *bias64;
    const int32_t *m;
    const uint8_t *s;
} wx_rq;

#ifndef QGRU_RT_FAST_ONLY /* the general cells (qgru_rt.h QGRU_RT_FAST_ONLY: a build without them) */
static int32_t act_get(act_buf b, int32_t k) { return b.a8 ? b.a8[k] : b.a16[QGRU_RT_ACT_POS(k)]; }
/* Four rows' dot products, exact: the kernel's int32 sums where the export proved they fit,
 * else an int64 loop (the wide path: weights of more than 8 bits, or a bound that fails). */
static void dot4(const qgru_rt_dir *d, int recurrent, int32_t row, act_buf a, int32_t corr, int64_t out[4])
{
    const int32_t K = recurrent ? d->hidden_size : d->input_size;
    const int32_t kp = recurrent ? d->k_pad_h : d->k_pad_x;
    const int8_t *w8 = recurrent ? d->r8 : d->w8;
    const int16_t *w16 = recurrent ? d->r16 : d->w16;
    int32_t i, k;
    if (!(recurrent ? d->wide_h : d->wide_x)) {
        int32_t s[4];
        if (a.a8)
            qgru_rt_dot4_a8(w8 + (int32_t)row * kp, kp, a.a8, kp, 0, corr, s);
        else
            qgru_rt_dot4_a16(w8 + (int32_t)row * kp, kp, a.a16, kp, 0, corr, s);
        for (i = 0; i < 4; i++)
            out[i] = s[i];
        return;
    }
    for (i = 0; i < 4; i++) {
        int64_t acc = 0;
        for (k = 0; k < K; k++) {
            const int32_t at = d->layout == QGRU_RT_LAYOUT_ROWS ? (row + i) * kp + k
                                                                : row * kp + (k >> 2) * 16 + i * 4 + (k & 3);
            acc += (int64_t)(w16 ? w16[at] : w8[at]) * act_get(a, k);
        }
        out[i] = acc;
    }
}

/* q - Z of a requantized accumulator (golden: saturate(rescale(acc) + Z) - Z) */
static int32_t requant_acc(int64_t acc, int32_t m, int s, int32_t zp, qgru_rt_range r)
{
    return (int32_t)(qgru_rt_sat64(qgru_rt_mul_shift(acc, m, s) + zp, r) - zp);
}

#endif /* QGRU_RT_FAST_ONLY */

#if defined(__GNUC__) || defined(__clang__)
#define QGRU_RT_NOINLINE __attribute__((noinline))
#else
#define QGRU_RT_NOINLINE
#endif

#ifndef QGRU_RT_FAST_ONLY /* the general cells (qgru_rt.h QGRU_RT_FAST_ONLY: a build without them) */
/* Unit j of the cell (golden gru_step): its three W x and R h sums (ax[4 g], ah[4 g]: gate g of dir_wide's blocks) -> the new h[j]. A function of
 * its own (not inlined into the block loop), so a 32-bit core keeps its values in registers. */
static QGRU_RT_NOINLINE int16_t unit(const qgru_rt_dir *d, const wx_rq *q, int32_t j, const int64_t *ax,
                                     const int64_t *ah, int32_t h)
{
    const int32_t H = d->hidden_size;
    int32_t dwx[3], drh[3], d_r, d_z, d_g, pre, g;
    int64_t hv;
    for (g = 0; g < 3; g++) {
        const int32_t c = g * H + j;
        const int64_t bx = q->bias ? q->bias[c] : q->bias64[c];
        const int64_t bh = d->bias_h ? d->bias_h[c] : d->bias_h64[c];
        dwx[g] = requant_acc(ax[4 * g] + bx, q->m[c], q->s[c], d->zp_wx[c], d->r_wx);
        drh[g] = requant_acc(ah[4 * g] + bh, d->m_rh[c], d->s_rh[c], d->zp_rh[c], d->r_rh);
    }
    pre = (int32_t)qgru_rt_sat64(qgru_rt_mul_shift32(dwx[0], d->m_gate[0][j], d->s_gate[0][j])
                                 + qgru_rt_mul_shift32(drh[0], d->m_gate[1][j], d->s_gate[1][j])
                                 + d->zp_rpre, d->r_rpre);
    d_r = qgru_rt_lookup(pre, &d->t_r) - d->zp_r;
    pre = (int32_t)qgru_rt_sat64(qgru_rt_mul_shift32(dwx[1], d->m_gate[2][j], d->s_gate[2][j])
                                 + qgru_rt_mul_shift32(drh[1], d->m_gate[3][j], d->s_gate[3][j])
                                 + d->zp_zpre, d->r_zpre);
    d_z = qgru_rt_lookup(pre, &d->t_z) - d->zp_z;
    /* g = tanh(Wx_g + r Rh_g): the product r Rh_g (< 2^33) rescaled straight into g_pre */
    pre = (int32_t)qgru_rt_sat64(qgru_rt_mul_shift32(dwx[2], d->m_gate[4][j], d->s_gate[4][j])
                                 + qgru_rt_mul_shift((int64_t)d_r * drh[2], d->m_gate[5][j], d->s_gate[5][j])
                                 + d->zp_gpre, d->r_gpre);
    d_g = qgru_rt_lookup(pre, &d->t_g) - d->zp_g;
    /* h' = z h + (1 - z) g, 1 - z on z's own grid: one_z - d_z */
    hv = qgru_rt_mul_shift((int64_t)d_z * (h - d->zp_h), d->m_zh, d->s_zh)
         + qgru_rt_mul_shift((int64_t)(d->one_z - d_z) * d_g, d->m_zg, d->s_zg) + d->zp_h;
    return (int16_t)qgru_rt_sat64(hv, d->r_h);
}

/* unit() where the export proved the 32-bit cell's bounds (cell32): every accumulator and rescale
 * operand v has |v| 2^pre < 2^31 (qgru_rt_rescale32), so each rescale is one SMULL and shifts of
 * its high word; only the three products (r Rh_g, z h, (1 - z) g) stay 64-bit. The same integers. */
static QGRU_RT_NOINLINE int16_t unit32(const qgru_rt_dir *d, const wx_rq *q, int32_t j, const int32_t *ax,
                                       const int32_t *ah, int32_t h)
{
    const int32_t H = d->hidden_size;
    int32_t dwx[3], drh[3], d_r, d_z, d_g, pre, g;
    int64_t hv;
    for (g = 0; g < 3; g++) {
        const int32_t c = g * H + j;
        dwx[g] = qgru_rt_sat32(qgru_rt_rescale32(ax[4 * g] + q->bias[c], q->m[c], q->s[c]) + d->zp_wx[c], d->r_wx)
                 - d->zp_wx[c];
        drh[g] = qgru_rt_sat32(qgru_rt_rescale32(ah[4 * g] + d->bias_h[c], d->m_rh[c], d->s_rh[c]) + d->zp_rh[c], d->r_rh)
                 - d->zp_rh[c];
    }
    pre = qgru_rt_sat32(qgru_rt_rescale32(dwx[0], d->m_gate[0][j], d->s_gate[0][j])
                        + qgru_rt_rescale32(drh[0], d->m_gate[1][j], d->s_gate[1][j]) + d->zp_rpre, d->r_rpre);
    d_r = qgru_rt_lookup(pre, &d->t_r) - d->zp_r;
    pre = qgru_rt_sat32(qgru_rt_rescale32(dwx[1], d->m_gate[2][j], d->s_gate[2][j])
                        + qgru_rt_rescale32(drh[1], d->m_gate[3][j], d->s_gate[3][j]) + d->zp_zpre, d->r_zpre);
    d_z = qgru_rt_lookup(pre, &d->t_z) - d->zp_z;
    pre = (int32_t)qgru_rt_sat64((int64_t)qgru_rt_rescale32(dwx[2], d->m_gate[4][j], d->s_gate[4][j])
                                 + qgru_rt_mul_shift((int64_t)d_r * drh[2], d->m_gate[5][j], d->s_gate[5][j])
                                 + d->zp_gpre, d->r_gpre);
    d_g = qgru_rt_lookup(pre, &d->t_g) - d->zp_g;
    hv = qgru_rt_mul_shift((int64_t)d_z * (h - d->zp_h), d->m_zh, d->s_zh)
         + qgru_rt_mul_shift((int64_t)(d->one_z - d_z) * d_g, d->m_zg, d->s_zg) + d->zp_h;
    return (int16_t)qgru_rt_sat64(hv, d->r_h);
}
#endif /* QGRU_RT_FAST_ONLY */

/* The fast cell (qgru_rt.h qgru_rt_fast, docs/mcu.md): unit j from its accumulators (biases
 * included by the kernels) -> the new h[j]. Each rescale is one SMMLAR (s <= 32) or the high word
 * of a product shifted once (s >= 33), each zero point and table input offset folded into a
 * constant, each table lookup one load pair and one multiply-add; the same integers as unit().
 * std16 (a constant at each call): every saturation is 16-bit (SSAT / USAT #16) and every table
 * has k = 6, frac = 4 (the geometry of a 16-bit input), so shifts and masks are immediates. */
QGRU_RT_INLINE int32_t fsat(int32_t v, qgru_rt_range r, const int std16)
{
    return std16 ? QGRU_RT_SSAT16(v) : v < r.lo ? r.lo : v > r.hi ? r.hi : v;
}

QGRU_RT_INLINE int32_t flook(int32_t u, int32_t span, const qgru_rt_ftable *t, const int std16)
{
    if (std16) {
        const int32_t *p;
        u = QGRU_RT_USAT16(u);
        p = t->tab + (u >> 6);
        return qgru_rt_shr32(p[0] + qgru_rt_shr32(p[1] - p[0], 6) * (u & 63), 10);
    }
    u = u < 0 ? 0 : u > span ? span : u;
    return qgru_rt_flookup(u, t);
}

/* q - Z of a requantized accumulator: saturate(rescale(acc) + Z) - Z, Z folded into the SMMLAR */
QGRU_RT_INLINE int32_t facc(int32_t acc, int32_t m, int32_t z, qgru_rt_range r, const int std16)
{
    return fsat(qgru_rt_mulhr(acc, m, z), r, std16) - z;
}

/* P: unit j's constants (qgru_rt.h QGRU_RT_UNIT_FIELDS), field f at P[QGRU_RT_UNIT_LANES f]; Q: its
 * shared constants (QGRU_RT_SHARED_FIELDS), field f at Q[QGRU_RT_UNIT_LANES f] */
#if QGRU_RT_LAYOUT == QGRU_RT_LAYOUT_PAIRS
#define QGRU_RT_UNIT_LANES 1
#define QGRU_RT_UNIT_PTR(F, j) ((F)->units + QGRU_RT_UNIT_FIELDS * (j))
#define QGRU_RT_SHARED_PTR(F, j) ((F)->shared + (F)->shared_stride * (j))
#else
#define QGRU_RT_UNIT_LANES 4
#define QGRU_RT_UNIT_PTR(F, j) ((F)->units + 4 * QGRU_RT_UNIT_FIELDS * ((j) >> 2) + ((j) & 3))
#define QGRU_RT_SHARED_PTR(F, j) ((F)->shared + (F)->shared_stride * ((j) >> 2) + ((j) & 3))
#endif
/* gate g: o = 0 mx, 1 zx, 2 mh, 3 zh */
#define QGRU_RT_UF(g, o) ((o) & 1 ? Q : P)[QGRU_RT_UNIT_LANES * (2 * (g) + ((o) >> 1))]
#define QGRU_RT_UG(k) Q[QGRU_RT_UNIT_LANES * (6 + (k))] /* mg[k]; k = 5: m_rg */
QGRU_RT_INLINE int16_t fast_unit(const qgru_rt_fast *F, const int32_t *P, const int32_t *Q, const int32_t *ax, const int32_t *ah,
                                 int32_t h, const int std16, const int accsh, const int xq)
{
    int32_t dx, dh, d_r, d_z, d_g, t;
    /* xq: ax holds q_Wx - Z_Wx already (an x level's W.x, dir_fast) */
    dx = xq ? ax[0] : facc(accsh ? qgru_rt_shl(ax[0], F->aa[0]) : ax[0], QGRU_RT_UF(0, 0), QGRU_RT_UF(0, 1), F->wx, std16);
    dh = facc(accsh ? qgru_rt_shl(ah[0], F->aa[1]) : ah[0], QGRU_RT_UF(0, 2), QGRU_RT_UF(0, 3), F->rh, std16);
    t = qgru_rt_mulhr(qgru_rt_shl(dh, F->a[1]), QGRU_RT_UG(1), qgru_rt_mulhr(qgru_rt_shl(dx, F->a[0]), QGRU_RT_UG(0), F->k_r));
    d_r = flook(t, F->span_r, &F->t[0], std16);
    dx = xq ? ax[4] : facc(accsh ? qgru_rt_shl(ax[4], F->aa[0]) : ax[4], QGRU_RT_UF(1, 0), QGRU_RT_UF(1, 1), F->wx, std16);
    dh = facc(accsh ? qgru_rt_shl(ah[4], F->aa[1]) : ah[4], QGRU_RT_UF(1, 2), QGRU_RT_UF(1, 3), F->rh, std16);
    t = qgru_rt_mulhr(qgru_rt_shl(dh, F->a[3]), QGRU_RT_UG(3), qgru_rt_mulhr(qgru_rt_shl(dx, F->a[2]), QGRU_RT_UG(2), F->k_z));
    d_z = flook(t, F->span_z, &F->t[1], std16);
    dx = xq ? ax[8] : facc(accsh ? qgru_rt_shl(ax[8], F->aa[0]) : ax[8], QGRU_RT_UF(2, 0), QGRU_RT_UF(2, 1), F->wx, std16);
    dh = facc(accsh ? qgru_rt_shl(ah[8], F->aa[1]) : ah[8], QGRU_RT_UF(2, 2), QGRU_RT_UF(2, 3), F->rh, std16);
    t = qgru_rt_shr32(qgru_rt_prod_hi(d_r, dh, QGRU_RT_UG(5)) + F->c_rg, F->p_rg); /* r Rh_g, + zp_gpre - in_lo */
    d_g = flook(qgru_rt_mulhr(qgru_rt_shl(dx, F->a[4]), QGRU_RT_UG(4), t), F->span_g, &F->t[2], std16);
    t = qgru_rt_shr32(qgru_rt_prod_hi(d_z, h - F->zp_h, F->m_zh) + F->c_zh, F->p_zh) /* + zp_h */
        + qgru_rt_shr32(qgru_rt_prod_hi(F->one_z - d_z, d_g, F->m_zg) + F->c_zg, F->p_zg);
    return (int16_t)fsat(t, F->h, std16);
}

/* units j0 .. j0 + n - 1 of a block (j0 % 4 == 0), their constants' pointers stepped unit by unit */
#if QGRU_RT_LAYOUT == QGRU_RT_LAYOUT_PAIRS
#define QGRU_RT_UNIT_STEP QGRU_RT_UNIT_FIELDS
#define QGRU_RT_SHARED_STEP(F) ((F)->shared_stride)
#else
#define QGRU_RT_UNIT_STEP 1
#define QGRU_RT_SHARED_STEP(F) 1
#endif
QGRU_RT_INLINE void fast_units(const qgru_rt_fast *F, int32_t j0, int32_t n, const int32_t *ax, const int32_t *ah,
                               const int16_t *h, int16_t *h_new, const int std16, const int accsh, const int xq)
{
    const int32_t *P = QGRU_RT_UNIT_PTR(F, j0), *Q = QGRU_RT_SHARED_PTR(F, j0);
    const int32_t qs = QGRU_RT_SHARED_STEP(F);
    int32_t u;
    for (u = 0; u < n; u++, P += QGRU_RT_UNIT_STEP, Q += qs)
        h_new[j0 + u] = fast_unit(F, P, Q, ax + u, ah + u, h[j0 + u], std16, accsh, xq);
}

#ifndef QGRU_RT_NO_STD16
static QGRU_RT_NOINLINE void fast_block16(const qgru_rt_fast *F, int32_t j0, int32_t n, const int32_t *ax,
                                          const int32_t *ah, const int16_t *h, int16_t *h_new)
{
    fast_units(F, j0, n, ax, ah, h, h_new, 1, 0, 0);
}

/* the same where the accumulators need their shifts (aa) */
static QGRU_RT_NOINLINE void fast_block16s(const qgru_rt_fast *F, int32_t j0, int32_t n, const int32_t *ax,
                                           const int32_t *ah, const int16_t *h, int16_t *h_new)
{
    fast_units(F, j0, n, ax, ah, h, h_new, 1, 1, 0);
}

/* fast_block16 / fast_block16s four units at a time in vector lanes (MVE, NEON): the same integers lane by lane.
 * mulhr = k + (v m + 2^31) >> 32 (MVE VRMULH; NEON SMULL + RSHRN #32), SSAT / USAT #16 as a
 * saturating shift left by 16 and a shift back, prod_hi from the product's two words (MUL, MULH)
 * as in qgru_rt_prod_hi, the tables by gathers (MVE) or loads by lane (NEON); the unit constants
 * one vector load a field (qgru_rt.h QGRU_RT_UNIT_FIELDS). */
#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_MVE
#include <arm_mve.h>
#define QGRU_RT_VEC 1
typedef int32x4_t vi32;
#define V_LD(p) vldrwq_s32(p)
#define V_DUP(x) vdupq_n_s32(x)
#define V_ADD(a, b) vaddq_s32(a, b)
#define V_SUB(a, b) vsubq_s32(a, b)
#define V_MUL(a, b) vmulq_s32(a, b)
#define V_SHL(v, a) vshlq_r_s32(v, a)
#define V_SHR(v, p) vshlq_r_s32(v, -(int32_t)(p))
#define V_MULHR(v, m, k) vaddq_s32(vrmulhq_s32(v, m), k)
#define V_SSAT16(v) vshrq_n_s32(vqshlq_n_s32(v, 16), 16)
#define V_USAT16(v) vreinterpretq_s32_u32(vshrq_n_u32(vqshluq_n_s32(v, 16), 16))
QGRU_RT_INLINE vi32 v_prod_hi(vi32 a, vi32 b, vi32 m)
{
    const vi32 lo = vmulq_s32(a, b), hi = vmulhq_s32(a, b);
    return vaddq_s32(vmulq_s32(hi, m), vreinterpretq_s32_u32(vmulhq_u32(vreinterpretq_u32_s32(lo), vreinterpretq_u32_s32(m))));
}
QGRU_RT_INLINE vi32 v_look(vi32 t, const qgru_rt_ftable *T)
{
    const vi32 u = V_USAT16(t);
    const uint32x4_t i = vreinterpretq_u32_s32(vshrq_n_s32(u, 6));
    const vi32 f = vandq_s32(u, vdupq_n_s32(63));
    const vi32 a = vldrwq_gather_shifted_offset_s32(T->tab, i), b = vldrwq_gather_shifted_offset_s32(T->tab + 1, i);
    return vshrq_n_s32(vaddq_s32(a, vmulq_s32(vshrq_n_s32(vsubq_s32(b, a), 6), f)), 10);
}
#define V_LDH(p) vldrhq_s32(p)
#define V_STH_SSAT16(p, v) vstrhq_s32(p, V_SSAT16(v))
#elif QGRU_RT_KERNEL == QGRU_RT_KERNEL_NEON
#include <arm_neon.h>
#define QGRU_RT_VEC 1
typedef int32x4_t vi32;
#define V_LD(p) vld1q_s32(p)
#define V_DUP(x) vdupq_n_s32(x)
#define V_ADD(a, b) vaddq_s32(a, b)
#define V_SUB(a, b) vsubq_s32(a, b)
#define V_MUL(a, b) vmulq_s32(a, b)
#define V_SHL(v, a) vshlq_s32(v, vdupq_n_s32(a))
#define V_SHR(v, p) vshlq_s32(v, vdupq_n_s32(-(int32_t)(p)))
#define V_SSAT16(v) vshrq_n_s32(vqshlq_n_s32(v, 16), 16)
#define V_USAT16(v) vreinterpretq_s32_u32(vshrq_n_u32(vqshluq_n_s32(v, 16), 16))
/* k + floor((v m + 2^31) / 2^32) as SQDMULH, floor(2 v m / 2^32) = floor(v m / 2^31) (it saturates
 * only at v = m = -2^31: m >= 0 here), then SRSRA #1: k + ((w + 1) >> 1) = k + floor((v m + 2^31) / 2^32)
 * (the floor of a floor); the rounding shift is computed without overflow */
QGRU_RT_INLINE vi32 V_MULHR(vi32 v, vi32 m, vi32 k) { return vrsraq_n_s32(k, vqdmulhq_s32(v, m), 1); }
/* floor(a b m / 2^32) (m >= 0): a b = hi 2^32 + lo, hi = floor((a b + 2^31) / 2^32) (SQDMULH, a
 * rounding shift by 1: the floor of a floor), lo = a b - hi 2^32 in [-2^31, 2^31) (MUL, read
 * signed); hi m + floor(lo m / 2^32) (SQDMULH(lo, m) >> 1, SSRA) modulo 2^32, exact because the
 * result fits int32 */
QGRU_RT_INLINE vi32 v_prod_hi(vi32 a, vi32 b, vi32 m)
{
    const vi32 hi = vrshrq_n_s32(vqdmulhq_s32(a, b), 1), lo = vmulq_s32(a, b);
    return vsraq_n_s32(vmulq_s32(hi, m), vqdmulhq_s32(lo, m), 1);
}
/* u = USAT #16 (SQSHLU #16 gives u 2^16), the byte offset 4 (u >> 6) (USHR, BIC: the loads take it
 * as a UXTW register offset) and f = u & 63; lane n: the pair tab[i_n], tab[i_n + 1] in one 64-bit
 * load, UZP1 / UZP2 split them */
QGRU_RT_INLINE vi32 n_look(vi32 t, const int32_t *tab, vi32 f63)
{
    const uint32x4_t s = vqshluq_n_s32(t, 16);
    const uint32x4_t off = vbicq_u32(vshrq_n_u32(s, 20), vdupq_n_u32(3));
    const vi32 f = vandq_s32(vreinterpretq_s32_u32(vshrq_n_u32(s, 16)), f63);
    const char *b = (const char *)tab;
    const vi32 p01 = vcombine_s32(vld1_s32((const int32_t *)(const void *)(b + vgetq_lane_u32(off, 0))),
                                  vld1_s32((const int32_t *)(const void *)(b + vgetq_lane_u32(off, 1))));
    const vi32 p23 = vcombine_s32(vld1_s32((const int32_t *)(const void *)(b + vgetq_lane_u32(off, 2))),
                                  vld1_s32((const int32_t *)(const void *)(b + vgetq_lane_u32(off, 3))));
    const vi32 lo = vuzp1q_s32(p01, p23), hi = vuzp2q_s32(p01, p23);
    return vshrq_n_s32(vmlaq_s32(lo, vshrq_n_s32(vsubq_s32(hi, lo), 6), f), 10);
}
QGRU_RT_INLINE vi32 v_look(vi32 t, const qgru_rt_ftable *T) { return n_look(t, T->tab, vdupq_n_s32(63)); }
#define V_LDH(p) vmovl_s16(vld1_s16(p))
#define V_STH_SSAT16(p, v) vst1_s16(p, vqmovn_s32(v)) /* SSAT #16 and the narrowing: SQXTN */
#endif

#if defined(QGRU_RT_VEC) && !defined(QGRU_RT_NO_VEC)
QGRU_RT_INLINE void fast_block16v(const qgru_rt_fast *F, int32_t j0, const int32_t *ax, const int32_t *ah,
                                   const int16_t *h, int16_t *h_new, const int accsh, const int xq)
{
    const int32_t *U = QGRU_RT_UNIT_PTR(F, j0), *S = QGRU_RT_SHARED_PTR(F, j0); /* field f: U + 4 f, S + 4 f */
    vi32 dx, dh, d_r, d_z, d_g, t;
    /* the accumulators' shifts (aa: fast_block16s's data) where accsh */
#define FACC(a, m, z, k) (t = V_LD(z), V_SUB(V_SSAT16(V_MULHR(accsh ? V_SHL(V_LD(a), F->aa[k]) : V_LD(a), V_LD(m), t)), t))
    /* xq: ax holds q_Wx - Z_Wx already (an x level's W.x, fast_block_level) */
    dx = xq ? V_LD(ax) : FACC(ax, U + 0, S + 0, 0);
    dh = FACC(ah, U + 4, S + 4, 1);
    t = V_MULHR(V_SHL(dh, F->a[1]), V_LD(S + 28), V_MULHR(V_SHL(dx, F->a[0]), V_LD(S + 24), V_DUP(F->k_r)));
    d_r = v_look(t, &F->t[0]);
    dx = xq ? V_LD(ax + 4) : FACC(ax + 4, U + 8, S + 8, 0);
    dh = FACC(ah + 4, U + 12, S + 12, 1);
    t = V_MULHR(V_SHL(dh, F->a[3]), V_LD(S + 36), V_MULHR(V_SHL(dx, F->a[2]), V_LD(S + 32), V_DUP(F->k_z)));
    d_z = v_look(t, &F->t[1]);
    dx = xq ? V_LD(ax + 8) : FACC(ax + 8, U + 16, S + 16, 0);
    dh = FACC(ah + 8, U + 20, S + 20, 1);
#undef FACC
    t = V_SHR(V_ADD(v_prod_hi(d_r, dh, V_LD(S + 44)), V_DUP(F->c_rg)), F->p_rg);
    d_g = v_look(V_MULHR(V_SHL(dx, F->a[4]), V_LD(S + 40), t), &F->t[2]);
    t = V_ADD(V_SHR(V_ADD(v_prod_hi(d_z, V_SUB(V_LDH(h + j0), V_DUP(F->zp_h)), V_DUP(F->m_zh)), V_DUP(F->c_zh)), F->p_zh),
              V_SHR(V_ADD(v_prod_hi(V_SUB(V_DUP(F->one_z), d_z), d_g, V_DUP(F->m_zg)), V_DUP(F->c_zg)), F->p_zg));
    V_STH_SSAT16(h_new + j0, t);
}

/* the variants out of line; the common one too on MVE, where inlined its vector constants and
 * spills stay in dir_fast's frame through the kernels' calls (416 -> 208 bytes, the deepest stack at
 * H = 96 952 -> 744, for +0.8% instructions; NEON inlines it: an ARM board's RAM is not scarce) */
#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_MVE
#define QGRU_RT_FAST16V0 static QGRU_RT_NOINLINE
#else
#define QGRU_RT_FAST16V0 QGRU_RT_INLINE
#endif
QGRU_RT_FAST16V0 void fast_block16v0(const qgru_rt_fast *F, int32_t j0, const int32_t *ax, const int32_t *ah,
                                            const int16_t *h, int16_t *h_new)
{
    fast_block16v(F, j0, ax, ah, h, h_new, 0, 0);
}

/* the accumulator-shift variant */
static QGRU_RT_NOINLINE void fast_block16vs(const qgru_rt_fast *F, int32_t j0, const int32_t *ax, const int32_t *ah,
                                            const int16_t *h, int16_t *h_new)
{
    fast_block16v(F, j0, ax, ah, h, h_new, 1, 0);
}

/* the x-level variant (fast_block_level) */
static QGRU_RT_NOINLINE void fast_block16vq(const qgru_rt_fast *F, int32_t j0, const int32_t *ax, const int32_t *ah,
                                            const int16_t *h, int16_t *h_new)
{
    fast_block16v(F, j0, ax, ah, h, h_new, 1, 1);
}

#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_NEON && defined(__ARM_FEATURE_DOTPROD)
/* AArch64 with +dotprod, the std16 vector cell without accumulator shifts on int8 x and h_gemm
 * (w8a8): one loop over the blocks of four units, each block's 12 SDOT rows and its cell in
 * registers (no kernel call, no accumulators through memory), the direction's constants loaded
 * once a step. The same integers as fast_block16v lane by lane (docs/mcu.md "Four units a lane"). */
typedef struct {
    vi32 k_r, k_z, c_rg, c_zh, c_zg, m_zh, m_zg, zp_h, one_z, f63, a0, a1, a2, a3, a4, np_rg, np_zh, np_zg;
} ncell_k;

/* floor(a b m / 2^32) + c (qgru_rt_prod_hi, + c; m >= 0, |a|, |b| < 2^31, the result fits int32):
 * a b = hi 2^32 + lo with hi = floor((a b + 2^31) / 2^32) (SQDMULH, then a rounding shift by 1:
 * the floor of a floor) and lo = a b - hi 2^32 in [-2^31, 2^31), the low word (MUL) read signed;
 * floor(a b m / 2^32) = hi m + floor(lo m / 2^32), the second SQDMULH(lo, m) >> 1 (SSRA), hi m
 * and the sum modulo 2^32 (MLA), exact because the result fits int32 */
QGRU_RT_INLINE vi32 n_prod_hi_c(vi32 a, vi32 b, vi32 m, vi32 c)
{
    const vi32 hi = vrshrq_n_s32(vqdmulhq_s32(a, b), 1), lo = vmulq_s32(a, b);
    return vsraq_n_s32(vmlaq_s32(c, hi, m), vqdmulhq_s32(lo, m), 1);
}

/* saturate(rescale(acc) + Z) - Z: SMMLAR as SQDMULH + SRSRA (V_MULHR), SSAT #16 */
QGRU_RT_INLINE vi32 n_facc(vi32 acc, vi32 m, vi32 z) { return vsubq_s32(V_SSAT16(V_MULHR(acc, m, z)), z); }

/* one block of four units (fast_block16v, xq = 0) from its accumulators in registers; accsh: their shifts */
QGRU_RT_INLINE void n_cell(const int32_t *const tab[3], const int32_t *U, const int32_t *S, const ncell_k *K, vi32 ax0, vi32 ax1,
                           vi32 ax2, vi32 ah0, vi32 ah1, vi32 ah2, const int16_t *h, int16_t *h_new, const int accsh, vi32 aax, vi32 aah)
{
    /* U: mx, mh of r, z (um), of g (ug); S: zx, zh of r, z (sz), zx_g, zh_g, mg[0], mg[1] (sg), mg[2..4], m_rg (sm) */
    const int32x4x4_t um = vld1q_s32_x4(U), sz = vld1q_s32_x4(S), sg = vld1q_s32_x4(S + 16), sm = vld1q_s32_x4(S + 32);
    const int32x4x2_t ug = vld1q_s32_x2(U + 16);
    vi32 dx, dh, d_r, d_z, d_g, t, hz;
    if (accsh) {
        ax0 = vshlq_s32(ax0, aax), ax1 = vshlq_s32(ax1, aax), ax2 = vshlq_s32(ax2, aax);
        ah0 = vshlq_s32(ah0, aah), ah1 = vshlq_s32(ah1, aah), ah2 = vshlq_s32(ah2, aah);
    }
    dx = n_facc(ax0, um.val[0], sz.val[0]);
    dh = n_facc(ah0, um.val[1], sz.val[1]);
    t = V_MULHR(vshlq_s32(dh, K->a1), sg.val[3], V_MULHR(vshlq_s32(dx, K->a0), sg.val[2], K->k_r));
    d_r = n_look(t, tab[0], K->f63);
    dx = n_facc(ax1, um.val[2], sz.val[2]);
    dh = n_facc(ah1, um.val[3], sz.val[3]);
    t = V_MULHR(vshlq_s32(dh, K->a3), sm.val[1], V_MULHR(vshlq_s32(dx, K->a2), sm.val[0], K->k_z));
    d_z = n_look(t, tab[1], K->f63);
    dx = n_facc(ax2, ug.val[0], sg.val[0]);
    dh = n_facc(ah2, ug.val[1], sg.val[1]);
    t = vshlq_s32(n_prod_hi_c(d_r, dh, sm.val[3], K->c_rg), K->np_rg);
    d_g = n_look(V_MULHR(vshlq_s32(dx, K->a4), sm.val[2], t), tab[2], K->f63);
    hz = vsubq_s32(vmovl_s16(vld1_s16(h)), K->zp_h);
    t = vaddq_s32(vshlq_s32(n_prod_hi_c(d_z, hz, K->m_zh, K->c_zh), K->np_zh),
                  vshlq_s32(n_prod_hi_c(vsubq_s32(K->one_z, d_z), d_g, K->m_zg, K->c_zg), K->np_zg));
    vst1_s16(h_new, vqmovn_s32(t)); /* SSAT #16 and the narrowing in one SQXTN */
}

/* dir_fast for such a direction, its whole blocks (returns the first unit not done: H & ~3) */
QGRU_RT_INLINE int32_t dir_fast_sdot(const qgru_rt_dir *d, const int8_t *xa, const int8_t *ha, const int16_t *h,
                                     int16_t *h_new, const int accsh)
{
    const qgru_rt_fast *F = d->fast;
    const int32_t H = d->hidden_size, G = d->rows_per_gate, kx = d->k_pad_x, kh = d->k_pad_h;
    const int32_t *ix = F->init_x, *ih = F->init_h;
    const int8_t *wx = d->w8, *wh = d->r8;
    const int32_t *U = F->units, *S = F->shared; /* (locals: the stores to h_new could alias F's bytes) */
    const int32_t ss = F->shared_stride;
    const int32_t *const tab[3] = {F->t[0].tab, F->t[1].tab, F->t[2].tab};
    const size_t gx = (size_t)G * (size_t)kx, gh = (size_t)G * (size_t)kh;
    const vi32 aax = V_DUP(accsh ? F->aa[0] : 0), aah = V_DUP(accsh ? F->aa[1] : 0);
    ncell_k K;
    int32_t j0;
    K.k_r = V_DUP(F->k_r), K.k_z = V_DUP(F->k_z), K.c_rg = V_DUP(F->c_rg), K.c_zh = V_DUP(F->c_zh);
    K.c_zg = V_DUP(F->c_zg), K.m_zh = V_DUP(F->m_zh), K.m_zg = V_DUP(F->m_zg), K.zp_h = V_DUP(F->zp_h);
    K.one_z = V_DUP(F->one_z), K.f63 = V_DUP(63);
    K.a0 = V_DUP(F->a[0]), K.a1 = V_DUP(F->a[1]), K.a2 = V_DUP(F->a[2]), K.a3 = V_DUP(F->a[3]), K.a4 = V_DUP(F->a[4]);
    K.np_rg = V_DUP(-(int32_t)F->p_rg), K.np_zh = V_DUP(-(int32_t)F->p_zh), K.np_zg = V_DUP(-(int32_t)F->p_zg);
    for (j0 = 0; j0 + 4 <= H; j0 += 4, wx += 4 * kx, wh += 4 * kh, U += 4 * QGRU_RT_UNIT_FIELDS, S += ss) {
        vi32 x0 = vld1q_s32(ix + j0), x1 = vld1q_s32(ix + G + j0), x2 = vld1q_s32(ix + 2 * G + j0);
        vi32 h0 = vld1q_s32(ih + j0), h1 = vld1q_s32(ih + G + j0), h2 = vld1q_s32(ih + 2 * G + j0);
        const int8_t *w0 = wx, *w1 = wx + gx, *w2 = wx + 2 * gx, *a, *e;
        /* each 16 activations against the three gates' 64 weight bytes (qgru_rt_dot12_a8) */
#define QGRU_RT_SDOT4(s, w)                                                                                          \
    do {                                                                                                              \
        const int8x16x4_t q = vld1q_s8_x4(w);                                                                          \
        s = vdotq_laneq_s32(s, q.val[0], v, 0), s = vdotq_laneq_s32(s, q.val[1], v, 1);                                \
        s = vdotq_laneq_s32(s, q.val[2], v, 2), s = vdotq_laneq_s32(s, q.val[3], v, 3);                                \
    } while (0)
#define QGRU_RT_SDOT12(s0, s1, s2)                                                                                   \
    do {                                                                                                              \
        const int8x16_t v = vld1q_s8(a);                                                                               \
        QGRU_RT_SDOT4(s0, w0);                                                                                         \
        QGRU_RT_SDOT4(s1, w1);                                                                                         \
        QGRU_RT_SDOT4(s2, w2);                                                                                         \
    } while (0)
        a = xa, e = xa + kx; /* k_pad >= 4: at least one pass */
        do {
            QGRU_RT_SDOT12(x0, x1, x2);
            a += 16, w0 += 64, w1 += 64, w2 += 64;
        } while (a < e);
        a = ha, e = ha + kh, w0 = wh, w1 = wh + gh, w2 = wh + 2 * gh;
        do {
            QGRU_RT_SDOT12(h0, h1, h2);
            a += 16, w0 += 64, w1 += 64, w2 += 64;
        } while (a < e);
#undef QGRU_RT_SDOT12
#undef QGRU_RT_SDOT4
        n_cell(tab, U, S, &K, x0, x1, x2, h0, h1, h2, h + j0, h_new + j0, accsh, aax, aah);
    }
    return j0;
}

static QGRU_RT_NOINLINE int32_t dir_fast_sdot0(const qgru_rt_dir *d, const int8_t *xa, const int8_t *ha, const int16_t *h,
                                               int16_t *h_new)
{
    return dir_fast_sdot(d, xa, ha, h, h_new, 0);
}

/* with the accumulators' shifts (aa) */
static QGRU_RT_NOINLINE int32_t dir_fast_sdots(const qgru_rt_dir *d, const int8_t *xa, const int8_t *ha, const int16_t *h,
                                               int16_t *h_new)
{
    return dir_fast_sdot(d, xa, ha, h, h_new, 1);
}
#endif
#endif
#endif

static QGRU_RT_NOINLINE void fast_block(const qgru_rt_fast *F, int32_t j0, int32_t n, const int32_t *ax,
                                        const int32_t *ah, const int16_t *h, int16_t *h_new)
{
    fast_units(F, j0, n, ax, ah, h, h_new, 0, 1, 0);
}

/* A token on x level j > 0 (qgru_rt_xlevels): its W.x sums (level j's biases included by the
 * kernels) requantized with level j's rescale onto the static Wx grid (golden input_gemm): one
 * SMMLAR with the level's constants (mx, aa: the static rescale's form) where the export proved
 * it, else a 64-bit product and shift; then the fast cell from q_Wx - Z_Wx on (its 16-bit variant,
 * in vector lanes where the target has them, where the data takes it). Reached only through
 * float_in (a build whose program never calls qgru_rt_run_float links none of it). */
typedef void (*level_block_fn)(const qgru_rt_dir *d, int32_t level, int32_t j0, int32_t n, int32_t *ax,
                               const int32_t *ah, const int16_t *h, int16_t *h_new);
static QGRU_RT_NOINLINE void fast_block_level(const qgru_rt_dir *d, int32_t level, int32_t j0, int32_t n,
                                              int32_t *ax, const int32_t *ah, const int16_t *h, int16_t *h_new)
{
    const qgru_rt_fast *F = d->fast;
    const qgru_rt_xlevels *lv = d->xlv;
    const int32_t H = d->hidden_size;
    const size_t off = (size_t)(level - 1) * 3u * (size_t)H;
    const int32_t *Q = QGRU_RT_SHARED_PTR(F, j0);
    const int32_t qs = QGRU_RT_SHARED_STEP(F);
    int32_t u, g;
    for (u = 0; u < n; u++, Q += qs) {
        for (g = 0; g < 3; g++) {
            const size_t c = off + (size_t)(g * H + j0 + u);
            const int32_t z = Q[QGRU_RT_UNIT_LANES * 2 * g]; /* QGRU_RT_UF(g, 1): Wx_g's zero point */
            int32_t *a = &ax[4 * g + u];
            if (lv->mx)
                *a = facc(qgru_rt_shl(*a, lv->aa[c]), lv->mx[c], z, F->wx, 0);
            else
                *a = (int32_t)qgru_rt_sat64(qgru_rt_mul_shift32(*a, lv->m[c], lv->s[c]) + z, F->wx) - z;
        }
    }
#ifndef QGRU_RT_NO_STD16
#if defined(QGRU_RT_VEC) && !defined(QGRU_RT_NO_VEC)
    if (F->std16 && n == 4) {
        fast_block16vq(F, j0, ax, ah, h, h_new);
        return;
    }
#endif
    if (F->std16) {
        fast_units(F, j0, n, ax, ah, h, h_new, 1, 1, 1);
        return;
    }
#endif
    fast_units(F, j0, n, ax, ah, h, h_new, 0, 1, 1);
}

/* R.h's operand requantized onto h_gemm's grid, the fast way (hg_mode 1: s >= 33, the high word
 * of one SMULL, + 2^(p-1) + zp_op 2^p, >> p); returns -128 sum (QGRU_RT_NEEDS_ASUM) */
QGRU_RT_INLINE int32_t fast_hg(const qgru_rt_dir *d, const int16_t *h, act_buf ha, const int sat, const int a8)
{
    const qgru_rt_fast *F = d->fast;
    const int32_t H = d->hidden_size, m = F->m_hg, c = F->c_hg, zp = F->zp_h;
    const int p = F->p_hg;
    int32_t j, s = 0;
    for (j = 0; j < H; j++) {
        int32_t v = qgru_rt_shr32(qgru_rt_mulhi(h[j] - zp, m) + c, p);
        v = sat == 8 ? QGRU_RT_SSAT8(v) : sat == 16 ? QGRU_RT_SSAT16(v) : v < d->r_op.lo ? d->r_op.lo : v > d->r_op.hi ? d->r_op.hi : v;
        s += v;
        if (a8)
            ha.a8[j] = (int8_t)v;
        else
            ha.a16[j] = (int16_t)v;
    }
    return QGRU_RT_NEEDS_ASUM ? -128 * s : 0;
}

#if defined(QGRU_RT_VEC) && !defined(QGRU_RT_NO_VEC)
/* fast_hg for int8 activations saturated to 8 bits, four units a lane (hidden_size % 4 == 0;
 * the vector kernels need no -128 sum): the high word of (h - zp) m_hg (MVE VMULH; NEON SMULL,
 * SMULL2, UZP2), + c_hg, >> p_hg, SSAT #8 (a saturating shift left by 24 and back / SQXTN twice) */
static QGRU_RT_NOINLINE void fast_hg8v(const qgru_rt_fast *F, const int16_t *h, int8_t *a, int32_t H)
{
    const vi32 zp = V_DUP(F->zp_h), m = V_DUP(F->m_hg), c = V_DUP(F->c_hg);
    const int p = F->p_hg;
    int32_t j = 0;
#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_MVE
    for (; j < H; j += 4) {
        const vi32 v = V_SUB(V_LDH(h + j), zp);
        vstrbq_s32(a + j, vshrq_n_s32(vqshlq_n_s32(V_SHR(V_ADD(vmulhq_s32(v, m), c), p), 24), 24));
    }
#else
    /* eight units a pass: hi + c as SSRA of SQDMULH (floor(v m / 2^31) >> 1 = floor(v m / 2^32), the
     * floor of a floor; m >= 0), >> p, SQXTN to 16 then 8 bits (SSAT #8) */
    const vi32 np = V_DUP(-p);
    for (; j + 8 <= H; j += 8) {
        const int16x8_t x = vld1q_s16(h + j);
        const vi32 v0 = V_SUB(vmovl_s16(vget_low_s16(x)), zp), v1 = V_SUB(vmovl_high_s16(x), zp);
        const vi32 t0 = vshlq_s32(vsraq_n_s32(c, vqdmulhq_s32(v0, m), 1), np);
        const vi32 t1 = vshlq_s32(vsraq_n_s32(c, vqdmulhq_s32(v1, m), 1), np);
        vst1_s8(a + j, vqmovn_s16(vqmovn_high_s32(vqmovn_s32(t0), t1)));
    }
    for (; j < H; j += 4) {
        const vi32 v = V_SUB(V_LDH(h + j), zp);
        const int16x4_t n16 = vqmovn_s32(vshlq_s32(vsraq_n_s32(c, vqdmulhq_s32(v, m), 1), np));
        vst1_lane_s32((int32_t *)(void *)(a + j), vreinterpret_s32_s8(vqmovn_s16(vcombine_s16(n16, n16))), 0);
    }
#endif
}
#endif

/* -128 sum(a) of an int16 activation buffer (the pairs layout's correction), else 0 */
static int32_t act_corr(act_buf b, int32_t n)
{
#if QGRU_RT_NEEDS_ASUM
    int32_t k, s = 0;
    for (k = 0; k < n; k++)
        s += b.a16[k];
    return -128 * s;
#else
    (void)b, (void)n;
    return 0;
#endif
}

/* dir_step's GEMMs and cell for a fast direction (functions of their own, so that the deepest
 * stack is one branch's, not the sum of all three) */
static QGRU_RT_NOINLINE void dir_fast(const qgru_rt_dir *d, act_buf xa, act_buf ha, const int16_t *h, int16_t *h_new,
                                      int32_t cx, int32_t ch, int32_t level, level_block_fn level_block)
{
    const int32_t H = d->hidden_size, G = d->rows_per_gate;
    int32_t j0, g;
    const qgru_rt_fast *F = d->fast;
    const int32_t kx = d->k_pad_x, kh = d->k_pad_h;
    const int32_t *init_x = level ? d->xlv->init + (size_t)(level - 1) * 3u * (size_t)G : F->init_x;
    j0 = 0;
#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_NEON && defined(__ARM_FEATURE_DOTPROD) && !defined(QGRU_RT_NO_VEC) \
    && !defined(QGRU_RT_NO_STD16)
    if (!level && xa.a8 && ha.a8 && F->std16) /* the whole blocks; a partial last one below */
        j0 = !F->aa[0] && !F->aa[1] ? dir_fast_sdot0(d, xa.a8, ha.a8, h, h_new) : dir_fast_sdots(d, xa.a8, ha.a8, h, h_new);
#endif
    for (; j0 < H; j0 += 4) {
        int32_t ax[3][4], ah[3][4];
#if QGRU_RT_HAS_DOT12
        if (xa.a8)
            qgru_rt_dot12_a8(d->w8 + j0 * kx, G * kx, xa.a8, kx, init_x + j0, G, cx, ax);
        else
            qgru_rt_dot12_a16(d->w8 + j0 * kx, G * kx, xa.a16, kx, init_x + j0, G, cx, ax);
        if (ha.a8)
            qgru_rt_dot12_a8(d->r8 + j0 * kh, G * kh, ha.a8, kh, F->init_h + j0, G, ch, ah);
        else
            qgru_rt_dot12_a16(d->r8 + j0 * kh, G * kh, ha.a16, kh, F->init_h + j0, G, ch, ah);
        g = 3;
#else
        g = 0;
#endif
        for (; g < 3; g++) {
            const int8_t *wx = d->w8 + (g * G + j0) * kx, *wh = d->r8 + (g * G + j0) * kh;
            if (xa.a8)
                qgru_rt_dot4_a8(wx, kx, xa.a8, kx, init_x + g * G + j0, cx, ax[g]);
            else
                qgru_rt_dot4_a16(wx, kx, xa.a16, kx, init_x + g * G + j0, cx, ax[g]);
            if (ha.a8)
                qgru_rt_dot4_a8(wh, kh, ha.a8, kh, F->init_h + g * G + j0, ch, ah[g]);
            else
                qgru_rt_dot4_a16(wh, kh, ha.a16, kh, F->init_h + g * G + j0, ch, ah[g]);
        }
        if (level) {
            level_block(d, level, j0, H - j0 < 4 ? H - j0 : 4, &ax[0][0], &ah[0][0], h, h_new);
            continue;
        }
#ifndef QGRU_RT_NO_STD16 /* tests/test_mcu.py: the general variant on data that takes the 16-bit one */
#if defined(QGRU_RT_VEC) && !defined(QGRU_RT_NO_VEC)
        if (F->std16 && H - j0 >= 4) { /* four units a lane */
            if (!F->aa[0] && !F->aa[1])
                fast_block16v0(F, j0, &ax[0][0], &ah[0][0], h, h_new);
            else
                fast_block16vs(F, j0, &ax[0][0], &ah[0][0], h, h_new);
        } else
#endif
        if (F->std16 && !F->aa[0] && !F->aa[1])
            fast_block16(F, j0, H - j0 < 4 ? H - j0 : 4, &ax[0][0], &ah[0][0], h, h_new);
        else if (F->std16)
            fast_block16s(F, j0, H - j0 < 4 ? H - j0 : 4, &ax[0][0], &ah[0][0], h, h_new);
        else
#endif
            fast_block(F, j0, H - j0 < 4 ? H - j0 : 4, &ax[0][0], &ah[0][0], h, h_new);
    }
}

#ifndef QGRU_RT_FAST_ONLY
/* int32 kernels straight into the 32-bit cell (cell32 implies neither GEMM is wide) */
static QGRU_RT_NOINLINE void dir_cell32(const qgru_rt_dir *d, const wx_rq *q, act_buf xa, act_buf ha, const int16_t *h,
                                        int16_t *h_new, int32_t cx, int32_t ch)
{
    const int32_t H = d->hidden_size, G = d->rows_per_gate;
    int32_t j0, g, u;
    const int32_t kx = d->k_pad_x, kh = d->k_pad_h;
    for (j0 = 0; j0 < H; j0 += 4) {
        int32_t ax[3][4], ah[3][4];
        for (g = 0; g < 3; g++) {
            const int8_t *wx = d->w8 + (g * G + j0) * kx, *wh = d->r8 + (g * G + j0) * kh;
            if (xa.a8)
                qgru_rt_dot4_a8(wx, kx, xa.a8, kx, 0, cx, ax[g]);
            else
                qgru_rt_dot4_a16(wx, kx, xa.a16, kx, 0, cx, ax[g]);
            if (ha.a8)
                qgru_rt_dot4_a8(wh, kh, ha.a8, kh, 0, ch, ah[g]);
            else
                qgru_rt_dot4_a16(wh, kh, ha.a16, kh, 0, ch, ah[g]);
        }
        for (u = 0; u < 4 && j0 + u < H; u++)
            h_new[j0 + u] = unit32(d, q, j0 + u, &ax[0][u], &ah[0][u], h[j0 + u]);
    }
}

/* the int64 loops (a wide GEMM) and the int64 cell */
static QGRU_RT_NOINLINE void dir_wide(const qgru_rt_dir *d, const wx_rq *q, act_buf xa, act_buf ha, const int16_t *h,
                                      int16_t *h_new, int32_t cx, int32_t ch)
{
    const int32_t H = d->hidden_size, G = d->rows_per_gate;
    int32_t j0, g, u;
    for (j0 = 0; j0 < H; j0 += 4) {
        int64_t ax[3][4], ah[3][4];
        for (g = 0; g < 3; g++) {
            dot4(d, 0, g * G + j0, xa, cx, ax[g]);
            dot4(d, 1, g * G + j0, ha, ch, ah[g]);
        }
        for (u = 0; u < 4 && j0 + u < H; u++)
            h_new[j0 + u] = unit(d, q, j0 + u, &ax[0][u], &ah[0][u], h[j0 + u]);
    }
}
#endif

/* One step of one direction (golden gru_step for one row): xa holds x on this layer's x grid
 * (on x level `level` of a layer-0 direction with levels), h the state; the new state goes to
 * h_new, which may be h itself: R.h reads its own copy of the state (ha), and each unit reads only
 * its own h[j] before it writes h_new[j] (the vector cells: their own four). */
QGRU_RT_INLINE void dir_step(const qgru_rt_dir *d, act_buf xa, act_buf ha, const int16_t *h, int16_t *h_new, int32_t level,
                     level_block_fn level_block)
{
    const int32_t H = d->hidden_size;
    int32_t j, cx, ch = 0;
    /* R.h's operand: the state itself, or requantized onto h_gemm's grid (recurrent_operand) */
    act_clear(ha, H);
    if (d->fast && d->fast->hg_mode) {
        const int sat = d->op_bits == 8 || d->op_bits == 16 ? d->op_bits : 0;
#if defined(QGRU_RT_VEC) && !defined(QGRU_RT_NO_VEC)
        if (ha.a8 && sat == 8 && !(H & 3))
            fast_hg8v(d->fast, h, ha.a8, H);
        else
#endif
        if (ha.a8)
            ch = sat == 8 ? fast_hg(d, h, ha, 8, 1) : fast_hg(d, h, ha, 0, 1);
        else
            ch = sat == 8 ? fast_hg(d, h, ha, 8, 0) : sat == 16 ? fast_hg(d, h, ha, 16, 0) : fast_hg(d, h, ha, 0, 0);
    } else
    for (j = 0; j < H; j++) {
        int32_t v = h[j];
        if (d->has_h_gemm && d->cell32)
            v = qgru_rt_sat32(qgru_rt_rescale32(v - d->zp_h, d->m_hg, d->s_hg) + d->zp_op, d->r_op);
        else if (d->has_h_gemm)
            v = (int32_t)qgru_rt_sat64(qgru_rt_mul_shift32(v - d->zp_h, d->m_hg, d->s_hg) + d->zp_op, d->r_op);
        act_put(ha, j, v);
    }
    cx = act_corr(xa, d->input_size);
    if (!(d->fast && d->fast->hg_mode))
        ch = act_corr(ha, H);
    if (d->fast)
        dir_fast(d, xa, ha, h, h_new, cx, ch, level, level_block);
#ifndef QGRU_RT_FAST_ONLY
    else {
        const qgru_rt_xlevels *lv = d->xlv;
        const size_t off = level ? (size_t)(level - 1) * 3u * d->hidden_size : 0;
        wx_rq q;
        q.bias = level ? (lv->bias ? lv->bias + off : 0) : d->bias_x;
        q.bias64 = level ? (lv->bias64 ? lv->bias64 + off : 0) : d->bias_x64;
        q.m = level ? lv->m + off : d->m_wx;
        q.s = level ? lv->s + off : d->s_wx;
        if (d->cell32 && (!level || lv->cell32[level - 1]))
            dir_cell32(d, &q, xa, ha, h, h_new, cx, ch);
        else
            dir_wide(d, &q, xa, ha, h, h_new, cx, ch);
    }
#endif
}

/* x operand of a layer > 0: the previous layer's outputs (prev [directions * H_prev], each on its
 * direction's h grid) requantized onto this direction's x grid (golden requantize_input) */
static void put_requantized(const qgru_rt_dir *d, act_buf xa, const int16_t *prev, int32_t ndir, int32_t hp)
{
    int32_t e, k;
    act_clear(xa, d->input_size);
    for (e = 0; e < ndir; e++)
        for (k = 0; k < hp; k++)
            act_put(xa, e * hp + k,
                    d->cell32 ? qgru_rt_sat32(qgru_rt_rescale32(prev[e * hp + k] - d->zp_hprev[e], d->m_in[e], d->s_in[e])
                                              + d->zp_x, d->r_x)
                              : (int32_t)qgru_rt_sat64(qgru_rt_mul_shift32(prev[e * hp + k] - d->zp_hprev[e], d->m_in[e],
                                                                           d->s_in[e]) + d->zp_x, d->r_x));
}

static void put_input(const qgru_rt_dir *d, act_buf xa, const int16_t *x)
{
    int32_t k = 0;
    act_clear(xa, d->input_size);
#if QGRU_RT_KERNEL == QGRU_RT_KERNEL_NEON
    if (xa.a8) { /* an 8-bit grid: its range fits int16; eight values a pass, clamped (SMAX, SMIN), narrowed */
        const int16x8_t lo = vdupq_n_s16((int16_t)d->r_x.lo), hi = vdupq_n_s16((int16_t)d->r_x.hi);
        for (; k + 8 <= d->input_size; k += 8)
            vst1_s8(xa.a8 + k, vmovn_s16(vminq_s16(vmaxq_s16(vld1q_s16(x + k), lo), hi)));
    }
#endif
    for (; k < d->input_size; k++)
        act_put(xa, k, qgru_rt_sat32(x[k], d->r_x));
}

/* golden quantize of one value: saturate(round_half_up(v / scale) + zp), v / scale clamped to one
 * step beyond the range first (so that +-inf saturate), in float64 */
static int32_t quantize64(double v, double scale, int32_t zp, qgru_rt_range r)
{
    const double lo = (double)r.lo - zp - 1, hi = (double)r.hi - zp + 1;
    double f;
    v = v / scale;
    v = v < lo ? lo : v > hi ? hi : v;
    f = (double)(int32_t)v; /* |v| < 2^17: the conversion is exact, truncating toward zero */
    if (f > v)
        f -= 1.0; /* floor */
    return qgru_rt_sat32((int32_t)f + (v - f >= 0.5) + zp, r);
}

/* quantize64 of a float32 x, the same integer, in float32 arithmetic where that decides it (an FPU
 * of single precision, or soft-float, pays for float64 division: ~1,500 instructions a value on a
 * Cortex-M4). y = x rscale (rscale = float32(1 / scale)) is within |y| 2^-23 (1 + 2^-24) of x / scale
 * and of its float64 quotient v (two float32 roundings; v's own is 2^-53 relative), so where y is
 * more than 2 beyond the range, or its fraction more than m = (|y| + 1) 2^-20 from 1/2, v rounds
 * as y does; else (a fraction of about 2^-19 (|y| + 1) of values) quantize64 decides. No NaN. */
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0 && !defined(QGRU_RT_FLOAT64_QUANTIZE)
#define QGRU_RT_FLOAT64_QUANTIZE /* float arithmetic in wider registers: the bound above is not the one */
#endif
static int32_t quantize1(float x, float rscale, double scale, int32_t zp, qgru_rt_range r)
{
#ifndef QGRU_RT_FLOAT64_QUANTIZE
    const float y = x * rscale;
    if (y > (float)(r.hi - zp) + 2.0f)
        return r.hi;
    if (y < (float)(r.lo - zp) - 2.0f)
        return r.lo;
    {
        int32_t t = (int32_t)y; /* |y| < 2^17 + 3: exact, truncating toward zero */
        float f = (float)t, m;
        if (f > y)
            t -= 1, f -= 1.0f;
        f = y - f; /* the fraction: exact (Sterbenz) but for y in (-1/2, 0), where it rounds by < 2^-25 */
        m = ((y < 0 ? -y : y) + 1.0f) * 0x1p-20f;
        if (f >= 0.5f + m)
            return qgru_rt_sat32(t + 1 + zp, r);
        if (f <= 0.5f - m)
            return qgru_rt_sat32(t + zp, r);
    }
#else
    (void)rscale;
#endif
    return quantize64((double)x, scale, zp, r);
}

/* x of a layer-0 direction from floats (no NaN): the token's level (golden select_levels: the first
 * whose [lo, hi] holds its smallest and largest value, else the last; lo32 / hi32 decide it in
 * float32 exactly as lo / hi in float64), each value quantized on it; returns the level (0: the
 * static grid) */
static int32_t put_input_float(const qgru_rt_dir *d, act_buf xa, const float *x)
{
    const qgru_rt_xlevels *lv = d->xlv;
    int32_t k, j = 0;
    double scale = d->x_scale;
    float rscale = d->x_rscale;
    act_clear(xa, d->input_size);
    if (lv && lv->num > 1) {
        float mn = x[0], mx = x[0];
        for (k = 1; k < d->input_size; k++) {
            mn = x[k] < mn ? x[k] : mn;
            mx = x[k] > mx ? x[k] : mx;
        }
        while (j < lv->num - 1 && !(lv->lo32[j] <= mn && mx <= lv->hi32[j]))
            j++;
        scale = lv->scale[j];
        rscale = lv->rscale[j];
    }
    for (k = 0; k < d->input_size; k++)
        act_put(xa, k, quantize1(x[k], rscale, scale, d->zp_x, d->r_x));
    return j;
}

/* work: [x operand: pad16(max K) values][R.h operand: pad16(H) values] (values of act_size bytes)
 * [stacked bidirectional: one layer's outputs, T * D * H int16]; the state is updated in place */
static int32_t max_input(const qgru_rt_model *m)
{
    const int32_t up = m->num_directions * m->hidden_size;
    return m->input_size > up ? m->input_size : up;
}

/* bytes of an operand value: 1 where every direction's x and R.h operands are int8 (a kernel with
 * QGRU_RT_HAS_A8), else 2 (int16: buf_for's a16) */
static size_t act_size(const qgru_rt_model *m)
{
    int32_t l;
    for (l = 0; l < m->num_layers * m->num_directions; l++)
        if (!use_a8(m->dirs[l].x_bits) || !use_a8(m->dirs[l].op_bits))
            return sizeof(int16_t);
    return 1;
}

static size_t fixed_bytes(const qgru_rt_model *m)
{
    return act_size(m) * (size_t)(qgru_rt_pad16(max_input(m)) + qgru_rt_pad16(m->hidden_size));
}

size_t qgru_rt_work_bytes(const qgru_rt_model *m, int32_t T)
{
    size_t n = fixed_bytes(m);
    if (m->num_directions == 2 && m->num_layers > 1 && T > 0)
        n += sizeof(int16_t) * (size_t)T * 2u * m->hidden_size;
    return n;
}

static act_buf buf_for(int bits, void *p)
{
    act_buf b;
    b.a8 = use_a8(bits) ? (int8_t *)p : 0;
    b.a16 = use_a8(bits) ? 0 : (int16_t *)p;
    return b;
}

/* float input: x and the functions that take it, by pointer, so that a program that never calls
 * qgru_rt_run_float links neither them nor float64 arithmetic (-Wl,--gc-sections) */
typedef struct {
    const float *x;
    int32_t (*put)(const qgru_rt_dir *d, act_buf xa, const float *x);
    level_block_fn level_block;
} float_in;

/* layer 0's x operand at step t: from x_q, or quantized from float (returns the token's level) */
static int32_t put_first(const qgru_rt_model *m, const qgru_rt_dir *d, act_buf xa, const int16_t *x_q,
                         const float_in *f, int32_t t)
{
    if (f)
        return f->put(d, xa, f->x + (size_t)t * m->input_size);
    put_input(d, xa, x_q + (size_t)t * m->input_size);
    return 0;
}

QGRU_RT_INLINE int run(const qgru_rt_model *m, const int16_t *x_q, const float_in *x_f, int32_t T, int16_t *state,
               int16_t *out, void *work, size_t work_bytes)
{
    const level_block_fn level_block = x_f ? x_f->level_block : 0;
    const int32_t L = m ? m->num_layers : 0, D = m ? m->num_directions : 0, H = m ? m->hidden_size : 0;
    void *xw, *hw;
    int16_t *seq;
    int32_t t, l, e, j;
    if (!m || !state || (T > 0 && !x_q && !x_f) || T < 0 || !work || L < 1 || (D != 1 && D != 2) || H < 1)
        return QGRU_RT_EARG;
    if (m->abi != QGRU_RT_ABI)
        return QGRU_RT_EABI;
    if (((uintptr_t)work & 3u) || work_bytes < qgru_rt_work_bytes(m, T))
        return QGRU_RT_EWORK;
    if (D == 2 && !out && T > 0)
        return QGRU_RT_EARG;
    for (l = 0; l < L * D; l++)
        if (m->dirs[l].layout != QGRU_RT_LAYOUT)
            return QGRU_RT_ELAYOUT;
#ifdef QGRU_RT_FAST_ONLY
    for (l = 0; l < L * D; l++)
        if (!m->dirs[l].fast)
            return QGRU_RT_ECELL;
#endif
    xw = work; /* (a multiple of 16 bytes each: seq stays aligned) */
    hw = (char *)work + act_size(m) * (size_t)qgru_rt_pad16(max_input(m));
    seq = (int16_t *)(void *)((char *)work + fixed_bytes(m));
    if (D == 1) {
        /* one step through every layer at a time: the layers above read the state just written */
        for (t = 0; t < T; t++) {
            for (l = 0; l < L; l++) {
                const qgru_rt_dir *d = &m->dirs[l];
                const act_buf xa = buf_for(d->x_bits, xw), ha = buf_for(d->op_bits, hw);
                int32_t level = 0;
                if (l == 0)
                    level = put_first(m, d, xa, x_q, x_f, t);
                else
                    put_requantized(d, xa, state + (size_t)(l - 1) * H, 1, H);
                dir_step(d, xa, ha, state + (size_t)l * H, state + (size_t)l * H, level, level_block);
            }
            if (out)
                memcpy(out + (size_t)t * H, state + (size_t)(L - 1) * H, sizeof(int16_t) * (size_t)H);
        }
        return QGRU_RT_OK;
    }
    /* bidirectional: layer by layer over the whole sequence (the reverse direction reads it from
     * the end); the layers' outputs alternate between out and seq so that the last lands in out */
    for (l = 0; l < L; l++) {
        int16_t *dst = ((L - 1 - l) % 2 == 0) ? out : seq;
        const int16_t *src = (l == 0) ? 0 : (dst == out ? seq : out);
        for (e = 0; e < 2; e++) {
            const qgru_rt_dir *d = &m->dirs[l * 2 + e];
            const act_buf xa = buf_for(d->x_bits, xw), ha = buf_for(d->op_bits, hw);
            int16_t *h = state + (size_t)(l * 2 + e) * H;
            for (j = 0; j < T; j++) {
                int32_t level = 0;
                t = e ? T - 1 - j : j;
                if (l == 0)
                    level = put_first(m, d, xa, x_q, x_f, t);
                else
                    put_requantized(d, xa, src + (size_t)t * 2 * H, 2, H);
                dir_step(d, xa, ha, h, h, level, level_block);
                memcpy(dst + ((size_t)t * 2 + e) * H, h, sizeof(int16_t) * (size_t)H);
            }
        }
    }
    return QGRU_RT_OK;
}

int qgru_rt_run(const qgru_rt_model *m, const int16_t *x_q, int32_t T, int16_t *state, int16_t *out,
                void *work, size_t work_bytes)
{
    return run(m, x_q, 0, T, state, out, work, work_bytes);
}

int qgru_rt_run_float(const qgru_rt_model *m, const float *x, int32_t T, int16_t *state, int16_t *out,
                      void *work, size_t work_bytes)
{
    size_t i;
    float_in f;
    if (m && x && T > 0)
        for (i = 0; i < (size_t)T * m->input_size; i++)
            if (x[i] != x[i])
                return QGRU_RT_ENAN;
    f.x = x;
    f.put = put_input_float;
    f.level_block = fast_block_level;
    return run(m, 0, x ? &f : 0, T, state, out, work, work_bytes);
}

/* golden quantize on layer 0's static grid (quantize1), NaN -> the zero point */
int32_t qgru_rt_quantize_input(const qgru_rt_model *m, const float *x, int32_t n, int16_t *x_q)
{
    const qgru_rt_dir *d = &m->dirs[0];
    int32_t i, nan = 0;
    for (i = 0; i < n; i++) {
        if (x[i] != x[i]) {
            nan++;
            x_q[i] = (int16_t)d->zp_x;
            continue;
        }
        x_q[i] = (int16_t)quantize1(x[i], d->x_rscale, d->x_scale, d->zp_x, d->r_x);
    }
    return nan;
}

void qgru_rt_dequantize(const qgru_rt_model *m, int32_t dir, const int16_t *q, int32_t n, float *y)
{
    const qgru_rt_dir *d = &m->dirs[dir];
    int32_t i;
    for (i = 0; i < n; i++)
        y[i] = (float)((double)(q[i] - d->zp_h) * d->h_scale);
}
