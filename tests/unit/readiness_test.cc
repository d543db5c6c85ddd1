// Readiness (refit/readiness.h) as a function of the receiver's state, what it heard of the fleet
// through its control plane (FleetStanding), and the publisher's roster (FleetRoster): joins,
// leaves, misses and drops.
#include "control/readiness.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "control/fleet_roster.h"
#include "control/protocol.h"
#include "refit/status_format.h"
#include "test_util.h"

namespace refit::internal {
namespace {

ReceiverStatus IdleAt(uint64_t version) {
  ReceiverStatus status;
  status.version = version;
  return status;
}

ReceiverStatus Open(uint64_t base, uint64_t target, ReceiverState state) {
  ReceiverStatus status = IdleAt(base);
  status.state = state;
  status.transfer_id = TransferId::Random();
  status.base_version = base;
  status.target_version = target;
  return status;
}

TEST(EvaluateReadinessTest, ReadyExactlyWhenIdleAtTheFleetsVersion) {
  ReadinessInputs inputs;
  inputs.status = IdleAt(4);
  EXPECT_EQ(EvaluateReadiness(inputs).reason, ReadinessReason::kFleetVersionUnknown);
  inputs.fleet_version = 4;
  Readiness readiness = EvaluateReadiness(inputs);
  EXPECT_TRUE(readiness.ready);
  EXPECT_EQ(readiness.reason, ReadinessReason::kReady);
  EXPECT_TRUE(readiness.detail.empty());

  inputs.fleet_version = 6;
  readiness = EvaluateReadiness(inputs);
  EXPECT_FALSE(readiness.ready);
  EXPECT_EQ(readiness.reason, ReadinessReason::kBehind);
  EXPECT_NE(readiness.detail.find("holds version 4, 2 behind the fleet's 6"), std::string::npos)
      << readiness.detail;

  inputs.fleet_version = 3;
  EXPECT_EQ(EvaluateReadiness(inputs).reason, ReadinessReason::kAhead);
}

TEST(EvaluateReadinessTest, NeverWhileATransferIsOpenFencedLeftOrNeedingAnAnchor) {
  for (ReceiverState state : {ReceiverState::kReceiving, ReceiverState::kPrepared}) {
    ReadinessInputs inputs;
    inputs.status = Open(4, 5, state);
    inputs.fleet_version = 4;
    EXPECT_EQ(EvaluateReadiness(inputs).reason, ReadinessReason::kTransferOpen);
  }
  ReadinessInputs inputs;
  inputs.status = IdleAt(4);
  inputs.fleet_version = 4;
  inputs.status.needs_anchor = true;
  inputs.status.needs_anchor_reason = "transfer 7 aborted";
  EXPECT_EQ(EvaluateReadiness(inputs).reason, ReadinessReason::kNeedsAnchor);
  inputs.status.needs_anchor = false;
  inputs.left = true;
  EXPECT_EQ(EvaluateReadiness(inputs).reason, ReadinessReason::kLeft);
  // Fencing wins over everything: the version it holds is the base the fleet left behind.
  inputs.fenced = "quorum commit of version 5 without it";
  const Readiness fenced = EvaluateReadiness(inputs);
  EXPECT_EQ(fenced.reason, ReadinessReason::kFenced);
  EXPECT_NE(fenced.detail.find("quorum commit"), std::string::npos);
}

TEST(FleetStandingTest, LearnsTheFleetsVersionFromPreparesCommitsAndJoins) {
  FleetStanding standing;
  EXPECT_EQ(standing.Evaluate(IdleAt(0)).reason, ReadinessReason::kFleetVersionUnknown);
  standing.ObserveFleetVersion(2);  // the join reply
  EXPECT_EQ(standing.Evaluate(IdleAt(0)).reason, ReadinessReason::kBehind);

  // A folded catch-up from 0 to the fleet's target 3: open, then behind if it aborts, ready
  // once it commits.
  PrepareRequest folded;
  folded.base_version = 0;
  folded.target_version = 3;
  standing.ObservePrepare(folded, false);
  EXPECT_EQ(standing.Evaluate(Open(0, 3, ReceiverState::kReceiving)).reason,
            ReadinessReason::kTransferOpen);
  EXPECT_EQ(standing.Evaluate(IdleAt(0)).fleet_version, 2u);
  standing.ObserveCommit(3);
  Readiness readiness = standing.Evaluate(IdleAt(3));
  EXPECT_TRUE(readiness.ready);
  EXPECT_EQ(readiness.last_catch_up, CatchUp::kFolded);

  // A delta prepared and aborted says the fleet is still at the base: ready again at the base.
  PrepareRequest delta;
  delta.base_version = 3;
  standing.ObservePrepare(delta, false);
  EXPECT_TRUE(standing.Evaluate(IdleAt(3)).ready);
  standing.ObserveCommit(4);
  EXPECT_EQ(standing.Evaluate(IdleAt(4)).last_catch_up, CatchUp::kDelta);

  // An anchor for this receiver alone names the fleet's base: a receiver at 0 learns it is behind.
  PrepareRequest anchor;
  anchor.base_version = 9;
  anchor.anchor = true;
  standing.ObservePrepare(anchor, false);
  EXPECT_EQ(standing.Evaluate(IdleAt(4)).reason, ReadinessReason::kBehind);
  standing.ObserveCommit(10);
  EXPECT_EQ(standing.Evaluate(IdleAt(10)).last_catch_up, CatchUp::kAnchor);

  // The versions never go back (a stale join reply).
  standing.ObserveFleetVersion(1);
  EXPECT_EQ(standing.Evaluate(IdleAt(10)).fleet_version, 10u);

  // Fenced (the quorum policy's hook) until the next commit; left until it joins again.
  standing.SetFenced("quorum");
  EXPECT_EQ(standing.Evaluate(IdleAt(10)).reason, ReadinessReason::kFenced);
  standing.ObserveCommit(11);
  EXPECT_TRUE(standing.Evaluate(IdleAt(11)).ready);
  standing.Joined("http://publisher:1");
  EXPECT_EQ(standing.Evaluate(IdleAt(11)).publisher_url, "http://publisher:1");
  standing.Left();
  EXPECT_EQ(standing.Evaluate(IdleAt(11)).reason, ReadinessReason::kLeft);
  standing.Joined("http://publisher:1");
  EXPECT_TRUE(standing.Evaluate(IdleAt(11)).ready);
}

TEST(FleetRosterTest, JoinLeaveAndDropAfterConsecutiveMisses) {
  FleetRoster roster({{"http://a:1", "a:2"}}, /*drop_after_missed_syncs=*/2);
  ASSERT_OK_AND_ASSIGN(FleetMembership joined, roster.Join({"http://b:1/", "b:2"}));
  ASSERT_EQ(joined.members.size(), 2u);
  EXPECT_EQ(joined.members[1].endpoint.control_url, "http://b:1");  // trailing '/' dropped
  EXPECT_TRUE(joined.members[1].joined);
  EXPECT_FALSE(joined.members[0].joined);
  // Joining again keeps the place and takes the new data endpoint; another member's is refused.
  ASSERT_OK(roster.Join({"http://b:1", "b:3"}).status());
  EXPECT_EQ(roster.Members()[1].data_endpoint, "b:3");
  EXPECT_STATUS(InvalidArgument, roster.Join({"http://c:1", "a:2"}).status());
  EXPECT_STATUS(NotFound, roster.Leave("http://nobody:1").status());

  RosterMiss miss;
  EXPECT_FALSE(roster.RecordUnreachable("http://a:1", Unavailable("refused"), miss));
  roster.RecordReached("http://a:1");  // the run of misses ends
  EXPECT_FALSE(roster.RecordUnreachable("http://a:1", Unavailable("refused"), miss));
  EXPECT_TRUE(roster.RecordUnreachable("http://a:1", Unavailable("refused"), miss));
  EXPECT_EQ(miss.unreachable.size(), 3u);
  EXPECT_EQ(miss.dropped, std::vector<std::string>{"http://a:1"});
  ASSERT_EQ(roster.Members().size(), 1u);

  RefitReport report;
  report.plan.target_version = 5;
  ReceiverOutcome outcome;
  outcome.name = "http://b:1";
  outcome.held_version = 1;
  outcome.lag = 3;
  outcome.caught_up_by = CatchUp::kFolded;
  outcome.wire_bytes = 1234;
  report.receivers.push_back(outcome);
  roster.RecordSync(report);
  const FleetMembership after = roster.Snapshot();
  EXPECT_EQ(after.fleet_version, 5u);
  EXPECT_EQ(after.members[0].version, 5u);
  EXPECT_EQ(after.members[0].caught_up_by, CatchUp::kFolded);
  EXPECT_EQ(after.members[0].wire_bytes, 1234u);

  // The JSON of GET /v1/members round-trips.
  ASSERT_OK_AND_ASSIGN(const FleetMembership parsed, MembershipFromJson(MembershipToJson(after)));
  EXPECT_EQ(parsed.fleet_version, 5u);
  ASSERT_EQ(parsed.members.size(), 1u);
  EXPECT_EQ(parsed.members[0].lag, 3u);
  EXPECT_EQ(parsed.members[0].caught_up_by, CatchUp::kFolded);

  ASSERT_OK_AND_ASSIGN(const FleetMembership empty, roster.Leave("http://b:1"));
  EXPECT_TRUE(empty.members.empty());
}

TEST(FleetRosterTest, ZeroMissesNeverDrops) {
  FleetRoster roster({{"http://a:1", "a:2"}}, 0);
  RosterMiss miss;
  for (int i = 0; i < 10; ++i)
    EXPECT_FALSE(roster.RecordUnreachable("http://a:1", Unavailable("x"), miss));
  EXPECT_EQ(roster.Members().size(), 1u);
}

}  // namespace
}  // namespace refit::internal
