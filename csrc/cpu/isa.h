// Which instruction-set paths of the CPU backend this CPU and OS can run, and which one to use.
#pragma once

#include <string>
#include <vector>

#include "kernels.h"

namespace qgru {
namespace cpu {

// The paths in order of preference (fastest first); each entry says whether this binary holds it
// and whether this CPU and OS can run it, and if not, why.
struct IsaInfo {
  std::string name;
  const Kernels* kernels;  // nullptr: not compiled into this binary
  bool supported;          // the CPU has the instructions and the OS saves their state
  std::string why;         // when not usable
  std::vector<std::string> needs;  // the CPU features it requires (gcc target names; portable: none)
};

std::vector<IsaInfo> isa_table();

// The kernels for `name` ("" or "auto": the best usable path); throws std::runtime_error naming
// the reason when the requested path cannot run here.
const Kernels* select_isa(const std::string& name);

// The CPU's model name (CPUID brand string), for reports.
std::string cpu_model();

}  // namespace cpu
}  // namespace qgru
