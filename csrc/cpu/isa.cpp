// Run-time choice of the CPU backend's path: what the CPU offers (CPUID), what the OS saves on a
// context switch (XCR0, read with xgetbv), and for AMX what Linux grants the process
// (arch_prctl ARCH_REQ_XCOMP_PERM). Compiling for an instruction set is not enough to run it:
// a binary built here may meet another CPU, a VM may hide AVX-512 state, a kernel may refuse AMX.
#include "isa.h"

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

struct Features {
  bool avx2 = false, fma = false, avx512 = false, vnni512 = false, amx = false;
  std::string avx_os, avx512_os, amx_os;  // why the OS side is missing, if it is
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
  const bool osxsave = (l1.c >> 27) & 1;
  const unsigned long long x = osxsave ? xcr0() : 0;
  const bool os_avx = osxsave && (x & 0x6) == 0x6;             // XMM and YMM state
  const bool os_avx512 = os_avx && (x & 0xE0) == 0xE0;         // opmask, ZMM_Hi256, Hi16_ZMM
  const bool os_amx = (x & 0x60000ull) == 0x60000ull;          // XTILECFG, XTILEDATA
  f.fma = (l1.c >> 12) & 1;
  f.avx2 = os_avx && ((l7.b >> 5) & 1) && f.fma;
  if (!os_avx) f.avx_os = "the OS does not enable AVX state (XCR0)";
  const bool avx512 = ((l7.b >> 16) & 1) && ((l7.b >> 17) & 1) && ((l7.b >> 30) & 1) && ((l7.b >> 31) & 1);  // F DQ BW VL
  f.avx512 = avx512 && os_avx512;
  if (avx512 && !os_avx512) f.avx512_os = "the CPU has AVX-512 but the OS does not enable its state (XCR0)";
  f.vnni512 = f.avx512 && ((l7.c >> 11) & 1);
  const bool amx = ((l7.d >> 24) & 1) && ((l7.d >> 25) & 1);  // AMX-TILE, AMX-INT8
  if (amx && f.vnni512) {
    if (!os_amx) f.amx_os = "the CPU has AMX but the OS does not enable its state (XCR0)";
    else if (!amx_permission()) f.amx_os = "the CPU has AMX but Linux refused the tile state (arch_prctl)";
    else f.amx = true;
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
  auto entry = [&](const char* name, const Kernels* k, bool ok, const std::string& os_why, const char* cpu_why) {
    std::string why;
    if (k == nullptr) why = "not compiled into this binary (compiler too old for it)";
    else if (!ok) why = os_why.empty() ? cpu_why : os_why;
    t.push_back(IsaInfo{name, k, k != nullptr && ok, why});
  };
  entry("amx", amx_kernels(), f.amx, f.amx_os, "this CPU has no AMX-INT8 (with AVX-512 VNNI)");
  entry("avx512vnni", avx512vnni_kernels(), f.vnni512, f.avx512_os, "this CPU has no AVX-512 VNNI (F, BW, DQ, VL)");
  entry("avx2", avx2_kernels(), f.avx2, f.avx_os, "this CPU has no AVX2 and FMA");
#endif
  t.push_back(IsaInfo{"portable", portable_kernels(), true, ""});
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
  throw std::runtime_error("qgru cpu: unknown path '" + name + "' (QGRU_CPU_ISA); this build knows: auto, " + names);
}

}  // namespace cpu
}  // namespace qgru
