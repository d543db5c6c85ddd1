// Internal SIMD kernel of the context-coded delta encoding (context_coding.cc): the class masks of
// a run of old elements. Trusts its arguments, which context_coding.cc derives and checks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace refit::internal {

/// Elements per class-mask block: one 64-bit word of masks.
inline constexpr uint64_t kContextBlock = 64;
/// Most magnitude thresholds (classes − 1) of one context-coded item.
inline constexpr uint32_t kMaxContextThresholds = 15;

/// For each of the `blocks` blocks of 64 elements starting at `old_elements` (element width
/// `width` ∈ {1, 2, 4}, little-endian, any alignment), and each threshold j < `threshold_count`,
/// write to `ge_masks[block * threshold_count + j]` the word whose bit i is set iff the magnitude
/// bits of element i of the block (the element with its sign bit cleared) are ≥ thresholds[j].
/// Uses the best SIMD target of this CPU (Highway dynamic dispatch).
/// Thread-safe: reads its inputs only.
void ContextGeMasks(const std::byte* old_elements, uint32_t width, uint64_t blocks,
                    const uint32_t* thresholds, uint32_t threshold_count, uint64_t* ge_masks);

/// Return the Highway name of the target ContextGeMasks dispatches to, e.g. "AVX3".
std::string_view DispatchedContextTarget();

}  // namespace refit::internal
