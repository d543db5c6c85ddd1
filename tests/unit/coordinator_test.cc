// Coordinator: the two-phase commit over an in-process fleet (inproc:// transport, receivers
// driven directly). The same protocol over real sockets is tests/integration/fleet_test.cc.
#include "pipeline/coordinator.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "fleet.h"
#include "refit/status_format.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::Fleet;
using testing::FleetOptions;
using testing::StoreSnapshot;

FleetOptions InprocOptions(const std::string& hub, size_t receivers = 3, uint32_t producers = 2) {
  return FleetOptions{.receivers = receivers,
                      .producers = producers,
                      .transport = "inproc://" + hub,
                      .http_control = false};
}

TEST(CoordinatorTest, EveryStepReachesEveryReceiverBitExactly) {
  Fleet fleet(InprocOptions("steps"));
  ASSERT_NO_FATAL_FAILURE(fleet.Start());
  for (uint64_t step = 1; step <= 4; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    fleet.TrainStep(0.01 * static_cast<double>(step), step);
    ASSERT_OK_AND_ASSIGN(RefitReport report, fleet.Refit());
    EXPECT_FALSE(report.plan.anchor);
    EXPECT_EQ(report.plan.base_version, step - 1);
    EXPECT_EQ(report.plan.target_version, step);
    ASSERT_EQ(report.producers.size(), 2u);
    ASSERT_EQ(report.receivers.size(), 3u);
    EXPECT_GT(report.payloads, 0u);
    EXPECT_EQ(report.payloads, report.producers[0].payloads + report.producers[1].payloads);
    EXPECT_GT(report.changed_elements, 0u);
    for (const ReceiverOutcome& receiver : report.receivers) {
      EXPECT_OK(receiver.commit_status);
      EXPECT_EQ(receiver.flush.payloads, report.payloads);
      EXPECT_EQ(receiver.flush.changed_elements, report.changed_elements);
      EXPECT_EQ(receiver.flush.target_version, step);
    }
    fleet.ExpectReceiversHold(fleet.ModelSnapshot(step));
    fleet.ExpectTrackersAt(step);
  }
}

TEST(CoordinatorTest, ProducersShareTheModelByChunkOwnership) {
  // Three producers over five chunks: every producer owns one or two, none sends twice.
  Fleet fleet(InprocOptions("ownership", /*receivers=*/2, /*producers=*/3));
  ASSERT_NO_FATAL_FAILURE(fleet.Start());
  fleet.TrainStep(0.2, 1);
  ASSERT_OK_AND_ASSIGN(RefitReport report, fleet.Refit());
  uint64_t owned = 0;
  for (const StreamReport& producer : report.producers) {
    EXPECT_EQ(producer.chunks, 5u);
    EXPECT_GE(producer.owned_chunks, 1u);
    owned += producer.owned_chunks;
  }
  EXPECT_EQ(owned, 5u);
  fleet.ExpectReceiversHold(fleet.ModelSnapshot(1));
}

TEST(CoordinatorTest, AStepWithoutChangesCommitsWithoutPayloads) {
  Fleet fleet(InprocOptions("unchanged"));
  ASSERT_NO_FATAL_FAILURE(fleet.Start());
  ASSERT_OK_AND_ASSIGN(RefitReport report, fleet.Refit());
  EXPECT_EQ(report.payloads, 0u);
  EXPECT_EQ(report.wire_bytes, 0u);
  fleet.ExpectReceiversHold(fleet.ModelSnapshot(1));
  fleet.ExpectTrackersAt(1);
}

TEST(CoordinatorTest, AForcedAnchorSendsEveryElement) {
  Fleet fleet(InprocOptions("anchor"));
  ASSERT_NO_FATAL_FAILURE(fleet.Start());
  fleet.TrainStep(0.01, 1);
  ASSERT_OK_AND_ASSIGN(RefitReport report, fleet.coordinator().Refit(/*force_anchor=*/true));
  EXPECT_TRUE(report.plan.anchor);
  // FULL items carry every element, changed or not.
  for (const ReceiverOutcome& receiver : report.receivers) {
    EXPECT_EQ(receiver.flush.changed_elements, report.total_elements);
  }
  fleet.ExpectReceiversHold(fleet.ModelSnapshot(1));
}

TEST(CoordinatorTest, ProducersAtDifferentVersionsAreRefusedBeforeAnythingOpens) {
  Fleet fleet(InprocOptions("versions"));
  ASSERT_NO_FATAL_FAILURE(fleet.Start());
  // Producer 1 alone commits an (empty) transfer: it is now one version ahead.
  internal::DeltaTracker& ahead = *fleet.trackers()[1];
  const TransferId solo = TransferId::Random();
  ASSERT_OK(ahead.Begin(solo).status());
  ASSERT_OK(ahead.Commit(solo));
  fleet.TrainStep(0.05, 1);
  const StoreSnapshot before = fleet.ModelSnapshot(0);
  EXPECT_STATUS_MSG(FailedPrecondition, "different versions", fleet.Refit());
  EXPECT_FALSE(fleet.trackers()[0]->open_transfer().has_value());
  EXPECT_FALSE(fleet.trackers()[1]->open_transfer().has_value());
  for (testing::FleetReceiver& receiver : fleet.receivers()) {
    EXPECT_EQ(receiver.session->GetStatus().state, ReceiverState::kIdle);
    EXPECT_EQ(receiver.store->version(), 0u);
  }
}

TEST(CoordinatorTest, AReceiverAtAnotherVersionAbortsTheTransferEverywhere) {
  Fleet fleet(InprocOptions("fencing"));
  ASSERT_NO_FATAL_FAILURE(fleet.Start());
  const StoreSnapshot at_zero = fleet.ModelSnapshot(0);
  // Receiver 1 restarted from a checkpoint of another version.
  ASSERT_NO_FATAL_FAILURE(fleet.RestartReceiver(1, 5, fleet.model()));
  fleet.TrainStep(0.05, 1);
  auto refused = fleet.Refit();
  EXPECT_STATUS_MSG(FailedPrecondition, "prepare failed at receiver 1", refused);
  EXPECT_EQ(testing::TakeSnapshot(*fleet.receivers()[0].store), at_zero);
  EXPECT_EQ(testing::TakeSnapshot(*fleet.receivers()[2].store), at_zero);
  fleet.ExpectTrackersAt(0);
  // Back at the fleet's version, the next transfer carries the step.
  ASSERT_NO_FATAL_FAILURE(fleet.RestartReceiver(1, 0, testing::FleetModel(fleet.options().seed)));
  ASSERT_OK(fleet.Refit().status());
  fleet.ExpectReceiversHold(fleet.ModelSnapshot(1));
  fleet.ExpectTrackersAt(1);
}

TEST(CoordinatorTest, ACorruptPayloadRollsEveryReceiverBackAndTheRetrySucceeds) {
  Fleet fleet(InprocOptions("corrupt"));
  ASSERT_NO_FATAL_FAILURE(fleet.Start());
  fleet.TrainStep(0.03, 1);
  ASSERT_OK(fleet.Refit().status());
  const StoreSnapshot at_one = fleet.ModelSnapshot(1);
  fleet.TrainStep(0.03, 2);
  ASSERT_NO_FATAL_FAILURE(fleet.SetSenderTransport("fault+inproc://corrupt?seed=1&corrupt=1"));
  EXPECT_STATUS(DataLoss, fleet.Refit());
  fleet.ExpectReceiversHold(at_one);
  fleet.ExpectTrackersAt(1);
  ASSERT_NO_FATAL_FAILURE(fleet.SetSenderTransport("inproc://corrupt"));
  ASSERT_OK_AND_ASSIGN(RefitReport retry, fleet.Refit());
  EXPECT_EQ(retry.plan.base_version, 1u);
  fleet.ExpectReceiversHold(fleet.ModelSnapshot(2));
  fleet.ExpectTrackersAt(2);
}

// Records what the coordinator tells it, and asks for an anchor from chosen base versions.
class RecordingObserver final : public TransferObserver {
 public:
  bool NeedsAnchor(uint64_t base_version) override {
    asked.push_back(base_version);
    return anchor_from.count(base_version) > 0;
  }
  Status TransferCommitted(const TransferPlan& plan,
                           const std::map<std::string, uint64_t>& digests) override {
    committed.push_back(plan);
    last_digests = digests;
    return fail_commit ? IoError("the chain index could not be written") : Status::OK();
  }
  void TransferAborted(const TransferId& id) override { aborted.push_back(id); }

  std::set<uint64_t> anchor_from;
  bool fail_commit = false;
  std::vector<uint64_t> asked;
  std::vector<TransferPlan> committed;
  std::vector<TransferId> aborted;
  std::map<std::string, uint64_t> last_digests;
};

TEST(CoordinatorTest, TheObserverLearnsEveryOutcomeAndMayAskForAnAnchor) {
  RecordingObserver observer;
  observer.anchor_from = {1};
  FleetOptions options = InprocOptions("observer");
  options.observer = &observer;
  Fleet fleet(options);
  ASSERT_NO_FATAL_FAILURE(fleet.Start());

  fleet.TrainStep(0.03, 1);
  ASSERT_OK_AND_ASSIGN(RefitReport first, fleet.Refit());
  EXPECT_FALSE(first.plan.anchor);
  fleet.TrainStep(0.03, 2);
  ASSERT_OK_AND_ASSIGN(RefitReport second, fleet.Refit());
  EXPECT_TRUE(second.plan.anchor) << "the observer asked for an anchor from version 1";
  EXPECT_EQ(observer.asked, (std::vector<uint64_t>{0, 1}));
  ASSERT_EQ(observer.committed.size(), 2u);
  EXPECT_EQ(observer.committed[1].transfer_id, second.plan.transfer_id);
  EXPECT_TRUE(observer.committed[1].anchor);
  // The digests it is given are the fleet's state at the target version.
  EXPECT_EQ(observer.last_digests, second.receivers[0].flush.digests);
  EXPECT_TRUE(observer.aborted.empty());

  // A failure is reported as an abort; a failing TransferCommitted does not undo a commit.
  fleet.TrainStep(0.03, 3);
  ASSERT_NO_FATAL_FAILURE(fleet.SetSenderTransport("fault+inproc://observer?seed=1&corrupt=1"));
  Result<RefitReport> failed = fleet.Refit();
  ASSERT_FALSE(failed.ok());
  ASSERT_EQ(observer.aborted.size(), 1u);
  EXPECT_EQ(observer.committed.size(), 2u);
  ASSERT_NO_FATAL_FAILURE(fleet.SetSenderTransport("inproc://observer"));
  observer.fail_commit = true;
  ASSERT_OK(fleet.Refit().status());
  fleet.ExpectReceiversHold(fleet.ModelSnapshot(3));
  fleet.ExpectTrackersAt(3);
}

TEST(CoordinatorTest, AFailingSourceAbortsAndNamesTheProducer) {
  Fleet fleet(InprocOptions("source"));
  ASSERT_NO_FATAL_FAILURE(fleet.Start());
  const StoreSnapshot at_zero = fleet.ModelSnapshot(0);
  fleet.TrainStep(0.05, 1);
  std::vector<internal::CoordinatedProducer> producers;
  for (auto& tracker : fleet.trackers()) {
    producers.push_back({tracker.get(), [](const TransferPlan&) -> Result<ChunkSource> {
                           return IoError("export of rank failed");
                         }});
  }
  std::vector<internal::CoordinatedReceiver> receivers;
  for (testing::FleetReceiver& receiver : fleet.receivers()) {
    receivers.push_back({receiver.endpoint, receiver.control()});
  }
  std::atomic<int> channels_opened{0};
  ASSERT_OK_AND_ASSIGN(
      auto coordinator,
      internal::Coordinator::Make(
          {}, producers, receivers,
          [&](const internal::ChannelRequest&) -> Result<std::unique_ptr<PayloadChannel>> {
            ++channels_opened;
            return Internal("unreachable");
          }));
  // Every producer's source fails; which one the error names first depends on thread timing,
  // so check that it names a producer and the source's error.
  const Status failed = coordinator->Refit().status();
  EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed.ToString();
  EXPECT_TRUE(
      std::regex_search(std::string(failed.message()),
                        std::regex("stream failed at producer [01]: export of rank failed")))
      << failed.ToString();
  EXPECT_EQ(channels_opened.load(), 0);
  fleet.ExpectReceiversHold(at_zero);
  fleet.ExpectTrackersAt(0);
}

TEST(CoordinatorTest, MakeRefusesIncompleteFleets) {
  ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));
  auto source = [](const TransferPlan&) -> Result<ChunkSource> { return ChunkSource{}; };
  auto channels = [](const internal::ChannelRequest&) -> Result<std::unique_ptr<PayloadChannel>> {
    return Internal("unused");
  };
  EXPECT_STATUS_MSG(InvalidArgument, "no producers",
                    internal::Coordinator::Make({}, {}, {}, channels));
  EXPECT_STATUS_MSG(InvalidArgument, "producer 0 has no tracker",
                    internal::Coordinator::Make({}, {{nullptr, source}}, {}, channels));
  EXPECT_STATUS_MSG(
      InvalidArgument, "receiver 'r' has no control",
      internal::Coordinator::Make({}, {{tracker.get(), source}}, {{"r", nullptr}}, channels));
  EXPECT_STATUS_MSG(InvalidArgument, "no channel factory",
                    internal::Coordinator::Make({}, {{tracker.get(), source}}, {}, nullptr));
  internal::CoordinatorOptions zero_timeout;
  zero_timeout.transfer_timeout = std::chrono::milliseconds(0);
  EXPECT_STATUS_MSG(
      InvalidArgument, "transfer_timeout",
      internal::Coordinator::Make(zero_timeout, {{tracker.get(), source}}, {}, channels));
  internal::CoordinatorOptions bad_stream;
  bad_stream.stream.bucket_bytes = 0;
  EXPECT_STATUS(InvalidArgument,
                internal::Coordinator::Make(bad_stream, {{tracker.get(), source}}, {}, channels));
}

}  // namespace
}  // namespace refit
