// Class-mask kernel of the context-coded delta encoding. Highway compiles the per-target section
// of this file once per SIMD target (foreach_target.h re-includes it) and HWY_DYNAMIC_DISPATCH
// picks the best one the CPU supports at run time. A block of 64 elements costs one load and one
// compare per threshold and vector: this is the O(N) pass over the old weights that both the
// encoder and the decoder of the encoding make.

#include "codec/context_kernels.h"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#ifndef REFIT_CODEC_CONTEXT_KERNELS_ONCE_
#define REFIT_CODEC_CONTEXT_KERNELS_ONCE_
static_assert(std::endian::native == std::endian::little, "context kernels assume little-endian");
#endif  // REFIT_CODEC_CONTEXT_KERNELS_ONCE_

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec/context_kernels.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace refit::internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <typename T>
T SignMask() {
  return static_cast<T>(T{1} << (sizeof(T) * 8 - 1));
}

// One element at a time: the tail of a vector target too wide for a 64-element block.
template <typename T>
void GeMasksScalar(const std::byte* old_elements, uint64_t blocks, const uint32_t* thresholds,
                   uint32_t threshold_count, uint64_t* ge_masks) {
  for (uint64_t block = 0; block < blocks; ++block) {
    uint64_t* out = ge_masks + block * threshold_count;
    for (uint32_t j = 0; j < threshold_count; ++j) out[j] = 0;
    for (uint64_t i = 0; i < kContextBlock; ++i) {
      T bits;
      std::memcpy(&bits, old_elements + (block * kContextBlock + i) * sizeof(T), sizeof(T));
      const uint32_t magnitude = static_cast<uint32_t>(bits & static_cast<T>(~SignMask<T>()));
      for (uint32_t j = 0; j < threshold_count; ++j) {
        out[j] |= static_cast<uint64_t>(magnitude >= thresholds[j]) << i;
      }
    }
  }
}

// Lanes are compared as signed integers (Highway's x86 targets have no unsigned ordering for
// every width): a magnitude with its sign bit cleared is non-negative, and magnitude ≥ t is
// magnitude > t − 1 with t ≥ 1.
template <typename T>
void GeMasksOfType(const std::byte* old_elements, uint64_t blocks, const uint32_t* thresholds,
                   uint32_t threshold_count, uint64_t* ge_masks) {
  using S = std::make_signed_t<T>;
  const hn::ScalableTag<S> d;
  const size_t lanes = hn::Lanes(d);
  if (lanes > kContextBlock || kContextBlock % lanes != 0) {
    GeMasksScalar<T>(old_elements, blocks, thresholds, threshold_count, ge_masks);
    return;
  }
  const auto magnitude_mask = hn::Set(d, static_cast<S>(~SignMask<T>()));
  using V = decltype(hn::Zero(d));
  V limits[kMaxContextThresholds];
  for (uint32_t j = 0; j < threshold_count; ++j) {
    limits[j] = hn::Set(d, static_cast<S>(thresholds[j] - 1));
  }
  const S* HWY_RESTRICT elements = reinterpret_cast<const S*>(old_elements);
  for (uint64_t block = 0; block < blocks; ++block) {
    uint64_t words[kMaxContextThresholds] = {};
    for (size_t lane = 0; lane < kContextBlock; lane += lanes) {
      const auto magnitude =
          hn::And(hn::LoadU(d, elements + block * kContextBlock + lane), magnitude_mask);
      for (uint32_t j = 0; j < threshold_count; ++j) {
        uint64_t bits = 0;
        hn::StoreMaskBits(d, hn::Gt(magnitude, limits[j]), reinterpret_cast<uint8_t*>(&bits));
        words[j] |= bits << lane;
      }
    }
    std::memcpy(ge_masks + block * threshold_count, words, threshold_count * sizeof(uint64_t));
  }
}

void GeMasksKernel(const std::byte* old_elements, uint32_t width, uint64_t blocks,
                   const uint32_t* thresholds, uint32_t threshold_count, uint64_t* ge_masks) {
  switch (width) {
    case 1:
      return GeMasksOfType<uint8_t>(old_elements, blocks, thresholds, threshold_count, ge_masks);
    case 2:
      return GeMasksOfType<uint16_t>(old_elements, blocks, thresholds, threshold_count, ge_masks);
    default:
      return GeMasksOfType<uint32_t>(old_elements, blocks, thresholds, threshold_count, ge_masks);
  }
}

const char* KernelTargetName() { return hwy::TargetName(HWY_TARGET); }

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace refit::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace refit::internal {

HWY_EXPORT(GeMasksKernel);
HWY_EXPORT(KernelTargetName);

void ContextGeMasks(const std::byte* old_elements, uint32_t width, uint64_t blocks,
                    const uint32_t* thresholds, uint32_t threshold_count, uint64_t* ge_masks) {
  if (threshold_count == 0 || blocks == 0) return;
  HWY_DYNAMIC_DISPATCH(GeMasksKernel)
  (old_elements, width, blocks, thresholds, threshold_count, ge_masks);
}

std::string_view DispatchedContextTarget() { return HWY_DYNAMIC_DISPATCH(KernelTargetName)(); }

}  // namespace refit::internal
#endif  // HWY_ONCE
