// A joined receiver's fleet watch (ReceiverNodeOptions::fleet_watch_interval) over a Publisher's
// real membership endpoint: a member learns of a fleet version that no transfer brought it and
// says "behind"; Join, Leave and Stop from several threads at once (the user's, control-plane
// handlers) start and stop the watch one at a time, and a Join that loses to Stop is refused.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bf16_model.h"
#include "loopback.h"
#include "refit/control_client.h"
#include "refit/producer_group.h"
#include "refit/publisher.h"
#include "refit/readiness.h"
#include "refit/receiver_node.h"
#include "test_util.h"

namespace refit {
namespace {

using bf16_model::MakeModel;
using bf16_model::Tensor;
using bf16_model::Views;

constexpr char kKey[] = "fleet-watch-test-key";

struct Member {
  std::vector<Tensor> buffers;
  std::unique_ptr<ReceiverNode> node;
};

std::unique_ptr<Member> StartMember(const std::vector<Tensor>& loaded,
                                    std::chrono::milliseconds watch_interval) {
  auto member = std::make_unique<Member>();
  member->buffers = loaded;
  ReceiverNodeOptions options;
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.data_endpoint = testing::FreeLoopbackEndpoint();
  options.control.api_key = kKey;
  options.fleet_watch_interval = watch_interval;
  member->node = ReceiverNode::Make(options).ValueOrDie();
  for (Tensor& t : member->buffers) EXPECT_OK(member->node->RegisterTensor(t.mutable_view()));
  EXPECT_OK(member->node->Start());
  return member;
}

std::unique_ptr<Publisher> MakeTrainer() {
  PublisherOptions options;
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.control.api_key = kKey;
  options.membership = MembershipOptions{};
  return Publisher::Make(options, std::move(MakeInProcessGroup(1).ValueOrDie()[0])).ValueOrDie();
}

// Wait up to `limit` for `done`.
template <typename Done>
bool Eventually(Done done, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

TEST(FleetWatchTest, AMemberLearnsTheFleetsVersionThatNoTransferBroughtIt) {
  const std::vector<Tensor> model = MakeModel(3);
  std::unique_ptr<Publisher> trainer = MakeTrainer();
  ASSERT_OK(trainer->AdoptBaseline(Views(model), 0));
  std::unique_ptr<Member> member = StartMember(model, std::chrono::milliseconds(100));
  ASSERT_OK(member->node->Join(trainer->membership_url()).status());
  EXPECT_TRUE(member->node->readiness().ready) << member->node->readiness().detail;

  // The trainer restarts from a later checkpoint of the fleet (version 5): no transfer reaches
  // this member, yet within a few intervals it says it is behind.
  ASSERT_OK(trainer->AdoptBaseline(Views(model), 5));
  EXPECT_TRUE(
      Eventually([&] { return member->node->readiness().reason == ReadinessReason::kBehind; },
                 std::chrono::seconds(5)))
      << member->node->readiness().detail;
  const Readiness behind = member->node->readiness();
  EXPECT_FALSE(behind.ready);
  EXPECT_EQ(behind.fleet_version, 5u);
  EXPECT_EQ(behind.version, 0u);

  // Left, it no longer follows the fleet: "left", whatever the fleet does.
  ASSERT_OK(member->node->Leave().status());
  EXPECT_EQ(member->node->readiness().reason, ReadinessReason::kLeft);
}

TEST(FleetWatchTest, JoinLeaveAndStopFromManyThreadsStartAndStopTheWatchOneAtATime) {
  const std::vector<Tensor> model = MakeModel(4);
  std::unique_ptr<Publisher> trainer = MakeTrainer();
  ASSERT_OK(trainer->AdoptBaseline(Views(model), 0));
  std::unique_ptr<Member> member = StartMember(model, std::chrono::milliseconds(10));
  ControlClientOptions over_http;
  over_http.base_url = member->node->control_url();
  over_http.api_key = kKey;
  std::atomic<int> joins{0};
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        // Half through the node, half through its control plane's handlers.
        std::unique_ptr<ControlClient> client = ControlClient::Make(over_http).ValueOrDie();
        for (int i = 0; i < 15; ++i) {
          const bool http = (t + i) % 2 == 0;
          Result<FleetMembership> joined = http ? client->JoinFleet(trainer->membership_url())
                                                : member->node->Join(trainer->membership_url());
          if (joined.ok()) ++joins;
          // A leave may find no fleet (another thread left it first): FailedPrecondition.
          Result<FleetMembership> left = http ? client->LeaveFleet() : member->node->Leave();
          if (!left.ok()) {
            EXPECT_EQ(left.status().code(), StatusCode::kFailedPrecondition)
                << left.status().ToString();
          }
        }
      });
    }
  }
  EXPECT_EQ(joins.load(), 60);
  // Joins racing a Stop: each is either taken before it (and left by Stop) or refused.
  std::atomic<bool> stopping{false};
  std::jthread joiner([&] {
    while (!stopping) {
      Result<FleetMembership> joined = member->node->Join(trainer->membership_url());
      if (!joined.ok()) {
        EXPECT_EQ(joined.status().code(), StatusCode::kFailedPrecondition)
            << joined.status().ToString();
        return;
      }
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  member->node->Stop();
  stopping = true;
  joiner.join();
  EXPECT_STATUS_MSG(FailedPrecondition, "before Stop",
                    member->node->Join(trainer->membership_url()));
  ASSERT_OK_AND_ASSIGN(const FleetMembership fleet, trainer->membership());
  EXPECT_TRUE(fleet.members.empty()) << "Stop left the fleet it had joined";
}

}  // namespace
}  // namespace refit
