/* qgru_rt.h: the qgru integer GRU runtime for microcontrollers and ARM boards (C99, no torch).
 *
 * One fixed library (csrc/c/: this header, qgru_rt.c and one kernel file per instruction set,
 * chosen at compile time) runs a whole converted QuantGRU (every layer and direction, stacked,
 * bidirectional) from the data that qgru.export_mcu writes (a .c and .h with a qgru_rt_model).
 * Every result is the integer of the golden model (qgru/golden.py) bit for bit: docs/mcu.md.
 *
 * Build: compile csrc/c/qgru_rt.c, csrc/c/kernel_*.c and the exported model .c together; the
 * kernel is picked from the compiler's target macros (qgru_rt_kernel.h), or forced with
 * -DQGRU_RT_KERNEL=QGRU_RT_KERNEL_REF (plain C).
 *
 * Integers: x_q is the model's input on layer 0's x grid (each value in [x_min, x_max]; values
 * beyond are saturated, as quantize() saturates), the state and the outputs are on each
 * direction's h grid, held in int16_t (the export refuses grids wider than 16 bits). Floats:
 * qgru_rt_run_float quantizes x itself, each token on its x level where layer 0 has levels.
 */
#ifndef QGRU_RT_H_
#define QGRU_RT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define QGRU_RT_ABI 6 /* the layout of the structs below; the exported data checks it */

#if defined(__GNUC__) || defined(__clang__)
#define QGRU_RT_ALIGN16 __attribute__((aligned(16))) /* weight arrays: whole-word loads */
#else
#define QGRU_RT_ALIGN16
#endif

/* signed saturation range of a stored tensor */
typedef struct {
    int32_t lo, hi;
} qgru_rt_range;

/* A sigmoid / tanh table (docs/spec.md section 7): entries int16_t (t16) where they fit, else
 * int32_t (t32); k: segment bits, frac: fraction bits, in_lo: the input range's lowest value. */
typedef struct {
    const int16_t *t16;
    const int32_t *t32;
    int32_t in_lo;
    int32_t out_zp;
    qgru_rt_range out;
    uint8_t k, frac;
} qgru_rt_table;

/* Weight layouts: rows (row-major, for MVE's 16-byte row loads) or interleaved (each block of 4
 * rows stored as groups of 4 columns, 16 bytes a group: row 0 k..k+3, row 1 k..k+3, ..., what one
 * LDM feeds four SMLAD rows, and one SDOT-by-lane reads). */
#define QGRU_RT_LAYOUT_ROWS 0
#define QGRU_RT_LAYOUT_INTERLEAVED 1
/* pairs (Cortex-M DSP, kernel_dsp.c): blocks of 4 rows as groups of 4 columns like interleaved, but
 * each word holds two rows' pair of columns, bytes (W[r][k] + 128, W[r+1][k], W[r][k+1] + 128,
 * W[r+1][k+1]) (r even): read as two halfwords that is W[r] + 128 + 256 W[r+1] per column, so one
 * SMLAD adds four products (docs/mcu.md). GEMMs on the int64 loop (wide) stay interleaved. */
#define QGRU_RT_LAYOUT_PAIRS 2
/* offset (ARMv6-M, kernel_v6m.c): the interleaved order, each byte W + 128 (unsigned: LDRB's
 * immediate offsets); a kernel's sum gets -128 sum(a) (corr). Wide GEMMs stay interleaved. */
#define QGRU_RT_LAYOUT_OFFSET 3

/* The fast cell (qgru_rt.c fast_unit, docs/mcu.md "The fast cell"): every constant precomputed
 * at export, every bound it relies on checked there. A rescale round_half_up(v m / 2^s) with
 * s <= 32 is one SMMLAR: K + floor((v 2^a  m 2^b + 2^31) / 2^32), a + b = 32 - s; one with
 * s >= 33 the high word of the 64-bit product plus 2^(p-1) (and K 2^p) shifted by p = s - 32. */
/* The per-unit constants, 6 int32 a unit: field 2 g (g < 3: r, z, g) gate g's Wx rescale (m 2^b), 2 g + 1
 * its Rh rescale. The shared constants, 12 int32: field 2 g gate g's Wx zero point, 2 g + 1 its Rh zero
 * point, 6 + k: mg[k] (Wx_r, Rh_r, Wx_z, Rh_z, Wx_g: m 2^b), 11: rRh_g's multiplier (its shift the
 * direction's p_rg); stored once for the direction where every unit's are equal (shared_stride 0:
 * per-tensor and per-gate grids, which the export sees), else for every unit like the others
 * (shared_stride 12 or 48). Unit j's fields are stored unit by unit (units[6 j + f], shared[shared_stride
 * j + f]) for the pairs layout (the M4's scalar cell: adjacent fields, LDRD), else in blocks of four
 * units lane by lane (units[24 (j / 4) + 4 f + j % 4], shared[shared_stride (j / 4) + 4 f + j % 4],
 * zeros past H; a shared block of 48 with its four lanes equal: one vector load a field). ABI 7. */
#define QGRU_RT_UNIT_FIELDS 6
#define QGRU_RT_SHARED_FIELDS 12

/* a table as tab[i] = T[i] 2^k + 2^(s-1) (s = k + frac; no rounding term when 0; one entry past the
 * last repeated): T[i+1] - T[i] = (tab[i+1] - tab[i]) / 2^k exactly, the lookup
 * (tab[i] + ((tab[i+1] - tab[i]) >> k) f) >> s; the export proved the output never saturates and
 * |tab[i+1] - tab[i]| < 2^31 */
typedef struct {
    const int32_t *tab;
    int32_t mask;
    uint8_t k, s;
} qgru_rt_ftable;

typedef struct {
    const int32_t *units;           /* the per-unit constants (QGRU_RT_UNIT_FIELDS) */
    const int32_t *shared;          /* the shared constants (QGRU_RT_SHARED_FIELDS) */
    int32_t shared_stride;          /* 0: one set for every unit; else 12 a unit (pairs) or 48 a block */
    const int32_t *init_x, *init_h; /* [3 rows_per_gate]: the kernels' accumulators start here (biases) */
    qgru_rt_ftable t[3];            /* r, z, g */
    int32_t k_r, k_z;               /* zp_pre - in_lo of r and z (u = pre - in_lo, saturated to [0, span]) */
    int32_t c_rg, m_zh, c_zh, m_zg, c_zg, zp_h, one_z;
    int32_t span_r, span_z, span_g;
    qgru_rt_range wx, rh, h;
    uint8_t a[5];                   /* the operand shifts of mg[] */
    uint8_t aa[2];                  /* the accumulators' shifts (Wx, Rh) before mx / mh */
    uint8_t p_rg, p_zh, p_zg;
    int32_t m_hg, c_hg;             /* h -> h_gemm (hg_mode 1): (hi(v m_hg) + c_hg) >> p_hg */
    uint8_t p_hg, hg_mode;          /* hg_mode 0: no h_gemm, or the runtime's general requantization */
    uint8_t std16;                  /* 1: Wx, Rh, h and every gate input 16-bit (SSAT/USAT #16), every
                                     * table k = 6, frac = 4 */
} qgru_rt_fast;

/* The x levels of a layer-0 direction (config x.dynamic, docs/spec.md section 4b): per-token grids
 * of the float input, the static grid widened by 2^(e/4). A token (the input_size values of one
 * step) takes the first level j whose [lo[j], hi[j]] holds all its values, else the last; it is
 * quantized with scale[j] (the static grid's zero point) and its W.x takes level j's bias and
 * rescale. Level 0 is the static grid itself (the direction's own data); the per-channel arrays
 * hold levels 1 .. num - 1 (level j at [(j - 1) * n]). Only qgru_rt_run_float selects levels. */
typedef struct {
    int32_t num;                   /* J >= 1 */
    const double *scale, *lo, *hi; /* [J]; lo = -HUGE_VAL (hi = HUGE_VAL) where that end is the grid's zero point */
    const float *rscale;           /* [J] float32(1 / scale): quantize's float32 estimate (qgru_rt.c quantize1) */
    const float *lo32, *hi32;      /* [J] lo rounded up, hi down to float32: lo <= v <=> lo32 <= v for float32 v */
    const int32_t *init;           /* fast cell: [J-1][3 rows_per_gate] the W.x kernels' starts (as fast->init_x) */
    const int32_t *bias;           /* other cells: [J-1][3H] b_x - Z rowsum(W), int32 where every level fits, */
    const int64_t *bias64;         /* else int64 */
    const int32_t *m;              /* [J-1][3H] the W.x rescale: multiplier, shift */
    const uint8_t *s;
    const int32_t *mx;             /* fast cell, where the export proved the form for every level, in place of m, s: */
    const uint8_t *aa;             /* [J-1][3H] the rescale as one SMMLAR: m 2^b and operand shifts a, a + b + s = 32 */
    const uint8_t *cell32;         /* other cells: [J-1] 1 where unit32's bounds hold on that level */
} qgru_rt_xlevels;

/* One layer and direction. Weights: 3 gates [r | z | g] of rows_per_gate (H rounded up to 4)
 * rows each (rows >= H are zero), each row k_pad (K rounded up to 4) int8_t values (int16_t in
 * w16/r16 when the weights have more than 8 bits), zero past K, 64 zero bytes after the last row,
 * in `layout`.
 * bias_*: b - Z * rowsum(q) per channel (3H), int32_t where it fits (else the *64 pointer). */
typedef struct {
    uint16_t input_size, hidden_size, rows_per_gate, k_pad_x, k_pad_h;
    uint8_t x_bits, op_bits;  /* bits of x and of R.h's operand (h_gemm, or h) */
    uint8_t wide_x, wide_h;   /* 1: the int32 accumulation bound does not hold: int64 loop */
    uint8_t layout;           /* QGRU_RT_LAYOUT_*: the kernel's (qgru_rt_run checks) */
    uint8_t cell32;           /* 1: the export proved every bound of the 32-bit cell (docs/mcu.md) */
    const int8_t *w8, *r8;
    const int16_t *w16, *r16;
    const int32_t *bias_x, *bias_h;
    const int64_t *bias_x64, *bias_h64;
    const int32_t *zp_wx, *zp_rh;                        /* [3H] */
    const int32_t *m_wx, *m_rh;                          /* [3H] acc -> Wx, Rh */
    const uint8_t *s_wx, *s_rh;
    const int32_t *m_gate[6];                            /* [H] Wx_r, Rh_r, Wx_z, Rh_z, Wx_g, rRh_g */
    const uint8_t *s_gate[6];
    qgru_rt_range r_x, r_h, r_op, r_wx, r_rh, r_rpre, r_zpre, r_gpre;
    int32_t zp_x, zp_h, zp_op, zp_rpre, zp_zpre, zp_gpre, zp_r, zp_z, zp_g, one_z;
    int32_t m_zh, m_zg, m_hg;                            /* z h -> h, (1 - z) g -> h, h -> h_gemm */
    uint8_t s_zh, s_zg, s_hg, has_h_gemm;
    qgru_rt_table t_r, t_z, t_g;
    int32_t m_in[2], zp_hprev[2];                        /* layer > 0: previous directions -> x */
    uint8_t s_in[2];
    const qgru_rt_fast *fast;                            /* the fast cell's data (0: unit32 / unit) */
    double x_scale, h_scale;                             /* only for the float boundary */
    float x_rscale;                                      /* float32(1 / x_scale) (qgru_rt.c quantize1) */
    const qgru_rt_xlevels *xlv;                          /* layer 0's x levels, or 0 (a static grid) */
} qgru_rt_dir;

typedef struct {
    uint16_t abi, num_layers, num_directions, input_size, hidden_size;
    const qgru_rt_dir *dirs; /* [num_layers * num_directions], torch's h_n order */
} qgru_rt_model;

/* QGRU_RT_ECELL: the runtime was built with -DQGRU_RT_FAST_ONLY (only the fast cell's code: 4.5 KB
 * less flash on a Cortex-M4 at 16 -> 64) and a direction of the model needs another cell (the exported
 * header's "Cells" line says which each direction takes) */
/* QGRU_RT_ENAN: qgru_rt_run_float's x holds a NaN (nothing was run, the state is unchanged) */
enum { QGRU_RT_OK = 0, QGRU_RT_EARG = -1, QGRU_RT_EWORK = -2, QGRU_RT_EABI = -3, QGRU_RT_ELAYOUT = -4,
       QGRU_RT_ECELL = -5, QGRU_RT_ENAN = -6 };

/* Bytes of work memory qgru_rt_run needs for T steps (T = 1: a streaming step). A unidirectional
 * model needs a fixed few hundred bytes whatever T; a stacked bidirectional one also holds one
 * layer's outputs, T * 2 * hidden_size int16_t. */
size_t qgru_rt_work_bytes(const qgru_rt_model *m, int32_t T);

/* Run T steps. x_q: [T][input_size] integers on layer 0's x grid. state: [layers * directions]
 * [hidden_size], h0 on entry, h_n on return (caller-owned: a stream keeps it between calls, and
 * chunked calls give exactly the integers of one whole call). out: [T][directions * hidden_size]
 * (the last layer's outputs, [forward | reverse]), may be NULL for a unidirectional model.
 * work: qgru_rt_work_bytes(m, T) bytes, 4-byte aligned. Returns QGRU_RT_OK or a negative error
 * (QGRU_RT_ELAYOUT: the data was exported for another kernel's weight layout). */
int qgru_rt_run(const qgru_rt_model *m, const int16_t *x_q, int32_t T, int16_t *state, int16_t *out,
                void *work, size_t work_bytes);

/* qgru_rt_run on float input x: [T][input_size] (golden quantize per token, in float64: soft-float
 * where the FPU is single precision, the same integers), each token on its x level where layer 0
 * has levels (qgru_rt_xlevels), else on the static grid; +-inf saturate. The outputs and the state
 * stay integers (qgru_rt_dequantize). Returns QGRU_RT_ENAN, having run nothing, if x holds a NaN. */
int qgru_rt_run_float(const qgru_rt_model *m, const float *x, int32_t T, int16_t *state, int16_t *out,
                      void *work, size_t work_bytes);

/* The float boundary (golden quantize / dequantize, float64 arithmetic: soft-float where the FPU
 * is single precision, the same integers). x: [n] floats of layer 0's input -> x_q on its static
 * grid (NaN -> the zero point; returns the number of NaN seen). */
int32_t qgru_rt_quantize_input(const qgru_rt_model *m, const float *x, int32_t n, int16_t *x_q);
/* h values of direction dir (index into dirs) -> floats: (q - Z_h) * S_h */
void qgru_rt_dequantize(const qgru_rt_model *m, int32_t dir, const int16_t *q, int32_t n, float *y);

#ifdef __cplusplus
}
#endif
#endif /* QGRU_RT_H_ */
