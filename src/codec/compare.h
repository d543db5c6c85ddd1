// Bitwise comparison of a tensor's new bytes against its baseline (its options and kernels:
// refit/compare_options.h).
//
// Elements are compared through a same-width unsigned view, never as floats: NaN payloads, ±0,
// subnormals and FP8 patterns count as changed exactly when their bits differ.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "refit/compare_options.h"
#include "refit/status.h"

namespace refit {

/// Append to `out` the indices i in [begin, end) where element i of `old_bytes` and `new_bytes`
/// (element width `width` ∈ {1, 2, 4, 8}) differ bitwise, in ascending order.
/// Preconditions: both spans hold at least `end` elements. Single-threaded.
void AppendChangedLocations(std::span<const std::byte> old_bytes,
                            std::span<const std::byte> new_bytes, uint32_t width, uint64_t begin,
                            uint64_t end, std::vector<uint64_t>* out,
                            CompareKernel kernel = CompareKernel::kBest);

/// Return the sorted indices in [begin, end) where the tensors differ, using `options.threads`
/// threads over chunks. Errors: InvalidArgument for an unsupported width, unequal sizes or a
/// range outside the tensors.
Result<std::vector<uint64_t>> FindChangedLocations(std::span<const std::byte> old_bytes,
                                                   std::span<const std::byte> new_bytes,
                                                   uint32_t width, uint64_t begin, uint64_t end,
                                                   const CompareOptions& options = {});

}  // namespace refit
