#include "core/digest.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "codec/values.h"
#include "core/digest_kernels.h"
#include "test_data.h"

namespace refit {
namespace {

// The digest function is part of payload format v1: pin a few values so a change is noticed.
TEST(DigestTest, ElementHashIsPinned) {
  EXPECT_EQ(ElementHash(0, 0), 0x48218226ff3cd4bfULL);
  EXPECT_EQ(ElementHash(1, 0x3c00), 0xa19fdf853cbff836ULL);
  EXPECT_EQ(ElementHash(1ULL << 40, 0xffffffffffffffffULL), 0x2929fa3ed8ca297cULL);
}

TEST(DigestTest, DependsOnIndexAndBits) {
  EXPECT_NE(ElementHash(0, 1), ElementHash(1, 1));
  EXPECT_NE(ElementHash(5, 1), ElementHash(5, 2));
  // A swap of two values changes the digest (position matters, unlike a plain sum of hashes).
  EXPECT_NE(ElementHash(0, 1) + ElementHash(1, 2), ElementHash(0, 2) + ElementHash(1, 1));
}

TEST(DigestTest, RangesAddUp) {
  for (DType dtype : {DType::kUInt8, DType::kBFloat16, DType::kFloat32, DType::kFloat64}) {
    OwnedTensor t = testing::RandomTensor("t", dtype, {1000}, 7);
    const uint32_t w = DTypeSize(dtype);
    EXPECT_EQ(TensorDigest(t.view()),
              DigestRange(t.bytes, w, 0, 333) + DigestRange(t.bytes, w, 333, 1000));
    EXPECT_EQ(DigestRange(t.bytes, w, 10, 10), 0u);
  }
}

TEST(DigestTest, IncrementalUpdateMatchesRecompute) {
  OwnedTensor old_t = testing::RandomTensor("t", DType::kBFloat16, {4096}, 1);
  OwnedTensor new_t = testing::Perturb(old_t, 0.05, 2);
  uint64_t digest = TensorDigest(old_t.view());
  for (uint64_t i = 0; i < 4096; ++i) {
    const uint64_t a = LoadBits(old_t.bytes, 2, i);
    const uint64_t b = LoadBits(new_t.bytes, 2, i);
    if (a != b) digest += ElementHash(i, b) - ElementHash(i, a);
  }
  EXPECT_EQ(digest, TensorDigest(new_t.view()));
  EXPECT_NE(digest, TensorDigest(old_t.view()));
}

// Every vector kernel this CPU runs (AVX-512, AVX2) returns the scalar sum bit for bit: each
// width, lengths around the kernels' 32- and 16-element steps, unaligned starts, and indices that
// wrap past 2^64.
TEST(DigestTest, EveryKernelReturnsTheScalarSum) {
  std::mt19937_64 rng(2026);
  std::vector<std::byte> bytes(1 << 16);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
  const auto reference = [&](uint32_t width, size_t offset, uint64_t first, uint64_t count) {
    uint64_t sum = 0;
    for (uint64_t k = 0; k < count; ++k) {
      uint64_t word = 0;
      std::memcpy(&word, bytes.data() + offset + k * width, width);
      sum += ElementHash(first + k, word);
    }
    return sum;
  };
  std::vector<std::string> targets;
  for (const char* target : {"scalar", "avx2", "avx512"}) {
    if (internal::DigestTargetSupported(target)) targets.push_back(target);
  }
  ASSERT_TRUE(internal::DigestTargetSupported(internal::DigestTargetName()));
  for (int trial = 0; trial < 2000; ++trial) {
    const uint32_t width = 1u << (rng() % 4);
    const uint64_t count = trial < 100 ? static_cast<uint64_t>(trial) : rng() % 300;
    const size_t offset = rng() % 61;
    const uint64_t first = trial % 3 == 0 ? UINT64_MAX - rng() % 64 : rng() % (uint64_t{1} << 40);
    const uint64_t want = reference(width, offset, first, count);
    for (const std::string& target : targets) {
      EXPECT_EQ(internal::DigestRunOn(target, bytes.data() + offset, width, first, count), want)
          << target << " width " << width << " count " << count << " first " << first;
    }
  }
  // The public functions go through the dispatched kernel.
  const std::span<const std::byte> all(bytes);
  EXPECT_EQ(DigestRange(all, 2, 5, 1005), reference(2, 10, 5, 1000));
  EXPECT_EQ(RemappedDigestRange(all, 4, 3, 1 << 20, 777), reference(4, 12, 1 << 20, 777));
}

TEST(DigestTest, EveryChangeKernelReturnsTheScalarChange) {
  std::mt19937_64 rng(43);
  std::vector<std::string> targets;
  for (const char* target : {"scalar", "avx2", "avx512"}) {
    if (internal::DigestTargetSupported(target)) targets.push_back(target);
  }
  for (int trial = 0; trial < 1000; ++trial) {
    const size_t count = trial < 70 ? static_cast<size_t>(trial) : rng() % 700;
    std::vector<uint64_t> index(count), now(count), before(count);
    for (size_t k = 0; k < count; ++k) {
      // Indices anywhere (the top of the range wraps in h's offset), bits of any width.
      index[k] = trial % 3 == 0 ? UINT64_MAX - rng() % 1000 : rng() % (uint64_t{1} << 40);
      const uint64_t mask = ~uint64_t{0} >> (8 * (rng() % 8));
      now[k] = rng() & mask;
      before[k] = k % 5 == 0 ? now[k] : rng() & mask;  // Some unchanged: no change.
    }
    uint64_t want = 0;
    for (size_t k = 0; k < count; ++k) {
      want += ElementHash(index[k], now[k]) - ElementHash(index[k], before[k]);
      EXPECT_EQ(ElementHashChange(index[k], before[k], now[k]),
                ElementHash(index[k], now[k]) - ElementHash(index[k], before[k]));
    }
    for (const std::string& target : targets) {
      EXPECT_EQ(internal::DigestChangeRunOn(target, index.data(), now.data(), before.data(), count),
                want)
          << target << " count " << count;
    }
    // DigestChange's blocks (of 256) and callables give the same sum.
    EXPECT_EQ(DigestChange(
                  count, [&](size_t k) { return index[k]; }, [&](size_t k) { return now[k]; },
                  [&](size_t k) { return before[k]; }),
              want);
  }
}

}  // namespace
}  // namespace refit
