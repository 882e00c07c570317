// Launch shapes of the CUDA backend's element-wise kernels (qgru_cuda_kernels.cu). Host code
// without CUDA headers, so that tests/test_cuda_compile.py can compile it with the host compiler
// and check, for many shapes, that the kernels' index loops visit every element exactly once.
#pragma once

#include <cstdint>

namespace qgru {
namespace cuda {

constexpr int kThreads = 256;  // threads per block

// A [rows, cols] array: x (threads and blocks) along the columns, which cover cols exactly once,
// y along the rows, with a grid-stride loop over them. Each kernel thread takes
//   column c = blockIdx.x * blockDim.x + threadIdx.x (and returns if c >= cols),
//   rows r = blockIdx.y * blockDim.y + threadIdx.y, r += gridDim.y * blockDim.y while r < rows,
// so that an element's (row, column) comes from the thread's coordinates, with no 64-bit `/` or
// `%` per element (a 64-bit division is a long instruction sequence on the GPU). Narrow arrays get
// narrow, taller blocks (block_x a power of two from 32 to kThreads, block_x * block_y = kThreads).
// cols is a channel or input count (< 3 * 2^17, LayerTensors::validate), far below grid x's limit.
struct Launch2DShape {
  int64_t grid_x, grid_y, block_x, block_y;
};

inline Launch2DShape launch_2d_shape(int64_t rows, int64_t cols) {
  if (cols < 1) cols = 1;
  int64_t bx = 32;  // the smallest power of two >= cols, from a warp to kThreads: it divides kThreads
  while (bx < cols && bx < kThreads) bx *= 2;
  const int64_t by = kThreads / bx;
  const int64_t gx = (cols + bx - 1) / bx;
  int64_t gy = (rows + by - 1) / by;
  gy = gy < 1 ? 1 : (gy > 65535 ? 65535 : gy);  // gridDim.y's limit; the row loop covers the rest
  return {gx, gy, bx, by};
}

}  // namespace cuda
}  // namespace qgru
