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

// One step of CTA `cta` (both kernels' body): warp w takes fs_item(s, w, pass)'s n tile and k
// steps, its A fragments from a_regs(tile, kstep, w[4]) (R in global memory, or the persistent
// kernel's shared copy) and its B fragments from h_in by `operand`; the k_split partial
// accumulators of an n tile meet in `part` (shared memory), and the lane of its ks = 0 warp runs the
// cell of its two (unit, row) pairs, writing their limbs of the next operand into h_out.
template <bool POW2, bool ACC32, typename ARegs, typename Operand>
__device__ __forceinline__ void fused_step_body(const CellParams& cp, const FsShape& s, int64_t cta, int lane, int warp,
                                                int32_t (*part)[kFsTiles][4][32], ARegs&& a_regs, Operand&& operand,
                                                const int8_t* h_in, int8_t* h_out, const int32_t* dwx_t,
                                                int32_t* state, int16_t* out_t, const int64_t* lengths, int64_t t,
                                                int32_t h_bits) {
  for (int64_t pass = 0; pass < s.passes; ++pass) {
    const FsItem it = fs_item(s, warp, pass);
    int32_t acc[kFsTiles][4] = {};
    if (it.nt >= 0) {
#pragma unroll 2
      for (int64_t kstep = it.ks; kstep < s.k_steps; kstep += s.k_split) {
        uint32_t b[2], w[4];
        fs_load_b_words(h_in, s.K_pad, s.N, it.nt, kstep, lane, b, operand);
        QGRU_UNROLL
        for (int tile = 0; tile < kFsTiles; ++tile) {
          a_regs(tile, kstep, w);
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
      fs_pair_step<POW2, ACC32>(cp, s.K_pad, h_bits, t, lengths, u.j, u.n, acc[0], acc[1], p, dwx_t, state, out_t,
                                h_out);
    }
  }
}

// One step. CTA blockIdx.x owns units [8 c, 8 c + 8); its R rows are read from global memory.
template <bool POW2, bool ACC32>
__global__ void __launch_bounds__(kFsThreads) fused_step_kernel(CellParams cp, FsShape s, FsArgs a) {
  __shared__ int32_t part[kFsWarps][kFsTiles][4][32];  // [warp][tile][register][lane]: no bank conflict
  const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
  const int64_t cta = blockIdx.x;
  const auto weight = [](const int8_t* p) { return (uint32_t)__ldg((const unsigned int*)p); };  // read-only
  const auto operand = [](const int8_t* p) { return *(const uint32_t*)p; };  // the previous launch's writes
  fused_step_body<POW2, ACC32>(
      cp, s, cta, lane, warp, part,
      [&](int tile, int64_t kstep, uint32_t w[4]) { fs_load_a_words(a.R, s.K_pad, s.H, cta, tile, kstep, lane, w, weight); },
      operand, a.h_in, a.h_out, a.dwx_t, a.state, a.out_t, a.lengths, a.t, a.h_bits);
}

// ---- the persistent fused step (qgru_fused_step.h "the persistent fused step": the protocol) ----
struct FpArgs {
  const int8_t* R;         // [M_pad, K_pad] R's int8 weight limbs
  int8_t* h_buf[2];        // [N_pad, K_pad] each: the operand's double buffer (h_t in h_buf[t % 2])
  const int32_t* dwx;      // [(t1 - t0) N, 3H] Wx - Z_Wx of the window's steps
  int32_t* state;          // [N, H]
  int16_t* out;            // [T, N, H] the call's output (step t at out + t N H)
  const int64_t* lengths;  // [N] or nullptr
  uint32_t* flags;         // [fp_flag_words(ctas)] zeroed before the call's first launch
  int64_t t0, t1;
  int32_t h_bits;
  FpLayout L;
};

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Steps [t0, t1) in one cooperative launch of s.ctas CTAs: the R rows copied into shared memory
// once, then per step the flag wait, fused_step_body on the shared rows, and the flag's release.
template <bool POW2, bool ACC32>
__global__ void __launch_bounds__(kFsThreads) fused_persistent_kernel(CellParams cp, FsShape s, FpArgs a) {
  extern __shared__ __align__(16) unsigned char fp_smem[];
  const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
  const int64_t cta = blockIdx.x, H = s.H, N = s.N;
  const FpLayout L = a.L;
  uint32_t* rows = reinterpret_cast<uint32_t*>(fp_smem);
  for (int w = (int)threadIdx.x; w < (int)L.r_words; w += kFsThreads) {
    const int64_t src = fp_stage_source(L, H, s.K_pad, cta, w);
    rows[w] = src >= 0 ? (uint32_t)__ldg((const unsigned int*)(a.R + src)) : 0u;
  }
  auto part = reinterpret_cast<int32_t(*)[kFsTiles][4][32]>(fp_smem + L.part_offset);
  __syncthreads();
  const auto operand = [](const int8_t* p) { return (uint32_t)__ldcg((const unsigned int*)p); };  // L2: other SMs'
  const auto a_regs = [&](int tile, int64_t kstep, uint32_t w[4]) {
    fs_load_a_regs(s.K_pad, H, cta, tile, kstep, lane, w, [&](int tl, int m, int64_t, int64_t k) {
      return *reinterpret_cast<const uint32_t*>(fp_smem + fp_r_offset(L, tl, m, k));
    });
  };
  for (int64_t t = a.t0; t < a.t1; ++t) {
    for (int c = (int)threadIdx.x; c < (int)s.ctas; c += kFsThreads) {  // every CTA's h_t slice is there
      const uint32_t* f = a.flags + fp_flag_index(c);
      while (!fp_flag_ready(ld_acquire_gpu(f), t)) {
      }
    }
    __syncthreads();
    // (a select, not an index into the parameter array: that would copy it to local memory)
    const int8_t* h_in = fp_in_parity(t) == 0 ? a.h_buf[0] : a.h_buf[1];
    int8_t* h_out = fp_out_parity(t) == 0 ? a.h_buf[0] : a.h_buf[1];
    fused_step_body<POW2, ACC32>(cp, s, cta, lane, warp, part, a_regs, operand, h_in, h_out,
                                 a.dwx + (t - a.t0) * N * 3 * H, a.state, a.out + t * N * H, a.lengths, t, a.h_bits);
    __syncthreads();  // the CTA's stores of h_{t+1} before its flag
    if (threadIdx.x == 0) {
      __threadfence();
      st_release_gpu(a.flags + fp_flag_index(cta), fp_flag_after(t));
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

template <typename F>
void dispatch_persistent(const LayerDesc& d, F&& f) {
  if (d.pow2) {
    d.acc32 ? f(fused_persistent_kernel<true, true>) : f(fused_persistent_kernel<true, false>);
  } else {
    d.acc32 ? f(fused_persistent_kernel<false, true>) : f(fused_persistent_kernel<false, false>);
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

int fused_persistent_plan(const LayerDesc& d, int64_t N, int device, FpPlan* out) {
  *out = FpPlan{};
  if (!fused_supported(d, device)) return kFpNotFused;
  int sm = 0, smem = 0, coop = 0;
  check(cudaDeviceGetAttribute(&sm, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute (SMs)");
  check(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "cudaDeviceGetAttribute (shared memory)");
  check(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device), "cudaDeviceGetAttribute (cooperative)");
#if CUDART_VERSION < 12000
  coop = 0;  // the launch needs CUDA 12's cudaLaunchKernelEx and its cooperative attribute
#endif
  FpPlan p{};
  p.s = fs_shape(d.H, N, d.rh.K_pad, kFsWarps);
  p.L = fp_layout(d.rh.K_pad, kFsWarps);
  FpDevice dev{sm, smem, 0, coop != 0};
  if (coop && p.L.bytes <= smem) {
    // the kernel's dynamic shared memory bound: the device's whole opt-in amount, the same for every
    // plan (the attribute is the kernel's, not a launch's), then the blocks per SM at this layout
    int per_sm = 0;
    dispatch_persistent(d, [&](auto kernel) {
      check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
            "cudaFuncSetAttribute (fused persistent kernel shared memory)");
      check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kFsThreads, (size_t)p.L.bytes),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    });
    dev.blocks_per_sm = per_sm;
  }
  p.sm_count = sm;
  p.blocks_per_sm = dev.blocks_per_sm;
  const int rc = fp_fit(p.s, p.L, dev);
  if (rc == kFpFits) *out = p;
  return rc;
}

void fused_persistent_steps(const LayerDesc& d, const FpPlan& p, int8_t* const h_buf[2], const int32_t* dwx,
                            int32_t* state, int16_t* out, const int64_t* lengths, uint32_t* flags, int64_t t0,
                            int64_t t1, cudaStream_t stream) {
  if (p.s.ctas <= 0) throw std::runtime_error("qgru cuda: the persistent fused step has no plan");
  FpArgs a{};
  a.R = d.rh.weight_limbs;
  a.h_buf[0] = h_buf[0];
  a.h_buf[1] = h_buf[1];
  a.dwx = dwx;
  a.state = state;
  a.out = out;
  a.lengths = lengths;
  a.flags = flags;
  a.t0 = t0;
  a.t1 = t1;
  a.h_bits = d.h_bits;
  a.L = p.L;
#if CUDART_VERSION >= 12000
  dispatch_persistent(d, [&](auto kernel) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3((unsigned)p.s.ctas);
    cfg.blockDim = dim3(kFsThreads);
    cfg.dynamicSmemBytes = (size_t)p.L.bytes;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;  // co-resident CTAs, or a launch error (never a hang)
    attr[0].val.cooperative = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    check(cudaLaunchKernelEx(&cfg, kernel, d.cell, p.s, a), "fused_persistent_kernel launch");
  });
#else
  throw std::runtime_error("qgru cuda: the persistent fused step needs CUDA 12 (fused_persistent_plan never plans it)");
#endif
}

}  // namespace cuda
}  // namespace qgru
