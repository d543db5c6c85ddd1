// Internal entry points of the bitwise compare kernels (compare_kernels.cc). The public API is
// codec/compare.h; these functions trust their arguments, which compare.cc validates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace refit::internal {

/// Append to `out` the indices i in [begin, end) where element i of `old_bytes` and `new_bytes`
/// differ bitwise, in ascending order, using the best SIMD target of this CPU (Highway dynamic
/// dispatch). The pointers address element 0 of each tensor and may have any alignment.
/// Preconditions: width ∈ {1, 2, 4, 8}; begin ≤ end; both tensors hold at least `end` elements.
/// Thread-safe: reads the inputs only; `out` belongs to the caller.
void AppendChangedSimd(const std::byte* old_bytes, const std::byte* new_bytes, uint32_t width,
                       uint64_t begin, uint64_t end, std::vector<uint64_t>* out);

/// The same contract as AppendChangedSimd, one element at a time in plain C++: the oracle the
/// SIMD kernels are tested against.
void AppendChangedScalar(const std::byte* old_bytes, const std::byte* new_bytes, uint32_t width,
                         uint64_t begin, uint64_t end, std::vector<uint64_t>* out);

/// Return the Highway name of the target AppendChangedSimd dispatches to, e.g. "AVX3".
std::string_view DispatchedCompareTarget();

/// Read `num_bytes` of `first` and of `second` with the same dispatched SIMD target and return
/// the OR of their XOR, so the compiler cannot drop the loads. This is the two-stream read that
/// compare throughput is measured against (bench/compare_bench.cc): it does all of a compare's
/// memory traffic and none of its index extraction.
uint64_t XorReduceTwoStreams(const std::byte* first, const std::byte* second, size_t num_bytes);

}  // namespace refit::internal
