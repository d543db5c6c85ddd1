#include "receiver/receiver_session.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <stop_token>
#include <thread>
#include <utility>
#include <vector>

#include "codec/tracker.h"
#include "store_snapshot.h"
#include "test_data.h"
#include "test_util.h"
#include "trainer_step.h"

namespace refit {
namespace {

using Step = testing::TrainerStep;
using testing::EncodeTrainerStep;
using testing::StoreSnapshot;
using testing::TakeSnapshot;

using testing::Perturb;
using testing::RandomTensor;

// A flush timeout no correct run reaches, even on a loaded 2-core machine.
constexpr auto kGenerousTimeout = std::chrono::seconds(60);
// A flush timeout for payloads that will never arrive: it only sets how long the test waits.
constexpr auto kShortTimeout = std::chrono::milliseconds(100);
// How long a test lets a thread run before checking that it is still blocked. A blocked call
// stays blocked however long we wait, so this cannot make a correct session fail.
constexpr auto kSettleTime = std::chrono::milliseconds(50);
// Fraction of elements each training step changes: every tensor gets some changes.
constexpr double kDensity = 0.05;

/// A trainer (DeltaTracker over W producers) and one receiver store that start from the same
/// weights.
class ReceiverSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make({}));
    store_ = WeightStore::Make();
    current_ = {RandomTensor("model.embed.weight", DType::kBFloat16, {64, 33}, 1),
                RandomTensor("model.layers.0.attn.qkv.weight", DType::kFloat16, {40, 40}, 2),
                RandomTensor("model.layers.0.mlp.up.weight", DType::kFloat32, {31, 29}, 3),
                RandomTensor("model.layers.0.mlp.down.weight", DType::kFloat8E4M3FN, {900}, 4),
                RandomTensor("model.layers.1.mlp.up.weight", DType::kBFloat16, {1000}, 5),
                RandomTensor("model.norm.weight", DType::kBFloat16, {257}, 6)};
    for (const OwnedTensor& t : current_) {
      ASSERT_OK(testing::AddTestTensor(*store_, t.view()));
      ASSERT_OK(tracker_->AdoptBaseline(t.view()));
    }
  }

  std::unique_ptr<internal::ReceiverSession> MakeSession(
      const ReceiverSessionOptions& options = {}) {
    auto session = internal::ReceiverSession::Make(options, *store_);
    EXPECT_TRUE(session.ok()) << session.status().ToString();
    return session.ok() ? std::move(session).ValueOrDie() : nullptr;
  }

  /// Encode the next step: every tensor perturbed, split into `spans` element ranges, one payload
  /// per range; range k of all tensors goes to producer k % producers, as the upstream
  /// `chunk % W` ownership does.
  Step EncodeStep(uint64_t seed, uint32_t producers = 2, uint64_t spans = 1) {
    return EncodeTrainerStep(*tracker_, current_, seed, kDensity, producers, spans);
  }

  static PrepareRequest Request(const Step& step) {
    return PrepareRequest{step.id, step.base_version, step.expected};
  }

  static FlushOptions Generous() {
    FlushOptions options;
    options.timeout = kGenerousTimeout;
    return options;
  }

  /// The trainer commits (the coordinator saw every receiver prepared).
  void CommitTrainer(const Step& step) {
    ASSERT_OK(tracker_->Commit(step.id));
    current_ = step.next;
  }

  void ExpectStoreHolds(const std::vector<OwnedTensor>& tensors) {
    for (const OwnedTensor& t : tensors) {
      EXPECT_TRUE(testing::StoreBytes(*store_, t.name) == t.bytes) << t.name;
    }
    EXPECT_EQ(store_->Digests(), store_->RecomputeDigests());
  }

  /// Wait (up to the generous timeout) until `count` payloads of the open transfer are applied.
  static void WaitForApplied(const internal::ReceiverSession& session, uint64_t count) {
    const auto deadline = std::chrono::steady_clock::now() + kGenerousTimeout;
    while (session.GetStatus().applied_payloads < count &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ(session.GetStatus().applied_payloads, count);
  }

  std::unique_ptr<internal::DeltaTracker> tracker_;
  std::unique_ptr<WeightStore> store_;
  std::vector<OwnedTensor> current_;
};

TEST_F(ReceiverSessionTest, APrepareNamingTensorsTheStoreDoesNotHoldIsRefusedAndKeepsNothing) {
  auto session = MakeSession();
  Step step = EncodeStep(11);
  // A hostile (authenticated) prepare: a million made-up names besides the real ones.
  PrepareRequest hostile = Request(step);
  for (int i = 0; i < 1'000'000; ++i) hostile.expected.digests[fmt::format("made.up.{}", i)] = i;
  EXPECT_STATUS_MSG(NotFound, "made.up.0", session->Prepare(hostile));
  EXPECT_EQ(session->GetStatus().state, ReceiverState::kIdle);
  // Nothing was kept: the real transfer prepares as usual; a flush naming an unknown tensor is
  // refused the same way, and the transfer still rolls back cleanly.
  ASSERT_OK(session->Prepare(Request(step)));
  for (const auto& payload : step.payloads) ASSERT_OK(session->Stage(payload));
  FlushOptions forged = Generous();
  forged.expected.digests["made.up.flush"] = 1;
  EXPECT_STATUS_MSG(NotFound, "made.up.flush", session->Flush(step.id, forged));
  ASSERT_OK(session->Abort(step.id));
  ExpectStoreHolds(current_);
}

TEST_F(ReceiverSessionTest, MakeRejectsBadOptions) {
  ReceiverSessionOptions options;
  options.apply_queue_depth = 0;
  EXPECT_STATUS(InvalidArgument, internal::ReceiverSession::Make(options, *store_));
  options.apply_queue_depth = ReceiverSessionOptions::kMaxApplyQueueDepth + 1;
  EXPECT_STATUS(InvalidArgument, internal::ReceiverSession::Make(options, *store_));
  options = {};
  options.remembered_transfers = 0;
  EXPECT_STATUS(InvalidArgument, internal::ReceiverSession::Make(options, *store_));
}

TEST_F(ReceiverSessionTest, SeveralTransfersReproduceTheTrainerBitExactly) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->GetStatus().state, ReceiverState::kIdle);
  for (uint64_t round = 0; round < 4; ++round) {
    const Step step = EncodeStep(round + 1);
    ASSERT_FALSE(step.payloads.empty());
    ASSERT_OK_AND_ASSIGN(PrepareResult prepared, session->Prepare(Request(step)));
    EXPECT_FALSE(prepared.repeated);
    EXPECT_FALSE(prepared.implied_commit.has_value());
    EXPECT_EQ(session->GetStatus().state, ReceiverState::kReceiving);
    for (const auto& payload : step.payloads) {
      ASSERT_OK_AND_ASSIGN(StageResult staged, session->Stage(payload));
      EXPECT_EQ(staged, StageResult::kAccepted);
    }
    ASSERT_OK_AND_ASSIGN(FlushReport report, session->Flush(step.id, Generous()));
    EXPECT_EQ(report.transfer_id, step.id);
    EXPECT_EQ(report.target_version, step.target_version);
    EXPECT_EQ(report.payloads, step.payloads.size());
    EXPECT_EQ(report.items, step.items_total);
    EXPECT_EQ(report.changed_elements, step.changed_elements);
    EXPECT_EQ(report.duplicates, 0u);
    EXPECT_EQ(report.digests, step.expected.digests);

    const ReceiverStatus status = session->GetStatus();
    EXPECT_EQ(status.state, ReceiverState::kPrepared);
    EXPECT_TRUE(status.sealed);
    EXPECT_EQ(status.staged_payloads, step.payloads.size());
    EXPECT_EQ(status.applied_payloads, step.payloads.size());
    EXPECT_GT(status.undo_bytes, 0u);
    EXPECT_EQ(store_->version(), step.base_version);  // Not before Commit.

    ASSERT_OK(session->Commit(step.id));
    CommitTrainer(step);
    EXPECT_EQ(store_->version(), step.target_version);
    const ReceiverStatus idle = session->GetStatus();
    EXPECT_EQ(idle.state, ReceiverState::kIdle);
    EXPECT_EQ(idle.version, step.target_version);
    EXPECT_FALSE(idle.transfer_id.has_value());
    EXPECT_EQ(idle.undo_bytes, 0u);
    ExpectStoreHolds(current_);
  }
}

TEST_F(ReceiverSessionTest, DuplicatesAreAckedButAppliedOnce) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const Step step = EncodeStep(1);
  ASSERT_OK(session->Prepare(Request(step)));
  for (const auto& payload : step.payloads) {
    ASSERT_OK_AND_ASSIGN(StageResult first, session->Stage(payload));
    EXPECT_EQ(first, StageResult::kAccepted);
    // A sender retry: an XOR payload applied twice would revert its changes.
    ASSERT_OK_AND_ASSIGN(StageResult second, session->Stage(payload));
    EXPECT_EQ(second, StageResult::kDuplicate);
  }
  ASSERT_OK_AND_ASSIGN(FlushReport report, session->Flush(step.id, Generous()));
  EXPECT_EQ(report.payloads, step.payloads.size());
  EXPECT_EQ(report.duplicates, step.payloads.size());
  EXPECT_EQ(session->GetStatus().duplicate_payloads, step.payloads.size());
  ASSERT_OK(session->Commit(step.id));
  CommitTrainer(step);
  ExpectStoreHolds(current_);
}

TEST_F(ReceiverSessionTest, ConflictingPayloadIsRefused) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const Step step = EncodeStep(1);
  ASSERT_OK(session->Prepare(Request(step)));
  ASSERT_OK(session->Stage(step.payloads[0]));
  // The same ids and items encoded without byte planes: other bytes, other checksum.
  std::vector<ItemView> views;
  for (const Item& item : step.items[0]) views.push_back(item.view());
  PayloadEncodeOptions flat;
  flat.byte_planes = false;
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> conflicting, EncodePayload(step.ids[0], views, flat));
  ASSERT_NE(conflicting, step.payloads[0]);
  EXPECT_STATUS_MSG(AlreadyExists, "another checksum", session->Stage(conflicting));
  // The conflict is a NACK of that copy only: the transfer still completes with the first.
  for (size_t i = 1; i < step.payloads.size(); ++i) ASSERT_OK(session->Stage(step.payloads[i]));
  ASSERT_OK(session->Flush(step.id, Generous()));
  ASSERT_OK(session->Commit(step.id));
  CommitTrainer(step);
  ExpectStoreHolds(current_);
}

TEST_F(ReceiverSessionTest, StageAfterFlushOrCommitIsRefused) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const Step step = EncodeStep(1);
  ASSERT_OK(session->Prepare(Request(step)));
  for (const auto& payload : step.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(step.id, Generous()));
  // Sealed: even a retry of a staged payload is refused, like upstream's relay.
  EXPECT_STATUS_MSG(FailedPrecondition, "already flushed", session->Stage(step.payloads[0]));
  ASSERT_OK(session->Commit(step.id));
  EXPECT_STATUS_MSG(FailedPrecondition, "already committed", session->Stage(step.payloads[0]));
  CommitTrainer(step);
  ExpectStoreHolds(current_);
}

TEST_F(ReceiverSessionTest, RefusesPayloadsOfOtherTransfersVersionsAndIds) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const Step step = EncodeStep(1);
  EXPECT_STATUS_MSG(FailedPrecondition, "idle at version 0", session->Stage(step.payloads[0]));
  ASSERT_OK(session->Prepare(Request(step)));

  auto reencode = [&](PayloadIds ids) {
    std::vector<ItemView> views;
    for (const Item& item : step.items[0]) views.push_back(item.view());
    auto bytes = EncodePayload(ids, views);
    EXPECT_TRUE(bytes.ok());
    return std::move(bytes).ValueOrDie();
  };
  PayloadIds other_transfer = step.ids[0];
  other_transfer.transfer_id = TransferId::Random();
  EXPECT_STATUS_MSG(FailedPrecondition, "not the open transfer",
                    session->Stage(reencode(other_transfer)));
  PayloadIds other_versions = step.ids[0];
  other_versions.base_version += 1;
  other_versions.target_version += 1;
  EXPECT_STATUS_MSG(FailedPrecondition, "moves version 1 -> 2",
                    session->Stage(reencode(other_versions)));
  PayloadIds unexpected_id = step.ids[0];
  unexpected_id.payload_id = 99;
  EXPECT_STATUS_MSG(InvalidArgument, "unexpected", session->Stage(reencode(unexpected_id)));
  PayloadIds unexpected_producer = step.ids[0];
  unexpected_producer.producer_id = 7;
  EXPECT_STATUS(InvalidArgument, session->Stage(reencode(unexpected_producer)));
  EXPECT_STATUS(DataLoss, session->Stage(std::vector<std::byte>(kPayloadHeaderSize / 2)));
  std::vector<std::byte> bad_header = step.payloads[0];
  bad_header[kPayloadHeaderSize / 2] ^= std::byte{0x40};
  EXPECT_STATUS(DataLoss, session->Stage(bad_header));

  // None of the refused payloads touched the transfer.
  EXPECT_EQ(session->GetStatus().staged_payloads, 0u);
  for (const auto& payload : step.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(step.id, Generous()));
  ASSERT_OK(session->Commit(step.id));
  CommitTrainer(step);
  ExpectStoreHolds(current_);
}

TEST_F(ReceiverSessionTest, ControlCallsAreFencedByVersionStateAndId) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const Step step = EncodeStep(1);
  const TransferId stranger = TransferId::Random();

  PrepareRequest ahead = Request(step);
  ahead.base_version = step.base_version + 1;
  EXPECT_STATUS_MSG(FailedPrecondition, "receiver is at version 0", session->Prepare(ahead));
  EXPECT_STATUS(FailedPrecondition, session->Flush(step.id, Generous()));
  EXPECT_STATUS(FailedPrecondition, session->Commit(step.id));

  ASSERT_OK(session->Prepare(Request(step)));
  ASSERT_OK_AND_ASSIGN(PrepareResult again, session->Prepare(Request(step)));
  EXPECT_TRUE(again.repeated);
  PrepareRequest changed = Request(step);
  changed.expected.total_payloads = 12345;
  EXPECT_STATUS(InvalidArgument, session->Prepare(changed));  // Contradicts its own counts.
  changed.expected = {};
  EXPECT_STATUS_MSG(FailedPrecondition, "different request", session->Prepare(changed));
  EXPECT_STATUS_MSG(FailedPrecondition, "receiving transfer",
                    session->Prepare(PrepareRequest{stranger, step.base_version, {}}));
  EXPECT_STATUS_MSG(FailedPrecondition, "not flushed", session->Commit(step.id));
  EXPECT_STATUS(FailedPrecondition, session->Commit(stranger));
  EXPECT_STATUS_MSG(FailedPrecondition, "not the open transfer", session->Abort(stranger));
  EXPECT_STATUS(FailedPrecondition, session->Flush(stranger, Generous()));

  for (const auto& payload : step.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK_AND_ASSIGN(FlushReport report, session->Flush(step.id, Generous()));
  ASSERT_OK_AND_ASSIGN(FlushReport repeated, session->Flush(step.id, Generous()));
  EXPECT_EQ(repeated, report);
  ASSERT_OK_AND_ASSIGN(PrepareResult again_prepared, session->Prepare(Request(step)));
  EXPECT_TRUE(again_prepared.repeated);
  ASSERT_OK(session->Commit(step.id));
  ASSERT_OK(session->Commit(step.id));  // A retried Commit.
  EXPECT_EQ(store_->version(), step.target_version);
  EXPECT_STATUS_MSG(FailedPrecondition, "already committed", session->Abort(step.id));
  EXPECT_STATUS_MSG(FailedPrecondition, "needs a new id",
                    session->Prepare(PrepareRequest{step.id, step.target_version, {}}));
  EXPECT_STATUS(FailedPrecondition, session->Flush(step.id, Generous()));
  CommitTrainer(step);
  ExpectStoreHolds(current_);
}

TEST_F(ReceiverSessionTest, PrepareOnTheTargetOfAPreparedTransferImpliesItsCommit) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const Step first = EncodeStep(1);
  ASSERT_OK(session->Prepare(Request(first)));
  for (const auto& payload : first.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(first.id, Generous()));
  CommitTrainer(first);  // The coordinator committed; this receiver's Commit is lost.

  const Step second = EncodeStep(2);
  ASSERT_EQ(second.base_version, first.target_version);
  // A transfer from another version than the prepared transfer's base or target says nothing
  // about its decision. (One from its base aborts it implicitly:
  // lease_receiver_session_test.cc.)
  EXPECT_STATUS(FailedPrecondition, session->Prepare(PrepareRequest{
                                        TransferId::Random(), first.target_version + 1, {}}));
  ASSERT_OK_AND_ASSIGN(PrepareResult prepared, session->Prepare(Request(second)));
  ASSERT_TRUE(prepared.implied_commit.has_value());
  EXPECT_EQ(*prepared.implied_commit, first.id);
  EXPECT_EQ(store_->version(), first.target_version);
  ASSERT_OK(session->Commit(first.id));  // The late Commit is harmless.
  EXPECT_EQ(session->GetStatus().transfer_id, second.id);

  for (const auto& payload : second.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(second.id, Generous()));
  ASSERT_OK(session->Commit(second.id));
  CommitTrainer(second);
  EXPECT_EQ(store_->version(), second.target_version);
  ExpectStoreHolds(current_);
}

// Regression: the status reported the committed version while after_commit was still copying
// it into the engine's memory (a torch mirror), so wait_for_version could return before the
// module held the version.
TEST_F(ReceiverSessionTest, TheVersionIsVisibleOnlyOnceAfterCommitReturned) {
  ReceiverSessionOptions options;
  std::atomic<bool> hook_running{false};
  std::atomic<bool> hook_done{false};
  std::atomic<uint64_t> seen_during_hook{UINT64_MAX};
  internal::ReceiverSession* observed = nullptr;
  options.after_commit = [&](const TransferId&, uint64_t) {
    hook_running = true;
    // Another thread reads the status while the hook still moves bytes.
    std::thread reader([&] { seen_during_hook = observed->GetStatus().version; });
    reader.join();
    std::this_thread::sleep_for(kSettleTime);
    hook_done = true;
  };
  auto session = MakeSession(options);
  ASSERT_NE(session, nullptr);
  observed = session.get();

  // Explicit commit.
  const Step first = EncodeStep(1);
  ASSERT_OK(session->Prepare(Request(first)));
  for (const auto& payload : first.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(first.id, Generous()));
  ASSERT_OK(session->Commit(first.id));
  EXPECT_TRUE(hook_done);
  EXPECT_EQ(seen_during_hook, first.base_version);
  EXPECT_EQ(session->GetStatus().version, first.target_version);
  CommitTrainer(first);

  // Implied commit (the Commit was lost): the same, and a late Commit returns only once the
  // version is visible.
  hook_done = false;
  seen_during_hook = UINT64_MAX;
  const Step second = EncodeStep(2);
  ASSERT_OK(session->Prepare(Request(second)));
  for (const auto& payload : second.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(second.id, Generous()));
  CommitTrainer(second);
  const Step third = EncodeStep(3);
  ASSERT_OK_AND_ASSIGN(PrepareResult prepared, session->Prepare(Request(third)));
  ASSERT_TRUE(prepared.implied_commit.has_value());
  EXPECT_TRUE(hook_done);
  EXPECT_EQ(seen_during_hook, second.base_version);
  EXPECT_EQ(session->GetStatus().version, second.target_version);
  ASSERT_OK(session->Commit(second.id));
}

TEST_F(ReceiverSessionTest, AbortMidTransferRestoresTheBaseBitExactly) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const StoreSnapshot before = TakeSnapshot(*store_);
  const Step step = EncodeStep(1, /*producers=*/2, /*spans=*/2);
  ASSERT_GE(step.payloads.size(), 4u);
  ASSERT_OK(session->Prepare(Request(step)));
  const size_t half = step.payloads.size() / 2;
  for (size_t i = 0; i < half; ++i) ASSERT_OK(session->Stage(step.payloads[i]));
  WaitForApplied(*session, half);
  EXPECT_NE(TakeSnapshot(*store_), before);
  EXPECT_GT(session->GetStatus().undo_bytes, 0u);

  ASSERT_OK(session->Abort(step.id));
  EXPECT_EQ(TakeSnapshot(*store_), before);
  EXPECT_EQ(store_->Digests(), store_->RecomputeDigests());
  const ReceiverStatus status = session->GetStatus();
  EXPECT_EQ(status.state, ReceiverState::kIdle);
  EXPECT_EQ(status.version, step.base_version);
  EXPECT_EQ(status.undo_bytes, 0u);
  ASSERT_OK(session->Abort(step.id));  // A retried Abort.
  EXPECT_STATUS_MSG(FailedPrecondition, "already aborted", session->Stage(step.payloads[half]));
  EXPECT_STATUS_MSG(FailedPrecondition, "needs a new id", session->Prepare(Request(step)));
  EXPECT_STATUS_MSG(FailedPrecondition, "aborted", session->Commit(step.id));
  ASSERT_OK(tracker_->Abort(step.id));

  // The retry, with a new id, re-sends the same changes from the restored base.
  const Step retry = EncodeStep(1, 2, 2);
  ASSERT_EQ(retry.base_version, step.base_version);
  ASSERT_OK(session->Prepare(Request(retry)));
  for (const auto& payload : retry.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(retry.id, Generous()));
  ASSERT_OK(session->Commit(retry.id));
  CommitTrainer(retry);
  ExpectStoreHolds(current_);
}

TEST_F(ReceiverSessionTest, CorruptPayloadFailsTheFlushAndAbortRestores) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const StoreSnapshot before = TakeSnapshot(*store_);
  const Step step = EncodeStep(1);
  ASSERT_GE(step.payloads.size(), 3u);
  const size_t last = step.payloads.size() - 1;
  std::vector<std::byte> corrupt = step.payloads[last];
  corrupt.back() ^= std::byte{0x01};  // In the body: only the body checksum catches it.
  ASSERT_OK(session->Prepare(Request(step)));
  for (size_t i = 0; i < last; ++i) ASSERT_OK(session->Stage(step.payloads[i]));
  // Applied before the corrupt one is staged: otherwise its error could NACK them (by design).
  WaitForApplied(*session, last);
  // ACK means staged: the header is fine, the body is checked on the apply thread.
  ASSERT_OK(session->Stage(corrupt));
  EXPECT_STATUS_MSG(DataLoss, "checksum", session->Flush(step.id, Generous()));
  // The first apply error surfaces at every later Stage too.
  EXPECT_STATUS_MSG(DataLoss, "failed earlier", session->Stage(step.payloads[0]));
  const ReceiverStatus status = session->GetStatus();
  EXPECT_EQ(status.state, ReceiverState::kReceiving);
  EXPECT_EQ(status.last_error.code(), StatusCode::kDataLoss);
  EXPECT_EQ(status.applied_payloads, last);
  EXPECT_NE(TakeSnapshot(*store_), before);

  ASSERT_OK(session->Abort(step.id));
  EXPECT_EQ(TakeSnapshot(*store_), before);
  EXPECT_EQ(session->GetStatus().last_error.code(), StatusCode::kDataLoss);
  ASSERT_OK(tracker_->Abort(step.id));

  const Step retry = EncodeStep(2);
  ASSERT_OK(session->Prepare(Request(retry)));
  EXPECT_OK(session->GetStatus().last_error);
  for (const auto& payload : retry.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(retry.id, Generous()));
  ASSERT_OK(session->Commit(retry.id));
  CommitTrainer(retry);
  ExpectStoreHolds(current_);
}

// Decode threads (the next payloads decoded while this one applies, several at once) change
// when a payload is decoded, never what is applied: with none, one or several, a flushed transfer
// holds the same bits, an abort after the flush restores the base, and a corrupt payload among
// many fails the flush and leaves nothing applied after it.
TEST_F(ReceiverSessionTest, AnyNumberOfDecodeThreadsAppliesTheSameBitsAndRollsBackTheSame) {
  std::optional<StoreSnapshot> flushed_with_other;
  for (const int decode_threads : {0, 1, 3}) {
    SCOPED_TRACE(fmt::format("{} decode threads", decode_threads));
    ReceiverSessionOptions options;
    options.decode_threads = decode_threads;
    options.apply_threads = 2;
    auto session = MakeSession(options);
    ASSERT_NE(session, nullptr);
    const StoreSnapshot before = TakeSnapshot(*store_);
    const Step step = EncodeStep(7, /*producers=*/2, /*spans=*/4);
    ASSERT_GE(step.payloads.size(), 6u);
    ASSERT_OK(session->Prepare(Request(step)));
    for (const auto& payload : step.payloads) ASSERT_OK(session->Stage(payload));
    ASSERT_OK(session->Flush(step.id, Generous()));
    const StoreSnapshot flushed = TakeSnapshot(*store_);
    if (flushed_with_other) {
      EXPECT_EQ(flushed, *flushed_with_other);
    }
    flushed_with_other = flushed;
    ASSERT_OK(session->Abort(step.id));
    EXPECT_EQ(TakeSnapshot(*store_), before);
    ASSERT_OK(tracker_->Abort(step.id));

    const Step corrupt_step = EncodeStep(8, 2, 4);
    const size_t middle = corrupt_step.payloads.size() / 2;
    ASSERT_OK(session->Prepare(Request(corrupt_step)));
    for (size_t i = 0; i < corrupt_step.payloads.size(); ++i) {
      std::vector<std::byte> payload = corrupt_step.payloads[i];
      if (i == middle) payload.back() ^= std::byte{0x01};
      // Stage may refuse payloads after the corrupt one once its error is known.
      (void)session->Stage(std::move(payload));
    }
    EXPECT_STATUS_MSG(DataLoss, "checksum", session->Flush(corrupt_step.id, Generous()));
    EXPECT_LE(session->GetStatus().applied_payloads, middle);
    ASSERT_OK(session->Abort(corrupt_step.id));
    EXPECT_EQ(TakeSnapshot(*store_), before);
    ASSERT_OK(tracker_->Abort(corrupt_step.id));
  }
}

TEST_F(ReceiverSessionTest, FlushTimesOutNamingTheMissingPayloadAndStaysOpen) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const Step step = EncodeStep(1);
  ASSERT_OK(session->Prepare(Request(step)));
  const size_t last = step.payloads.size() - 1;
  for (size_t i = 0; i < last; ++i) ASSERT_OK(session->Stage(step.payloads[i]));
  FlushOptions flush;
  flush.timeout = kShortTimeout;
  const std::string missing =
      fmt::format("1 of {} expected payloads missing (producer {} payload {})",
                  step.payloads.size(), step.ids[last].producer_id, step.ids[last].payload_id);
  EXPECT_STATUS_MSG(DeadlineExceeded, missing, session->Flush(step.id, flush));
  EXPECT_FALSE(session->GetStatus().sealed);
  EXPECT_EQ(session->GetStatus().last_error.code(), StatusCode::kDeadlineExceeded);

  // Not sealed: the late payload is accepted and a second Flush succeeds.
  ASSERT_OK(session->Stage(step.payloads[last]));
  ASSERT_OK(session->Flush(step.id, Generous()));
  ASSERT_OK(session->Commit(step.id));
  CommitTrainer(step);
  ExpectStoreHolds(current_);
}

TEST_F(ReceiverSessionTest, ExpectationsMayComeAtFlush) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const Step step = EncodeStep(1);
  // Prepare before the producers streamed: counts and digests are not known yet.
  ASSERT_OK(session->Prepare(PrepareRequest{step.id, step.base_version, {}}));
  const size_t last = step.payloads.size() - 1;
  for (size_t i = 0; i < last; ++i) ASSERT_OK(session->Stage(step.payloads[i]));
  EXPECT_STATUS_MSG(FailedPrecondition, "no expected payload count",
                    session->Flush(step.id, Generous()));

  FlushOptions total;
  total.timeout = kShortTimeout;
  total.expected.total_payloads = step.payloads.size();
  EXPECT_STATUS_MSG(DeadlineExceeded,
                    fmt::format("{} of {} expected payloads staged", last, step.payloads.size()),
                    session->Flush(step.id, total));
  FlushOptions contradicting = total;
  contradicting.expected.total_payloads = step.payloads.size() + 1;
  EXPECT_STATUS_MSG(InvalidArgument, "differs", session->Flush(step.id, contradicting));

  ASSERT_OK(session->Stage(step.payloads[last]));
  total.timeout = kGenerousTimeout;
  total.expected.digests = step.expected.digests;
  ASSERT_OK_AND_ASSIGN(FlushReport report, session->Flush(step.id, total));
  EXPECT_EQ(report.payloads, step.payloads.size());
  ASSERT_OK(session->Commit(step.id));
  CommitTrainer(step);
  ExpectStoreHolds(current_);
}

TEST_F(ReceiverSessionTest, UnexpectedPayloadStagedBeforeTheCountFailsTheFlush) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const Step step = EncodeStep(1);
  ASSERT_OK(session->Prepare(PrepareRequest{step.id, step.base_version, {}}));
  for (const auto& payload : step.payloads) ASSERT_OK(session->Stage(payload));
  FlushOptions fewer = Generous();
  fewer.expected.payloads_per_producer = step.expected.payloads_per_producer;
  const uint32_t producer = step.ids.back().producer_id;
  --fewer.expected.payloads_per_producer[producer];
  EXPECT_STATUS_MSG(InvalidArgument, "was staged but is not expected",
                    session->Flush(step.id, fewer));
  FlushOptions fewer_total = Generous();
  fewer_total.expected.total_payloads = step.payloads.size() - 1;
  EXPECT_STATUS_MSG(InvalidArgument, "expected", session->Flush(step.id, fewer_total));
  ASSERT_OK(session->Abort(step.id));
}

TEST_F(ReceiverSessionTest, ConcurrentStageFromFourThreads) {
  constexpr uint32_t kProducers = 4;
  ReceiverSessionOptions options;
  options.apply_queue_depth = 2;  // Small, so stagers also block on back-pressure.
  auto session = MakeSession(options);
  ASSERT_NE(session, nullptr);

  // Round 1: each thread sends its producer's payloads, then retries its neighbour's, so every
  // key arrives from two threads at once and exactly one copy may be accepted.
  const Step first = EncodeStep(1, kProducers, /*spans=*/4);
  ASSERT_GE(first.payloads.size(), 16u);
  ASSERT_OK(session->Prepare(Request(first)));
  std::atomic<uint64_t> accepted{0};
  std::atomic<uint64_t> duplicates{0};
  std::atomic<uint64_t> failures{0};
  {
    std::vector<std::jthread> stagers;
    for (uint32_t p = 0; p < kProducers; ++p) {
      stagers.emplace_back([&, p] {
        for (uint32_t owner : {p, (p + 1) % kProducers}) {
          for (size_t i = 0; i < first.payloads.size(); ++i) {
            if (first.ids[i].producer_id != owner) continue;
            auto result = session->Stage(first.payloads[i]);
            if (!result.ok()) {
              ++failures;
            } else if (*result == StageResult::kAccepted) {
              ++accepted;
            } else {
              ++duplicates;
            }
          }
        }
      });
    }
  }
  EXPECT_EQ(failures.load(), 0u);
  EXPECT_EQ(accepted.load(), first.payloads.size());
  EXPECT_EQ(duplicates.load(), first.payloads.size());
  ASSERT_OK_AND_ASSIGN(FlushReport report, session->Flush(first.id, Generous()));
  EXPECT_EQ(report.payloads, first.payloads.size());
  EXPECT_EQ(report.duplicates, first.payloads.size());
  EXPECT_EQ(report.digests, first.expected.digests);
  ASSERT_OK(session->Commit(first.id));
  CommitTrainer(first);
  ExpectStoreHolds(current_);

  // Round 2: Flush runs while the four threads stage, and waits for them.
  const Step second = EncodeStep(2, kProducers, /*spans=*/4);
  ASSERT_OK(session->Prepare(Request(second)));
  failures = 0;
  {
    std::vector<std::jthread> stagers;
    for (uint32_t p = 0; p < kProducers; ++p) {
      stagers.emplace_back([&, p] {
        for (size_t i = 0; i < second.payloads.size(); ++i) {
          if (second.ids[i].producer_id == p && !session->Stage(second.payloads[i]).ok()) {
            ++failures;
          }
        }
      });
    }
    ASSERT_OK_AND_ASSIGN(FlushReport flushed, session->Flush(second.id, Generous()));
    EXPECT_EQ(flushed.payloads, second.payloads.size());
  }
  EXPECT_EQ(failures.load(), 0u);
  ASSERT_OK(session->Commit(second.id));
  CommitTrainer(second);
  ExpectStoreHolds(current_);
}

TEST_F(ReceiverSessionTest, ExpectedDigestMismatchFailsTheFlushAndAbortRestores) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const StoreSnapshot before = TakeSnapshot(*store_);
  const Step step = EncodeStep(1);
  PrepareRequest request = Request(step);
  const std::string victim = "model.layers.0.mlp.up.weight";
  ASSERT_TRUE(request.expected.digests.contains(victim));
  request.expected.digests[victim] += 1;
  ASSERT_OK(session->Prepare(request));
  for (const auto& payload : step.payloads) ASSERT_OK(session->Stage(payload));
  EXPECT_STATUS_MSG(DataLoss, victim, session->Flush(step.id, Generous()));
  const ReceiverStatus status = session->GetStatus();
  EXPECT_EQ(status.state, ReceiverState::kReceiving);
  EXPECT_TRUE(status.sealed);
  EXPECT_STATUS_MSG(FailedPrecondition, "already flushed", session->Stage(step.payloads[0]));
  EXPECT_STATUS(FailedPrecondition, session->Commit(step.id));
  ASSERT_OK(session->Abort(step.id));
  EXPECT_EQ(TakeSnapshot(*store_), before);
  ASSERT_OK(tracker_->Abort(step.id));

  // A digest for a tensor the receiver does not hold is refused already at Prepare.
  const Step retry = EncodeStep(2);
  PrepareRequest unknown = Request(retry);
  unknown.expected.digests["model.not.here"] = 7;
  EXPECT_STATUS_MSG(NotFound, "model.not.here", session->Prepare(unknown));
  EXPECT_EQ(session->GetStatus().state, ReceiverState::kIdle);
  EXPECT_EQ(TakeSnapshot(*store_), before);
}

/// A gate the apply thread waits at before each payload, so a test controls when it drains.
class ApplyGate {
 public:
  void Wait() {
    std::unique_lock lock(mutex_);
    ++entered_;
    changed_.notify_all();
    changed_.wait(lock, [this] { return open_; });
  }
  void WaitUntilEntered(int count) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return entered_ >= count; });
  }
  void Open() {
    std::lock_guard lock(mutex_);
    open_ = true;
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int entered_ = 0;
  bool open_ = false;
};

// Opens its gate when it goes out of scope. Declared after the session, it opens the gate before
// the session is destroyed, even when an ASSERT returns early: the apply thread would otherwise
// wait at the gate forever.
class GateOpener {
 public:
  explicit GateOpener(ApplyGate& gate) : gate_(gate) {}
  ~GateOpener() { gate_.Open(); }
  GateOpener(const GateOpener&) = delete;
  GateOpener& operator=(const GateOpener&) = delete;

 private:
  ApplyGate& gate_;
};

// A payload arrives validated under its listener's limits; the session checks the header's
// sizes against its own (tighter here) before queueing it, and the transfer goes on.
TEST_F(ReceiverSessionTest, AValidatedPayloadOverTheSessionsLimitsIsRefusedByName) {
  const Step step = EncodeStep(1, 2, 2);
  ASSERT_OK_AND_ASSIGN(ValidatedPayload largest, ValidatePayload(step.payloads[0]));
  for (const std::vector<std::byte>& bytes : step.payloads) {
    ASSERT_OK_AND_ASSIGN(ValidatedPayload payload, ValidatePayload(bytes));
    if (payload.size() > largest.size()) largest = std::move(payload);
  }
  ReceiverSessionOptions options;
  options.limits.max_payload_bytes = largest.size() - 1;
  auto session = MakeSession(options);
  ASSERT_NE(session, nullptr);
  ASSERT_OK(session->Prepare(Request(step)));
  const std::string named =
      fmt::format("payload {} of producer {}", largest.ids().payload_id, largest.ids().producer_id);
  EXPECT_STATUS_MSG(ResourceExhausted, named, session->Stage(std::move(largest)));
  EXPECT_EQ(session->GetStatus().received_payloads, 0u);
}

TEST_F(ReceiverSessionTest, FullApplyQueueBlocksStageAndFailsTryStage) {
  constexpr size_t kDepth = 2;
  ApplyGate gate;
  ReceiverSessionOptions options;
  options.apply_queue_depth = kDepth;
  options.before_apply = [&](const PayloadIds&) { gate.Wait(); };
  auto session = MakeSession(options);
  ASSERT_NE(session, nullptr);
  const GateOpener opener(gate);
  const Step step = EncodeStep(1, 2, 2);
  ASSERT_GE(step.payloads.size(), kDepth + 3);
  ASSERT_OK(session->Prepare(Request(step)));

  // Payload 0 is taken by the apply thread, which then waits at the gate; 1 and 2 fill the queue.
  ASSERT_OK(session->Stage(step.payloads[0]));
  gate.WaitUntilEntered(1);
  ASSERT_OK(session->Stage(step.payloads[1]));
  ASSERT_OK(session->Stage(step.payloads[2]));
  EXPECT_EQ(session->GetStatus().queued_payloads, kDepth);

  ASSERT_OK_AND_ASSIGN(ValidatedPayload refused, ValidatePayload(step.payloads[3]));
  EXPECT_STATUS_MSG(ResourceExhausted, "apply queue is full (2 payload(s)",
                    session->TryStage(refused));
  EXPECT_STATUS_MSG(ResourceExhausted, "depth 2", session->TryStage(refused));
  // Untouched, so the caller can retry it.
  EXPECT_TRUE(std::ranges::equal(refused.bytes(), step.payloads[3]));
  ASSERT_OK_AND_ASSIGN(ValidatedPayload duplicate, ValidatePayload(step.payloads[1]));
  ASSERT_OK_AND_ASSIGN(StageResult dedupe, session->TryStage(duplicate));
  EXPECT_EQ(dedupe, StageResult::kDuplicate);  // Dedupe needs no room.

  std::atomic<bool> returned{false};
  Result<StageResult> blocked_result = Status(StatusCode::kInternal, "not run");
  std::jthread blocked([&] {
    blocked_result = session->Stage(step.payloads[3]);
    returned = true;
  });
  std::stop_source cancel;
  Result<StageResult> cancelled_result = Status(StatusCode::kInternal, "not run");
  std::jthread cancelled(
      [&] { cancelled_result = session->Stage(step.payloads[4], cancel.get_token()); });
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_FALSE(returned.load());
  cancel.request_stop();
  cancelled.join();
  EXPECT_STATUS(Cancelled, cancelled_result);

  gate.Open();
  blocked.join();
  ASSERT_OK_AND_ASSIGN(StageResult late, blocked_result);
  EXPECT_EQ(late, StageResult::kAccepted);
  for (size_t i = 4; i < step.payloads.size(); ++i) ASSERT_OK(session->Stage(step.payloads[i]));
  ASSERT_OK(session->Flush(step.id, Generous()));
  ASSERT_OK(session->Commit(step.id));
  CommitTrainer(step);
  ExpectStoreHolds(current_);
}

// The queue's byte bound: a payload waits while the queued ones hold apply_queue_bytes, though
// the depth has room; an empty queue takes any payload, however large.
TEST_F(ReceiverSessionTest, TheApplyQueuesByteBoundBlocksStageButAnEmptyQueueTakesAnyPayload) {
  ApplyGate gate;
  ReceiverSessionOptions options;
  options.apply_queue_depth = 8;
  options.apply_queue_bytes = 1;  // Less than any payload: one queued at a time.
  options.before_apply = [&](const PayloadIds&) { gate.Wait(); };
  auto session = MakeSession(options);
  ASSERT_NE(session, nullptr);
  const GateOpener opener(gate);
  const Step step = EncodeStep(1, 2, 2);
  ASSERT_GE(step.payloads.size(), 4u);
  ASSERT_OK(session->Prepare(Request(step)));
  ASSERT_OK(session->Stage(step.payloads[0]));  // taken by the apply thread, held at the gate
  gate.WaitUntilEntered(1);
  ASSERT_OK(session->Stage(step.payloads[1]));  // the queue was empty: larger than the bound
  EXPECT_EQ(session->GetStatus().queued_payloads, 1u);
  ASSERT_OK_AND_ASSIGN(ValidatedPayload refused, ValidatePayload(step.payloads[2]));
  EXPECT_STATUS_MSG(ResourceExhausted, "1 bytes)", session->TryStage(refused));
  EXPECT_STATUS_MSG(ResourceExhausted,
                    fmt::format("1 payload(s) of {} bytes", step.payloads[1].size()),
                    session->TryStage(refused));
  std::atomic<bool> returned{false};
  Result<StageResult> blocked_result = Status(StatusCode::kInternal, "not run");
  std::jthread blocked([&] {
    blocked_result = session->Stage(step.payloads[2]);
    returned = true;
  });
  std::this_thread::sleep_for(kSettleTime);
  EXPECT_FALSE(returned.load()) << "waits for the bytes ahead of it, not for the depth";
  gate.Open();
  blocked.join();
  ASSERT_OK(blocked_result.status());
  for (size_t i = 3; i < step.payloads.size(); ++i) ASSERT_OK(session->Stage(step.payloads[i]));
  ASSERT_OK(session->Flush(step.id, Generous()));
  ASSERT_OK(session->Commit(step.id));
  CommitTrainer(step);
  ExpectStoreHolds(current_);
}

TEST_F(ReceiverSessionTest, PayloadsQueuedBehindAnApplyErrorAreNotApplied) {
  ApplyGate gate;
  ReceiverSessionOptions options;
  options.before_apply = [&](const PayloadIds&) { gate.Wait(); };
  auto session = MakeSession(options);
  ASSERT_NE(session, nullptr);
  const GateOpener opener(gate);
  const StoreSnapshot before = TakeSnapshot(*store_);
  const Step step = EncodeStep(1);
  std::vector<std::byte> corrupt = step.payloads[0];
  corrupt.back() ^= std::byte{0x01};
  ASSERT_OK(session->Prepare(Request(step)));
  ASSERT_OK(session->Stage(corrupt));
  gate.WaitUntilEntered(1);
  // Queued while the corrupt payload is at the gate: ACKed, since its error is not known yet.
  for (size_t i = 1; i < step.payloads.size(); ++i) ASSERT_OK(session->Stage(step.payloads[i]));
  gate.Open();
  EXPECT_STATUS_MSG(DataLoss, "checksum", session->Flush(step.id, Generous()));
  EXPECT_EQ(session->GetStatus().applied_payloads, 0u);
  EXPECT_EQ(session->GetStatus().queued_payloads, 0u);
  EXPECT_EQ(TakeSnapshot(*store_), before);  // Nothing applied, even before the Abort.
  ASSERT_OK(session->Abort(step.id));
  EXPECT_EQ(TakeSnapshot(*store_), before);
}

TEST_F(ReceiverSessionTest, AbortEndsAWaitingFlush) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const StoreSnapshot before = TakeSnapshot(*store_);
  const Step step = EncodeStep(1);
  ASSERT_OK(session->Prepare(Request(step)));
  ASSERT_OK(session->Stage(step.payloads[0]));
  Result<FlushReport> flushed = Status(StatusCode::kInternal, "not run");
  std::jthread flusher([&] { flushed = session->Flush(step.id, Generous()); });
  std::this_thread::sleep_for(kSettleTime);
  ASSERT_OK(session->Abort(step.id));
  flusher.join();
  // Cancelled if the Flush was waiting (the usual case), FailedPrecondition if the Abort came
  // first; never a 60 s DeadlineExceeded.
  EXPECT_TRUE(flushed.status().code() == StatusCode::kCancelled ||
              flushed.status().code() == StatusCode::kFailedPrecondition)
      << flushed.status().ToString();
  EXPECT_EQ(TakeSnapshot(*store_), before);
}

TEST_F(ReceiverSessionTest, DestroyingTheSessionRollsBackAnOpenTransfer) {
  const StoreSnapshot before = TakeSnapshot(*store_);
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const Step step = EncodeStep(1);
  ASSERT_OK(session->Prepare(Request(step)));
  for (const auto& payload : step.payloads) ASSERT_OK(session->Stage(payload));
  WaitForApplied(*session, step.payloads.size());
  EXPECT_NE(TakeSnapshot(*store_), before);
  session.reset();
  EXPECT_EQ(TakeSnapshot(*store_), before);
}

TEST_F(ReceiverSessionTest, EmptyTransferCommits) {
  auto session = MakeSession();
  ASSERT_NE(session, nullptr);
  const StoreSnapshot before = TakeSnapshot(*store_);
  const TransferId id = TransferId::Random();
  TransferExpectation nothing;
  nothing.total_payloads = 0;
  ASSERT_OK(session->Prepare(PrepareRequest{id, 0, nothing}));
  ASSERT_OK_AND_ASSIGN(FlushReport report, session->Flush(id, Generous()));
  EXPECT_EQ(report.payloads, 0u);
  EXPECT_EQ(report.digests, before.digests);
  ASSERT_OK(session->Commit(id));
  EXPECT_EQ(store_->version(), 1u);
}

TEST_F(ReceiverSessionTest, AbortOfAnUnpreparedTransferRefusesItLater) {
  ReceiverSessionOptions options;
  options.remembered_transfers = 2;
  auto session = MakeSession(options);
  ASSERT_NE(session, nullptr);
  const TransferId lost = TransferId::Random();
  ASSERT_OK(session->Abort(lost));  // Its Prepare never arrived here.
  EXPECT_STATUS_MSG(FailedPrecondition, "already aborted",
                    session->Prepare(PrepareRequest{lost, 0, {}}));
  // Only the newest `remembered_transfers` ids are kept.
  ASSERT_OK(session->Abort(TransferId::Random()));
  ASSERT_OK(session->Abort(TransferId::Random()));
  ASSERT_OK(session->Prepare(PrepareRequest{lost, 0, {}}));
  ASSERT_OK(session->Abort(lost));
}

}  // namespace
}  // namespace refit
