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
/// `width` ∈ {1, 2, 4}, little-endian, any alignment), split the block into `threshold_count` + 1
/// classes by the elements' magnitude bits (the element with its sign bit cleared): class c holds
/// the elements with thresholds[c − 1] ≤ magnitude < thresholds[c] (no lower bound for class 0,
/// no upper bound for the last). Writes the class's mask word (bit i: element i of the block) to
/// `masks[block * classes + c]` and its population count to `counts[block * classes + c]`.
/// Preconditions: 1 ≤ threshold_count ≤ kMaxContextThresholds; thresholds strictly increasing,
/// each in [1, 2^(8·width − 1)). Uses the best SIMD target of this CPU (Highway dynamic
/// dispatch). Thread-safe: reads its inputs only.
void ContextClassMasks(const std::byte* old_elements, uint32_t width, uint64_t blocks,
                       const uint32_t* thresholds, uint32_t threshold_count, uint64_t* masks,
                       uint8_t* counts);

/// The decoder's pass: for each of the `blocks` blocks of 64 elements starting at
/// `old_elements`, split the block into classes as ContextClassMasks does (threshold_count may be
/// 0: one class), take the next popcount(class mask) bits of class c's change bitmap
/// `bitmaps[c]` from bit `offsets[c]` (advancing it), deposit them at the class's members, and
/// write the block's changed-elements word to `changed[block]`. A null `bitmaps[c]` means no
/// member of class c changed, or (bit c of `all_changed` set) every one did. Returns false, with
/// `offsets` unspecified, when a class reads past its `members[c]` bits: the old elements hold
/// more members of a class than the encoder saw (a class without bitmap is checked per batch and
/// may end up to one batch past its members: the caller checks every offset at the end). Each
/// bitmap must hold one word past its last bit. Uses the best SIMD target (and BMI2's PDEP where
/// the target has it). Thread-safe: writes only `offsets` and `changed`.
bool ContextChangedWords(const std::byte* old_elements, uint32_t width, uint64_t blocks,
                         const uint32_t* thresholds, uint32_t threshold_count,
                         const uint64_t* const* bitmaps, uint32_t all_changed,
                         const uint64_t* members, uint64_t* offsets, uint64_t* changed);

/// Return the Highway name of the target ContextClassMasks dispatches to, e.g. "AVX3".
std::string_view DispatchedContextTarget();

}  // namespace refit::internal
