// The weight-only CPU kernel (qgru/weight_only/cpu.py builds it with torch.utils.cpp_extension.load_inline,
// -O3 -march=native -fopenmp, into ~/.cache/qgru/wo-<hash>; the hash covers this file's text).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "qgru_check.h"  // QGRU_CHECK: messages whose numbers are formatted without iostreams

namespace {

// y[m, n] = sum_g scale[g, n] * (sum_{k in g} code[n, k] * x[m, k] - zp[g, n] * xsum[m, g]), n in [n0, n0 + NB).
// NB output rows at once: their codes are read as NB consecutive words of a word row, unpacked in
// registers, and their accumulators stay in registers through a group. Code i of a word is not
// shifted down: (word & (MASK << BITS*i)) is code * 2^(BITS*i) exactly (at most BITS significant
// bits), and xs holds x * 2^-(BITS*i) (exact: a power of two), so each weight costs an and, a
// conversion and a fused multiply-add; the top code of a word is (word >> BITS*i) instead.
template <int BITS, int NB>
inline void mm_block(const float* xs, const float* xsum, int64_t M, int64_t K, const uint32_t* codes,
                     const float* scale, const uint8_t* zp, int64_t N, int64_t group, float* y, int64_t ldy,
                     int64_t n0) {
  constexpr int PER = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const int64_t J = (K + PER - 1) / PER;
  const int64_t G = (K + group - 1) / group;
  const int64_t wpg = group / PER;  // word rows per group (group is a multiple of PER)
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = xs + m * J * PER;
    float out[NB];
    for (int l = 0; l < NB; ++l) out[l] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      float acc[NB];
      for (int l = 0; l < NB; ++l) acc[l] = 0.f;
      const int64_t j1 = std::min(J, (g + 1) * wpg);
      for (int64_t j = g * wpg; j < j1; ++j) {
        const uint32_t* w = codes + j * N + n0;
        const float* xj = xm + j * PER;  // zero past K
        for (int i = 0; i < PER - 1; ++i) {
          const float xv = xj[i];
          const uint32_t mask = MASK << (BITS * i);
          for (int l = 0; l < NB; ++l) acc[l] += (float)(int32_t)(w[l] & mask) * xv;
        }
        const float xv = xj[PER - 1];
        for (int l = 0; l < NB; ++l) acc[l] += (float)(int32_t)(w[l] >> (32 - BITS)) * xv;
      }
      const float xg = xsum[m * G + g];
      const float* s = scale + g * N + n0;
      const uint8_t* z = zp + g * N + n0;
      for (int l = 0; l < NB; ++l) out[l] += s[l] * (acc[l] - (float)z[l] * xg);
    }
    for (int l = 0; l < NB; ++l) y[m * ldy + n0 + l] = out[l];
  }
}

#if defined(__AVX512F__)
#include <immintrin.h>
// The same block as mm_block<BITS, 64> in AVX-512 intrinsics: 4 vectors of 16 output rows.
template <int BITS>
inline void mm_block_simd(const float* xs, const float* xsum, int64_t M, int64_t K, const uint32_t* codes,
                          const float* scale, const uint8_t* zp, int64_t N, int64_t group, float* y, int64_t ldy,
                          int64_t n0) {
  constexpr int PER = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const int64_t J = (K + PER - 1) / PER;
  const int64_t G = (K + group - 1) / group;
  const int64_t wpg = group / PER;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = xs + m * J * PER;
    __m512 out[4];
    for (int v = 0; v < 4; ++v) out[v] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[4];
      for (int v = 0; v < 4; ++v) acc[v] = _mm512_setzero_ps();
      const int64_t j1 = std::min(J, (g + 1) * wpg);
      for (int64_t j = g * wpg; j < j1; ++j) {
        const uint32_t* w = codes + j * N + n0;
        __m512i wv[4];
        for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_si512(w + 16 * v);
        const float* xj = xm + j * PER;
#pragma GCC unroll 16
        for (int i = 0; i < PER - 1; ++i) {
          const __m512 xv = _mm512_set1_ps(xj[i]);
          const __m512i mk = _mm512_set1_epi32((int)(MASK << (BITS * i)));
          for (int v = 0; v < 4; ++v)
            acc[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(wv[v], mk)), xv, acc[v]);
        }
        const __m512 xv = _mm512_set1_ps(xj[PER - 1]);
        for (int v = 0; v < 4; ++v)
          acc[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(wv[v], 32 - BITS)), xv, acc[v]);
      }
      const __m512 xg = _mm512_set1_ps(xsum[m * G + g]);
      for (int v = 0; v < 4; ++v) {
        const __m512 s = _mm512_loadu_ps(scale + g * N + n0 + 16 * v);
        const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(zp + g * N + n0 + 16 * v))));
        out[v] = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(z, xg, acc[v]), out[v]);
      }
    }
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(y + m * ldy + n0 + 16 * v, out[v]);
  }
}
constexpr int SIMD_NB = 64;
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// The same block as mm_block<BITS, 32> in AVX2 intrinsics: 4 vectors of 8 output rows.
template <int BITS>
inline void mm_block_simd(const float* xs, const float* xsum, int64_t M, int64_t K, const uint32_t* codes,
                          const float* scale, const uint8_t* zp, int64_t N, int64_t group, float* y, int64_t ldy,
                          int64_t n0) {
  constexpr int PER = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const int64_t J = (K + PER - 1) / PER;
  const int64_t G = (K + group - 1) / group;
  const int64_t wpg = group / PER;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = xs + m * J * PER;
    __m256 out[4];
    for (int v = 0; v < 4; ++v) out[v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc[4];
      for (int v = 0; v < 4; ++v) acc[v] = _mm256_setzero_ps();
      const int64_t j1 = std::min(J, (g + 1) * wpg);
      for (int64_t j = g * wpg; j < j1; ++j) {
        const uint32_t* w = codes + j * N + n0;
        __m256i wv[4];
        for (int v = 0; v < 4; ++v) wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * v));
        const float* xj = xm + j * PER;
#pragma GCC unroll 16
        for (int i = 0; i < PER - 1; ++i) {
          const __m256 xv = _mm256_set1_ps(xj[i]);
          const __m256i mk = _mm256_set1_epi32((int)(MASK << (BITS * i)));
          for (int v = 0; v < 4; ++v)
            acc[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(wv[v], mk)), xv, acc[v]);
        }
        const __m256 xv = _mm256_set1_ps(xj[PER - 1]);
        for (int v = 0; v < 4; ++v)
          acc[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(wv[v], 32 - BITS)), xv, acc[v]);
      }
      const __m256 xg = _mm256_set1_ps(xsum[m * G + g]);
      for (int v = 0; v < 4; ++v) {
        const __m256 s = _mm256_loadu_ps(scale + g * N + n0 + 8 * v);
        const __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zp + g * N + n0 + 8 * v))));
        out[v] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, xg, acc[v]), out[v]);
      }
    }
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + m * ldy + n0 + 8 * v, out[v]);
  }
}
constexpr int SIMD_NB = 32;
#else
template <int BITS>
inline void mm_block_simd(const float* xs, const float* xsum, int64_t M, int64_t K, const uint32_t* codes,
                          const float* scale, const uint8_t* zp, int64_t N, int64_t group, float* y, int64_t ldy,
                          int64_t n0) {
  mm_block<BITS, 32>(xs, xsum, M, K, codes, scale, zp, N, group, y, ldy, n0);
}
constexpr int SIMD_NB = 32;
#endif

// output rows [b0 * SIMD_NB, b1 * SIMD_NB) (clipped to N): whole blocks by the vector code, the rest one by one
template <int BITS>
void mm_rows(const float* xs, const float* xsum, int64_t M, int64_t K, const uint32_t* codes, const float* scale,
             const uint8_t* zp, int64_t N, int64_t group, float* y, int64_t ldy, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * SIMD_NB;
    if (n0 + SIMD_NB <= N) {
      mm_block_simd<BITS>(xs, xsum, M, K, codes, scale, zp, N, group, y, ldy, n0);
    } else {
      for (int64_t n = n0; n < N; ++n) mm_block<BITS, 1>(xs, xsum, M, K, codes, scale, zp, N, group, y, ldy, n);
    }
  }
}

void mm_dispatch(const float* x, int64_t M, int64_t K, const uint32_t* codes, const float* scale,
                 const uint8_t* zp, int64_t N, int64_t group, int64_t bits, float* y, int64_t ldy) {
  const int64_t per = 32 / bits;
  const int64_t J = (K + per - 1) / per, G = (K + group - 1) / group;
  // x scaled per slot of its word (x * 2^-(bits * i), the top slot unscaled), zero-padded to J words;
  // and its sum over each group (the zero points' term)
  std::vector<float> xs(M * J * per, 0.f), xsum(M * G, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = k % per;
      const float v = x[m * K + k];
      xs[m * J * per + k] = i == per - 1 ? v : std::ldexp(v, -(int)(bits * i));
      xsum[m * G + k / group] += v;
    }
  }
  const int64_t blocks = (N + SIMD_NB - 1) / SIMD_NB;  // mm_rows' blocks of output rows
  auto body = [&](int64_t b0, int64_t b1) {
    if (bits == 2) mm_rows<2>(xs.data(), xsum.data(), M, K, codes, scale, zp, N, group, y, ldy, b0, b1);
    else if (bits == 4) mm_rows<4>(xs.data(), xsum.data(), M, K, codes, scale, zp, N, group, y, ldy, b0, b1);
    else mm_rows<8>(xs.data(), xsum.data(), M, K, codes, scale, zp, N, group, y, ldy, b0, b1);
  };
  // threads only for large products: a streaming step (one GEMV) is tens of microseconds, where a
  // thread barrier on a busy machine can cost a scheduler quantum
  if (N * K * std::max<int64_t>(M, 1) < (1 << 22)) body(0, blocks);
  else at::parallel_for(0, blocks, 2, body);
}

void check(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
           const torch::Tensor& zp, int64_t bits, int64_t group, int64_t K) {
  QGRU_CHECK(bits == 2 || bits == 4 || bits == 8, "wo_mm: bits must be 2, 4 or 8");
  const int64_t per = 32 / bits;
  QGRU_CHECK(group > 0 && group % per == 0, "wo_mm: group must be a positive multiple of ", per);
  QGRU_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "wo_mm: x must be a contiguous float32 CPU matrix");
  QGRU_CHECK(x.size(1) == K, "wo_mm: x has ", x.size(1), " columns, the weight ", K, " inputs");
  const int64_t N = codes.size(1);
  QGRU_CHECK(codes.scalar_type() == torch::kInt32 && codes.dim() == 2 && codes.is_contiguous() &&
              codes.size(0) == (K + per - 1) / per, "wo_mm: codes must be contiguous int32 [ceil(K/per), N]");
  const int64_t G = (K + group - 1) / group;
  QGRU_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 2 &&
              scale.size(0) == G && scale.size(1) == N, "wo_mm: scale must be contiguous float32 [G, N]");
  QGRU_CHECK(zp.scalar_type() == torch::kUInt8 && zp.is_contiguous() && zp.dim() == 2 &&
              zp.size(0) == G && zp.size(1) == N, "wo_mm: zp must be contiguous uint8 [G, N]");
}

torch::Tensor wo_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, torch::Tensor zp,
                    int64_t bits, int64_t group, int64_t K) {
  check(x, codes, scale, zp, bits, group, K);
  const int64_t M = x.size(0), N = codes.size(1);
  auto y = torch::empty({M, N}, x.options());
  mm_dispatch(x.data_ptr<float>(), M, K, reinterpret_cast<const uint32_t*>(codes.data_ptr<int32_t>()),
              scale.data_ptr<float>(), zp.data_ptr<uint8_t>(), N, group, bits, y.data_ptr<float>(), N);
  return y;
}

inline float sigmoidf_(float v) { return 1.f / (1.f + std::exp(-v)); }

std::vector<torch::Tensor> wo_gru_direction(torch::Tensor gi, torch::Tensor h0, torch::Tensor codes,
                                            torch::Tensor scale, torch::Tensor zp, int64_t bits,
                                            int64_t group, torch::Tensor b_hh, torch::Tensor lengths,
                                            bool reverse) {
  QGRU_CHECK(gi.dim() == 3 && gi.is_contiguous() && gi.scalar_type() == torch::kFloat32 && gi.device().is_cpu(),
              "wo_gru_direction: gi must be contiguous float32 [T, B, 3H] on the CPU");
  const int64_t T = gi.size(0), B = gi.size(1), H = h0.size(1);
  QGRU_CHECK(gi.size(2) == 3 * H && h0.dim() == 2 && h0.size(0) == B && h0.is_contiguous() &&
              h0.scalar_type() == torch::kFloat32, "wo_gru_direction: h0 must be contiguous float32 [B, H]");
  check(h0, codes, scale, zp, bits, group, H);
  QGRU_CHECK(codes.size(1) == 3 * H, "wo_gru_direction: R has ", codes.size(1), " rows, expected 3H");
  const bool has_b = b_hh.numel() > 0;
  QGRU_CHECK(!has_b || (b_hh.scalar_type() == torch::kFloat32 && b_hh.is_contiguous() && b_hh.numel() == 3 * H),
              "wo_gru_direction: b_hh must be contiguous float32 [3H] or empty");
  const bool has_len = lengths.numel() > 0;
  QGRU_CHECK(!has_len || (lengths.scalar_type() == torch::kInt64 && lengths.numel() == B && lengths.is_contiguous()),
              "wo_gru_direction: lengths must be contiguous int64 [B] or empty");
  const int64_t* len = has_len ? lengths.data_ptr<int64_t>() : nullptr;
  auto out = torch::empty({T, B, H}, gi.options());
  auto h = h0.clone();
  std::vector<float> gh(B * 3 * H);
  const uint32_t* c = reinterpret_cast<const uint32_t*>(codes.data_ptr<int32_t>());
  const float* bh = has_b ? b_hh.data_ptr<float>() : nullptr;
  float* hp = h.data_ptr<float>();
  for (int64_t s = 0; s < T; ++s) {
    const int64_t t = reverse ? T - 1 - s : s;
    mm_dispatch(hp, B, H, c, scale.data_ptr<float>(), zp.data_ptr<uint8_t>(), 3 * H, group, bits, gh.data(), 3 * H);
    const float* g = gi.data_ptr<float>() + t * B * 3 * H;
    float* o = out.data_ptr<float>() + t * B * H;
    for (int64_t b = 0; b < B; ++b) {
      if (has_len && t >= len[b]) {  // padding of a shorter sequence: state kept, output 0
        std::fill(o + b * H, o + (b + 1) * H, 0.f);
        continue;
      }
      const float* gib = g + b * 3 * H;
      const float* ghb = gh.data() + b * 3 * H;
      for (int64_t j = 0; j < H; ++j) {
        const float hr = ghb[j] + (has_b ? bh[j] : 0.f);
        const float hz = ghb[H + j] + (has_b ? bh[H + j] : 0.f);
        const float hn = ghb[2 * H + j] + (has_b ? bh[2 * H + j] : 0.f);
        const float r = sigmoidf_(gib[j] + hr);
        const float z = sigmoidf_(gib[H + j] + hz);
        const float n = std::tanh(gib[2 * H + j] + r * hn);
        const float hv = (1.f - z) * n + z * hp[b * H + j];
        o[b * H + j] = hv;
      }
      std::copy(o + b * H, o + (b + 1) * H, hp + b * H);
    }
  }
  return {out, h};
}

// One layer direction from its input: gi = W.x + b_ih for all T * B rows at once, then the time loop.
std::vector<torch::Tensor> wo_gru_layer(torch::Tensor x, torch::Tensor w_codes, torch::Tensor w_scale,
                                        torch::Tensor w_zp, int64_t w_group, torch::Tensor b_ih, torch::Tensor h0,
                                        torch::Tensor r_codes, torch::Tensor r_scale, torch::Tensor r_zp,
                                        int64_t r_group, torch::Tensor b_hh, torch::Tensor lengths, int64_t bits,
                                        bool reverse) {
  QGRU_CHECK(x.dim() == 3, "wo_gru_layer: x must be [T, B, K]");
  const int64_t T = x.size(0), B = x.size(1), K = x.size(2), N = w_codes.size(1);
  auto gi = wo_mm(x.reshape({T * B, K}), w_codes, w_scale, w_zp, bits, w_group, K);
  if (b_ih.numel() > 0) {
    QGRU_CHECK(b_ih.scalar_type() == torch::kFloat32 && b_ih.is_contiguous() && b_ih.numel() == N,
                "wo_gru_layer: b_ih must be contiguous float32 [3H] or empty");
    float* g = gi.data_ptr<float>();
    const float* b = b_ih.data_ptr<float>();
    for (int64_t r = 0; r < T * B; ++r)
      for (int64_t n = 0; n < N; ++n) g[r * N + n] += b[n];
  }
  return wo_gru_direction(gi.view({T, B, N}), h0, r_codes, r_scale, r_zp, bits, r_group, b_hh, lengths, reverse);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("wo_mm", &wo_mm, "x [M, K] float32 times packed weights -> [M, N]");
  m.def("wo_gru_direction", &wo_gru_direction, "one GRU layer direction over T steps");
  m.def("wo_gru_layer", &wo_gru_layer, "one GRU layer direction from its input");
}
