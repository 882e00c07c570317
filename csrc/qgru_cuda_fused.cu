// The fused step of the CUDA backend: one kernel per time step does the R.h product by int8
// mma.sync.m16n8k32 (the three gates of a hidden unit in one lane's accumulators), the cell in
// registers (qgru_cell.h gru_cell_acc through fs_cell) and writes the next step's int8 operand,
// instead of a cuBLAS GEMM node, a cell node and the Gh int32 round trip between them. The fragment
// maps, the schedule, the loads and the end of a pair's step (fs_pair_step) are qgru_fused_step.h's
// __host__ __device__ functions, which the
// tests run on the host against the golden model (tests/test_cuda_fused_step.py) and the exact
// product (tests/test_cuda_compile.py, tests/test_cuda_fused_compile.py); this file is the kernel
// around them and its launch. Opt-in (QGRU_CUDA_FUSED=1, qgru_cuda.cpp) for layers with one R.h
// limb pair (8-bit weights and operand: w8a8) on sm_80 or newer: it has not run on a GPU yet.
//
// The operand's double buffer is the layer's two h limb buffers (a one-limb layer uses only the
// first otherwise): step t reads h_limbs[t % 2] and writes h_limbs[(t + 1) % 2], so no CTA writes
// what another CTA of the same launch still reads; their padding (k >= H, rows >= N) stays zero.
// A row past its length writes no operand (fs_pair_step): its products are no longer used.
#include <stdexcept>
#include <string>

#include "qgru_cuda.h"
#include "qgru_fused_step.h"

namespace qgru {
namespace cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("qgru cuda: ") + what + ": " + cudaGetErrorString(e));
}

constexpr int kFsWarps = 8;  // warps per CTA (the schedule splits K over them when n tiles are few)
constexpr int kFsThreads = 32 * kFsWarps;

struct FsArgs {
  const int8_t* R;         // [M_pad, K_pad] R's int8 weight limbs (one limb), rows q H + j
  const int8_t* h_in;      // [N_pad, K_pad] this step's operand limbs (zero past H)
  int8_t* h_out;           // [N_pad, K_pad] the next step's
  const int32_t* dwx_t;    // [N, 3H] Wx - Z_Wx of this step
  int32_t* state;          // [N, H]
  int16_t* out_t;          // [N, H] this step's output
  const int64_t* lengths;  // [N] or nullptr
  int64_t t;
  int32_t h_bits;
};

// D = A B + D, s8 x s8 -> s32 (PTX ISA mma.m16n8k32; the fragment maps of qgru_fused_step.h).
__device__ __forceinline__ void mma_s8(int32_t d[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // never launched there: fused_supported requires compute capability 8.0
#endif
}

// One step. CTA blockIdx.x owns units [8 c, 8 c + 8); warp w takes fs_item(s, w, pass)'s n tile
// and k steps; the k_split partial accumulators of an n tile meet in shared memory, and the lane of
// its ks = 0 warp runs the cell of its two (unit, row) pairs.
template <bool POW2, bool ACC32>
__global__ void __launch_bounds__(kFsThreads) fused_step_kernel(CellParams cp, FsShape s, FsArgs a) {
  __shared__ int32_t part[kFsWarps][kFsTiles][4][32];  // [warp][tile][register][lane]: no bank conflict
  const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
  const int64_t cta = blockIdx.x, H = s.H;
  const auto weight = [](const int8_t* p) { return (uint32_t)__ldg((const unsigned int*)p); };  // read-only
  const auto operand = [](const int8_t* p) { return *(const uint32_t*)p; };  // the previous launch's writes
  for (int64_t pass = 0; pass < s.passes; ++pass) {
    const FsItem it = fs_item(s, warp, pass);
    int32_t acc[kFsTiles][4] = {};
    if (it.nt >= 0) {
#pragma unroll 2
      for (int64_t kstep = it.ks; kstep < s.k_steps; kstep += s.k_split) {
        uint32_t b[2], w[4];
        fs_load_b_words(a.h_in, s.K_pad, s.N, it.nt, kstep, lane, b, operand);
        QGRU_UNROLL
        for (int tile = 0; tile < kFsTiles; ++tile) {
          fs_load_a_words(a.R, s.K_pad, H, cta, tile, kstep, lane, w, weight);
          mma_s8(acc[tile], w, b);
        }
      }
    }
    if (s.k_split > 1) {  // uniform over the CTA: every warp reaches both barriers
      if (it.nt >= 0 && it.ks != 0)
        for (int tile = 0; tile < kFsTiles; ++tile)
          for (int i = 0; i < 4; ++i) part[warp][tile][i][lane] = acc[tile][i];
      __syncthreads();
      if (it.nt >= 0 && it.ks == 0)
        for (int q = 1; q < (int)s.k_split; ++q)
          for (int tile = 0; tile < kFsTiles; ++tile)
            for (int i = 0; i < 4; ++i) acc[tile][i] += part[warp + q][tile][i][lane];  // exact in int32
      __syncthreads();  // the next pass writes `part` again
    }
    if (it.nt < 0 || it.ks != 0) continue;
    QGRU_UNROLL
    for (int p = 0; p < 2; ++p) {
      const FsAcc u = fs_acc(s, cta, 0, it.nt, lane, p);  // tile 0 c_p: gate r of the pair
      if (u.gate != 0) continue;
      fs_pair_step<POW2, ACC32>(cp, s.K_pad, a.h_bits, a.t, a.lengths, u.j, u.n, acc[0], acc[1], p, a.dwx_t, a.state,
                                a.out_t, a.h_out);
    }
  }
}

template <typename F>
void dispatch(const LayerDesc& d, F&& f) {
  if (d.pow2) {
    d.acc32 ? f(fused_step_kernel<true, true>) : f(fused_step_kernel<true, false>);
  } else {
    d.acc32 ? f(fused_step_kernel<false, true>) : f(fused_step_kernel<false, false>);
  }
}

}  // namespace

bool fused_supported(const LayerDesc& d, int device) {
  const GemmDesc& g = d.rh;
  // one limb pair (8-bit operand and weights: the accumulator is the exact product, no ones column),
  // R's rows q H + j, K_pad a multiple of 4 (word loads) and K < 2^17 (exact int32 partial sums)
  const bool layer = g.P == 1 && d.h_bits <= 8 && g.act_limb[0] == 0 && g.weight_limb[0] == 0 &&
                     g.weight_offset[0] == 0 && g.M_pad >= 3 * d.H && g.K_pad >= d.H && g.K_pad % 4 == 0 &&
                     g.K_pad < (1 << 17) && d.H >= 1;
  if (!layer) return false;
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
        "cudaDeviceGetAttribute (compute capability)");
  return major >= 8;  // mma.sync.m16n8k32 with s8 operands: sm_80 and newer
}

void fused_step(const LayerDesc& d, const int8_t* h_in, int8_t* h_out, const int32_t* dwx_t, int32_t* state,
                int16_t* out_t, const int64_t* lengths, int64_t t, int64_t N, cudaStream_t stream) {
  const FsShape s = fs_shape(d.H, N, d.rh.K_pad, kFsWarps);
  FsArgs a{};
  a.R = d.rh.weight_limbs;
  a.h_in = h_in;
  a.h_out = h_out;
  a.dwx_t = dwx_t;
  a.state = state;
  a.out_t = out_t;
  a.lengths = lengths;
  a.t = t;
  a.h_bits = d.h_bits;
  dispatch(d, [&](auto kernel) { kernel<<<(unsigned)s.ctas, kFsThreads, 0, stream>>>(d.cell, s, a); });
  check(cudaGetLastError(), "fused_step_kernel launch");
}

}  // namespace cuda
}  // namespace qgru
