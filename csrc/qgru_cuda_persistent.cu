// The persistent recurrence of the CUDA backend (issue 34): one cooperative launch runs a window's
// steps, each block keeping its rows of R in shared memory for the whole launch, with a grid
// barrier between steps. The plan and every phase of a block's step are qgru_persistent.h's (the
// tests run them on the host against the golden model); this file is their thread-strided loops,
// the barrier and the launch. Run on an H200 (2026-11-28): bit-exact, and slower than the per-step
// path at every benchmark shape but one (H=512 T=1000 B=1, across two runs), so off by default (docs/design.md, "persistent recurrence"). The
// grid barrier needs every block resident at once: the kernel is only launched cooperatively.
#include <stdexcept>
#include <string>

#include "qgru_cuda.h"
#include "qgru_persistent.h"

namespace qgru {
namespace cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("qgru cuda: ") + what + ": " + cudaGetErrorString(e));
}

// The grid barrier after launch-local step s (pk_barrier_target): thread 0 of each block
// publishes the block's writes (fence), arrives, and waits until every block has arrived; the
// fence after the wait orders the block's later reads after the others' writes. The operand is then
// read with ld.global.cg (L2, never a stale L1 line: pk_stage_h's loader below).
__device__ __forceinline__ void grid_barrier(uint32_t* counter, uint32_t target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    while (*(volatile uint32_t*)counter < target) {
#if __CUDA_ARCH__ >= 700
      __nanosleep(20);
#endif
    }
    __threadfence();
  }
  __syncthreads();
}

template <int NP, bool POW2, bool ACC32>
__global__ void __launch_bounds__(kPkThreads) persistent_kernel(CellParams c, PkPlan p, PkArgs a, int64_t t_begin,
                                                                int64_t t_end) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t b = blockIdx.x;
  for (int64_t w = threadIdx.x; w < pk_r_words(p); w += blockDim.x) pk_stage_r(p, a, smem, b, w);
  __syncthreads();
  const auto load = [](const int8_t* q) { return (uint32_t)__ldcg((const unsigned int*)q); };
  for (int64_t t = t_begin; t < t_end; ++t) {
    for (int64_t tile = 0; tile < p.tiles; ++tile) {
      const int64_t row0 = tile * p.rows_tile;
      for (int64_t w = threadIdx.x; w < pk_h_words(p); w += blockDim.x) pk_stage_h(p, a, smem, t, row0, w, load);
      __syncthreads();
      for (int64_t o = threadIdx.x; o < pk_products(p); o += blockDim.x) pk_product(p, a, smem, o);
      __syncthreads();
      for (int64_t e = threadIdx.x; e < pk_cells(p); e += blockDim.x)
        pk_cell<NP, POW2, ACC32>(c, p, a, smem, b, t, row0, e);
      __syncthreads();
    }
    if (t + 1 < t_end) grid_barrier(a.counter, pk_barrier_target(t - t_begin, p.blocks));
  }
}

template <typename F>
void dispatch(const LayerDesc& d, F&& f) {
  dispatch_kernel(d.rh.P, d.pow2, d.acc32, [&](auto np, auto pow2, auto acc32) {
    f(persistent_kernel<decltype(np)::value, decltype(pow2)::value, decltype(acc32)::value>);
  });
}

}  // namespace

PkShape persistent_shape(const LayerDesc& d, int64_t N) {
  PkShape s{};
  s.H = d.H, s.N = N, s.K_pad = d.rh.K_pad, s.M_pad = d.rh.M_pad;
  s.n_act = d.h_bits > 8 ? 2 : 1;
  s.P = d.rh.P;
  s.n_w = 1;
  s.ones = false;
  for (int q = 0; q < d.rh.P; ++q) {
    s.n_w = d.rh.weight_limb[q] + 1 > s.n_w ? d.rh.weight_limb[q] + 1 : s.n_w;
    s.ones = s.ones || d.rh.weight_offset[q] != 0;
  }
  s.ones_col = d.ones_col;
  return s;
}

int persistent_plan(const LayerDesc& d, int64_t N, int device, PkPlan* out) {
  int sm = 0, smem = 0;
  check(cudaDeviceGetAttribute(&sm, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute (SMs)");
  check(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "cudaDeviceGetAttribute (shared memory)");
  int coop = 0;
  check(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device), "cudaDeviceGetAttribute (cooperative)");
#if CUDART_VERSION < 12000
  coop = 0;  // the launch below needs CUDA 12's cudaLaunchKernelEx and its cooperative attribute
#endif
  if (!coop) return kPkNoDevice;
  PkPlan p{};
  const int rc = pk_plan(persistent_shape(d, N), PkDevice{sm, smem}, &p);
  if (rc != kPkFits) return rc;
  // The kernel's dynamic shared memory: the device's whole opt-in amount, the same for every plan
  // (the attribute belongs to the kernel, not to a launch: a plan's own size would lower the bound
  // under another plan of the same kernel). Then whether one block per SM is co-resident
  // (registers, shared memory): the cooperative launch would refuse a grid that is not.
  int per_sm = 0;
  dispatch(d, [&](auto kernel) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
          "cudaFuncSetAttribute (persistent kernel shared memory)");
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kPkThreads, (size_t)p.smem_bytes),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  });
  if ((int64_t)per_sm * sm < p.blocks) return kPkNoRoom;
  *out = p;
  return kPkFits;
}

void persistent_steps(const LayerDesc& d, const PkPlan& p, const PkArgs& args, int64_t t_begin, int64_t t_end,
                      cudaStream_t stream) {
  // at most pk_launch_steps steps per launch, each launch's barrier counter from 0
  for (int64_t s0 = t_begin; s0 < t_end; s0 += pk_launch_steps(p.blocks)) {
    const int64_t s1 = t_end - s0 < pk_launch_steps(p.blocks) ? t_end : s0 + pk_launch_steps(p.blocks);
    check(cudaMemsetAsync(args.counter, 0, sizeof(uint32_t), stream), "cudaMemsetAsync (barrier counter)");
#if CUDART_VERSION >= 12000
    dispatch(d, [&](auto kernel) {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3((unsigned)p.blocks);
      cfg.blockDim = dim3(kPkThreads);
      cfg.dynamicSmemBytes = (size_t)p.smem_bytes;
      cfg.stream = stream;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeCooperative;  // co-resident blocks, or a launch error (never a hang)
      attr[0].val.cooperative = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      check(cudaLaunchKernelEx(&cfg, kernel, d.cell, p, args, s0, s1), "persistent_kernel launch");
    });
#else
    throw std::runtime_error("qgru cuda: the persistent recurrence needs CUDA 12 (persistent_plan never plans it)");
#endif
  }
}

}  // namespace cuda
}  // namespace qgru
