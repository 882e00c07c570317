// Host-side glue shared by the CPU and CUDA bindings: turns the prepared parameter tensors of one
// layer and direction (qgru/native.py, `prepare_layer`) into the plain structs of qgru_cell.h.
// The tensors live on the backend's device and are owned by the Layer object, so the raw pointers
// stay valid for its lifetime.
#pragma once

#include <torch/extension.h>

#include <map>
#include <string>

#include "qgru_cell.h"

namespace qgru {

using TensorMap = std::map<std::string, at::Tensor>;
using IntMap = std::map<std::string, int64_t>;

struct LayerTensors {
  TensorMap t;
  IntMap v;

  const at::Tensor& tensor(const std::string& k) const {
    auto it = t.find(k);
    TORCH_CHECK(it != t.end(), "qgru native layer: missing tensor '", k, "'");
    return it->second;
  }
  int64_t value(const std::string& k) const {
    auto it = v.find(k);
    TORCH_CHECK(it != v.end(), "qgru native layer: missing value '", k, "'");
    return it->second;
  }
  const int64_t* i64(const std::string& k) const {
    const at::Tensor& x = tensor(k);
    TORCH_CHECK(x.scalar_type() == at::kLong && x.is_contiguous(), "qgru native layer: '", k, "' must be contiguous int64");
    return x.data_ptr<int64_t>();
  }
  const int32_t* i32(const std::string& k) const {
    const at::Tensor& x = tensor(k);
    TORCH_CHECK(x.scalar_type() == at::kInt && x.is_contiguous(), "qgru native layer: '", k, "' must be contiguous int32");
    return x.data_ptr<int32_t>();
  }
  Range range(const std::string& k) const { return Range{value(k + "_lo"), value(k + "_hi")}; }
  Rescale rescale(const std::string& k) const {
    return Rescale{i64(k + "_mult"), i32(k + "_shift"), i32(k + "_mult_log2")};
  }
  Table table(const std::string& k) const {
    return Table{i64("table_" + k), (int32_t)value(k + "_table_k"), (int32_t)value(k + "_table_frac"),
                 value(k + "_pre_lo"), value(k + "_zp"), range(k)};
  }
  AccRequant acc(const std::string& k) const {  // k = "Wx" or "Rh"
    return AccRequant{i64(k + "_bias"), rescale(k), i64(k + "_zp"), range(k)};
  }
  // The int32 form, when prepare_layer found it exact for this layer ("acc32" = 1).
  AccRequant32 acc32(const std::string& k) const {
    if (value("acc32") == 0) return AccRequant32{nullptr, nullptr, nullptr, nullptr, 0, 0};
    return AccRequant32{i32(k + "_bias_hi"), i32(k + "_bias_lo"), i32(k + "_rshift"), i32(k + "_zp32"),
                        (int32_t)value(k + "_lo"), (int32_t)value(k + "_hi")};
  }
  SigmoidGate sigmoid(const std::string& k) const {  // k = "r" or "z"
    return SigmoidGate{rescale(k + "_from_wx"), rescale(k + "_from_rh"), value(k + "_pre_zp"), range(k + "_pre"),
                       table(k)};
  }
  Table32 table32(const std::string& k) const {
    return Table32{i64("table_" + k), (int32_t)value(k + "_table_k"),
                   (int32_t)value(k + "_table_frac"), (int32_t)value(k + "_pre_lo"), (int32_t)value(k + "_zp"),
                   (int32_t)value(k + "_lo"), (int32_t)value(k + "_hi")};
  }
  // The int32 cell, when prepare_layer found it exact for this layer ("acc32" = 1).
  Cell32 cell32() const {
    Cell32 c{};
    if (value("acc32") == 0) return c;
    const at::Tensor& ch = tensor("c32_channels");
    TORCH_CHECK(ch.dim() == 3 && ch.size(0) == (value("H") + kCell32Block - 1) / kCell32Block &&
                    ch.size(1) == kCell32Fields && ch.size(2) == kCell32Block,
                "qgru native layer: c32_channels must be [ceil(H/", kCell32Block, "), ", kCell32Fields, ", ",
                kCell32Block, "], got ", ch.sizes());
    c.channels = i32("c32_channels");
    c.zh_rsh = (int32_t)value("zh_rsh");
    c.zg_rsh = (int32_t)value("zg_rsh");
    const char* gates[3] = {"r", "z", "g"};
    for (int q = 0; q < 3; ++q) {
      const std::string g = gates[q];
      c.pre_zp[q] = (int32_t)value(g + "_pre_zp");
      c.pre_lo[q] = (int32_t)value(g + "_pre_lo");
      c.pre_hi[q] = (int32_t)value(g + "_pre_hi");
      c.table[q] = table32(g);
    }
    c.one_z = (int32_t)value("one_z");
    c.h_zp = (int32_t)value("h_zp");
    c.h_lo = (int32_t)value("h_lo");
    c.h_hi = (int32_t)value("h_hi");
    c.wx_lo = (int32_t)value("Wx_lo");
    c.wx_hi = (int32_t)value("Wx_hi");
    c.rh_lo = (int32_t)value("Rh_lo");
    c.rh_hi = (int32_t)value("Rh_hi");
    return c;
  }
  CellParams cell() const {
    CellParams p;
    p.H = value("H");
    p.c32 = cell32();
    p.rh = acc("Rh");
    p.r = sigmoid("r");
    p.z = sigmoid("z");
    p.g_from_wx = rescale("g_from_wx");
    p.g_from_rrh = rescale("g_from_rrh");
    p.g_pre_zp = value("g_pre_zp");
    p.g_pre = range("g_pre");
    p.g = table("g");
    p.zh = rescale("zh");
    p.zg = rescale("zg");
    p.one_z = value("one_z");
    p.h_zp = value("h_zp");
    p.h = range("h");
    return p;
  }
  // The limb pairs of one GEMM ("x": W.x, "h": R.h): [P, 4] int64 rows (act limb, weight limb,
  // scale, weight offset), read on the host.
  at::Tensor pairs(const std::string& k) const { return tensor(k + "_pairs").cpu(); }
};

}  // namespace qgru
