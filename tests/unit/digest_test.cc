#include "core/digest.h"

#include <gtest/gtest.h>

#include "codec/values.h"
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

}  // namespace
}  // namespace refit
