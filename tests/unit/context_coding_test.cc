// Tests of context-coded deltas (src/codec/context_coding.cc): bit-exact round trips over the
// float dtypes, the size gain where the old magnitude predicts the change, and the decoder's
// answers to hostile bytes and to old weights that differ from the producer's.
#include "codec/context_coding.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <span>
#include <vector>

#include "refit/dtype.h"
#include "test_util.h"

namespace refit::internal {
namespace {

struct StepPair {
  std::vector<std::byte> old_bytes;
  std::vector<uint64_t> locations;
  std::vector<std::byte> xor_values;
};

uint64_t Load(const std::vector<std::byte>& bytes, uint32_t width, uint64_t index) {
  uint64_t bits = 0;
  std::memcpy(&bits, bytes.data() + index * width, width);
  return bits;
}

// An Adam-like step on random old bits: an element changes with a probability that falls with
// its magnitude (its exponent field), by ±1 ulp mostly, more at small magnitudes. `scale_bits`
// makes the probability uniform instead when 0.
StepPair MakeStep(DType dtype, uint64_t span, uint32_t seed, bool magnitude_dependent = true) {
  const uint32_t width = DTypeSize(dtype);
  const uint32_t bits = 8 * width;
  std::mt19937_64 rng(seed);
  StepPair pair;
  pair.old_bytes.resize(span * width);
  std::normal_distribution<double> exponent_offset(0, 2.5);
  std::uniform_real_distribution<double> unit(0, 1);
  const uint64_t magnitude_mask = (bits == 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1) >> 1;
  for (uint64_t i = 0; i < span; ++i) {
    // Magnitude bits concentrated around the middle of the range, like real weights' exponents.
    const double centre = static_cast<double>(magnitude_mask) * 0.45;
    const double spread = static_cast<double>(magnitude_mask) * 0.02 * exponent_offset(rng);
    uint64_t magnitude = static_cast<uint64_t>(
        std::clamp(centre + spread, 1.0, static_cast<double>(magnitude_mask)));
    const uint64_t sign = (rng() & 1) << (bits - 1);
    const uint64_t value = sign | (magnitude & magnitude_mask);
    std::memcpy(pair.old_bytes.data() + i * width, &value, width);
  }
  for (uint64_t i = 0; i < span; ++i) {
    const uint64_t old_bits = Load(pair.old_bytes, width, i);
    const double magnitude =
        static_cast<double>(old_bits & magnitude_mask) / static_cast<double>(magnitude_mask);
    const double p =
        magnitude_dependent ? std::clamp(0.9 - 2 * (magnitude - 0.4) * 10, 0.001, 0.9) : 0.03;
    if (unit(rng) >= p) continue;
    const uint64_t steps = magnitude < 0.44 ? 1 + rng() % 4 : 1;
    const uint64_t mask = bits == 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1;
    const uint64_t new_bits = ((rng() & 1) ? old_bits + steps : old_bits - steps) & mask;
    if (new_bits == old_bits) continue;
    pair.locations.push_back(i);
    const uint64_t x = old_bits ^ new_bits;
    const size_t at = pair.xor_values.size();
    pair.xor_values.resize(at + width);
    std::memcpy(pair.xor_values.data() + at, &x, width);
  }
  return pair;
}

class ContextCodingRoundTrip : public ::testing::TestWithParam<DType> {};

TEST_P(ContextCodingRoundTrip, DecodesToTheSameLocationsAndXorValues) {
  const DType dtype = GetParam();
  for (uint64_t span :
       {uint64_t{0}, uint64_t{1}, uint64_t{63}, uint64_t{64}, uint64_t{1000}, uint64_t{200003}}) {
    for (uint32_t max_classes : {1u, 4u, 16u}) {
      SCOPED_TRACE(testing::Message()
                   << DTypeName(dtype) << " span " << span << " classes " << max_classes);
      const StepPair pair = MakeStep(dtype, span, static_cast<uint32_t>(span) + max_classes);
      ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes,
                           EncodeContextCoded(dtype, pair.old_bytes, pair.locations,
                                              pair.xor_values, {.max_classes = max_classes}));
      ASSERT_OK_AND_ASSIGN(ContextDecoded decoded,
                           DecodeContextCoded(dtype, pair.old_bytes, bytes, pair.locations.size()));
      EXPECT_EQ(decoded.locations, pair.locations);
      EXPECT_EQ(decoded.xor_values, pair.xor_values);
      // Deterministic: the same inputs give the same bytes.
      ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> again,
                           EncodeContextCoded(dtype, pair.old_bytes, pair.locations,
                                              pair.xor_values, {.max_classes = max_classes}));
      EXPECT_EQ(again, bytes);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(FloatDTypes, ContextCodingRoundTrip,
                         ::testing::Values(DType::kBFloat16, DType::kFloat16, DType::kFloat32,
                                           DType::kFloat8E4M3FN, DType::kFloat8E5M2,
                                           DType::kFloat8E4M3FNUZ, DType::kFloat8E5M2FNUZ),
                         [](const auto& param_info) {
                           return std::string(DTypeName(param_info.param));
                         });

TEST(ContextCoding, EveryElementChangedAndSignCrossingsRoundTrip) {
  const DType dtype = DType::kBFloat16;
  const uint64_t span = 4099;
  std::vector<std::byte> old_bytes(span * 2);
  std::vector<uint64_t> locations(span);
  std::vector<std::byte> xor_values(span * 2);
  for (uint64_t i = 0; i < span; ++i) {
    const uint16_t old_bits = static_cast<uint16_t>(i * 40503u);
    const uint16_t new_bits = static_cast<uint16_t>(old_bits ^ 0x8000u ^ (i & 0xFF));
    std::memcpy(old_bytes.data() + i * 2, &old_bits, 2);
    const uint16_t x = old_bits ^ new_bits;
    std::memcpy(xor_values.data() + i * 2, &x, 2);
    locations[i] = i;
  }
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes,
                       EncodeContextCoded(dtype, old_bytes, locations, xor_values));
  ASSERT_OK_AND_ASSIGN(ContextDecoded decoded, DecodeContextCoded(dtype, old_bytes, bytes, span));
  EXPECT_EQ(decoded.locations, locations);
  EXPECT_EQ(decoded.xor_values, xor_values);
}

// The point of the encoding: where the old magnitude predicts the change, the coded size is
// well under the memoryless entropy bound H(gap) + H(xor) of the same changes.
TEST(ContextCoding, BeatsTheMemorylessBoundWhereMagnitudePredictsTheChange) {
  const DType dtype = DType::kBFloat16;
  const StepPair pair = MakeStep(dtype, uint64_t{1} << 20, 7);
  ASSERT_GT(pair.locations.size(), 1000u);
  std::map<uint64_t, double> gaps;
  std::map<uint64_t, double> xors;
  for (size_t i = 0; i < pair.locations.size(); ++i) {
    gaps[i == 0 ? pair.locations[0] : pair.locations[i] - pair.locations[i - 1]] += 1;
    xors[Load(pair.xor_values, 2, i)] += 1;
  }
  const double n = static_cast<double>(pair.locations.size());
  double bound_bits = 0;
  for (const auto* histogram : {&gaps, &xors}) {
    for (const auto& [symbol, count] : *histogram) bound_bits -= count * std::log2(count / n);
  }
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes,
                       EncodeContextCoded(dtype, pair.old_bytes, pair.locations, pair.xor_values));
  EXPECT_LT(static_cast<double>(bytes.size()), 0.8 * bound_bits / 8)
      << "coded " << bytes.size() << " bytes, memoryless bound " << bound_bits / 8;
}

TEST(ContextCoding, RefusesWhatItCannotEncode) {
  std::vector<std::byte> old_bytes(16);
  std::vector<uint64_t> locations = {1, 1};
  std::vector<std::byte> values(4, std::byte{1});
  EXPECT_STATUS(InvalidArgument, EncodeContextCoded(DType::kInt16, old_bytes, {}, {}));
  EXPECT_STATUS(InvalidArgument, EncodeContextCoded(DType::kFloat64, old_bytes, {}, {}));
  EXPECT_STATUS(InvalidArgument,
                EncodeContextCoded(DType::kBFloat16, old_bytes, locations, values));
  locations = {1, 8};
  EXPECT_STATUS(InvalidArgument,
                EncodeContextCoded(DType::kBFloat16, old_bytes, locations, values));
  locations = {1, 2};
  EXPECT_STATUS(InvalidArgument, EncodeContextCoded(DType::kBFloat16, old_bytes, locations,
                                                    std::vector<std::byte>(4)));  // zero XOR values
  EXPECT_FALSE(ContextCodingSupported(DType::kFloat64));
  EXPECT_TRUE(ContextCodingSupported(DType::kBFloat16));
}

TEST(ContextCoding, RejectsOldWeightsThatDifferFromTheProducers) {
  const DType dtype = DType::kBFloat16;
  StepPair pair = MakeStep(dtype, 100000, 3);
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes,
                       EncodeContextCoded(dtype, pair.old_bytes, pair.locations, pair.xor_values));
  // Move one element to the largest magnitude class: the class sizes no longer match.
  std::vector<std::byte> other = pair.old_bytes;
  const uint16_t huge = 0x7F00;
  std::memcpy(other.data() + 2 * 500, &huge, 2);
  EXPECT_STATUS(DataLoss, DecodeContextCoded(dtype, other, bytes, pair.locations.size()));
  // A different span length or count is caught before any pass.
  EXPECT_STATUS(DataLoss, DecodeContextCoded(dtype, std::span(pair.old_bytes).first(2 * 99999),
                                             bytes, pair.locations.size()));
  EXPECT_STATUS(DataLoss,
                DecodeContextCoded(dtype, pair.old_bytes, bytes, pair.locations.size() + 1));
}

TEST(ContextCoding, RejectsTruncationTrailingBytesAndSurvivesEveryByteFlip) {
  const DType dtype = DType::kFloat16;
  const StepPair pair = MakeStep(dtype, 5000, 11);
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> bytes,
                       EncodeContextCoded(dtype, pair.old_bytes, pair.locations, pair.xor_values));
  for (size_t length = 0; length < bytes.size(); ++length) {
    EXPECT_FALSE(DecodeContextCoded(dtype, pair.old_bytes, std::span(bytes).first(length),
                                    pair.locations.size())
                     .ok())
        << "truncated to " << length;
  }
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_STATUS(DataLoss, DecodeContextCoded(dtype, pair.old_bytes, longer, pair.locations.size()));
  // Every single-bit flip either fails cleanly or decodes to some valid change set of the span.
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::vector<uint8_t> flipped = bytes;
    flipped[i] ^= static_cast<uint8_t>(1u << (i % 8));
    auto decoded = DecodeContextCoded(dtype, pair.old_bytes, flipped, pair.locations.size());
    if (!decoded.ok()) {
      EXPECT_TRUE(decoded.status().code() == StatusCode::kDataLoss ||
                  decoded.status().code() == StatusCode::kInvalidArgument)
          << decoded.status().ToString();
      continue;
    }
    ASSERT_EQ(decoded->locations.size(), pair.locations.size());
    for (size_t j = 1; j < decoded->locations.size(); ++j) {
      ASSERT_LT(decoded->locations[j - 1], decoded->locations[j]);
    }
  }
}

TEST(ContextCoding, NamesTheSimdTarget) { EXPECT_FALSE(ContextCodingSimdTarget().empty()); }

}  // namespace
}  // namespace refit::internal
