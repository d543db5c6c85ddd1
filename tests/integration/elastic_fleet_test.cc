// Per-receiver plans over real loopback sockets (zmq:// data plane, HTTP control planes): W = 2
// publisher ranks and embedded ReceiverNodes. A newcomer that loaded the step-0 checkpoint and a
// member that missed three syncs join the fleet between syncs; the next sync catches both up
// while the current members' received bytes (their own byte counters) stay delta-sized, and
// every receiver ends bit-identical to the trainer.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bf16_model.h"
#include "loopback.h"
#include "refit/control_client.h"
#include "refit/producer_group.h"
#include "refit/publisher.h"
#include "refit/receiver_node.h"
#include "test_util.h"

namespace refit {
namespace {

using bf16_model::MakeModel;
using bf16_model::Step;
using bf16_model::Tensor;
using bf16_model::Views;

// A receiver embedded in this process over buffers it owns, as an engine owns its parameters.
struct Receiver {
  std::string who;
  std::vector<Tensor> buffers;
  std::unique_ptr<ReceiverNode> node;

  uint64_t received_bytes() const {
    ControlClientOptions options;
    options.base_url = node->control_url();
    auto client = ControlClient::Make(options).ValueOrDie();
    Result<ControlStatus> status = client->GetStatus();
    EXPECT_OK(status.status());
    return status.ok() ? status->receiver.received_bytes : 0;
  }
  uint64_t version() const {
    ControlClientOptions options;
    options.base_url = node->control_url();
    auto client = ControlClient::Make(options).ValueOrDie();
    Result<ControlStatus> status = client->GetStatus();
    EXPECT_OK(status.status());
    return status.ok() ? status->receiver.version : 0;
  }
  void ExpectHolds(const std::vector<Tensor>& model) const {
    for (size_t t = 0; t < model.size(); ++t) {
      EXPECT_TRUE(buffers[t].bits == model[t].bits) << who << ": tensor " << model[t].name;
    }
  }
};

std::unique_ptr<Receiver> StartReceiver(std::string who, const std::vector<Tensor>& loaded) {
  auto receiver = std::make_unique<Receiver>();
  receiver->who = std::move(who);
  receiver->buffers = loaded;
  ReceiverNodeOptions options;
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.data_endpoint = testing::FreeLoopbackEndpoint();
  Result<std::unique_ptr<ReceiverNode>> node = ReceiverNode::Make(options);
  EXPECT_OK(node.status());
  receiver->node = std::move(node).ValueOrDie();
  for (Tensor& t : receiver->buffers) {
    EXPECT_OK(receiver->node->RegisterTensor(t.mutable_view()));
  }
  EXPECT_OK(receiver->node->Start());
  return receiver;
}

class ElasticFleetTest : public ::testing::Test {
 protected:
  void MakeRanks(uint32_t world, uint32_t history_versions) {
    PublisherOptions options;
    options.transport_uri = "zmq://?timeout_ms=10000";
    options.stream.chunk_bytes = 16 << 10;  // 4 chunks of 2 tensors.
    options.stream.bucket_bytes = 8 << 10;
    options.stream.encode_threads = 1;
    options.stream.serialize_threads = 1;
    options.stream.send_threads = 1;
    options.transfer_timeout = std::chrono::seconds(60);
    options.history_versions = history_versions;
    options.receivers = {{"http://unused", "unused"}};
    auto groups = MakeInProcessGroup(world).ValueOrDie();
    for (std::unique_ptr<ProducerGroup>& group : groups) {
      ranks_.push_back(Publisher::Make(options, std::move(group)).ValueOrDie());
    }
  }

  void SetFleet(const std::vector<Receiver*>& fleet) {
    std::vector<PublisherReceiver> listed;
    for (Receiver* receiver : fleet) {
      listed.push_back({receiver->node->control_url(), receiver->node->producer_endpoint()});
    }
    ASSERT_OK(ranks_[0]->SetReceivers(std::move(listed)));
  }

  // Sync on every rank at once (SPMD); return rank 0's report.
  Result<SyncReport> SyncAll(const std::vector<Tensor>& model) {
    std::vector<Result<SyncReport>> results(ranks_.size(), Status(StatusCode::kInternal, "unset"));
    {
      std::vector<std::jthread> threads;
      for (size_t p = 1; p < ranks_.size(); ++p) {
        threads.emplace_back([&, p] { results[p] = ranks_[p]->Sync(Views(model)); });
      }
      results[0] = ranks_[0]->Sync(Views(model));
    }
    for (size_t p = 1; p < ranks_.size(); ++p) {
      EXPECT_TRUE(results[p].ok()) << "rank " << p << ": " << results[p].status().ToString();
    }
    return std::move(results[0]);
  }

  const ReceiverOutcome& OutcomeOf(const SyncReport& report, const Receiver& receiver) {
    for (const ReceiverOutcome& outcome : report.transfer.receivers) {
      if (outcome.name == receiver.node->control_url()) return outcome;
    }
    ADD_FAILURE() << "no outcome for " << receiver.who;
    return report.transfer.receivers.front();
  }

  std::vector<std::unique_ptr<Publisher>> ranks_;
};

TEST_F(ElasticFleetTest, ANewcomerAndALaggardCatchUpInOneSyncWhileTheMembersGetTheDelta) {
  std::mt19937_64 rng(40);
  const std::vector<Tensor> step0 = MakeModel(40);
  std::vector<Tensor> model = step0;
  std::vector<std::unique_ptr<Receiver>> members;
  for (const char* who : {"a", "b", "c"}) members.push_back(StartReceiver(who, step0));
  std::unique_ptr<Receiver> laggard = StartReceiver("laggard", step0);
  MakeRanks(/*world=*/2, /*history_versions=*/8);
  for (auto& rank : ranks_) ASSERT_OK(rank->AdoptBaseline(Views(step0), 0));

  std::vector<Receiver*> everyone = {members[0].get(), members[1].get(), members[2].get(),
                                     laggard.get()};
  // Two syncs with the laggard, then three without it (it was preempted).
  ASSERT_NO_FATAL_FAILURE(SetFleet(everyone));
  for (int s = 0; s < 2; ++s) {
    Step(model, rng);
    ASSERT_OK(SyncAll(model).status());
  }
  ASSERT_NO_FATAL_FAILURE(SetFleet({members[0].get(), members[1].get(), members[2].get()}));
  uint64_t delta_bytes = 0;
  for (int s = 0; s < 3; ++s) {
    Step(model, rng);
    const uint64_t before = members[0]->received_bytes();
    ASSERT_OK_AND_ASSIGN(SyncReport report, SyncAll(model));
    EXPECT_FALSE(report.transfer.plan.anchor);
    delta_bytes = std::max(delta_bytes, members[0]->received_bytes() - before);
  }
  ASSERT_GT(delta_bytes, 0u);
  ASSERT_EQ(laggard->version(), 2u);

  // A newcomer that loaded the step-0 checkpoint and the laggard join between syncs.
  std::unique_ptr<Receiver> newcomer = StartReceiver("newcomer", step0);
  everyone.push_back(newcomer.get());
  ASSERT_NO_FATAL_FAILURE(SetFleet(everyone));
  Step(model, rng);
  std::vector<uint64_t> before;
  for (Receiver* receiver : everyone) before.push_back(receiver->received_bytes());
  ASSERT_OK_AND_ASSIGN(SyncReport joined, SyncAll(model));

  EXPECT_FALSE(joined.transfer.plan.anchor) << "one receiver behind must not anchor the fleet";
  EXPECT_EQ(joined.transfer.plan.base_version, 5u);
  for (size_t r = 0; r < everyone.size(); ++r) {
    SCOPED_TRACE(everyone[r]->who);
    EXPECT_EQ(everyone[r]->version(), 6u);
    everyone[r]->ExpectHolds(model);
  }
  const uint64_t model_bytes = 8 * 4096 * 2;
  for (size_t r = 0; r < 3; ++r) {
    SCOPED_TRACE(members[r]->who);
    const ReceiverOutcome& outcome = OutcomeOf(joined, *members[r]);
    EXPECT_EQ(outcome.caught_up_by, CatchUp::kDelta);
    EXPECT_EQ(outcome.lag, 0u);
    // Delta-sized, from its own byte counter: no more than twice the largest delta before, and
    // a small fraction of the model.
    const uint64_t received = members[r]->received_bytes() - before[r];
    EXPECT_EQ(received, outcome.wire_bytes);
    EXPECT_LE(received, 2 * delta_bytes);
    EXPECT_LT(received * 4, model_bytes);
  }
  // Both are within the retained history (8 versions): each is prepared from its own version to
  // the target and gets the deltas it missed folded into one, far below an anchor.
  for (Receiver* behind : {laggard.get(), newcomer.get()}) {
    SCOPED_TRACE(behind->who);
    const ReceiverOutcome& outcome = OutcomeOf(joined, *behind);
    EXPECT_EQ(outcome.caught_up_by, CatchUp::kFolded);
    const uint64_t received = behind->received_bytes() - before[behind == laggard.get() ? 3 : 4];
    EXPECT_EQ(received, outcome.wire_bytes);
    EXPECT_LT(received * 2, model_bytes) << "a fold of a few sparse deltas, not an anchor";
  }
  EXPECT_EQ(OutcomeOf(joined, *laggard).held_version, 2u);
  EXPECT_EQ(OutcomeOf(joined, *laggard).lag, 3u);
  EXPECT_EQ(OutcomeOf(joined, *newcomer).held_version, 0u);
  EXPECT_EQ(OutcomeOf(joined, *newcomer).lag, 5u);
  EXPECT_EQ(joined.transfer.wire_bytes, [&] {
    uint64_t routes = 0;
    for (const StreamReport& producer : joined.transfer.producers) routes += producer.wire_bytes;
    return routes;
  }());

  // From then on the whole fleet is current: every receiver gets the delta.
  Step(model, rng);
  ASSERT_OK_AND_ASSIGN(SyncReport next, SyncAll(model));
  for (Receiver* receiver : everyone) {
    SCOPED_TRACE(receiver->who);
    EXPECT_EQ(OutcomeOf(next, *receiver).caught_up_by, CatchUp::kDelta);
    receiver->ExpectHolds(model);
  }
}

// Beyond the retained history (here 2 versions) a receiver gets an anchor for itself alone; the
// members still get the delta.
TEST_F(ElasticFleetTest, AReceiverBeyondTheRetainedHistoryGetsAnAnchorOfItsOwn) {
  std::mt19937_64 rng(41);
  const std::vector<Tensor> step0 = MakeModel(41);
  std::vector<Tensor> model = step0;
  std::unique_ptr<Receiver> member = StartReceiver("member", step0);
  std::unique_ptr<Receiver> laggard = StartReceiver("laggard", step0);
  MakeRanks(/*world=*/2, /*history_versions=*/2);
  for (auto& rank : ranks_) ASSERT_OK(rank->AdoptBaseline(Views(step0), 0));
  ASSERT_NO_FATAL_FAILURE(SetFleet({member.get()}));
  for (int s = 0; s < 3; ++s) {
    Step(model, rng);
    ASSERT_OK(SyncAll(model).status());
  }
  ASSERT_NO_FATAL_FAILURE(SetFleet({member.get(), laggard.get()}));
  Step(model, rng);
  const uint64_t member_before = member->received_bytes();
  const uint64_t laggard_before = laggard->received_bytes();
  ASSERT_OK_AND_ASSIGN(SyncReport joined, SyncAll(model));
  EXPECT_FALSE(joined.transfer.plan.anchor);
  EXPECT_EQ(OutcomeOf(joined, *member).caught_up_by, CatchUp::kDelta);
  EXPECT_EQ(OutcomeOf(joined, *laggard).caught_up_by, CatchUp::kAnchor);
  EXPECT_EQ(OutcomeOf(joined, *laggard).lag, 3u);
  const uint64_t model_bytes = 8 * 4096 * 2;
  EXPECT_GE((laggard->received_bytes() - laggard_before) * 2, model_bytes);
  EXPECT_LT((member->received_bytes() - member_before) * 4, model_bytes);
  for (Receiver* receiver : {member.get(), laggard.get()}) {
    SCOPED_TRACE(receiver->who);
    EXPECT_EQ(receiver->version(), 4u);
    receiver->ExpectHolds(model);
  }
}

}  // namespace
}  // namespace refit
