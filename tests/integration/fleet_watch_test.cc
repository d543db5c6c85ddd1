// A joined receiver's fleet watch (ReceiverNodeOptions::fleet_watch_interval) over a Publisher's
// real membership endpoint: a member learns of a fleet version that no transfer brought it and
// says "behind"; Join, Leave and Stop from several threads at once (the user's, control-plane
// handlers) start and stop the watch one at a time, and a Join that loses to Stop is refused.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
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

// `resume`: a trainer restarted from the fleet's checkpoint, continuing run "fleet-watch-run".
std::unique_ptr<Publisher> MakeTrainer(uint16_t membership_port = 0, bool resume = false) {
  PublisherOptions options;
  options.run_id = "fleet-watch-run";
  options.resume = resume;
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.control.api_key = kKey;
  options.membership = MembershipOptions{};
  options.membership->port = membership_port;
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

// The trainer restarts: its new membership endpoint (same address) starts with an empty roster.
// Each member's watch finds itself unlisted and joins again, so the restarted trainer's next sync
// reaches every member with no member restarted or reconfigured — and one that left before the
// restart stays out.
TEST(FleetWatchTest, MembersJoinARestartedTrainerAgainByThemselves) {
  std::vector<Tensor> model = MakeModel(5);
  std::unique_ptr<Publisher> trainer = MakeTrainer();
  ASSERT_OK(trainer->AdoptBaseline(Views(model), 0));
  std::vector<std::unique_ptr<Member>> members;
  for (int m = 0; m < 3; ++m) {
    members.push_back(StartMember(model, std::chrono::milliseconds(50)));
    ASSERT_OK(members.back()->node->Join(trainer->membership_url()).status());
  }
  std::mt19937_64 rng(5);
  bf16_model::Step(model, rng);
  ASSERT_OK_AND_ASSIGN(SyncReport first, trainer->Sync(Views(model)));
  EXPECT_EQ(first.transfer.receivers.size(), 3u);
  ASSERT_OK(members[2]->node->Leave().status());

  const std::string url = trainer->membership_url();
  const auto port = static_cast<uint16_t>(std::stoi(url.substr(url.rfind(':') + 1)));
  trainer.reset();
  std::unique_ptr<Publisher> restarted = MakeTrainer(port, /*resume=*/true);
  ASSERT_EQ(restarted->membership_url(), url);
  ASSERT_OK(restarted->AdoptBaseline(Views(model), 1));
  const auto members_of = [](const Publisher& publisher) {
    Result<FleetMembership> fleet = publisher.membership();
    return fleet.ok() ? fleet->members.size() : size_t{0};
  };
  ASSERT_TRUE(Eventually([&] { return members_of(*restarted) == 2; }, std::chrono::seconds(10)))
      << members_of(*restarted) << " members";
  bf16_model::Step(model, rng);
  ASSERT_OK_AND_ASSIGN(SyncReport next, restarted->Sync(Views(model)));
  EXPECT_FALSE(next.transfer.plan.anchor);
  ASSERT_EQ(next.transfer.receivers.size(), 2u);
  for (const ReceiverOutcome& outcome : next.transfer.receivers) {
    EXPECT_EQ(outcome.caught_up_by, CatchUp::kDelta) << outcome.name;
    EXPECT_NE(outcome.name, members[2]->node->control_url()) << "the member that left";
  }
  for (int m = 0; m < 2; ++m) {
    for (size_t t = 0; t < model.size(); ++t) {
      EXPECT_EQ(members[m]->buffers[t].bits, model[t].bits) << "member " << m;
    }
    EXPECT_TRUE(members[m]->node->readiness().ready) << members[m]->node->readiness().detail;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // four watch intervals
  EXPECT_EQ(members_of(*restarted), 2u) << "the member that left stays out";
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
