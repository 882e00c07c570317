/* qgru_rt_fixed.h: the fixed-point primitives of qgru/primitives.py and qgru/tables.py in C99.
 *
 * The same functions as csrc/qgru_fixedpoint.h (C++/CUDA), written for C99 compilers for
 * microcontrollers: docs/mcu.md says why this is its own header. Each returns the golden
 * model's integer for every operand docs/spec.md section 6 allows.
 */
#ifndef QGRU_RT_FIXED_H_
#define QGRU_RT_FIXED_H_

#include <stdint.h>

#include "qgru_rt.h"

#if defined(__GNUC__) || defined(__clang__)
#define QGRU_RT_INLINE static inline __attribute__((always_inline))
#else
#define QGRU_RT_INLINE static inline
#endif

/* floor(v / 2^s), 0 <= s <= 62. C99 leaves >> of a negative value implementation-defined: GCC
 * and Clang define it as the arithmetic shift (their manuals), elsewhere a negative v is shifted
 * through its complement (~v >= 0, two's complement by definition of intN_t). */
#if defined(__GNUC__) || defined(__clang__)
QGRU_RT_INLINE int64_t qgru_rt_shr64(int64_t v, int s) { return v >> s; }
QGRU_RT_INLINE int32_t qgru_rt_shr32(int32_t v, int s) { return v >> s; }
#else
QGRU_RT_INLINE int64_t qgru_rt_shr64(int64_t v, int s) { return v < 0 ? ~(~v >> s) : v >> s; }
QGRU_RT_INLINE int32_t qgru_rt_shr32(int32_t v, int s) { return v < 0 ? ~(~v >> s) : v >> s; }
#endif

/* round_half_up(p / 2^s) = floor((p + 2^(s-1)) / 2^s) of a product p (|p| < 2^62, 1 <= s <= 62).
 * With s >= 33 the rounding constant only adds 2^(s-33) to the high word hi = floor(p / 2^32),
 * and floor(floor(x / 2^32) / 2^(s-32)) = floor(x / 2^s): the result is (hi + 2^(s-33)) >> (s-32)
 * in 32-bit arithmetic (|hi| < 2^30, the sum cannot overflow), the high word of one SMULL on a
 * 32-bit core. Below 33 the 64-bit form (its result may exceed int32 before saturation). */
QGRU_RT_INLINE int64_t qgru_rt_round_product(int64_t p, int s)
{
    if (s >= 33)
        return qgru_rt_shr32((int32_t)qgru_rt_shr64(p, 32) + (1 << (s - 33)), s - 32);
    return qgru_rt_shr64(p + ((int64_t)1 << (s - 1)), s);
}

/* round_half_up(v m / 2^s) in 32-bit words, for |v| 2^pre < 2^31 (pre = max(0, 33 - s), the
 * export checks the bound: cell32): v 2^pre m / 2^(s + pre) with s + pre >= 33, so the rounding
 * constant only adds 2^(post-1) to the high word of one SMULL, post = s + pre - 32 (as in
 * qgru_rt_round_product). Exact for every such v. */
QGRU_RT_INLINE int32_t qgru_rt_rescale32(int32_t v, int32_t m, int s)
{
    const int pre = s < 33 ? 33 - s : 0, post = s < 33 ? 1 : s - 32;
    const int32_t hi = (int32_t)qgru_rt_shr64((int64_t)(v * (1 << pre)) * m, 32);
    return qgru_rt_shr32(hi + (1 << (post - 1)), post);
}

/* rounding_mul_shift: round_half_up(v m / 2^s), 1 <= s <= 62, |v m| < 2^62 (spec section 3). */
QGRU_RT_INLINE int64_t qgru_rt_mul_shift(int64_t v, int32_t m, int s) { return qgru_rt_round_product(v * m, s); }

/* The same for an int32 operand: one 32x32 -> 64 multiply (SMULL on Cortex-M3 and up). */
QGRU_RT_INLINE int64_t qgru_rt_mul_shift32(int32_t v, int32_t m, int s) { return qgru_rt_round_product((int64_t)v * m, s); }

QGRU_RT_INLINE int64_t qgru_rt_sat64(int64_t v, qgru_rt_range r) { return v < r.lo ? r.lo : v > r.hi ? r.hi : v; }
QGRU_RT_INLINE int32_t qgru_rt_sat32(int32_t v, qgru_rt_range r) { return v < r.lo ? r.lo : v > r.hi ? r.hi : v; }

/* tables.lookup: q already saturated to the table's input range; u = q - lo, segment u >> k,
 * position f, T[i] 2^k + (T[i+1] - T[i]) f (a multiplication: T[i] may be negative), a rounding
 * shift by k + frac (none when 0), the output zero point and saturation. The export checks that
 * |T| 2^(k+1) < 2^31, so the interpolation is exact in int32. */
QGRU_RT_INLINE int32_t qgru_rt_lookup(int32_t q, const qgru_rt_table *t)
{
    const int32_t u = q - t->in_lo;
    const int32_t i = u >> t->k, f = u & ((1 << t->k) - 1);
    int32_t lo, hi, v;
    const int s = t->k + t->frac;
    if (t->t16) {
        lo = t->t16[i];
        hi = t->t16[i + 1];
    } else {
        lo = t->t32[i];
        hi = t->t32[i + 1];
    }
    v = lo * (1 << t->k) + (hi - lo) * f;
    if (s)
        v = qgru_rt_shr32(v + (1 << (s - 1)), s);
    return qgru_rt_sat32(v + t->out_zp, t->out);
}

/* ---- the fast cell's primitives (qgru_rt.h qgru_rt_fast; the export proves each bound) ---- */

/* k + floor((v m + 2^31) / 2^32): SMMLAR where the DSP extension has it. With v = x 2^a and m the
 * multiplier times 2^b, a + b + s = 32, this is k + round_half_up(x m / 2^s) exactly. */
#if defined(__ARM_FEATURE_DSP) && __ARM_FEATURE_DSP && !defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#include <arm_acle.h>
QGRU_RT_INLINE int32_t qgru_rt_mulhr(int32_t v, int32_t m, int32_t k)
{
    int32_t r;
    __asm__("smmlar %0, %1, %2, %3" : "=r"(r) : "r"(v), "r"(m), "r"(k));
    return r;
}
#define QGRU_RT_SSAT16(v) __ssat((v), 16)
#define QGRU_RT_SSAT8(v) __ssat((v), 8)
#define QGRU_RT_USAT16(v) ((int32_t)__usat((v), 16))
#elif defined(__ARM_ARCH_6M__) && (defined(__GNUC__) || defined(__clang__))
/* ARMv6-M (Cortex-M0, M0+, M1): MULS is 32 x 32 -> 32 only; a 64-bit product is a libgcc call.
 * v m from 16-bit halves, v = vh 2^16 + vl, m = mh 2^16 + ml (vl, ml, mh in [0, 2^16), vh signed;
 * m >= 0, as every multiplier of the runtime): vl ml is exact in uint32, a = vh ml in int32 and
 * b = vl mh in [0, 2^31), so (v m + c) / 2^32 = vh mh + (a >> 16) + the high half of
 * t = (vl ml >> 16) + b + (a & 0xffff) + c / 2^16, which is below 2^31 + 2^18: exact in uint32 for
 * every int32 v and m >= 0 (c = 2^31: the rounding of mulhr; c = 0: mulhi). qgru_rt_v6m_mulh is that
 * formula in 19 Thumb-1 instructions (cell_v6m.c's cell takes it); the C form below is the same
 * integers (tests/test_mcu.py compiles it for the host). */
#define QGRU_RT_V6M_MULH(v, m, c)                                                                  \
    const uint32_t vl_ = (uint32_t)(v) & 0xffffu, ml_ = (uint32_t)(m) & 0xffffu, mh_ = (uint32_t)(m) >> 16; \
    const int32_t vh_ = (v) >> 16;                                                                 \
    const int32_t a_ = vh_ * (int32_t)ml_;                                                         \
    const uint32_t t_ = ((vl_ * ml_) >> 16) + vl_ * mh_ + ((uint32_t)a_ & 0xffffu) + ((c) >> 16);   \
    const int32_t r_ = (int32_t)((uint32_t)(vh_ * (int32_t)mh_) + (uint32_t)(a_ >> 16) + (t_ >> 16))
#if defined(__thumb__) && !defined(__thumb2__)
/* k + floor((v m + c) / 2^32), c16 = c / 2^16 (0x8000 or 0), m >= 0: the formula above */
QGRU_RT_INLINE int32_t qgru_rt_v6m_mulh(int32_t v, int32_t m, int32_t k, uint32_t c16)
{
    uint32_t vl, ml, t;
    __asm__(".syntax unified\n\t"
            "uxth %[vl], %[v]\n\t"
            "asrs %[v], %[v], #16\n\t"   /* vh */
            "uxth %[ml], %[m]\n\t"
            "lsrs %[m], %[m], #16\n\t"   /* mh */
            "movs %[t], %[ml]\n\t"
            "muls %[t], %[v]\n\t"        /* a = vh ml */
            "muls %[ml], %[vl]\n\t"      /* vl ml */
            "muls %[vl], %[m]\n\t"       /* b = vl mh */
            "muls %[m], %[v]\n\t"        /* vh mh */
            "lsrs %[ml], %[ml], #16\n\t"
            "adds %[ml], %[ml], %[vl]\n\t"
            "adds %[ml], %[ml], %[c]\n\t"
            "uxth %[vl], %[t]\n\t"
            "adds %[ml], %[ml], %[vl]\n\t"
            "lsrs %[ml], %[ml], #16\n\t"  /* t >> 16 */
            "asrs %[t], %[t], #16\n\t"
            "adds %[m], %[m], %[t]\n\t"
            "adds %[m], %[m], %[ml]\n\t"
            "adds %[m], %[m], %[k]\n\t"
            ".syntax divided\n\t"
            : [v] "+l"(v), [m] "+l"(m), [vl] "=&l"(vl), [ml] "=&l"(ml), [t] "=&l"(t)
            : [k] "l"(k), [c] "l"(c16)
            : "cc");
    return m;
}
QGRU_RT_INLINE int32_t qgru_rt_mulhr(int32_t v, int32_t m, int32_t k) { return qgru_rt_v6m_mulh(v, m, k, 0x8000u); }
/* the clamps with the in-range case first, one taken branch: v >> 15 in {-1, 0} (v + 2^15 >> 15 in
 * {0, 1}, unsigned) for int16; v >> 16 == 0 for [0, 65535]; out of range the bound from the sign,
 * 32767 ^ (v >> 31) and ~(v >> 31) >> 16 */
QGRU_RT_INLINE int32_t qgru_rt_v6m_ssat16(int32_t v)
{
    int32_t t;
    __asm__(".syntax unified\n\t"
            "asrs %[t], %[v], #15\n\t"
            "adds %[t], %[t], #1\n\t"
            "cmp %[t], #1\n\t"
            "bls 1f\n\t"
            "asrs %[v], %[v], #31\n\t"
            "movs %[t], #128\n\t"
            "lsls %[t], %[t], #8\n\t"
            "subs %[t], %[t], #1\n\t"
            "eors %[v], %[t]\n\t"
            "1:\n\t"
            ".syntax divided\n\t"
            : [v] "+l"(v), [t] "=&l"(t) : : "cc");
    return v;
}
QGRU_RT_INLINE int32_t qgru_rt_v6m_usat16(int32_t v)
{
    int32_t t;
    __asm__(".syntax unified\n\t"
            "lsrs %[t], %[v], #16\n\t"
            "beq 1f\n\t"
            "asrs %[v], %[v], #31\n\t"
            "mvns %[v], %[v]\n\t"
            "lsrs %[v], %[v], #16\n\t"
            "1:\n\t"
            ".syntax divided\n\t"
            : [v] "+l"(v), [t] "=&l"(t) : : "cc");
    return v;
}
QGRU_RT_INLINE int32_t qgru_rt_v6m_ssat8(int32_t v)
{
    int32_t t;
    __asm__(".syntax unified\n\t"
            "asrs %[t], %[v], #7\n\t"
            "adds %[t], %[t], #1\n\t"
            "cmp %[t], #1\n\t"
            "bls 1f\n\t"
            "asrs %[v], %[v], #31\n\t"
            "movs %[t], #127\n\t"
            "eors %[v], %[t]\n\t"
            "1:\n\t"
            ".syntax divided\n\t"
            : [v] "+l"(v), [t] "=&l"(t) : : "cc");
    return v;
}
#define QGRU_RT_SSAT8(v) qgru_rt_v6m_ssat8(v)
#define QGRU_RT_SSAT16(v) qgru_rt_v6m_ssat16(v)
#define QGRU_RT_USAT16(v) qgru_rt_v6m_usat16(v)
#else
QGRU_RT_INLINE int32_t qgru_rt_mulhr(int32_t v, int32_t m, int32_t k)
{
    QGRU_RT_V6M_MULH(v, m, 0x80000000u);
    return k + r_;
}
#endif
#ifndef QGRU_RT_SSAT16
#define QGRU_RT_SSAT16(v) ((v) < -32768 ? -32768 : (v) > 32767 ? 32767 : (v))
#define QGRU_RT_USAT16(v) ((v) < 0 ? 0 : (v) > 65535 ? 65535 : (v))
#endif
#ifndef QGRU_RT_SSAT8
#define QGRU_RT_SSAT8(v) ((v) < -128 ? -128 : (v) > 127 ? 127 : (v))
#endif
#else
QGRU_RT_INLINE int32_t qgru_rt_mulhr(int32_t v, int32_t m, int32_t k)
{
    return k + (int32_t)qgru_rt_shr64((int64_t)v * m + ((int64_t)1 << 31), 32);
}
#define QGRU_RT_SSAT16(v) ((v) < -32768 ? -32768 : (v) > 32767 ? 32767 : (v))
#define QGRU_RT_SSAT8(v) ((v) < -128 ? -128 : (v) > 127 ? 127 : (v))
#define QGRU_RT_USAT16(v) ((v) < 0 ? 0 : (v) > 65535 ? 65535 : (v))
#endif

/* floor(v m / 2^32) of int32 v, m >= 0 */
QGRU_RT_INLINE int32_t qgru_rt_mulhi(int32_t v, int32_t m)
{
#if defined(QGRU_RT_V6M_MULH) && defined(__thumb__) && !defined(__thumb2__)
    /* qgru_rt_v6m_mulh without c and k: 17 instructions */
    uint32_t vl, ml, t;
    __asm__(".syntax unified\n\t"
            "uxth %[vl], %[v]\n\t"
            "asrs %[v], %[v], #16\n\t"
            "uxth %[ml], %[m]\n\t"
            "lsrs %[m], %[m], #16\n\t"
            "movs %[t], %[ml]\n\t"
            "muls %[t], %[v]\n\t"
            "muls %[ml], %[vl]\n\t"
            "muls %[vl], %[m]\n\t"
            "muls %[m], %[v]\n\t"
            "lsrs %[ml], %[ml], #16\n\t"
            "adds %[ml], %[ml], %[vl]\n\t"
            "uxth %[vl], %[t]\n\t"
            "adds %[ml], %[ml], %[vl]\n\t"
            "lsrs %[ml], %[ml], #16\n\t"
            "asrs %[t], %[t], #16\n\t"
            "adds %[m], %[m], %[t]\n\t"
            "adds %[m], %[m], %[ml]\n\t"
            ".syntax divided\n\t"
            : [v] "+l"(v), [m] "+l"(m), [vl] "=&l"(vl), [ml] "=&l"(ml), [t] "=&l"(t)
            :
            : "cc");
    return m;
#elif defined(QGRU_RT_V6M_MULH)
    QGRU_RT_V6M_MULH(v, m, 0u);
    return r_;
#else
    return (int32_t)qgru_rt_shr64((int64_t)v * m, 32);
#endif
}

/* floor(a b m / 2^32), m >= 0, |a b m| < 2^63: on a 32-bit core the 64-bit a b split into its
 * words, lo m by UMULL (unsigned, its high word is floor(lo m / 2^32)) and hi m added (MLA) modulo
 * 2^32, exact because the true result fits int32. */
QGRU_RT_INLINE int32_t qgru_rt_prod_hi(int32_t a, int32_t b, int32_t m)
{
#if defined(QGRU_RT_V6M_MULH) && defined(__thumb__) && !defined(__thumb2__)
    /* the C form below in 41 Thumb-1 instructions (7 low registers, 9 MULS) */
    uint32_t al, bl, x, y;
    __asm__(".syntax unified\n\t"
            "uxth %[al], %[a]\n\t"
            "asrs %[a], %[a], #16\n\t"     /* ah */
            "uxth %[bl], %[b]\n\t"
            "asrs %[b], %[b], #16\n\t"     /* bh */
            "movs %[x], %[bl]\n\t"
            "muls %[x], %[a]\n\t"          /* x = ah bl */
            "movs %[y], %[al]\n\t"
            "muls %[y], %[b]\n\t"          /* y = al bh */
            "muls %[b], %[a]\n\t"          /* ah bh */
            "muls %[al], %[bl]\n\t"        /* ll = al bl */
            "lsrs %[a], %[al], #16\n\t"
            "uxth %[bl], %[x]\n\t"
            "adds %[a], %[a], %[bl]\n\t"
            "uxth %[bl], %[y]\n\t"
            "adds %[a], %[a], %[bl]\n\t"   /* t */
            "asrs %[x], %[x], #16\n\t"
            "adds %[b], %[b], %[x]\n\t"
            "asrs %[y], %[y], #16\n\t"
            "adds %[b], %[b], %[y]\n\t"
            "lsrs %[x], %[a], #16\n\t"
            "adds %[b], %[b], %[x]\n\t"    /* hi */
            "uxth %[al], %[al]\n\t"        /* ul */
            "uxth %[a], %[a]\n\t"          /* uh */
            "muls %[b], %[m]\n\t"          /* hi m */
            "uxth %[x], %[m]\n\t"          /* nl */
            "lsrs %[m], %[m], #16\n\t"     /* nh */
            "movs %[y], %[a]\n\t"
            "muls %[y], %[x]\n\t"          /* q = uh nl */
            "movs %[bl], %[al]\n\t"
            "muls %[bl], %[x]\n\t"         /* ul nl */
            "lsrs %[bl], %[bl], #16\n\t"
            "muls %[al], %[m]\n\t"         /* ul nh */
            "adds %[bl], %[bl], %[al]\n\t"
            "uxth %[x], %[y]\n\t"
            "adds %[bl], %[bl], %[x]\n\t"  /* u */
            "lsrs %[bl], %[bl], #16\n\t"
            "muls %[a], %[m]\n\t"          /* uh nh */
            "lsrs %[y], %[y], #16\n\t"
            "adds %[a], %[a], %[y]\n\t"
            "adds %[a], %[a], %[bl]\n\t"
            "adds %[a], %[a], %[b]\n\t"
            ".syntax divided\n\t"
            : [a] "+l"(a), [b] "+l"(b), [m] "+l"(m), [al] "=&l"(al), [bl] "=&l"(bl), [x] "=&l"(x), [y] "=&l"(y)
            :
            : "cc");
    return a;
#elif defined(QGRU_RT_V6M_MULH)
    /* a b = hi 2^32 + lo (lo = uh 2^16 + ul unsigned) from halves as in QGRU_RT_V6M_MULH, then
     * floor(lo m / 2^32) from the halves of lo and m (ul nh < 2^31 as m < 2^31: u < 2^31 + 2^17,
     * exact in uint32) + hi m modulo 2^32, exact because the true result fits int32 */
    const uint32_t al = (uint32_t)a & 0xffffu, bl = (uint32_t)b & 0xffffu;
    const int32_t ah = a >> 16, bh = b >> 16;
    const int32_t x = ah * (int32_t)bl, y = (int32_t)al * bh;
    const uint32_t ll = al * bl;
    const uint32_t t = (ll >> 16) + ((uint32_t)x & 0xffffu) + ((uint32_t)y & 0xffffu);
    const uint32_t hi = (uint32_t)(ah * bh + (x >> 16) + (y >> 16)) + (t >> 16);
    const uint32_t ul = ll & 0xffffu, uh = t & 0xffffu, nl = (uint32_t)m & 0xffffu, nh = (uint32_t)m >> 16;
    const uint32_t q = uh * nl;
    const uint32_t u = ((ul * nl) >> 16) + ul * nh + (q & 0xffffu);
    return (int32_t)(uh * nh + (q >> 16) + (u >> 16) + hi * (uint32_t)m);
#elif UINTPTR_MAX > 0xffffffffu
    return (int32_t)qgru_rt_shr64((int64_t)a * b * m, 32);
#else
    const int64_t p = (int64_t)a * b;
    const uint32_t lo = (uint32_t)p, hi = (uint32_t)(p >> 32);
    return (int32_t)((uint32_t)(((uint64_t)lo * (uint32_t)m) >> 32) + hi * (uint32_t)m);
#endif
}

/* v 2^a without the undefined left shift of a negative int (a two's complement wrap: |v| 2^a < 2^31) */
QGRU_RT_INLINE int32_t qgru_rt_shl(int32_t v, int a) { return (int32_t)((uint32_t)v << a); }

/* the fast table: u in [0, span], (tab[i] + ((tab[i+1] - tab[i]) >> k) f) >> s: T[i] 2^k + (T[i+1] - T[i]) f
 * plus the rounding term, shifted (golden lookup minus its zero point: the output never saturates) */
QGRU_RT_INLINE int32_t qgru_rt_flookup(int32_t u, const qgru_rt_ftable *t)
{
    const int32_t *p = t->tab + (u >> t->k);
    return qgru_rt_shr32(p[0] + qgru_rt_shr32(p[1] - p[0], t->k) * (u & t->mask), t->s);
}

#endif /* QGRU_RT_FIXED_H_ */
