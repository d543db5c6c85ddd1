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
// Turn one block's threshold words (bit i set iff element i ≥ threshold j) into class masks
// and their counts.
HWY_INLINE void FinishBlock(const uint64_t* ge, uint32_t threshold_count, uint64_t* masks,
                            uint8_t* counts) {
  uint64_t below = ~uint64_t{0};
  for (uint32_t c = 0; c < threshold_count; ++c) {
    masks[c] = below & ~ge[c];
    below &= ge[c];
  }
  masks[threshold_count] = below;
  for (uint32_t c = 0; c <= threshold_count; ++c) {
    counts[c] = static_cast<uint8_t>(hwy::PopCount(masks[c]));
  }
}

template <typename T>
void ClassMasksScalar(const std::byte* old_elements, uint64_t blocks, const uint32_t* thresholds,
                      uint32_t threshold_count, uint64_t* masks, uint8_t* counts) {
  const uint32_t classes = threshold_count + 1;
  for (uint64_t block = 0; block < blocks; ++block) {
    uint64_t out[kMaxContextThresholds] = {};
    for (uint64_t i = 0; i < kContextBlock; ++i) {
      T bits;
      std::memcpy(&bits, old_elements + (block * kContextBlock + i) * sizeof(T), sizeof(T));
      const uint32_t magnitude = static_cast<uint32_t>(bits & static_cast<T>(~SignMask<T>()));
      for (uint32_t j = 0; j < threshold_count; ++j) {
        out[j] |= static_cast<uint64_t>(magnitude >= thresholds[j]) << i;
      }
    }
    FinishBlock(out, threshold_count, masks + block * classes, counts + block * classes);
  }
}

// Lanes are compared as signed integers (Highway's x86 targets have no unsigned ordering for
// every width): a magnitude with its sign bit cleared is non-negative, and magnitude ≥ t is
// magnitude > t − 1 with t ≥ 1.
template <typename T>
void ClassMasksOfType(const std::byte* old_elements, uint64_t blocks, const uint32_t* thresholds,
                      uint32_t threshold_count, uint64_t* masks, uint8_t* counts) {
  const uint32_t classes = threshold_count + 1;
  using S = std::make_signed_t<T>;
  const hn::ScalableTag<S> d;
  const size_t lanes = hn::Lanes(d);
  if (lanes > kContextBlock || kContextBlock % lanes != 0) {
    ClassMasksScalar<T>(old_elements, blocks, thresholds, threshold_count, masks, counts);
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
    FinishBlock(words, threshold_count, masks + block * classes, counts + block * classes);
  }
}

void ClassMasksKernel(const std::byte* old_elements, uint32_t width, uint64_t blocks,
                      const uint32_t* thresholds, uint32_t threshold_count, uint64_t* masks,
                      uint8_t* counts) {
  switch (width) {
    case 1:
      return ClassMasksOfType<uint8_t>(old_elements, blocks, thresholds, threshold_count, masks,
                                       counts);
    case 2:
      return ClassMasksOfType<uint16_t>(old_elements, blocks, thresholds, threshold_count, masks,
                                        counts);
    default:
      return ClassMasksOfType<uint32_t>(old_elements, blocks, thresholds, threshold_count, masks,
                                        counts);
  }
}

// `count` ≤ 64 bits of `words` from bit `offset`; words holds one word past the last bit read.
HWY_INLINE uint64_t ExtractBits(const uint64_t* words, uint64_t offset, uint32_t count) {
  if (count == 0) return 0;
  const uint64_t word = offset / 64;
  const uint32_t shift = offset % 64;
  uint64_t value = words[word] >> shift;
  if (shift != 0) value |= words[word + 1] << (64 - shift);
  return count == 64 ? value : value & ((uint64_t{1} << count) - 1);
}

// Deposit the low bits of `bits` at the set bits of `mask`, lowest first.
HWY_INLINE uint64_t Deposit(uint64_t bits, uint64_t mask) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  // These targets include BMI2.
  return _pdep_u64(bits, mask);
#else
  uint64_t result = 0;
  while (bits != 0) {
    const uint64_t lowest = mask & (~mask + 1);
    // Branch-free: whether a class member changed is as unpredictable as the data.
    result |= lowest & (uint64_t{0} - (bits & 1));
    mask ^= lowest;
    bits >>= 1;
  }
  return result;
#endif
}

template <typename T>
bool ChangedWordsOfType(const std::byte* old_elements, uint64_t blocks, const uint32_t* thresholds,
                        uint32_t threshold_count, const uint64_t* const* bitmaps,
                        uint32_t all_changed, const uint64_t* members, uint64_t* offsets,
                        uint64_t* changed) {
  const uint32_t classes = threshold_count + 1;
  constexpr uint64_t kBatch = 256;
  uint64_t masks[kBatch * (kMaxContextThresholds + 1)];
  uint8_t counts[kBatch * (kMaxContextThresholds + 1)];
  for (uint64_t first = 0; first < blocks; first += kBatch) {
    const uint64_t batch = HWY_MIN(kBatch, blocks - first);
    // A class read without bitmap may have overrun in the last batch: its offset is checked
    // once per batch (it reads nothing, so a late check is safe).
    for (uint32_t c = 0; c < classes; ++c) {
      if (offsets[c] > members[c]) return false;
    }
    if (threshold_count == 0) {
      for (uint64_t b = 0; b < batch; ++b) {
        masks[b] = ~uint64_t{0};
        counts[b] = kContextBlock;
      }
    } else {
      ClassMasksOfType<T>(old_elements + first * kContextBlock * sizeof(T), batch, thresholds,
                          threshold_count, masks, counts);
    }
    for (uint64_t b = 0; b < batch; ++b) {
      uint64_t word = 0;
      for (uint32_t c = 0; c < classes; ++c) {
        const uint32_t in_block = counts[b * classes + c];
        if (bitmaps[c] == nullptr) {
          // No member changes, or every one does: no bits to read (and so no bound to check
          // before the end).
          offsets[c] += in_block;
          if ((all_changed >> c) & 1) word |= masks[b * classes + c];
          continue;
        }
        if (offsets[c] + in_block > members[c]) return false;
        const uint64_t bits = ExtractBits(bitmaps[c], offsets[c], in_block);
        offsets[c] += in_block;
        if (bits != 0) word |= Deposit(bits, masks[b * classes + c]);
      }
      changed[first + b] = word;
    }
  }
  return true;
}

bool ChangedWordsKernel(const std::byte* old_elements, uint32_t width, uint64_t blocks,
                        const uint32_t* thresholds, uint32_t threshold_count,
                        const uint64_t* const* bitmaps, uint32_t all_changed,
                        const uint64_t* members, uint64_t* offsets, uint64_t* changed) {
  switch (width) {
    case 1:
      return ChangedWordsOfType<uint8_t>(old_elements, blocks, thresholds, threshold_count, bitmaps,
                                         all_changed, members, offsets, changed);
    case 2:
      return ChangedWordsOfType<uint16_t>(old_elements, blocks, thresholds, threshold_count,
                                          bitmaps, all_changed, members, offsets, changed);
    default:
      return ChangedWordsOfType<uint32_t>(old_elements, blocks, thresholds, threshold_count,
                                          bitmaps, all_changed, members, offsets, changed);
  }
}

const char* ContextKernelTargetName() { return hwy::TargetName(HWY_TARGET); }

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace refit::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace refit::internal {

HWY_EXPORT(ClassMasksKernel);
HWY_EXPORT(ContextKernelTargetName);
HWY_EXPORT(ChangedWordsKernel);

void ContextClassMasks(const std::byte* old_elements, uint32_t width, uint64_t blocks,
                       const uint32_t* thresholds, uint32_t threshold_count, uint64_t* masks,
                       uint8_t* counts) {
  if (threshold_count == 0 || blocks == 0) return;
  HWY_DYNAMIC_DISPATCH(ClassMasksKernel)
  (old_elements, width, blocks, thresholds, threshold_count, masks, counts);
}

bool ContextChangedWords(const std::byte* old_elements, uint32_t width, uint64_t blocks,
                         const uint32_t* thresholds, uint32_t threshold_count,
                         const uint64_t* const* bitmaps, uint32_t all_changed,
                         const uint64_t* members, uint64_t* offsets, uint64_t* changed) {
  if (blocks == 0) return true;
  return HWY_DYNAMIC_DISPATCH(ChangedWordsKernel)(old_elements, width, blocks, thresholds,
                                                  threshold_count, bitmaps, all_changed, members,
                                                  offsets, changed);
}

std::string_view DispatchedContextTarget() {
  return HWY_DYNAMIC_DISPATCH(ContextKernelTargetName)();
}

}  // namespace refit::internal
#endif  // HWY_ONCE
