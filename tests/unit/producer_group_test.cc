#include "refit/producer_group.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "group_rounds.h"
#include "test_util.h"

namespace refit {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

/// Generous: collectives among threads complete in microseconds; this only bounds a hang.
constexpr seconds kGenerous{30};
/// For the calls that are meant to time out: short, since the test waits it out.
constexpr milliseconds kShort{200};

GroupClock::time_point Soon(GroupClock::duration wait = kGenerous) {
  return GroupClock::now() + wait;
}

TEST(InProcessGroupTest, RejectsWorldSizeZero) {
  EXPECT_STATUS(InvalidArgument, MakeInProcessGroup(0));
}

TEST(InProcessGroupTest, RanksAndWorldSize) {
  ASSERT_OK_AND_ASSIGN(auto ranks, MakeInProcessGroup(3));
  ASSERT_EQ(ranks.size(), 3u);
  for (uint32_t rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(ranks[rank]->rank(), rank);
    EXPECT_EQ(ranks[rank]->world_size(), 3u);
  }
  EXPECT_EQ(TcpGroupPort(*ranks[0]), 0);
}

class InProcessGroupSizeTest : public ::testing::TestWithParam<uint32_t> {};

// Alternating broadcasts and gathers (and two of each in a row, where rounds could slip): every
// rank gets exactly rank 0's message, rank 0 gets every message in rank order.
TEST_P(InProcessGroupSizeTest, SequenceOfCollectivesDeliversExactContents) {
  ASSERT_OK_AND_ASSIGN(auto ranks, MakeInProcessGroup(GetParam()));
  std::vector<ProducerGroup*> endpoints;
  for (auto& rank : ranks) endpoints.push_back(rank.get());
  testing::ExpectMixedRoundsDeliverExactly(endpoints, [] { return Soon(); });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, InProcessGroupSizeTest, ::testing::Values(1u, 2u, 5u));

TEST(InProcessGroupTest, GatherDeadlineNamesTheMissingRank) {
  ASSERT_OK_AND_ASSIGN(auto ranks, MakeInProcessGroup(4));
  // Ranks 1 and 3 contribute; rank 2 never calls.
  ASSERT_OK(ranks[1]->Gather("one", Soon()));
  ASSERT_OK(ranks[3]->Gather("three", Soon()));
  const Status failed = ranks[0]->Gather("zero", Soon(kShort)).status();
  EXPECT_STATUS_MSG(DeadlineExceeded, "rank 2 of 4 sent nothing by the deadline", failed);
  EXPECT_EQ(failed.message().find("rank 1 "), std::string::npos) << failed.message();
  EXPECT_EQ(failed.message().find("rank 3 "), std::string::npos) << failed.message();
}

TEST(InProcessGroupTest, BroadcastDeadlineNamesRankZero) {
  ASSERT_OK_AND_ASSIGN(auto ranks, MakeInProcessGroup(2));
  EXPECT_STATUS_MSG(DeadlineExceeded, "rank 0 of 2 sent nothing by the deadline",
                    ranks[1]->Broadcast("", Soon(kShort)));
}

// A rank that missed a round because its deadline passed is back in step at the next one: the
// late message of the abandoned round is never taken for the next round's.
TEST(InProcessGroupTest, LateMessageOfAnAbandonedRoundIsNotTakenForTheNext) {
  ASSERT_OK_AND_ASSIGN(auto ranks, MakeInProcessGroup(2));
  // Round 0, gather: rank 0 gives up before rank 1 contributes.
  EXPECT_STATUS(DeadlineExceeded, ranks[0]->Gather("zero", Soon(kShort)));
  ASSERT_OK(ranks[1]->Gather("late", Soon()));
  // Round 1, gather: rank 0 must see round 1's message, not the late one.
  ASSERT_OK(ranks[1]->Gather("on time", Soon()));
  ASSERT_OK_AND_ASSIGN(auto messages, ranks[0]->Gather("zero", Soon()));
  EXPECT_EQ(messages, (std::vector<std::string>{"zero", "on time"}));
  // Round 2, broadcast: rank 1 gives up first, and rank 0 posts afterwards.
  EXPECT_STATUS(DeadlineExceeded, ranks[1]->Broadcast("", Soon(kShort)));
  ASSERT_OK(ranks[0]->Broadcast("stale", Soon()));
  // Round 3: rank 1 gets round 3's message, not round 2's.
  ASSERT_OK(ranks[0]->Broadcast("fresh", Soon()));
  ASSERT_OK_AND_ASSIGN(std::string got, ranks[1]->Broadcast("", Soon()));
  EXPECT_EQ(got, "fresh");
}

TEST(InProcessGroupTest, DestroyedRankFailsGatherAndBroadcastStillReachesTheOthers) {
  ASSERT_OK_AND_ASSIGN(auto ranks, MakeInProcessGroup(4));
  testing::OnEveryRank(4, [&](uint32_t rank) {
    if (rank == 2) return;
    if (rank != 0) {
      ASSERT_OK(ranks[rank]->Gather(testing::GroupPayload(0, rank), Soon()));
      // Rank 0's abort after the failed gather reaches the survivors.
      ASSERT_OK_AND_ASSIGN(std::string decision, ranks[rank]->Broadcast("", Soon()));
      EXPECT_EQ(decision, "abort");
      return;
    }
    // Rank 0 is already waiting when rank 2 goes away (or finds it gone): either way the gather
    // fails at once, naming it, long before the deadline.
    std::jthread departure([&] { ranks[2].reset(); });
    const auto started = GroupClock::now();
    EXPECT_STATUS_MSG(Unavailable, "rank 2 of 4 left the group",
                      ranks[0]->Gather(testing::GroupPayload(0, 0), Soon()));
    EXPECT_LT(GroupClock::now() - started, kGenerous);
    departure.join();
    EXPECT_STATUS_MSG(Unavailable, "rank 2 of 4 left the group",
                      ranks[0]->Broadcast("abort", Soon()));
  });
}

TEST(InProcessGroupTest, DestroyedRankZeroFailsTheOthers) {
  ASSERT_OK_AND_ASSIGN(auto ranks, MakeInProcessGroup(3));
  testing::OnEveryRank(3, [&](uint32_t rank) {
    if (rank == 0) {
      ranks[0].reset();
      return;
    }
    EXPECT_STATUS_MSG(Unavailable, "rank 0 of 3 left the group",
                      ranks[rank]->Broadcast("", Soon()));
    EXPECT_STATUS_MSG(Unavailable, "rank 0 of 3 left the group",
                      ranks[rank]->Gather("report", Soon()));
  });
}

TEST(InProcessGroupTest, MessageDepositedBeforeLeavingIsDelivered) {
  ASSERT_OK_AND_ASSIGN(auto ranks, MakeInProcessGroup(2));
  ASSERT_OK(ranks[1]->Gather("last words", Soon()));
  ranks[1].reset();
  ASSERT_OK_AND_ASSIGN(auto messages, ranks[0]->Gather("zero", Soon()));
  EXPECT_EQ(messages, (std::vector<std::string>{"zero", "last words"}));
}

}  // namespace
}  // namespace refit
