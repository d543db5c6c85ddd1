// FleetRoster: the members of a publisher's fleet and how each stood at the last Sync
// (refit/membership.h). Rank 0 owns it; the membership endpoint changes it between Syncs, and each
// Sync takes one snapshot at its start, which the begin message carries to the other ranks, so
// every rank of a Sync sees the same fleet.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "refit/membership.h"
#include "refit/refit_report.h"
#include "refit/status.h"
#include "util/mutex.h"

namespace refit::internal {

/// What one Sync's start did to the roster: members left out because they could not be
/// reached, and members dropped for it.
struct RosterMiss {
  /// The members left out of this Sync, each with why ("unreachable (2 of 3): …").
  std::vector<std::string> unreachable;
  /// The members dropped from the fleet: unreachable for drop_after_missed_syncs Syncs in a row.
  std::vector<std::string> dropped;
};

/// Thread-safety: every member function may be called concurrently.
class FleetRoster {
 public:
  /// A roster of the `configured` members (not joined: PublisherOptions::receivers), dropping a
  /// member after `drop_after_missed_syncs` consecutive unreachable Syncs (0: never).
  FleetRoster(const std::vector<MemberEndpoint>& configured, uint32_t drop_after_missed_syncs);

  /// Add `member` from the next Sync on; a member already listed under its control URL keeps its
  /// place and takes the new data endpoint (a restarted worker joining again). Errors:
  /// InvalidArgument for an empty control URL, or a data endpoint another member has.
  Result<FleetMembership> Join(const MemberEndpoint& member);
  /// Remove the member of `control_url` from the next Sync on. Errors: NotFound naming it.
  Result<FleetMembership> Leave(const std::string& control_url);
  /// Replace every member (Publisher::SetReceivers); standings of members kept stay.
  void Replace(const std::vector<MemberEndpoint>& members);

  /// The members a Sync starting now lists, in order.
  std::vector<MemberEndpoint> Members() const;
  /// At a Sync's start: the member of `control_url` could not be reached (`why`); return
  /// whether it is now dropped. A member no longer listed (it left meanwhile) is ignored.
  bool RecordUnreachable(const std::string& control_url, const Status& why, RosterMiss& miss);
  /// At a Sync's start: the member answered (its run of misses ends).
  void RecordReached(const std::string& control_url);
  /// After a Sync committed: each listed receiver's outcome, and the fleet's new version.
  void RecordSync(const RefitReport& report);
  /// The fleet's committed version (the publisher's, e.g. an adopted baseline's) when known.
  void SetFleetVersion(uint64_t version);

  FleetMembership Snapshot() const;

 private:
  FleetMembership SnapshotLocked() const REFIT_REQUIRES(mutex_);
  MemberStanding* FindLocked(const std::string& control_url) REFIT_REQUIRES(mutex_);

  const uint32_t drop_after_missed_syncs_;
  mutable Mutex mutex_;
  std::vector<MemberStanding> members_ REFIT_GUARDED_BY(mutex_);
  std::optional<uint64_t> fleet_version_ REFIT_GUARDED_BY(mutex_);
};

}  // namespace refit::internal
