// A coordinator that vanishes at each phase of a transfer, in process: from the moment it dies
// no call of it reaches a receiver (not even its aborts), as if its process had been killed
// there. Receivers must not stay wedged past their lease, the fleet must end at one version
// bit-exactly, and the next Refit must succeed. The same with real processes and kill -9 is
// tests/integration/chaos_push_kill_test.py.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fleet.h"
#include "pipeline/coordinator.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::Fleet;
using testing::FleetOptions;

// Receivers' lease: a live in-process transfer never pauses this long between payloads.
constexpr auto kLease = std::chrono::milliseconds(500);
// How long a receiver may take past its lease to roll back (scheduling on a loaded machine).
constexpr auto kLeaseSlack = std::chrono::seconds(20);

// Where the coordinator dies.
enum class DieAt {
  kNever,
  kAfterPrepare,   // every receiver prepared, no payload sent
  kMidStream,      // after the first payload of producer 0
  kBeforeFlush,    // every payload sent, no flush
  kAfterFlush,     // every receiver prepared, no commit
  kAfterOneCommit  // receiver 0 committed, the others never heard
};

// The coordinator's life, shared by its receiver controls and channels.
struct Life {
  DieAt die_at = DieAt::kNever;
  std::atomic<bool> dead{false};
  std::atomic<int> prepares{0};
  std::atomic<int> flushes{0};
  size_t receivers = 0;
  // kAfterOneCommit: commits are let through one at a time, so exactly one lands.
  std::mutex commit_mutex;
  int committed_receiver = -1;
};

Status Gone() { return Unavailable("the coordinator is gone"); }

// What a vanished coordinator's call to a receiver looks like: it never arrives.
class VanishingControl final : public ReceiverControl {
 public:
  VanishingControl(size_t index, ReceiverControl& inner, Life& life)
      : index_(static_cast<int>(index)), inner_(inner), life_(life) {}

  Result<PrepareResult> Prepare(const PrepareRequest& request) override {
    if (life_.dead) return Gone();
    Result<PrepareResult> prepared = inner_.Prepare(request);
    if (life_.die_at == DieAt::kAfterPrepare &&
        static_cast<size_t>(++life_.prepares) == life_.receivers) {
      life_.dead = true;
    }
    // Dies before it hears the reply: the receiver is prepared all the same.
    if (life_.die_at == DieAt::kAfterPrepare) return Gone();
    return prepared;
  }
  Result<FlushReport> Flush(const TransferId& id, const FlushOptions& options) override {
    if (life_.die_at == DieAt::kBeforeFlush) life_.dead = true;
    if (life_.dead) return Gone();
    Result<FlushReport> flushed = inner_.Flush(id, options);
    if (life_.die_at == DieAt::kAfterFlush &&
        static_cast<size_t>(++life_.flushes) == life_.receivers) {
      life_.dead = true;
    }
    return flushed;
  }
  Status Commit(const TransferId& id) override {
    std::lock_guard lock(life_.commit_mutex);
    if (life_.dead) return Gone();
    const Status committed = inner_.Commit(id);
    if (life_.die_at == DieAt::kAfterOneCommit) {
      life_.committed_receiver = index_;
      life_.dead = true;
    }
    return committed;
  }
  Status Abort(const TransferId& id) override {
    if (life_.dead) return Gone();
    return inner_.Abort(id);
  }
  Result<HeldRegions> Regions(const std::vector<std::string>& canonical_names) override {
    if (life_.dead) return Gone();
    return inner_.Regions(canonical_names);
  }

 private:
  const int index_;
  ReceiverControl& inner_;
  Life& life_;
};

// A producer's channel that dies with its coordinator (kMidStream: after its first payload).
class VanishingChannel final : public PayloadChannel {
 public:
  VanishingChannel(std::unique_ptr<PayloadChannel> inner, Life& life)
      : inner_(std::move(inner)), life_(life) {}
  Status Send(uint32_t payload_id, std::span<const std::byte> payload) override {
    if (life_.dead) return Gone();
    const Status sent = inner_->Send(payload_id, payload);
    if (life_.die_at == DieAt::kMidStream) life_.dead = true;
    return sent;
  }
  void CleanupThread() override { inner_->CleanupThread(); }
  Status Finish(uint64_t payloads) override {
    if (life_.dead) return Gone();
    return inner_->Finish(payloads);
  }

 private:
  std::unique_ptr<PayloadChannel> inner_;
  Life& life_;
};

class ChaosCoordinatorTest : public ::testing::TestWithParam<DieAt> {
 protected:
  void SetUp() override {
    hub_ = fmt::format("chaos-{}", static_cast<int>(GetParam()));
    FleetOptions options{
        .receivers = 3, .producers = 2, .transport = "inproc://" + hub_, .http_control = false};
    options.transfer_lease = kLease;
    fleet_ = std::make_unique<Fleet>(options);
    ASSERT_NO_FATAL_FAILURE(fleet_->Start());
    ASSERT_OK_AND_ASSIGN(sender_, MakeTransport("inproc://" + hub_));
  }

  // A coordinator incarnation over the fleet's trackers and receivers, living `life`.
  std::unique_ptr<internal::Coordinator> MakeCoordinator(Life& life) {
    life.receivers = fleet_->receivers().size();
    controls_.clear();
    std::vector<internal::CoordinatedReceiver> receivers;
    for (size_t r = 0; r < fleet_->receivers().size(); ++r) {
      controls_.push_back(
          std::make_unique<VanishingControl>(r, *fleet_->receivers()[r].session, life));
      receivers.push_back({fmt::format("receiver {}", r), controls_.back().get()});
    }
    std::vector<internal::CoordinatedProducer> producers;
    for (const std::unique_ptr<internal::DeltaTracker>& tracker : fleet_->trackers()) {
      producers.push_back({tracker.get(), [this](const TransferPlan&) -> Result<ChunkSource> {
                             std::vector<TensorView> views;
                             for (const OwnedTensor& t : fleet_->model()) views.push_back(t.view());
                             return TensorListSource(std::move(views), testing::kFleetChunkBytes);
                           }});
    }
    internal::CoordinatorOptions options;
    options.stream.chunk_bytes = testing::kFleetChunkBytes;
    options.stream.bucket_bytes = 4 << 10;
    options.transfer_timeout = std::chrono::seconds(30);
    internal::ChannelFactory channels =
        [this, &life](
            const internal::ChannelRequest& request) -> Result<std::unique_ptr<PayloadChannel>> {
      REFIT_ASSIGN_OR_RETURN(
          std::unique_ptr<TransportSender> sender,
          sender_->MakeSender(SenderContext{.transfer_id = request.transfer_id,
                                            .producer_id = request.producer_id,
                                            .base_version = request.base_version,
                                            .target_version = request.target_version,
                                            .endpoints = fleet_->endpoints()}));
      return std::unique_ptr<PayloadChannel>(
          std::make_unique<VanishingChannel>(std::move(sender), life));
    };
    auto made =
        internal::Coordinator::Make(options, std::move(producers), std::move(receivers), channels);
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    return made.ok() ? std::move(made).ValueOrDie() : nullptr;
  }

  // Wait until no receiver is receiving (the lease rolled them back); prepared ones stay.
  void ExpectNoneReceivingWithinTheLease() {
    const auto deadline = std::chrono::steady_clock::now() + kLease + kLeaseSlack;
    for (testing::FleetReceiver& receiver : fleet_->receivers()) {
      while (receiver.session->GetStatus().state == ReceiverState::kReceiving) {
        ASSERT_LT(std::chrono::steady_clock::now(), deadline)
            << "wedged: still receiving " << kLeaseSlack.count() << " s past the lease";
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }

  std::string hub_;
  std::unique_ptr<Fleet> fleet_;
  std::unique_ptr<Transport> sender_;
  std::vector<std::unique_ptr<VanishingControl>> controls_;
};

TEST_P(ChaosCoordinatorTest, TheNextRefitRepairsWhateverTheDeadCoordinatorLeft) {
  const DieAt die_at = GetParam();
  const testing::StoreSnapshot at_zero = testing::TakeSnapshot(*fleet_->receivers()[0].store);
  fleet_->TrainStep(0.05, 1);
  int committed_receiver = -1;
  {
    Life life;
    life.die_at = die_at;
    std::unique_ptr<internal::Coordinator> doomed = MakeCoordinator(life);
    ASSERT_NE(doomed, nullptr);
    const Result<RefitReport> outcome = doomed->Refit();
    ASSERT_TRUE(life.dead) << "the coordinator never reached the phase it should die in";
    if (die_at == DieAt::kAfterFlush || die_at == DieAt::kAfterOneCommit) {
      // Decided: the coordinator committed its trackers whatever the receivers answered.
      ASSERT_OK(outcome.status());
      fleet_->ExpectTrackersAt(1);
    } else {
      EXPECT_STATUS(Unavailable, outcome);
      fleet_->ExpectTrackersAt(0);
    }
    committed_receiver = life.committed_receiver;
  }
  const uint64_t decided = die_at == DieAt::kAfterFlush || die_at == DieAt::kAfterOneCommit ? 1 : 0;
  ASSERT_NO_FATAL_FAILURE(ExpectNoneReceivingWithinTheLease());
  // A decided transfer must outlive the lease: wait past it before looking.
  if (decided == 1) std::this_thread::sleep_for(2 * kLease);
  for (size_t r = 0; r < fleet_->receivers().size(); ++r) {
    SCOPED_TRACE(fmt::format("receiver {}", r));
    const ReceiverStatus status = fleet_->receivers()[r].session->GetStatus();
    if (decided == 0) {
      // Rolled back by the lease (bit-exactly: below).
      EXPECT_EQ(status.state, ReceiverState::kIdle);
      EXPECT_EQ(status.version, 0u);
      EXPECT_EQ(status.expired_leases, 1u);
      EXPECT_EQ(status.last_error.code(), StatusCode::kDeadlineExceeded);
    } else if (static_cast<int>(r) == committed_receiver) {
      EXPECT_EQ(status.state, ReceiverState::kIdle);
      EXPECT_EQ(status.version, 1u);
    } else {
      // Prepared and decided elsewhere: no lease may roll it back.
      EXPECT_EQ(status.state, ReceiverState::kPrepared);
      EXPECT_EQ(status.expired_leases, 0u);
    }
  }
  if (decided == 0) {
    for (testing::FleetReceiver& receiver : fleet_->receivers()) {
      EXPECT_EQ(testing::TakeSnapshot(*receiver.store), at_zero);
      EXPECT_EQ(receiver.store->RecomputeDigests(), receiver.store->Digests());
    }
  }

  // A new coordinator (same trackers, as a long-lived trainer's rank 0 after a failed Sync):
  // the next step commits everywhere.
  fleet_->TrainStep(0.05, 2);
  Life alive;
  std::unique_ptr<internal::Coordinator> next = MakeCoordinator(alive);
  ASSERT_NE(next, nullptr);
  ASSERT_OK_AND_ASSIGN(const RefitReport report, next->Refit());
  EXPECT_EQ(report.plan.base_version, decided);
  for (size_t r = 0; r < report.receivers.size(); ++r) {
    const ReceiverOutcome& receiver = report.receivers[r];
    EXPECT_OK(receiver.commit_status);
    const bool was_prepared = decided == 1 && static_cast<int>(r) != committed_receiver;
    EXPECT_EQ(receiver.implied_commit.has_value(), was_prepared) << receiver.name;
    EXPECT_FALSE(receiver.implied_abort.has_value()) << receiver.name;
  }
  fleet_->ExpectReceiversHold(fleet_->ModelSnapshot(decided + 1));
  fleet_->ExpectTrackersAt(decided + 1);
}

std::string PhaseName(const ::testing::TestParamInfo<DieAt>& phase) {
  switch (phase.param) {
    case DieAt::kAfterPrepare:
      return "AfterPrepare";
    case DieAt::kMidStream:
      return "MidStream";
    case DieAt::kBeforeFlush:
      return "BeforeFlush";
    case DieAt::kAfterFlush:
      return "AfterFlush";
    case DieAt::kAfterOneCommit:
      return "AfterOneCommit";
    case DieAt::kNever:
      break;
  }
  return "Never";
}

INSTANTIATE_TEST_SUITE_P(EveryPhase, ChaosCoordinatorTest,
                         ::testing::Values(DieAt::kAfterPrepare, DieAt::kMidStream,
                                           DieAt::kBeforeFlush, DieAt::kAfterFlush,
                                           DieAt::kAfterOneCommit),
                         PhaseName);

}  // namespace
}  // namespace refit
