#include "pipeline/quorum.h"

#include <map>
#include <string>

#include <fmt/format.h>

#include "refit/status_format.h"

namespace refit {

Result<CommitDecision> DecideCommit(const CommitPolicy& policy,
                                    std::span<const std::vector<size_t>> replicas,
                                    const std::vector<bool>& replica_flushed, size_t receivers) {
  if (replicas.size() != replica_flushed.size()) {
    return InvalidArgument("commit decision: {} replicas but {} flush results", replicas.size(),
                           replica_flushed.size());
  }
  CommitDecision decision;
  decision.fenced.assign(receivers, false);
  decision.replicas = replicas.size();
  REFIT_ASSIGN_OR_RETURN(decision.required_replicas, RequiredReplicas(policy, replicas.size()));
  for (bool flushed : replica_flushed) decision.flushed_replicas += flushed ? 1 : 0;
  // A fleet of no replicas commits trivially under `all`, as before; a quorum needs one flushed.
  decision.commit = decision.flushed_replicas >= decision.required_replicas &&
                    (decision.flushed_replicas > 0 || policy.kind == CommitPolicy::Kind::kAll);
  if (!decision.commit) return decision;
  for (size_t i = 0; i < replicas.size(); ++i) {
    if (replica_flushed[i]) continue;
    for (size_t r : replicas[i]) {
      if (r >= receivers) {
        return InvalidArgument("commit decision: replica {} names receiver {} of {}", i, r,
                               receivers);
      }
      decision.fenced[r] = true;
    }
  }
  return decision;
}

Result<QuorumFleet> LeaveOutUnanswered(const CommitPolicy& policy,
                                       std::span<const std::string> names,
                                       std::span<const std::optional<ReplicaPlace>> places,
                                       std::span<const Status> errors) {
  const size_t n = names.size();
  if (places.size() != n || errors.size() != n) {
    return InvalidArgument("quorum fleet: {} names, {} places, {} errors", n, places.size(),
                           errors.size());
  }
  QuorumFleet fleet;
  fleet.included.assign(n, true);
  fleet.left_out_because.assign(n, Status::OK());
  // Named replicas: the shards that answered, and how many the group has.
  struct Group {
    std::vector<size_t> answered;
    uint32_t shards = 1;
  };
  std::map<std::string, Group> groups;
  uint64_t unanswered = 0;
  uint64_t complete = 0;
  for (size_t r = 0; r < n; ++r) {
    if (!places[r].has_value()) {
      fleet.included[r] = false;
      fleet.left_out_because[r] =
          errors[r].ok() ? Unavailable("{} did not answer its status", names[r]) : errors[r];
      ++unanswered;
    } else if (places[r]->replica.empty()) {
      ++complete;
    } else {
      Group& group = groups[places[r]->replica];
      group.answered.push_back(r);
      group.shards = places[r]->shards;
    }
  }
  uint64_t missing_shards = 0;
  uint64_t incomplete = 0;
  for (const auto& [replica, group] : groups) {
    if (group.answered.size() >= group.shards) {
      ++complete;
      continue;
    }
    ++incomplete;
    missing_shards += group.shards - group.answered.size();
    for (size_t r : group.answered) {
      fleet.included[r] = false;
      fleet.left_out_because[r] = Unavailable(
          "replica '{}': {} of its {} shards did not answer their status, so the replica is left "
          "out whole",
          replica, group.shards - group.answered.size(), group.shards);
    }
  }
  fleet.replicas =
      complete + incomplete + (unanswered > missing_shards ? unanswered - missing_shards : 0);
  REFIT_ASSIGN_OR_RETURN(const uint64_t required, RequiredReplicas(policy, fleet.replicas));
  if (complete < required) {
    std::string who;
    for (size_t r = 0; r < n; ++r) {
      if (!places[r].has_value()) {
        who += fmt::format("{}{} ({})", who.empty() ? "" : "; ", names[r],
                           fleet.left_out_because[r].ToString());
      }
    }
    return Unavailable(
        "{} of {} replica(s) answered their status, commit policy {} needs {}; did not answer: {}",
        complete, fleet.replicas, CommitPolicyName(policy), required, who);
  }
  fleet.policy = policy.kind == CommitPolicy::Kind::kAll
                     ? policy
                     : CommitPolicy{.kind = CommitPolicy::Kind::kQuorum,
                                    .count = static_cast<uint32_t>(required)};
  return fleet;
}

}  // namespace refit
