// The whole refit over real loopback sockets: producers stream through the zmq:// relay tree,
// the coordinator drives every receiver through its HTTP control plane. Faults are injected at
// each stage (fault+zmq:// senders, a receiver killed mid-transfer, a coordinator timeout); after
// each, every surviving receiver must be back at the base version bit-exactly, no tracker may
// have committed, and the next transfer must succeed without restarting anything.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <string>
#include <thread>

#include "fleet.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::Fleet;
using testing::FleetOptions;
using testing::StoreSnapshot;

// Budget of a transfer that a fault makes wait (a silent drop, a delayed sender): long enough for
// a correct transfer on a loaded 2-core machine, short enough to keep the suite fast.
constexpr auto kShortBudget = std::chrono::milliseconds(3000);

class FleetTest : public ::testing::Test {
 protected:
  void StartFleet(size_t receivers = 4, uint32_t producers = 2,
                  std::chrono::milliseconds budget = std::chrono::seconds(60),
                  int apply_threads = ReceiverSessionOptions{}.apply_threads,
                  int decode_threads = ReceiverSessionOptions{}.decode_threads) {
    fleet_ = std::make_unique<Fleet>(FleetOptions{.receivers = receivers,
                                                  .producers = producers,
                                                  .transport = "zmq://?timeout_ms=2000&retries=1",
                                                  .http_control = true,
                                                  .transfer_timeout = budget,
                                                  .apply_threads = apply_threads,
                                                  .decode_threads = decode_threads});
    ASSERT_NO_FATAL_FAILURE(fleet_->Start());
    // A first committed step, so that faults hit a delta at version 1 → 2.
    fleet_->TrainStep(0.02, 1);
    ASSERT_OK(fleet_->Refit().status());
  }

  // Inject `fault_uri` into the senders for one transfer of the next step and check that the
  // transfer fails with `code` and leaves everything at version 1; then a clean transfer of the
  // same step succeeds.
  void ExpectFaultRollsBack(const std::string& fault_uri, StatusCode code) {
    const StoreSnapshot at_one = fleet_->ModelSnapshot(1);
    fleet_->TrainStep(0.03, 2);
    ASSERT_NO_FATAL_FAILURE(fleet_->SetSenderTransport(fault_uri));
    Result<RefitReport> failed = fleet_->Refit();
    EXPECT_EQ(failed.status().code(), code) << failed.status().ToString();
    fleet_->ExpectReceiversHold(at_one);
    fleet_->ExpectTrackersAt(1);
    ASSERT_NO_FATAL_FAILURE(fleet_->SetSenderTransport("zmq://?timeout_ms=2000&retries=1"));
    ASSERT_OK_AND_ASSIGN(RefitReport retry, fleet_->Refit());
    EXPECT_EQ(retry.plan.base_version, 1u);
    fleet_->ExpectReceiversHold(fleet_->ModelSnapshot(2));
    fleet_->ExpectTrackersAt(2);
  }

  std::unique_ptr<Fleet> fleet_;
};

TEST_F(FleetTest, StepsReachEveryReceiverOfTheTreeBitExactly) {
  ASSERT_NO_FATAL_FAILURE(StartFleet(/*receivers=*/5, /*producers=*/3));
  for (uint64_t step = 2; step <= 4; ++step) {
    fleet_->TrainStep(0.01 * static_cast<double>(step), step);
    ASSERT_OK_AND_ASSIGN(RefitReport report, fleet_->Refit());
    EXPECT_EQ(report.plan.target_version, step);
    for (const ReceiverOutcome& receiver : report.receivers) {
      EXPECT_OK(receiver.commit_status);
      EXPECT_EQ(receiver.flush.payloads, report.payloads);
      EXPECT_EQ(receiver.flush.duplicates, 0u);
    }
    fleet_->ExpectReceiversHold(fleet_->ModelSnapshot(step));
  }
}

TEST_F(FleetTest, ASendThatFailsAbortsEverywhere) {
  ASSERT_NO_FATAL_FAILURE(StartFleet());
  ExpectFaultRollsBack("fault+zmq://?seed=1&drop=0.5&timeout_ms=2000&retries=1",
                       StatusCode::kUnavailable);
}

TEST_F(FleetTest, APayloadLostAfterItsAckTimesOutAtFlushAndAbortsEverywhere) {
  ASSERT_NO_FATAL_FAILURE(StartFleet(4, 2, kShortBudget));
  ExpectFaultRollsBack("fault+zmq://?seed=2&drop=0.5&drop_mode=silent&timeout_ms=2000&retries=1",
                       StatusCode::kDeadlineExceeded);
}

TEST_F(FleetTest, ACorruptPayloadIsDataLossAndAbortsEverywhere) {
  ASSERT_NO_FATAL_FAILURE(StartFleet());
  ExpectFaultRollsBack("fault+zmq://?seed=3&corrupt=0.5&timeout_ms=2000&retries=1",
                       StatusCode::kDataLoss);
}

TEST_F(FleetTest, DuplicatedPayloadsAreAppliedOnce) {
  ASSERT_NO_FATAL_FAILURE(StartFleet());
  fleet_->TrainStep(0.03, 2);
  ASSERT_NO_FATAL_FAILURE(
      fleet_->SetSenderTransport("fault+zmq://?seed=4&duplicate=1&timeout_ms=2000&retries=1"));
  ASSERT_OK_AND_ASSIGN(RefitReport report, fleet_->Refit());
  for (const ReceiverOutcome& receiver : report.receivers) {
    EXPECT_EQ(receiver.flush.payloads, report.payloads);
  }
  fleet_->ExpectReceiversHold(fleet_->ModelSnapshot(2));
  fleet_->ExpectTrackersAt(2);
}

TEST_F(FleetTest, ASlowTransportPastTheBudgetIsAbortedEverywhere) {
  // Every send waits longer than the whole budget.
  ASSERT_NO_FATAL_FAILURE(StartFleet(4, 2, std::chrono::milliseconds(1000)));
  ExpectFaultRollsBack("fault+zmq://?seed=5&delay_ms=1500&timeout_ms=2000&retries=1",
                       StatusCode::kDeadlineExceeded);
}

TEST_F(FleetTest, AReceiverKilledMidTransferLeavesTheSurvivorsAtTheBase) {
  ASSERT_NO_FATAL_FAILURE(StartFleet(/*receivers=*/4, /*producers=*/1));
  const StoreSnapshot at_one = fleet_->ModelSnapshot(1);
  const std::vector<OwnedTensor> model_at_one = fleet_->model();
  fleet_->TrainStep(0.05, 2);
  // Receiver 2, a leaf of the tree rooted at relay 0, dies once every receiver has prepared the
  // transfer and before the producer's payloads reach it: its ports close, and relay 0 cannot
  // forward to it.
  constexpr size_t kVictim = 2;
  fleet_->on_channel_open = [&](const internal::ChannelRequest&) { fleet_->KillReceiver(kVictim); };
  Result<RefitReport> failed = fleet_->Refit();
  fleet_->on_channel_open = nullptr;
  EXPECT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("abort failed at receiver 2"), std::string::npos)
      << failed.status().ToString();
  for (size_t r = 0; r < fleet_->receivers().size(); ++r) {
    if (r == kVictim) continue;
    SCOPED_TRACE(fmt::format("survivor {}", r));
    EXPECT_EQ(testing::TakeSnapshot(*fleet_->receivers()[r].store), at_one);
    EXPECT_EQ(fleet_->receivers()[r].session->GetStatus().state, ReceiverState::kIdle);
  }
  fleet_->ExpectTrackersAt(1);
  // The victim's process restarts from the checkpoint of version 1; the same step then commits.
  ASSERT_NO_FATAL_FAILURE(fleet_->RestartReceiver(kVictim, 1, model_at_one));
  ASSERT_OK(fleet_->Refit().status());
  fleet_->ExpectReceiversHold(fleet_->ModelSnapshot(2));
  fleet_->ExpectTrackersAt(2);
}

// Under a quorum, a receiver that dies mid-stream costs the transfer that receiver alone: it is
// the root relay of producer 0's tree, so every payload of that producer must go around it — its
// two children are sent each payload directly and forward it to their subtrees — and the
// survivors commit while it is fenced. Killed with no relay tree to route around (the policy
// `all`), the same death aborts everywhere (AReceiverKilledMidTransferLeavesTheSurvivorsAtTheBase).
TEST_F(FleetTest, UnderAQuorumAReceiverKilledMidStreamIsRoutedAroundAndFenced) {
  fleet_ = std::make_unique<Fleet>(FleetOptions{.receivers = 6,
                                                .producers = 2,
                                                .transport = "zmq://?timeout_ms=2000&retries=1",
                                                .transfer_timeout = std::chrono::seconds(30),
                                                .commit_policy = "quorum:5"});
  ASSERT_NO_FATAL_FAILURE(fleet_->Start());
  fleet_->TrainStep(0.02, 1);
  ASSERT_OK(fleet_->Refit().status());
  fleet_->TrainStep(0.05, 2);
  constexpr size_t kVictim = 0;
  std::atomic<bool> killed{false};
  fleet_->on_channel_open = [&](const internal::ChannelRequest&) {
    if (!killed.exchange(true)) fleet_->KillReceiver(kVictim);
  };
  const auto start = std::chrono::steady_clock::now();
  Result<RefitReport> refit = fleet_->Refit();
  ASSERT_OK(refit.status());
  const RefitReport& report = *refit;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fleet_->on_channel_open = nullptr;
  EXPECT_EQ(report.plan.target_version, 2u);
  ASSERT_EQ(report.fenced, std::vector<std::string>{"receiver 0"});
  EXPECT_EQ(report.flushed_replicas, 5u);
  EXPECT_LT(seconds, 20) << "the dead relay is found at once, not after the transfer's deadline";
  const StoreSnapshot at_two = fleet_->ModelSnapshot(2);
  for (size_t r = 1; r < fleet_->receivers().size(); ++r) {
    SCOPED_TRACE(fmt::format("survivor {}", r));
    EXPECT_EQ(testing::TakeSnapshot(*fleet_->receivers()[r].store), at_two);
    EXPECT_FALSE(report.receivers[r].fenced);
    EXPECT_EQ(report.receivers[r].flush.payloads, report.payloads)
        << "every payload of both producers reached it, around the dead root";
  }
  fleet_->ExpectTrackersAt(2);
}

// 200 consecutive steps with random densities; about one transfer in four gets a random fault.
// Whatever fails is aborted everywhere and its changes travel with the next transfer; every
// transfer leaves the fleet consistent, and the last one leaves every receiver equal to the
// trainer.
/// The receivers' pipeline: apply threads and decode threads.
struct Pipeline {
  int apply_threads;
  int decode_threads;
};

class FleetSoakTest : public FleetTest, public ::testing::WithParamInterface<Pipeline> {};

// The same seeded steps and faults through a serial receiver (one apply thread, no decode
// thread) and the default parallel one: each must hold exactly the trainer's bits after every
// committed step and exactly the previous version's after every abort, so the two agree bit for
// bit whatever the order their threads applied items in.
TEST_P(FleetSoakTest, TwoHundredStepsWithRandomFaultsEndBitIdenticalToTheTrainer) {
  constexpr int kSteps = 200;
  ASSERT_NO_FATAL_FAILURE(StartFleet(/*receivers=*/3, /*producers=*/2, kShortBudget,
                                     GetParam().apply_threads, GetParam().decode_threads));
  std::mt19937_64 rng(2026);
  std::uniform_real_distribution<double> density(0.001, 0.05);
  const std::string clean = "zmq://?timeout_ms=2000&retries=1";
  const std::vector<std::string> faults = {"drop=0.3", "drop=0.3&drop_mode=silent", "corrupt=0.3",
                                           "duplicate=0.5", "disconnect_after=1"};
  int committed = 0;
  int aborted = 0;
  uint64_t version = 1;
  for (int step = 2; step < 2 + kSteps; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    fleet_->TrainStep(density(rng), static_cast<uint64_t>(step));
    std::string uri = clean;
    if (rng() % 4 == 0) {
      uri = fmt::format("fault+zmq://?seed={}&{}&timeout_ms=2000&retries=1", step,
                        faults[rng() % faults.size()]);
    }
    ASSERT_NO_FATAL_FAILURE(fleet_->SetSenderTransport(uri));
    Result<RefitReport> report = fleet_->Refit();
    if (report.ok()) {
      ++committed;
      ++version;
      fleet_->ExpectReceiversHold(fleet_->ModelSnapshot(version));
    } else {
      ++aborted;
      // Nothing moved: every receiver still holds what the trackers hold.
      for (testing::FleetReceiver& receiver : fleet_->receivers()) {
        EXPECT_EQ(receiver.store->version(), version);
        EXPECT_EQ(receiver.session->GetStatus().state, ReceiverState::kIdle);
      }
    }
    fleet_->ExpectTrackersAt(version);
    if (::testing::Test::HasFatalFailure() || ::testing::Test::HasNonfatalFailure()) break;
  }
  ASSERT_NO_FATAL_FAILURE(fleet_->SetSenderTransport(clean));
  ASSERT_OK(fleet_->Refit().status());
  ++version;
  fleet_->ExpectReceiversHold(fleet_->ModelSnapshot(version));
  std::map<std::string, uint64_t> trainer;
  for (auto& tracker : fleet_->trackers()) {
    for (const auto& [name, digest] : tracker->Digests()) trainer[name] = digest;
  }
  for (testing::FleetReceiver& receiver : fleet_->receivers()) {
    EXPECT_EQ(receiver.store->Digests(), trainer);
  }
  std::printf(
      "200-step soak (%d apply, %d decode threads): %d committed, %d aborted by injected "
      "faults\n",
      GetParam().apply_threads, GetParam().decode_threads, committed, aborted);
  EXPECT_GT(aborted, 10);
  EXPECT_GT(committed, 100);
}

INSTANTIATE_TEST_SUITE_P(Pipelines, FleetSoakTest,
                         ::testing::Values(Pipeline{1, 0}, Pipeline{4, 2}),
                         [](const auto& param_info) {
                           return fmt::format("Apply{}Decode{}", param_info.param.apply_threads,
                                              param_info.param.decode_threads);
                         });

}  // namespace
}  // namespace refit
