// qgru's argument checks in native code: QGRU_CHECK(cond, parts...) and QGRU_CHECK_VALUE, which raise
// what TORCH_CHECK and TORCH_CHECK_VALUE raise (RuntimeError, ValueError in Python) with the parts
// joined into one message. The parts are formatted here, numbers with snprintf, and the message
// reaches c10 as one std::string, which c10 takes without an iostream.
//
// Why not TORCH_CHECK's own formatting (c10::str, an std::ostringstream): on an H200 machine
// (2026-11-28, both extensions built with that image's /opt/gcc toolchain against torch
// 2.11.0+cu130) every native check whose message streamed a number crashed the process with a
// segmentation fault, while checks whose message held only text raised cleanly
// (scripts/cuda_triage.py). Formatting numbers without iostreams removes that dependence on how the
// toolchain's C++ runtime and torch's agree: with these macros every one of those checks raised
// cleanly on the same machine (gpu_check, 2026-11-28 08:47, tests/test_cuda_speed_paths.py).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

namespace qgru {
namespace check_detail {

inline void put(std::string& s, const char* v) { s += v != nullptr ? v : "(null)"; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void put(std::string& s, const c10::Device& v) { s += v.str(); }
inline void put(std::string& s, c10::ScalarType v) { s += c10::toString(v); }

// integers as %lld / %llu; floating point as %g (what an ostream's default precision prints)
template <typename T>
typename std::enable_if<std::is_integral<T>::value && !std::is_same<T, bool>::value && !std::is_same<T, char>::value>::type
put(std::string& s, T v) {
  char b[32];
  if (std::is_signed<T>::value)
    std::snprintf(b, sizeof b, "%lld", (long long)v);
  else
    std::snprintf(b, sizeof b, "%llu", (unsigned long long)v);
  s += b;
}
template <typename T>
typename std::enable_if<std::is_floating_point<T>::value>::type put(std::string& s, T v) {
  char b[40];
  std::snprintf(b, sizeof b, "%g", (double)v);
  s += b;
}
template <typename T>
typename std::enable_if<std::is_enum<T>::value && !std::is_same<T, c10::ScalarType>::value>::type put(std::string& s,
                                                                                                   T v) {
  put(s, (long long)v);
}
// sizes: [a, b, c]
template <typename T>
void put(std::string& s, c10::ArrayRef<T> v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    put(s, v[i]);
  }
  s += ']';
}
template <typename T>
void put(std::string& s, const std::vector<T>& v) {
  put(s, c10::ArrayRef<T>(v));
}

inline void join(std::string&) {}
template <typename A, typename... Rest>
void join(std::string& s, const A& a, const Rest&... rest) {
  put(s, a);
  join(s, rest...);
}

}  // namespace check_detail

// The parts of a check's message as one string (numbers by snprintf, never an iostream).
template <typename... Args>
std::string check_message(const Args&... args) {
  std::string s;
  check_detail::join(s, args...);
  return s;
}

}  // namespace qgru

// The message is built only when the check fails (TORCH_CHECK evaluates it in its failure branch).
#define QGRU_CHECK(cond, ...) TORCH_CHECK(cond, ::qgru::check_message(__VA_ARGS__))
#define QGRU_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::qgru::check_message(__VA_ARGS__))
