// int8 x int8 -> int32 GEMMs on Intel AMX tiles, for the C++ CPU backend (qgru_cpu.cpp) only.
//
// AMX (Sapphire Rapids and later) multiplies a 16 x 64 int8 tile A by a 64 x 16 int8 tile B into
// a 16 x 16 int32 tile C in one instruction (tdpbssd, signed x signed, exact int32 sums), about
// 8x the int8 throughput of AVX-512 VNNI. Measured on a 2-core Sapphire Rapids VM: R.h of one step
// (64 x 512 by 512 x 1536) takes 14 us per thread against ~90 us for ATen's _int_mm, which
// repacks the weights on every call. Here the weights are packed once, when the layer is built.
//
// Layouts (every tile 16 rows of 64 bytes):
//  * A, the activations: row-major int8 [rows, lda], lda a multiple of 64, the K padding zeroed;
//    the buffer has at least round_up(rows, 16) rows (the extra rows' results are ignored).
//  * B, the weights W [M, K] (a row per output channel), packed by pack_b: for each column tile
//    (16 channels) and each 64-wide K slice, one 1 KB tile whose row kk holds, for the 16
//    channels c, W[c][64 kt + 4 kk .. 64 kt + 4 kk + 3] (AMX's "VNNI" order for B).
//  * C: row-major int32 [rows, ldc]; whole 16 x 16 tiles are stored.
//
// Exactness: each C entry is the int32 sum of K products of int8 values, |sum| <= K 2^14, exact
// for K < 2^17 (qgru_cell.h, LimbProducts, which every caller already requires).
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__) && defined(__x86_64__)
#define QGRU_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define QGRU_HAVE_AMX 0
#endif

namespace qgru {
namespace amx {

constexpr int64_t kTile = 16;         // rows of every tile; int32 columns of a C tile
constexpr int64_t kTileK = 64;        // int8 K values per A-tile row
constexpr int64_t kTileBytes = 1024;  // one tile

inline int64_t tiles(int64_t n, int64_t per) { return (n + per - 1) / per; }

// Packs W into B tiles. channel(m) gives the row of W that output column m (0 <= m < 16 MT) reads,
// or -1 for a zero column; W is int8 [*, ldw] with K valid columns. out: MT * KT tiles.
template <typename ChannelOf>
void pack_b(const int8_t* W, int64_t ldw, int64_t K, int64_t MT, ChannelOf channel, int8_t* out) {
  const int64_t KT = tiles(K, kTileK);
  memset(out, 0, (size_t)(MT * KT * kTileBytes));
  for (int64_t mt = 0; mt < MT; ++mt)
    for (int64_t c = 0; c < kTile; ++c) {
      const int64_t ch = channel(mt * kTile + c);
      if (ch < 0) continue;
      for (int64_t k = 0; k < K; ++k)
        out[((mt * KT + k / kTileK) * kTile + (k % kTileK) / 4) * 64 + c * 4 + k % 4] = W[ch * ldw + k];
    }
}

#if QGRU_HAVE_AMX
// The process must ask Linux for the AMX tile state once before any tile instruction
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without it the first one faults.
inline bool request_permission() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

// Every tile 16 rows x 64 bytes (palette 1). A constant object: gcc (12) does not see that
// ldtilecfg reads all 64 bytes, and dropped the stores that filled a stack copy (its slot was
// reused), which loaded an empty configuration and faulted on the first tile instruction.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline constexpr TileConfig kTileConfig{1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

// The configuration is per thread and other libraries (oneDNN) load their own, so each parallel
// task loads it before its first tile instruction.
inline void configure() { _tile_loadconfig(&kTileConfig); }

// C tiles (NA x NB: 16 NA rows, 16 NB columns) = A rows x B column tiles, over KT K slices.
// Tiles 0-3 accumulate, 4-5 hold A, 6-7 hold B. b_stride: bytes from one column tile to the next.
template <int NA, int NB>
inline void block(const int8_t* A, int64_t lda, const int8_t* B, int64_t b_stride, int64_t KT, int32_t* C,
                  int64_t ldc) {
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
  if (NB > 1) _tile_stored(1, C + kTile, ldc_bytes);
  if (NA > 1) _tile_stored(2, C + kTile * ldc, ldc_bytes);
  if (NA > 1 && NB > 1) _tile_stored(3, C + kTile * ldc + kTile, ldc_bytes);
}

// C[row tiles [r0, r1), column tiles [m0, m1)] = A . B, in 2 x 2 tile blocks (smaller at the
// edges). The B pair of a column block stays in L1 while the row tiles stream past it.
inline void gemm(const int8_t* A, int64_t lda, int64_t r0, int64_t r1, const int8_t* B, int64_t KT, int64_t m0,
                 int64_t m1, int32_t* C, int64_t ldc) {
  const int64_t bs = KT * kTileBytes;
  for (int64_t m = m0; m < m1; m += 2) {
    const bool nb2 = m + 1 < m1;
    for (int64_t r = r0; r < r1; r += 2) {
      const bool na2 = r + 1 < r1;
      const int8_t* a = A + r * kTile * lda;
      const int8_t* b = B + m * bs;
      int32_t* c = C + r * kTile * ldc + m * kTile;
      if (na2 && nb2) block<2, 2>(a, lda, b, bs, KT, c, ldc);
      else if (na2) block<2, 1>(a, lda, b, bs, KT, c, ldc);
      else if (nb2) block<1, 2>(a, lda, b, bs, KT, c, ldc);
      else block<1, 1>(a, lda, b, bs, KT, c, ldc);
    }
  }
}

// The three gates' R.h for one 16-row tile of h and one block of 16 hidden units: B holds the
// block's r, z and g column tiles one after the other (3 KT tiles). The gate tiles are stored at
// acc, acc + gate_stride, acc + 2 gate_stride (int32), each 16 rows of stride ldc.
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
#else
inline bool request_permission() { return false; }
#endif

// True when this binary holds the AMX kernels and Linux grants the tile state.
inline bool available() { return QGRU_HAVE_AMX && request_permission(); }

}  // namespace amx
}  // namespace qgru
