// How a tracker compares a tensor's new bytes with its baseline: the kernel, the threads, and the
// SIMD target this CPU dispatches to. (The compare itself is internal: src/codec/compare.h.)
#pragma once

#include <cstdint>
#include <string_view>

namespace refit {

/// Which implementation a comparison uses.
enum class CompareKernel : uint8_t {
  /// The fastest SIMD target Highway finds on this CPU at run time (AVX-512, AVX2, SSE4, …).
  kBest,
  /// Plain C++ loop: the reference the SIMD kernels are tested against.
  kScalar,
};

/// Return the name of the SIMD target kBest dispatches to on this machine, e.g. "AVX3".
std::string_view BestCompareTarget();

/// Options of a compare (TrackerOptions::compare).
struct CompareOptions {
  /// Worker threads (1 = the calling thread only).
  int threads = 1;
  /// Elements per work unit when threads > 1. 1 Mi elements amortise thread hand-off while
  /// keeping per-thread output small.
  uint64_t chunk_elements = uint64_t{1} << 20;
  CompareKernel kernel = CompareKernel::kBest;
};

}  // namespace refit
