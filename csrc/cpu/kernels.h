// The CPU backend's kernel interface: what one instruction-set path provides (XNNPACK / oneDNN
// style: one small table of functions, one file per path, one run-time choice).
//
//   kernel_portable.cpp   plain C++ that the compiler vectorises for the build's baseline target
//   kernel_avx2.cpp       AVX2: int8/int16 operands sign-extended to int16, vpmaddwd into int32
//   kernel_avxvnni.cpp    AVX-VNNI: vpdpbusd in its VEX form (256-bit), as avx512vnni, for CPUs
//                         without AVX-512 (vnni_gemm.h: both paths' GEMM)
//   kernel_avx512vnni.cpp AVX-512 VNNI: vpdpbusd (u8 x s8) with a +128 offset and column sums
//   kernel_amx.cpp        AMX-INT8 tiles (tdpbssd)
//   isa.cpp               which of them this CPU and OS can run (CPUID, XCR0, AMX permission)
//
// Every path computes exact int32 dot products (the proof for each is at its GEMM) and runs the
// cell through the same functions of qgru_cell.h (cell_loops.h), so every path gives the golden
// model's integers. Only the driver (qgru_cpu.cpp: chunks, threads, buffers) is compiled once.
//
// Kernel files hold no torch or standard-library templates: only plain C++ and qgru's headers,
// whose inline functions each file compiles into its own namespace (QGRU_ISA, qgru_fixedpoint.h).
#pragma once

#include <stdint.h>

#include "qgru_cell.h"

namespace qgru {
namespace cpu {

constexpr int64_t kTileRows = 16;            // rows of every row tile; buffers hold whole tiles
constexpr int64_t kKAlign = 64;              // activation rows: K padded with zeros to this
constexpr int64_t kTaskUnits = kCell32Block;  // hidden units of one fused task (128)

// GEMM of one row block: C = A . B^T over the weight column groups [g0, g1) of a packed matrix.
//  * A: int8 or int16 (Kernels::act_bytes) [round_up(rows, 16), lda], lda a multiple of 64, the
//    columns K .. lda - 1 zero. Rows past `rows` are readable and their results are ignored.
//  * B: packed by Kernels::pack, column groups of Kernels::group columns.
//  * Output, plain (gate_stride == 0): group g's column c of row r at C[r ldc + (g - g0) group + c].
//    Gates (gate_stride > 0; the groups come as r, z, g of one unit group after another, see
//    gate_channels in qgru_cpu.cpp): unit group u = (g - g0) / 3, gate q = (g - g0) % 3 at
//    C[q gate_stride + r ldc + u group + c]. C is writable for round_up(rows, 16) rows.
struct GemmArgs {
  const void* A;
  int64_t lda, rows, K;
  const void* B;
  int64_t g0, g1;
  int32_t* C;
  int64_t ldc, gate_stride;
};

// The pow2 int32 requantization of a two-pair product (16-bit weights as two int8 limbs times a
// 16-bit activation taken whole as int16: prepare.py limbs16_fits and _limb32_parts; cell_loops.h
// requant_limbs32): P = 256 G1 + G0 + 128 Rs, G0 / G1 the lo / hi weight limb's int32 sums and Rs
// the activation row's sum (the ones column), each exact in int32. With bias = bias_hi 2^R +
// bias_lo (0 <= bias_lo < 2^R), floor((P + bias) / 2^R) = bias_hi + (G1 >> (R - 8)) + (G0 >> R)
// + (Rs >> (R - 7)) + (rem >> R), rem = ((G1 mod 2^(R-8)) << 8) + (G0 mod 2^R) + ((Rs mod
// 2^(R-7)) << 7) + bias_lo in [0, 2^(R+2)), inside int32 for 8 <= R <= 29; |bias_hi| + 2^25 <
// 2^31 keeps the other sums inside int32 (|G1 >> (R - 8)|, |G0 >> R| <= 2^23). Then as
// requantize_acc: round half up ((v + 1) >> 1), add Z, saturate, subtract Z.
struct LimbRequant32 {
  const int32_t* bias_hi;  // [3H] (W.x with x levels: [J 3H], a row's at its level's offset)
  const int32_t* bias_lo;
  const int32_t* rshift;   // R in [8, 29]
  const int32_t* zp;       // [3H]
  int32_t lo, hi;
};

// The non-fused step's cells: rows [n0, n1) of one time step, all H channels.
struct CellRowsArgs {
  const CellParams* p;
  const LimbProducts* rh;   // the step's R.h limb products
  const int32_t* dwx;       // [N, 3H] Wx - Z_Wx of this step
  int32_t* state;           // [N, H] the state, updated
  int32_t* out;             // [N, H] this step's output
  void* const* h_limbs;     // the next step's h as activation limbs ([N, lda] each)
  int n_h_limbs, h_bits, h_direct;  // h_direct: one int16 limb holding h itself
  int64_t lda, n0, n1;
  const int64_t* lengths;   // rows whose length is reached carry their state (nullptr: none)
  int64_t t;
  int np, pow2, acc32;      // kernel flags (dispatch_kernel)
  int hybrid = 0;           // the hybrid cell (acc32 = 0): int64 requantization, int32 gates (cell_block_hybrid)
  const LimbRequant32* l32 = nullptr;  // hybrid, two pairs, pow2: R.h's int32 requantization (else nullptr)
};

// The fused step's cells of one task (qgru_cpu.cpp fused_steps): rows x nj elements.
struct CellTileArgs {
  const CellParams* p;
  const AccRequant* wx;
  int64_t j0, nj, rows;
  const uint8_t* active;    // [rows] 1 where the row's sequence goes on at this step
  const int32_t* x;         // xacc: W.x tiles [3][16][kTaskUnits]; else the rows' Wx - Z_Wx [rows, 3H]
  const int32_t* acc_h;     // R.h tiles [3][16][kTaskUnits]
  int32_t* s;               // the rows' state, row stride H
  int32_t* o;               // the rows' output, row stride H (nullptr: y takes it)
  const void* h_in;         // this step's h as one activation limb, row stride lda
  void* h_out;              // the next step's
  int64_t lda;
  int pow2, acc32, xacc;
  // xacc: W.x's int32 form as flat [levels][3H] arrays (wx32), and each row's x level (level[r],
  // nullptr: level 0; rows of a layer without levels), the row's arrays at level[r] * 3H
  const AccRequant32* wx32;
  const int32_t* level;
  // level 0's W.x requantization is the static grid's (checked when the layer is made): a row on
  // level 0 then reads W.x's fields from the channel blocks, as a layer without levels
  int level0_static;
  // wide accumulators (a 16-bit operand taken whole; acc32 set too): cell_tile's WIDE form, which
  // reads the requantization fields in their wide form (qgru_cell.h requant_wide32)
  int wide;
  // y (not nullptr): the rows' output as floats, primitives.dequantize with y_scale and y_zp (row
  // stride H; the last layer of a stack), written instead of the int32 output o (then nullptr)
  float* y = nullptr;
  double y_scale = 1.0, y_zp = 0.0;
};

// W.x requantization of rows [r0, r1): dwx[r][c] = Wx - Z_Wx from the limb products.
struct RequantRowsArgs {
  const AccRequant* a;
  const AccRequant32* a32;
  const LimbProducts* lp;
  int64_t r0, r1, H3;
  int32_t* dwx;
  int np, pow2, acc32;
  const int32_t* level;     // row r's x level at level[r] (nullptr: level 0; a layer without levels)
  const LimbRequant32* l32 = nullptr;  // two pairs, pow2: the int32 requantization (requant_limbs32)
};

// Rows [r0, r1) of int32 values of `bits` bits (row stride K) as activation limbs: n_limbs
// arrays [rows, ld] of int8 or int16 (act_limb; direct: one int16 limb, the value itself).
// cell (R.h's activations only, else nullptr): src holds states, written as their R.h operand
// (gemm_operand; the int32 form where the layer's flags pow2 / acc32 say).
struct ToActArgs {
  const int32_t* src;
  int64_t r0, r1, K, ld;
  int bits, n_limbs, direct;
  void* const* dst;
  const CellParams* cell;
  int pow2, acc32;
};

QGRU_ISA_BEGIN
// K padded with zeros to whole kKAlign slices: every path's packed weights and activation rows.
// (In each path's namespace like every inline function the kernel files compile.)
inline int64_t k_padded(int64_t K) { return (K + kKAlign - 1) / kKAlign * kKAlign; }
// K padded to whole multiples of `step` (a divisor of kKAlign): what a path's GEMM packs and loops
// over where its micro-kernels need less than kKAlign (the vpdpbusd paths 8, avx2 4). Activation
// rows keep their kKAlign-padded stride, their columns K .. lda - 1 zero, so every path reads the
// same buffers; a small K is then not multiplied as 64 (I = 16: a quarter of W.x's work, issue 40).
inline int64_t k_padded_to(int64_t K, int64_t step) { return (K + step - 1) / step * step; }
QGRU_ISA_END

struct Kernels {
  const char* name;   // "portable", "avx2", "avxvnni", "avx512vnni", "amx"
  int act_bytes;      // activation limbs as int8 (1) or int16 (2); int16 paths may take 16-bit values whole
  int64_t group;      // columns per packed column group
  int64_t (*packed_bytes)(int64_t groups, int64_t K);
  // Packs int8 W [*, ldw] (K valid columns): column c of group g reads row channel[g group + c]
  // (-1: a zero column).
  void (*pack)(const int8_t* W, int64_t ldw, int64_t K, const int64_t* channel, int64_t groups, void* out);
  void (*gemm)(const GemmArgs& a);
  void (*cell_rows)(const CellRowsArgs& a);
  void (*cell_tile)(const CellTileArgs& a);
  void (*requant_rows)(const RequantRowsArgs& a);
  void (*to_act)(const ToActArgs& a);
  void (*thread_init)();  // once per thread region before gemm (AMX: load the tile configuration)
  // The float boundary: primitives.quantize of x[0, n) into q (range [lo, hi]); false on NaN.
  bool (*quantize_f32)(const float* x, int32_t* q, int64_t n, double scale, int64_t zp, int64_t lo, int64_t hi);
  bool (*quantize_f64)(const double* x, int32_t* q, int64_t n, double scale, int64_t zp, int64_t lo, int64_t hi);
  // golden.quantize_levels over tokens [0, tokens) of I values each: per token its minimum and
  // maximum, its level (select_level) into level[t] and its values on that level's grid into q;
  // false on NaN (a token holding one gets some level: the call fails anyway).
  bool (*quantize_levels_f32)(const float* x, int32_t* q, int32_t* level, int64_t tokens, int64_t I,
                              const XLevelGrid& g, int64_t zp, int64_t lo, int64_t hi);
  bool (*quantize_levels_f64)(const double* x, int32_t* q, int32_t* level, int64_t tokens, int64_t I,
                              const XLevelGrid& g, int64_t zp, int64_t lo, int64_t hi);
  // An int8 path's sibling with int16 activations (act_bytes 2, the same path's instructions), for
  // layers whose 16-bit x or h the GEMM takes whole (prepare.py x_direct16 / h_direct16): one GEMM
  // pass instead of two limb pairs, and so the fused step (issue 40). nullptr: none.
  const Kernels* act16 = nullptr;
};

// The paths compiled into this binary (nullptr where the compiler cannot build one).
const Kernels* portable_kernels();
const Kernels* avx2_kernels();
const Kernels* avxvnni_kernels();
const Kernels* avx512vnni_kernels();
const Kernels* amx_kernels();

// One row of C values (C a multiple of 4) requantized onto another grid, 4 at a time (the AVX2
// path's, kernel_avx2.cpp; op_cpu.cpp requantize_cat): dst[c] = saturate(rounding_mul_shift(a[c] -
// z, m, s) + to_zp, [r_lo, r_hi]) with m, s per channel (m[c], s[c]) or per tensor (m[0], s[0]).
// False where some a[c] - z leaves int32: the caller then takes the row as scalars. nullptr where
// the path is not compiled; only for a CPU that runs the avx2 path.
using RequantRowFn = bool (*)(const int32_t* a, int64_t C, int64_t z, const int64_t* m, const int64_t* s,
                              bool per_channel, int64_t to_zp, int64_t r_lo, int64_t r_hi, int32_t* dst);
RequantRowFn avx2_requant_row();

}  // namespace cpu
}  // namespace qgru
