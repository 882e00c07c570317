// The AVX-512 VNNI path (Intel since Cascade Lake / Ice Lake, AMD Zen 4 and later).
//
// GEMM: vpdpbusd multiplies unsigned 8-bit by signed 8-bit values, sums each group of four
// products and adds it to an int32 lane. The activations are signed, so they enter offset by 128
// (a XOR 0x80 = a + 128, in [0, 255]) and the offset is taken out at the end:
//     a . w = (a + 128) . w - 128 colsum(w),
// exact modulo 2^32 and so exactly (vnni_gemm.h: the GEMM and packing this path shares with
// avxvnni, the proof, the layout). Here in zmm registers: groups of 16 output columns, micro-
// kernels of up to 8 rows x 3 groups (24 of the 32 registers).
#define QGRU_ISA avx512vnni
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QGRU_BUILD_VNNI 1
#define QGRU_QUANTIZE_AVX512
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#endif
#else
#define QGRU_BUILD_VNNI 0
#endif
#if QGRU_BUILD_VNNI
#define QGRU_LANES_SCALAR_TABLE  // table lookups as scalar loads, not gathers (lanes_avx512.h says why)
#include "lanes_avx512.h"  // the int32 cell in explicit 16-lane vectors
#define QGRU_CELL_LANES I32x16
#endif
#include "cell_loops.h"
#include "quantize_block.h"

#if QGRU_BUILD_VNNI
#include <immintrin.h>
#include <string.h>

#include "vnni_gemm.h"
#include "vnni16_gemm.h"
#endif

namespace qgru {
namespace cpu {
#if QGRU_BUILD_VNNI
QGRU_ISA_BEGIN
namespace {

// The GEMM (vnni_gemm.h) in zmm registers: groups of 16 columns, up to 8 rows x 3 groups (24 of
// the 32 registers).
struct Zmm {
  using reg = __m512i;
  static constexpr int64_t kGroup = 16;
  static constexpr int kRowBlock = 8;
  static reg zero() { return _mm512_setzero_si512(); }
  static reg load(const void* p) { return _mm512_loadu_si512(p); }
  static reg quad(int32_t q) { return _mm512_xor_si512(_mm512_set1_epi32(q), _mm512_set1_epi32((int32_t)0x80808080u)); }
  // gcc 12's _mm512_dpbusd_epi32 made every accumulator of the micro-kernel also stored to the
  // stack, and copied twice, at every K quad (the layer ran 30 instead of 22 ms); the same
  // instruction as inline asm leaves them in registers
  static reg dpbusd(reg acc, reg a, reg b) {
#if defined(__clang__)
    return _mm512_dpbusd_epi32(acc, a, b);
#else
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
#endif
  }
  static reg add(reg x, reg y) { return _mm512_add_epi32(x, y); }
  static reg sub(reg x, reg y) { return _mm512_sub_epi32(x, y); }
  static void store(int32_t* p, reg x) { _mm512_storeu_si512((void*)p, x); }
};
using Gemm = VnniGemm<Zmm>;

void no_init() {}

// The int16 sibling (Kernels::act16, issue 40): 16-bit activations whole, vpdpwssd (vnni16_gemm.h),
// in zmm registers as above (the same micro-kernel shapes).
template <int WB>  // packed weight bytes: 2, int16; 1, int8 widened as loaded (vnni16_gemm.h)
struct Zmm16 {
  using reg = __m512i;
  static constexpr int64_t kGroup = 16;
  static constexpr int kRowBlock = 8;
  static constexpr int64_t kWeightBytes = WB;
  static reg zero() { return _mm512_setzero_si512(); }
  static reg load(const void* p) { return _mm512_loadu_si512(p); }
  static reg load_w8(const void* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
  static reg pair(int32_t q) { return _mm512_set1_epi32(q); }
  // inline asm for the reason given at Zmm::dpbusd
  static reg dpwssd(reg acc, reg a, reg b) {
#if defined(__clang__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
#endif
  }
  static reg add(reg x, reg y) { return _mm512_add_epi32(x, y); }
  static void store(int32_t* p, reg x) { _mm512_storeu_si512((void*)p, x); }
};
// Weights packed as int8 and widened as they are loaded (vpmovsxbw): against int16 packing, the same
// speed at H = 64 and 128, and faster where the weights leave L1 or L2: I = H = 512, N = 1, T = 20,
// 1 thread, 0.44 against 0.74 ms per call (an interleaved run on a shared Zen 4 EPYC, 2026-11-28).
using Gemm16 = Vnni16Gemm<Zmm16<1>>;

const Kernels kTable16{"avx512vnni", 2, Zmm16<1>::kGroup, Gemm16::packed_bytes, Gemm16::pack, Gemm16::gemm,
                       CellLoops<int16_t>::rows, CellLoops<int16_t>::tile, CellLoops<int16_t>::requant,
                       CellLoops<int16_t>::act, no_init, quantize_f32, quantize_f64,
                       quantize_levels_f32, quantize_levels_f64};

const Kernels kTable{"avx512vnni", 1, Zmm::kGroup, Gemm::packed_bytes, Gemm::pack, Gemm::gemm,
                     CellLoops<int8_t>::rows, CellLoops<int8_t>::tile, CellLoops<int8_t>::requant,
                     CellLoops<int8_t>::act, no_init, quantize_f32, quantize_f64,
                     quantize_levels_f32, quantize_levels_f64, &kTable16};

}  // namespace
QGRU_ISA_END

const Kernels* avx512vnni_kernels() { return &kTable; }
#else
const Kernels* avx512vnni_kernels() { return nullptr; }
#endif

}  // namespace cpu
}  // namespace qgru

#if defined(__clang__) && QGRU_BUILD_VNNI
#pragma clang attribute pop
#endif
