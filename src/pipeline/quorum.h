// The commit decision of one transfer under a commit policy (refit/commit_policy.h): which
// replicas flushed, whether that is enough to commit, and which receivers are fenced
// (docs/protocol.md "Stragglers and quorum").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "refit/commit_policy.h"
#include "refit/status.h"
#include "refit/transfer.h"

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

/// The fleet of a transfer under a quorum, once every receiver was asked its status: a receiver
/// that did not answer (stopped, partitioned, wedged) is left out of the transfer — fenced before
/// it starts — and so is every shard of a replica that lacks one, while the quorum is still
/// counted over the whole fleet's replicas.
struct QuorumFleet {
  /// Per receiver: it takes part in the transfer.
  std::vector<bool> included;
  /// Per receiver left out: why (its status error, or its replica's missing shard); OK if included.
  std::vector<Status> left_out_because;
  /// The fleet's replicas, the left-out ones included: each complete replica once, each
  /// incomplete one once, and each unanswered receiver not accounted for as a missing shard as one
  /// replica of its own (conservative: a whole shard group that did not answer counts as several).
  uint64_t replicas = 0;
  /// The quorum for the receivers included, as a count of replicas: `policy` over `replicas`.
  CommitPolicy policy;
};

/// Leave out the receivers whose status could not be read. `places[r]`: receiver r's place as its
/// status said, nullopt with `errors[r]` its error when it did not answer.
/// Errors: InvalidArgument when the policy asks for more replicas than the fleet has;
/// Unavailable, naming the receivers that did not answer, when fewer replicas answered than the
/// quorum needs (the transfer would abort anyway; nothing is opened).
/// Complexity: O(receivers log receivers).
Result<QuorumFleet> LeaveOutUnanswered(const CommitPolicy& policy,
                                       std::span<const std::string> names,
                                       std::span<const std::optional<ReplicaPlace>> places,
                                       std::span<const Status> errors);

}  // namespace refit
