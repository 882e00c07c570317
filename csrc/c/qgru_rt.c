/* qgru_rt.c: the driver of the qgru runtime (qgru_rt.h): layers, directions, time steps, and the
 * cell of golden.gru_step, unit by unit. The matrix-vector products are the kernel's
 * (qgru_rt_kernel.h); everything else is here, the same on every target. docs/mcu.md. */
#include <string.h>

#include "qgru_rt.h"
#include "qgru_rt_fixed.h"
#include "qgru_rt_kernel.h"

/* activations of one GEMM operand: int8 when its grid has <= 8 bits and the kernel takes int8 */
typedef struct {
    int8_t *a8;
    int16_t *a16;
} act_buf;

static int use_a8(int bits) { return QGRU_RT_HAS_A8 && bits <= 8; }

static void act_clear(act_buf b, int32_t n)
{
    if (b.a8)
        memset(b.a8, 0, (size_t)qgru_rt_pad16(n));
    else
        memset(b.a16, 0, sizeof(int16_t) * (size_t)qgru_rt_pad16(n));
}

static void act_put(act_buf b, int32_t k, int32_t v)
{
    if (b.a8)
        b.a8[k] = (int8_t)v;
    else
        b.a16[QGRU_RT_ACT_POS(k)] = (int16_t)v;
}

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

#if defined(__GNUC__) || defined(__clang__)
#define QGRU_RT_NOINLINE __attribute__((noinline))
#else
#define QGRU_RT_NOINLINE
#endif

/* Unit j of the cell (golden gru_step): its three W x and R h sums -> the new h[j]. A function of
 * its own (not inlined into the block loop), so a 32-bit core keeps its values in registers. */
static QGRU_RT_NOINLINE int16_t unit(const qgru_rt_dir *d, int32_t j, const int64_t ax[3], const int64_t ah[3], int32_t h)
{
    const int32_t H = d->hidden_size;
    int32_t dwx[3], drh[3], d_r, d_z, d_g, pre, g;
    int64_t hv;
    for (g = 0; g < 3; g++) {
        const int32_t c = g * H + j;
        const int64_t bx = d->bias_x ? d->bias_x[c] : d->bias_x64[c];
        const int64_t bh = d->bias_h ? d->bias_h[c] : d->bias_h64[c];
        dwx[g] = requant_acc(ax[g] + bx, d->m_wx[c], d->s_wx[c], d->zp_wx[c], d->r_wx);
        drh[g] = requant_acc(ah[g] + bh, d->m_rh[c], d->s_rh[c], d->zp_rh[c], d->r_rh);
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
static QGRU_RT_NOINLINE int16_t unit32(const qgru_rt_dir *d, int32_t j, const int32_t *ax, const int32_t *ah,
                                       int32_t h)
{
    const int32_t H = d->hidden_size;
    int32_t dwx[3], drh[3], d_r, d_z, d_g, pre, g;
    int64_t hv;
    for (g = 0; g < 3; g++) {
        const int32_t c = g * H + j;
        dwx[g] = qgru_rt_sat32(qgru_rt_rescale32(ax[4 * g] + d->bias_x[c], d->m_wx[c], d->s_wx[c]) + d->zp_wx[c], d->r_wx)
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
        u = QGRU_RT_USAT16(u);
        return qgru_rt_shr32(t->tab[u >> 6] + t->dif[u >> 6] * (u & 63), 10);
    }
    u = u < 0 ? 0 : u > span ? span : u;
    return qgru_rt_flookup(u, t);
}

/* q - Z of a requantized accumulator: saturate(rescale(acc) + Z) - Z, Z folded into the SMMLAR */
QGRU_RT_INLINE int32_t facc(int32_t acc, int32_t m, int32_t z, qgru_rt_range r, const int std16)
{
    return fsat(qgru_rt_mulhr(acc, m, z), r, std16) - z;
}

QGRU_RT_INLINE int16_t fast_unit(const qgru_rt_fast *F, const qgru_rt_unit *U, const int32_t *ax, const int32_t *ah,
                                 int32_t h, const int std16, const int accsh)
{
    int32_t dx, dh, d_r, d_z, d_g, t;
    dx = facc(accsh ? qgru_rt_shl(ax[0], F->aa[0]) : ax[0], U->c[0].mx, U->c[0].zx, F->wx, std16);
    dh = facc(accsh ? qgru_rt_shl(ah[0], F->aa[1]) : ah[0], U->c[0].mh, U->c[0].zh, F->rh, std16);
    t = qgru_rt_mulhr(qgru_rt_shl(dh, F->a[1]), U->mg[1], qgru_rt_mulhr(qgru_rt_shl(dx, F->a[0]), U->mg[0], F->k_r));
    d_r = flook(t, F->span_r, &F->t[0], std16);
    dx = facc(accsh ? qgru_rt_shl(ax[4], F->aa[0]) : ax[4], U->c[1].mx, U->c[1].zx, F->wx, std16);
    dh = facc(accsh ? qgru_rt_shl(ah[4], F->aa[1]) : ah[4], U->c[1].mh, U->c[1].zh, F->rh, std16);
    t = qgru_rt_mulhr(qgru_rt_shl(dh, F->a[3]), U->mg[3], qgru_rt_mulhr(qgru_rt_shl(dx, F->a[2]), U->mg[2], F->k_z));
    d_z = flook(t, F->span_z, &F->t[1], std16);
    dx = facc(accsh ? qgru_rt_shl(ax[8], F->aa[0]) : ax[8], U->c[2].mx, U->c[2].zx, F->wx, std16);
    dh = facc(accsh ? qgru_rt_shl(ah[8], F->aa[1]) : ah[8], U->c[2].mh, U->c[2].zh, F->rh, std16);
    t = qgru_rt_shr32(qgru_rt_prod_hi(d_r, dh, U->m_rg) + F->c_rg, F->p_rg); /* r Rh_g, + zp_gpre - in_lo */
    d_g = flook(qgru_rt_mulhr(qgru_rt_shl(dx, F->a[4]), U->mg[4], t), F->span_g, &F->t[2], std16);
    t = qgru_rt_shr32(qgru_rt_prod_hi(d_z, h - F->zp_h, F->m_zh) + F->c_zh, F->p_zh) /* + zp_h */
        + qgru_rt_shr32(qgru_rt_prod_hi(F->one_z - d_z, d_g, F->m_zg) + F->c_zg, F->p_zg);
    return (int16_t)fsat(t, F->h, std16);
}

#ifndef QGRU_RT_NO_STD16
static QGRU_RT_NOINLINE void fast_block16(const qgru_rt_fast *F, int32_t j0, int32_t n, const int32_t *ax,
                                          const int32_t *ah, const int16_t *h, int16_t *h_new)
{
    int32_t u;
    for (u = 0; u < n; u++)
        h_new[j0 + u] = fast_unit(F, &F->units[j0 + u], ax + u, ah + u, h[j0 + u], 1, 0);
}

/* the same where the accumulators need their shifts (aa) */
static QGRU_RT_NOINLINE void fast_block16s(const qgru_rt_fast *F, int32_t j0, int32_t n, const int32_t *ax,
                                           const int32_t *ah, const int16_t *h, int16_t *h_new)
{
    int32_t u;
    for (u = 0; u < n; u++)
        h_new[j0 + u] = fast_unit(F, &F->units[j0 + u], ax + u, ah + u, h[j0 + u], 1, 1);
}
#endif

static QGRU_RT_NOINLINE void fast_block(const qgru_rt_fast *F, int32_t j0, int32_t n, const int32_t *ax,
                                        const int32_t *ah, const int16_t *h, int16_t *h_new)
{
    int32_t u;
    for (u = 0; u < n; u++)
        h_new[j0 + u] = fast_unit(F, &F->units[j0 + u], ax + u, ah + u, h[j0 + u], 0, 1);
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
        int32_t v = qgru_rt_shr32((int32_t)qgru_rt_shr64((int64_t)(h[j] - zp) * m, 32) + c, p);
        v = sat == 8 ? QGRU_RT_SSAT8(v) : sat == 16 ? QGRU_RT_SSAT16(v) : v < d->r_op.lo ? d->r_op.lo : v > d->r_op.hi ? d->r_op.hi : v;
        s += v;
        if (a8)
            ha.a8[j] = (int8_t)v;
        else
            ha.a16[j] = (int16_t)v;
    }
    return QGRU_RT_NEEDS_ASUM ? -128 * s : 0;
}

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

/* One step of one direction (golden gru_step for one row): xa holds x on this layer's x grid,
 * h the state; the new state goes to h_new (not aliasing h). */
static void dir_step(const qgru_rt_dir *d, act_buf xa, act_buf ha, const int16_t *h, int16_t *h_new)
{
    const int32_t H = d->hidden_size, G = d->rows_per_gate;
    int32_t j0, j, u, g, cx, ch = 0;
    /* R.h's operand: the state itself, or requantized onto h_gemm's grid (recurrent_operand) */
    act_clear(ha, H);
    if (d->fast && d->fast->hg_mode) {
        const int sat = d->op_bits == 8 || d->op_bits == 16 ? d->op_bits : 0;
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
    if (d->fast) { /* kernels from the biases straight into the fast cell */
        const qgru_rt_fast *F = d->fast;
        const int32_t kx = d->k_pad_x, kh = d->k_pad_h;
        for (j0 = 0; j0 < H; j0 += 4) {
            int32_t ax[3][4], ah[3][4];
#if QGRU_RT_HAS_DOT12
            if (xa.a8)
                qgru_rt_dot12_a8(d->w8 + j0 * kx, G * kx, xa.a8, kx, F->init_x + j0, G, cx, ax);
            else
                qgru_rt_dot12_a16(d->w8 + j0 * kx, G * kx, xa.a16, kx, F->init_x + j0, G, cx, ax);
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
                    qgru_rt_dot4_a8(wx, kx, xa.a8, kx, F->init_x + g * G + j0, cx, ax[g]);
                else
                    qgru_rt_dot4_a16(wx, kx, xa.a16, kx, F->init_x + g * G + j0, cx, ax[g]);
                if (ha.a8)
                    qgru_rt_dot4_a8(wh, kh, ha.a8, kh, F->init_h + g * G + j0, ch, ah[g]);
                else
                    qgru_rt_dot4_a16(wh, kh, ha.a16, kh, F->init_h + g * G + j0, ch, ah[g]);
            }
#ifndef QGRU_RT_NO_STD16 /* tests/test_mcu.py: the general variant on data that takes the 16-bit one */
            if (F->std16 && !F->aa[0] && !F->aa[1])
                fast_block16(F, j0, H - j0 < 4 ? H - j0 : 4, &ax[0][0], &ah[0][0], h, h_new);
            else if (F->std16)
                fast_block16s(F, j0, H - j0 < 4 ? H - j0 : 4, &ax[0][0], &ah[0][0], h, h_new);
            else
#endif
                fast_block(F, j0, H - j0 < 4 ? H - j0 : 4, &ax[0][0], &ah[0][0], h, h_new);
        }
        return;
    }
    if (d->cell32) { /* int32 kernels straight into the 32-bit cell (cell32 implies neither GEMM is wide) */
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
                h_new[j0 + u] = unit32(d, j0 + u, &ax[0][u], &ah[0][u], h[j0 + u]);
        }
        return;
    }
    for (j0 = 0; j0 < H; j0 += 4) {
        int64_t ax[3][4], ah[3][4];
        for (g = 0; g < 3; g++) {
            dot4(d, 0, g * G + j0, xa, cx, ax[g]);
            dot4(d, 1, g * G + j0, ha, ch, ah[g]);
        }
        for (u = 0; u < 4 && j0 + u < H; u++) {
            {
                const int64_t x3[3] = {ax[0][u], ax[1][u], ax[2][u]}, h3[3] = {ah[0][u], ah[1][u], ah[2][u]};
                h_new[j0 + u] = unit(d, j0 + u, x3, h3, h[j0 + u]);
            }
        }
    }
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
    int32_t k;
    act_clear(xa, d->input_size);
    for (k = 0; k < d->input_size; k++)
        act_put(xa, k, qgru_rt_sat32(x[k], d->r_x));
}

/* work: [x operand: pad16(max K) int16][R.h operand: pad16(H) int16][new state: H int16]
 * [stacked bidirectional: one layer's outputs, T * D * H int16] */
static int32_t max_input(const qgru_rt_model *m)
{
    const int32_t up = m->num_directions * m->hidden_size;
    return m->input_size > up ? m->input_size : up;
}

static size_t fixed_bytes(const qgru_rt_model *m)
{
    return sizeof(int16_t) * (size_t)(qgru_rt_pad16(max_input(m)) + qgru_rt_pad16(m->hidden_size)
                                      + ((m->hidden_size + 7) & ~7));
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

int qgru_rt_run(const qgru_rt_model *m, const int16_t *x_q, int32_t T, int16_t *state, int16_t *out,
                void *work, size_t work_bytes)
{
    const int32_t L = m ? m->num_layers : 0, D = m ? m->num_directions : 0, H = m ? m->hidden_size : 0;
    int16_t *xw, *hw, *hn, *seq;
    int32_t t, l, e, j;
    if (!m || !state || (T > 0 && !x_q) || T < 0 || !work || L < 1 || (D != 1 && D != 2) || H < 1)
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
    xw = (int16_t *)work;
    hw = xw + qgru_rt_pad16(max_input(m));
    hn = hw + qgru_rt_pad16(H);
    seq = hn + ((H + 7) & ~7);
    if (D == 1) {
        /* one step through every layer at a time: the layers above read the state just written */
        for (t = 0; t < T; t++) {
            for (l = 0; l < L; l++) {
                const qgru_rt_dir *d = &m->dirs[l];
                const act_buf xa = buf_for(d->x_bits, xw), ha = buf_for(d->op_bits, hw);
                if (l == 0)
                    put_input(d, xa, x_q + (size_t)t * m->input_size);
                else
                    put_requantized(d, xa, state + (size_t)(l - 1) * H, 1, H);
                dir_step(d, xa, ha, state + (size_t)l * H, hn);
                memcpy(state + (size_t)l * H, hn, sizeof(int16_t) * (size_t)H);
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
                t = e ? T - 1 - j : j;
                if (l == 0)
                    put_input(d, xa, x_q + (size_t)t * m->input_size);
                else
                    put_requantized(d, xa, src + (size_t)t * 2 * H, 2, H);
                dir_step(d, xa, ha, h, hn);
                memcpy(h, hn, sizeof(int16_t) * (size_t)H);
                memcpy(dst + ((size_t)t * 2 + e) * H, hn, sizeof(int16_t) * (size_t)H);
            }
        }
    }
    return QGRU_RT_OK;
}

/* golden quantize: saturate(round_half_up(x / scale) + zp), x / scale clamped to one step beyond
 * the range first (so that +-inf saturate), in float64 */
int32_t qgru_rt_quantize_input(const qgru_rt_model *m, const float *x, int32_t n, int16_t *x_q)
{
    const qgru_rt_dir *d = &m->dirs[0];
    const double lo = (double)d->r_x.lo - d->zp_x - 1, hi = (double)d->r_x.hi - d->zp_x + 1;
    int32_t i, nan = 0;
    for (i = 0; i < n; i++) {
        double v = (double)x[i];
        double r;
        int32_t q;
        if (v != v) {
            nan++;
            x_q[i] = (int16_t)d->zp_x;
            continue;
        }
        v = v / d->x_scale;
        v = v < lo ? lo : v > hi ? hi : v;
        r = (double)(int32_t)v; /* |v| < 2^17: the conversion is exact, truncating toward zero */
        if (r > v)
            r -= 1.0; /* floor */
        q = (int32_t)r + (v - r >= 0.5);
        x_q[i] = (int16_t)qgru_rt_sat32(q + d->zp_x, d->r_x);
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
