// The commit decision of one transfer under a commit policy (refit/commit_policy.h): which
// replicas flushed, whether that is enough to commit, and which receivers are fenced
// (docs/protocol.md "Stragglers and quorum").
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "refit/commit_policy.h"
#include "refit/status.h"

namespace refit {

/// What the coordinator does after the flush phase.
struct CommitDecision {
  /// Commit on every receiver not fenced; false: abort everywhere.
  bool commit = false;
  /// Per receiver: aborted while the others commit (its replica did not flush and verify).
  /// All false unless `commit`.
  std::vector<bool> fenced;
  /// Replicas in the fleet, replicas that flushed and verified, replicas the policy needs.
  uint64_t replicas = 0;
  uint64_t flushed_replicas = 0;
  uint64_t required_replicas = 0;
};

/// Decide one transfer. `replicas[i]`: the receivers (indices below `receivers`) of replica i;
/// `replica_flushed[i]`: every one of them flushed and the replica verified. Under `all` the
/// transfer commits only when every replica flushed; under `quorum` when at least
/// RequiredReplicas did (and at least one did), the others' receivers fenced.
/// Errors: InvalidArgument for a policy that asks for more replicas than `replicas` has, or
/// lists of different lengths.
/// Complexity: O(receivers).
Result<CommitDecision> DecideCommit(const CommitPolicy& policy,
                                    std::span<const std::vector<size_t>> replicas,
                                    const std::vector<bool>& replica_flushed, size_t receivers);

}  // namespace refit
