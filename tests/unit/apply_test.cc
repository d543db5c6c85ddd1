#include "receiver/apply.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "codec/tracker.h"
#include "core/digest.h"
#include "store_snapshot.h"
#include "test_data.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::AddTestTensor;
using testing::StoreBytes;
using testing::StoreSnapshot;
using testing::TakeSnapshot;

using testing::Perturb;
using testing::RandomTensor;

// `bytes` as a listener hands them on: the header validated (ValidatePayload).
ValidatedPayload Validated(std::vector<std::byte> bytes) {
  Result<ValidatedPayload> payload = ValidatePayload(std::move(bytes));
  EXPECT_OK(payload.status());
  return std::move(payload).ValueOrDie();
}

// `items` as one payload of transfer `id` (producer 0, payload 0) from `plan`'s base to its target.
std::vector<std::byte> EncodeItems(const TransferId& id, const TransferPlan& plan,
                                   const std::vector<Item>& items) {
  std::vector<ItemView> views;
  for (const Item& item : items) views.push_back(item.view());
  Result<std::vector<std::byte>> bytes =
      EncodePayload(PayloadIds{id, 0, 0, plan.base_version, plan.target_version}, views);
  EXPECT_OK(bytes.status());
  return std::move(bytes).ValueOrDie();
}

// The digest of items[forged] forged (its values stay right), the payload of `items` applied into
// `store` on `threads` threads with the payload kept for the undo: the apply fails with DataLoss
// and every item of the payload is undone, whatever ran on the other threads; the kept payload is
// untouched.
void ExpectAForgedDigestUndoesThePayload(std::vector<Item> items, size_t forged,
                                         const TransferId& id, const TransferPlan& plan,
                                         WeightStore& store, int threads) {
  const StoreSnapshot before = TakeSnapshot(store);
  const std::map<std::string, uint64_t> digests_before = store.Digests();
  items[forged].digest ^= 1;
  const std::vector<std::byte> bytes = EncodeItems(id, plan, items);
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(bytes));
  internal::UndoLog undo;
  ValidatedPayload kept = Validated(bytes);
  EXPECT_STATUS_MSG(DataLoss, "digest change after apply",
                    internal::ApplyPayload(decoded, store, &undo, &kept, threads));
  EXPECT_EQ(TakeSnapshot(store), before);
  EXPECT_EQ(store.Digests(), digests_before);
  EXPECT_EQ(undo.records(), 0u);
  EXPECT_TRUE(std::ranges::equal(kept.bytes(), bytes));
}

/// A producer and a receiver that start from the same weights, like a trainer and one replica.
class ApplyTest : public ::testing::TestWithParam<std::tuple<DType, Op>> {
 protected:
  void SetUp() override {
    const auto [dtype, op] = GetParam();
    TrackerOptions options;
    options.op = op;
    options.add_delta_dtype = DType::kFloat32;
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make(options));
    store_ = WeightStore::Make();
    v0_ = {RandomTensor("model.embed.weight", dtype, {300, 17}, 1),
           RandomTensor("model.norm.weight", dtype, {17}, 2)};
    const TransferId id = TransferId::Random();
    ASSERT_OK(tracker_->Begin(id));
    for (const OwnedTensor& t : v0_) {
      ASSERT_OK(tracker_->Encode(id, t.view()));
      ASSERT_OK(AddTestTensor(*store_, t.view()));
    }
    ASSERT_OK(tracker_->Commit(id));
    store_->set_version(tracker_->version());
  }

  /// Encode `next` as one transfer into one payload per tensor.
  std::vector<std::vector<std::byte>> EncodeStep(const std::vector<OwnedTensor>& next,
                                                 const TransferId& id) {
    auto plan = tracker_->Begin(id);
    EXPECT_TRUE(plan.ok());
    std::vector<std::vector<std::byte>> payloads;
    uint32_t payload_id = 0;
    for (const OwnedTensor& t : next) {
      auto encoded = tracker_->Encode(id, t.view());
      EXPECT_TRUE(encoded.ok()) << encoded.status().ToString();
      std::vector<ItemView> views;
      for (const Item& item : encoded->items) views.push_back(item.view());
      PayloadIds ids{id, 0, payload_id++, plan->base_version, plan->target_version};
      auto bytes = EncodePayload(ids, views);
      EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
      payloads.push_back(std::move(bytes).ValueOrDie());
    }
    return payloads;
  }

  std::unique_ptr<internal::DeltaTracker> tracker_;
  std::unique_ptr<WeightStore> store_;
  std::vector<OwnedTensor> v0_;
};

TEST_P(ApplyTest, StepsReproduceTheTrainerBitExactlyAndDigestsMatch) {
  std::vector<OwnedTensor> current = v0_;
  for (int step = 0; step < 3; ++step) {
    for (OwnedTensor& t : current) t = Perturb(t, 0.05, 10 * step + t.bytes.size());
    const TransferId id = TransferId::Random();
    internal::UndoLog undo;
    for (const auto& payload : EncodeStep(current, id)) {
      ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
      ASSERT_OK(internal::ApplyPayload(decoded, *store_, &undo));
    }
    // The receiver's incrementally kept digests equal a from-scratch digest and the producer's.
    EXPECT_EQ(store_->Digests(), store_->RecomputeDigests());
    EXPECT_EQ(store_->Digests(), tracker_->PendingDigests());
    ASSERT_OK(tracker_->Commit(id));
    undo.Clear();
    for (const OwnedTensor& t : current) {
      EXPECT_EQ(StoreBytes(*store_, t.name), t.bytes) << t.name;
    }
  }
}

TEST_P(ApplyTest, RollbackRestoresTheBaseBitExactly) {
  const StoreSnapshot before = TakeSnapshot(*store_);
  std::vector<OwnedTensor> next;
  for (const OwnedTensor& t : v0_) next.push_back(Perturb(t, 0.3, 99));
  const TransferId id = TransferId::Random();
  internal::UndoLog undo;
  for (const auto& payload : EncodeStep(next, id)) {
    ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
    ASSERT_OK(internal::ApplyPayload(decoded, *store_, &undo));
  }
  EXPECT_NE(TakeSnapshot(*store_), before);
  EXPECT_GT(undo.bytes(), 0u);
  ASSERT_OK(undo.Rollback(*store_));
  EXPECT_EQ(TakeSnapshot(*store_), before);
  EXPECT_EQ(undo.records(), 0u);
  ASSERT_OK(tracker_->Abort(id));
}

// What the receiver's session does: each payload's bytes go with it into the undo log, which then
// undoes XOR items by applying them again and keeps old bits only for the other ops.
// In device memory every op keeps old bits (a re-applied XOR would be wrong after a scatter that
// failed halfway), so the log never takes the payload there.
TEST_P(ApplyTest, RollbackThroughKeptPayloadsRestoresTheBaseBitExactly) {
  const Op op = std::get<1>(GetParam());
  const bool reapplies = op == Op::kXor && !testing::DeviceMemoryForced();
  const StoreSnapshot before = TakeSnapshot(*store_);
  const std::map<std::string, uint64_t> digests_before = store_->Digests();
  std::vector<OwnedTensor> next;
  for (const OwnedTensor& t : v0_) next.push_back(Perturb(t, 0.3, 77));
  const TransferId id = TransferId::Random();
  internal::UndoLog undo;
  uint64_t wire = 0;
  for (auto& payload : EncodeStep(next, id)) {
    wire += payload.size();
    ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
    ValidatedPayload received = Validated(payload);
    ASSERT_OK(internal::ApplyPayload(decoded, *store_, &undo, &received));
    // The log took the bytes exactly when it undoes by re-applying (XOR items).
    EXPECT_EQ(received.size() == 0, reapplies);
  }
  EXPECT_EQ(store_->Digests(), tracker_->PendingDigests());
  if (reapplies) {
    // O(wire): the kept payloads are all the log holds.
    EXPECT_EQ(undo.payload_bytes(), wire);
    EXPECT_EQ(undo.bytes(), wire);
  } else {
    EXPECT_EQ(undo.payload_bytes(), 0u);
    EXPECT_GT(undo.bytes(), 0u);
  }
  ASSERT_OK(undo.Rollback(*store_));
  EXPECT_EQ(TakeSnapshot(*store_), before);
  EXPECT_EQ(store_->Digests(), digests_before);
  EXPECT_EQ(store_->Digests(), store_->RecomputeDigests());
  EXPECT_EQ(undo.bytes(), 0u);
  ASSERT_OK(tracker_->Abort(id));
}

// A delta payload of several tensors (one of them in two spans, which share its digest and stay
// on one thread) applied on 4 threads gives the bytes and digests one thread gives, and rolls
// back as exactly, with and without the payload kept; a forged item digest fails the whole
// payload and leaves the store as it was.
TEST_P(ApplyTest, AParallelDeltaApplyEqualsASerialOneAndRollsBackAsExactly) {
  const StoreSnapshot before = TakeSnapshot(*store_);
  const std::map<std::string, uint64_t> digests_before = store_->Digests();
  std::vector<OwnedTensor> next;
  for (const OwnedTensor& t : v0_) next.push_back(Perturb(t, 0.2, 55));
  const TransferId id = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(const TransferPlan plan, tracker_->Begin(id));
  std::vector<Item> items;
  for (const OwnedTensor& t : next) {
    const uint64_t numel = t.view().numel();
    const std::vector<uint64_t> cuts = t.name == "model.embed.weight"
                                           ? std::vector<uint64_t>{0, 1111, numel}
                                           : std::vector<uint64_t>{0, numel};
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      ASSERT_OK_AND_ASSIGN(internal::EncodeResult encoded,
                           tracker_->Encode(id, t.view(), cuts[k], cuts[k + 1]));
      for (Item& item : encoded.items) items.push_back(std::move(item));
    }
  }
  ASSERT_GE(items.size(), 3u);
  const std::vector<std::byte> bytes = EncodeItems(id, plan, items);
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(bytes));

  auto serial = WeightStore::Make();
  for (const OwnedTensor& t : v0_) ASSERT_OK(AddTestTensor(*serial, t.view()));
  serial->set_version(store_->version());
  internal::UndoLog serial_undo;
  ASSERT_OK(internal::ApplyPayload(decoded, *serial, &serial_undo, nullptr, /*threads=*/1));
  for (const bool keep_payload : {false, true}) {
    SCOPED_TRACE(keep_payload ? "payload kept" : "old bits kept");
    internal::UndoLog undo;
    ValidatedPayload kept = Validated(bytes);
    ASSERT_OK(internal::ApplyPayload(decoded, *store_, &undo, keep_payload ? &kept : nullptr,
                                     /*threads=*/4));
    EXPECT_EQ(TakeSnapshot(*store_), TakeSnapshot(*serial));
    EXPECT_EQ(store_->Digests(), serial->Digests());
    EXPECT_EQ(store_->Digests(), tracker_->PendingDigests());
    EXPECT_EQ(kept.size() == 0, keep_payload && std::get<1>(GetParam()) == Op::kXor &&
                                    !testing::DeviceMemoryForced());
    ASSERT_OK(undo.Rollback(*store_));
    EXPECT_EQ(TakeSnapshot(*store_), before);
    EXPECT_EQ(store_->Digests(), digests_before);
  }

  // The last item's digest forged: every item of the payload undone.
  ExpectAForgedDigestUndoesThePayload(items, items.size() - 1, id, plan, *store_, /*threads=*/4);
  ASSERT_OK(tracker_->Abort(id));
}

// A payload of one large XOR item (and a small one) whose record keeps the payload applies the
// large item in slices at its location marks on several threads: the bytes and digests of one
// thread, an exact rollback (the item re-applied whole), and a forged digest undoes it all.
TEST(ApplySlicesTest, ALargeXorItemAppliesInSlicesOnSeveralThreads) {
  ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));
  const std::vector<OwnedTensor> v0 = {RandomTensor("big", DType::kBFloat16, {1000, 700}, 1),
                                       RandomTensor("small", DType::kBFloat16, {64}, 2)};
  const auto make_store = [&] {
    auto store = WeightStore::Make();
    for (const OwnedTensor& t : v0) EXPECT_OK(AddTestTensor(*store, t.view()));
    return store;
  };
  TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id));
  for (const OwnedTensor& t : v0) ASSERT_OK(tracker->Encode(id, t.view()));
  ASSERT_OK(tracker->Commit(id));

  id = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(const TransferPlan plan, tracker->Begin(id));
  std::vector<OwnedTensor> next;
  for (const OwnedTensor& t : v0) next.push_back(Perturb(t, 0.3, 9));
  std::vector<Item> items;
  for (const OwnedTensor& t : next) {
    ASSERT_OK_AND_ASSIGN(internal::EncodeResult encoded, tracker->Encode(id, t.view()));
    for (Item& item : encoded.items) items.push_back(std::move(item));
  }
  const std::vector<std::byte> bytes = EncodeItems(id, plan, items);
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(bytes));
  ASSERT_EQ(decoded.items()[0].name, "big");
  ASSERT_GE(decoded.location_marks(0).size(), 4u) << "the large item must split";
  EXPECT_TRUE(decoded.location_marks(1).empty());

  auto serial = make_store();
  serial->set_version(plan.base_version);
  internal::UndoLog serial_undo;
  ASSERT_OK(internal::ApplyPayload(decoded, *serial, &serial_undo, nullptr, /*threads=*/1));
  EXPECT_EQ(serial->Digests(), tracker->PendingDigests());
  for (const int threads : {2, 4, 7}) {
    SCOPED_TRACE(fmt::format("{} threads", threads));
    auto store = make_store();
    store->set_version(plan.base_version);
    const StoreSnapshot before = TakeSnapshot(*store);
    const std::map<std::string, uint64_t> digests_before = store->Digests();
    internal::UndoLog undo;
    ValidatedPayload kept = Validated(bytes);
    ASSERT_OK(internal::ApplyPayload(decoded, *store, &undo, &kept, threads));
    // Kept to undo the XOR items, which then split; a device tensor keeps old bits instead.
    EXPECT_EQ(kept.size() == 0, !testing::DeviceMemoryForced());
    EXPECT_EQ(TakeSnapshot(*store), TakeSnapshot(*serial));
    EXPECT_EQ(store->Digests(), serial->Digests());
    EXPECT_EQ(store->Digests(), store->RecomputeDigests());
    ASSERT_OK(undo.Rollback(*store));
    EXPECT_EQ(TakeSnapshot(*store), before);
    EXPECT_EQ(store->Digests(), digests_before);

    // The large item's digest forged: every slice applied, then all of the payload undone.
    ExpectAForgedDigestUndoesThePayload(items, 0, id, plan, *store, threads);
  }
  ASSERT_OK(tracker->Abort(id));
}

INSTANTIATE_TEST_SUITE_P(DTypesAndOps, ApplyTest,
                         ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16,
                                                              DType::kFloat32, DType::kFloat8E4M3FN,
                                                              DType::kFloat8E5M2, DType::kInt64),
                                            ::testing::Values(Op::kXor, Op::kOverwrite, Op::kAdd)),
                         [](const auto& param_info) {
                           return std::string(DTypeName(std::get<0>(param_info.param))) + "_" +
                                  std::string(OpName(std::get<1>(param_info.param)));
                         });

class ApplyRejectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = WeightStore::Make();
    base_ = RandomTensor("w", DType::kBFloat16, {1000}, 5);
    ASSERT_OK(AddTestTensor(*store_, base_.view()));
    ASSERT_OK(AddTestTensor(*store_, RandomTensor("other", DType::kFloat32, {10}, 6).view()));
  }

  /// One payload holding an XOR delta of `w` (base → perturbed) plus `extra` items.
  std::vector<std::byte> MakePayload(std::vector<Item> extra = {}) {
    auto tracker = internal::DeltaTracker::Make({});
    EXPECT_TRUE(tracker.ok());
    const TransferId anchor = TransferId::Random();
    EXPECT_TRUE((*tracker)->Begin(anchor).ok());
    EXPECT_TRUE((*tracker)->Encode(anchor, base_.view()).ok());
    EXPECT_TRUE((*tracker)->Commit(anchor).ok());
    const TransferId id = TransferId::Random();
    EXPECT_TRUE((*tracker)->Begin(id).ok());
    next_ = Perturb(base_, 0.2, 7);
    auto r = (*tracker)->Encode(id, next_.view());
    EXPECT_TRUE(r.ok());
    std::vector<ItemView> views;
    for (const Item& item : r->items) views.push_back(item.view());
    for (const Item& item : extra) views.push_back(item.view());
    auto bytes = EncodePayload(PayloadIds{id, 3, 9, 1, 2}, views);
    EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
    return std::move(bytes).ValueOrDie();
  }

  std::unique_ptr<WeightStore> store_;
  OwnedTensor base_;
  OwnedTensor next_;
};

Item OverwriteItem(std::string name, DType dtype, Shape shape) {
  Item item;
  item.name = std::move(name);
  item.dtype = item.value_dtype = dtype;
  item.shape = shape;
  item.op = Op::kOverwrite;
  item.span_end = 4;
  item.count = 1;
  item.location_encoding = LocationEncoding::kGap16;
  item.locations = {0, 0};
  item.values.resize(DTypeSize(dtype));
  return item;
}

TEST_F(ApplyRejectionTest, UnknownTensorAppliesNothing) {
  const StoreSnapshot before = TakeSnapshot(*store_);
  // The valid item for 'w' comes first: it must not be applied either.
  auto payload = MakePayload({OverwriteItem("model.missing", DType::kBFloat16, {4})});
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
  internal::UndoLog undo;
  EXPECT_STATUS_MSG(NotFound, "model.missing", internal::ApplyPayload(decoded, *store_, &undo));
  EXPECT_EQ(TakeSnapshot(*store_), before);
  EXPECT_EQ(undo.records(), 0u);
}

TEST_F(ApplyRejectionTest, DtypeOrShapeMismatchAppliesNothing) {
  const StoreSnapshot before = TakeSnapshot(*store_);
  internal::UndoLog undo;
  for (Item bad : {OverwriteItem("other", DType::kBFloat16, {10}),
                   OverwriteItem("other", DType::kFloat32, {2, 5})}) {
    auto payload = MakePayload({bad});
    ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
    EXPECT_STATUS_MSG(InvalidArgument, "'other'", internal::ApplyPayload(decoded, *store_, &undo));
    EXPECT_EQ(TakeSnapshot(*store_), before);
  }
}

TEST_F(ApplyRejectionTest, ReceiverNotAtBaseIsDetectedAndUndone) {
  auto payload = MakePayload();
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
  // Diverge the receiver at an element the payload changes, then remember that state.
  size_t changed_byte = 0;
  while (base_.bytes[changed_byte] == next_.bytes[changed_byte]) ++changed_byte;
  ASSERT_OK(testing::FlipByte(*store_, "w", changed_byte));
  ASSERT_OK(store_->SetDigest("w", store_->RecomputeDigests().at("w")));
  const StoreSnapshot diverged = TakeSnapshot(*store_);
  internal::UndoLog undo;
  EXPECT_STATUS_MSG(DataLoss, "holds at version 1 differs from the producer's base",
                    internal::ApplyPayload(decoded, *store_, &undo));
  EXPECT_EQ(TakeSnapshot(*store_), diverged);
  EXPECT_EQ(undo.records(), 0u);
}

TEST_F(ApplyRejectionTest, AFailedApplyWithKeptBytesUndoesItsXorItemsAndKeepsNothing) {
  if (testing::DeviceMemoryForced()) GTEST_SKIP() << "device records never keep payloads";
  // The XOR item of 'w' applies first, then the payload fails at 'other' (not at its base): the
  // XOR item is undone by applying it again from the payload being applied, and the log does
  // not take the bytes.
  auto payload = MakePayload();
  ASSERT_OK_AND_ASSIGN(DecodedPayload good, DecodePayload(payload));
  internal::UndoLog undo;
  ValidatedPayload kept = Validated(payload);
  ASSERT_OK(internal::ApplyPayload(good, *store_, &undo, &kept));
  EXPECT_EQ(kept.size(), 0u);
  const StoreSnapshot after_first = TakeSnapshot(*store_);
  // The same payload again: the receiver is no longer at its base, so its digest check fails
  // after the XOR was applied, and that payload is undone.
  ValidatedPayload again = Validated(payload);
  EXPECT_STATUS_MSG(DataLoss, "holds at version 1 differs from the producer's base",
                    internal::ApplyPayload(good, *store_, &undo, &again));
  EXPECT_TRUE(std::ranges::equal(again.bytes(), payload));
  EXPECT_EQ(TakeSnapshot(*store_), after_first);
  EXPECT_EQ(undo.payload_bytes(), payload.size());
  ASSERT_OK(undo.Rollback(*store_));
  EXPECT_EQ(StoreBytes(*store_, "w"), base_.bytes);
  EXPECT_EQ(store_->Digests(), store_->RecomputeDigests());
}

TEST_F(ApplyRejectionTest, DivergenceOutsideTheChangesShowsInTheTensorDigest) {
  auto payload = MakePayload();
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
  size_t unchanged_byte = 0;
  while (base_.bytes[unchanged_byte] != next_.bytes[unchanged_byte]) ++unchanged_byte;
  ASSERT_OK(testing::FlipByte(*store_, "w", unchanged_byte));
  ASSERT_OK(store_->SetDigest("w", store_->RecomputeDigests().at("w")));
  // The payload only touches changed elements, so it applies; the divergence is caught where
  // the coordinator compares whole-tensor digests with the producer's.
  internal::UndoLog undo;
  ASSERT_OK(internal::ApplyPayload(decoded, *store_, &undo));
  EXPECT_NE(*store_->Digest("w"), TensorDigest(next_.view()));
  EXPECT_EQ(*store_->Digest("w"), store_->RecomputeDigests().at("w"));
}

TEST_F(ApplyRejectionTest, UndoLogSpansPayloadsAndRollsBackAll) {
  const StoreSnapshot before = TakeSnapshot(*store_);
  internal::UndoLog undo;
  auto payload = MakePayload();
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
  ASSERT_OK(internal::ApplyPayload(decoded, *store_, &undo));
  EXPECT_STATUS(InvalidArgument, internal::ApplyPayload(decoded, *store_, nullptr));
  ASSERT_OK(undo.Rollback(*store_));
  EXPECT_EQ(TakeSnapshot(*store_), before);
}

}  // namespace
}  // namespace refit
