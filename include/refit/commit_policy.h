// When a transfer commits although some receivers did not flush: the commit policy of a
// coordinator (CoordinatorOptions, PublisherOptions::commit_policy, `refit push --commit-policy`,
// the configuration key `commit_policy`, Python `commit_policy=`). docs/protocol.md "Stragglers and
// quorum" states the invariants.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "refit/status.h"

namespace refit {

/// `all` (the default): a transfer commits only where every receiver flushed; one receiver that
/// fails or misses the flush deadline aborts it everywhere. `quorum`: it commits on the replicas
/// that flushed when at least `count` of them did (or the fraction `fraction` of the fleet's
/// replicas, rounded up), and **fences** the others: they are aborted (rolled back to the base),
/// reported (ReceiverOutcome::fenced) and caught up at the next transfer by their own plans.
/// Replicas are counted, not receivers: a replica (a shard group) counts only when every one of
/// its shards flushed and the group verified; a replica that does not is fenced whole.
struct CommitPolicy {
  enum class Kind : uint8_t { kAll, kQuorum };
  Kind kind = Kind::kAll;
  /// kQuorum: the replicas that must flush, ≥ 1; 0 when `fraction` says it.
  uint32_t count = 0;
  /// kQuorum with count 0: the fraction of the fleet's replicas that must flush, in (0, 1].
  double fraction = 0;

  friend bool operator==(const CommitPolicy&, const CommitPolicy&) = default;
};

/// Parse "all", "quorum:N" (a count of replicas, N ≥ 1), "quorum:F" (a fraction in (0, 1], e.g.
/// 0.5) or "quorum:P%" (a percentage in (0, 100]). Errors: InvalidArgument naming the text and
/// the forms allowed.
Result<CommitPolicy> ParseCommitPolicy(std::string_view text);
/// The spelling ParseCommitPolicy reads: "all", "quorum:2", "quorum:0.5".
std::string CommitPolicyName(const CommitPolicy& policy);
/// Check a policy built by hand (count or fraction in range). Errors: InvalidArgument naming
/// the value.
Status CheckCommitPolicy(const CommitPolicy& policy);
/// The replicas that must flush for a transfer over `replicas` replicas to commit: all of them
/// under kAll, else count or ⌈fraction × replicas⌉ (at least 1).
/// Errors: InvalidArgument when the policy asks for more replicas than the fleet has, naming both.
Result<uint64_t> RequiredReplicas(const CommitPolicy& policy, uint64_t replicas);

}  // namespace refit
