// The tracker's background baseline fold (codec/tracker.h): Commit returns before the committed
// changes are scattered into the baseline, and nothing that reads a baseline may see it half
// folded. These tests hold the fold on its thread (SetFoldHookForTesting) and race the next
// transfer, a reader and the tracker's destruction against it.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "codec/locations.h"
#include "codec/tracker.h"
#include "codec/values.h"
#include "core/digest.h"
#include "refit/status_format.h"
#include "test_data.h"
#include "test_util.h"
#include "util/background_job.h"

namespace refit {
namespace {

using testing::Perturb;
using testing::RandomTensor;

/// A gate the fold's hook waits at until a test opens it, from another thread.
struct Gate {
  std::atomic<bool> open{false};
  std::atomic<bool> reached{false};
  Status Pass() {
    reached = true;
    while (!open.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return Status::OK();
  }
  /// Open the gate after `delay` from a thread of its own (joined by the caller).
  std::thread OpenAfter(std::chrono::milliseconds delay) {
    return std::thread([this, delay] {
      std::this_thread::sleep_for(delay);
      open = true;
    });
  }
};

/// The elements at which `a` and `b` differ.
uint64_t Differences(const OwnedTensor& a, const OwnedTensor& b) {
  const uint32_t width = DTypeSize(a.dtype);
  uint64_t n = 0;
  for (uint64_t i = 0; i < a.bytes.size() / width; ++i) {
    n += std::memcmp(a.bytes.data() + i * width, b.bytes.data() + i * width, width) != 0;
  }
  return n;
}

/// `base` with `items` applied as a receiver applies them.
OwnedTensor ApplyItems(const OwnedTensor& base, const std::vector<Item>& items) {
  OwnedTensor out = base;
  for (const Item& item : items) {
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

class BaselineFoldTest : public ::testing::TestWithParam<BaselineStorage> {
 protected:
  std::unique_ptr<internal::DeltaTracker> MakeTracker() {
    TrackerOptions options;
    options.baseline_storage = GetParam();
    options.commit_threads = 2;
    auto tracker = internal::DeltaTracker::Make(options);
    EXPECT_TRUE(tracker.ok()) << tracker.status().ToString();
    return std::move(tracker).ValueOrDie();
  }

  /// One transfer of `tensors` (an anchor the first time), committed.
  static void Sync(internal::DeltaTracker& tracker, const std::vector<OwnedTensor>& tensors) {
    const TransferId id = TransferId::Random();
    ASSERT_OK(tracker.Begin(id));
    for (const OwnedTensor& t : tensors) ASSERT_OK(tracker.Encode(id, t.view()));
    ASSERT_OK(tracker.Commit(id));
  }

  /// Four tensors of 64 Ki bf16 each at version 1, and the step that makes version 2 of them.
  void SetUpModel() {
    for (int k = 0; k < 4; ++k) {
      v0.push_back(RandomTensor("layer" + std::to_string(k), DType::kBFloat16, {256, 256}, 10 + k));
      v1.push_back(Perturb(v0.back(), 0.05, 20 + k));
      v2.push_back(Perturb(v1.back(), 0.05, 30 + k));
    }
  }

  std::vector<OwnedTensor> v0, v1, v2;
};

// The core race: the fold of version 2 is held on its thread while the next transfer begins at
// once. Begin must wait for it, and the next delta must be exactly v1 -> v2: a compare against a
// baseline still at v0 (or half-way) would send v0 -> v2 changes, which applied to v1 miss v2.
TEST_P(BaselineFoldTest, TheNextTransferWaitsForAHeldFoldAndItsDeltaIsBitExact) {
  SetUpModel();
  auto tracker = MakeTracker();
  Sync(*tracker, v0);  // Version 1: an anchor, nothing to fold.
  EXPECT_EQ(tracker->last_fold().elements, 0u);
  Gate gate;
  tracker->SetFoldHookForTesting([&gate] { return gate.Pass(); });
  Sync(*tracker, v1);  // Version 2: returns with its fold held at the gate.
  EXPECT_EQ(tracker->version(), 2u);
  while (!gate.reached.load()) std::this_thread::yield();
  EXPECT_TRUE(tracker->last_fold().running);
  // The digests are the committed state's at once: they need no fold.
  for (const OwnedTensor& t : v1) EXPECT_EQ(tracker->Digests().at(t.name), TensorDigest(t.view()));

  std::thread opener = gate.OpenAfter(std::chrono::milliseconds(150));
  const TransferId id = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(id));
  // Begin returned, so the gate was open and the fold finished.
  EXPECT_TRUE(gate.open.load());
  EXPECT_FALSE(tracker->last_fold().running);
  opener.join();
  EXPECT_FALSE(plan.anchor);
  EXPECT_EQ(plan.base_version, 2u);
  for (size_t k = 0; k < v2.size(); ++k) {
    SCOPED_TRACE(v2[k].name);
    ASSERT_OK_AND_ASSIGN(internal::EncodeResult r, tracker->Encode(id, v2[k].view()));
    EXPECT_EQ(r.changed_elements, Differences(v1[k], v2[k]));
    EXPECT_EQ(ApplyItems(v1[k], r.items).bytes, v2[k].bytes);
  }
  ASSERT_OK(tracker->Commit(id));
  ASSERT_OK(tracker->WaitBaseline());
  EXPECT_GT(tracker->last_fold().elements, 0u);
  EXPECT_GT(tracker->last_fold().waited_seconds, 0.0);
  for (const OwnedTensor& t : v2) {
    ASSERT_OK_AND_ASSIGN(TensorView baseline, tracker->Baseline(t.name));
    EXPECT_TRUE(std::ranges::equal(baseline.bytes, t.bytes)) << t.name;
  }
}

// A reader of the baseline (Baseline, as a tool or the benchmark's compare-only pass does) and a
// re-adoption wait for the held fold too: the one sees the committed bits, the other replaces
// the buffer only once the fold stopped writing into it.
TEST_P(BaselineFoldTest, ReadersAndAdoptionWaitForAHeldFold) {
  SetUpModel();
  auto tracker = MakeTracker();
  Sync(*tracker, v0);
  Gate gate;
  tracker->SetFoldHookForTesting([&gate] { return gate.Pass(); });
  Sync(*tracker, v1);
  while (!gate.reached.load()) std::this_thread::yield();
  std::thread opener = gate.OpenAfter(std::chrono::milliseconds(100));
  ASSERT_OK_AND_ASSIGN(TensorView baseline, tracker->Baseline(v1[0].name));
  EXPECT_TRUE(gate.open.load());
  EXPECT_TRUE(std::ranges::equal(baseline.bytes, v1[0].bytes));
  opener.join();

  gate.open = false;
  gate.reached = false;
  Sync(*tracker, v2);
  while (!gate.reached.load()) std::this_thread::yield();
  opener = gate.OpenAfter(std::chrono::milliseconds(100));
  ASSERT_OK(tracker->AdoptBaseline(v0[1].view()));
  EXPECT_TRUE(gate.open.load());
  opener.join();
  ASSERT_OK_AND_ASSIGN(baseline, tracker->Baseline(v0[1].name));
  EXPECT_TRUE(std::ranges::equal(baseline.bytes, v0[1].bytes));
  ASSERT_OK_AND_ASSIGN(baseline, tracker->Baseline(v2[2].name));
  EXPECT_TRUE(std::ranges::equal(baseline.bytes, v2[2].bytes));
}

// Destroying the tracker while its fold is held: the destructor waits for the fold before the
// baselines it writes into go (an ASan build reports a use after free otherwise).
TEST_P(BaselineFoldTest, DestroyingTheTrackerMidFoldWaitsForIt) {
  SetUpModel();
  auto tracker = MakeTracker();
  Sync(*tracker, v0);
  Gate gate;
  tracker->SetFoldHookForTesting([&gate] { return gate.Pass(); });
  Sync(*tracker, v1);
  while (!gate.reached.load()) std::this_thread::yield();
  std::thread opener = gate.OpenAfter(std::chrono::milliseconds(100));
  tracker.reset();
  EXPECT_TRUE(gate.open.load());  // The destructor returned only after the fold went on.
  opener.join();
}

// An aborted transfer folds nothing: its changes are sent again by the next transfer.
TEST_P(BaselineFoldTest, AnAbortFoldsNothing) {
  SetUpModel();
  auto tracker = MakeTracker();
  Sync(*tracker, v0);
  const TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id));
  for (const OwnedTensor& t : v1) ASSERT_OK(tracker->Encode(id, t.view()));
  ASSERT_OK(tracker->Abort(id));
  EXPECT_EQ(tracker->last_fold().elements, 0u);
  EXPECT_FALSE(tracker->last_fold().running);
  for (const OwnedTensor& t : v0) {
    ASSERT_OK_AND_ASSIGN(TensorView baseline, tracker->Baseline(t.name));
    EXPECT_TRUE(std::ranges::equal(baseline.bytes, t.bytes)) << t.name;
  }
}

// A fold that fails (only a bug can: the hook stands in for it) drops the tensors it may have
// left half-folded and makes the next transfer an anchor; the transfer after that is a delta
// again, bit-exact.
TEST_P(BaselineFoldTest, AFailedFoldDropsItsTensorsAndTheNextTransferIsAnAnchor) {
  SetUpModel();
  auto tracker = MakeTracker();
  Sync(*tracker, v0);
  tracker->SetFoldHookForTesting([] { return DataLoss("the test's fold failure"); });
  Sync(*tracker, v1);
  tracker->SetFoldHookForTesting(nullptr);
  EXPECT_FALSE(tracker->Baseline(v1[0].name).ok());
  const Status begun = tracker->Begin(TransferId::Random()).status();
  EXPECT_EQ(begun.code(), StatusCode::kDataLoss) << begun.ToString();
  EXPECT_NE(begun.ToString().find("the next transfer is an anchor"), std::string::npos)
      << begun.ToString();
  EXPECT_TRUE(tracker->NextIsAnchor());
  EXPECT_EQ(tracker->Baseline(v1[0].name).status().code(), StatusCode::kNotFound);

  const TransferId anchor = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(anchor));
  EXPECT_TRUE(plan.anchor);
  for (const OwnedTensor& t : v1) ASSERT_OK(tracker->Encode(anchor, t.view()));
  ASSERT_OK(tracker->Commit(anchor));
  const TransferId delta = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(plan, tracker->Begin(delta));
  EXPECT_FALSE(plan.anchor);
  for (size_t k = 0; k < v2.size(); ++k) {
    ASSERT_OK_AND_ASSIGN(internal::EncodeResult r, tracker->Encode(delta, v2[k].view()));
    EXPECT_EQ(ApplyItems(v1[k], r.items).bytes, v2[k].bytes) << v2[k].name;
  }
}

INSTANTIATE_TEST_SUITE_P(Storage, BaselineFoldTest,
                         ::testing::Values(BaselineStorage::kMemory, BaselineStorage::kFile),
                         [](const auto& param_info) {
                           return param_info.param == BaselineStorage::kMemory ? "Memory" : "File";
                         });

TEST(BackgroundJobTest, WaitReportsTheFirstErrorOnceAndWaitIdleKeepsIt) {
  internal::BackgroundJob job("test-job");
  ASSERT_OK(job.Wait());  // Nothing started.
  job.Start([] { return InvalidArgument("first"); });
  EXPECT_EQ(job.WaitIdle().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(job.idle());
  job.Start([] { return Internal("second"); });
  const Status status = job.Wait();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  ASSERT_OK(job.Wait());  // Reported once.
  job.Start([] { return Status::OK(); });
  ASSERT_OK(job.Wait());
}

TEST(BackgroundJobTest, TheDestructorWaitsForARunningJob) {
  std::atomic<bool> finished{false};
  {
    internal::BackgroundJob job("test-job");
    job.Start([&finished] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      finished = true;
      return Status::OK();
    });
  }
  EXPECT_TRUE(finished.load());
}

}  // namespace
}  // namespace refit
