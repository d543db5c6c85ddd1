// Lineage and fencing (docs/protocol.md "Lineage and fencing") over real loopback sockets: a
// `refit serve` daemon (its own process, saving its model and lineage on exit) and two embedded
// ReceiverNodes follow trainer A (run 'run-a'). A second trainer of another run cannot overwrite
// the versions the fleet holds and is refused by name; a trainer restarted without resuming
// cannot take A's run id; A restarted with resume continues its run with deltas as epoch 1; the
// old A (a zombie of epoch 0) is refused, also by the daemon restarted from its saved file; a new
// run anchors the fleet above every version it holds, and the trainer it replaced is told so.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bf16_model.h"
#include "local_fleet.h"
#include "loopback.h"
#include "process.h"
#include "refit/control_client.h"
#include "refit/lineage.h"
#include "refit/producer_group.h"
#include "refit/publisher.h"
#include "refit/receiver_node.h"
#include "refit/safetensors.h"
#include "test_data.h"
#include "test_util.h"

#ifndef REFIT_BINARY
#error "REFIT_BINARY must name the refit executable (set by tests/integration/CMakeLists.txt)"
#endif

namespace refit {
namespace {

using testkit::LocalFleet;
using testkit::LocalFleetOptions;

using bf16_model::Step;
using bf16_model::Tensor;
using bf16_model::Views;

// Four bf16 tensors of 4096 elements, weights around ±0.02.
std::vector<Tensor> MakeModel(uint64_t seed) { return bf16_model::MakeModel(seed, 4); }

ReceiverStatus StatusOf(const std::string& control_url) {
  ControlClientOptions options;
  options.base_url = control_url;
  auto client = ControlClient::Make(options).ValueOrDie();
  Result<ControlStatus> status = client->GetStatus();
  EXPECT_OK(status.status());
  return status.ok() ? status->receiver : ReceiverStatus{};
}

// A receiver embedded in this process over buffers it owns.
struct Embedded {
  std::vector<Tensor> buffers;
  std::unique_ptr<ReceiverNode> node;
};

std::unique_ptr<Embedded> StartEmbedded(const std::vector<Tensor>& loaded) {
  auto receiver = std::make_unique<Embedded>();
  receiver->buffers = loaded;
  ReceiverNodeOptions options;
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.data_endpoint = testing::FreeLoopbackEndpoint();
  receiver->node = ReceiverNode::Make(options).ValueOrDie();
  for (Tensor& t : receiver->buffers) {
    EXPECT_OK(receiver->node->RegisterTensor(t.mutable_view()));
  }
  EXPECT_OK(receiver->node->Start());
  return receiver;
}

class LineageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(work_dir_, testkit::MakeTemporaryDirectory("refit-lineage-test"));
    saved_path_ = work_dir_ + "/daemon-saved.safetensors";
  }
  void TearDown() override {
    if (daemon_ != nullptr) daemon_->Stop().IgnoreError();
    std::filesystem::remove_all(work_dir_);
  }

  // Start the daemon from `model_path`; it saves what it holds to saved_path_ on SIGTERM.
  void StartDaemon(const std::string& model_path) {
    LocalFleetOptions options;
    options.refit_binary = REFIT_BINARY;
    options.receivers = LocalFleetOptions::Replicas(model_path, 1);
    options.work_dir = work_dir_;
    options.label = "daemon";
    options.extra_args = {"--save-on-exit", saved_path_};
    options.start_timeout = std::chrono::seconds(60);
    ASSERT_OK_AND_ASSIGN(daemon_, LocalFleet::Start(options));
  }

  std::string daemon_url() const { return daemon_->receivers()[0].control_url; }

  std::vector<PublisherReceiver> Fleet() const {
    std::vector<PublisherReceiver> fleet = {
        {daemon_->receivers()[0].control_url, daemon_->receivers()[0].data_endpoint}};
    for (const auto& receiver : embedded_) {
      fleet.push_back({receiver->node->control_url(), receiver->node->producer_endpoint()});
    }
    return fleet;
  }

  // A trainer of one rank for the fleet, publishing `run_id` (resumed or not).
  std::unique_ptr<Publisher> Trainer(const std::string& run_id, bool resume) const {
    PublisherOptions options;
    options.transport_uri = "zmq://?timeout_ms=10000";
    options.stream.chunk_bytes = 16 << 10;
    options.stream.bucket_bytes = 8 << 10;
    options.stream.encode_threads = 1;
    options.stream.serialize_threads = 1;
    options.stream.send_threads = 1;
    options.transfer_timeout = std::chrono::seconds(60);
    options.receivers = Fleet();
    options.run_id = run_id;
    options.resume = resume;
    auto groups = MakeInProcessGroup(1).ValueOrDie();
    return Publisher::Make(options, std::move(groups[0])).ValueOrDie();
  }

  // Every receiver holds `version` of `run_id` at `epoch`, and the embedded ones hold `model`
  // bit for bit; the daemon's fingerprint is theirs.
  void ExpectFleetHolds(const std::vector<Tensor>& model, uint64_t version,
                        const std::string& run_id, uint64_t epoch) {
    const ReceiverStatus daemon = StatusOf(daemon_url());
    EXPECT_EQ(daemon.version, version);
    EXPECT_EQ(daemon.lineage.run_id, run_id);
    EXPECT_EQ(daemon.lineage.epoch, epoch);
    EXPECT_NE(daemon.lineage.fingerprint, 0u);
    for (const auto& receiver : embedded_) {
      const ReceiverStatus status = StatusOf(receiver->node->control_url());
      EXPECT_EQ(status.version, version);
      EXPECT_EQ(status.lineage, daemon.lineage);
      for (size_t t = 0; t < model.size(); ++t) {
        EXPECT_TRUE(receiver->buffers[t].bits == model[t].bits) << "tensor " << model[t].name;
      }
    }
  }

  std::string work_dir_;
  std::string saved_path_;
  std::unique_ptr<LocalFleet> daemon_;
  std::vector<std::unique_ptr<Embedded>> embedded_;
};

TEST_F(LineageTest, OnlyTheFleetsLineageContinuesItAndANewRunAnchorsAboveIt) {
  std::mt19937_64 rng(40);
  const std::vector<Tensor> step0 = MakeModel(40);
  const std::string step0_path = work_dir_ + "/step0.safetensors";
  ASSERT_OK(WriteSafetensors(step0_path, Views(step0), {{kWeightVersionMetadataKey, "0"}}));
  ASSERT_NO_FATAL_FAILURE(StartDaemon(step0_path));
  for (int r = 0; r < 2; ++r) embedded_.push_back(StartEmbedded(step0));

  // Trainer A starts run 'run-a' from the checkpoint the fleet loaded: deltas, versions 1 and 2.
  std::vector<Tensor> model_a = step0;
  std::unique_ptr<Publisher> trainer_a = Trainer("run-a", /*resume=*/false);
  ASSERT_OK(trainer_a->AdoptBaseline(Views(step0), 0));
  for (int s = 0; s < 2; ++s) {
    Step(model_a, rng);
    ASSERT_OK_AND_ASSIGN(SyncReport report, trainer_a->Sync(Views(model_a)));
    EXPECT_FALSE(report.transfer.plan.anchor);
  }
  ASSERT_NO_FATAL_FAILURE(ExpectFleetHolds(model_a, 2, "run-a", 0));

  // A second trainer of another run, from its own checkpoint labelled version 1: it would
  // publish version 2 again with other contents. Every receiver refuses it, naming both runs.
  {
    std::vector<Tensor> model_b = MakeModel(41);
    std::unique_ptr<Publisher> trainer_b = Trainer("run-b", /*resume=*/false);
    ASSERT_OK(trainer_b->AdoptBaseline(Views(model_b), 1));
    Step(model_b, rng);
    const Result<SyncReport> refused = trainer_b->Sync(Views(model_b));
    EXPECT_STATUS_MSG(FailedPrecondition, "of run 'run-b' epoch 0", refused);
    EXPECT_STATUS_MSG(FailedPrecondition, "holds version 2 of run 'run-a' epoch 0", refused);
    EXPECT_STATUS_MSG(FailedPrecondition, "would reuse version 2 with other contents", refused);
  }
  // A trainer restarted without resuming may not take the run's name either.
  {
    std::unique_ptr<Publisher> again = Trainer("run-a", /*resume=*/false);
    ASSERT_OK(again->AdoptBaseline(Views(model_a), 2));
    EXPECT_STATUS_MSG(FailedPrecondition, "run 'run-a' is held by the fleet already",
                      again->Sync(Views(model_a)));
  }
  ASSERT_NO_FATAL_FAILURE(ExpectFleetHolds(model_a, 2, "run-a", 0));

  // A restarts from its version-2 checkpoint and resumes the run (the fleet's, named by no run
  // id): epoch 1, and its syncs are deltas.
  std::unique_ptr<Publisher> resumed = Trainer("", /*resume=*/true);
  ASSERT_OK(resumed->AdoptBaseline(Views(model_a), 2));
  std::vector<Tensor> model_resumed = model_a;
  Step(model_resumed, rng);
  {
    ASSERT_OK_AND_ASSIGN(SyncReport report, resumed->Sync(Views(model_resumed)));
    EXPECT_FALSE(report.transfer.plan.anchor);
    for (const ReceiverOutcome& outcome : report.transfer.receivers) {
      EXPECT_EQ(outcome.caught_up_by, CatchUp::kDelta) << outcome.name;
    }
  }
  EXPECT_EQ(resumed->run_id(), "run-a");
  EXPECT_EQ(resumed->epoch(), 1u);
  ASSERT_NO_FATAL_FAILURE(ExpectFleetHolds(model_resumed, 3, "run-a", 1));

  // The old A is a zombie of epoch 0: fenced.
  Step(model_a, rng);
  EXPECT_STATUS_MSG(FailedPrecondition, "run 'run-a' epoch 0", trainer_a->Sync(Views(model_a)));
  EXPECT_STATUS_MSG(FailedPrecondition, "is fenced", trainer_a->Sync(Views(model_a)));
  ASSERT_NO_FATAL_FAILURE(ExpectFleetHolds(model_resumed, 3, "run-a", 1));

  // The daemon restarts from the file it saved: its version and lineage came back with it, and
  // it alone fences the zombie.
  ASSERT_OK(daemon_->Stop());
  daemon_.reset();
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<SafetensorsFile> saved,
                         SafetensorsFile::Open(saved_path_));
    EXPECT_EQ(WeightVersionOf(*saved), 3u);
    EXPECT_EQ(saved->metadata().at(kLineageRunMetadataKey), "run-a");
    EXPECT_EQ(saved->metadata().at(kLineageEpochMetadataKey), "1");
  }
  ASSERT_NO_FATAL_FAILURE(StartDaemon(saved_path_));
  {
    const ReceiverStatus restarted = StatusOf(daemon_url());
    EXPECT_EQ(restarted.version, 3u);
    EXPECT_EQ(restarted.lineage.run_id, "run-a");
    EXPECT_EQ(restarted.lineage.epoch, 1u);
    EXPECT_EQ(restarted.lineage, StatusOf(embedded_[0]->node->control_url()).lineage);
    ASSERT_OK(trainer_a->SetReceivers({{daemon_url(), daemon_->receivers()[0].data_endpoint}}));
    EXPECT_STATUS_MSG(FailedPrecondition, "is fenced", trainer_a->Sync(Views(model_a)));
    ASSERT_OK(resumed->SetReceivers(Fleet()));
  }

  // The resumed trainer goes on with deltas to the restarted daemon too.
  Step(model_resumed, rng);
  {
    ASSERT_OK_AND_ASSIGN(SyncReport report, resumed->Sync(Views(model_resumed)));
    EXPECT_FALSE(report.transfer.plan.anchor);
  }
  ASSERT_NO_FATAL_FAILURE(ExpectFleetHolds(model_resumed, 4, "run-a", 1));

  // A new run with no checkpoint of the fleet's: the fleet anchors to it above version 4.
  std::vector<Tensor> model_c = MakeModel(42);
  std::unique_ptr<Publisher> trainer_c = Trainer("run-c", /*resume=*/false);
  {
    ASSERT_OK_AND_ASSIGN(SyncReport report, trainer_c->Sync(Views(model_c)));
    EXPECT_EQ(report.transfer.plan.target_version, 5u);
    for (const ReceiverOutcome& outcome : report.transfer.receivers) {
      EXPECT_TRUE(report.transfer.plan.anchor || outcome.caught_up_by == CatchUp::kAnchor)
          << outcome.name;
    }
  }
  ASSERT_NO_FATAL_FAILURE(ExpectFleetHolds(model_c, 5, "run-c", 0));
  Step(model_c, rng);
  {
    ASSERT_OK_AND_ASSIGN(SyncReport report, trainer_c->Sync(Views(model_c)));
    EXPECT_FALSE(report.transfer.plan.anchor);
  }
  ASSERT_NO_FATAL_FAILURE(ExpectFleetHolds(model_c, 6, "run-c", 0));

  // The trainer it replaced is told its run was superseded, and changes nothing.
  Step(model_resumed, rng);
  EXPECT_STATUS_MSG(FailedPrecondition, "run 'run-a' epoch 1 was superseded",
                    resumed->Sync(Views(model_resumed)));
  ASSERT_NO_FATAL_FAILURE(ExpectFleetHolds(model_c, 6, "run-c", 0));
}

// W = 2 ranks: rank 0 decides the lineage for both. Restarted ranks that resume continue with
// deltas (the first one's base fingerprint is not stated: each rank knows only its own
// tensors' digests, and the flush's digest check verifies the adopted baseline), and the old
// pair of ranks is fenced.
TEST_F(LineageTest, TwoRanksResumeTheirRunAndTheOldPairIsFenced) {
  std::mt19937_64 rng(43);
  const std::vector<Tensor> step0 = MakeModel(43);
  for (int r = 0; r < 2; ++r) embedded_.push_back(StartEmbedded(step0));
  const auto make_ranks = [&](bool resume) {
    PublisherOptions options;
    options.transport_uri = "zmq://?timeout_ms=10000";
    options.stream.chunk_bytes = 16 << 10;
    options.stream.bucket_bytes = 8 << 10;
    options.transfer_timeout = std::chrono::seconds(60);
    for (const auto& receiver : embedded_) {
      options.receivers.push_back(
          {receiver->node->control_url(), receiver->node->producer_endpoint()});
    }
    options.run_id = "run-w2";
    options.resume = resume;
    std::vector<std::unique_ptr<Publisher>> ranks;
    std::vector<std::unique_ptr<ProducerGroup>> groups = MakeInProcessGroup(2).ValueOrDie();
    for (std::unique_ptr<ProducerGroup>& group : groups) {
      ranks.push_back(Publisher::Make(options, std::move(group)).ValueOrDie());
    }
    return ranks;
  };
  const auto sync = [](std::vector<std::unique_ptr<Publisher>>& ranks,
                       const std::vector<Tensor>& model) {
    Result<SyncReport> other = Status(StatusCode::kInternal, "unset");
    Result<SyncReport> leader = Status(StatusCode::kInternal, "unset");
    {
      std::jthread rank1([&] { other = ranks[1]->Sync(Views(model)); });
      leader = ranks[0]->Sync(Views(model));
    }
    return leader;
  };
  std::vector<Tensor> model = step0;
  std::vector<std::unique_ptr<Publisher>> first = make_ranks(false);
  for (auto& rank : first) ASSERT_OK(rank->AdoptBaseline(Views(step0), 0));
  Step(model, rng);
  ASSERT_OK_AND_ASSIGN(SyncReport report, sync(first, model));
  EXPECT_FALSE(report.transfer.plan.anchor);

  std::vector<std::unique_ptr<Publisher>> resumed = make_ranks(true);
  for (auto& rank : resumed) ASSERT_OK(rank->AdoptBaseline(Views(model), 1));
  Step(model, rng);
  ASSERT_OK_AND_ASSIGN(report, sync(resumed, model));
  EXPECT_FALSE(report.transfer.plan.anchor);
  EXPECT_EQ(resumed[0]->epoch(), 1u);
  for (const auto& receiver : embedded_) {
    const ReceiverStatus status = StatusOf(receiver->node->control_url());
    EXPECT_EQ(status.version, 2u);
    EXPECT_EQ(status.lineage.run_id, "run-w2");
    EXPECT_EQ(status.lineage.epoch, 1u);
    for (size_t t = 0; t < model.size(); ++t)
      EXPECT_TRUE(receiver->buffers[t].bits == model[t].bits);
  }
  EXPECT_STATUS_MSG(FailedPrecondition, "is fenced", sync(first, model));
  Step(model, rng);
  ASSERT_OK_AND_ASSIGN(report, sync(resumed, model));
  EXPECT_FALSE(report.transfer.plan.anchor);
  EXPECT_EQ(report.transfer.plan.target_version, 3u);
}

}  // namespace
}  // namespace refit
