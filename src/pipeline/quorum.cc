#include "pipeline/quorum.h"

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

}  // namespace refit
