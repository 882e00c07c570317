// The AMX path (Intel Sapphire Rapids and later, where Linux grants the tile state: isa.cpp).
//
// AMX multiplies a 16 x 64 int8 tile A by a 64 x 16 int8 tile B into a 16 x 16 int32 tile C in
// one instruction (tdpbssd, signed x signed, exact int32 sums: |sum| <= K 2^14 < 2^31 for
// K < 2^17), about 8x the int8 throughput of AVX-512 VNNI. Measured on a 2-core Sapphire Rapids
// VM: R.h of one step (64 x 512 by 512 x 1536) takes 14 us per thread, against ~90 us for ATen's
// _int_mm, which repacks the weights on every call.
//
// Packed weights: groups of 16 output columns (one B tile wide); for each 64-wide K slice, one
// 1 KB tile whose row kk holds, for the 16 columns c, W[c][64 kt + 4 kk .. + 3] (AMX's "VNNI"
// order for B). A rows are read as whole 16-row tiles and C is written as whole tiles (the
// GemmArgs contract: buffers hold whole row tiles, lda a multiple of 64).
#define QGRU_ISA amx
#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 12))
#define QGRU_BUILD_AMX 1
#define QGRU_QUANTIZE_AVX512
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")
#endif
#else
#define QGRU_BUILD_AMX 0
#endif
#if QGRU_BUILD_AMX
#include "lanes_avx512.h"  // the int32 cell in explicit 16-lane vectors
#define QGRU_CELL_LANES I32x16
#endif
#include "cell_loops.h"
#include "quantize_block.h"

#if QGRU_BUILD_AMX
#include <immintrin.h>
#include <string.h>
#endif

namespace qgru {
namespace cpu {
#if QGRU_BUILD_AMX
QGRU_ISA_BEGIN
namespace {

constexpr int64_t kTile = 16;         // rows of every tile; int32 columns of a C tile
constexpr int64_t kTileK = 64;        // int8 K values per A-tile row
constexpr int64_t kTileBytes = 1024;  // one tile

int64_t tiles(int64_t n, int64_t per) { return (n + per - 1) / per; }

int64_t packed_bytes(int64_t groups, int64_t K) { return groups * tiles(K, kTileK) * kTileBytes; }

void pack(const int8_t* W, int64_t ldw, int64_t K, const int64_t* channel, int64_t groups, void* out) {
  const int64_t KT = tiles(K, kTileK);
  int8_t* o = static_cast<int8_t*>(out);
  memset(o, 0, (size_t)packed_bytes(groups, K));
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < kTile; ++c) {
      const int64_t ch = channel[g * kTile + c];
      if (ch < 0) continue;
      for (int64_t k = 0; k < K; ++k)
        o[((g * KT + k / kTileK) * kTile + (k % kTileK) / 4) * 64 + c * 4 + k % 4] = W[ch * ldw + k];
    }
}

// Every tile 16 rows x 64 bytes (palette 1). A constant object: gcc (12) does not see that
// ldtilecfg reads all 64 bytes, and dropped the stores that filled a stack copy (its slot was
// reused), which loaded an empty configuration and faulted on the first tile instruction.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
constexpr TileConfig kTileConfig{1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

// The configuration is per thread and other libraries (oneDNN) load their own, so each parallel
// task loads it before its first tile instruction (Kernels::thread_init).
void configure() { _tile_loadconfig(&kTileConfig); }

// C tiles (NA x NB: 16 NA rows, 16 NB columns) = A rows x B column tiles, over KT K slices.
// Tiles 0-3 accumulate, 4-5 hold A, 6-7 hold B. b_stride: bytes from one column tile to the next;
// c_stride: int32 elements from one C column tile to the next.
template <int NA, int NB>
inline void block(const int8_t* A, int64_t lda, const int8_t* B, int64_t b_stride, int64_t KT, int32_t* C,
                  int64_t ldc, int64_t c_stride) {
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NA > 1) _tile_zero(2);
  if (NA > 1 && NB > 1) _tile_zero(3);
  for (int64_t kt = 0; kt < KT; ++kt) {
    _tile_loadd(4, A + kt * kTileK, lda);
    if (NA > 1) _tile_loadd(5, A + kTile * lda + kt * kTileK, lda);
    _tile_loadd(6, B + kt * kTileBytes, 64);
    if (NB > 1) _tile_loadd(7, B + b_stride + kt * kTileBytes, 64);
    _tile_dpbssd(0, 4, 6);
    if (NB > 1) _tile_dpbssd(1, 4, 7);
    if (NA > 1) _tile_dpbssd(2, 5, 6);
    if (NA > 1 && NB > 1) _tile_dpbssd(3, 5, 7);
  }
  const int64_t ldc_bytes = ldc * 4;
  _tile_stored(0, C, ldc_bytes);
  if (NB > 1) _tile_stored(1, C + c_stride, ldc_bytes);
  if (NA > 1) _tile_stored(2, C + kTile * ldc, ldc_bytes);
  if (NA > 1 && NB > 1) _tile_stored(3, C + kTile * ldc + c_stride, ldc_bytes);
}

// The three gates of one 16-row tile of A and one unit group: B holds the group's r, z and g
// column tiles one after the other (3 KT tiles); A is loaded once for the three.
inline void gate_tiles(const int8_t* A, int64_t lda, const int8_t* B, int64_t KT, int32_t* acc, int64_t ldc,
                       int64_t gate_stride) {
  const int64_t bs = KT * kTileBytes;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t kt = 0; kt < KT; ++kt) {
    _tile_loadd(4, A + kt * kTileK, lda);
    _tile_loadd(5, B + kt * kTileBytes, 64);
    _tile_loadd(6, B + bs + kt * kTileBytes, 64);
    _tile_loadd(7, B + 2 * bs + kt * kTileBytes, 64);
    _tile_dpbssd(0, 4, 5);
    _tile_dpbssd(1, 4, 6);
    _tile_dpbssd(2, 4, 7);
  }
  _tile_stored(0, acc, ldc * 4);
  _tile_stored(1, acc + gate_stride, ldc * 4);
  _tile_stored(2, acc + 2 * gate_stride, ldc * 4);
}

void gemm(const GemmArgs& a) {
  const int64_t KT = tiles(a.K, kTileK), RT = tiles(a.rows, kTile), bs = KT * kTileBytes;
  const int8_t* A = static_cast<const int8_t*>(a.A);
  const int8_t* B = static_cast<const int8_t*>(a.B);
  if (a.gate_stride > 0) {  // unit groups: r, z, g tiles of 16 units each
    for (int64_t g = a.g0; g + 3 <= a.g1; g += 3)
      for (int64_t rt = 0; rt < RT; ++rt)
        gate_tiles(A + rt * kTile * a.lda, a.lda, B + g * bs, KT, gemm_out(a, kTile, g, rt * kTile), a.ldc,
                   a.gate_stride);
    return;
  }
  // 2 x 2 tile blocks (smaller at the edges); a column pair's B tiles stay in L1 while the row
  // tiles stream past
  for (int64_t g = a.g0; g < a.g1; g += 2) {
    const bool nb2 = g + 1 < a.g1;
    for (int64_t rt = 0; rt < RT; rt += 2) {
      const bool na2 = rt + 1 < RT;
      const int8_t* at = A + rt * kTile * a.lda;
      const int8_t* b = B + g * bs;
      int32_t* c = gemm_out(a, kTile, g, rt * kTile);
      if (na2 && nb2) block<2, 2>(at, a.lda, b, bs, KT, c, a.ldc, kTile);
      else if (na2) block<2, 1>(at, a.lda, b, bs, KT, c, a.ldc, kTile);
      else if (nb2) block<1, 2>(at, a.lda, b, bs, KT, c, a.ldc, kTile);
      else block<1, 1>(at, a.lda, b, bs, KT, c, a.ldc, kTile);
    }
  }
}

const Kernels kTable{"amx", 1, kTile, packed_bytes, pack, gemm,
                     CellLoops<int8_t>::rows, CellLoops<int8_t>::tile, CellLoops<int8_t>::requant,
                     CellLoops<int8_t>::act, configure, quantize_f32, quantize_f64,
                     quantize_levels_f32, quantize_levels_f64};

}  // namespace
QGRU_ISA_END

const Kernels* amx_kernels() { return &kTable; }
#else
const Kernels* amx_kernels() { return nullptr; }
#endif

}  // namespace cpu
}  // namespace qgru

#if defined(__clang__) && QGRU_BUILD_AMX
#pragma clang attribute pop
#endif
