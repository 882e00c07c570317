// qgru C++ CPU backend: one layer and direction of the integer GRU, bit-exact with qgru/golden.py.
//
// GEMMs: int8 x int8 -> int32, one per limb pair (qgru_cell.h), on AMX tiles with weights packed
// once (qgru_amx.h) where the CPU and the kernel allow it, else through ATen's _int_mm (oneDNN)
// and, for a few rows, a VNNI dot loop. Pointwise: the shared cell functions of qgru_cell.h,
// parallel with at::parallel_for, inner loop over channels written for the compiler to vectorise.
// With AMX and one limb pair on both GEMMs (x, h, W and R of at most 8 bits) each step is one
// fused pass: a task computes the three gates' W.x and R.h tiles for kFusedWidth hidden units and
// 16 batch rows and runs the cell on them while they are in cache; no W.x is written out (below
// 16 batch rows, where a W.x tile would be mostly padding, W.x is one GEMM per chunk of steps).
// The steps of a chunk share one parallel region; threads wait between steps on a count of
// finished tasks (StepCounters).
// Large per-call buffers (the layer's output, the quantized input) reuse their memory from call
// to call once the caller has dropped the previous result (reuse_or_empty).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <atomic>
#include <mutex>
#include <thread>
#include <cmath>
#include <type_traits>
#include <vector>

#include "qgru_amx.h"
#include "qgru_layer.h"

#ifdef QGRU_PROFILE
#include <chrono>
#include <cstdio>
#define QGRU_TIC(name) auto name = std::chrono::steady_clock::now()
#define QGRU_TOC(acc, since) acc += std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count()
#else
#define QGRU_TIC(name)
#define QGRU_TOC(acc, since)
#endif

namespace qgru {
namespace {
#ifdef QGRU_PROFILE
double prof_in_gemm = 0, prof_in_epi = 0, prof_h_gemm = 0, prof_cell = 0;
#endif

// The fused path's per-step task counters: the next task to hand out and the tasks finished
// (separate cache lines: every thread bumps both).
struct StepCounters {
  alignas(64) std::atomic<int64_t> next{0};
  alignas(64) std::atomic<int64_t> done{0};

  // Until all n tasks are done: spin briefly (the usual wait is the tail of another thread's last
  // task, a few microseconds), then yield, so that more threads than cores still make progress.
  void wait_all(int64_t n) const {
    for (int spins = 0; done.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < kSpinsBeforeYield) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }
  static constexpr int kSpinsBeforeYield = 256;  // 256 pauses: ~1-20 us, by the CPU's pause latency
};

constexpr int64_t kInputChunkRows = 1024;  // rows of W.x per GEMM: measured fastest on oneDNN here
constexpr int64_t kFusedWidth = kCell32Block;  // hidden units per fused task (128): measured best of 16, 64, 128, 256 (H = 512)
constexpr int64_t kAmxChunkBytes = 1 << 20;  // W.x output per chunk on AMX: stays in L2 for its epilogue
constexpr int64_t kFusedChunkBytes = 1 << 17;  // fused path: x's int8 rows per chunk, converted right before use
constexpr int64_t kChannelBlock = 128;     // channels per parallel work item
constexpr int64_t kMinParallelWork = 4096; // cell elements per thread, at least
constexpr int kQuantizeBuffers = 4;         // quantize outputs reused per thread (reuse_or_empty)

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// An int32 tensor of the given sizes whose memory is `cache`'s, reused when the last caller has let
// go of it, else fresh. For the layer's output and the quantized input, buffers of many MB that a
// forward call makes and drops: fresh, each call paid their pages' faults, ~3000 per call on the
// benchmark, measured as ~8 ms of a 20 ms module call on a VM. The caller gets an alias (its own
// TensorImpl on the cached storage) and the cache's TensorImpl never leaves: so the storage's use
// count is 1 exactly when no tensor or view handed out is alive. (The TensorImpl's own count
// would not do: torch keeps a returned tensor's Python object, and its reference, alive while
// C++ holds the tensor.) The cache and its aliases are made outside InferenceMode even when the
// call runs inside it: an inference tensor cached by a call under torch.inference_mode() would be
// handed out, and written in place, by later calls outside it, which torch forbids.
at::Tensor reuse_or_empty(at::Tensor& cache, at::IntArrayRef sizes) {
  c10::InferenceMode normal_tensors(false);
  if (!(cache.defined() && !cache.is_inference() && cache.storage().use_count() == 1 && cache.sizes() == sizes))
    cache = at::empty(sizes, at::TensorOptions().dtype(at::kInt));
  return cache.alias();
}

// Writes the int8 limbs of rows [0, rows) of src (int64 [rows, K]) into limbs[i] ([>= rows, ld]).
void split_limbs(const int32_t* src, int64_t rows, int64_t K, int32_t bits, std::vector<at::Tensor>& limbs) {
  const int64_t ld = limbs[0].size(1);
  const int n_limbs = (int)limbs.size();
  std::vector<int8_t*> dst;
  for (auto& l : limbs) dst.push_back(l.data_ptr<int8_t>());
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t* __restrict s = src + r * K;
      if (bits <= 8) {  // one limb: with constant arguments gcc vectorizes the loop (the general
        int8_t* __restrict d = dst[0] + r * ld;  // one below stays scalar: ~5% of a layer call)
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) d[k] = act_limb(s[k], 8, 0);
        continue;
      }
      for (int i = 0; i < n_limbs; ++i) {
        int8_t* __restrict d = dst[i] + r * ld;
        for (int64_t k = 0; k < K; ++k) d[k] = act_limb(s[k], bits, i);
      }
    }
  });
}

// One step of channels [j0, j1) of batch row n: state s is read and overwritten, o gets a copy.
// A separate, never inlined function with restrict pointers and by-value parameters: inlined into
// its caller, gcc loses sight of the copies and falls back to scalar table loads (measured 2x slower).
#if defined(__GNUC__)
#define QGRU_NOINLINE __attribute__((noinline))
#else
#define QGRU_NOINLINE
#endif

template <int NP, bool POW2, bool ACC32>
QGRU_NOINLINE void cell_block(const CellParams p, const LimbProducts lp, int64_t n, int64_t j0, int64_t j1,
                const int32_t* __restrict wx, int32_t* __restrict s, int32_t* __restrict o) {
  static_assert(kChannelBlock == kCell32Block, "a channel block must be one block of the int32 fields");
  // channel j's int32 fields are at fields + (j - j0): one pointer, every field at a fixed offset
  const int32_t* fields = cell32_channel<ACC32>(p, j0).at;
#pragma omp simd
  for (int64_t j = j0; j < j1; ++j) {
    const Channel32 ch{ACC32 ? fields + (j - j0) : nullptr};
    const int32_t h_new = (int32_t)gru_cell<NP, POW2, ACC32>(p, lp, n, j, ch, wx, s[j]);
    s[j] = h_new;
    o[j] = h_new;
  }
}

// The fused path's cells of one task: rows x nj elements (batch rows n0 + r, channels j0 + c; j0
// a multiple of kCell32Block, nj <= kFusedWidth) from the three gates' R.h tiles acc_h
// ([3][16][kFusedWidth] int32, gate q's at acc_h + q gs) and their W.x: with XACC the W.x tiles x
// (same layout, requantized here), else the rows' Wx - Z_Wx x ([rows, 3H]). Rows past their
// sequence length carry their state. Pointers are at row n0; s, o have row stride H; h_in / h_out,
// the int8 h of this step and the next, stride lda.
// All rows in one call, the row loops around the channel loops: per row calls of the same loops
// paid their start-up (setup, pipeline fill) for every 128 elements; measured ~15% of the cell.
template <bool POW2, bool ACC32, bool XACC>
QGRU_NOINLINE void cell_tile(const CellParams& p, const AccRequant& wx, int64_t j0, int64_t nj, int64_t rows,
                             const uint8_t* __restrict active, const int32_t* __restrict x,
                             const int32_t* __restrict acc_h, int32_t* __restrict s, int32_t* __restrict o,
                             const int8_t* __restrict h_in, int8_t* __restrict h_out, int64_t lda) {
  static_assert(kFusedWidth == kCell32Block, "a fused task's channels must be one block of the int32 fields");
  constexpr int64_t W = kFusedWidth, gs = amx::kTile * W;  // gs: from one gate's tile rows to the next's
  const int64_t H = p.H;
  // gate q of row r, channel c: W.x at x[r * xr + q * xs + c], R.h at acc_h[r * W + q * gs + c]
  const int64_t xs = XACC ? gs : H, xr = XACC ? W : 3 * H;
  if (!XACC) x += j0;
  s += j0;  // row r's state and output channel c: s[r * H + c], o[r * H + c]
  o += j0;
  if constexpr (ACC32) {
    // gru_cell32 in two loops, r and z first, then g and h: with one table gather in each loop's
    // dependency chain instead of two, more iterations overlap (measured ~15% faster)
    const Cell32 c32 = p.c32;
    const int32_t* fields = cell32_channel<ACC32>(p, j0).at;  // channel j0 + c's at fields + c
    const auto d_wx = [&](Channel32 ch, int q, int32_t v) {
      return XACC ? requant32_at(ch, kWxRequant, q, v, c32.wx_lo, c32.wx_hi) : v;
    };
    alignas(64) int32_t d_r[amx::kTile * W], d_z[amx::kTile * W];  // row r's at [r * W]
    for (int64_t r = 0; r < rows; ++r) {
      if (!active[r]) continue;
      const int64_t rx = r * xr, rh = r * W;
#pragma omp simd
      for (int64_t c = 0; c < nj; ++c) {
        const Channel32 ch{fields + c};
        d_r[rh + c] = sigmoid_gate32(c32, ch, 0, acc_h[rh + c], d_wx(ch, 0, x[rx + c]));
        d_z[rh + c] = sigmoid_gate32(c32, ch, 1, acc_h[rh + gs + c], d_wx(ch, 1, x[rx + xs + c]));
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (!active[r]) continue;
      const int64_t rx = r * xr, rh = r * W, rs = r * H;
#pragma omp simd
      for (int64_t c = 0; c < nj; ++c) {
        const Channel32 ch{fields + c};
        const int32_t h_new = candidate_state32(c32, ch, acc_h[rh + 2 * gs + c], d_wx(ch, 2, x[rx + 2 * xs + c]),
                                                d_r[rh + c], d_z[rh + c], s[rs + c]);
        s[rs + c] = h_new;
        o[rs + c] = h_new;
      }
    }
  } else {
    const auto d_wx = [&](int q, int64_t j, int32_t v) {
      return XACC ? (int32_t)requantize_acc<POW2>(wx, q * H + j, v) : v;
    };
    for (int64_t r = 0; r < rows; ++r) {
      if (!active[r]) continue;
      const int64_t rx = r * xr, rh = r * W, rs = r * H;
#pragma omp simd
      for (int64_t c = 0; c < nj; ++c) {
        const int64_t j = j0 + c;
        const int32_t h_new = (int32_t)gru_cell_acc<POW2, false>(
            p, j, Channel32{nullptr}, acc_h[rh + c], acc_h[rh + gs + c], acc_h[rh + 2 * gs + c],
            d_wx(0, j, x[rx + c]), d_wx(1, j, x[rx + xs + c]), d_wx(2, j, x[rx + 2 * xs + c]), s[rs + c]);
        s[rs + c] = h_new;
        o[rs + c] = h_new;
      }
    }
  }
  // Loops of their own: an int8 store in the loops above makes gcc pick 64 lanes (one zmm of
  // int8), more than a row's 16 channels, and run every cell in the scalar remainder (measured 8x
  // slower). Inactive rows (past their length) carry h and the state into this step's output.
  h_in += j0;
  h_out += j0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t rs = r * H, ra = r * lda;
    if (active[r]) {
      for (int64_t c = 0; c < nj; ++c) h_out[ra + c] = (int8_t)s[rs + c];  // h <= 8 bits: its one int8 limb
    } else {
      for (int64_t c = 0; c < nj; ++c) {
        o[rs + c] = s[rs + c];
        h_out[ra + c] = h_in[ra + c];
      }
    }
  }
}

// One row of W.x: the exact products of row r, plus bias, rescaled onto Wx (relative to Z_Wx).
template <int NP, bool POW2, bool ACC32>
QGRU_NOINLINE void requantize_row(const AccRequant a, const AccRequant32 a32, const LimbProducts lp, int64_t r,
                                  int64_t H3, int32_t* __restrict o) {
#pragma omp simd
  for (int64_t c = 0; c < H3; ++c) o[c] = (int32_t)requantize_product<NP, POW2, ACC32>(a, a32, lp, r, c);
}

// out[c] = a . w[c] for channels [c0, c1), int8 x int8 -> int32, exact. The activation comes
// offset to unsigned, ua = a + 128, because u8 x s8 dot products are what AVX-512 VNNI
// (vpdpbusd) and gcc's usdot pattern provide: a . w = ua . w - 128 colsum(w), and
// |ua . w| <= K 255 128 < 2^31 for K < 2^16. For a few rows (streaming, batch 1) this is ~5x
// faster than oneDNN's int8 GEMM, which is tuned for many rows.
QGRU_NOINLINE void dot_channels(const uint8_t* __restrict ua, const int8_t* __restrict w,
                                const int32_t* __restrict colsum, int64_t K, int64_t c0, int64_t c1,
                                int32_t* __restrict out) {
  for (int64_t c = c0; c < c1; ++c) {
    const int8_t* __restrict wc = w + c * K;
    int32_t acc = 0;
    for (int64_t k = 0; k < K; ++k) acc += (int32_t)ua[k] * (int32_t)wc[k];
    out[c] = acc - 128 * colsum[c];
  }
}

constexpr int64_t kSmallRows = 4;  // up to this many rows, dot_channels instead of oneDNN

struct Gemm {  // the limb GEMMs of one product (W.x or R.h)
  std::vector<at::Tensor> weight_limbs;  // each [M_pad, K_pad] int8
  std::vector<at::Tensor> weight_colsum; // each [M_pad] int32: sum over K, for dot_channels
  std::vector<at::Tensor> packed;        // AMX only: each weight limb as B tiles (qgru_amx.h)
  std::vector<int64_t> act_limb, weight_limb, scale, weight_offset;
  int64_t P = 0;
  bool amx = false;
  int64_t KT = 0, MT = 0;  // AMX: K slices of 64, column tiles of 16

  void init(const LayerTensors& lt, const std::string& k, bool use_amx) {
    at::Tensor w = lt.tensor(k + "_weight_limbs");  // [L, M_pad, K_pad]
    TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 3, "qgru: ", k, "_weight_limbs must be int8 [L, M, K]");
    amx = use_amx;
    const int64_t M = w.size(1), K = w.size(2);
    KT = amx::tiles(K, amx::kTileK);
    MT = amx::tiles(M, amx::kTile);
    for (int64_t i = 0; i < w.size(0); ++i) {
      weight_limbs.push_back(w[i]);
      weight_colsum.push_back(w[i].to(at::kInt).sum(1, false, at::kInt).contiguous());
      if (amx) {
        at::Tensor pk = at::empty({MT * KT * amx::kTileBytes}, w.options());
        amx::pack_b(w[i].data_ptr<int8_t>(), K, K, MT, [M](int64_t m) { return m < M ? m : int64_t(-1); },
                    pk.data_ptr<int8_t>());
        packed.push_back(pk);
      }
    }

    at::Tensor pr = lt.pairs(k);
    P = pr.size(0);
    TORCH_CHECK(P == 1 || P == 2 || P == 4, "qgru: unsupported number of limb pairs ", P);
    auto a = pr.accessor<int64_t, 2>();
    for (int64_t p = 0; p < P; ++p) {
      act_limb.push_back(a[p][0]);
      weight_limb.push_back(a[p][1]);
      scale.push_back(a[p][2]);
      weight_offset.push_back(a[p][3]);
    }
  }

  // Row stride of the activation limb buffers: AMX reads whole 64-byte K slices.
  int64_t act_ld() const { return amx ? KT * amx::kTileK : weight_limbs[0].size(1); }
  // Rows of the activation and output buffers for `rows` rows: AMX reads and writes whole tiles.
  int64_t buffer_rows(int64_t rows) const { return amx ? amx::tiles(rows, amx::kTile) * amx::kTile : rows; }

  // G[p][:rows] = act_limbs[i][:rows] @ weight_limbs[j].T, and the LimbProducts view of them.
  LimbProducts run(const std::vector<at::Tensor>& act_limbs, std::vector<at::Tensor>& G, int64_t rows,
                   int64_t ones_col) const {
    LimbProducts lp{};
    for (int64_t p = 0; p < P; ++p) {
      at::Tensor out = G[p].narrow(0, 0, rows);
      if (amx) {
        run_amx(act_limbs[act_limb[p]], packed[weight_limb[p]], G[p], rows);
      } else if (rows <= kSmallRows && weight_limbs[0].size(1) < (int64_t(1) << 16)) {  // dot_channels' bound
        const at::Tensor& a = act_limbs[act_limb[p]];
        const at::Tensor& w = weight_limbs[weight_limb[p]];
        const int64_t K = w.size(1), M = w.size(0), ld = G[p].size(1);
        const int8_t* ap = a.data_ptr<int8_t>();
        std::vector<uint8_t> ua((size_t)(rows * K));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < K; ++k) ua[r * K + k] = (uint8_t)((int32_t)ap[r * a.size(1) + k] + 128);
        const int8_t* wp = w.data_ptr<int8_t>();
        const int32_t* cs = weight_colsum[weight_limb[p]].data_ptr<int32_t>();
        int32_t* op = G[p].data_ptr<int32_t>();
        at::parallel_for(0, M, std::max<int64_t>(16, kMinParallelWork * 16 / std::max<int64_t>(K, 1)),
                         [&](int64_t c0, int64_t c1) {
          for (int64_t r = 0; r < rows; ++r) dot_channels(ua.data() + r * K, wp, cs, K, c0, c1, op + r * ld);
        });
      } else {
        at::_int_mm_out(out, act_limbs[act_limb[p]].narrow(0, 0, rows), weight_limbs[weight_limb[p]].t());
      }
      lp.G[p] = G[p].data_ptr<int32_t>();
      lp.scale[p] = scale[p];
      lp.weight_offset[p] = weight_offset[p];
    }
    lp.ld = G[0].size(1);
    lp.ones_col = ones_col;
    return lp;
  }

 private:
  // Tasks of (2 column tiles) x (up to 8 row tiles), column-major so that a thread's consecutive
  // tasks share their B tiles.
  void run_amx(const at::Tensor& a, const at::Tensor& b, at::Tensor& c, int64_t rows) const {
#if QGRU_HAVE_AMX
    const int64_t RT = amx::tiles(rows, amx::kTile), RG = amx::tiles(RT, 8), MB = amx::tiles(MT, 2);
    const int8_t* A = a.data_ptr<int8_t>();
    const int8_t* B = b.data_ptr<int8_t>();
    int32_t* C = c.data_ptr<int32_t>();
    const int64_t lda = a.size(1), ldc = c.size(1);
    const int64_t macs = 2 * amx::kTile * std::min<int64_t>(RT, 8) * amx::kTile * KT * amx::kTileK;
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 21) / macs);  // >= ~1 us of work per thread
    at::parallel_for(0, MB * RG, grain, [&](int64_t i0, int64_t i1) {
      amx::configure();
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t mb = i / RG, rg = i % RG;
        amx::gemm(A, lda, rg * 8, std::min(RT, rg * 8 + 8), B, KT, 2 * mb, std::min(MT, 2 * mb + 2), C, ldc);
      }
    });
#else
    (void)a, (void)b, (void)c, (void)rows;
    TORCH_CHECK(false, "qgru cpu: this binary has no AMX kernels");
#endif
  }
};

class CpuLayer {
 public:
  CpuLayer(TensorMap tensors, IntMap values) : lt_{std::move(tensors), std::move(values)} {
    for (auto& kv : lt_.t) TORCH_CHECK(kv.second.device().is_cpu(), "qgru cpu backend: '", kv.first, "' is not on the CPU");
    H_ = lt_.value("H");
    I_ = lt_.value("I");
    M_pad_ = lt_.value("M_pad");
    ones_col_ = lt_.value("ones_col");
    x_bits_ = (int32_t)lt_.value("x_bits");
    h_bits_ = (int32_t)lt_.value("h_bits");
    pow2_ = lt_.value("pow2") != 0;
    acc32_ = lt_.value("acc32") != 0;
    // "cpu_amx" = 0 (QGRU_CPU_AMX=0, qgru/native.py) asks for oneDNN even where AMX is available
    amx_ = amx::available() && lt_.value("cpu_amx") != 0;
    wx_.init(lt_, "x", amx_);
    rh_.init(lt_, "h", amx_);
    acc_x_ = lt_.acc("Wx");
    acc_x32_ = lt_.acc32("Wx");
    cell_ = lt_.cell();
    fused_ = amx_ && rh_.P == 1 && wx_.P == 1;
    if (fused_) {
      gate_blocks_x_ = pack_gate_blocks(wx_);
      gate_blocks_h_ = pack_gate_blocks(rh_);
    }
  }

  // "amx-fused" (one pass per step), "amx" (AMX GEMMs, separate cell pass) or "onednn".
  std::string gemm_path() const { return fused_ ? "amx-fused" : (amx_ ? "amx" : "onednn"); }

  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& qx_in, const at::Tensor& qh0_in,
                                             const c10::optional<at::Tensor>& lengths_in) {
    TORCH_CHECK(qx_in.dim() == 3 && qx_in.size(2) == I_, "qgru cpu: qx must be [T, N, ", I_, "]");
    TORCH_CHECK(qh0_in.dim() == 2 && qh0_in.size(0) == qx_in.size(1) && qh0_in.size(1) == H_,
                "qgru cpu: qh0 must be [N, ", H_, "]");
    const at::Tensor qx = qx_in.to(at::kInt).contiguous();  // values fit: at most 16 bits
    const int64_t T = qx.size(0), N = qx.size(1);
    at::Tensor state = qh0_in.to(at::kInt).contiguous().clone();
    std::lock_guard<std::mutex> lock(mu_);  // the workspace and out_ are shared by calls on this layer
    at::Tensor out = reuse_or_empty(out_, {T, N, H_});
    if (T == 0 || N == 0) return {out, state};
    at::Tensor lengths;
    if (lengths_in.has_value()) {
      lengths = lengths_in->to(at::kLong).contiguous();
      TORCH_CHECK(lengths.numel() == N, "qgru cpu: lengths must have N entries");
    }
    const int64_t* len = lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr;
    // W.x is computed for a chunk of steps at a time, right before those steps run: its buffers
    // stay small and warm in cache, and are reused across chunks and calls (fresh large buffers
    // cost page faults that measured as much as the arithmetic). The fused path computes W.x
    // inside the steps (only x's int8 rows are kept per chunk) once a step fills a 16-row tile;
    // for fewer rows a tile would be mostly padding, and W.x of the chunk's steps is one GEMM.
    const bool wx_in_step = fused_ && N >= amx::kTile;
    const int64_t chunk_rows = wx_in_step ? kFusedChunkBytes / wx_.act_ld()
                                          : (amx_ ? kAmxChunkBytes / (4 * M_pad_ * wx_.P) : kInputChunkRows);
    const int64_t steps = std::max<int64_t>(1, std::min<int64_t>(T, chunk_rows / N));
    ensure_workspace(steps * N, N, !wx_in_step);
    split_limbs(state.data_ptr<int32_t>(), N, H_, h_bits_, fused_ ? ws_.h_fused[0] : ws_.h_limbs);
    ws_.cur = 0;
    for (int64_t t0 = 0; t0 < T; t0 += steps) {
      const int64_t tc = std::min(steps, T - t0);
      if (wx_in_step) {
        split_limbs(qx.data_ptr<int32_t>() + t0 * N * I_, tc * N, I_, x_bits_, ws_.x_limbs);
      } else {
        input_chunk(qx.data_ptr<int32_t>() + t0 * N * I_, tc * N);
      }
      if (fused_) {
        QGRU_TIC(c0);
        dispatch(rh_.P, [&](auto, auto pow2, auto acc32) {  // P = 1 here: the flags are pow2, acc32
          if (wx_in_step) fused_steps<pow2.value, acc32.value, true>(t0, tc, N, state.data_ptr<int32_t>(), out, len);
          else fused_steps<pow2.value, acc32.value, false>(t0, tc, N, state.data_ptr<int32_t>(), out, len);
        });
        QGRU_TOC(prof_cell, c0);
      } else {
        recurrent_steps(t0, tc, N, state, out, len);
      }
    }
    return {out, state};
  }

 private:
  struct Workspace {
    int64_t rows = 0, N = 0;
    std::vector<at::Tensor> x_limbs, Gx, h_limbs, Gh;
    std::vector<at::Tensor> h_fused[2];  // fused path: h as int8, read by step t, written for t + 1
    int cur = 0;                         // which h_fused the next step reads
    at::Tensor dwx;  // [rows, 3H] Wx - Z_Wx of the current chunk of steps
  };

  // Buffers for chunks of `rows` rows of x and batches of N rows; with_wx: also W.x's (GEMM output
  // and Wx - Z_Wx), which the fused path with W.x inside the steps does without.
  void ensure_workspace(int64_t rows, int64_t N, bool with_wx) {
    auto i8 = at::TensorOptions().dtype(at::kChar), i32 = at::TensorOptions().dtype(at::kInt);
    if (ws_.rows < rows) {
      ws_.x_limbs.clear();
      ws_.Gx.clear();
      ws_.dwx = at::Tensor();
      const int n_act = x_bits_ > 8 ? 2 : 1;
      // AMX reads whole 16-row tiles; on the fused path a step's last row tile may reach up to 15
      // rows past the chunk's rows
      const int64_t br = rows + amx::kTile;
      // zeroed once: the K padding must read as 0 in every GEMM and is never written
      for (int i = 0; i < n_act; ++i) ws_.x_limbs.push_back(at::zeros({br, wx_.act_ld()}, i8));
      ws_.rows = rows;
    }
    if (with_wx && !ws_.dwx.defined()) {
      for (int64_t p = 0; p < wx_.P; ++p) ws_.Gx.push_back(at::empty({ws_.x_limbs[0].size(0), M_pad_}, i32));
      ws_.dwx = at::empty({ws_.rows, 3 * H_}, i32);
    }
    if (ws_.N < N) {
      ws_.h_limbs.clear();
      ws_.Gh.clear();
      const int n_act = h_bits_ > 8 ? 2 : 1;
      const int64_t br = rh_.buffer_rows(N);
      if (fused_) {
        for (auto& b : ws_.h_fused) b = {at::zeros({br, rh_.act_ld()}, i8)};
      } else {
        for (int i = 0; i < n_act; ++i) ws_.h_limbs.push_back(at::zeros({br, rh_.act_ld()}, i8));
        for (int64_t p = 0; p < rh_.P; ++p) ws_.Gh.push_back(at::empty({br, M_pad_}, i32));
      }
      ws_.N = N;
    }
  }

  // W or R (the one int8 limb of g) as B tiles grouped per block of 16 hidden units: the block's
  // r, z and g column tiles (channels j, H + j, 2H + j) one after the other, so one task gets all
  // three gates of its units.
  at::Tensor pack_gate_blocks(const Gemm& g) const {
    const at::Tensor& w = g.weight_limbs[0];
    const int64_t H = H_, HB = amx::tiles(H, amx::kTile);
    at::Tensor blocks = at::empty({3 * HB * g.KT * amx::kTileBytes}, w.options());
    amx::pack_b(w.data_ptr<int8_t>(), w.size(1), w.size(1), 3 * HB, [H](int64_t m) {
      const int64_t tile = m / amx::kTile, j = (tile / 3) * amx::kTile + m % amx::kTile;
      return j < H ? (tile % 3) * H + j : int64_t(-1);
    }, blocks.data_ptr<int8_t>());
    return blocks;
  }

  // Steps t0 .. t0 + tc - 1 on the fused path: per step one parallel pass over tasks (block of
  // kFusedWidth hidden units, tile of 16 batch rows), each computing its R.h tiles, with XACC its
  // W.x tiles too (from x's int8 rows of the chunk in ws_.x_limbs; else Wx - Z_Wx is read from
  // ws_.dwx), and then the cell on them while they are in L1.
  template <bool POW2, bool ACC32, bool XACC>
  void fused_steps(int64_t t0, int64_t tc, int64_t N, int32_t* state, at::Tensor& out, const int64_t* lengths) {
#if QGRU_HAVE_AMX
    constexpr int64_t W = kFusedWidth, T16 = amx::kTile;
    const int64_t H = H_, HB = amx::tiles(H, W), RT = amx::tiles(N, T16);
    const int64_t lda = ws_.h_fused[0][0].size(1), ldx = ws_.x_limbs[0].size(1);
    const int8_t* blocks_x = gate_blocks_x_.data_ptr<int8_t>();
    const int8_t* blocks_h = gate_blocks_h_.data_ptr<int8_t>();
    // one block of 16 units in gate_blocks_x_ / gate_blocks_h_
    const int64_t bytes_x = 3 * wx_.KT * amx::kTileBytes, bytes_h = 3 * rh_.KT * amx::kTileBytes;
    const CellParams p = cell_;
    const AccRequant wx = acc_x_;
    // One parallel region for all tc steps, not one per step (measured 3-7% faster): a thread that
    // runs out of tasks of step t waits until every task of step t is done (they write the h that
    // step t + 1 reads), then takes tasks of step t + 1. Waiting on the count of finished tasks,
    // not of arrived threads, holds however many threads the region actually gets (one, nested).
    // Tasks are handed out one at a time, not in fixed halves: on a shared 2-core VM the threads'
    // speeds differ from step to step, and fixed halves left one waiting (~10% of the step time).
    const int64_t n_tasks = HB * RT;
    const int cur0 = ws_.cur;
    std::vector<StepCounters> counters(tc);
    at::parallel_for(0, std::min<int64_t>(n_tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      amx::configure();
      alignas(64) int32_t acc_x[3 * T16 * W], acc_h[3 * T16 * W];  // [gate][row][unit]
      uint8_t active[T16];
      for (int64_t t = t0; t < t0 + tc; ++t) {
        const int cur = (cur0 + (int)(t - t0)) & 1;  // h is double-buffered: read one, write the other
        const int8_t* h_in = ws_.h_fused[cur][0].data_ptr<int8_t>();
        int8_t* h_out = ws_.h_fused[1 - cur][0].data_ptr<int8_t>();
        const int8_t* x_t = ws_.x_limbs[0].data_ptr<int8_t>() + (t - t0) * N * ldx;
        const int32_t* dwx_t = XACC ? nullptr : ws_.dwx.data_ptr<int32_t>() + (t - t0) * N * 3 * H;
        int32_t* out_t = out.data_ptr<int32_t>() + t * N * H;
        StepCounters& step = counters[t - t0];
        for (int64_t i; (i = step.next.fetch_add(1, std::memory_order_relaxed)) < n_tasks;) {
          const int64_t b = i / RT, n0 = (i % RT) * T16;
          const int64_t rows = std::min(T16, N - n0), j0 = b * W, nj = std::min(W, H - j0);
          for (int64_t q = 0; q * T16 < nj; ++q) {
            const int64_t ub = j0 / T16 + q;  // the block of 16 units
            if (XACC)
              amx::gate_tiles(x_t + n0 * ldx, ldx, blocks_x + ub * bytes_x, wx_.KT, acc_x + q * T16, W, T16 * W);
            amx::gate_tiles(h_in + n0 * lda, lda, blocks_h + ub * bytes_h, rh_.KT, acc_h + q * T16, W, T16 * W);
          }
          for (int64_t r = 0; r < rows; ++r) active[r] = lengths == nullptr || t < lengths[n0 + r];
          cell_tile<POW2, ACC32, XACC>(p, wx, j0, nj, rows, active, XACC ? acc_x : dwx_t + n0 * 3 * H, acc_h,
                                       state + n0 * H, out_t + n0 * H, h_in + n0 * lda, h_out + n0 * lda, lda);
          step.done.fetch_add(1, std::memory_order_release);  // publishes this task's h_out, state, out
        }
        step.wait_all(n_tasks);
      }
    });
    ws_.cur = (cur0 + (int)tc) & 1;
#else
    (void)t0, (void)tc, (void)N, (void)state, (void)out, (void)lengths;
    TORCH_CHECK(false, "qgru cpu: this binary has no AMX kernels");
#endif
  }

  template <int NP, bool POW2, bool ACC32>
  void input_epilogue(const LimbProducts& lp, int32_t* dwx, int64_t rows) const {
    const int64_t H3 = 3 * H_;
    const AccRequant a = acc_x_;
    const AccRequant32 a32 = acc_x32_;
    at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) requantize_row<NP, POW2, ACC32>(a, a32, lp, r, H3, dwx + r * H3);
    });
  }

  // Wx - Z_Wx of `rows` input rows into ws_.dwx (seed 001 steps 1-2).
  void input_chunk(const int32_t* src, int64_t rows) {
    QGRU_TIC(t0);
    split_limbs(src, rows, I_, x_bits_, ws_.x_limbs);
    LimbProducts lp = wx_.run(ws_.x_limbs, ws_.Gx, rows, ones_col_);
    QGRU_TOC(prof_in_gemm, t0);
    QGRU_TIC(t1);
    int32_t* o = ws_.dwx.data_ptr<int32_t>();
    dispatch(wx_.P, [&](auto np, auto pow2, auto acc32) { input_epilogue<np.value, pow2.value, acc32.value>(lp, o, rows); });
    QGRU_TOC(prof_in_epi, t1);
  }

  template <int NP, bool POW2, bool ACC32>
  void step_pointwise(const LimbProducts& lp, const int32_t* dwx_t, int32_t* state, int32_t* out_t,
                      std::vector<int8_t*>& h_limbs, int64_t K_pad, int64_t N, int64_t t,
                      const int64_t* lengths) const {
    const int64_t H = H_;
    const int64_t blocks = (H + kChannelBlock - 1) / kChannelBlock;
    const CellParams p = cell_;
    const int32_t hb = h_bits_;
    const int n_limbs = (int)h_limbs.size();
    // at least kMinParallelWork elements per thread: below that a fork/join costs more than it saves
    const int64_t grain = std::max<int64_t>(1, kMinParallelWork / kChannelBlock);
    at::parallel_for(0, N * blocks, grain, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t n = w / blocks;
        const int64_t j0 = (w % blocks) * kChannelBlock;
        const int64_t j1 = std::min(H, j0 + kChannelBlock);
        int32_t* s = state + n * H;
        int32_t* o = out_t + n * H;
        if (lengths != nullptr && t >= lengths[n]) {  // padding: the state is carried unchanged
          for (int64_t j = j0; j < j1; ++j) o[j] = s[j];
          continue;
        }
        cell_block<NP, POW2, ACC32>(p, lp, n, j0, j1, dwx_t + n * 3 * H, s, o);
        for (int i = 0; i < n_limbs; ++i) {
          int8_t* d = h_limbs[i] + n * K_pad;
          for (int64_t j = j0; j < j1; ++j) d[j] = act_limb(s[j], hb, i);
        }
      }
    });
  }

  // Steps t0 .. t0 + tc - 1, reading their Wx from ws_.dwx (seed 001 step 3).
  void recurrent_steps(int64_t t0, int64_t tc, int64_t N, at::Tensor& state, at::Tensor& out, const int64_t* lengths) {
    const int64_t K_pad = ws_.h_limbs[0].size(1);  // the limb buffers' row stride
    std::vector<int8_t*> limb_ptrs;
    for (auto& l : ws_.h_limbs) limb_ptrs.push_back(l.data_ptr<int8_t>());
    int32_t* s = state.data_ptr<int32_t>();
    for (int64_t t = t0; t < t0 + tc; ++t) {
      QGRU_TIC(c0);
      LimbProducts lp = rh_.run(ws_.h_limbs, ws_.Gh, N, ones_col_);
      QGRU_TOC(prof_h_gemm, c0);
      QGRU_TIC(c1);
      const int32_t* dwx_t = ws_.dwx.data_ptr<int32_t>() + (t - t0) * N * 3 * H_;
      int32_t* out_t = out.data_ptr<int32_t>() + t * N * H_;
      dispatch(rh_.P, [&](auto np, auto pow2, auto acc32) {
        step_pointwise<np.value, pow2.value, acc32.value>(lp, dwx_t, s, out_t, limb_ptrs, K_pad, N, t, lengths);
      });
      QGRU_TOC(prof_cell, c1);
    }
  }

  template <typename F>
  void dispatch(int64_t P, F&& f) const {
    dispatch_kernel(P, pow2_, acc32_, std::forward<F>(f));
  }

  LayerTensors lt_;
  std::mutex mu_;
  bool amx_ = false, fused_ = false;
  at::Tensor gate_blocks_x_, gate_blocks_h_;  // fused path: W and R packed by pack_gate_blocks
  Workspace ws_;
  at::Tensor out_;  // the last output, reused once its caller drops it (reuse_or_empty)
  int64_t H_, I_, M_pad_, ones_col_;
  int32_t x_bits_, h_bits_;
  bool pow2_, acc32_;
  Gemm wx_, rh_;
  AccRequant acc_x_;
  AccRequant32 acc_x32_;
  CellParams cell_;
};

// ---------------------------------------------------------------------------------------------
// The float boundary and the layer-to-layer requantization, one pass each (the golden model's
// primitives.quantize / dequantize / golden.requantize_input, same float64 arithmetic)
// ---------------------------------------------------------------------------------------------
// primitives.quantize of one element: round_half_up(x / scale) + zp, saturated; NaN gives 0 and
// sets *nan. x / scale is one float64 division, as in the golden model.
inline int32_t quantize_one(double x, double scale, int64_t zp, Range r, double lo, double hi, bool* nan) {
  double v = x / scale;
  if (v != v) {
    *nan = true;
    v = 0.0;
  }
  v = v < lo ? lo : (v > hi ? hi : v);
  const double f = std::floor(v);
  const int64_t rounded = (int64_t)f + ((v - f) >= 0.5 ? 1 : 0);  // round half up, exact
  return (int32_t)saturate(rounded + zp, r);
}

// The same over a block. gcc (12) leaves this loop scalar whatever its form (measured 2 ns per
// element, 3 ms per call of the benchmark's input), so AVX-512 is written out: the same float64
// operations, 8 lanes at a time, each IEEE-exact, so the results are identical.
template <typename scalar_t>
bool quantize_block(const scalar_t* x, int32_t* q, int64_t n, double scale, int64_t zp, Range r) {
  // clamp bounds of primitives.quantize: just beyond the integer range, so +-inf saturate
  const double lo = (double)(r.lo - zp - 1), hi = (double)(r.hi - zp + 1);
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  const __m512d vscale = _mm512_set1_pd(scale), vlo = _mm512_set1_pd(lo), vhi = _mm512_set1_pd(hi);
  const __m512d half = _mm512_set1_pd(0.5);
  const __m512i vzp = _mm512_set1_epi64(zp), one = _mm512_set1_epi64(1);
  const __m512i qlo = _mm512_set1_epi64(r.lo), qhi = _mm512_set1_epi64(r.hi);
  __mmask8 any_nan = 0;
  for (; i + 8 <= n; i += 8) {
    __m512d xv;
    if (std::is_same<scalar_t, float>::value) xv = _mm512_cvtps_pd(_mm256_loadu_ps((const float*)(x + i)));
    else xv = _mm512_loadu_pd((const double*)(x + i));
    __m512d v = _mm512_div_pd(xv, vscale);
    const __mmask8 is_nan = _mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q);
    any_nan |= is_nan;
    v = _mm512_mask_mov_pd(v, is_nan, _mm512_setzero_pd());
    v = _mm512_min_pd(_mm512_max_pd(v, vlo), vhi);
    const __m512d f = _mm512_roundscale_pd(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __mmask8 up = _mm512_cmp_pd_mask(_mm512_sub_pd(v, f), half, _CMP_GE_OQ);
    __m512i k = _mm512_add_epi64(_mm512_cvttpd_epi64(f), vzp);
    k = _mm512_mask_add_epi64(k, up, k, one);
    k = _mm512_min_epi64(_mm512_max_epi64(k, qlo), qhi);
    _mm256_storeu_si256((__m256i*)(q + i), _mm512_cvtepi64_epi32(k));
  }
  nan = any_nan != 0;
#endif
  for (; i < n; ++i) q[i] = quantize_one((double)x[i], scale, zp, r, lo, hi, &nan);
  return !nan;
}

template <typename scalar_t>
bool quantize_loop(const scalar_t* x, int32_t* q, int64_t n, double scale, int64_t zp, Range r) {
  std::atomic<bool> nan{false};
  at::parallel_for(0, n, 4096, [&](int64_t b, int64_t e) {
    if (!quantize_block(x + b, q + b, e - b, scale, zp, r)) nan = true;
  });
  return !nan;
}

// float -> int32 on (scale, zp, bits); NaN is an error (it has no quantized value).
at::Tensor quantize(const at::Tensor& x_in, double scale, int64_t zp, int64_t bits, const std::string& what) {
  TORCH_CHECK(x_in.is_floating_point() && x_in.device().is_cpu(), "qgru cpu quantize: float CPU tensor expected");
  const at::Tensor x = (x_in.scalar_type() == at::kDouble ? x_in : x_in.to(at::kFloat)).contiguous();
  // per calling thread (no other thread sees a buffer being reused), a few shapes: a module call
  // quantizes its input and then h0 while still holding the input's result
  thread_local at::Tensor cache[kQuantizeBuffers];
  at::Tensor* slot = &cache[0];
  for (auto& c : cache) {
    if (c.defined() && c.sizes() == x.sizes() && c.storage().use_count() == 1) { slot = &c; break; }
    if (!c.defined() || c.storage().use_count() == 1) slot = &c;  // free: may be replaced
  }
  at::Tensor q = reuse_or_empty(*slot, x.sizes());
  const Range r{-(int64_t(1) << (bits - 1)), (int64_t(1) << (bits - 1)) - 1};
  bool ok;
  {
    pybind11::gil_scoped_release release;
    ok = x.scalar_type() == at::kDouble
             ? quantize_loop(x.data_ptr<double>(), q.data_ptr<int32_t>(), x.numel(), scale, zp, r)
             : quantize_loop(x.data_ptr<float>(), q.data_ptr<int32_t>(), x.numel(), scale, zp, r);
  }
  TORCH_CHECK_VALUE(ok, "QuantGRU ", what, " contains NaN, which has no quantized value ",
                    "(out-of-range and infinite values saturate)");
  return q;
}

// int -> float32: (q - zp) * scale in float64, rounded once to float32 (as primitives.dequantize).
at::Tensor dequantize(const at::Tensor& q_in, double scale, int64_t zp) {
  const at::Tensor q = q_in.to(at::kInt).contiguous();
  pybind11::gil_scoped_release release;
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  const int32_t* src = q.data_ptr<int32_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, q.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = (float)((double)((int64_t)src[i] - zp) * scale);
  });
  return out;
}

// golden.requantize_input: sat(rescale(q - from_zp) + to_zp, to_bits), per-tensor factor.
at::Tensor requantize(const at::Tensor& q_in, int64_t from_zp, int64_t mult, int64_t shift, int64_t to_zp,
                      int64_t to_bits) {
  const at::Tensor q = q_in.to(at::kInt).contiguous();
  pybind11::gil_scoped_release release;
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int32_t* src = q.data_ptr<int32_t>();
  int32_t* dst = out.data_ptr<int32_t>();
  const Range r{-(int64_t(1) << (to_bits - 1)), (int64_t(1) << (to_bits - 1)) - 1};
  at::parallel_for(0, q.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = (int32_t)saturate(rounding_mul_shift((int64_t)src[i] - from_zp, mult,
                                                                                  (int32_t)shift) + to_zp, r);
  });
  return out;
}

}  // namespace
}  // namespace qgru

#ifndef QGRU_TORCH_VERSION
#error "QGRU_TORCH_VERSION must be defined by the build (qgru/native.py)"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "qgru C++ CPU backend (bit-exact with qgru/golden.py)";
  // The torch version this binary was compiled against: qgru refuses to load a stale binary.
  m.attr("built_for_torch") = QGRU_TORCH_VERSION;
#ifdef QGRU_PROFILE
  m.def("profile", []() {
    auto r = std::vector<double>{qgru::prof_in_gemm, qgru::prof_in_epi, qgru::prof_h_gemm, qgru::prof_cell};
    qgru::prof_in_gemm = qgru::prof_in_epi = qgru::prof_h_gemm = qgru::prof_cell = 0;
    return r;
  });
#endif
  m.def("amx_available", &qgru::amx::available, "AMX int8 kernels compiled in and granted by the OS");
  m.def("quantize", &qgru::quantize, "float -> int32 (primitives.quantize)");
  m.def("dequantize", &qgru::dequantize, "int -> float (primitives.dequantize)");
  m.def("requantize", &qgru::requantize, "golden.requantize_input, per-tensor factor");
  pybind11::class_<qgru::CpuLayer>(m, "Layer")
      .def(pybind11::init<qgru::TensorMap, qgru::IntMap>())
      .def_property_readonly("gemm", &qgru::CpuLayer::gemm_path)
      .def("forward", &qgru::CpuLayer::forward, pybind11::arg("qx"), pybind11::arg("qh0"),
           pybind11::arg("lengths") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
