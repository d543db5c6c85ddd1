// Transfer leases and implied decisions of ReceiverSession (docs/protocol.md, "Leases and
// implied decisions"): a receiving transfer whose producer died is rolled back by the session
// itself; a prepared one waits for its decision, which the next transfer's Prepare implies.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "codec/tracker.h"
#include "receiver/receiver_session.h"
#include "test_data.h"
#include "test_util.h"
#include "trainer_step.h"

namespace refit {
namespace {

using Step = testing::TrainerStep;
using testing::EncodeTrainerStep;
using testing::RandomTensor;

// A lease short enough that a test waits for it in well under a second, long enough that the
// steps a test takes in a row (stage, wait for apply) never outlast it on a loaded 2-core
// machine.
constexpr auto kShortLease = std::chrono::milliseconds(300);
// How long a test waits for something that must happen (a lease to expire): far above the
// lease, so only a session that never expires the lease reaches it.
constexpr auto kGenerousWait = std::chrono::seconds(30);
constexpr double kDensity = 0.05;

class LeaseReceiverSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make({}));
    store_ = WeightStore::Make();
    original_ = {RandomTensor("model.embed.weight", DType::kBFloat16, {64, 33}, 1),
                 RandomTensor("model.layers.0.mlp.up.weight", DType::kFloat32, {31, 29}, 2),
                 RandomTensor("model.norm.weight", DType::kBFloat16, {257}, 3)};
    for (const OwnedTensor& t : original_) {
      ASSERT_OK(store_->AddCopy(t.view()));
      ASSERT_OK(tracker_->AdoptBaseline(t.view()));
    }
  }

  std::unique_ptr<internal::ReceiverSession> MakeSession(
      std::chrono::milliseconds lease,
      std::chrono::milliseconds preempt_after = ReceiverSessionOptions{}.preempt_after) {
    ReceiverSessionOptions options;
    options.transfer_lease = lease;
    options.preempt_after = preempt_after;
    auto session = internal::ReceiverSession::Make(options, *store_);
    EXPECT_TRUE(session.ok()) << session.status().ToString();
    return session.ok() ? std::move(session).ValueOrDie() : nullptr;
  }

  // One producer, `spans` payloads per tensor.
  Step EncodeStep(uint64_t seed, uint64_t spans = 1) {
    return EncodeTrainerStep(*tracker_, original_, seed, kDensity, /*producers=*/1, spans);
  }

  static FlushOptions Generous() {
    FlushOptions options;
    options.timeout = kGenerousWait;
    return options;
  }

  static PrepareRequest Request(const Step& step) {
    return PrepareRequest{step.id, step.base_version, step.expected};
  }

  void ExpectStoreHolds(const std::vector<OwnedTensor>& tensors) {
    for (const OwnedTensor& t : tensors) {
      ASSERT_OK_AND_ASSIGN(TensorView got, std::as_const(*store_).Find(t.name));
      EXPECT_TRUE(std::equal(got.bytes.begin(), got.bytes.end(), t.bytes.begin(), t.bytes.end()))
          << t.name;
    }
    EXPECT_EQ(store_->Digests(), store_->RecomputeDigests());
  }

  static bool WaitForState(const internal::ReceiverSession& session, ReceiverState state) {
    const auto deadline = std::chrono::steady_clock::now() + kGenerousWait;
    while (session.GetStatus().state != state) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
  }

  static void WaitForApplied(const internal::ReceiverSession& session, uint64_t count) {
    const auto deadline = std::chrono::steady_clock::now() + kGenerousWait;
    while (session.GetStatus().applied_payloads < count &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ(session.GetStatus().applied_payloads, count);
  }

  std::unique_ptr<internal::DeltaTracker> tracker_;
  std::unique_ptr<WeightStore> store_;
  std::vector<OwnedTensor> original_;
};

TEST_F(LeaseReceiverSessionTest, AReceivingTransferWithoutProgressIsRolledBackWhenItsLeaseEnds) {
  auto session = MakeSession(kShortLease);
  Step step = EncodeStep(1, /*spans=*/2);
  ASSERT_GE(step.payloads.size(), 2u);
  ASSERT_OK(session->Prepare(Request(step)));
  // The producer sends half its payloads and dies (kill -9): nobody ever aborts the transfer.
  const size_t sent = step.payloads.size() / 2;
  for (size_t i = 0; i < sent; ++i) ASSERT_OK(session->Stage(step.payloads[i]));
  WaitForApplied(*session, sent);
  ASSERT_TRUE(session->GetStatus().lease_remaining_ms.has_value());

  ASSERT_TRUE(WaitForState(*session, ReceiverState::kIdle)) << "the lease never expired";
  const ReceiverStatus status = session->GetStatus();
  EXPECT_EQ(status.version, step.base_version);
  EXPECT_EQ(status.expired_leases, 1u);
  EXPECT_FALSE(status.lease_remaining_ms.has_value());
  EXPECT_EQ(status.last_error.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(status.last_error.message().find(step.id.ToHex()), std::string::npos)
      << status.last_error.ToString();
  ExpectStoreHolds(original_);
  // The dead producer's late payloads and a replayed prepare are refused: it was aborted.
  EXPECT_STATUS(FailedPrecondition, session->Stage(step.payloads[sent]));
  EXPECT_STATUS(FailedPrecondition, session->Prepare(Request(step)));

  // The next push (a new id from the same base) goes through.
  ASSERT_OK(tracker_->Abort(step.id));
  Step retry = EncodeStep(2);
  ASSERT_OK(session->Prepare(Request(retry)));
  for (const auto& payload : retry.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(retry.id, Generous()));
  ASSERT_OK(session->Commit(retry.id));
  ExpectStoreHolds(retry.next);
  EXPECT_EQ(session->GetStatus().version, retry.target_version);
}

TEST_F(LeaseReceiverSessionTest, AFlushWaitingForPayloadsThatNeverComeEndsWithTheLease) {
  auto session = MakeSession(kShortLease);
  Step step = EncodeStep(3, /*spans=*/2);
  ASSERT_OK(session->Prepare(Request(step)));
  ASSERT_OK(session->Stage(step.payloads.front()));
  // The coordinator's flush is in flight when it dies: the flush must not hold the lease open
  // for its whole timeout.
  FlushOptions flush;
  flush.expected = step.expected;
  flush.timeout = kGenerousWait;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_STATUS(Cancelled, session->Flush(step.id, flush));
  EXPECT_LT(std::chrono::steady_clock::now() - start, kGenerousWait / 2);
  EXPECT_EQ(session->GetStatus().state, ReceiverState::kIdle);
  EXPECT_EQ(session->GetStatus().expired_leases, 1u);
  ExpectStoreHolds(original_);
}

TEST_F(LeaseReceiverSessionTest, PayloadsArrivingWithinTheLeaseKeepTheTransferOpen) {
  auto session = MakeSession(kShortLease);
  Step step = EncodeStep(4, /*spans=*/6);
  ASSERT_GE(step.payloads.size(), 6u);
  ASSERT_OK(session->Prepare(Request(step)));
  // Each gap is a third of the lease, and together they outlast it several times over.
  for (const auto& payload : step.payloads) {
    std::this_thread::sleep_for(kShortLease / 3);
    ASSERT_OK(session->Stage(payload));
  }
  ASSERT_OK(session->Flush(step.id, Generous()));
  ASSERT_OK(session->Commit(step.id));
  EXPECT_EQ(session->GetStatus().expired_leases, 0u);
  ExpectStoreHolds(step.next);
}

TEST_F(LeaseReceiverSessionTest, APreparedTransferWaitsForItsDecisionPastTheLease) {
  auto session = MakeSession(std::chrono::milliseconds(50));
  Step step = EncodeStep(5);
  ASSERT_OK(session->Prepare(Request(step)));
  for (const auto& payload : step.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(step.id, Generous()));
  // It may be committed on other receivers already: no lease may roll it back.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ReceiverStatus status = session->GetStatus();
  EXPECT_EQ(status.state, ReceiverState::kPrepared);
  EXPECT_EQ(status.expired_leases, 0u);
  ASSERT_OK(session->Commit(step.id));
  ExpectStoreHolds(step.next);
}

TEST_F(LeaseReceiverSessionTest, ZeroMeansNoLease) {
  auto session = MakeSession(std::chrono::milliseconds(0));
  Step step = EncodeStep(6);
  ASSERT_OK(session->Prepare(Request(step)));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const ReceiverStatus status = session->GetStatus();
  EXPECT_EQ(status.state, ReceiverState::kReceiving);
  EXPECT_FALSE(status.lease_remaining_ms.has_value());
  ASSERT_OK(session->Abort(step.id));
}

TEST_F(LeaseReceiverSessionTest, ANegativeLeaseIsRefused) {
  ReceiverSessionOptions options;
  options.transfer_lease = std::chrono::milliseconds(-1);
  EXPECT_STATUS(InvalidArgument, internal::ReceiverSession::Make(options, *store_));
}

TEST_F(LeaseReceiverSessionTest, APrepareFromTheBaseOfAPreparedTransferAbortsItImplicitly) {
  auto session = MakeSession(kShortLease);
  Step abandoned = EncodeStep(7);
  ASSERT_OK(session->Prepare(Request(abandoned)));
  for (const auto& payload : abandoned.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(abandoned.id, Generous()));
  // Its coordinator died before deciding; a restarted one starts again from the same base.
  ASSERT_OK(tracker_->Abort(abandoned.id));
  Step next = EncodeStep(8);
  ASSERT_EQ(next.base_version, abandoned.base_version);
  ASSERT_OK_AND_ASSIGN(const PrepareResult prepared, session->Prepare(Request(next)));
  ASSERT_TRUE(prepared.implied_abort.has_value());
  EXPECT_EQ(*prepared.implied_abort, abandoned.id);
  EXPECT_FALSE(prepared.implied_commit.has_value());
  ExpectStoreHolds(original_);
  EXPECT_STATUS(FailedPrecondition, session->Commit(abandoned.id));

  for (const auto& payload : next.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(next.id, Generous()));
  ASSERT_OK(session->Commit(next.id));
  ExpectStoreHolds(next.next);
  EXPECT_EQ(session->GetStatus().version, next.target_version);
}

TEST_F(LeaseReceiverSessionTest, APrepareFromTheTargetOfAPreparedTransferCommitsItImplicitly) {
  auto session = MakeSession(kShortLease);
  Step decided = EncodeStep(9);
  ASSERT_OK(session->Prepare(Request(decided)));
  for (const auto& payload : decided.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(decided.id, Generous()));
  ASSERT_OK(tracker_->Commit(decided.id));  // The coordinator decided; this Commit was lost.
  PrepareRequest anchor{TransferId::Random(), decided.target_version, {}};
  anchor.anchor = true;
  ASSERT_OK_AND_ASSIGN(const PrepareResult prepared, session->Prepare(anchor));
  ASSERT_TRUE(prepared.implied_commit.has_value());
  EXPECT_EQ(*prepared.implied_commit, decided.id);
  EXPECT_FALSE(prepared.implied_abort.has_value());
  ExpectStoreHolds(decided.next);
  ASSERT_OK(session->Abort(anchor.transfer_id));
  EXPECT_EQ(session->GetStatus().version, decided.target_version);
}

TEST_F(LeaseReceiverSessionTest, APreparedTransferRefusesAPrepareFromAnyOtherVersion) {
  auto session = MakeSession(kShortLease);
  Step step = EncodeStep(10);
  ASSERT_OK(session->Prepare(Request(step)));
  for (const auto& payload : step.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(step.id, Generous()));
  PrepareRequest stranger{TransferId::Random(), step.target_version + 5, {}};
  stranger.anchor = true;  // Even an anchor: it says nothing about how this transfer ended.
  const Result<PrepareResult> refused = session->Prepare(stranger);
  EXPECT_STATUS(FailedPrecondition, refused);
  const std::string message(refused.status().message());
  EXPECT_NE(message.find(step.id.ToHex()), std::string::npos) << message;
  EXPECT_NE(message.find("is neither"), std::string::npos) << message;
  EXPECT_EQ(session->GetStatus().state, ReceiverState::kPrepared);
  ASSERT_OK(session->Commit(step.id));
  ExpectStoreHolds(step.next);
}

TEST_F(LeaseReceiverSessionTest, AReceivingTransferRefusesAnotherNamingWhenItsLeaseEnds) {
  auto session = MakeSession(std::chrono::seconds(60));
  Step step = EncodeStep(11);
  ASSERT_OK(session->Prepare(Request(step)));
  const Result<PrepareResult> refused =
      session->Prepare(PrepareRequest{TransferId::Random(), step.base_version, {}});
  EXPECT_STATUS(FailedPrecondition, refused);
  const std::string message(refused.status().message());
  EXPECT_NE(message.find(step.id.ToHex()), std::string::npos) << message;
  EXPECT_NE(message.find("lease expires in"), std::string::npos) << message;
  EXPECT_EQ(session->GetStatus().state, ReceiverState::kReceiving);
  ASSERT_OK(session->Abort(step.id));
  ExpectStoreHolds(original_);
}

// Issue 45: a coordinator that died between its prepare and its first payload blocked the next
// one for the whole lease (300 s by default). A receiving transfer that has been quiet for
// preempt_after is rolled back by a prepare from its base, with the payloads it applied.
TEST_F(LeaseReceiverSessionTest, AQuietReceivingTransferIsPreemptedByTheNextCoordinator) {
  auto session = MakeSession(std::chrono::minutes(5), /*preempt_after=*/kShortLease);
  Step abandoned = EncodeStep(21, /*spans=*/2);
  ASSERT_OK(session->Prepare(Request(abandoned)));
  ASSERT_OK(session->Stage(abandoned.payloads.front()));  // Its coordinator dies mid-stream.
  WaitForApplied(*session, 1);
  // Live (progress within preempt_after): refused.
  EXPECT_STATUS_MSG(
      FailedPrecondition, "once it has been quiet for",
      session->Prepare(PrepareRequest{TransferId::Random(), abandoned.base_version, {}}));
  std::this_thread::sleep_for(kShortLease + std::chrono::milliseconds(50));
  // A restarted coordinator starts again from the same base.
  ASSERT_OK(tracker_->Abort(abandoned.id));
  Step next = EncodeStep(22);
  ASSERT_EQ(next.base_version, abandoned.base_version);
  ASSERT_OK_AND_ASSIGN(const PrepareResult prepared, session->Prepare(Request(next)));
  ASSERT_TRUE(prepared.implied_abort.has_value());
  EXPECT_EQ(*prepared.implied_abort, abandoned.id);
  // The abandoned transfer's payload was rolled back: the next one applies on the base.
  EXPECT_STATUS(FailedPrecondition, session->Stage(abandoned.payloads.back()));
  for (const auto& payload : next.payloads) ASSERT_OK(session->Stage(payload));
  ASSERT_OK(session->Flush(next.id, Generous()));
  ASSERT_OK(session->Commit(next.id));
  ExpectStoreHolds(next.next);
}

TEST_F(LeaseReceiverSessionTest, TheDefaultPreemptionLetsTheNextCoordinatorInWithinSeconds) {
  EXPECT_GT(ReceiverSessionOptions{}.preempt_after.count(), 0);
  EXPECT_LE(ReceiverSessionOptions{}.preempt_after, std::chrono::seconds(30));
  ReceiverSessionOptions options;
  options.preempt_after = std::chrono::milliseconds(-1);
  EXPECT_STATUS_MSG(InvalidArgument, "preempt_after -1 ms is negative",
                    internal::ReceiverSession::Make(options, *store_));
}

}  // namespace
}  // namespace refit
