// cadence's CPU kernels: which instruction sets they take. AVX2 and FMA always (the Python side
// refuses a CPU without them); AVX-512 where the CPU has it, in functions marked CADENCE_AVX512
// and called only where `use_avx512()`.
// A part of cpu_kernels.cc's one translation unit (see there), included by it alone.

#pragma once

#include <cstdlib>
#include <string>

#define CADENCE_AVX512 __attribute__((target("avx512f")))

namespace {

// AVX-512 where the CPU has it, unless CADENCE_CPU_AVX512=0 (the tests compare the two).
bool use_avx512() {
  static const bool use = [] {
    const char* env = std::getenv("CADENCE_CPU_AVX512");
    return __builtin_cpu_supports("avx512f") && !(env && std::string(env) == "0");
  }();
  return use;
}

}  // namespace
