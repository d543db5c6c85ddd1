// The receiver's memory policy for anchors (AnchorUndo): what an aborted FULL leaves behind under
// each policy, the needs_anchor state of `none`, and the spill file of `file`.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "codec/tracker.h"
#include "receiver/apply.h"
#include "receiver/receiver_session.h"
#include "store_snapshot.h"
#include "test_data.h"
#include "test_util.h"
#include "trainer_step.h"

namespace refit {
namespace {

using Step = testing::TrainerStep;
using testing::EncodeTrainerStep;
using testing::Perturb;
using testing::RandomTensor;

constexpr auto kGenerousTimeout = std::chrono::seconds(60);

TEST(AnchorUndoNameTest, ParsesItsOwnNamesAndNamesABadOne) {
  for (AnchorUndo policy : {AnchorUndo::kMemory, AnchorUndo::kFile, AnchorUndo::kNone}) {
    ASSERT_OK_AND_ASSIGN(AnchorUndo parsed, ParseAnchorUndo(AnchorUndoName(policy)));
    EXPECT_EQ(parsed, policy);
  }
  EXPECT_STATUS_MSG(InvalidArgument, "'disk' is not one of memory, file, none",
                    ParseAnchorUndo("disk"));
}

/// A trainer and one receiver store that start from the same weights, and a session over the
/// store under the policy of the test's parameter.
class AnchorUndoTest : public ::testing::TestWithParam<AnchorUndo> {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make({}));
    store_ = WeightStore::Make();
    current_ = {RandomTensor("model.embed.weight", DType::kBFloat16, {64, 33}, 1),
                RandomTensor("model.layers.0.mlp.up.weight", DType::kFloat32, {31, 29}, 3),
                RandomTensor("model.norm.weight", DType::kBFloat16, {257}, 6)};
    for (const OwnedTensor& t : current_) {
      ASSERT_OK(testing::AddTestTensor(*store_, t.view()));
      ASSERT_OK(tracker_->AdoptBaseline(t.view()));
    }
    ReceiverSessionOptions options;
    options.anchor_undo = GetParam();
    options.after_abort = [this](const TransferId&, uint64_t) { ++after_abort_calls_; };
    options.after_commit = [this](const TransferId&, uint64_t) { ++after_commit_calls_; };
    ASSERT_OK_AND_ASSIGN(session_, internal::ReceiverSession::Make(options, *store_));
  }

  uint64_t ModelBytes() const {
    uint64_t total = 0;
    for (const OwnedTensor& t : current_) total += t.bytes.size();
    return total;
  }

  Step EncodeStep(uint64_t seed, bool anchor) {
    return EncodeTrainerStep(*tracker_, current_, seed, 0.05, /*producers=*/2, /*spans=*/2, anchor);
  }

  static PrepareRequest Request(const Step& step) {
    return PrepareRequest{step.id, step.base_version, step.expected, step.anchor};
  }

  /// Prepare, stage and flush `step` (every payload applied and verified).
  void Deliver(const Step& step) {
    ASSERT_OK(session_->Prepare(Request(step)));
    for (const auto& payload : step.payloads) ASSERT_OK(session_->Stage(payload));
    FlushOptions flush;
    flush.timeout = kGenerousTimeout;
    ASSERT_OK(session_->Flush(step.id, flush));
  }

  void Commit(const Step& step) {
    ASSERT_OK(session_->Commit(step.id));
    ASSERT_OK(tracker_->Commit(step.id));
    current_ = step.next;
  }

  bool StoreHolds(const std::vector<OwnedTensor>& tensors) const {
    for (const OwnedTensor& t : tensors) {
      if (testing::StoreBytes(*store_, t.name) != t.bytes) return false;
    }
    return true;
  }

  std::unique_ptr<internal::DeltaTracker> tracker_;
  std::unique_ptr<WeightStore> store_;
  std::vector<OwnedTensor> current_;
  std::unique_ptr<internal::ReceiverSession> session_;
  std::atomic<int> after_abort_calls_{0};
  std::atomic<int> after_commit_calls_{0};
};

TEST_P(AnchorUndoTest, AnAbortedAnchorRestoresTheBaseOrLeavesTheReceiverNeedingAnAnchor) {
  const AnchorUndo policy = GetParam();
  // A delta first: the version moves, and a delta's undo is the same under every policy.
  const Step delta = EncodeStep(1, /*anchor=*/false);
  ASSERT_NO_FATAL_FAILURE(Deliver(delta));
  Commit(delta);
  const std::vector<OwnedTensor> base = current_;

  const Step anchor = EncodeStep(2, /*anchor=*/true);
  ASSERT_TRUE(anchor.anchor);
  ASSERT_NO_FATAL_FAILURE(Deliver(anchor));
  const ReceiverStatus during = session_->GetStatus();
  // What holds the anchor's old bits while it is open: memory, the spill file, or nothing.
  switch (policy) {
    case AnchorUndo::kMemory:
      EXPECT_EQ(during.undo_bytes, ModelBytes());
      EXPECT_EQ(during.undo_file_bytes, 0u);
      break;
    case AnchorUndo::kFile:
      EXPECT_EQ(during.undo_bytes, 0u);
      EXPECT_EQ(during.undo_file_bytes, ModelBytes());
      break;
    case AnchorUndo::kNone:
      EXPECT_EQ(during.undo_bytes, 0u);
      EXPECT_EQ(during.undo_file_bytes, 0u);
      break;
  }
  ASSERT_OK(session_->Abort(anchor.id));
  ASSERT_OK(tracker_->Abort(anchor.id));

  const ReceiverStatus after = session_->GetStatus();
  EXPECT_EQ(after.state, ReceiverState::kIdle);
  EXPECT_EQ(after.version, delta.target_version);
  EXPECT_EQ(after.undo_file_bytes, 0u);
  // Whatever the policy, the digests match the bytes: the next anchor's checks depend on it.
  EXPECT_EQ(store_->Digests(), store_->RecomputeDigests());
  if (policy != AnchorUndo::kNone) {
    EXPECT_FALSE(after.needs_anchor);
    EXPECT_TRUE(StoreHolds(base)) << "the base is restored bit-exactly";
    EXPECT_EQ(after_abort_calls_, 1);
    return;
  }
  EXPECT_TRUE(after.needs_anchor);
  EXPECT_NE(after.needs_anchor_reason.find(anchor.id.ToHex()), std::string::npos)
      << after.needs_anchor_reason;
  EXPECT_TRUE(StoreHolds(anchor.next)) << "the anchor's bits stay: nothing kept the old ones";
  EXPECT_EQ(after_abort_calls_, 0) << "an engine must stay paused: its weights need an anchor";

  // A delta is refused at prepare, by name, and nothing is opened.
  const Step refused = EncodeStep(3, /*anchor=*/false);
  EXPECT_STATUS_MSG(FailedPrecondition, "needs an anchor and refuses a delta",
                    session_->Prepare(Request(refused)));
  EXPECT_EQ(session_->GetStatus().state, ReceiverState::kIdle);
  ASSERT_OK(tracker_->Abort(refused.id));

  // The next anchor heals it; deltas flow again after it.
  const Step heal = EncodeStep(4, /*anchor=*/true);
  ASSERT_NO_FATAL_FAILURE(Deliver(heal));
  Commit(heal);
  EXPECT_FALSE(session_->GetStatus().needs_anchor);
  EXPECT_TRUE(StoreHolds(current_));
  const Step next = EncodeStep(5, /*anchor=*/false);
  ASSERT_NO_FATAL_FAILURE(Deliver(next));
  Commit(next);
  EXPECT_TRUE(StoreHolds(current_));
  EXPECT_EQ(store_->Digests(), store_->RecomputeDigests());
}

TEST_P(AnchorUndoTest, AnAnchorAbortedBeforeItsFlushEndsTheSameWay) {
  // Half the anchor's payloads applied, the rest never sent (a producer killed mid-stream).
  const std::vector<OwnedTensor> base = current_;
  const Step anchor = EncodeStep(7, /*anchor=*/true);
  ASSERT_GE(anchor.payloads.size(), 2u);
  ASSERT_OK(session_->Prepare(Request(anchor)));
  ASSERT_OK(session_->Stage(anchor.payloads[0]));
  const auto deadline = std::chrono::steady_clock::now() + kGenerousTimeout;
  while (session_->GetStatus().applied_payloads < 1 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_OK(session_->Abort(anchor.id));
  ASSERT_OK(tracker_->Abort(anchor.id));
  EXPECT_EQ(store_->Digests(), store_->RecomputeDigests());
  EXPECT_EQ(session_->GetStatus().needs_anchor, GetParam() == AnchorUndo::kNone);
  if (GetParam() != AnchorUndo::kNone) {
    EXPECT_TRUE(StoreHolds(base));
  }
}

TEST_P(AnchorUndoTest, ADeltaAbortIsExactUnderEveryPolicy) {
  const std::vector<OwnedTensor> base = current_;
  const Step delta = EncodeStep(9, /*anchor=*/false);
  ASSERT_NO_FATAL_FAILURE(Deliver(delta));
  ASSERT_OK(session_->Abort(delta.id));
  ASSERT_OK(tracker_->Abort(delta.id));
  EXPECT_FALSE(session_->GetStatus().needs_anchor);
  EXPECT_TRUE(StoreHolds(base));
  EXPECT_EQ(store_->Digests(), store_->RecomputeDigests());
}

INSTANTIATE_TEST_SUITE_P(Policies, AnchorUndoTest,
                         ::testing::Values(AnchorUndo::kMemory, AnchorUndo::kFile,
                                           AnchorUndo::kNone),
                         [](const auto& param_info) {
                           return std::string(AnchorUndoName(param_info.param));
                         });

// An anchor's payload of several tensors (one of them in two spans) applied on 4 threads gives
// the bytes and digests one thread gives; its rollback is as exact, and a forged item digest
// fails the whole payload and leaves the store as it was, under every policy that keeps bits.
TEST(AnchorUndoParallelTest, AParallelFullApplyEqualsASerialOneAndRollsBackAsExactly) {
  const std::vector<OwnedTensor> base = {RandomTensor("a.weight", DType::kBFloat16, {300, 40}, 21),
                                         RandomTensor("b.weight", DType::kFloat32, {77, 13}, 22),
                                         RandomTensor("c.weight", DType::kFloat16, {5000}, 23),
                                         RandomTensor("d.bias", DType::kBFloat16, {3}, 24)};
  std::vector<OwnedTensor> next;
  for (const OwnedTensor& t : base) next.push_back(Perturb(t, 0.5, 99));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<internal::DeltaTracker> tracker,
                       internal::DeltaTracker::Make({}));
  const TransferId id = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(const TransferPlan plan, tracker->Begin(id, /*force_anchor=*/true));
  std::vector<Item> items;
  for (const OwnedTensor& t : next) {
    const uint64_t numel = t.view().numel();
    // c.weight in two spans: they share its digest, so they stay on one thread.
    const std::vector<uint64_t> cuts = t.name == "c.weight" ? std::vector<uint64_t>{0, 1234, numel}
                                                            : std::vector<uint64_t>{0, numel};
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      ASSERT_OK_AND_ASSIGN(internal::EncodeResult encoded,
                           tracker->Encode(id, t.view(), cuts[k], cuts[k + 1]));
      for (Item& item : encoded.items) items.push_back(std::move(item));
    }
  }
  std::vector<ItemView> views;
  for (const Item& item : items) views.push_back(item.view());
  const PayloadIds ids{id, 0, 0, plan.base_version, plan.target_version};
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> bytes, EncodePayload(ids, views));
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(bytes));
  // The same payload with one item's digest forged (its values stay right).
  std::vector<Item> forged_items = items;
  forged_items[2].digest ^= 1;
  std::vector<ItemView> forged_views;
  for (const Item& item : forged_items) forged_views.push_back(item.view());
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> forged_bytes, EncodePayload(ids, forged_views));
  ASSERT_OK_AND_ASSIGN(DecodedPayload forged, DecodePayload(forged_bytes));

  const auto make_store = [&] {
    auto store = WeightStore::Make();
    for (const OwnedTensor& t : base) EXPECT_OK(testing::AddTestTensor(*store, t.view()));
    return store;
  };
  const auto holds = [](const WeightStore& store, const std::vector<OwnedTensor>& model) {
    for (const OwnedTensor& t : model) {
      if (testing::StoreBytes(store, t.name) != t.bytes) return false;
    }
    return true;
  };
  auto serial = make_store();
  internal::UndoLog serial_undo;
  ASSERT_OK(internal::ApplyPayload(decoded, *serial, &serial_undo, nullptr, /*threads=*/1));
  ASSERT_TRUE(holds(*serial, next));
  const std::string directory = std::filesystem::temp_directory_path().string();
  for (AnchorUndo policy : {AnchorUndo::kMemory, AnchorUndo::kFile, AnchorUndo::kNone}) {
    SCOPED_TRACE(AnchorUndoName(policy));
    auto store = make_store();
    internal::UndoLog undo(
        internal::UndoLogOptions{.anchor_undo = policy, .spill_directory = directory});
    ASSERT_OK(internal::ApplyPayload(decoded, *store, &undo, nullptr, /*threads=*/4));
    EXPECT_TRUE(holds(*store, next));
    EXPECT_EQ(store->Digests(), serial->Digests());
    EXPECT_EQ(store->Digests(), store->RecomputeDigests());
    EXPECT_EQ(undo.spilled_bytes() > 0, policy == AnchorUndo::kFile);
    EXPECT_EQ(undo.exact(), policy != AnchorUndo::kNone);
    ASSERT_OK(undo.Rollback(*store));
    EXPECT_TRUE(holds(*store, policy == AnchorUndo::kNone ? next : base));
    EXPECT_EQ(store->Digests(), store->RecomputeDigests());
    if (policy == AnchorUndo::kNone) continue;
    // The forged payload: refused, nothing of it left.
    EXPECT_STATUS_MSG(DataLoss, "span digest after apply",
                      internal::ApplyPayload(forged, *store, &undo, nullptr, /*threads=*/4));
    EXPECT_TRUE(holds(*store, base));
    EXPECT_EQ(store->Digests(), store->RecomputeDigests());
    EXPECT_EQ(undo.records(), 0u);
  }
  ASSERT_OK(tracker->Abort(id));
}

TEST(AnchorUndoOptionsTest, ASpillDirectoryThatCannotHoldTheFileIsRefusedAtMakeNamingIt) {
  auto store = WeightStore::Make();
  ReceiverSessionOptions options;
  options.anchor_undo = AnchorUndo::kFile;
  options.anchor_undo_directory = "/nonexistent/refit-spill";
  EXPECT_STATUS_MSG(InvalidArgument, "'/nonexistent/refit-spill' is not a directory",
                    internal::ReceiverSession::Make(options, *store));
  // Only kFile uses the directory.
  options.anchor_undo = AnchorUndo::kNone;
  EXPECT_OK(internal::ReceiverSession::Make(options, *store));
}

// A spill file that cannot be written (here: past RLIMIT_FSIZE, as on a full disk) fails the
// payload with an IoError that names the file, and leaves the store as it was.
TEST(AnchorUndoSpillTest, AFailedSpillWriteFailsThePayloadAndAppliesNothing) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<internal::DeltaTracker> tracker,
                       internal::DeltaTracker::Make({}));
  auto store = WeightStore::Make();
  const OwnedTensor base = RandomTensor("big.weight", DType::kFloat32, {64, 64}, 11);
  ASSERT_OK(testing::AddTestTensor(*store, base.view()));
  ASSERT_OK(tracker->AdoptBaseline(base.view()));
  const Step step = EncodeTrainerStep(*tracker, {base}, 12, 0.5, 1, 1, /*anchor=*/true);
  ASSERT_EQ(step.payloads.size(), 1u);
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(step.payloads[0]));

  const std::string directory =
      (std::filesystem::temp_directory_path() / fmt::format("refit-spill-{}", ::getpid())).string();
  std::filesystem::create_directories(directory);
  internal::UndoLog undo(
      internal::UndoLogOptions{.anchor_undo = AnchorUndo::kFile, .spill_directory = directory});
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto previous_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = 4096;  // The tensor's old bits are 16 KiB.
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const Status applied = internal::ApplyPayload(decoded, *store, &undo);
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous_handler);
  std::filesystem::remove_all(directory);

  EXPECT_EQ(applied.code(), StatusCode::kIoError) << applied.ToString();
  EXPECT_NE(applied.message().find("refit-anchor-undo-"), std::string::npos) << applied.ToString();
  EXPECT_EQ(testing::StoreBytes(*store, "big.weight"), base.bytes);
  EXPECT_EQ(store->Digests(), store->RecomputeDigests());
  EXPECT_EQ(undo.records(), 0u);
}

}  // namespace
}  // namespace refit
