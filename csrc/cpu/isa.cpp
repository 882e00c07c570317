// Run-time choice of the CPU backend's path: what the CPU offers (CPUID), what the OS saves on a
// context switch (XCR0, read with xgetbv), and for AMX what Linux grants the process
// (arch_prctl ARCH_REQ_XCOMP_PERM). Compiling for an instruction set is not enough to run it:
// a binary built here may meet another CPU, a VM may hide AVX-512 state, a kernel may refuse AMX.
#include "isa.h"

#include <map>
#include <stdexcept>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QGRU_X86 1
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define QGRU_X86 0
#endif

namespace qgru {
namespace cpu {
namespace {

#if QGRU_X86
struct Cpuid {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

Cpuid cpuid(unsigned leaf, unsigned sub) {
  Cpuid r;
  if (leaf > __get_cpuid_max(leaf & 0x80000000u, nullptr)) return r;
  __cpuid_count(leaf, sub, r.a, r.b, r.c, r.d);
  return r;
}

unsigned long long xcr0() {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((unsigned long long)hi << 32) | lo;
}

// Every CPU feature that a path's code may use, by the names of gcc's target attribute: a path
// is entered only where all of its kernel file's target (`#pragma GCC target`, which lets gcc use
// them anywhere in the file, BMI2's shlx / sarx in the cells included) is present.
// tests/test_cpu_isa_code.py checks these lists against the kernel files' targets.
const std::vector<std::string> kAvx2Needs = {"avx2", "fma", "bmi2", "f16c", "popcnt"};
const std::vector<std::string> kAvxVnniNeeds = {"avx2", "fma", "bmi2", "f16c", "popcnt", "avxvnni"};
const std::vector<std::string> kAvx512VnniNeeds = {"avx2",     "fma",      "bmi2",     "avx512f",
                                                   "avx512bw", "avx512vl", "avx512dq", "avx512vnni"};
const std::vector<std::string> kAmxNeeds = {"avx2",     "fma",      "bmi2",       "avx512f",  "avx512bw",
                                            "avx512vl", "avx512dq", "avx512vnni", "amx-tile", "amx-int8"};

struct Features {
  std::map<std::string, bool> cpu;         // CPUID, by target-attribute name
  bool os_avx = false, os_avx512 = false;  // XCR0: the OS saves the YMM / ZMM and opmask state
  std::string amx_os;                      // why the OS refuses the tile state, if it does
  std::string missing(const std::vector<std::string>& needs) const {
    std::string m;
    for (const auto& n : needs)
      if (!cpu.count(n) || !cpu.at(n)) m += (m.empty() ? "" : ", ") + n;
    return m;
  }
  bool has(const std::vector<std::string>& needs) const { return missing(needs).empty(); }
};
bool amx_permission() {
#if defined(__linux__)
  // once per process; without it the first tile instruction faults
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
#else
  return false;
#endif
}

Features detect() {
  Features f;
  const Cpuid l1 = cpuid(1, 0), l7 = cpuid(7, 0);
  const Cpuid l7s1 = l7.a >= 1 ? cpuid(7, 1) : Cpuid{};  // leaf 7's EAX: its last sub-leaf
  const auto bit = [](unsigned r, int i) { return ((r >> i) & 1u) != 0; };
  f.cpu = {{"avx", bit(l1.c, 28)},      {"fma", bit(l1.c, 12)},        {"popcnt", bit(l1.c, 23)},
           {"f16c", bit(l1.c, 29)},     {"avx2", bit(l7.b, 5)},        {"bmi2", bit(l7.b, 8)},
           {"avx512f", bit(l7.b, 16)},  {"avx512dq", bit(l7.b, 17)},   {"avx512bw", bit(l7.b, 30)},
           {"avx512vl", bit(l7.b, 31)}, {"avx512vnni", bit(l7.c, 11)}, {"amx-tile", bit(l7.d, 24)},
           {"amx-int8", bit(l7.d, 25)}, {"avxvnni", bit(l7s1.a, 4)}};
  const bool osxsave = bit(l1.c, 27);
  const unsigned long long x = osxsave ? xcr0() : 0;
  f.os_avx = osxsave && f.cpu["avx"] && (x & 0x6) == 0x6;  // XMM and YMM state
  f.os_avx512 = f.os_avx && (x & 0xE0) == 0xE0;            // opmask, ZMM_Hi256, Hi16_ZMM
  const bool os_amx = (x & 0x60000ull) == 0x60000ull;      // XTILECFG, XTILEDATA
  if (f.has(kAmxNeeds)) {
    if (!os_amx) f.amx_os = "the CPU has AMX but the OS does not enable its state (XCR0)";
    else if (!amx_permission()) f.amx_os = "the CPU has AMX but Linux refused the tile state (arch_prctl)";
  }
  return f;
}
#endif

const Features& features() {
#if QGRU_X86
  static const Features f = detect();
  return f;
#else
  static const Features f{};
  return f;
#endif
}

}  // namespace

std::string cpu_model() {
#if QGRU_X86
  if (__get_cpuid_max(0x80000000u, nullptr) < 0x80000004u) return "unknown x86-64 CPU";
  char brand[49] = {0};
  for (unsigned i = 0; i < 3; ++i) {
    unsigned r[4];
    __cpuid(0x80000002u + i, r[0], r[1], r[2], r[3]);
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 4; ++k) brand[16 * i + 4 * j + k] = (char)((r[j] >> (8 * k)) & 0xFF);
  }
  std::string s(brand);
  const auto b = s.find_first_not_of(' '), e = s.find_last_not_of(' ');
  return b == std::string::npos ? "unknown x86-64 CPU" : s.substr(b, e - b + 1);
#else
  return "non-x86 CPU";
#endif
}

std::vector<IsaInfo> isa_table() {
  std::vector<IsaInfo> t;
#if QGRU_X86
  const Features& f = features();
  // why a path cannot run: not compiled, the CPU lacks a feature of its target, or the OS does not
  // save the registers (XCR0) or grant the tiles
  auto entry = [&](const char* name, const Kernels* k, const std::vector<std::string>& needs, bool os_ok,
                   const std::string& os_why) {
    std::string why;
    if (k == nullptr) why = "not compiled into this binary (the toolchain that built it cannot: compiler or assembler too old)";
    else if (!f.has(needs)) why = "this CPU lacks " + f.missing(needs);
    else if (!os_ok) why = os_why;
    t.push_back(IsaInfo{name, k, why.empty(), why, needs});
  };
  const std::string no_ymm = "the OS does not enable AVX state (XCR0)";
  const std::string no_zmm = "the CPU has AVX-512 but the OS does not enable its state (XCR0)";
  entry("amx", amx_kernels(), kAmxNeeds, f.os_avx512 && f.amx_os.empty(), f.os_avx512 ? f.amx_os : no_zmm);
  entry("avx512vnni", avx512vnni_kernels(), kAvx512VnniNeeds, f.os_avx512, f.os_avx ? no_zmm : no_ymm);
  entry("avxvnni", avxvnni_kernels(), kAvxVnniNeeds, f.os_avx, no_ymm);
  entry("avx2", avx2_kernels(), kAvx2Needs, f.os_avx, no_ymm);
#endif
  t.push_back(IsaInfo{"portable", portable_kernels(), true, "", {}});
  return t;
}

const Kernels* select_isa(const std::string& name) {
  const std::vector<IsaInfo> t = isa_table();
  std::string names;
  for (const IsaInfo& i : t) {
    if ((name.empty() || name == "auto") && i.supported) return i.kernels;
    if (i.name == name) {
      if (!i.supported)
        throw std::runtime_error("qgru cpu: the '" + name + "' path cannot run here: " + i.why);
      return i.kernels;
    }
    names += (names.empty() ? "" : ", ") + i.name;
  }
  throw std::runtime_error("qgru cpu: unknown path '" + name + "'; this build knows: auto, " + names);
}

}  // namespace cpu
}  // namespace qgru
