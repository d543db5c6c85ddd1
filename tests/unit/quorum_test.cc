// The commit policy and the quorum decision (docs/protocol.md "Stragglers and quorum"): parsing
// and its errors, the replicas a quorum needs, and DecideCommit counting replicas — a shard group
// counts only when every shard flushed — with the edge cases: every replica failed, exactly the
// quorum, one short of it, a fleet of one.
#include "pipeline/quorum.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "refit/commit_policy.h"
#include "refit/status_format.h"
#include "test_util.h"

namespace refit {
namespace {

CommitPolicy Quorum(uint32_t count) {
  return CommitPolicy{.kind = CommitPolicy::Kind::kQuorum, .count = count};
}
CommitPolicy QuorumFraction(double fraction) {
  return CommitPolicy{.kind = CommitPolicy::Kind::kQuorum, .fraction = fraction};
}

TEST(CommitPolicyTest, ParsesEveryFormAndNamesBadOnes) {
  ASSERT_OK_AND_ASSIGN(CommitPolicy all, ParseCommitPolicy("all"));
  EXPECT_EQ(all, CommitPolicy{});
  ASSERT_OK_AND_ASSIGN(CommitPolicy two, ParseCommitPolicy("quorum:2"));
  EXPECT_EQ(two, Quorum(2));
  ASSERT_OK_AND_ASSIGN(CommitPolicy half, ParseCommitPolicy("quorum:0.5"));
  EXPECT_EQ(half, QuorumFraction(0.5));
  ASSERT_OK_AND_ASSIGN(CommitPolicy most, ParseCommitPolicy("quorum:75%"));
  EXPECT_EQ(most, QuorumFraction(0.75));
  ASSERT_OK_AND_ASSIGN(CommitPolicy whole, ParseCommitPolicy("quorum:1.0"));
  EXPECT_EQ(whole, QuorumFraction(1.0));
  for (const char* text : {"", "All", "quorum", "quorum:", "quorum:0", "quorum:0.0", "quorum:-1",
                           "quorum:1.5", "quorum:101%", "quorum:0%", "quorum:two", "quorum:2x",
                           "quorum:nan", "quorum:inf", "quorum:99999999999"}) {
    SCOPED_TRACE(text);
    const Status status = ParseCommitPolicy(text).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find(std::string("'") + text + "'"), std::string_view::npos)
        << status.message();
  }
  EXPECT_EQ(CommitPolicyName(all), "all");
  EXPECT_EQ(CommitPolicyName(two), "quorum:2");
  EXPECT_EQ(CommitPolicyName(half), "quorum:0.5");
  ASSERT_OK_AND_ASSIGN(CommitPolicy again, ParseCommitPolicy(CommitPolicyName(half)));
  EXPECT_EQ(again, half);
}

TEST(CommitPolicyTest, HandBuiltPoliciesAreChecked) {
  EXPECT_OK(CheckCommitPolicy(CommitPolicy{}));
  EXPECT_STATUS_MSG(InvalidArgument, "count 0 and fraction 0",
                    CheckCommitPolicy(CommitPolicy{.kind = CommitPolicy::Kind::kQuorum}));
  EXPECT_STATUS(InvalidArgument, CheckCommitPolicy(QuorumFraction(1.01)));
  EXPECT_STATUS_MSG(InvalidArgument, "not both",
                    CheckCommitPolicy(CommitPolicy{
                        .kind = CommitPolicy::Kind::kQuorum, .count = 2, .fraction = 0.5}));
}

TEST(CommitPolicyTest, RequiredReplicasRoundsUpAndRefusesMoreThanTheFleet) {
  ASSERT_OK_AND_ASSIGN(uint64_t n, RequiredReplicas(CommitPolicy{}, 5));
  EXPECT_EQ(n, 5u);
  ASSERT_OK_AND_ASSIGN(n, RequiredReplicas(Quorum(3), 5));
  EXPECT_EQ(n, 3u);
  ASSERT_OK_AND_ASSIGN(n, RequiredReplicas(QuorumFraction(0.5), 4));
  EXPECT_EQ(n, 2u);
  ASSERT_OK_AND_ASSIGN(n, RequiredReplicas(QuorumFraction(0.5), 5));
  EXPECT_EQ(n, 3u);
  ASSERT_OK_AND_ASSIGN(n, RequiredReplicas(QuorumFraction(0.01), 3));
  EXPECT_EQ(n, 1u) << "a quorum needs at least one replica";
  ASSERT_OK_AND_ASSIGN(n, RequiredReplicas(QuorumFraction(1.0), 7));
  EXPECT_EQ(n, 7u);
  EXPECT_STATUS_MSG(InvalidArgument, "the fleet has 2 replica(s), fewer than the quorum of 3",
                    RequiredReplicas(Quorum(3), 2));
}

// Four replicas: two unsharded receivers (0, 1) and two shard groups of two (2+3, 4+5).
const std::vector<std::vector<size_t>> kReplicas = {{0}, {1}, {2, 3}, {4, 5}};
constexpr size_t kReceivers = 6;

TEST(QuorumTest, AllCommitsOnlyWhenEveryReplicaFlushed) {
  ASSERT_OK_AND_ASSIGN(CommitDecision every,
                       DecideCommit(CommitPolicy{}, kReplicas, {true, true, true, true}, 6));
  EXPECT_TRUE(every.commit);
  EXPECT_EQ(every.fenced, std::vector<bool>(kReceivers, false));
  ASSERT_OK_AND_ASSIGN(CommitDecision one_short,
                       DecideCommit(CommitPolicy{}, kReplicas, {true, true, false, true}, 6));
  EXPECT_FALSE(one_short.commit);
  EXPECT_EQ(one_short.fenced, std::vector<bool>(kReceivers, false)) << "abort everywhere";
}

TEST(QuorumTest, AQuorumFencesTheReplicasThatDidNotFlushWholeShardGroupsIncluded) {
  // Replica 2 (a shard group) did not flush on one shard: both its shards are fenced.
  ASSERT_OK_AND_ASSIGN(CommitDecision decided,
                       DecideCommit(Quorum(3), kReplicas, {true, true, false, true}, kReceivers));
  EXPECT_TRUE(decided.commit);
  EXPECT_EQ(decided.fenced, (std::vector<bool>{false, false, true, true, false, false}));
  EXPECT_EQ(decided.replicas, 4u);
  EXPECT_EQ(decided.flushed_replicas, 3u);
  EXPECT_EQ(decided.required_replicas, 3u);
  // Exactly the quorum commits; one short of it aborts everywhere, fencing nobody.
  ASSERT_OK_AND_ASSIGN(decided,
                       DecideCommit(Quorum(2), kReplicas, {false, true, false, true}, kReceivers));
  EXPECT_TRUE(decided.commit);
  EXPECT_EQ(decided.fenced, (std::vector<bool>{true, false, true, true, false, false}));
  ASSERT_OK_AND_ASSIGN(decided,
                       DecideCommit(Quorum(3), kReplicas, {false, true, false, true}, kReceivers));
  EXPECT_FALSE(decided.commit);
  EXPECT_EQ(decided.flushed_replicas, 2u);
  EXPECT_EQ(decided.fenced, std::vector<bool>(kReceivers, false));
  // A fraction: half of 4 replicas is 2.
  ASSERT_OK_AND_ASSIGN(decided, DecideCommit(QuorumFraction(0.5), kReplicas,
                                             {false, false, true, true}, kReceivers));
  EXPECT_TRUE(decided.commit);
  EXPECT_EQ(decided.fenced, (std::vector<bool>{true, true, false, false, false, false}));
}

TEST(QuorumTest, AFailureOfEveryReplicaAbortsEverywhereWhateverThePolicy) {
  for (const CommitPolicy& policy : {Quorum(1), QuorumFraction(0.01), CommitPolicy{}}) {
    SCOPED_TRACE(CommitPolicyName(policy));
    ASSERT_OK_AND_ASSIGN(CommitDecision decided,
                         DecideCommit(policy, kReplicas, {false, false, false, false}, 6));
    EXPECT_FALSE(decided.commit);
    EXPECT_EQ(decided.flushed_replicas, 0u);
    EXPECT_EQ(decided.fenced, std::vector<bool>(kReceivers, false));
  }
  // A fleet of one replica: a quorum of 1 is `all`.
  const std::vector<std::vector<size_t>> one = {{0}};
  ASSERT_OK_AND_ASSIGN(CommitDecision decided, DecideCommit(Quorum(1), one, {false}, 1));
  EXPECT_FALSE(decided.commit);
  ASSERT_OK_AND_ASSIGN(decided, DecideCommit(Quorum(1), one, {true}, 1));
  EXPECT_TRUE(decided.commit);
}

TEST(QuorumTest, BadInputsAreNamed) {
  EXPECT_STATUS_MSG(InvalidArgument, "fewer than the quorum of 5",
                    DecideCommit(Quorum(5), kReplicas, {true, true, true, true}, kReceivers));
  EXPECT_STATUS_MSG(InvalidArgument, "4 replicas but 3 flush results",
                    DecideCommit(Quorum(1), kReplicas, {true, true, true}, kReceivers));
  EXPECT_STATUS_MSG(InvalidArgument, "names receiver 5 of 5",
                    DecideCommit(Quorum(1), kReplicas, {true, true, true, false}, 5));
}

// Before a transfer, under a quorum: receivers that did not answer their status are left out,
// and so is every shard of a group that lacks one; the quorum stays counted over the whole fleet.
TEST(QuorumTest, ReceiversThatDidNotAnswerAreLeftOutAndStillCounted) {
  const std::vector<std::string> names = {"a", "b", "tp0", "tp1", "gone", "gone-tp1"};
  const std::vector<std::optional<ReplicaPlace>> places = {
      ReplicaPlace{}, ReplicaPlace{}, ReplicaPlace{"engine", 0, 2}, ReplicaPlace{"engine", 1, 2},
      std::nullopt,   std::nullopt,
  };
  const std::vector<Status> errors = {Status::OK(),
                                      Status::OK(),
                                      Status::OK(),
                                      Status::OK(),
                                      Unavailable("gone: connection refused"),
                                      DeadlineExceeded("gone-tp1: no answer")};
  // Both unanswered receivers count as replicas of their own: 2 + 1 + 2 = 5 replicas.
  ASSERT_OK_AND_ASSIGN(QuorumFleet fleet,
                       LeaveOutUnanswered(QuorumFraction(0.5), names, places, errors));
  EXPECT_EQ(fleet.included, (std::vector<bool>{true, true, true, true, false, false}));
  EXPECT_EQ(fleet.replicas, 5u);
  EXPECT_EQ(fleet.policy, Quorum(3)) << "half of the whole fleet, not of those that answered";
  EXPECT_STATUS_MSG(Unavailable, "connection refused", fleet.left_out_because[4]);

  // A shard group whose second shard did not answer is left out whole, and that shard is not
  // counted twice: a, b, engine (incomplete), gone = 4 replicas.
  std::vector<std::optional<ReplicaPlace>> split = places;
  split[3] = std::nullopt;
  std::vector<Status> split_errors = errors;
  split_errors[3] = Unavailable("tp1: connection refused");
  split[5] = ReplicaPlace{};
  split_errors[5] = Status::OK();
  ASSERT_OK_AND_ASSIGN(fleet, LeaveOutUnanswered(Quorum(2), names, split, split_errors));
  EXPECT_EQ(fleet.included, (std::vector<bool>{true, true, false, false, false, true}));
  EXPECT_EQ(fleet.replicas, 5u) << "a, b, engine, gone, gone-tp1 (answered, unsharded)";
  EXPECT_STATUS_MSG(Unavailable, "replica 'engine': 1 of its 2 shards did not answer",
                    fleet.left_out_because[2]);

  // Fewer answering replicas than the quorum: refused before anything opens, naming them.
  EXPECT_STATUS_MSG(Unavailable,
                    "3 of 5 replica(s) answered their status, commit policy quorum:5 "
                    "needs 5; did not answer: gone",
                    LeaveOutUnanswered(Quorum(5), names, places, errors));
  EXPECT_STATUS_MSG(InvalidArgument, "fewer than the quorum of 7",
                    LeaveOutUnanswered(Quorum(7), names, places, errors));
}

}  // namespace
}  // namespace refit
