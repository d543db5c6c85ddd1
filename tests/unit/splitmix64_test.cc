#include "util/splitmix64.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace refit::internal {
namespace {

// The first outputs for seed 1234567 of the reference implementation (Vigna's splitmix64.c, the
// sequence also quoted by the Java SplittableRandom tests): the simulator's model, the golden
// inputs and the injected faults are pinned to it, so it must never drift.
TEST(SplitMix64Test, MatchesTheReferenceSequence) {
  SplitMix64 generator(1234567);
  std::vector<uint64_t> outputs;
  for (int i = 0; i < 5; ++i) outputs.push_back(generator.Next());
  EXPECT_EQ(outputs, (std::vector<uint64_t>{6457827717110365317ULL, 3203168211198807973ULL,
                                            9817491932198370423ULL, 4593380528125082431ULL,
                                            16408922859458223821ULL}));
}

TEST(SplitMix64Test, TheStatelessHashIsOneStepOfTheGenerator) {
  for (uint64_t seed : {uint64_t{0}, uint64_t{1234567}, ~uint64_t{0}}) {
    SplitMix64 generator(seed);
    EXPECT_EQ(SplitMix64Hash(seed), generator.Next());
    EXPECT_EQ(SplitMix64Hash(seed + kSplitMix64Gamma), generator.Next());
  }
}

TEST(SplitMix64Test, TheFinalizerIsUsableAtCompileTime) {
  static_assert(SplitMix64Finalize(0) == 0, "0 is the finalizer's fixed point");
  static_assert(SplitMix64Hash(1234567) == 6457827717110365317ULL);
  EXPECT_NE(SplitMix64Finalize(1), SplitMix64Finalize(2));
}

}  // namespace
}  // namespace refit::internal
