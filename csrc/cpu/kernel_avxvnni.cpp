// The AVX-VNNI path: x86-64 CPUs with AVX2 and the VEX-encoded vpdpbusd but no AVX-512 (Intel
// client cores since Alder Lake, whose AVX-512 is fused off, and the E-core Xeons such as Sierra
// Forest). CPUs with AVX-512 VNNI take the avx512vnni path (or amx) instead.
//
// GEMM: the AVX-512 VNNI path's (vnni_gemm.h: one GEMM and packing for both, with the exactness
// proof) in 256-bit registers. vpdpbusd multiplies unsigned 8-bit by signed 8-bit values and adds
// each group of four products to an int32 lane, modulo 2^32: the activations enter offset by 128
// and the GEMM subtracts 128 colsum(w), which gives a . w exactly. Per K quad that is 32 products
// per instruction, against the avx2 path's 16 (vpmaddwd on operands widened to int16). Groups of
// 8 columns, micro-kernels of up to 4 rows x 3 groups (12 of the 16 ymm registers).
// The cell: the int32 cell in 8-lane vectors (lanes_avx2.h), as on the avx2 path, but with its
// table lookups as gathers (avx2 takes scalar loads: lanes_avx2.h says why).
#define QGRU_ISA avxvnni
// (QGRU_NO_AVXVNNI: qgru/native.py found that the toolchain cannot build it, _toolchain_has_avxvnni)
#if defined(__x86_64__) && !defined(QGRU_NO_AVXVNNI) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define QGRU_BUILD_AVXVNNI 1
#define QGRU_QUANTIZE_AVX2
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,bmi2,f16c,popcnt,avxvnni"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,bmi2,f16c,popcnt,avxvnni")
#endif
#else
#define QGRU_BUILD_AVXVNNI 0  // gcc before 11 and clang before 12 have no AVX-VNNI intrinsics
#endif
#if QGRU_BUILD_AVXVNNI
#include "lanes_avx2.h"  // the int32 cell in explicit 8-lane vectors
#define QGRU_CELL_LANES I32x8
#endif
#include "cell_loops.h"
#include "quantize_block.h"

#if QGRU_BUILD_AVXVNNI
#include <immintrin.h>
#include <string.h>

#include "vnni_gemm.h"
#endif

namespace qgru {
namespace cpu {
#if QGRU_BUILD_AVXVNNI
QGRU_ISA_BEGIN
namespace {

// The GEMM (vnni_gemm.h) in ymm registers: groups of 8 columns, up to 4 rows x 3 groups (12 of
// the 16 registers).
struct Ymm {
  using reg = __m256i;
  static constexpr int64_t kGroup = 8;
  static constexpr int kRowBlock = 4;
  static reg zero() { return _mm256_setzero_si256(); }
  static reg load(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static reg quad(int32_t q) { return _mm256_xor_si256(_mm256_set1_epi32(q), _mm256_set1_epi32((int32_t)0x80808080u)); }
  // gcc 12's _mm256_dpbusd_avx_epi32 made every accumulator of the micro-kernel also stored to
  // the stack and copied at every K quad (the layer ran 47 instead of 36 ms); the same instruction
  // as inline asm leaves them in registers
  static reg dpbusd(reg acc, reg a, reg b) {
#if defined(__clang__)
    return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b));
    return acc;
#endif
  }
  static reg add(reg x, reg y) { return _mm256_add_epi32(x, y); }
  static reg sub(reg x, reg y) { return _mm256_sub_epi32(x, y); }
  static void store(int32_t* p, reg x) { _mm256_storeu_si256((__m256i*)p, x); }
};
using Gemm = VnniGemm<Ymm>;

void no_init() {}

const Kernels kTable{"avxvnni", 1, Ymm::kGroup, Gemm::packed_bytes, Gemm::pack, Gemm::gemm,
                     CellLoops<int8_t>::rows, CellLoops<int8_t>::tile, CellLoops<int8_t>::requant,
                     CellLoops<int8_t>::act, no_init, quantize_f32, quantize_f64,
                     quantize_levels_f32, quantize_levels_f64};

}  // namespace
QGRU_ISA_END

const Kernels* avxvnni_kernels() { return &kTable; }
#else
const Kernels* avxvnni_kernels() { return nullptr; }
#endif

}  // namespace cpu
}  // namespace qgru

#if defined(__clang__) && QGRU_BUILD_AVXVNNI
#pragma clang attribute pop
#endif
