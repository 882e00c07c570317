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
  Shift32 shift32(const std::string& k) const { return Shift32{i32(k + "_lsh"), i32(k + "_rsh")}; }
  Table32 table32(const std::string& k) const {
    return Table32{i64("table_" + k), (int32_t)value(k + "_table_k"),
                   (int32_t)value(k + "_table_frac"), (int32_t)value(k + "_pre_lo"), (int32_t)value(k + "_zp"),
                   (int32_t)value(k + "_lo"), (int32_t)value(k + "_hi")};
  }
  // The int32 cell, when prepare_layer found it exact for this layer ("acc32" = 1).
  Cell32 cell32() const {
    Cell32 c{};
    if (value("acc32") == 0) return c;
    c.r_wx = shift32("r_from_wx");
    c.r_rh = shift32("r_from_rh");
    c.z_wx = shift32("z_from_wx");
    c.z_rh = shift32("z_from_rh");
    c.g_wx = shift32("g_from_wx");
    c.g_rrh_rsh = i32("g_from_rrh_rsh");
    c.zh_rsh = (int32_t)value("zh_rsh");
    c.zg_rsh = (int32_t)value("zg_rsh");
    c.r_pre_zp = (int32_t)value("r_pre_zp");
    c.r_pre_lo = (int32_t)value("r_pre_lo");
    c.r_pre_hi = (int32_t)value("r_pre_hi");
    c.z_pre_zp = (int32_t)value("z_pre_zp");
    c.z_pre_lo = (int32_t)value("z_pre_lo");
    c.z_pre_hi = (int32_t)value("z_pre_hi");
    c.g_pre_zp = (int32_t)value("g_pre_zp");
    c.g_pre_lo = (int32_t)value("g_pre_lo");
    c.g_pre_hi = (int32_t)value("g_pre_hi");
    c.r = table32("r");
    c.z = table32("z");
    c.g = table32("g");
    c.one_z = (int32_t)value("one_z");
    c.h_zp = (int32_t)value("h_zp");
    c.h_lo = (int32_t)value("h_lo");
    c.h_hi = (int32_t)value("h_hi");
    return c;
  }
  CellParams cell() const {
    CellParams p;
    p.H = value("H");
    p.c32 = cell32();
    p.rh = acc("Rh");
    p.rh32 = acc32("Rh");
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
