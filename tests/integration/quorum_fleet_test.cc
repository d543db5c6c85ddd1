// Stragglers and quorum over real loopback sockets (zmq:// data plane, HTTP control planes): W = 2
// publisher ranks and embedded ReceiverNodes (docs/protocol.md "Stragglers and quorum"). One
// receiver's apply is stalled past the flush deadline (its apply hook blocks, as a wedged engine
// or a paused process would): under a quorum the others commit and the straggler is fenced — it
// never reports or holds the new version — and the next sync catches it up by folded deltas,
// bit-identically, while the members get the delta. Below the quorum, and when every receiver
// fails, the sync still aborts everywhere.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
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

using std::chrono::milliseconds;

using bf16_model::MakeModel;
using bf16_model::Step;
using bf16_model::Tensor;
using bf16_model::Views;

// A receiver embedded in this process over buffers it owns, whose apply thread can be stalled.
struct Receiver {
  std::string who;
  std::vector<Tensor> buffers;
  std::unique_ptr<ReceiverNode> node;
  // While set, every payload's apply waits (the apply thread is stuck; staging and relaying go
  // on, as in an engine whose weight copy hangs).
  std::atomic<bool> stalled{false};

  // A test that fails while the apply thread is stuck must not hang in the node's Stop: the stall
  // ends before `node` is destroyed (members are destroyed after this body).
  ~Receiver() { stalled = false; }

  ControlStatus status() const {
    ControlClientOptions options;
    options.base_url = node->control_url();
    auto client = ControlClient::Make(options).ValueOrDie();
    Result<ControlStatus> asked = client->GetStatus();
    EXPECT_OK(asked.status());
    return asked.ok() ? *asked : ControlStatus{};
  }
  uint64_t version() const { return status().receiver.version; }
  // The status if it answers within `timeout` (a wedged receiver may not).
  Result<ControlStatus> TryStatus(milliseconds timeout) const {
    ControlClientOptions options;
    options.base_url = node->control_url();
    options.timeout = timeout;
    auto client = ControlClient::Make(options).ValueOrDie();
    return client->GetStatus();
  }
  bool Holds(const std::vector<Tensor>& model) const {
    for (size_t t = 0; t < model.size(); ++t) {
      if (buffers[t].bits != model[t].bits) return false;
    }
    return true;
  }
};

std::unique_ptr<Receiver> StartReceiver(std::string who, const std::vector<Tensor>& loaded) {
  auto receiver = std::make_unique<Receiver>();
  receiver->who = std::move(who);
  receiver->buffers = loaded;
  ReceiverNodeOptions options;
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.data_endpoint = testing::FreeLoopbackEndpoint();
  // Room for every payload of a sync, so a stalled apply never holds up staging (and the relay
  // tree): the straggler misses the flush, not the stream.
  options.session.apply_queue_depth = 256;
  Receiver* self = receiver.get();
  options.session.before_apply = [self](const PayloadIds&) {
    while (self->stalled.load()) std::this_thread::sleep_for(milliseconds(5));
  };
  Result<std::unique_ptr<ReceiverNode>> node = ReceiverNode::Make(options);
  EXPECT_OK(node.status());
  receiver->node = std::move(node).ValueOrDie();
  for (Tensor& t : receiver->buffers) {
    EXPECT_OK(receiver->node->RegisterTensor(t.mutable_view()));
  }
  EXPECT_OK(receiver->node->Start());
  return receiver;
}

// Wait until `receiver` has no transfer open (its abort, lost or late, has run), at most 20 s.
void WaitIdle(const Receiver& receiver) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (receiver.status().receiver.state != ReceiverState::kIdle &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(20));
  }
}

class QuorumFleetTest : public ::testing::Test {
 protected:
  // `transfer_timeout`: the flush deadline a stalled receiver misses.
  void MakeRanks(const std::string& commit_policy, milliseconds transfer_timeout,
                 const std::vector<Receiver*>& fleet) {
    PublisherOptions options;
    options.transport_uri = "zmq://?timeout_ms=10000";
    options.stream.chunk_bytes = 16 << 10;  // 4 chunks of 2 tensors.
    options.stream.bucket_bytes = 8 << 10;
    options.stream.encode_threads = 1;
    options.stream.serialize_threads = 1;
    options.stream.send_threads = 1;
    options.transfer_timeout = transfer_timeout;
    options.commit_policy = ParseCommitPolicy(commit_policy).ValueOrDie();
    // A receiver whose status does not answer within this is left out of the sync (fenced).
    options.control.timeout = std::chrono::seconds(2);
    for (Receiver* receiver : fleet) {
      options.receivers.push_back(
          {receiver->node->control_url(), receiver->node->producer_endpoint()});
    }
    auto groups = MakeInProcessGroup(2).ValueOrDie();
    for (std::unique_ptr<ProducerGroup>& group : groups) {
      ranks_.push_back(Publisher::Make(options, std::move(group)).ValueOrDie());
    }
  }

  // Sync on every rank at once (SPMD); return rank 0's result.
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
      EXPECT_EQ(results[p].ok(), results[0].ok())
          << "rank " << p << ": " << results[p].status().ToString();
    }
    return std::move(results[0]);
  }

  static const ReceiverOutcome& OutcomeOf(const SyncReport& report, const Receiver& receiver) {
    for (const ReceiverOutcome& outcome : report.transfer.receivers) {
      if (outcome.name == receiver.node->control_url()) return outcome;
    }
    ADD_FAILURE() << "no outcome for " << receiver.who;
    return report.transfer.receivers.front();
  }

  std::vector<std::unique_ptr<Publisher>> ranks_;
};

TEST_F(QuorumFleetTest, AStalledReceiverIsFencedAndCaughtUpAtTheNextSyncBitIdentically) {
  std::mt19937_64 rng(42);
  const std::vector<Tensor> step0 = MakeModel(42);
  std::vector<Tensor> model = step0;
  std::vector<std::unique_ptr<Receiver>> owned;
  for (const char* who : {"a", "b", "c", "straggler"}) owned.push_back(StartReceiver(who, step0));
  std::vector<Receiver*> fleet;
  for (auto& receiver : owned) fleet.push_back(receiver.get());
  Receiver& straggler = *owned.back();
  // 3 of the 4 replicas must flush.
  MakeRanks("quorum:0.75", std::chrono::seconds(4), fleet);
  for (auto& rank : ranks_) ASSERT_OK(rank->AdoptBaseline(Views(step0), 0));

  Step(model, rng);
  ASSERT_OK_AND_ASSIGN(SyncReport first, SyncAll(model));
  EXPECT_TRUE(first.transfer.fenced.empty());
  EXPECT_EQ(first.transfer.flushed_replicas, 4u);
  const std::vector<Tensor> at_v1 = model;

  // The straggler stalls: it stages the payloads (and relays them) but never applies them in time.
  straggler.stalled = true;
  Step(model, rng);
  ASSERT_OK_AND_ASSIGN(SyncReport fenced, SyncAll(model));
  EXPECT_EQ(fenced.transfer.plan.target_version, 2u);
  ASSERT_EQ(fenced.transfer.fenced.size(), 1u);
  EXPECT_EQ(fenced.transfer.fenced[0], straggler.node->control_url());
  EXPECT_EQ(fenced.transfer.replicas, 4u);
  EXPECT_EQ(fenced.transfer.flushed_replicas, 3u);
  const ReceiverOutcome& outcome = OutcomeOf(fenced, straggler);
  EXPECT_TRUE(outcome.fenced);
  EXPECT_FALSE(outcome.fenced_because.ok());
  EXPECT_EQ(outcome.held_version, 1u);
  for (Receiver* member : {fleet[0], fleet[1], fleet[2]}) {
    SCOPED_TRACE(member->who);
    EXPECT_FALSE(OutcomeOf(fenced, *member).fenced);
    EXPECT_OK(OutcomeOf(fenced, *member).commit_status);
    EXPECT_EQ(member->version(), 2u);
    EXPECT_TRUE(member->Holds(model));
  }
  for (auto& rank : ranks_) EXPECT_EQ(rank->version(), 2u) << "the fleet's version is the target";
  // While stalled it never reports the new version (its control plane may not answer at all:
  // its abort waits for the payload its apply thread is stuck in).
  if (Result<ControlStatus> stuck = straggler.TryStatus(milliseconds(500)); stuck.ok()) {
    EXPECT_EQ(stuck->receiver.version, 1u);
  }

  // Still stalled at the next sync: its status does not answer, so it is left out of the sync and
  // fenced before the transfer starts; the others commit (3 of 4 replicas answered).
  Step(model, rng);
  ASSERT_OK_AND_ASSIGN(SyncReport left_out, SyncAll(model));
  EXPECT_EQ(left_out.transfer.plan.target_version, 3u);
  ASSERT_EQ(left_out.transfer.fenced.size(), 1u);
  EXPECT_EQ(left_out.transfer.fenced[0], straggler.node->control_url());
  EXPECT_EQ(left_out.transfer.replicas, 4u);
  EXPECT_EQ(left_out.transfer.flushed_replicas, 3u);
  EXPECT_TRUE(OutcomeOf(left_out, straggler).fenced);
  EXPECT_STATUS_MSG(DeadlineExceeded, "GET /v1/status",
                    OutcomeOf(left_out, straggler).fenced_because);
  for (Receiver* member : {fleet[0], fleet[1], fleet[2]}) {
    SCOPED_TRACE(member->who);
    EXPECT_EQ(member->version(), 3u);
    EXPECT_TRUE(member->Holds(model));
  }

  // It resumes: its abort runs, and it holds the version it had, bit-exactly.
  straggler.stalled = false;
  WaitIdle(straggler);
  const ControlStatus resumed = straggler.status();
  EXPECT_EQ(resumed.receiver.version, 1u);
  EXPECT_EQ(resumed.receiver.state, ReceiverState::kIdle);
  EXPECT_TRUE(straggler.Holds(at_v1)) << "a fenced receiver is rolled back to the base";

  // The next sync: the members get the delta; the straggler, two versions behind, is prepared
  // from the version it holds and caught up by the folded deltas 1 → 4.
  Step(model, rng);
  std::vector<uint64_t> before;
  for (Receiver* receiver : fleet) before.push_back(receiver->status().receiver.received_bytes);
  ASSERT_OK_AND_ASSIGN(SyncReport caught_up, SyncAll(model));
  EXPECT_FALSE(caught_up.transfer.plan.anchor);
  EXPECT_TRUE(caught_up.transfer.fenced.empty());
  EXPECT_EQ(caught_up.transfer.plan.base_version, 3u);
  const ReceiverOutcome& again = OutcomeOf(caught_up, straggler);
  EXPECT_EQ(again.caught_up_by, CatchUp::kFolded);
  EXPECT_EQ(again.held_version, 1u);
  EXPECT_EQ(again.lag, 2u);
  const uint64_t model_bytes = 8 * 4096 * 2;
  for (size_t r = 0; r < fleet.size(); ++r) {
    SCOPED_TRACE(fleet[r]->who);
    EXPECT_EQ(fleet[r]->version(), 4u);
    EXPECT_TRUE(fleet[r]->Holds(model)) << "bit-identical to the trainer";
    const uint64_t received = fleet[r]->status().receiver.received_bytes - before[r];
    EXPECT_LT(received * 4, model_bytes) << "delta-sized: no anchor for anyone";
    if (fleet[r] != &straggler) {
      EXPECT_EQ(OutcomeOf(caught_up, *fleet[r]).caught_up_by, CatchUp::kDelta);
    }
  }
}

TEST_F(QuorumFleetTest, BelowTheQuorumAndWhenEveryReceiverFailsTheSyncAbortsEverywhere) {
  std::mt19937_64 rng(43);
  const std::vector<Tensor> step0 = MakeModel(43);
  std::vector<Tensor> model = step0;
  std::vector<std::unique_ptr<Receiver>> owned;
  for (const char* who : {"a", "b", "c"}) owned.push_back(StartReceiver(who, step0));
  std::vector<Receiver*> fleet;
  for (auto& receiver : owned) fleet.push_back(receiver.get());
  MakeRanks("quorum:2", std::chrono::seconds(3), fleet);
  for (auto& rank : ranks_) ASSERT_OK(rank->AdoptBaseline(Views(step0), 0));
  Step(model, rng);
  ASSERT_OK(SyncAll(model).status());
  const std::vector<Tensor> at_v1 = model;

  // Two of three stalled: one replica flushed, the quorum needs two.
  fleet[1]->stalled = true;
  fleet[2]->stalled = true;
  Step(model, rng);
  Result<SyncReport> short_of_quorum = SyncAll(model);
  EXPECT_STATUS_MSG(DeadlineExceeded, "1 of 3 replica(s) flushed; commit policy quorum:2 needs 2",
                    short_of_quorum);
  for (Receiver* receiver : fleet) receiver->stalled = false;
  for (Receiver* receiver : fleet) {
    SCOPED_TRACE(receiver->who);
    WaitIdle(*receiver);
    EXPECT_EQ(receiver->version(), 1u);
    EXPECT_TRUE(receiver->Holds(at_v1)) << "aborted everywhere, the one that flushed included";
  }
  for (auto& rank : ranks_) EXPECT_EQ(rank->version(), 1u);

  // Every receiver stalled: nothing to commit on, whatever the quorum.
  for (Receiver* receiver : fleet) receiver->stalled = true;
  Result<SyncReport> none = SyncAll(model);
  EXPECT_STATUS_MSG(DeadlineExceeded, "0 of 3 replica(s) flushed", none);
  for (Receiver* receiver : fleet) receiver->stalled = false;
  for (Receiver* receiver : fleet) {
    SCOPED_TRACE(receiver->who);
    WaitIdle(*receiver);
    EXPECT_EQ(receiver->version(), 1u);
    EXPECT_TRUE(receiver->Holds(at_v1));
  }

  // The fleet is whole again: the next sync is a delta for every receiver.
  ASSERT_OK_AND_ASSIGN(SyncReport next, SyncAll(model));
  EXPECT_FALSE(next.transfer.plan.anchor);
  EXPECT_EQ(next.transfer.plan.base_version, 1u);
  for (Receiver* receiver : fleet) {
    SCOPED_TRACE(receiver->who);
    EXPECT_EQ(OutcomeOf(next, *receiver).caught_up_by, CatchUp::kDelta);
    EXPECT_EQ(receiver->version(), 2u);
    EXPECT_TRUE(receiver->Holds(model));
  }
}

TEST_F(QuorumFleetTest, AQuorumLargerThanTheFleetOrWithoutRelayTreesIsRefusedByName) {
  const std::vector<Tensor> step0 = MakeModel(44);
  std::unique_ptr<Receiver> only = StartReceiver("only", step0);
  MakeRanks("quorum:2", std::chrono::seconds(10), {only.get()});
  for (auto& rank : ranks_) ASSERT_OK(rank->AdoptBaseline(Views(step0), 0));
  EXPECT_STATUS_MSG(InvalidArgument, "the fleet has 1 replica(s), fewer than the quorum of 2",
                    SyncAll(step0));
  EXPECT_EQ(only->version(), 0u);

  PublisherOptions options;
  options.transport_uri = "inproc://quorum-no-trees";
  options.receivers = {{"http://127.0.0.1:1", ""}};
  options.commit_policy = ParseCommitPolicy("quorum:1").ValueOrDie();
  auto groups = MakeInProcessGroup(1).ValueOrDie();
  EXPECT_STATUS_MSG(InvalidArgument, "needs a transport with relay trees",
                    Publisher::Make(options, std::move(groups[0])));
}

}  // namespace
}  // namespace refit
