// qgru C++ CPU backend: one layer and direction of the integer GRU, bit-exact with qgru/golden.py.
//
// This file is the driver, compiled for the build's baseline target: it splits a layer call into
// chunks of steps and parallel tasks, owns the buffers, and calls one instruction-set path's
// kernels (kernels.h: the packed int8 GEMMs and the cell loops; isa.cpp picks the path at run
// time from what the CPU and OS offer, or QGRU_CPU_ISA through qgru/native/cpu.py). Its Python
// binding is bind_cpu.cpp, which sees this file through cpu_backend.h only.
//
// GEMMs: int8 (or int16) x int8 -> int32, one per limb pair (qgru_cell.h), weights packed once
// per layer in the layout the path's kernel reads. With one limb pair on both GEMMs (x, h, W and
// R of at most 8 bits, or 16-bit x / h taken whole by a path with int16 operands) each step is one
// fused pass: a task computes the three gates' W.x and R.h for kTaskUnits hidden units and 16
// batch rows and runs the cell on them while they are in cache; no W.x is written out (below 16
// batch rows, where a W.x tile would be mostly padding, W.x is one GEMM per chunk of steps). The
// steps of a chunk share one parallel region; threads wait between steps on a count of finished
// tasks (StepCounters). Other layers run a GEMM per step and then a cell pass.
// Large per-call buffers (the layer's output, the quantized input) reuse their memory from call
// to call once the caller has dropped the previous result (reuse_or_empty).
#include <ATen/Parallel.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <new>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpu_backend.h"
#include "isa.h"
#include "qgru_layer.h"
#include "qgru_check.h"

namespace qgru {
namespace {
using cpu::Kernels;
using cpu::kTaskUnits;
using cpu::kTileRows;

// The fused path's per-step count of finished tasks (own cache line: every thread bumps it).
struct StepCounters {
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

// One thread's home share of a step's tasks, [next, end), handed out one at a time: first to its
// owner, then to any thread that has run out of its own (own cache line each).
struct TaskSlot {
  alignas(64) std::atomic<int64_t> next{0};
  int64_t end = 0;
};

// An array of T that grows when asked for more and is otherwise kept (its elements are set by the
// caller on every use): per-call bookkeeping that a streaming step would else allocate each call.
template <typename T>
class Reused {
 public:
  T* get(int64_t n) {
    if (n > cap_) {
      data_.reset(new T[n]);
      cap_ = n;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<T[]> data_;
  int64_t cap_ = 0;
};

// fork(): GNU OpenMP's thread pool (at::parallel_for's, on this torch) does not survive it. A
// thread that ran a parallel region keeps its pool's threads on record; the child of a fork made
// by that thread has none of them, and its next parallel region waits for them forever (torch's
// own operators too: `a * 3` on 4M elements hangs such a child, as torch documents). In a
// child of fork this backend's loops therefore run on the calling thread (the same integers: no
// result depends on the thread count); qgru/native/cpu.py says so with a warning where torch would
// run more than one thread. Set by a pthread_atfork child handler (registered at module import),
// or by qgru/native/build.py (set_forked_child) when the module is first loaded in a child of a fork.
std::atomic<bool> g_forked{false};

void mark_forked_child() { g_forked.store(true, std::memory_order_relaxed); }

// at::parallel_for, or f(begin, end) on the calling thread in a child of fork (g_forked).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (!g_forked.load(std::memory_order_relaxed)) return at::parallel_for(begin, end, grain, f);
  if (begin < end) f(begin, end);
}

// ---------------------------------------------------------------------------------------------
// Phase profile (scripts/profile_cpu.py, issue 40): where a call's time goes, per phase, summed
// over threads, in nanoseconds of the steady clock. Off unless profile_enable(true): then each
// phase costs two clock reads (~20-40 ns) per task, a few % of a small step.
// ---------------------------------------------------------------------------------------------
enum Phase { kPhQuantize, kPhWx, kPhRh, kPhCell, kPhWait, kPhDequantize, kPhStack, kPhases };
std::atomic<bool> g_profile{false};
std::atomic<int64_t> g_phase_ns[kPhases];
std::atomic<int64_t> g_profile_calls{0};

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
inline bool profiling() { return g_profile.load(std::memory_order_relaxed); }
inline void add_phase(Phase p, int64_t ns) { g_phase_ns[p].fetch_add(ns, std::memory_order_relaxed); }

// Times its scope into phase p where profiling is on.
struct PhaseScope {
  Phase p;
  int64_t t0;
  explicit PhaseScope(Phase ph) : p(ph), t0(profiling() ? now_ns() : -1) {}
  ~PhaseScope() {
    if (t0 >= 0) add_phase(p, now_ns() - t0);
  }
};

constexpr int64_t kInputChunkRows = 1024;      // rows of W.x per chunk of steps (unfused paths)
constexpr int64_t kFusedChunkBytes = 1 << 17;  // fused path: x's activation rows per chunk, converted right before use
constexpr int64_t kGemmRows = 64;              // rows of one GEMM task
constexpr int64_t kGemmGroups = 6;             // column groups of one GEMM task (a multiple of 2 and 3)
constexpr int64_t kMinParallelWork = 4096;     // cell elements per thread, at least
constexpr int64_t kMinStepMacs = 1 << 18;      // fused path: a step's multiply-adds per thread, at least
constexpr int kQuantizeBuffers = 4;            // quantize outputs reused per thread (reuse_or_empty)
// A calling thread keeps its own int32 buffers (stack_forward's scratch, quantize's outputs) only up to
// this size each; larger ones come from the process's BufferPool, which keeps kPoolBytes in all.
constexpr int64_t kThreadBufferBytes = 256 << 10;
constexpr int64_t kPoolBytes = 32 << 20;

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int64_t ceil_div(int64_t v, int64_t m) { return (v + m - 1) / m; }

// t as int32 and contiguous, with no dispatched call where it already is (each costs a streaming
// call ~0.5 us, even a no-op). A negative view (torch._neg_view) is resolved: its memory holds the
// values before the sign that torch applies on reading, and native code reads the memory.
at::Tensor int32_contiguous(const at::Tensor& t) {
  if (t.scalar_type() == at::kInt && t.is_contiguous() && !t.is_neg()) return t;
  return t.resolve_neg().to(at::kInt).contiguous();
}

// Refuses an integer operand (qx, qh0) that is not an integer tensor or holds values outside r:
// the layer reads its values as r's bits (the GEMM operand's limbs, the state's grid) and would
// compute on other ones without a word.
// (A loop over the values, not at::aminmax: two dispatched reductions and four item() calls
// cost a streaming call several microseconds.)
void check_operand_values(const at::Tensor& t_in, Range r, const char* what) {
  QGRU_CHECK(at::isIntegralType(t_in.scalar_type(), /*includeBool=*/false), "qgru cpu: ", what,
              " must be an integer tensor, got ", t_in.scalar_type());
  const at::Tensor t = t_in.resolve_neg().contiguous();
  if (t.numel() == 0) return;
  int64_t lo = 0, hi = 0;
  AT_DISPATCH_INTEGRAL_TYPES(t.scalar_type(), "qgru_check_operand", [&] {
    const scalar_t* p = t.data_ptr<scalar_t>();
    scalar_t mn = p[0], mx = p[0];  // in the tensor's own type: a loop the compiler vectorises
    for (int64_t i = 1, n = t.numel(); i < n; ++i) {
      mn = p[i] < mn ? p[i] : mn;
      mx = p[i] > mx ? p[i] : mx;
    }
    lo = (int64_t)mn, hi = (int64_t)mx;
  });
  QGRU_CHECK(r.lo <= lo && hi <= r.hi, "qgru cpu: ", what, " holds values in [", lo, ", ", hi, "], outside its grid [",
              r.lo, ", ", r.hi, "]");
}

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

// Which weight row each packed column reads (-1: a zero column), in groups of G columns.
// Plain: all M channels in order. Gates (the fused step's layout): per unit group u of G hidden
// units, the r, z and g columns of units u G .. u G + G - 1, so a task of units [j0, j0 + nj)
// reads the consecutive groups 3 j0 / G .. 3 ceil((j0 + nj) / G).
std::vector<int64_t> plain_channels(int64_t M, int64_t G) {
  std::vector<int64_t> ch(ceil_div(std::max<int64_t>(M, 1), G) * G);
  for (int64_t m = 0; m < (int64_t)ch.size(); ++m) ch[m] = m < M ? m : -1;
  return ch;
}

std::vector<int64_t> gate_channels(int64_t H, int64_t G) {
  std::vector<int64_t> ch(ceil_div(std::max<int64_t>(H, 1), G) * 3 * G);
  for (int64_t m = 0; m < (int64_t)ch.size(); ++m) {
    const int64_t u = m / (3 * G), q = (m / G) % 3, j = u * G + m % G;
    ch[m] = j < H ? q * H + j : -1;
  }
  return ch;
}

// The limb GEMMs of one product (W.x or R.h) on one path: weight limbs packed for its kernel.
struct Gemm {
  const Kernels* k = nullptr;
  std::vector<at::Tensor> packed;  // per weight limb: all M_pad channels in column groups (uint8 bytes)
  at::Tensor gates;                // one limb pair only: the weight packed per unit group as r, z, g groups
  std::vector<int64_t> act_limb, weight_limb, scale, weight_offset;
  int64_t P = 0, K = 0, M_pad = 0, groups = 0, lda = 0;
  int n_act = 1, bits = 8, direct = 0;

  void init(const LayerTensors& lt, const std::string& k_name, const Kernels* kern, int64_t H, int64_t K_real,
            int act_bits, int act_direct) {
    k = kern;
    bits = act_bits;
    direct = act_direct;
    QGRU_CHECK(!direct || k->act_bytes == 2, "qgru cpu: 16-bit activations taken whole need a path with int16 operands");
    n_act = (bits > 8 && !direct) ? 2 : 1;
    at::Tensor w = lt.tensor(k_name + "_weight_limbs");  // [L, M_pad, K_pad]
    QGRU_CHECK(w.scalar_type() == at::kChar && w.dim() == 3 && w.is_contiguous(), "qgru: ", k_name,
                "_weight_limbs must be contiguous int8 [L, M, K]");
    M_pad = w.size(1);
    const int64_t K_pad = w.size(2);
    if (direct) {  // a whole 16-bit activation: the int32 sums must be exact (native.direct16_fits,
      // or limbs16_fits for the two limbs of 16-bit weights): |a . w_c| <= 2^15 sum_k |w_ck| for
      // every row c of every limb, the ones row included (in int32: int8's abs leaves -128 at -128)
      const int64_t max_row = w.numel() ? w.to(at::kInt).abs().sum(2).max().item<int64_t>() : 0;
      QGRU_CHECK(w.size(0) <= 2 && max_row * 32768 < (int64_t(1) << 31), "qgru: ", k_name,
                  "_direct16 needs at most two weight limbs with 2^15 sum_k |w_ck| < 2^31 for every row c");
    }
    K = K_pad;
    lda = cpu::k_padded(std::max<int64_t>(K, 1));
    const std::vector<int64_t> plain = plain_channels(M_pad, k->group);
    groups = (int64_t)plain.size() / k->group;
    for (int64_t i = 0; i < w.size(0); ++i) packed.push_back(pack(w[i], plain));

    at::Tensor pr = lt.pairs(k_name);
    P = pr.size(0);
    QGRU_CHECK(P == 1 || P == 2 || P == 4, "qgru: unsupported number of limb pairs ", P);
    auto a = pr.accessor<int64_t, 2>();
    for (int64_t p = 0; p < P; ++p) {
      QGRU_CHECK(a[p][0] >= 0 && a[p][0] < n_act && a[p][1] >= 0 && a[p][1] < w.size(0),
                  "qgru: ", k_name, "_pairs names a limb that does not exist");
      act_limb.push_back(a[p][0]);
      weight_limb.push_back(a[p][1]);
      scale.push_back(a[p][2]);
      weight_offset.push_back(a[p][3]);
    }
    if (P == 1) gates = pack(w[0], gate_channels(H, k->group));
  }

  at::Tensor pack(const at::Tensor& w, const std::vector<int64_t>& channel) const {
    const int64_t g = (int64_t)channel.size() / k->group;
    at::Tensor out = at::empty({k->packed_bytes(g, K)}, at::TensorOptions().dtype(at::kByte));
    k->pack(w.data_ptr<int8_t>(), w.size(1), K, channel.data(), g, out.data_ptr<uint8_t>());
    return out;
  }

  at::ScalarType act_type() const { return k->act_bytes == 2 ? at::kShort : at::kChar; }

  // G[p][:rows] = act_limbs[i][:rows] . weight limb j, for every pair, as parallel tasks of
  // kGemmRows rows x kGemmGroups column groups; and the LimbProducts view of them.
  LimbProducts run(const std::vector<at::Tensor>& act, std::vector<at::Tensor>& G, int64_t rows, int64_t ones_col) const {
    LimbProducts lp{};
    const int64_t ldc = G[0].size(1), RB = ceil_div(rows, kGemmRows), CB = ceil_div(groups, kGemmGroups);
    const int64_t ab = k->act_bytes;
    const int64_t work = kGemmRows * kGemmGroups * k->group * K;  // MACs of a full task
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(work, 1));
    parallel_for(0, P * RB * CB, grain, [&](int64_t i0, int64_t i1) {
      k->thread_init();
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t p = i / (RB * CB), rb = (i / CB) % RB, cb = i % CB;
        const int64_t r0 = rb * kGemmRows, g0 = cb * kGemmGroups;
        cpu::GemmArgs a{static_cast<const char*>(act[act_limb[p]].data_ptr()) + r0 * lda * ab, lda,
                        std::min(kGemmRows, rows - r0), K, packed[weight_limb[p]].data_ptr<uint8_t>(), g0,
                        std::min(groups, g0 + kGemmGroups), G[p].data_ptr<int32_t>() + r0 * ldc + g0 * k->group,
                        ldc, 0};
        k->gemm(a);
      }
    });
    for (int64_t p = 0; p < P; ++p) {
      lp.G[p] = G[p].data_ptr<int32_t>();
      lp.scale[p] = scale[p];
      lp.weight_offset[p] = weight_offset[p];
    }
    lp.ld = ldc;
    lp.ones_col = ones_col;
    return lp;
  }

  // Writes rows [0, rows) of src (int32 [rows, K_real]) as this GEMM's activation limbs; with
  // cell (R.h), src holds states, written as their R.h operand (gemm_operand).
  void to_act(const int32_t* src, int64_t rows, int64_t K_real, std::vector<at::Tensor>& limbs,
              const CellParams* cell = nullptr, int pow2 = 0, int acc32 = 0) const {
    void* dst[2] = {nullptr, nullptr};  // one limb per activation byte (n_act <= 2): no heap block per call
    QGRU_CHECK(limbs.size() <= 2, "qgru cpu: at most two activation limbs");
    for (size_t i = 0; i < limbs.size(); ++i) dst[i] = limbs[i].data_ptr();
    parallel_for(0, rows, std::max<int64_t>(16, kMinParallelWork * 8 / std::max<int64_t>(K_real, 1)),
                     [&](int64_t r0, int64_t r1) {
      k->to_act(cpu::ToActArgs{src, r0, r1, K_real, lda, bits, n_act, direct, dst, cell, pow2, acc32});
    });
  }
};

// Where run_into also writes floats (primitives.dequantize on the state's grid): the final state
// [N, H] at `out` (nullptr: nowhere), and every step's output [T, N, H] at `seq` instead of the
// int32 output (nullptr: the int32 output; a stack's last layer, whose int32 output nothing reads).
struct StateFloats {
  float* out = nullptr;
  float* seq = nullptr;
  double scale = 1.0;
  double zp = 0.0;
};

class CpuLayer {
 public:
  CpuLayer(TensorMap tensors, IntMap values, const std::string& isa) : lt_{std::move(tensors), std::move(values)} {
    for (auto& kv : lt_.t) QGRU_CHECK(kv.second.device().is_cpu(), "qgru cpu backend: '", kv.first, "' is not on the CPU");
    try {
      k_ = cpu::select_isa(isa);
    } catch (const std::runtime_error& e) {
      QGRU_CHECK_VALUE(false, e.what());
    }
    H_ = lt_.value("H");
    I_ = lt_.value("I");
    ones_col_ = lt_.value("ones_col");
    x_bits_ = (int32_t)lt_.value("x_bits");
    h_bits_ = (int32_t)lt_.value("h_bits");
    pow2_ = lt_.value("pow2") != 0;
    acc32_ = lt_.value("acc32") != 0;
    wide_ = wide_accumulators();
    // a 16-bit x or h taken whole on an int8 path: its int16 sibling (one GEMM pass, not two limbs)
    if ((lt_.value("x_direct16") != 0 || lt_.value("h_direct16") != 0) && k_->act_bytes == 1 && k_->act16 != nullptr)
      k_ = k_->act16;
    wx_.init(lt_, "x", k_, H_, I_, x_bits_, (int)lt_.value("x_direct16"));
    rh_.init(lt_, "h", k_, H_, H_, h_bits_, (int)lt_.value("h_direct16"));
    levels_ = lt_.x_levels();
    acc_x_ = lt_.acc_x();  // every x level's (levels_ > 0), else the static grid's
    acc_x32_ = lt_.acc32_x();
    cell_ = lt_.cell();
    level0_static_ = levels_ > 0 && level0_is_static();
    fused_ = rh_.P == 1 && wx_.P == 1;
    // the hybrid cell (int64 requantization, int32 gates) on the unfused step's cell_rows
    hybrid_ = !acc32_ && !fused_ && lt_.hybrid32() != 0;
    // two-pair products requantized in int32 (prepare.py _limb32_parts: pow2, R in [8, 29])
    if (lt_.value_or("limb32_x", 0) != 0)
      lx_ = limb32(levels_ > 0 ? "Wxl" : "Wx", "Wx", (levels_ > 0 ? levels_ : 1) * 3 * H_, wx_), lx32_ = true;
    if (lt_.value_or("limb32_h", 0) != 0) lh_ = limb32("Rh", "Rh", 3 * H_, rh_), lh32_ = true;
    if (fused_) rh_.packed.clear();  // the fused step reads R only in the gates layout
    // nothing reads the weights again but in their packed copies
    lt_.t.erase("x_weight_limbs");
    lt_.t.erase("h_weight_limbs");
  }

  // One-step calls of a batch of one (streaming) run on `isa`'s Layer of the same layer, made
  // from `tensors` / `values` (prepared for that path) on the first such call and kept. Which path
  // and when is qgru/native/cpu.py's one_row_path, the one place that decides it. The maps are
  // validated now (LayerTensors, the CPU device; they must describe this layer: its sizes and bit
  // widths); what the path itself requires (Gemm::init) is checked when the Layer is made.
  void set_one_row(TensorMap tensors, IntMap values, const std::string& isa) {
    for (auto& kv : tensors)
      QGRU_CHECK(kv.second.device().is_cpu(), "qgru cpu backend: '", kv.first, "' is not on the CPU");
    const LayerTensors spec{tensors, values};
    QGRU_CHECK(spec.x_levels() == lt_.x_levels(), "qgru cpu: the one-row Layer has ", spec.x_levels(),
                " x levels, this layer ", lt_.x_levels());
    for (const char* v : {"H", "I", "x_bits", "h_bits"})
      QGRU_CHECK(spec.value(v) == lt_.value(v), "qgru cpu: the one-row Layer's ", v, " (", spec.value(v),
                  ") is not this layer's (", lt_.value(v), ")");
    try {
      (void)cpu::select_isa(isa);
    } catch (const std::runtime_error& e) {
      QGRU_CHECK_VALUE(false, e.what());
    }
    std::lock_guard<std::mutex> lock(mu_);
    one_row_spec_ = OneRowSpec{std::move(tensors), std::move(values), isa};
    one_row_.reset();
  }

  const Kernels* kernels() const { return k_; }

  // The path's name, and "-fused" where each step is one fused pass.
  std::string gemm_path() const { return std::string(k_->name) + (fused_ ? "-fused" : ""); }
  // The cell this layer runs: "int32" (qgru_cell.h's int32 cell), "int32-wide" (the same from wide
  // accumulators), "int32-hybrid" (the accumulators requantized in int64, the rest in the int32
  // cell: limb products beyond int32, cell_loops.h cell_block_hybrid) or "int64" (the int64 cell:
  // prepare_layer found an int32 bound that fails).
  std::string cell_kind() const {
    return acc32_ ? (wide_ ? "int32-wide" : "int32") : (hybrid_ ? "int32-hybrid" : "int64");
  }

  // The path whose Layer runs one-step calls of a batch of one ("" where it is this one).
  std::string one_row_path() {
    std::lock_guard<std::mutex> lock(mu_);
    return one_row_spec_.isa;
  }

  // Whether a one-row call has made that Layer yet (tests: it runs, and only for those calls).
  bool one_row_made() {
    std::lock_guard<std::mutex> lock(mu_);
    return one_row_ != nullptr;
  }

  // qx_bits > 0: the caller made qx's values in the signed qx_bits-bit range (quantize or requantize
  // saturated them there); where that range is within this layer's x range, qx is not scanned
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& qx_in, const at::Tensor& qh0_in,
                                             const c10::optional<at::Tensor>& lengths_in,
                                             const c10::optional<at::Tensor>& level_in = c10::nullopt,
                                             int64_t qx_bits = 0) {
    QGRU_CHECK(qx_in.device().is_cpu() && qh0_in.device().is_cpu() &&
                    (!lengths_in.has_value() || lengths_in->device().is_cpu()),
                "qgru cpu: qx, qh0 and lengths must be CPU tensors");
    QGRU_CHECK(qx_in.dim() == 3 && qx_in.size(2) == I_, "qgru cpu: qx must be [T, N, ", I_, "]");
    QGRU_CHECK(qh0_in.dim() == 2 && qh0_in.size(0) == qx_in.size(1) && qh0_in.size(1) == H_,
                "qgru cpu: qh0 must be [N, ", H_, "]");
    QGRU_CHECK(qx_in.scalar_type() == at::kInt || qx_bits == 0, "qgru cpu: an int32 qx expected");
    if (qx_bits <= 0 || qx_bits > x_bits_) check_operand_values(qx_in, signed_range(x_bits_), "qx");
    check_operand_values(qh0_in, lt_.range("h"), "qh0");
    at::Tensor lengths;
    if (lengths_in.has_value()) {
      lengths = lengths_in->resolve_neg().to(at::kLong).contiguous();
      QGRU_CHECK(lengths.numel() == qx_in.size(1), "qgru cpu: lengths must have N entries");
    }
    at::Tensor level;
    // a layer with x levels given no level: every token on level 0, the static grid (golden.gru_direction)
    if (level_in.has_value()) {
      QGRU_CHECK(levels_ > 0, "qgru cpu: this layer has no x levels, yet a level per token was given");
      QGRU_CHECK(level_in->device().is_cpu() && level_in->dim() == 2 && level_in->size(0) == qx_in.size(0) &&
                      level_in->size(1) == qx_in.size(1),
                  "qgru cpu: level must be a CPU tensor [T, N] = [", qx_in.size(0), ", ", qx_in.size(1), "], got ",
                  level_in->sizes());
      check_operand_values(*level_in, Range{0, levels_ - 1}, "level");
      level = int32_contiguous(*level_in);
    }
    // values fit int32: at most 16 bits; the state is this call's own copy (run updates it)
    return run(int32_contiguous(qx_in), int32_contiguous(qh0_in).clone(), lengths, level);
  }

  int64_t x_levels() const { return levels_; }

  int64_t hidden_size() const { return H_; }
  int64_t input_size() const { return I_; }
  int64_t x_bits() const { return x_bits_; }
  // the state's grid (an h_gemm operand may have fewer bits) and zero point
  Range state_range() const { return lt_.range("h"); }
  int64_t state_zp() const { return lt_.value("h_zp"); }

  // forward on checked operands: qx int32 contiguous [T, N, I]; state int32 contiguous [N, H], the
  // initial state, owned by this call (updated in place and returned as h_n); lengths undefined or
  // int64 contiguous [N]; level (a layer with x levels) int32 contiguous [T, N] with values in
  // [0, levels), else undefined. (stack_forward quantizes h0 straight into such a state.)
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& qx, at::Tensor state, const at::Tensor& lengths,
                                         const at::Tensor& level = at::Tensor()) {
    const int64_t T = qx.size(0), N = qx.size(1);
    if (T == 1 && N == 1)
      if (std::shared_ptr<CpuLayer> other = one_row_layer()) return other->run(qx, std::move(state), lengths, level);
    // the output is handed to the caller: reused only once the caller has let go of it
    at::Tensor out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      out = reuse_or_empty(out_, {T, N, H_});
    }
    run_into(qx.data_ptr<int32_t>(), T, N, state.data_ptr<int32_t>(),
             lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr,
             level.defined() ? level.data_ptr<int32_t>() : nullptr, out.data_ptr<int32_t>());
    return {out, state};
  }

  // run on raw operands (stack_forward's, in its calling thread's scratch buffers: no tensor made
  // or aliased per call, which a streaming step would pay for): qx [T, N, I], state [N, H] (the
  // initial state, updated in place), len [N] or nullptr, lev [T, N] or nullptr, out [T, N, H]
  // written; none of them used after the call returns. floats: where the final state's floats
  // go (the fused path writes them in its last step's tasks, while they are in cache and on
  // every thread, not in a serial pass after the parallel region; floats.seq: every step's, the
  // int32 output `out` then unused); true if they were written (the fused path), else the int32
  // output and the state hold them.
  bool run_into(const int32_t* qx, int64_t T, int64_t N, int32_t* state, const int64_t* len, const int32_t* lev,
                int32_t* out, StateFloats floats = StateFloats{}) {
    if (T == 1 && N == 1)
      if (std::shared_ptr<CpuLayer> other = one_row_layer())
        return other->run_into(qx, T, N, state, len, lev, out, floats);
    if (T == 0 || N == 0) return false;
    std::lock_guard<std::mutex> lock(mu_);  // the workspace is shared by calls on this layer
    // W.x is computed for a chunk of steps at a time, right before those steps run: its buffers
    // stay small and warm in cache, and are reused across chunks and calls (fresh large buffers
    // cost page faults that measured as much as the arithmetic). The fused path computes W.x
    // inside the steps (only x's activation rows are kept per chunk) once a step fills a 16-row
    // tile; for fewer rows a tile would be mostly padding, and W.x of the chunk's steps is one GEMM
    // (which reads each weight once for all the chunk's steps).
    // One step alone (a streaming call, T = 1) takes W.x inside the step too, whatever N: a
    // separate input GEMM would cost a parallel region of its own for one step's rows.
    const bool wx_in_step = fused_ && (N >= kTileRows || T == 1);
    const int64_t chunk_rows = wx_in_step ? kFusedChunkBytes / (wx_.lda * k_->act_bytes) : kInputChunkRows;
    const int64_t steps = std::max<int64_t>(1, std::min<int64_t>(T, chunk_rows / N));
    ensure_workspace(steps * N, N, !wx_in_step);
    rh_.to_act(state, N, H_, fused_ ? ws_.h_fused[0] : ws_.h_act, &cell_, pow2_, acc32_);
    ws_.cur = 0;
    for (int64_t t0 = 0; t0 < T; t0 += steps) {
      const int64_t tc = std::min(steps, T - t0);
      if (wx_in_step) {
        const PhaseScope scope(kPhWx);
        wx_.to_act(qx + t0 * N * I_, tc * N, I_, ws_.x_act);
      } else {
        input_chunk(qx + t0 * N * I_, tc * N, lev != nullptr ? lev + t0 * N : nullptr);
      }
      if (fused_) {
        // the final state's floats in the call's last step
        fused_steps(t0, tc, N, state, out, len, wx_in_step, wx_in_step ? lev : nullptr,
                    StateFloats{t0 + tc == T ? floats.out : nullptr, floats.seq, floats.scale, floats.zp});
      } else {
        recurrent_steps(t0, tc, N, state, out, len);
      }
    }
    return fused_ && (floats.out != nullptr || floats.seq != nullptr);
  }

 private:
  struct OneRowSpec {
    TensorMap tensors;
    IntMap values;
    std::string isa;  // "": none
  };

  // Whether x level 0's W.x requantization is the static grid's, integer for integer (prepare.py
  // builds it so; checked here, since the fused step then runs a tile whose rows are all on level 0
  // as a layer without levels: W.x's fields from the channel blocks, not from the flat per-level
  // arrays, whose extra base pointers cost the cell ~3-8% at small shapes, issue 40).
  bool level0_is_static() const {
    if (!acc32_) return true;  // the int64 cell reads level 0 from the flat arrays either way
    const int64_t H3 = 3 * H_;
    for (const char* f : {"bias_hi", "bias_lo", "rshift", "mult32"}) {
      const std::string lv = std::string("Wxl_") + f, st = std::string("Wx_") + f;
      if (!lt_.t.count(lv) || !lt_.t.count(st)) return false;
      const at::Tensor a = lt_.t.at(lv).reshape(-1), b = lt_.t.at(st).reshape(-1);
      if (a.numel() < H3 || b.numel() != H3 || !at::equal(a.narrow(0, 0, H3), b)) return false;
    }
    return true;
  }

  // The int32 requantization of a two-pair product (kernels.h LimbRequant32) from the arrays
  // `arrays`_l32_* (n values) and the zero points `acc`_l32_zp ([3H]), checked: the GEMM is the
  // 16-bit activation whole times the lo (offset 128) and hi (scale 256) limbs, pow2, and every
  // channel's R in [8, 29], 0 <= bias_lo < 2^R and |bias_hi| + 2^25 < 2^31.
  cpu::LimbRequant32 limb32(const std::string& arrays, const std::string& acc, int64_t n, const Gemm& g) const {
    QGRU_CHECK(pow2_ && g.direct && g.P == 2 && g.act_limb[0] == 0 && g.act_limb[1] == 0 && g.weight_limb[0] == 0 &&
                    g.weight_limb[1] == 1 && g.scale[0] == 1 && g.weight_offset[0] == 128 && g.scale[1] == 256 &&
                    g.weight_offset[1] == 0 && ones_col_ > 0,
                "qgru cpu: limb32 for ", acc, " needs pow2 and two limb pairs of a 16-bit activation taken whole");
    const auto arr = [&](const std::string& k, int64_t len) {
      const at::Tensor& x = lt_.tensor(k);
      QGRU_CHECK(x.scalar_type() == at::kInt && x.is_contiguous() && x.numel() == len, "qgru cpu: '", k,
                  "' must be contiguous int32 [", len, "]");
      return x.data_ptr<int32_t>();
    };
    const int32_t* bh = arr(arrays + "_l32_bias_hi", n);
    const int32_t* bl = arr(arrays + "_l32_bias_lo", n);
    const int32_t* sh = arr(arrays + "_l32_rshift", n);
    const int32_t* zp = arr(acc + "_l32_zp", 3 * H_);
    for (int64_t i = 0; i < n; ++i)
      QGRU_CHECK(sh[i] >= 8 && sh[i] <= 29 && bl[i] >= 0 && bl[i] < (int32_t(1) << sh[i]) &&
                      std::abs((int64_t)bh[i]) + (int64_t(1) << 25) < (int64_t(1) << 31),
                  "qgru cpu: '", arrays, "_l32_*' entry ", i, " is outside the int32 requantization's bounds");
    const int64_t lo = lt_.value(acc + "_lo"), hi = lt_.value(acc + "_hi");
    for (int64_t i = 0; i < 3 * H_; ++i)
      QGRU_CHECK(zp[i] >= lo && zp[i] <= hi, "qgru cpu: '", acc, "_l32_zp' entry ", i, " is outside ", acc, "'s range");
    QGRU_CHECK(lo >= -(int64_t(1) << 16) && hi < (int64_t(1) << 16), "qgru cpu: limb32 needs ", acc, " of at most 16 bits");
    return cpu::LimbRequant32{bh, bl, sh, zp, (int32_t)lo, (int32_t)hi};
  }

  // Whether the int32 cell reads wide accumulators ("acc_wide" = 1; maps without the value: 0).
  bool wide_accumulators() const {
    auto it = lt_.v.find("acc_wide");
    return it != lt_.v.end() && it->second != 0;
  }

  // The one-row Layer (made on first use), or nullptr where set_one_row named none. Shared: a
  // call keeps the one it runs on alive through a set_one_row that replaces it.
  std::shared_ptr<CpuLayer> one_row_layer() {
    std::lock_guard<std::mutex> lock(mu_);
    if (one_row_spec_.isa.empty()) return nullptr;
    if (!one_row_) {
      c10::InferenceMode normal_tensors(false);  // it packs weights kept across calls
      one_row_ = std::make_shared<CpuLayer>(one_row_spec_.tensors, one_row_spec_.values, one_row_spec_.isa);
      one_row_spec_.tensors.clear();  // the Layer holds its own copies
    }
    return one_row_;
  }

  struct Workspace {
    int64_t rows = 0, N = 0;
    std::vector<at::Tensor> x_act, Gx, h_act, Gh;
    std::vector<at::Tensor> h_fused[2];  // fused path: h as one activation limb, read by step t, written for t + 1
    int cur = 0;                         // which h_fused the next step reads
    Reused<StepCounters> counters;       // fused_steps: per step of a chunk
    Reused<TaskSlot> slots;              // fused_steps: per step and thread
    at::Tensor dwx;  // [rows, 3H] Wx - Z_Wx of the current chunk of steps
  };

  // Buffers for chunks of `rows` rows of x and batches of N rows; with_wx: also W.x's (GEMM output
  // and Wx - Z_Wx), which the fused path with W.x inside the steps does without. Row counts are
  // whole row tiles plus one (the GemmArgs contract; a fused step's last row tile may read up to
  // 15 rows past its step's rows).
  void ensure_workspace(int64_t rows, int64_t N, bool with_wx) {
    c10::InferenceMode normal_tensors(false);  // kept across calls: never inference tensors (reuse_or_empty)
    auto i32 = at::TensorOptions().dtype(at::kInt);
    if (ws_.rows < rows) {
      ws_.x_act.clear();
      ws_.Gx.clear();
      ws_.dwx = at::Tensor();
      const int64_t br = round_up(rows, kTileRows) + kTileRows;
      // zeroed once: the K padding must read as 0 in every GEMM and is never written
      for (int i = 0; i < wx_.n_act; ++i) ws_.x_act.push_back(at::zeros({br, wx_.lda}, at::TensorOptions().dtype(wx_.act_type())));
      ws_.rows = rows;
    }
    if (with_wx && !ws_.dwx.defined()) {
      for (int64_t p = 0; p < wx_.P; ++p)
        ws_.Gx.push_back(at::empty({ws_.x_act[0].size(0), wx_.groups * k_->group}, i32));
      ws_.dwx = at::empty({ws_.rows, 3 * H_}, i32);
    }
    if (ws_.N < N) {
      ws_.h_act.clear();
      ws_.Gh.clear();
      const int64_t br = round_up(N, kTileRows);
      const auto opt = at::TensorOptions().dtype(rh_.act_type());
      if (fused_) {
        for (auto& b : ws_.h_fused) b = {at::zeros({br, rh_.lda}, opt)};
      } else {
        for (int i = 0; i < rh_.n_act; ++i) ws_.h_act.push_back(at::zeros({br, rh_.lda}, opt));
        for (int64_t p = 0; p < rh_.P; ++p) ws_.Gh.push_back(at::empty({br, rh_.groups * k_->group}, i32));
      }
      ws_.N = N;
    }
  }

  // Steps t0 .. t0 + tc - 1 on the fused path: per step one parallel pass over tasks (block of
  // kTaskUnits hidden units, tile of 16 batch rows), each computing its R.h, with xacc its W.x
  // too (from x's activation rows of the chunk in ws_.x_act; else Wx - Z_Wx is read from
  // ws_.dwx), and then the cell on them while they are in L1.
  // level (xacc, a layer with x levels): every token's, at t N + n; else nullptr.
  // floats.out (not nullptr): step t0 + tc - 1's tasks also write their rows' and units' new state
  // as floats there; floats.seq (not nullptr): every step's tasks write their output as floats
  // there (seq + t N H), not into `out`.
  void fused_steps(int64_t t0, int64_t tc, int64_t N, int32_t* state, int32_t* out, const int64_t* lengths,
                   bool xacc, const int32_t* level, StateFloats floats = StateFloats{}) {
    constexpr int64_t W = kTaskUnits, T16 = kTileRows;
    const int64_t H = H_, HB = ceil_div(H, W), RT = ceil_div(N, T16), G = k_->group, ab = k_->act_bytes;
    const int64_t lda = rh_.lda, ldx = wx_.lda;
    const uint8_t* gates_x = wx_.gates.data_ptr<uint8_t>();
    const uint8_t* gates_h = rh_.gates.data_ptr<uint8_t>();
    // One parallel region for all tc steps, not one per step (measured 3-7% faster): a thread that
    // runs out of tasks of step t waits until every task of step t is done (they write the h that
    // step t + 1 reads), then takes tasks of step t + 1. Waiting on the count of finished tasks,
    // not of arrived threads, holds however many threads the region actually gets (one, nested).
    // Each thread owns a contiguous share of a step's tasks (tasks are ordered unit block first,
    // so a share is a range of weight columns): step after step it reads the same weights, which
    // stay in its own L2 (on a 1 MB L2 the whole layer's do not fit: H = 512 holds 1.2 MB). Tasks
    // are still handed out one at a time and a thread that runs out takes the rest of another's
    // share: on a shared 2-core VM the threads' speeds differ from step to step, and fixed halves
    // left one waiting (~10% of the step time).
    const int64_t n_tasks = HB * RT;
    // threads: at most one per task, and one per kMinStepMacs of a step's work (below that the
    // wait between steps costs more than a second thread saves)
    const int64_t step_macs = N * 3 * H * (rh_.K + (xacc ? wx_.K : 0));
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>({n_tasks, (int64_t)at::get_num_threads(),
                                                                    step_macs / kMinStepMacs}));
    const int cur0 = ws_.cur;
    // kept in the workspace (a streaming step would otherwise make two aligned heap blocks per call)
    StepCounters* counters = ws_.counters.get(tc);
    TaskSlot* slots = ws_.slots.get(tc * threads);
    for (int64_t t = 0; t < tc; ++t) {
      counters[t].done.store(0, std::memory_order_relaxed);
      for (int64_t m = 0; m < threads; ++m) {
        slots[t * threads + m].next.store(m * n_tasks / threads, std::memory_order_relaxed);
        slots[t * threads + m].end = (m + 1) * n_tasks / threads;
      }
    }
    const char* x_base = xacc ? static_cast<const char*>(ws_.x_act[0].data_ptr()) : nullptr;
    const bool prof = profiling();
    parallel_for(0, threads, 1, [&](int64_t home, int64_t) {
      k_->thread_init();
      alignas(64) int32_t acc_x[3 * T16 * W], acc_h[3 * T16 * W];  // [gate][row][unit]
      uint8_t active[T16];
      int64_t ns_wx = 0, ns_rh = 0, ns_cell = 0, ns_wait = 0, tp = prof ? now_ns() : 0;
      const auto lap = [&](int64_t& into) {
        if (!prof) return;
        const int64_t t = now_ns();
        into += t - tp;
        tp = t;
      };
      for (int64_t t = t0; t < t0 + tc; ++t) {
        const int cur = (cur0 + (int)(t - t0)) & 1;  // h is double-buffered: read one, write the other
        const char* h_in = static_cast<const char*>(ws_.h_fused[cur][0].data_ptr());
        char* h_out = static_cast<char*>(ws_.h_fused[1 - cur][0].data_ptr());
        const char* x_t = xacc ? x_base + (t - t0) * N * ldx * ab : nullptr;
        const int32_t* dwx_t = xacc ? nullptr : ws_.dwx.data_ptr<int32_t>() + (t - t0) * N * 3 * H;
        int32_t* out_t = floats.seq == nullptr ? out + t * N * H : nullptr;
        float* seq_t = floats.seq == nullptr ? nullptr : floats.seq + t * N * H;
        StepCounters& step = counters[t - t0];
        for (int64_t m = 0; m < threads; ++m) {
          TaskSlot& share = slots[(t - t0) * threads + (home + m) % threads];
          for (int64_t i; (i = share.next.fetch_add(1, std::memory_order_relaxed)) < share.end;) {
            const int64_t b = i / RT, n0 = (i % RT) * T16;
            const int64_t rows = std::min(T16, N - n0), j0 = b * W, nj = std::min(W, H - j0);
            const int64_t g0 = (j0 / G) * 3, g1 = g0 + 3 * ceil_div(nj, G);
            lap(ns_wait);
            // the GEMMs over the tile's rows up to its last active one (rows past their length
            // only carry their state: the cell reads no accumulator of theirs), none when every
            // row is done: rows sorted by length (the module's packed calls) skip finished tiles
            int64_t live = rows;
            for (int64_t r = 0; r < rows; ++r) active[r] = lengths == nullptr || t < lengths[n0 + r];
            while (live > 0 && !active[live - 1]) --live;
            if (xacc && live > 0)
              k_->gemm(cpu::GemmArgs{x_t + n0 * ldx * ab, ldx, live, wx_.K, gates_x, g0, g1, acc_x, W, T16 * W});
            lap(ns_wx);
            if (live > 0)
              k_->gemm(cpu::GemmArgs{h_in + n0 * lda * ab, lda, live, rh_.K, gates_h, g0, g1, acc_h, W, T16 * W});
            lap(ns_rh);
            // rows on level 0 (the static grid, level0_static_): the cell as without levels
            k_->cell_tile(cpu::CellTileArgs{&cell_, &acc_x_, j0, nj, rows, active, xacc ? acc_x : dwx_t + n0 * 3 * H,
                                           acc_h, state + n0 * H, out_t != nullptr ? out_t + n0 * H : nullptr,
                                           h_in + n0 * lda * ab, h_out + n0 * lda * ab, lda, pow2_, acc32_, xacc,
                                           &acc_x32_, level != nullptr ? level + t * N + n0 : nullptr,
                                           level0_static_ ? 1 : 0, wide_ ? 1 : 0,
                                           seq_t != nullptr ? seq_t + n0 * H : nullptr, floats.scale, floats.zp});
            if (floats.out != nullptr && t == t0 + tc - 1)
              for (int64_t r = 0; r < rows; ++r) {
                const int32_t* sr = state + (n0 + r) * H + j0;
                float* fr = floats.out + (n0 + r) * H + j0;
                for (int64_t c = 0; c < nj; ++c) fr[c] = dequantize_value(sr[c], floats.scale, floats.zp);
              }
            lap(ns_cell);
            step.done.fetch_add(1, std::memory_order_release);  // publishes this task's h_out, state, out
          }
        }
        // (after the region's last step its end, a barrier, is the wait: nothing reads this step's
        // h_out, state or out before the region returns)
        if (t + 1 < t0 + tc) step.wait_all(n_tasks);
      }
      if (prof) {
        lap(ns_wait);
        add_phase(kPhWx, ns_wx);
        add_phase(kPhRh, ns_rh);
        add_phase(kPhCell, ns_cell);
        add_phase(kPhWait, ns_wait);
      }
    });
    ws_.cur = (cur0 + (int)tc) & 1;
  }

  // Wx - Z_Wx of `rows` input rows into ws_.dwx (seed 001 steps 1-2); level: row r's x level at
  // level[r] (a layer with levels), else nullptr.
  void input_chunk(const int32_t* src, int64_t rows, const int32_t* level) {
    PhaseScope scope(kPhWx);
    wx_.to_act(src, rows, I_, ws_.x_act);
    const LimbProducts lp = wx_.run(ws_.x_act, ws_.Gx, rows, ones_col_);
    int32_t* o = ws_.dwx.data_ptr<int32_t>();
    parallel_for(0, rows, std::max<int64_t>(1, kMinParallelWork * 4 / (3 * H_)), [&](int64_t r0, int64_t r1) {
      k_->requant_rows(
          // (wide accumulators: the int64 requantization, whose integers the wide cell's are)
          cpu::RequantRowsArgs{&acc_x_, &acc_x32_, &lp, r0, r1, 3 * H_, o, (int)wx_.P, pow2_, acc32_ && !wide_, level,
                               lx32_ ? &lx_ : nullptr});
    });
  }

  // Steps t0 .. t0 + tc - 1, reading their Wx from ws_.dwx (seed 001 step 3): per step the R.h
  // GEMMs, then the cell pass, which also writes the next step's h limbs.
  void recurrent_steps(int64_t t0, int64_t tc, int64_t N, int32_t* s, int32_t* out, const int64_t* lengths) {
    std::vector<void*> limb_ptrs;
    for (auto& l : ws_.h_act) limb_ptrs.push_back(l.data_ptr());
    // at least kMinParallelWork elements per thread: below that a fork/join costs more than it saves
    const int64_t grain = std::max<int64_t>(1, kMinParallelWork / H_);
    for (int64_t t = t0; t < t0 + tc; ++t) {
      const int64_t tr = profiling() ? now_ns() : -1;
      const LimbProducts lp = rh_.run(ws_.h_act, ws_.Gh, N, ones_col_);
      if (tr >= 0) add_phase(kPhRh, now_ns() - tr);
      PhaseScope cell_scope(kPhCell);
      const int32_t* dwx_t = ws_.dwx.data_ptr<int32_t>() + (t - t0) * N * 3 * H_;
      int32_t* out_t = out + t * N * H_;
      parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        k_->cell_rows(cpu::CellRowsArgs{&cell_, &lp, dwx_t, s, out_t, limb_ptrs.data(), rh_.n_act, h_bits_,
                                        rh_.direct, rh_.lda, n0, n1, lengths, t, (int)rh_.P, pow2_, acc32_,
                                        hybrid_, lh32_ ? &lh_ : nullptr});
      });
    }
  }

  LayerTensors lt_;
  std::mutex mu_;
  const Kernels* k_ = nullptr;
  OneRowSpec one_row_spec_;          // set_one_row
  std::shared_ptr<CpuLayer> one_row_;  // made from it on the first one-row call
  bool fused_ = false;
  Workspace ws_;
  at::Tensor out_;  // the last output, reused once its caller drops it (reuse_or_empty)
  int64_t H_, I_, ones_col_;
  int64_t levels_ = 0;  // x levels (0: none)
  bool level0_static_ = false;  // level 0's W.x requantization is the static grid's (level0_is_static)
  int32_t x_bits_, h_bits_;
  bool pow2_, acc32_;
  bool wide_ = false;  // the int32 cell with wide accumulators (cell_loops.h cell_tile, WIDE), acc32_ set too
  bool hybrid_ = false;  // the hybrid cell (cell_loops.h cell_block_hybrid), acc32_ unset
  bool lx32_ = false, lh32_ = false;  // W.x's / R.h's two-pair products requantized in int32 (limb32)
  cpu::LimbRequant32 lx_{}, lh_{};
  Gemm wx_, rh_;
  AccRequant acc_x_;
  AccRequant32 acc_x32_;
  CellParams cell_;
};

// ---------------------------------------------------------------------------------------------
// The float boundary and the layer-to-layer requantization, one pass each (the golden model's
// primitives.quantize / dequantize / golden.requantize_input, same float64 arithmetic)
// ---------------------------------------------------------------------------------------------
// The path's quantize_f32 / quantize_f64 (csrc/cpu/quantize_block.h) over blocks of elements in
// parallel; false if any element is NaN.
template <typename scalar_t>
bool quantize_loop(const Kernels* k, const scalar_t* x, int32_t* q, int64_t n, double scale, int64_t zp, Range r) {
  std::atomic<bool> nan{false};
  parallel_for(0, n, 4096, [&](int64_t b, int64_t e) {
    const bool ok = std::is_same<scalar_t, float>::value
                        ? k->quantize_f32((const float*)(x + b), q + b, e - b, scale, zp, r.lo, r.hi)
                        : k->quantize_f64((const double*)(x + b), q + b, e - b, scale, zp, r.lo, r.hi);
    if (!ok) nan = true;
  });
  return !nan;
}

const Kernels* kernels_for(const std::string& isa) {
  try {
    return cpu::select_isa(isa);
  } catch (const std::runtime_error& e) {
    QGRU_CHECK_VALUE(false, e.what());
  }
  return nullptr;
}

// x as float64 if it is, else float32, contiguous and with any negative view resolved (what
// quantize reads)
at::Tensor float_contiguous(const at::Tensor& x, const char* what) {
  QGRU_CHECK(x.is_floating_point() && x.device().is_cpu(), "qgru cpu: ", what, " must be a float CPU tensor, got ",
              x.scalar_type(), " on ", x.device());
  const bool f32_or_f64 = x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble;
  if (f32_or_f64 && x.is_contiguous() && !x.is_neg()) return x;
  const at::Tensor y = x.resolve_neg();
  return (f32_or_f64 ? y : y.to(at::kFloat)).contiguous();
}

// Elements [first, first + n) of xc (float_contiguous) -> int32 on (scale, zp, bits) into q; NaN
// is an error (it has no quantized value). The caller checks that xc holds them.
void quantize_into(const at::Tensor& xc, int64_t first, int64_t n, double scale, int64_t zp, int64_t bits,
                   const char* what, const Kernels* k, int32_t* q) {
  check_quantize_args("qgru cpu quantize", scale, zp, bits);  // qgru_layer.h
  const Range r = signed_range((int32_t)bits);
  const bool ok = xc.scalar_type() == at::kDouble
                      ? quantize_loop(k, xc.data_ptr<double>() + first, q, n, scale, zp, r)
                      : quantize_loop(k, xc.data_ptr<float>() + first, q, n, scale, zp, r);
  QGRU_CHECK_VALUE(ok, "QuantGRU ", what, " contains NaN, which has no quantized value ",
                    "(out-of-range and infinite values saturate)");
}

// The int32 buffers of more than kThreadBufferBytes that calls reuse (stack_forward's scratch,
// quantize's outputs): one pool for the process, not one set per calling thread, which kept each
// thread's largest call's buffers until the thread ended (eight pool threads that had each made
// one call of T=1000 N=64 I=H=128 kept 254 MB, never given back). The pool holds at most
// kPoolBytes of buffers, the most recently used kept; a buffer is free while the pool holds the
// only reference to it and to its storage (no call's handle, no caller's tensor or view of it
// alive), so dropping one that a call still uses only frees it once that call lets go. A buffer
// larger than kPoolBytes is not kept: its call frees it. Reused buffers spare large calls their
// pages' faults (reuse_or_empty).
class BufferPool {
 public:
  static BufferPool& instance() {
    static BufferPool* pool = new BufferPool();  // never destroyed: thread_local buffers may outlive statics
    return *pool;
  }
  // A 1-D int32 buffer of at least n values (64-byte aligned, rounded up to 16 values), the caller's
  // until it drops it: the smallest free one that holds n, or (exact) one of exactly this size; else
  // fresh. Made outside InferenceMode (reuse_or_empty says why).
  at::Tensor take(int64_t n, bool exact) {
    const int64_t len = round_up(std::max<int64_t>(n, 16), 16);
    std::vector<at::Tensor> evicted;  // freed after the lock is released
    {
      std::lock_guard<std::mutex> lock(mu_);
      int64_t best = -1;
      for (int64_t i = 0; i < (int64_t)bufs_.size(); ++i) {
        const int64_t m = bufs_[i].numel();
        if (m < len || (exact && m != len) || !free(bufs_[i])) continue;
        if (best < 0 || m < bufs_[best].numel()) best = i;
      }
      if (best >= 0) {
        at::Tensor buf = std::move(bufs_[best]);
        bufs_.erase(bufs_.begin() + best);
        bufs_.push_back(buf);  // the most recently used last
        return buf;
      }
    }
    at::Tensor buf;
    {
      c10::InferenceMode normal_tensors(false);
      buf = at::empty({len}, at::TensorOptions().dtype(at::kInt));
    }
    if (len * (int64_t)sizeof(int32_t) > kPoolBytes) return buf;
    std::lock_guard<std::mutex> lock(mu_);
    bufs_.push_back(buf);
    bytes_ += len * (int64_t)sizeof(int32_t);
    while (bytes_ > kPoolBytes) {  // the least recently used go (the new one fits alone)
      bytes_ -= bufs_.front().numel() * (int64_t)sizeof(int32_t);
      evicted.push_back(std::move(bufs_.front()));
      bufs_.erase(bufs_.begin());
    }
    return buf;
  }

  // In a child of fork (cpu_api::mark_forked_child, while the child has one thread): a fresh
  // mutex and no buffers. The parent's other threads may have held the lock, or been changing the
  // list, when it forked; they do not exist here. The old list is left as it is, never freed (its
  // buffers would be freed under a thread that no longer exists), as build.py leaves old Layers.
  void after_fork() {
    new (&mu_) std::mutex();
    new (&bufs_) std::vector<at::Tensor>();
    bytes_ = 0;
  }

 private:
  BufferPool() = default;
  // Only the pool holds b: no copy of its handle (a Scratch32 holds one while its call runs) and no
  // other tensor or view on its storage (quantize hands out views).
  static bool free(const at::Tensor& b) { return b.use_count() == 1 && b.storage().use_count() == 1; }
  std::mutex mu_;
  std::vector<at::Tensor> bufs_;
  int64_t bytes_ = 0;
};

// An int32 tensor of `sizes` from one of a calling thread's kQuantizeBuffers cached buffers
// (reuse_or_empty): the one of these sizes that no caller holds any more, else a free one replaced.
// Above kThreadBufferBytes, a view of a BufferPool buffer of just that size instead (a thread keeps
// no large buffer).
at::Tensor reuse_slot(at::Tensor (&cache)[kQuantizeBuffers], at::IntArrayRef sizes) {
  const int64_t n = c10::multiply_integers(sizes);
  if (n * (int64_t)sizeof(int32_t) > kThreadBufferBytes) {
    const at::Tensor buf = BufferPool::instance().take(n, /*exact=*/true);
    c10::InferenceMode normal_tensors(false);
    return buf.narrow(0, 0, n).view(sizes);
  }
  at::Tensor* slot = &cache[0];
  for (auto& c : cache) {
    if (c.defined() && c.sizes() == sizes && c.storage().use_count() == 1) { slot = &c; break; }
    if (!c.defined() || c.storage().use_count() == 1) slot = &c;  // free: may be replaced
  }
  return reuse_or_empty(*slot, sizes);
}

// A calling thread's int32 scratch buffer (thread_local, never handed out), 64-byte aligned. Up
// to kThreadBufferBytes its own, grown when asked for more, else kept: a streaming step makes,
// locks and frees nothing. Larger: a BufferPool buffer, held until release() (stack_forward's
// end), so that a thread keeps no large buffer between calls.
class Scratch32 {
 public:
  int32_t* get(int64_t n) {
    if (n * (int64_t)sizeof(int32_t) > kThreadBufferBytes) {
      big_ = BufferPool::instance().take(n, /*exact=*/false);
      return big_.data_ptr<int32_t>();
    }
    if (n > cap_) {
      const int64_t cap = round_up(std::max<int64_t>(n, 16), 16);
      int32_t* p = static_cast<int32_t*>(std::aligned_alloc(64, (size_t)cap * sizeof(int32_t)));
      if (p == nullptr) throw std::bad_alloc();
      std::free(p_);
      p_ = p;
      cap_ = cap;
    }
    return p_;
  }
  void release() { big_.reset(); }
  Scratch32() = default;
  Scratch32(const Scratch32&) = delete;
  Scratch32& operator=(const Scratch32&) = delete;
  ~Scratch32() { std::free(p_); }

 private:
  int32_t* p_ = nullptr;
  int64_t cap_ = 0;
  at::Tensor big_;  // this call's BufferPool buffer, if it needed one
};

// float -> int32 on (scale, zp, bits), into a buffer reused per calling thread.
at::Tensor quantize(const at::Tensor& x_in, double scale, int64_t zp, int64_t bits, const char* what,
                    const Kernels* k) {
  const at::Tensor x = float_contiguous(x_in, what);
  // per calling thread (no other thread sees a buffer being reused), a few shapes: a module call
  // quantizes its input and then h0 while still holding the input's result
  thread_local at::Tensor cache[kQuantizeBuffers];
  at::Tensor q = reuse_slot(cache, x.sizes());
  quantize_into(x, 0, x.numel(), scale, zp, bits, what, k, q.data_ptr<int32_t>());
  return q;
}

// golden.quantize_levels over tokens [0, tokens) of I values each: per token its minimum and
// maximum (in its own float type, exact), its level (select_level, qgru_fixedpoint.h) and its
// values on that level's grid with the path's quantize; false if any value is NaN.
template <typename scalar_t>
bool quantize_levels_loop(const Kernels* k, const scalar_t* x, int32_t* q, int32_t* level, int64_t tokens, int64_t I,
                          const XLevelGrid& g, int64_t zp, Range r) {
  std::atomic<bool> nan{false};
  // the path's kernel (quantize_block.h quantize_levels_block): min and max in its float vectors
  parallel_for(0, tokens, std::max<int64_t>(1, 4096 / I), [&](int64_t b, int64_t e) {
    const bool ok = std::is_same<scalar_t, float>::value
                        ? k->quantize_levels_f32((const float*)x + b * I, q + b * I, level + b, e - b, I, g, zp,
                                                 r.lo, r.hi)
                        : k->quantize_levels_f64((const double*)x + b * I, q + b * I, level + b, e - b, I, g, zp,
                                                 r.lo, r.hi);
    if (!ok) nan = true;
  });
  return !nan;
}

// quantize_levels' argument checks: every level's grid, and x [..., I] with I >= 1.
void check_levels_args(const at::Tensor& x, const XLevelGrid& g, int64_t zp, int64_t bits, const char* what) {
  for (int j = 0; j < g.count; ++j) check_quantize_args("qgru cpu quantize_levels", g.scale[j], zp, bits);
  QGRU_CHECK(x.dim() >= 1 && x.size(-1) >= 1, "qgru cpu quantize_levels: ", what,
              " must have at least one value per token (its last axis)");
}

// xc (float_contiguous, [..., I], checked by check_levels_args) -> q [..., I] and each token's
// level [...] (int32, the caller's memory): each token on its own x level; NaN is an error (it has
// no quantized value).
void quantize_levels_into(const at::Tensor& xc, const XLevelGrid& g, int64_t zp, int64_t bits, const char* what,
                          const Kernels* k, int32_t* q, int32_t* level) {
  const int64_t I = xc.size(-1), tokens = xc.numel() / I;
  const Range r = signed_range((int32_t)bits);
  const bool ok = xc.scalar_type() == at::kDouble
                      ? quantize_levels_loop(k, xc.data_ptr<double>(), q, level, tokens, I, g, zp, r)
                      : quantize_levels_loop(k, xc.data_ptr<float>(), q, level, tokens, I, g, zp, r);
  QGRU_CHECK_VALUE(ok, "QuantGRU ", what, " contains NaN, which has no quantized value ",
                    "(out-of-range and infinite values saturate)");
}

// float x [..., I] -> (q int32 [..., I], level int32 [...]): each token on its own x level; NaN is
// an error (it has no quantized value).
std::tuple<at::Tensor, at::Tensor> quantize_levels(const at::Tensor& x_in, const XLevelGrid& g, int64_t zp,
                                                   int64_t bits, const char* what, const Kernels* k) {
  check_levels_args(x_in, g, zp, bits, what);
  const at::Tensor x = float_contiguous(x_in, what);
  // per calling thread, reused once dropped (as quantize's: a streaming call's allocations count)
  thread_local at::Tensor q_cache[kQuantizeBuffers], level_cache[kQuantizeBuffers];
  at::Tensor q = reuse_slot(q_cache, x.sizes());
  at::Tensor level = reuse_slot(level_cache, x.sizes().slice(0, x.dim() - 1));
  quantize_levels_into(x, g, zp, bits, what, k, q.data_ptr<int32_t>(), level.data_ptr<int32_t>());
  return {q, level};
}

// int32 src[0, n) -> float32 dst: (q - zp) * scale in float64, rounded once to float32 (as
// primitives.dequantize).
void dequantize_into(const int32_t* src, int64_t n, double scale, int64_t zp, float* dst) {
  // dequantize_value (qgru_fixedpoint.h): an int32 -> double conversion, which the baseline x86-64
  // target vectorises (int64 -> double it does not: that loop measured 6% of an AMX call)
  const double z = (double)zp;
  parallel_for(0, n, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = dequantize_value(src[i], scale, z);
  });
}

at::Tensor dequantize(const at::Tensor& q_in, double scale, int64_t zp) {
  QGRU_CHECK(q_in.device().is_cpu(), "qgru cpu dequantize: a CPU tensor expected");
  const at::Tensor q = int32_contiguous(q_in);
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  dequantize_into(q.data_ptr<int32_t>(), q.numel(), scale, zp, out.data_ptr<float>());
  return out;
}

// golden.requantize_input on src[0, n) into dst (arguments checked by check_requantize_args).
void requantize_into(const int32_t* src, int64_t n, int64_t from_zp, int64_t mult, int64_t shift, int64_t to_zp,
                     int64_t to_bits, int32_t* dst) {
  const Range r = signed_range((int32_t)to_bits);
  parallel_for(0, n, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = (int32_t)saturate(rounding_mul_shift((int64_t)src[i] - from_zp, mult,
                                                                                  (int32_t)shift) + to_zp, r);
  });
}

// golden.requantize_input: sat(rescale(q - from_zp) + to_zp, to_bits), per-tensor factor.
at::Tensor requantize(const at::Tensor& q_in, int64_t from_zp, int64_t mult, int64_t shift, int64_t to_zp,
                      int64_t to_bits) {
  QGRU_CHECK(q_in.device().is_cpu(), "qgru cpu requantize: a CPU tensor expected");
  check_requantize_args("qgru cpu requantize", from_zp, mult, shift, to_zp, to_bits);
  QGRU_CHECK(!q_in.is_floating_point(), "qgru cpu requantize: an integer tensor expected");
  const at::Tensor q = int32_contiguous(q_in);
  at::Tensor out = at::empty(q.sizes(), q.options());
  requantize_into(q.data_ptr<int32_t>(), q.numel(), from_zp, mult, shift, to_zp, to_bits, out.data_ptr<int32_t>());
  return out;
}

// A whole unidirectional stack without padding in one call: quantize the input and each layer's
// h0, run the layers (layer l > 0 on layer l - 1's output moved onto its x grid), dequantize the
// last layer's output and every h_n. The same functions as the separate calls (quantize, the
// Layer, requantize, dequantize), minus their Python round trips: for one step of a batch of one
// (streaming) those cost more than the layer. q[l] = (S_x, Z_x, bits_x, S_h, Z_h, bits_h,
// multiplier and shift of S_h,l-1 / S_x,l), the per-tensor values qgru/native/stacks.py reads from the
// layer's parameters. The Stack checked the layers and the values against each other; x and h0
// are checked here, per call.
// levels: layer 0's x levels (count 0: none), whose input is quantized per token on them.
std::tuple<at::Tensor, at::Tensor> stack_forward(const std::vector<std::shared_ptr<CpuLayer>>& layers,
                                                 const at::Tensor& x, const at::Tensor& h0,
                                                 const std::vector<std::vector<double>>& q, const XLevelGrid& levels) {
  const int64_t L = (int64_t)layers.size();
  QGRU_CHECK(L > 0 && (int64_t)q.size() == L && h0.dim() == 3 && h0.size(0) == L,
              "qgru cpu stack_forward: one Layer, one parameter row and one h0 per layer");
  const int64_t H = layers[0]->hidden_size();
  QGRU_CHECK(x.dim() == 3 && x.size(2) == layers[0]->input_size(), "qgru cpu stack_forward: x must be [T, N, ",
              layers[0]->input_size(), "]");
  const int64_t N = x.size(1);
  QGRU_CHECK(h0.size(1) == N && h0.size(2) == H, "qgru cpu stack_forward: h0 must be [", L, ", ", N, ", ", H, "]");
  const Kernels* k = layers[0]->kernels();
  const PhaseScope whole(kPhStack);
  if (profiling()) g_profile_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t T = x.size(0), I = x.size(2);
  // the quantized input, each layer's state and output: the calling thread's scratch buffers,
  // kept from call to call up to kThreadBufferBytes each, larger ones the BufferPool's for this
  // call (none leaves this function; a tensor made or aliased per call costs a streaming step
  // ~0.3 us each)
  thread_local Scratch32 s_qx, s_level, s_state, s_out;
  // their large buffers go back to the pool when this call ends, whichever way it ends
  struct Release {
    Scratch32* s[4];
    ~Release() {
      for (Scratch32* p : s) p->release();
    }
  } release{{&s_qx, &s_level, &s_state, &s_out}};
  int64_t tq = profiling() ? now_ns() : -1;
  const at::Tensor xc = float_contiguous(x, "input");
  int32_t* qx = s_qx.get(T * N * std::max(I, H));  // layer 0's input, then each later layer's
  int32_t* level = nullptr;
  if (levels.count > 0) {
    check_levels_args(xc, levels, (int64_t)q[0][1], (int64_t)q[0][2], "input");
    level = s_level.get(T * N);
    quantize_levels_into(xc, levels, (int64_t)q[0][1], (int64_t)q[0][2], "input", k, qx, level);
  } else {
    quantize_into(xc, 0, T * N * I, q[0][0], (int64_t)q[0][1], (int64_t)q[0][2], "input", k, qx);
  }
  // h0 is read and h_n written in place, layer by layer (no per-layer views of them)
  const at::Tensor h0c = float_contiguous(h0, "h0");
  at::Tensor h_n = at::empty({L, N, H}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor y = at::empty({T, N, H}, at::TensorOptions().dtype(at::kFloat));
  bool y_written = false;  // by the last layer's fused steps
  int32_t* out = s_out.get(T * N * H);
  int32_t* state = s_state.get(N * H);  // each layer's own, updated
  for (int64_t l = 0; l < L; ++l) {
    if (l > 0) {
      tq = profiling() ? now_ns() : -1;
      check_requantize_args("qgru cpu requantize", (int64_t)q[l - 1][4], (int64_t)q[l][6], (int64_t)q[l][7],
                            (int64_t)q[l][1], (int64_t)q[l][2]);
      requantize_into(out, T * N * H, (int64_t)q[l - 1][4], (int64_t)q[l][6], (int64_t)q[l][7], (int64_t)q[l][1],
                      (int64_t)q[l][2], qx);
    }
    quantize_into(h0c, l * N * H, N * H, q[l][3], (int64_t)q[l][4], (int64_t)q[l][5], "h0", k, state);
    if (tq >= 0) add_phase(kPhQuantize, now_ns() - tq);
    float* h_l = h_n.data_ptr<float>() + l * N * H;
    // the fused path writes h_n's floats in its last step's tasks, and the last layer's output as
    // floats in every step's (its int32 output is then not written: nothing reads it); else one
    // pass here, and one for the output below
    const bool last = l == L - 1;
    const bool floats = layers[l]->run_into(
        qx, T, N, state, nullptr, l == 0 ? level : nullptr, out,
        StateFloats{h_l, last && T > 0 ? y.data_ptr<float>() : nullptr, q[l][3], (double)(int64_t)q[l][4]});
    if (!floats) {
      const PhaseScope deq(kPhDequantize);
      dequantize_into(state, N * H, q[l][3], (int64_t)q[l][4], h_l);
    }
    if (last) y_written = floats;
  }
  const PhaseScope deq(kPhDequantize);
  if (T > 0 && !y_written) {
    // the last step's output is the last layer's final state (no padding here): h_n's floats
    dequantize_into(out, (T - 1) * N * H, q[L - 1][3], (int64_t)q[L - 1][4], y.data_ptr<float>());
    std::copy_n(h_n.data_ptr<float>() + (L - 1) * N * H, N * H, y.data_ptr<float>() + (T - 1) * N * H);
  }
  return {y, h_n};
}

// A stack's Layers and per-layer values, held for its one call per forward: a streaming call
// (one step of a batch of one, ~20 us) then converts no Python lists. The Stack shares the
// ownership of its Layers (the Python objects' shared_ptr holders), so they live as long as it
// does whatever becomes of the list it was made from; each runs one-row calls on its own one-row
// Layer where it has one (CpuLayer::set_one_row). The values are checked once, here, against the
// Layers: each layer takes the previous one's output, quantize's and requantize's ranges, and
// each layer's x bits, state grid and state zero point.
class Stack {
 public:
  // levels: layer 0's x levels as [scale, lo, hi] (golden.XLevels), or empty for a stack without.
  Stack(std::vector<std::shared_ptr<CpuLayer>> layers, std::vector<std::vector<double>> q,
        const std::vector<std::vector<double>>& levels)
      : layers_(std::move(layers)), q_(std::move(q)) {
    check_stack_values("qgru cpu Stack", layers_, q_, [](const CpuLayer&, const CpuLayer&) { return true; });
    levels_ = check_stack_levels("qgru cpu Stack", layers_, levels);
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& h0) const {
    return stack_forward(layers_, x, h0, q_, levels_);
  }

  // The module's one-call entry (qgru/module.py _cpu_one_call): forward where x and h0 are what it
  // takes, else nullopt (the general path then runs, and raises what it must): x a float32 strided
  // CPU tensor [T >= 1, N, I] that is not a negative view; h0 none (zeros) or the same [L, N, H].
  // These checks were the Python entry's; here they cost nanoseconds, not ~1.5 us a streaming call.
  c10::optional<std::tuple<at::Tensor, at::Tensor>> call(const at::Tensor& x, const c10::optional<at::Tensor>& h0) const {
    const int64_t L = (int64_t)layers_.size(), H = layers_[0]->hidden_size();
    const auto takes = [](const at::Tensor& t) {
      return t.defined() && t.scalar_type() == at::kFloat && t.layout() == at::kStrided && t.device().is_cpu() &&
             t.dim() == 3 && !t.is_neg();
    };
    if (!takes(x) || x.size(0) == 0 || x.size(2) != layers_[0]->input_size()) return c10::nullopt;
    const int64_t N = x.size(1);
    if (!h0.has_value()) return stack_forward(layers_, x, at::zeros({L, N, H}, x.options()), q_, levels_);
    if (!takes(*h0) || h0->size(0) != L || h0->size(1) != N || h0->size(2) != H) return c10::nullopt;
    return stack_forward(layers_, x, *h0, q_, levels_);
  }

 private:
  std::vector<std::shared_ptr<CpuLayer>> layers_;
  std::vector<std::vector<double>> q_;
  XLevelGrid levels_{};
};

// One path's GEMM on its own, for the tests: C [rows, M] = A [rows, K] . W [M, K]^T with W int8 and
// A int32 values of the path's activation type (int8, or int16 on a path with int16 operands),
// packed, padded and run as a layer runs them (plain layout; gates: the fused step's per-unit-group
// layout with H = M / 3, unscrambled again). The path computes int32 sums: the caller compares
// with an exact product where that fits int32.
// isa "NAME+int16": that path's int16 sibling (Kernels::act16; an int16 path is its own).
at::Tensor kernel_gemm(const std::string& isa, const at::Tensor& a_in, const at::Tensor& w_in, bool gates) {
  const std::string suffix = "+int16";
  const bool int16 = isa.size() > suffix.size() && isa.compare(isa.size() - suffix.size(), suffix.size(), suffix) == 0;
  const Kernels* k = kernels_for(int16 ? isa.substr(0, isa.size() - suffix.size()) : isa);
  if (int16 && k->act_bytes == 1) {
    QGRU_CHECK_VALUE(k->act16 != nullptr, "kernel_gemm: the '", isa, "' path has no int16 sibling");
    k = k->act16;
  }
  QGRU_CHECK(a_in.device().is_cpu() && w_in.device().is_cpu(), "kernel_gemm: CPU tensors expected");
  QGRU_CHECK(a_in.dim() == 2 && w_in.dim() == 2 && a_in.size(1) == w_in.size(1), "kernel_gemm: A [rows, K], W [M, K]");
  const at::Tensor w = w_in.resolve_neg().to(at::kChar).contiguous();
  const int64_t rows = a_in.size(0), K = a_in.size(1), M = w.size(0);
  QGRU_CHECK(!gates || M % 3 == 0, "kernel_gemm: gates need M = 3 H");
  const int64_t lda = cpu::k_padded(std::max<int64_t>(K, 1)), G = k->group;
  at::Tensor a = at::zeros({round_up(rows, kTileRows), lda}, at::TensorOptions().dtype(k->act_bytes == 2 ? at::kShort : at::kChar));
  a.narrow(0, 0, rows).narrow(1, 0, K).copy_(a_in);
  const int64_t H = M / 3;
  const std::vector<int64_t> ch = gates ? gate_channels(H, G) : plain_channels(M, G);
  const int64_t groups = (int64_t)ch.size() / G;
  at::Tensor packed = at::empty({k->packed_bytes(groups, K)}, at::TensorOptions().dtype(at::kByte));
  k->pack(w.data_ptr<int8_t>(), K, K, ch.data(), groups, packed.data_ptr<uint8_t>());
  at::Tensor c = at::zeros({round_up(rows, kTileRows), groups * G}, at::TensorOptions().dtype(at::kInt));
  k->thread_init();
  if (!gates) {
    k->gemm(cpu::GemmArgs{a.data_ptr(), lda, rows, K, packed.data_ptr<uint8_t>(), 0, groups, c.data_ptr<int32_t>(),
                          c.size(1), 0});
    return c.narrow(0, 0, rows).narrow(1, 0, M).clone();
  }
  // gate layout, one task (16 rows x kTaskUnits units) at a time, as fused_steps runs it
  at::Tensor out = at::zeros({rows, M}, at::TensorOptions().dtype(at::kInt));
  std::vector<int32_t> acc(3 * kTileRows * kTaskUnits);
  auto o = out.accessor<int32_t, 2>();
  for (int64_t n0 = 0; n0 < rows; n0 += kTileRows)
    for (int64_t j0 = 0; j0 < H; j0 += kTaskUnits) {
      const int64_t nj = std::min(kTaskUnits, H - j0), r = std::min(kTileRows, rows - n0);
      const int64_t g0 = (j0 / G) * 3, g1 = g0 + 3 * ceil_div(nj, G);
      k->gemm(cpu::GemmArgs{static_cast<const char*>(a.data_ptr()) + n0 * lda * k->act_bytes, lda, r, K,
                            packed.data_ptr<uint8_t>(), g0, g1, acc.data(), kTaskUnits, kTileRows * kTaskUnits});
      for (int64_t q = 0; q < 3; ++q)
        for (int64_t i = 0; i < r; ++i)
          for (int64_t c2 = 0; c2 < nj; ++c2)
            o[n0 + i][q * H + j0 + c2] = acc[(q * kTileRows + i) * kTaskUnits + c2];
    }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The interface the binding (bind_cpu.cpp) uses: cpu_backend.h
// ---------------------------------------------------------------------------------------------
namespace cpu_api {

void mark_forked_child() {
  qgru::mark_forked_child();
  qgru::BufferPool::instance().after_fork();
}

void profile_enable(bool on) { g_profile.store(on, std::memory_order_relaxed); }
std::vector<int64_t> profile_read(bool reset) {
  std::vector<int64_t> v;
  for (auto& p : g_phase_ns) v.push_back(reset ? p.exchange(0) : p.load());
  v.push_back(reset ? g_profile_calls.exchange(0) : g_profile_calls.load());
  return v;
}
bool forked_child() { return g_forked.load(std::memory_order_relaxed); }

at::Tensor quantize(const at::Tensor& x, double scale, int64_t zp, int64_t bits, const std::string& what,
                    const std::string& isa) {
  return qgru::quantize(x, scale, zp, bits, what.c_str(), qgru::kernels_for(isa));
}
std::tuple<at::Tensor, at::Tensor> quantize_levels(const at::Tensor& x, const std::vector<double>& scale,
                                                   const std::vector<double>& lo, const std::vector<double>& hi,
                                                   int64_t zp, int64_t bits, const std::string& what,
                                                   const std::string& isa) {
  return qgru::quantize_levels(x, level_grid(scale, lo, hi, "qgru cpu quantize_levels"), zp, bits, what.c_str(),
                               qgru::kernels_for(isa));
}
// The level of every token of float x [..., I] by qgru_fixedpoint.h's token_level alone, serially:
// the function the CUDA kernel folds (a NaN counts as 0.0), run on the host for tests against
// golden.select_levels(x.nan_to_num(0.0)).
at::Tensor token_levels(const at::Tensor& x_in, const std::vector<double>& scale, const std::vector<double>& lo,
                        const std::vector<double>& hi) {
  const XLevelGrid g = qgru::level_grid(scale, lo, hi, "qgru cpu token_levels");
  QGRU_CHECK(x_in.device().is_cpu() && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kDouble) &&
                  x_in.dim() >= 1 && x_in.size(-1) >= 1,
              "qgru cpu token_levels: a CPU float32 or float64 x with at least one value per token");
  const at::Tensor x = x_in.resolve_conj().resolve_neg().contiguous();
  const int64_t I = x.size(-1), tokens = x.numel() / I;
  at::Tensor level = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kInt));
  int32_t* out = level.data_ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t)
    out[t] = x.scalar_type() == at::kDouble ? qgru::token_level(g, x.data_ptr<double>() + t * I, I)
                                            : qgru::token_level(g, x.data_ptr<float>() + t * I, I);
  return level;
}
at::Tensor dequantize(const at::Tensor& q, double scale, int64_t zp) { return qgru::dequantize(q, scale, zp); }
at::Tensor requantize(const at::Tensor& q, int64_t from_zp, int64_t mult, int64_t shift, int64_t to_zp,
                      int64_t to_bits) {
  return qgru::requantize(q, from_zp, mult, shift, to_zp, to_bits);
}
at::Tensor kernel_gemm(const std::string& isa, const at::Tensor& a, const at::Tensor& w, bool gates) {
  return qgru::kernel_gemm(isa, a, w, gates);
}

struct Layer::Impl {
  std::shared_ptr<CpuLayer> layer;
};

Layer::Layer(TensorMap tensors, IntMap values, const std::string& isa)
    : impl(std::make_shared<Impl>(Impl{std::make_shared<CpuLayer>(std::move(tensors), std::move(values), isa)})) {}
std::string Layer::gemm_path() const { return impl->layer->gemm_path(); }
std::string Layer::one_row_path() { return impl->layer->one_row_path(); }
bool Layer::one_row_made() { return impl->layer->one_row_made(); }
void Layer::set_one_row(TensorMap tensors, IntMap values, const std::string& isa) {
  impl->layer->set_one_row(std::move(tensors), std::move(values), isa);
}
std::tuple<at::Tensor, at::Tensor> Layer::forward(const at::Tensor& qx, const at::Tensor& qh0,
                                                  const c10::optional<at::Tensor>& lengths,
                                                  const c10::optional<at::Tensor>& level) {
  return impl->layer->forward(qx, qh0, lengths, level);
}
std::tuple<at::Tensor, at::Tensor> Layer::forward_in_range(const at::Tensor& qx, int64_t qx_bits, const at::Tensor& qh0,
                                                           const c10::optional<at::Tensor>& lengths,
                                                           const c10::optional<at::Tensor>& level) {
  QGRU_CHECK(qx_bits >= 1 && qx_bits <= 31, "qgru cpu: qx_bits ", qx_bits, " outside [1, 31]");
  return impl->layer->forward(qx, qh0, lengths, level, qx_bits);
}
at::Tensor pooled_int32(int64_t n) { return qgru::BufferPool::instance().take(n, /*exact=*/false); }
int64_t Layer::x_levels() const { return impl->layer->x_levels(); }
std::string Layer::cell_kind() const { return impl->layer->cell_kind(); }

struct Stack::Impl {
  qgru::Stack stack;
};

namespace {
std::vector<std::shared_ptr<CpuLayer>> cpu_layers(const std::vector<std::shared_ptr<Layer>>& layers) {
  std::vector<std::shared_ptr<CpuLayer>> out;
  for (const auto& l : layers) out.push_back(l ? l->impl->layer : nullptr);  // None: Stack refuses it
  return out;
}
}  // namespace

Stack::Stack(const std::vector<std::shared_ptr<Layer>>& layers, std::vector<std::vector<double>> values,
             const std::vector<std::vector<double>>& levels)
    : impl(std::make_shared<Impl>(Impl{qgru::Stack(cpu_layers(layers), std::move(values), levels)})) {}
std::tuple<at::Tensor, at::Tensor> Stack::forward(const at::Tensor& x, const at::Tensor& h0) const {
  return impl->stack.forward(x, h0);
}
c10::optional<std::tuple<at::Tensor, at::Tensor>> Stack::call(const at::Tensor& x,
                                                               const c10::optional<at::Tensor>& h0) const {
  return impl->stack.call(x, h0);
}

}  // namespace cpu_api
}  // namespace qgru
