// Bitwise compare kernels. Highway compiles the per-target section of this file once per SIMD
// target (foreach_target.h re-includes it) and HWY_DYNAMIC_DISPATCH picks the best one the CPU
// supports at run time.
//
// The kernels are tuned for the common case of a sparse change set (0.1–5 % of elements differ,
// docs/architecture.md): they compare a group of vectors per iteration, fold the group's masks into
// one test so an unchanged group costs only its loads, and extract index bits only from groups that
// differ. Throughput is then bounded by reading both streams from memory
// (bench/compare_bench.cc measures it against a plain two-stream read).

#include "codec/compare_kernels.h"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "util/check.h"

// Target-independent helpers: compiled once although foreach_target.h re-includes this file.
#ifndef REFIT_CODEC_COMPARE_KERNELS_ONCE_
#define REFIT_CODEC_COMPARE_KERNELS_ONCE_
// The kernels read StoreMaskBits bytes as words and tensors as little-endian element bits.
static_assert(std::endian::native == std::endian::little, "compare kernels assume little-endian");

namespace refit::internal {
namespace {

// Load element `index` of a tensor that starts at `base`. memcpy because tensor bytes (e.g. an
// mmapped safetensors file) need not be aligned to the element width.
template <typename T>
T LoadElement(const std::byte* base, uint64_t index) {
  T value;
  std::memcpy(&value, base + index * sizeof(T), sizeof(T));
  return value;
}

}  // namespace
}  // namespace refit::internal
#endif  // REFIT_CODEC_COMPARE_KERNELS_ONCE_

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec/compare_kernels.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace refit::internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Vectors compared per loop iteration: four (eight independent loads) keep the memory system
// busy and amortise the group's one skip branch. Larger groups would rarely be skipped: at 0.1 %
// density a 128-element bf16 group on AVX-512 is unchanged 88 % of the time, at 1 % only 28 %.
constexpr size_t kVectorsPerGroup = 4;

constexpr size_t kBitsPerWord = 64;

// Indices EmitSetBits writes per batch without branching on how many bits are set. A 64-lane
// mask word holds at most 4 set bits in 99.95 % of cases at 1 % density and in 78 % at 5 %; a
// second batch covers up to 8 (99.6 % at 5 %; binomial tails). Rarer words take a loop.
constexpr size_t kEmitBatch = 4;
// Slots past the last valid index that EmitSetBits may fill with scratch: two batches.
constexpr size_t kEmitSlack = 2 * kEmitBatch;

// Indices staged before they are appended to the caller's vector: 8 KiB, a quarter of a typical
// L1d, and at least two groups of the widest target's byte lanes.
constexpr size_t kStagedIndices =
    HWY_MAX(size_t{1024}, 2 * kVectorsPerGroup * HWY_LANES(uint8_t)) + kEmitSlack;

// Collects changed indices in a small buffer and appends them to the caller's vector in bulk.
// Writing into the buffer needs no capacity check per index, which lets EmitSetBits store
// indices unconditionally: slots past the last valid index are scratch.
//
// Thread-compatible: one stage per call.
class IndexStage {
 public:
  explicit IndexStage(std::vector<uint64_t>* out) : out_(out) {}

  // Return where to write up to `count` further indices. Precondition: count ≤ one group.
  uint64_t* Reserve(size_t count) {
    if (size_ + count + kEmitSlack > kStagedIndices) {
      Flush();
    }
    return indices_ + size_;
  }

  // Mark the indices before `end` (a pointer returned by Reserve, advanced) as valid.
  void Commit(const uint64_t* end) { size_ = static_cast<size_t>(end - indices_); }

  void Flush() {
    out_->insert(out_->end(), indices_, indices_ + size_);
    size_ = 0;
  }

 private:
  std::vector<uint64_t>* out_;
  size_t size_ = 0;
  uint64_t indices_[kStagedIndices];
};

// Return the position of the lowest set bit of `bits`, or 64 if there is none.
HWY_INLINE uint64_t LowestSetBit(uint64_t bits) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  // These targets include BMI1, whose tzcnt defines the zero case. With std::countr_zero, GCC
  // sees the zero check in its definition and splits the unrolled emits below into one
  // unpredictable branch each.
  return _tzcnt_u64(bits);
#else
  return static_cast<uint64_t>(std::countr_zero(bits));
#endif
}

// Write `base + position` of each set bit of `bits` to `dst`, ascending; return the new end.
// `dst` must have room for max(popcount, kEmitSlack) indices: slots past the last valid one
// receive scratch (base + 64) that later writes overwrite.
HWY_INLINE uint64_t* EmitSetBits(uint64_t bits, uint64_t base, uint64_t* HWY_RESTRICT dst) {
  const size_t count = hwy::PopCount(bits);
  const auto emit_lowest = [&bits, base, dst](size_t slot) {
    dst[slot] = base + LowestSetBit(bits);
    bits &= bits - 1;
  };
  static_assert(kEmitBatch == 4, "the batches below are unrolled by hand");
  emit_lowest(0);
  emit_lowest(1);
  emit_lowest(2);
  emit_lowest(3);
  if (count > kEmitBatch) {
    emit_lowest(4);
    emit_lowest(5);
    emit_lowest(6);
    emit_lowest(7);
    for (size_t slot = kEmitSlack; slot < count; ++slot) {
      emit_lowest(slot);
    }
  }
  return dst + count;
}

// Return the bits of `mask` (lane j at bit j) as one word. Precondition: Lanes(d) ≤ 64.
template <class D, class M>
HWY_INLINE uint64_t MaskWord(D d, M mask) {
  // StoreMaskBits writes ceil(lanes / 8) ≤ 8 bytes, lane 0 in the lowest bit of the first byte;
  // the rest of the word stays zero.
  uint64_t word = 0;
  hn::StoreMaskBits(d, mask, reinterpret_cast<uint8_t*>(&word));
  return word;
}

// Write `base + lane` of each lane set in `mask` to `dst`, ascending; return the new end. Any
// number of lanes: a mask wider than a word is emitted one word at a time.
template <class D, class M>
HWY_INLINE uint64_t* EmitMask(D d, M mask, uint64_t base, uint64_t* HWY_RESTRICT dst) {
  constexpr size_t kWords = (hn::MaxLanes(D()) + kBitsPerWord - 1) / kBitsPerWord;
  uint64_t words[kWords] = {};
  hn::StoreMaskBits(d, mask, reinterpret_cast<uint8_t*>(words));
  const size_t lanes = hn::Lanes(d);
  for (size_t first_lane = 0; first_lane < lanes; first_lane += kBitsPerWord) {
    dst = EmitSetBits(words[first_lane / kBitsPerWord], base + first_lane, dst);
  }
  return dst;
}

template <typename T>
void AppendChangedOfType(const std::byte* old_bytes, const std::byte* new_bytes, uint64_t begin,
                         uint64_t end, std::vector<uint64_t>* out) {
  const hn::ScalableTag<T> d;
  // Upper bound of Lanes(d), a constant even where the vector length is only known at run time
  // (SVE, RVV); it picks how a group's masks are packed into 64-bit words below.
  constexpr size_t kMaxLanes = hn::MaxLanes(hn::ScalableTag<T>());
  const size_t lanes = hn::Lanes(d);
  const size_t group_lanes = kVectorsPerGroup * lanes;
  // Element pointers for LoadU, which (like the memcpy in LoadElement) accepts any alignment.
  const T* HWY_RESTRICT old_elements = reinterpret_cast<const T*>(old_bytes);
  const T* HWY_RESTRICT new_elements = reinterpret_cast<const T*>(new_bytes);
  IndexStage stage(out);

  uint64_t i = begin;
  for (; end - i >= group_lanes; i += group_lanes) {
    const auto changed0 = hn::Ne(hn::LoadU(d, old_elements + i), hn::LoadU(d, new_elements + i));
    const auto changed1 =
        hn::Ne(hn::LoadU(d, old_elements + i + lanes), hn::LoadU(d, new_elements + i + lanes));
    const auto changed2 = hn::Ne(hn::LoadU(d, old_elements + i + 2 * lanes),
                                 hn::LoadU(d, new_elements + i + 2 * lanes));
    const auto changed3 = hn::Ne(hn::LoadU(d, old_elements + i + 3 * lanes),
                                 hn::LoadU(d, new_elements + i + 3 * lanes));
    if (hn::AllFalse(d, hn::Or(hn::Or(changed0, changed1), hn::Or(changed2, changed3)))) {
      continue;
    }
    uint64_t* dst = stage.Reserve(group_lanes);
    // Pack the group's masks into as few 64-bit words as they fill: each word costs one popcount
    // and a batch of stores however few of its bits are set.
    if constexpr (kMaxLanes > kBitsPerWord / 2) {
      dst = EmitMask(d, changed0, i, dst);
      dst = EmitMask(d, changed1, i + lanes, dst);
      dst = EmitMask(d, changed2, i + 2 * lanes, dst);
      dst = EmitMask(d, changed3, i + 3 * lanes, dst);
    } else if constexpr (kMaxLanes > kBitsPerWord / kVectorsPerGroup) {
      dst = EmitSetBits(MaskWord(d, changed0) | (MaskWord(d, changed1) << lanes), i, dst);
      dst =
          EmitSetBits(MaskWord(d, changed2) | (MaskWord(d, changed3) << lanes), i + 2 * lanes, dst);
    } else {
      dst = EmitSetBits(MaskWord(d, changed0) | (MaskWord(d, changed1) << lanes) |
                            (MaskWord(d, changed2) << (2 * lanes)) |
                            (MaskWord(d, changed3) << (3 * lanes)),
                        i, dst);
    }
    stage.Commit(dst);
  }
  for (; end - i >= lanes; i += lanes) {
    const auto changed = hn::Ne(hn::LoadU(d, old_elements + i), hn::LoadU(d, new_elements + i));
    if (hn::AllFalse(d, changed)) {
      continue;
    }
    stage.Commit(EmitMask(d, changed, i, stage.Reserve(lanes)));
  }
  // Fewer than one vector of elements is left: a full-vector load could cross into an unmapped
  // page, and masked loads of 8/16-bit lanes are emulated with full loads on pre-AVX-512 targets.
  for (; i < end; ++i) {
    if (LoadElement<T>(old_bytes, i) != LoadElement<T>(new_bytes, i)) {
      uint64_t* dst = stage.Reserve(1);
      *dst = i;
      stage.Commit(dst + 1);
    }
  }
  stage.Flush();
}

void AppendChangedKernel(const std::byte* old_bytes, const std::byte* new_bytes, uint32_t width,
                         uint64_t begin, uint64_t end, std::vector<uint64_t>* out) {
  switch (width) {
    case 1:
      return AppendChangedOfType<uint8_t>(old_bytes, new_bytes, begin, end, out);
    case 2:
      return AppendChangedOfType<uint16_t>(old_bytes, new_bytes, begin, end, out);
    case 4:
      return AppendChangedOfType<uint32_t>(old_bytes, new_bytes, begin, end, out);
    case 8:
      return AppendChangedOfType<uint64_t>(old_bytes, new_bytes, begin, end, out);
    default:
      REFIT_DCHECK(false, "compare kernel: element width not in {1, 2, 4, 8}");
  }
}

const char* KernelTargetName() { return hwy::TargetName(HWY_TARGET); }

uint64_t XorReduceKernel(const std::byte* first, const std::byte* second, size_t num_bytes) {
  const hn::ScalableTag<uint64_t> d;
  const size_t lanes = hn::Lanes(d);
  const size_t num_words = num_bytes / sizeof(uint64_t);
  const uint64_t* HWY_RESTRICT first_words = reinterpret_cast<const uint64_t*>(first);
  const uint64_t* HWY_RESTRICT second_words = reinterpret_cast<const uint64_t*>(second);
  // As many independent accumulators as the compare kernel has vectors per group, so both loops
  // keep the same number of loads in flight.
  auto acc0 = hn::Zero(d);
  auto acc1 = hn::Zero(d);
  auto acc2 = hn::Zero(d);
  auto acc3 = hn::Zero(d);
  size_t i = 0;
  for (; num_words - i >= kVectorsPerGroup * lanes; i += kVectorsPerGroup * lanes) {
    acc0 = hn::Or(acc0, hn::Xor(hn::LoadU(d, first_words + i), hn::LoadU(d, second_words + i)));
    acc1 = hn::Or(acc1, hn::Xor(hn::LoadU(d, first_words + i + lanes),
                                hn::LoadU(d, second_words + i + lanes)));
    acc2 = hn::Or(acc2, hn::Xor(hn::LoadU(d, first_words + i + 2 * lanes),
                                hn::LoadU(d, second_words + i + 2 * lanes)));
    acc3 = hn::Or(acc3, hn::Xor(hn::LoadU(d, first_words + i + 3 * lanes),
                                hn::LoadU(d, second_words + i + 3 * lanes)));
  }
  HWY_ALIGN uint64_t acc_lanes[hn::MaxLanes(hn::ScalableTag<uint64_t>())];
  hn::Store(hn::Or(hn::Or(acc0, acc1), hn::Or(acc2, acc3)), d, acc_lanes);
  uint64_t result = 0;
  for (size_t lane = 0; lane < lanes; ++lane) {
    result |= acc_lanes[lane];
  }
  for (size_t byte = i * sizeof(uint64_t); byte < num_bytes; ++byte) {
    result |= std::to_integer<uint64_t>(first[byte] ^ second[byte]);
  }
  return result;
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace refit::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace refit::internal {

HWY_EXPORT(AppendChangedKernel);
HWY_EXPORT(KernelTargetName);
HWY_EXPORT(XorReduceKernel);

namespace {

template <typename T>
void AppendChangedScalarOfType(const std::byte* old_bytes, const std::byte* new_bytes,
                               uint64_t begin, uint64_t end, std::vector<uint64_t>* out) {
  for (uint64_t i = begin; i < end; ++i) {
    if (LoadElement<T>(old_bytes, i) != LoadElement<T>(new_bytes, i)) {
      out->push_back(i);
    }
  }
}

}  // namespace

void AppendChangedSimd(const std::byte* old_bytes, const std::byte* new_bytes, uint32_t width,
                       uint64_t begin, uint64_t end, std::vector<uint64_t>* out) {
  HWY_DYNAMIC_DISPATCH(AppendChangedKernel)(old_bytes, new_bytes, width, begin, end, out);
}

void AppendChangedScalar(const std::byte* old_bytes, const std::byte* new_bytes, uint32_t width,
                         uint64_t begin, uint64_t end, std::vector<uint64_t>* out) {
  switch (width) {
    case 1:
      return AppendChangedScalarOfType<uint8_t>(old_bytes, new_bytes, begin, end, out);
    case 2:
      return AppendChangedScalarOfType<uint16_t>(old_bytes, new_bytes, begin, end, out);
    case 4:
      return AppendChangedScalarOfType<uint32_t>(old_bytes, new_bytes, begin, end, out);
    case 8:
      return AppendChangedScalarOfType<uint64_t>(old_bytes, new_bytes, begin, end, out);
    default:
      REFIT_DCHECK(false, "scalar compare: element width not in {1, 2, 4, 8}");
  }
}

std::string_view DispatchedCompareTarget() { return HWY_DYNAMIC_DISPATCH(KernelTargetName)(); }

uint64_t XorReduceTwoStreams(const std::byte* first, const std::byte* second, size_t num_bytes) {
  return HWY_DYNAMIC_DISPATCH(XorReduceKernel)(first, second, num_bytes);
}

}  // namespace refit::internal
#endif  // HWY_ONCE
