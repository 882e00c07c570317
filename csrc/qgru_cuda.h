// qgru CUDA backend, torch-free part (haste's split): kernels, cuBLAS int8 GEMMs and the forward
// driver take plain structs of raw device pointers, a stream and a cuBLAS handle. The torch
// binding (qgru_cuda.cpp) owns the memory, picks the stream and the handle (PyTorch's, or its own
// with a workspace it owns for what it captures), and captures the forward in a CUDA graph. Errors are thrown as std::runtime_error with the failing call named.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "qgru_cell.h"
#include "qgru_cuda_launch.h"
#include "qgru_fused_step.h"
#include "qgru_persistent.h"

namespace qgru {
namespace cuda {

// kPad, kMinGemmDim and gemm_rows: qgru_cuda_launch.h

struct GemmDesc {              // one product (W.x or R.h) as int8 limb GEMMs
  const int8_t* weight_limbs;  // [n_weight_limbs, M_pad, K_pad], row-major, zero padded
  int64_t M_pad, K_pad;
  int P;                       // limb pairs (1, 2 or 4)
  int act_limb[kMaxPairs];     // which activation limb / weight limb each pair multiplies
  int weight_limb[kMaxPairs];
  int64_t scale[kMaxPairs];
  int64_t weight_offset[kMaxPairs];
};

struct LayerDesc {
  int64_t H, I;
  int32_t x_bits, h_bits;
  int64_t ones_col;
  bool pow2, acc32;
  GemmDesc wx, rh;
  // W.x's requantization: with x levels (x_levels > 0) every level's, [x_levels, 3H] flat
  // (qgru_cell.h at_level), else the static grid's
  int64_t x_levels;
  AccRequant acc_x;
  AccRequant32 acc_x32;
  CellParams cell;
};

// Device buffers for one forward of shape (T, N); sizes from workspace_sizes(). Limb buffers must
// be zeroed once at allocation (their padding is never written).
struct Workspace {
  int64_t window_steps;    // steps per window: W.x of a window's steps, then their recurrence
  int64_t chunk_rows;      // buffer rows of a window's x limbs and W.x GEMM (gemm_rows of its rows)
  int64_t N_pad;           // batch rows of the R.h GEMM (gemm_rows(N))
  // limb and product buffers each from one allocation, consecutive (one GEMM per product spans
  // them: run_gemms in qgru_cuda_kernels.cu checks the layout)
  int8_t* x_limbs[2];      // [chunk_rows, wx.K_pad]
  int32_t* Gx[kMaxPairs];  // [chunk_rows, M_pad]
  int8_t* h_limbs[2];      // [N_pad, rh.K_pad]
  int32_t* Gh[kMaxPairs];  // [N_pad, M_pad]
  int32_t* dwx;            // [window_steps * N, 3H]  Wx - Z_Wx of the current window's steps
  // The persistent recurrence (qgru_persistent.h, qgru_cuda_persistent.cu), where pk.blocks > 0:
  // each window's steps in one launch instead of one R.h GEMM and one cell kernel per step.
  PkPlan pk;
  int8_t* pk_h;            // [pk.h_buffer] the operand's double buffer, zeroed at allocation
  uint32_t* pk_counter;    // [1] the grid barrier's counter
  // The fused step (qgru_cuda_fused.cu), where true and pk.blocks == 0: one kernel per step instead
  // of one R.h GEMM and one cell kernel, the operand double-buffered in h_limbs[0] and h_limbs[1]
  // (a layer fused_supported accepts has one operand limb, so h_limbs[1] is free).
  bool fused;
  // The persistent fused step (qgru_cuda_fused.cu), where fused and fp.s.ctas > 0: each window's
  // steps in one launch, the operand in h_limbs[t % 2], the CTAs' step flags in fp_flags
  // ([fp_flag_words(fp.s.ctas)], zeroed by forward before the call's first launch).
  FpPlan fp;
  uint32_t* fp_flags;
};

struct WorkspaceSizes {    // element counts
  int64_t window_steps, chunk_rows, N_pad, x_limb, Gx, h_limb, Gh, dwx;
};

WorkspaceSizes workspace_sizes(const LayerDesc& d, int64_t T, int64_t N);

// out[t]: int16 [N, H]; state: int32 [N, H] (state holds q_h0 on entry and q_h_T on return).
// qx: int16 [T, N, I] on the device. Activations have at most 16 bits (LayerTensors::validate), so
// the T-sized buffers a plan keeps between calls are int16, half an int32 copy. lengths: int64 [N]
// or nullptr. level (a layer with x levels): int32 [T, N], each token's level (a value outside
// [0, x_levels) is clamped into it: the kernels never read outside the level arrays; the Layer
// takes levels from quantize_levels), else nullptr. Only kernel launches and cuBLAS calls on
// `stream`: safe to capture in a CUDA graph.
void forward(const LayerDesc& d, const Workspace& ws, const int16_t* qx, const int32_t* level, int64_t T, int64_t N,
             int32_t* state, int16_t* out, const int64_t* lengths, cudaStream_t stream, cublasHandle_t handle);

// The persistent recurrence (qgru_cuda_persistent.cu). persistent_plan: the plan of a layer for
// N batch rows on `device`, or why there is none (PkFit: the device, the shared memory, the
// occupancy of one block per SM); it sets the kernel's shared-memory attribute, outside any capture
// preferably. persistent_steps: steps [t_begin, t_end) of the window in args (one cooperative
// launch per pk_launch_steps steps), on `stream`; capturable in a CUDA graph.
PkShape persistent_shape(const LayerDesc& d, int64_t N);
int persistent_plan(const LayerDesc& d, int64_t N, int device, PkPlan* out);
void persistent_steps(const LayerDesc& d, const PkPlan& p, const PkArgs& args, int64_t t_begin, int64_t t_end,
                      cudaStream_t stream);

// The fused step (qgru_cuda_fused.cu). fused_supported: whether a layer can take it on `device`
// (one R.h limb pair: 8-bit weights and operand; compute capability 8.0 or newer). fused_step: step
// t of the recurrence in one launch on `stream`, R.h from the operand limbs h_in [N_pad, K_pad], the
// cell, and the next step's limbs into h_out (another buffer); capturable in a CUDA graph.
bool fused_supported(const LayerDesc& d, int device);
// The persistent fused step (qgru_cuda_fused.cu, qgru_fused_step.h fp_*). fused_persistent_plan: the
// plan of a layer for N batch rows on `device`, or why there is none (FpFit: the layer, cooperative
// launch, shared memory, co-residency by the occupancy API); it sets the kernel's shared-memory
// attribute, outside any capture. fused_persistent_steps: steps [t0, t1) of a window in one
// cooperative launch on `stream` (dwx: the window's Wx - Z_Wx, out: the call's [T, N, H]);
// capturable in a CUDA graph.
int fused_persistent_plan(const LayerDesc& d, int64_t N, int device, FpPlan* out);
void fused_persistent_steps(const LayerDesc& d, const FpPlan& p, int8_t* const h_buf[2], const int32_t* dwx,
                            int32_t* state, int16_t* out, const int64_t* lengths, uint32_t* flags, int64_t t0,
                            int64_t t1, cudaStream_t stream);
void fused_step(const LayerDesc& d, const int8_t* h_in, int8_t* h_out, const int32_t* dwx_t, int32_t* state,
                int16_t* out_t, const int64_t* lengths, int64_t t, int64_t N, cudaStream_t stream);

// The float boundary (primitives.quantize / dequantize) and the layer-to-layer requantization,
// one pass each on `stream`. quantize: x [n] float32 or float64 -> q [n] int32 or int16 on the grid
// (scale, zp, bits); a NaN x takes the value 0.0 takes, and nan_bit is ORed into *nan_flag (a
// device int32; nullptr: not recorded). dequantize: q [n] int32 or int16 -> out float32.
// requantize (golden.requantize_input, per-tensor factor): int16 q [n] on one h grid -> int16 out
// on the next layer's x grid. Instantiated in qgru_cuda_kernels.cu for these types only.
template <typename X, typename Q>
void quantize(const X* x, Q* q, int64_t n, double scale, int64_t zp, int32_t bits, int32_t* nan_flag, int32_t nan_bit,
              cudaStream_t stream);
// golden.quantize_levels: x [tokens, I] float32 or float64 -> q [tokens, I] int32 or int16 and
// level [tokens] int32, one warp per token (its minimum and maximum, select_level, quantize on that
// level's grid). A token holding a NaN takes the last level, its NaN the value 0.0 takes, and sets
// nan_bit in *nan_flag (as quantize).
template <typename X, typename Q>
void quantize_levels(const X* x, Q* q, int32_t* level, int64_t tokens, int64_t I, const XLevelGrid& g, int64_t zp,
                     int32_t bits, int32_t* nan_flag, int32_t nan_bit, cudaStream_t stream);
template <typename Q>
void dequantize(const Q* q, float* out, int64_t n, double scale, int64_t zp, cudaStream_t stream);
void requantize(const int16_t* q, int16_t* out, int64_t n, int64_t from_zp, int64_t mult, int32_t shift, int64_t to_zp,
                int32_t to_bits, cudaStream_t stream);

}  // namespace cuda
}  // namespace qgru
