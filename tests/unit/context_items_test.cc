// Context-coded items end to end (payload format v2): the producer's coding of a tracker's XOR
// item (pipeline/context_items.h), the payload's version and rules, and the receiver's apply,
// which decodes the item against the bits it holds (host, or the device boundary's read when
// REFIT_TEST_DEVICE_MEMORY=1), verifies the digest and rolls back as before.
#include "pipeline/context_items.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>

#include "codec/locations.h"
#include "codec/tracker.h"
#include "receiver/apply.h"
#include "store_snapshot.h"
#include "test_util.h"
#include "util/endian.h"

namespace refit {
namespace {

using testing::AddTestTensor;
using testing::StoreBytes;
using testing::TakeSnapshot;

/// bf16 weights like a trained layer's (normal, σ = 0.02), and the next step: small magnitudes
/// move by one ulp far more often than large ones, as under Adam with a small learning rate.
std::pair<OwnedTensor, OwnedTensor> WeightStep(const std::string& name, uint64_t numel,
                                               uint64_t seed) {
  OwnedTensor old{name, DType::kBFloat16, {static_cast<int64_t>(numel)}, {}};
  old.bytes.resize(numel * 2);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  OwnedTensor next = old;
  for (uint64_t i = 0; i < numel; ++i) {
    const float value = normal(rng);
    auto bits = static_cast<uint16_t>(std::bit_cast<uint32_t>(value) >> 16);
    internal::StoreLittleEndian(reinterpret_cast<uint8_t*>(old.bytes.data()) + 2 * i, bits);
    const double p = std::min(0.5, 2e-4 / (std::fabs(value) + 1e-6));
    if (unit(rng) < p) bits = static_cast<uint16_t>(bits + (rng() % 2 == 0 ? 1 : -1));
    internal::StoreLittleEndian(reinterpret_cast<uint8_t*>(next.bytes.data()) + 2 * i, bits);
  }
  return {std::move(old), std::move(next)};
}

class ContextItemsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::tie(v0_, v1_) = WeightStep("layer.weight", 1 << 16, 7);
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make(TrackerOptions{}));
    const TransferId id = TransferId::Random();
    ASSERT_OK(tracker_->Begin(id).status());
    ASSERT_OK(tracker_->Encode(id, v0_.view()).status());
    ASSERT_OK(tracker_->Commit(id));
    store_ = WeightStore::Make();
    ASSERT_OK(AddTestTensor(*store_, v0_.view()));
    store_->set_version(tracker_->version());
    id_ = TransferId::Random();
    ASSERT_OK_AND_ASSIGN(plan_, tracker_->Begin(id_));
    ASSERT_OK_AND_ASSIGN(internal::EncodeResult encoded, tracker_->Encode(id_, v1_.view()));
    ASSERT_EQ(encoded.items.size(), 1u);
    plain_ = std::move(encoded.items[0]);
    ASSERT_OK_AND_ASSIGN(TensorView baseline, tracker_->Baseline(v0_.name));
    baseline_ = baseline.bytes;
  }

  std::vector<std::byte> Encode(const Item& item) {
    const ItemView view = item.view();
    Result<std::vector<std::byte>> bytes = EncodePayload(
        PayloadIds{id_, 0, 0, plan_.base_version, plan_.target_version}, std::span(&view, 1));
    EXPECT_OK(bytes.status());
    return std::move(bytes).ValueOrDie();
  }

  OwnedTensor v0_, v1_;
  std::unique_ptr<internal::DeltaTracker> tracker_;
  std::unique_ptr<WeightStore> store_;
  TransferId id_;
  TransferPlan plan_;
  Item plain_;
  std::span<const std::byte> baseline_;
};

TEST_F(ContextItemsTest, AContextItemMakesAVersion2PayloadThatAppliesAndRollsBackExactly) {
  ASSERT_GT(plain_.count, 100u);
  ASSERT_OK_AND_ASSIGN(Item coded, internal::ContextCodeItem(plain_.view(), baseline_));
  EXPECT_EQ(coded.location_encoding, LocationEncoding::kContext);
  EXPECT_TRUE(coded.values.empty());
  EXPECT_EQ(coded.digest, plain_.digest);

  const std::vector<std::byte> plain_bytes = Encode(plain_);
  const std::vector<std::byte> coded_bytes = Encode(coded);
  ASSERT_OK_AND_ASSIGN(PayloadHeader plain_header, ValidatePayloadHeader(plain_bytes));
  ASSERT_OK_AND_ASSIGN(PayloadHeader coded_header, ValidatePayloadHeader(coded_bytes));
  EXPECT_EQ(plain_header.format_version, 1);  // v1 writers unchanged without context items.
  EXPECT_EQ(coded_header.format_version, 2);

  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(coded_bytes));
  ASSERT_TRUE(decoded.has_context_items());
  EXPECT_TRUE(decoded.items()[0].values.empty());

  const auto before = TakeSnapshot(*store_);
  internal::UndoLog undo;
  ASSERT_OK(internal::ApplyPayload(decoded, *store_, &undo));
  EXPECT_EQ(StoreBytes(*store_, v0_.name), v1_.bytes);
  EXPECT_EQ(undo.payload_bytes(), 0u);  // Undone from old bits, not by re-applying.
  ASSERT_OK(undo.Rollback(*store_));
  EXPECT_EQ(TakeSnapshot(*store_), before);
}

TEST_F(ContextItemsTest, ExpandingGivesThePlainItemBack) {
  ASSERT_OK_AND_ASSIGN(Item coded, internal::ContextCodeItem(plain_.view(), baseline_));
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(Encode(coded)));
  ASSERT_OK_AND_ASSIGN(DecodedPayload expanded,
                       ExpandContextItems(decoded, [&](const ItemView&, std::span<std::byte> out) {
                         std::memcpy(out.data(), baseline_.data(), out.size());
                         return Result<bool>(true);
                       }));
  EXPECT_FALSE(expanded.has_context_items());
  const ItemView& item = expanded.items()[0];
  ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> got, DecodeAllLocations(item));
  ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> want, DecodeAllLocations(plain_.view()));
  EXPECT_EQ(got, want);
  EXPECT_TRUE(std::ranges::equal(item.values, plain_.values));
  EXPECT_EQ(item.digest, plain_.digest);
  EXPECT_EQ(item.span_begin, plain_.span_begin);
  EXPECT_EQ(item.span_end, plain_.span_end);
}

TEST_F(ContextItemsTest, AReceiverNotAtTheBaseIsRefusedAndKeepsItsBits) {
  ASSERT_OK_AND_ASSIGN(Item coded, internal::ContextCodeItem(plain_.view(), baseline_));
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(Encode(coded)));
  // The receiver's old bits of a changed element differ from the producer's: the decode (a class
  // whose size no longer agrees) or the digest check refuses the payload.
  ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> changed, DecodeAllLocations(plain_.view()));
  ASSERT_OK(testing::FlipByte(*store_, v0_.name, 2 * changed[changed.size() / 2]));
  const auto before = TakeSnapshot(*store_);
  internal::UndoLog undo;
  EXPECT_STATUS(DataLoss, internal::ApplyPayload(decoded, *store_, &undo));
  EXPECT_EQ(TakeSnapshot(*store_), before);
  EXPECT_EQ(undo.records(), 0u);
}

TEST_F(ContextItemsTest, AVersion1PayloadMayNotCarryAContextItem) {
  ASSERT_OK_AND_ASSIGN(Item coded, internal::ContextCodeItem(plain_.view(), baseline_));
  std::vector<std::byte> bytes = Encode(coded);
  auto* header = reinterpret_cast<uint8_t*>(bytes.data());
  internal::StoreLittleEndian(header + 4, uint16_t{1});
  internal::StoreLittleEndian(header + kPayloadHeaderSize - 8,
                              XXH3_64bits(header, kPayloadHeaderSize - 8));
  EXPECT_STATUS_MSG(InvalidArgument, "unknown location encoding code 7", DecodePayload(bytes));
}

TEST_F(ContextItemsTest, AContextItemMustBeXorOfAFloatDType) {
  ASSERT_OK_AND_ASSIGN(Item coded, internal::ContextCodeItem(plain_.view(), baseline_));
  Item overwrite = coded;
  overwrite.op = Op::kOverwrite;
  const ItemView view = overwrite.view();
  EXPECT_STATUS_MSG(InvalidArgument, "needs op xor",
                    EncodePayload(PayloadIds{id_, 0, 0, 1, 2}, std::span(&view, 1)));
  Item with_values = coded;
  with_values.values = plain_.values;
  const ItemView view2 = with_values.view();
  EXPECT_STATUS_MSG(InvalidArgument, "carries none",
                    EncodePayload(PayloadIds{id_, 0, 0, 1, 2}, std::span(&view2, 1)));
}

TEST_F(ContextItemsTest, TheChoiceFollowsTheModeAndTheLink) {
  const auto reader = [&](const ItemView&, std::span<const std::byte>* old_span) {
    *old_span = baseline_;
    return Result<bool>(true);
  };
  const PayloadEncodeOptions encode;
  {
    std::vector<Item> items{plain_};
    ASSERT_OK_AND_ASSIGN(auto report, internal::ChooseItemCoding(items, ItemCoding::kPlain,
                                                                 "s3://b/p", encode, reader));
    EXPECT_EQ(report.context_coded, 0u);
    EXPECT_EQ(items[0].location_encoding, plain_.location_encoding);
  }
  {
    std::vector<Item> items{plain_};
    ASSERT_OK_AND_ASSIGN(auto report, internal::ChooseItemCoding(items, ItemCoding::kAuto, "zmq://",
                                                                 encode, reader));
    EXPECT_EQ(report.candidates, 0u);  // A fast link: not even measured.
    EXPECT_EQ(items[0].location_encoding, plain_.location_encoding);
  }
  {
    std::vector<Item> items{plain_};
    ASSERT_OK_AND_ASSIGN(auto report, internal::ChooseItemCoding(items, ItemCoding::kContext,
                                                                 "zmq://", encode, reader));
    EXPECT_EQ(report.context_coded, 1u);
    EXPECT_EQ(items[0].location_encoding, LocationEncoding::kContext);
  }
  {
    // On s3:// (priced bytes) the item goes context-coded exactly when it saves the margin.
    std::vector<Item> items{plain_};
    ASSERT_OK_AND_ASSIGN(auto report, internal::ChooseItemCoding(items, ItemCoding::kAuto,
                                                                 "s3://b/p", encode, reader));
    EXPECT_EQ(report.candidates, 1u);
    const bool pays = report.sent_bytes <= (1 - internal::kContextMinSaving) * report.plain_bytes &&
                      report.sent_bytes < report.plain_bytes;
    EXPECT_EQ(report.context_coded == 1, pays) << report.sent_bytes << " vs " << report.plain_bytes;
    EXPECT_EQ(report.context_coded, 1u) << "these Adam-like weights should pay on s3://";
  }
  {
    // Uniformly random bits with scattered changes: no context to exploit, the choice falls back.
    std::vector<Item> items{plain_};
    std::vector<std::byte> noise(baseline_.size());
    std::mt19937_64 rng(3);
    for (std::byte& b : noise) b = static_cast<std::byte>(rng());
    ASSERT_OK_AND_ASSIGN(auto report, internal::ChooseItemCoding(
                                          items, ItemCoding::kAuto, "s3://b/p", encode,
                                          [&](const ItemView&, std::span<const std::byte>* s) {
                                            *s = noise;
                                            return Result<bool>(true);
                                          }));
    EXPECT_EQ(report.candidates, 1u);
    EXPECT_LE(report.sent_bytes, report.plain_bytes);
  }
}

}  // namespace
}  // namespace refit
