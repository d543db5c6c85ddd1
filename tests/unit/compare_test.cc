// Tests of the bitwise compare kernels (src/codec/compare.h).
//
// Every input is built by changing known elements of a random tensor, so each test checks the
// kernels against the ground truth of the construction, and kBest against kScalar. The kernel
// tests run once per SIMD target Highway compiled and this CPU supports (AVX-512, AVX2, SSE4,
// ..., scalar), so targets other than the best one are covered too.

#include "codec/compare.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include "test_util.h"

namespace refit {
namespace {

using ::testing::ElementsAreArray;

constexpr uint32_t kWidths[] = {1, 2, 4, 8};
constexpr uint64_t kSeed = 0xC0FFEE;

// Old and new tensor bytes plus the indices where they differ (ascending): the ground truth.
struct TensorPair {
  uint32_t width = 0;
  std::vector<std::byte> old_bytes;
  std::vector<std::byte> new_bytes;
  std::vector<uint64_t> changed;

  uint64_t numel() const { return old_bytes.size() / width; }
};

// Return `numel` random elements of `width` bytes whose new version differs from the old one in
// each element with probability `density`. Half the changes flip one random bit anywhere in the
// element (so a change confined to the top byte of a u64 must be found), half XOR random bytes.
TensorPair MakeTensorPair(uint32_t width, uint64_t numel, double density, uint64_t seed) {
  std::mt19937_64 random(seed);
  TensorPair pair;
  pair.width = width;
  pair.old_bytes.resize(numel * width);
  for (auto& byte : pair.old_bytes) {
    byte = static_cast<std::byte>(random());
  }
  pair.new_bytes = pair.old_bytes;
  std::bernoulli_distribution is_changed(density);
  std::bernoulli_distribution one_bit(0.5);
  std::uniform_int_distribution<uint32_t> bit(0, width * 8 - 1);
  for (uint64_t index = 0; index < numel; ++index) {
    if (!is_changed(random)) {
      continue;
    }
    std::byte* element = pair.new_bytes.data() + index * width;
    if (one_bit(random)) {
      const uint32_t flipped = bit(random);
      element[flipped / 8] ^= static_cast<std::byte>(1u << (flipped % 8));
    } else {
      bool any = false;
      for (uint32_t b = 0; b < width; ++b) {
        const auto mask = static_cast<std::byte>(random());
        element[b] ^= mask;
        any = any || mask != std::byte{0};
      }
      if (!any) {
        element[0] ^= std::byte{1};
      }
    }
    pair.changed.push_back(index);
  }
  return pair;
}

// Return a pair of `Bits` arrays, each (old, new) pattern of `patterns` repeated `copies` times
// with equal random filler between, so special values pass through every SIMD lane position.
template <typename Bits>
TensorPair MakePatternPair(const std::vector<std::pair<Bits, Bits>>& patterns, int copies,
                           uint64_t seed) {
  std::mt19937_64 random(seed);
  std::vector<Bits> old_elements;
  std::vector<Bits> new_elements;
  TensorPair pair;
  pair.width = sizeof(Bits);
  std::uniform_int_distribution<int> filler_count(0, 3);
  for (int copy = 0; copy < copies; ++copy) {
    for (const auto& [old_bits, new_bits] : patterns) {
      for (int filler = filler_count(random); filler > 0; --filler) {
        const auto value = static_cast<Bits>(random());
        old_elements.push_back(value);
        new_elements.push_back(value);
      }
      if (old_bits != new_bits) {
        pair.changed.push_back(old_elements.size());
      }
      old_elements.push_back(old_bits);
      new_elements.push_back(new_bits);
    }
  }
  pair.old_bytes.resize(old_elements.size() * sizeof(Bits));
  pair.new_bytes.resize(new_elements.size() * sizeof(Bits));
  std::memcpy(pair.old_bytes.data(), old_elements.data(), pair.old_bytes.size());
  std::memcpy(pair.new_bytes.data(), new_elements.data(), pair.new_bytes.size());
  return pair;
}

std::vector<uint64_t> ExpectedIn(const TensorPair& pair, uint64_t begin, uint64_t end) {
  std::vector<uint64_t> expected;
  for (const uint64_t index : pair.changed) {
    if (index >= begin && index < end) {
      expected.push_back(index);
    }
  }
  return expected;
}

std::vector<uint64_t> Compare(std::span<const std::byte> old_bytes,
                              std::span<const std::byte> new_bytes, uint32_t width, uint64_t begin,
                              uint64_t end, CompareKernel kernel) {
  std::vector<uint64_t> out;
  AppendChangedLocations(old_bytes, new_bytes, width, begin, end, &out, kernel);
  return out;
}

// Check both kernels against the ground truth on [begin, end).
void ExpectBothKernelsFind(const TensorPair& pair, uint64_t begin, uint64_t end) {
  const std::vector<uint64_t> expected = ExpectedIn(pair, begin, end);
  EXPECT_THAT(
      Compare(pair.old_bytes, pair.new_bytes, pair.width, begin, end, CompareKernel::kScalar),
      ElementsAreArray(expected))
      << "scalar, width " << pair.width << ", range [" << begin << ", " << end << ")";
  EXPECT_THAT(Compare(pair.old_bytes, pair.new_bytes, pair.width, begin, end, CompareKernel::kBest),
              ElementsAreArray(expected))
      << "best (" << BestCompareTarget() << "), width " << pair.width << ", range [" << begin
      << ", " << end << ")";
}

// Kernel tests run on one Highway target at a time, mocked as the only one the CPU supports so
// that kBest dispatches to it.
class TargetScope {
 public:
  explicit TargetScope(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~TargetScope() { hwy::SetSupportedTargetsForTest(0); }
  TargetScope(const TargetScope&) = delete;
  TargetScope& operator=(const TargetScope&) = delete;
};

// Tests over one target and one element width.
class CompareKernelTest : public ::testing::TestWithParam<std::tuple<int64_t, uint32_t>> {
 protected:
  uint32_t width() const { return std::get<1>(GetParam()); }

 private:
  TargetScope target_scope_{std::get<0>(GetParam())};
};

// Tests over one target whose inputs fix the element width (floating-point formats).
class CompareTargetTest : public ::testing::TestWithParam<int64_t> {
 private:
  TargetScope target_scope_{GetParam()};
};

TEST_P(CompareTargetTest, DispatchesToTheTargetUnderTest) {
  EXPECT_EQ(BestCompareTarget(), hwy::TargetName(GetParam()));
}

TEST_P(CompareKernelTest, FindsRandomChangesAtEveryDensity) {
  // 0, the sparse range the kernels are tuned for, dense, and every element. 10007 elements (a
  // prime) leave a tail after every vector and group size.
  constexpr uint64_t kNumel = 10007;
  for (const double density : {0.0, 0.001, 0.01, 0.03, 0.05, 0.2, 0.5, 1.0}) {
    SCOPED_TRACE(testing::Message() << "density " << density);
    const TensorPair pair =
        MakeTensorPair(width(), kNumel, density, kSeed + static_cast<uint64_t>(density * 1e4));
    if (density == 0.0) {
      ASSERT_TRUE(pair.changed.empty());
    } else if (density == 1.0) {
      ASSERT_EQ(pair.changed.size(), kNumel);
    }
    ExpectBothKernelsFind(pair, 0, kNumel);
  }
}

TEST_P(CompareKernelTest, FindsChangesInLargeDenseTensors) {
  // More changes than the kernel stages internally before appending (thousands), in one call.
  constexpr uint64_t kNumel = 200003;
  const TensorPair pair = MakeTensorPair(width(), kNumel, 0.5, kSeed);
  ExpectBothKernelsFind(pair, 0, kNumel);
}

TEST_P(CompareKernelTest, HandlesUnalignedRangesAndSpans) {
  constexpr uint64_t kNumel = 1031;
  const TensorPair pair = MakeTensorPair(width(), kNumel, 0.05, kSeed);
  // Element indices around every lane count (2-64) and group size (8-256), plus the ends.
  const std::vector<uint64_t> bounds = {0,   1,   2,   3,   7,   8,    15,   16,    17,  31,
                                        32,  33,  63,  64,  65,  127,  128,  129,   255, 256,
                                        257, 511, 512, 513, 777, 1024, 1030, kNumel};
  // The old and new spans start at different offsets into their buffers, so neither is aligned
  // and their misalignments differ.
  constexpr size_t kMaxOffset = 64;
  std::vector<std::byte> old_buffer(pair.old_bytes.size() + kMaxOffset);
  std::vector<std::byte> new_buffer(pair.new_bytes.size() + kMaxOffset);
  for (const size_t old_offset : {0, 1, 2, 3, 5, 8, 13, 31, 63}) {
    const size_t new_offset = (old_offset * 7 + 3) % kMaxOffset;
    std::memcpy(old_buffer.data() + old_offset, pair.old_bytes.data(), pair.old_bytes.size());
    std::memcpy(new_buffer.data() + new_offset, pair.new_bytes.data(), pair.new_bytes.size());
    const std::span<const std::byte> old_span(old_buffer.data() + old_offset,
                                              pair.old_bytes.size());
    const std::span<const std::byte> new_span(new_buffer.data() + new_offset,
                                              pair.new_bytes.size());
    for (const uint64_t begin : bounds) {
      for (const uint64_t end : bounds) {
        if (begin > end) {
          continue;
        }
        ASSERT_THAT(Compare(old_span, new_span, width(), begin, end, CompareKernel::kBest),
                    ElementsAreArray(ExpectedIn(pair, begin, end)))
            << "offsets " << old_offset << "/" << new_offset << ", range [" << begin << ", " << end
            << ")";
      }
    }
  }
}

TEST_P(CompareKernelTest, HandlesRangesShorterThanAVector) {
  constexpr uint64_t kNumel = 600;
  // Every length below, at and just above one and two vectors of the widest lanes (64 bytes).
  constexpr uint64_t kMaxLength = 130;
  const TensorPair pair = MakeTensorPair(width(), kNumel, 0.3, kSeed);
  std::mt19937_64 random(kSeed);
  std::uniform_int_distribution<uint64_t> begin_of(0, kNumel - 1);
  for (uint64_t length = 1; length <= kMaxLength; ++length) {
    const uint64_t begin = std::min(begin_of(random), kNumel - length);
    ExpectBothKernelsFind(pair, begin, begin + length);
  }
}

TEST_P(CompareKernelTest, EmptyRangesAppendNothing) {
  constexpr uint64_t kNumel = 300;
  const TensorPair pair = MakeTensorPair(width(), kNumel, 1.0, kSeed);
  for (const uint64_t position : {uint64_t{0}, uint64_t{1}, uint64_t{64}, kNumel}) {
    for (const CompareKernel kernel : {CompareKernel::kBest, CompareKernel::kScalar}) {
      std::vector<uint64_t> out = {7, 42};
      AppendChangedLocations(pair.old_bytes, pair.new_bytes, width(), position, position, &out,
                             kernel);
      EXPECT_THAT(out, ElementsAreArray({uint64_t{7}, uint64_t{42}})) << "at " << position;
    }
  }
  // Zero-sized tensors.
  std::vector<uint64_t> out;
  AppendChangedLocations({}, {}, width(), 0, 0, &out);
  EXPECT_TRUE(out.empty());
}

TEST_P(CompareKernelTest, AppendsAfterExistingLocations) {
  constexpr uint64_t kNumel = 5000;
  const TensorPair pair = MakeTensorPair(width(), kNumel, 0.02, kSeed);
  std::vector<uint64_t> out = {1, 2, 3};
  AppendChangedLocations(pair.old_bytes, pair.new_bytes, width(), 0, kNumel, &out);
  std::vector<uint64_t> expected = {1, 2, 3};
  expected.insert(expected.end(), pair.changed.begin(), pair.changed.end());
  EXPECT_THAT(out, ElementsAreArray(expected));
}

TEST_P(CompareTargetTest, ComparesFloatingPointSpecialValuesBitwise) {
  // Pairs where float != and bitwise comparison disagree: ±0 differ bitwise but compare equal;
  // an identical NaN is unchanged bitwise but unequal as a float; NaN payloads, signalling vs
  // quiet NaNs, subnormals and infinities must be told apart by their bits.
  constexpr int kCopies = 40;
  {
    SCOPED_TRACE("bfloat16 / binary16");
    const TensorPair pair = MakePatternPair<uint16_t>(
        {{0x0000, 0x8000},   // +0 vs -0
         {0x8000, 0x8000},   // -0 unchanged
         {0x7FC0, 0x7FC0},   // bf16 quiet NaN unchanged
         {0x7FC0, 0x7FC1},   // bf16 NaN payload
         {0x7FC0, 0xFFC0},   // bf16 NaN sign
         {0x7F81, 0x7FC1},   // bf16 signalling vs quiet NaN
         {0x7F80, 0x7F80},   // bf16 +Inf unchanged
         {0x7F80, 0xFF80},   // bf16 +Inf vs -Inf
         {0x7F80, 0x7F81},   // bf16 Inf vs NaN
         {0x0001, 0x0001},   // subnormal unchanged
         {0x0001, 0x0002},   // subnormal 1 ulp
         {0x0001, 0x0000},   // smallest subnormal vs +0
         {0x807F, 0x8080},   // bf16 largest negative subnormal vs smallest negative normal
         {0x7C00, 0x7C01},   // f16 +Inf vs NaN
         {0x7E00, 0x7E00},   // f16 quiet NaN unchanged
         {0x3F80, 0x3F81}},  // bf16 1.0 vs next
        kCopies, kSeed);
    ExpectBothKernelsFind(pair, 0, pair.numel());
  }
  {
    SCOPED_TRACE("float32");
    const auto bits = [](float value) { return std::bit_cast<uint32_t>(value); };
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    const float denorm = std::numeric_limits<float>::denorm_min();
    const TensorPair pair =
        MakePatternPair<uint32_t>({{bits(0.0f), bits(-0.0f)},
                                   {bits(-0.0f), bits(-0.0f)},
                                   {bits(nan), bits(nan)},
                                   {bits(nan), bits(nan) | 1u},
                                   {bits(nan), bits(-nan)},
                                   {bits(std::numeric_limits<float>::signaling_NaN()), bits(nan)},
                                   {bits(inf), bits(inf)},
                                   {bits(inf), bits(-inf)},
                                   {bits(denorm), bits(denorm)},
                                   {bits(denorm), bits(0.0f)},
                                   {bits(denorm), bits(2 * denorm)},
                                   {bits(std::numeric_limits<float>::max()), bits(inf)},
                                   {bits(1.0f), bits(std::nextafter(1.0f, 2.0f))},
                                   {0x80000000u, 0x00000000u}},  // the sign bit alone (top byte)
                                  kCopies, kSeed);
    ExpectBothKernelsFind(pair, 0, pair.numel());
  }
  {
    SCOPED_TRACE("float64");
    const auto bits = [](double value) { return std::bit_cast<uint64_t>(value); };
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    const double denorm = std::numeric_limits<double>::denorm_min();
    const TensorPair pair = MakePatternPair<uint64_t>(
        {{bits(0.0), bits(-0.0)},
         {bits(-0.0), bits(-0.0)},
         {bits(nan), bits(nan)},
         {bits(nan), bits(nan) | 1u},
         {bits(nan), bits(-nan)},
         {bits(std::numeric_limits<double>::signaling_NaN()), bits(nan)},
         {bits(inf), bits(inf)},
         {bits(inf), bits(-inf)},
         {bits(denorm), bits(denorm)},
         {bits(denorm), bits(0.0)},
         {bits(std::numeric_limits<double>::max()), bits(inf)},
         {bits(1.0), bits(std::nextafter(1.0, 2.0))},
         {uint64_t{1} << 63, 0},             // the sign bit alone (top byte)
         {uint64_t{1} << 32, uint64_t{0}}},  // a change in the upper 32-bit half only
        kCopies, kSeed);
    ExpectBothKernelsFind(pair, 0, pair.numel());
  }
}

TEST_P(CompareTargetTest, AllFp8PatternPairs) {
  // Every (old, new) pair of the 256 byte patterns of FP8 E4M3/E5M2 (NaNs, ±0, subnormals, ±Inf
  // included): element i holds old = i / 256 and new = i % 256.
  constexpr uint64_t kPatterns = 256;
  TensorPair pair;
  pair.width = 1;
  for (uint64_t i = 0; i < kPatterns * kPatterns; ++i) {
    pair.old_bytes.push_back(static_cast<std::byte>(i / kPatterns));
    pair.new_bytes.push_back(static_cast<std::byte>(i % kPatterns));
    if (i / kPatterns != i % kPatterns) {
      pair.changed.push_back(i);
    }
  }
  ASSERT_EQ(pair.changed.size(), kPatterns * (kPatterns - 1));
  ExpectBothKernelsFind(pair, 0, pair.numel());
}

std::string TargetAndWidthName(
    const ::testing::TestParamInfo<std::tuple<int64_t, uint32_t>>& info) {
  return std::string(hwy::TargetName(std::get<0>(info.param))) + "_width" +
         std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    AllTargets, CompareKernelTest,
    ::testing::Combine(::testing::ValuesIn(hwy::SupportedAndGeneratedTargets()),
                       ::testing::ValuesIn(kWidths)),
    TargetAndWidthName);

std::string TargetName(const ::testing::TestParamInfo<int64_t>& info) {
  return hwy::TargetName(info.param);
}

INSTANTIATE_TEST_SUITE_P(AllTargets, CompareTargetTest,
                         ::testing::ValuesIn(hwy::SupportedAndGeneratedTargets()), TargetName);

TEST(BestCompareTargetTest, NamesATarget) {
  EXPECT_FALSE(BestCompareTarget().empty());
  EXPECT_NE(BestCompareTarget(), "Unknown");
}

TEST(FindChangedLocationsTest, MultiThreadedEqualsSingleThreaded) {
  constexpr uint64_t kNumel = 20011;
  for (const uint32_t width : kWidths) {
    const TensorPair pair = MakeTensorPair(width, kNumel, 0.02, kSeed + width);
    for (const auto& [begin, end] :
         {std::pair<uint64_t, uint64_t>{0, kNumel}, std::pair<uint64_t, uint64_t>{13, kNumel - 5},
          std::pair<uint64_t, uint64_t>{4096, 4097}}) {
      ASSERT_OK_AND_ASSIGN(const std::vector<uint64_t> single,
                           FindChangedLocations(pair.old_bytes, pair.new_bytes, width, begin, end));
      ASSERT_THAT(single, ElementsAreArray(ExpectedIn(pair, begin, end)));
      for (int threads = 2; threads <= 4; ++threads) {
        for (const uint64_t chunk_elements : {1, 3, 64, 1000, 4096, 1 << 20}) {
          for (const CompareKernel kernel : {CompareKernel::kBest, CompareKernel::kScalar}) {
            CompareOptions options;
            options.threads = threads;
            options.chunk_elements = chunk_elements;
            options.kernel = kernel;
            ASSERT_OK_AND_ASSIGN(
                const std::vector<uint64_t> multi,
                FindChangedLocations(pair.old_bytes, pair.new_bytes, width, begin, end, options));
            ASSERT_EQ(multi, single)
                << "width " << width << ", threads " << threads << ", chunk_elements "
                << chunk_elements << ", range [" << begin << ", " << end << ")";
          }
        }
      }
    }
  }
}

TEST(FindChangedLocationsTest, EmptyRangeWithThreads) {
  const TensorPair pair = MakeTensorPair(2, 100, 1.0, kSeed);
  CompareOptions options;
  options.threads = 4;
  options.chunk_elements = 1;
  ASSERT_OK_AND_ASSIGN(const std::vector<uint64_t> locations,
                       FindChangedLocations(pair.old_bytes, pair.new_bytes, 2, 50, 50, options));
  EXPECT_TRUE(locations.empty());
}

TEST(FindChangedLocationsTest, RejectsInvalidArguments) {
  const std::vector<std::byte> ten_bytes(10);
  const std::vector<std::byte> eight_bytes(8);
  const std::vector<std::byte> seven_bytes(7);
  for (const uint32_t width : {0u, 3u, 5u, 16u}) {
    EXPECT_STATUS_MSG(InvalidArgument, "width " + std::to_string(width),
                      FindChangedLocations(eight_bytes, eight_bytes, width, 0, 0));
  }
  EXPECT_STATUS_MSG(InvalidArgument, "10 bytes but new tensor has 8 bytes",
                    FindChangedLocations(ten_bytes, eight_bytes, 2, 0, 0));
  EXPECT_STATUS_MSG(InvalidArgument, "7 bytes is not a multiple of element width 2",
                    FindChangedLocations(seven_bytes, seven_bytes, 2, 0, 0));
  EXPECT_STATUS_MSG(InvalidArgument, "range [0, 6) is not inside the tensor's 5 elements",
                    FindChangedLocations(ten_bytes, ten_bytes, 2, 0, 6));
  EXPECT_STATUS_MSG(InvalidArgument, "range [4, 3)",
                    FindChangedLocations(ten_bytes, ten_bytes, 2, 4, 3));
  EXPECT_STATUS_MSG(InvalidArgument, "range [6, 6)",
                    FindChangedLocations(ten_bytes, ten_bytes, 2, 6, 6));
  CompareOptions no_threads;
  no_threads.threads = 0;
  EXPECT_STATUS_MSG(InvalidArgument, "threads 0",
                    FindChangedLocations(ten_bytes, ten_bytes, 2, 0, 5, no_threads));
  CompareOptions empty_chunks;
  empty_chunks.threads = 2;
  empty_chunks.chunk_elements = 0;
  EXPECT_STATUS_MSG(InvalidArgument, "chunk_elements is 0",
                    FindChangedLocations(ten_bytes, ten_bytes, 2, 0, 5, empty_chunks));
  // The boundaries themselves are valid.
  EXPECT_OK(FindChangedLocations(ten_bytes, ten_bytes, 2, 5, 5));
  EXPECT_OK(FindChangedLocations(ten_bytes, ten_bytes, 2, 0, 5));
}

}  // namespace
}  // namespace refit
