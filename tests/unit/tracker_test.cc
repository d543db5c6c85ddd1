#include "codec/tracker.h"

#include <gtest/gtest.h>

#include <thread>

#include "codec/locations.h"
#include "codec/values.h"
#include "core/digest.h"
#include "test_data.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::Perturb;
using testing::RandomTensor;

/// Apply items to a copy of `base` the way a receiver would; return the result.
OwnedTensor ApplyItems(const OwnedTensor& base, const std::vector<Item>& items) {
  OwnedTensor out = base;
  for (const Item& item : items) {
    EXPECT_EQ(item.name, base.name);
    if (item.op == Op::kFull) {
      const uint32_t w = DTypeSize(item.dtype);
      std::copy(item.values.begin(), item.values.end(), out.bytes.begin() + item.span_begin * w);
      continue;
    }
    auto locations = DecodeAllLocations(item.view());
    EXPECT_TRUE(locations.ok()) << locations.status().ToString();
    ApplyOpValues(item.op, item.dtype, item.value_dtype, out.bytes, *locations, item.values,
                  nullptr);
  }
  return out;
}

class TrackerTest : public ::testing::TestWithParam<BaselineStorage> {
 protected:
  std::unique_ptr<internal::DeltaTracker> MakeTracker(TrackerOptions options = {}) {
    options.baseline_storage = GetParam();
    auto tracker = internal::DeltaTracker::Make(options);
    EXPECT_TRUE(tracker.ok()) << tracker.status().ToString();
    return std::move(tracker).ValueOrDie();
  }

  /// Run an anchor transfer of `tensors` and commit it.
  void Anchor(internal::DeltaTracker& tracker, const std::vector<OwnedTensor>& tensors) {
    const TransferId id = TransferId::Random();
    ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker.Begin(id));
    ASSERT_TRUE(plan.anchor);
    for (const OwnedTensor& t : tensors) {
      ASSERT_OK_AND_ASSIGN(internal::EncodeResult r, tracker.Encode(id, t.view()));
      ASSERT_EQ(r.items.size(), 1u);
      EXPECT_EQ(r.items[0].op, Op::kFull);
      EXPECT_EQ(r.items[0].digest, TensorDigest(t.view()));
    }
    ASSERT_OK(tracker.Commit(id));
  }
};

TEST_P(TrackerTest, FirstTransferIsAnchorThenDeltasReproduceNewBits) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat8E4M3FN,
                      DType::kFloat64, DType::kInt32}) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    auto fresh = MakeTracker();
    OwnedTensor v0 = RandomTensor("w", dtype, {64, 33}, 1);
    Anchor(*fresh, {v0});
    ASSERT_OK_AND_ASSIGN(TensorView baseline, fresh->Baseline("w"));
    EXPECT_TRUE(std::equal(baseline.bytes.begin(), baseline.bytes.end(), v0.bytes.begin()));

    OwnedTensor v1 = Perturb(v0, 0.03, 2);
    const TransferId id = TransferId::Random();
    ASSERT_OK_AND_ASSIGN(TransferPlan plan, fresh->Begin(id));
    EXPECT_FALSE(plan.anchor);
    EXPECT_EQ(plan.base_version, 1u);
    EXPECT_EQ(plan.target_version, 2u);
    ASSERT_OK_AND_ASSIGN(internal::EncodeResult r, fresh->Encode(id, v1.view()));
    ASSERT_EQ(r.items.size(), 1u);
    EXPECT_EQ(r.items[0].op, Op::kXor);
    EXPECT_GT(r.changed_elements, 0u);
    EXPECT_EQ(r.items[0].count, r.changed_elements);
    EXPECT_EQ(ApplyItems(v0, r.items).bytes, v1.bytes);
    EXPECT_EQ(r.items[0].digest, TensorDigest(v1.view()) - TensorDigest(v0.view()));
    ASSERT_OK(fresh->Commit(id));
    EXPECT_EQ(fresh->version(), 2u);
    ASSERT_OK_AND_ASSIGN(baseline, fresh->Baseline("w"));
    EXPECT_TRUE(std::equal(baseline.bytes.begin(), baseline.bytes.end(), v1.bytes.begin()));
    EXPECT_EQ(fresh->Digests().at("w"), TensorDigest(v1.view()));
  }
}

TEST_P(TrackerTest, UnchangedTensorEmitsNoItem) {
  auto tracker = MakeTracker();
  OwnedTensor v0 = RandomTensor("w", DType::kBFloat16, {1000}, 3);
  Anchor(*tracker, {v0});
  const TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult r, tracker->Encode(id, v0.view()));
  EXPECT_TRUE(r.items.empty());
  EXPECT_EQ(r.changed_elements, 0u);
  EXPECT_EQ(r.total_elements, 1000u);
}

TEST_P(TrackerTest, AbortReemitsTheSameDelta) {
  auto tracker = MakeTracker();
  OwnedTensor v0 = RandomTensor("w", DType::kBFloat16, {4096}, 4);
  Anchor(*tracker, {v0});
  OwnedTensor v1 = Perturb(v0, 0.02, 5);

  const TransferId first = TransferId::Random();
  ASSERT_OK(tracker->Begin(first));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult r1, tracker->Encode(first, v1.view()));
  EXPECT_GT(tracker->pending_bytes(), 0u);
  ASSERT_OK(tracker->Abort(first));
  EXPECT_EQ(tracker->pending_bytes(), 0u);
  EXPECT_EQ(tracker->version(), 1u);
  ASSERT_OK_AND_ASSIGN(TensorView baseline, tracker->Baseline("w"));
  EXPECT_TRUE(std::equal(baseline.bytes.begin(), baseline.bytes.end(), v0.bytes.begin()));

  const TransferId second = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(second));
  EXPECT_EQ(plan.base_version, 1u);
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult r2, tracker->Encode(second, v1.view()));
  ASSERT_EQ(r1.items.size(), r2.items.size());
  for (size_t i = 0; i < r1.items.size(); ++i) {
    EXPECT_EQ(r1.items[i].locations, r2.items[i].locations);
    EXPECT_EQ(r1.items[i].values, r2.items[i].values);
    EXPECT_EQ(r1.items[i].digest, r2.items[i].digest);
  }
}

TEST_P(TrackerTest, CommitScattersContiguousAndScatteredChanges) {
  auto tracker = MakeTracker();
  OwnedTensor v0 = RandomTensor("w", DType::kFloat32, {10000}, 6);
  Anchor(*tracker, {v0});
  OwnedTensor v1 = v0;
  for (int i = 100; i < 2100; ++i) v1.bytes[i * 4] ^= std::byte{1};  // one contiguous run
  for (int i = 5000; i < 10000; i += 7) v1.bytes[i * 4 + 3] ^= std::byte{0x80};  // scattered
  const TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id));
  ASSERT_OK(tracker->Encode(id, v1.view()));
  ASSERT_OK(tracker->Commit(id));
  ASSERT_OK_AND_ASSIGN(TensorView baseline, tracker->Baseline("w"));
  EXPECT_TRUE(std::equal(baseline.bytes.begin(), baseline.bytes.end(), v1.bytes.begin()));
  EXPECT_EQ(tracker->Digests().at("w"), TensorDigest(v1.view()));
}

TEST_P(TrackerTest, MissingOrReshapedBaselineIsAnErrorOutsideAnAnchor) {
  auto tracker = MakeTracker();
  OwnedTensor v0 = RandomTensor("w", DType::kBFloat16, {8, 8}, 7);
  Anchor(*tracker, {v0});
  const TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id));
  OwnedTensor other = RandomTensor("new.weight", DType::kBFloat16, {8, 8}, 8);
  EXPECT_STATUS_MSG(FailedPrecondition, "new.weight", tracker->Encode(id, other.view()));
  OwnedTensor reshaped = RandomTensor("w", DType::kBFloat16, {4, 16}, 9);
  EXPECT_STATUS_MSG(FailedPrecondition, "[4, 16]", tracker->Encode(id, reshaped.view()));
  OwnedTensor retyped = RandomTensor("w", DType::kFloat16, {8, 8}, 9);
  EXPECT_STATUS_MSG(FailedPrecondition, "float16", tracker->Encode(id, retyped.view()));
  ASSERT_OK(tracker->Abort(id));

  // An anchor may introduce and reshape tensors.
  const TransferId anchor = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(anchor, /*force_anchor=*/true));
  EXPECT_TRUE(plan.anchor);
  ASSERT_OK(tracker->Encode(anchor, other.view()));
  ASSERT_OK(tracker->Encode(anchor, reshaped.view()));
  ASSERT_OK(tracker->Commit(anchor));
  ASSERT_OK_AND_ASSIGN(TensorView baseline, tracker->Baseline("w"));
  EXPECT_EQ(baseline.shape, (Shape{4, 16}));
  EXPECT_EQ(tracker->Digests().at("new.weight"), TensorDigest(other.view()));
}

TEST_P(TrackerTest, ADeltaMustCoverTheWholeModelAndAnAnchorMayShrinkIt) {
  auto tracker = MakeTracker();
  OwnedTensor a = RandomTensor("a", DType::kBFloat16, {16, 4}, 1);
  OwnedTensor b = RandomTensor("b", DType::kBFloat16, {8}, 2);
  Anchor(*tracker, {a, b});

  // A delta that encodes only half of `a` and none of `b` would commit both partly stale.
  const TransferId half = TransferId::Random();
  ASSERT_OK(tracker->Begin(half));
  ASSERT_OK(tracker->Encode(half, b.view()));
  ASSERT_OK(tracker->Encode(half, a.view(), 0, 32));
  EXPECT_STATUS_MSG(FailedPrecondition, "'a'", tracker->CheckModelCovered(half));
  ASSERT_OK(tracker->Abort(half));
  const TransferId without_b = TransferId::Random();
  ASSERT_OK(tracker->Begin(without_b));
  ASSERT_OK(tracker->Encode(without_b, a.view()));
  EXPECT_STATUS_MSG(FailedPrecondition, "'b'", tracker->CheckModelCovered(without_b));
  ASSERT_OK(tracker->Abort(without_b));

  // An anchor without `b` drops its baseline; the next delta covers `a` alone.
  const TransferId anchor = TransferId::Random();
  ASSERT_OK(tracker->Begin(anchor, /*force_anchor=*/true));
  ASSERT_OK(tracker->Encode(anchor, a.view()));
  ASSERT_OK(tracker->CheckModelCovered(anchor));
  ASSERT_OK(tracker->Commit(anchor));
  EXPECT_EQ(tracker->Digests().count("b"), 0u);
  const TransferId next = TransferId::Random();
  ASSERT_OK(tracker->Begin(next));
  ASSERT_OK(tracker->Encode(next, a.view()));
  ASSERT_OK(tracker->CheckModelCovered(next));
  ASSERT_OK(tracker->Commit(next));
}

TEST_P(TrackerTest, TransferIdsAreChecked) {
  auto tracker = MakeTracker();
  OwnedTensor v0 = RandomTensor("w", DType::kBFloat16, {16}, 10);
  const TransferId id = TransferId::Random();
  EXPECT_STATUS(FailedPrecondition, tracker->Encode(id, v0.view()));
  ASSERT_OK(tracker->Begin(id));
  EXPECT_STATUS(FailedPrecondition, tracker->Begin(TransferId::Random()));
  EXPECT_STATUS(FailedPrecondition, tracker->Encode(TransferId::Random(), v0.view()));
  EXPECT_STATUS(FailedPrecondition, tracker->Commit(TransferId::Random()));
  EXPECT_STATUS(FailedPrecondition, tracker->Abort(TransferId::Random()));
  ASSERT_OK(tracker->Abort(id));
}

TEST_P(TrackerTest, FullSyncIntervalCadence) {
  TrackerOptions options;
  options.full_sync_interval = 3;
  auto tracker = MakeTracker(options);
  OwnedTensor v = RandomTensor("w", DType::kBFloat16, {256}, 11);
  std::vector<bool> anchors;
  for (int step = 0; step < 7; ++step) {
    const TransferId id = TransferId::Random();
    ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(id));
    anchors.push_back(plan.anchor);
    v = Perturb(v, 0.1, 100 + step);
    ASSERT_OK(tracker->Encode(id, v.view()));
    ASSERT_OK(tracker->Commit(id));
  }
  EXPECT_EQ(anchors, (std::vector<bool>{true, false, false, true, false, false, true}));
}

TEST_P(TrackerTest, DriftRuleForcesAnAnchor) {
  TrackerOptions options;
  options.max_drift_fraction = 0.15;
  auto tracker = MakeTracker(options);
  OwnedTensor v = RandomTensor("w", DType::kBFloat16, {10000}, 12);
  Anchor(*tracker, {v});
  std::vector<bool> anchors;
  for (int step = 0; step < 4; ++step) {
    const TransferId id = TransferId::Random();
    ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(id));
    anchors.push_back(plan.anchor);
    v = Perturb(v, 0.1, 200 + step);
    ASSERT_OK(tracker->Encode(id, v.view()));
    ASSERT_OK(tracker->Commit(id));
  }
  // ~10 % per step: after two deltas the drift (~20 %) exceeds 15 %.
  EXPECT_EQ(anchors, (std::vector<bool>{false, false, true, false}));
}

TEST_P(TrackerTest, AddDemotesInexactElementsToOverwrite) {
  TrackerOptions options;
  options.op = Op::kAdd;
  options.add_delta_dtype = DType::kBFloat16;
  auto tracker = MakeTracker(options);
  OwnedTensor v0 = RandomTensor("w", DType::kBFloat16, {20000}, 13);
  Anchor(*tracker, {v0});
  OwnedTensor v1 = Perturb(v0, 0.2, 14);
  const TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult r, tracker->Encode(id, v1.view()));
  // Random bits include NaN/Inf and wide exponent gaps, so some elements must be demoted.
  ASSERT_EQ(r.items.size(), 2u);
  EXPECT_EQ(r.items[0].op, Op::kAdd);
  EXPECT_EQ(r.items[1].op, Op::kOverwrite);
  EXPECT_EQ(r.items[0].count + r.items[1].count, r.changed_elements);
  EXPECT_EQ(ApplyItems(v0, r.items).bytes, v1.bytes);
  EXPECT_EQ(r.items[0].digest + r.items[1].digest,
            TensorDigest(v1.view()) - TensorDigest(v0.view()));
}

TEST_P(TrackerTest, AddFallsBackToOverwriteForIntegers) {
  TrackerOptions options;
  options.op = Op::kAdd;
  auto tracker = MakeTracker(options);
  OwnedTensor v0 = RandomTensor("ids", DType::kInt64, {100}, 15);
  Anchor(*tracker, {v0});
  OwnedTensor v1 = Perturb(v0, 0.3, 16);
  const TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult r, tracker->Encode(id, v1.view()));
  ASSERT_EQ(r.items.size(), 1u);
  EXPECT_EQ(r.items[0].op, Op::kOverwrite);
  EXPECT_EQ(ApplyItems(v0, r.items).bytes, v1.bytes);
}

TEST_P(TrackerTest, OverwriteNamesOverrideTheOp) {
  TrackerOptions options;
  options.overwrite_names = {"b"};
  auto tracker = MakeTracker(options);
  OwnedTensor a0 = RandomTensor("a", DType::kBFloat16, {100}, 17);
  OwnedTensor b0 = RandomTensor("b", DType::kBFloat16, {100}, 18);
  Anchor(*tracker, {a0, b0});
  const TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult ra, tracker->Encode(id, Perturb(a0, 0.5, 19).view()));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult rb, tracker->Encode(id, Perturb(b0, 0.5, 20).view()));
  EXPECT_EQ(ra.items.at(0).op, Op::kXor);
  EXPECT_EQ(rb.items.at(0).op, Op::kOverwrite);
}

TEST_P(TrackerTest, SpansEncodeDisjointRangesOfOneTensor) {
  auto tracker = MakeTracker();
  OwnedTensor v0 = RandomTensor("w", DType::kBFloat16, {1000}, 21);
  const TransferId anchor = TransferId::Random();
  ASSERT_OK(tracker->Begin(anchor));
  ASSERT_OK(tracker->Encode(anchor, v0.view(), 0, 400));
  // A new tensor must be covered completely before commit; nothing changes on failure.
  EXPECT_STATUS_MSG(FailedPrecondition, "covered 400 of 1000", tracker->Commit(anchor));
  ASSERT_OK(tracker->Encode(anchor, v0.view(), 400, 1000));
  ASSERT_OK(tracker->Commit(anchor));

  OwnedTensor v1 = Perturb(v0, 0.1, 22);
  const TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult lo, tracker->Encode(id, v1.view(), 0, 500));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult hi, tracker->Encode(id, v1.view(), 500, 1000));
  ASSERT_EQ(lo.items.size(), 1u);
  EXPECT_EQ(lo.items[0].span_end, 500u);
  EXPECT_EQ(hi.items[0].span_begin, 500u);
  std::vector<Item> all = std::move(lo.items);
  all.push_back(std::move(hi.items[0]));
  EXPECT_EQ(ApplyItems(v0, all).bytes, v1.bytes);
  EXPECT_STATUS(InvalidArgument, tracker->Encode(id, v1.view(), 900, 1001));
  ASSERT_OK(tracker->Commit(id));
  EXPECT_EQ(tracker->Digests().at("w"), TensorDigest(v1.view()));
}

TEST_P(TrackerTest, ConcurrentEncodesOnDisjointTensorsMatchSerial) {
  constexpr int kTensors = 16;
  std::vector<OwnedTensor> v0, v1;
  for (int i = 0; i < kTensors; ++i) {
    v0.push_back(RandomTensor("t" + std::to_string(i), DType::kBFloat16, {5000}, 30 + i));
    v1.push_back(Perturb(v0.back(), 0.01 * (i + 1), 60 + i));
  }
  auto serial = MakeTracker();
  auto parallel = MakeTracker();
  Anchor(*serial, v0);
  Anchor(*parallel, v0);

  const TransferId id = TransferId::Random();
  ASSERT_OK(serial->Begin(id));
  ASSERT_OK(parallel->Begin(id));
  std::vector<internal::EncodeResult> expected(kTensors), actual(kTensors);
  for (int i = 0; i < kTensors; ++i) {
    ASSERT_OK_AND_ASSIGN(expected[i], serial->Encode(id, v1[i].view()));
  }
  std::vector<Status> statuses(kTensors);
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int i = t; i < kTensors; i += 4) {
          auto r = parallel->Encode(id, v1[i].view());
          statuses[i] = r.status();
          if (r.ok()) actual[i] = std::move(r).ValueOrDie();
        }
      });
    }
  }
  for (int i = 0; i < kTensors; ++i) {
    ASSERT_OK(statuses[i]);
    ASSERT_EQ(actual[i].items.size(), expected[i].items.size());
    EXPECT_EQ(actual[i].items[0].locations, expected[i].items[0].locations);
    EXPECT_EQ(actual[i].items[0].values, expected[i].items[0].values);
  }
  EXPECT_EQ(parallel->PendingDigests(), serial->PendingDigests());
  ASSERT_OK(serial->Commit(id));
  ASSERT_OK(parallel->Commit(id));
  EXPECT_EQ(parallel->Digests(), serial->Digests());
  for (int i = 0; i < kTensors; ++i) {
    EXPECT_EQ(parallel->Digests().at(v1[i].name), TensorDigest(v1[i].view()));
  }
}

TEST_P(TrackerTest, PendingMemoryIsProportionalToChanges) {
  auto tracker = MakeTracker();
  OwnedTensor v0 = RandomTensor("w", DType::kBFloat16, {1 << 20}, 40);
  Anchor(*tracker, {v0});
  EXPECT_EQ(tracker->baseline_bytes(), v0.bytes.size());
  OwnedTensor v1 = Perturb(v0, 0.01, 41);
  const TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult r, tracker->Encode(id, v1.view()));
  // The new bits (2 bytes per change) and the locations in their smallest encoding (at 1 %
  // density, gaps of about 100: 2 bytes each as gap16 or range), not 8-byte indices; no second
  // copy of the tensor.
  EXPECT_GE(tracker->pending_bytes(), r.changed_elements * 2);
  EXPECT_LE(tracker->pending_bytes(), r.changed_elements * 4 + 64);
  EXPECT_LT(tracker->pending_bytes(), v0.bytes.size() / 20);
  // Commit scatters them exactly.
  ASSERT_OK(tracker->Commit(id));
  ASSERT_OK_AND_ASSIGN(TensorView held, tracker->Baseline("w"));
  EXPECT_TRUE(std::equal(held.bytes.begin(), held.bytes.end(), v1.bytes.begin()));
  EXPECT_EQ(tracker->pending_bytes(), 0u);
}

TEST(TrackerOptionsTest, RejectsBadOptions) {
  TrackerOptions options;
  options.op = Op::kFull;
  EXPECT_STATUS(InvalidArgument, internal::DeltaTracker::Make(options));
  options = {};
  options.op = Op::kAdd;
  options.add_delta_dtype = DType::kInt8;
  EXPECT_STATUS_MSG(InvalidArgument, "int8", internal::DeltaTracker::Make(options));
  options = {};
  options.max_drift_fraction = 2.0;
  EXPECT_STATUS(InvalidArgument, internal::DeltaTracker::Make(options));
  options = {};
  options.commit_threads = 0;
  EXPECT_STATUS_MSG(InvalidArgument, "commit_threads 0 is outside [1, 256]",
                    internal::DeltaTracker::Make(options));
}

// The compare runs block by block with each block's changes gathered right after it, on one
// thread or over chunks on several, and Commit scatters on several threads: items (locations,
// values, digests) and the committed baselines are the same whichever the split. The tensors
// span many compare blocks and chunks that do not line up with them.
TEST_P(TrackerTest, SplitCompareAndParallelCommitMatchTheOneThreadResult) {
  for (Op op : {Op::kXor, Op::kOverwrite, Op::kAdd}) {
    SCOPED_TRACE(std::string(OpName(op)));
    const std::vector<OwnedTensor> v0 = {RandomTensor("a", DType::kBFloat16, {200003}, 31),
                                         RandomTensor("b", DType::kFloat32, {70001}, 32),
                                         RandomTensor("c", DType::kFloat16, {5}, 33)};
    std::vector<OwnedTensor> v1;
    for (const OwnedTensor& t : v0) v1.push_back(Perturb(t, 0.03, 34));
    TrackerOptions one;
    one.op = op;
    one.add_delta_dtype = DType::kFloat32;
    one.commit_threads = 1;
    TrackerOptions split = one;
    split.compare.threads = 3;
    split.compare.chunk_elements = 50000;
    split.commit_threads = 4;
    auto serial = MakeTracker(one);
    auto parallel = MakeTracker(split);
    Anchor(*serial, v0);
    Anchor(*parallel, v0);
    const TransferId id = TransferId::Random();
    ASSERT_OK(serial->Begin(id));
    ASSERT_OK(parallel->Begin(id));
    for (const OwnedTensor& t : v1) {
      ASSERT_OK_AND_ASSIGN(internal::EncodeResult a, serial->Encode(id, t.view()));
      ASSERT_OK_AND_ASSIGN(internal::EncodeResult b, parallel->Encode(id, t.view()));
      EXPECT_EQ(a.changed_elements, b.changed_elements);
      ASSERT_EQ(a.items.size(), b.items.size());
      for (size_t k = 0; k < a.items.size(); ++k) {
        EXPECT_EQ(a.items[k].locations, b.items[k].locations);
        EXPECT_EQ(a.items[k].values, b.items[k].values);
        EXPECT_EQ(a.items[k].digest, b.items[k].digest);
      }
      EXPECT_EQ(ApplyItems(t.name == "a"   ? v0[0]
                           : t.name == "b" ? v0[1]
                                           : v0[2],
                           a.items)
                    .bytes,
                t.bytes);
    }
    EXPECT_EQ(serial->PendingDigests(), parallel->PendingDigests());
    ASSERT_OK(serial->Commit(id));
    ASSERT_OK(parallel->Commit(id));
    EXPECT_EQ(serial->Digests(), parallel->Digests());
    for (const OwnedTensor& t : v1) {
      ASSERT_OK_AND_ASSIGN(TensorView baseline, parallel->Baseline(t.name));
      EXPECT_TRUE(
          std::equal(baseline.bytes.begin(), baseline.bytes.end(), t.bytes.begin(), t.bytes.end()))
          << t.name;
      EXPECT_EQ(parallel->Digests().at(t.name), TensorDigest(t.view()));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Storage, TrackerTest,
                         ::testing::Values(BaselineStorage::kMemory, BaselineStorage::kFile),
                         [](const auto& param_info) {
                           return param_info.param == BaselineStorage::kMemory ? "Memory" : "File";
                         });

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST(TrackerAdoptTest, AdoptedBaselineMakesTheNextTransferADelta) {
  ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));
  OwnedTensor v0 = testing::RandomTensor("w", DType::kBFloat16, {512}, 70);
  ASSERT_OK(tracker->AdoptBaseline(v0.view()));
  EXPECT_EQ(tracker->version(), 0u);
  EXPECT_EQ(tracker->Digests().at("w"), TensorDigest(v0.view()));
  const TransferId id = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(id));
  EXPECT_FALSE(plan.anchor);
  EXPECT_EQ(plan.base_version, 0u);
  EXPECT_STATUS(FailedPrecondition, tracker->AdoptBaseline(v0.view()));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult r,
                       tracker->Encode(id, testing::Perturb(v0, 0.1, 71).view()));
  EXPECT_EQ(r.items.at(0).op, Op::kXor);
}

}  // namespace
}  // namespace refit
