#include "control/fleet_roster.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "util/logging.h"

namespace refit::internal {
namespace {

// The name a member goes by: its control URL without a trailing '/', as ControlClient names it.
std::string MemberName(std::string url) {
  while (url.size() > 1 && url.back() == '/') url.pop_back();
  return url;
}

}  // namespace

FleetRoster::FleetRoster(const std::vector<MemberEndpoint>& configured,
                         uint32_t drop_after_missed_syncs)
    : drop_after_missed_syncs_(drop_after_missed_syncs) {
  Replace(configured);
}

MemberStanding* FleetRoster::FindLocked(const std::string& control_url) {
  const std::string name = MemberName(control_url);
  for (MemberStanding& member : members_) {
    if (member.endpoint.control_url == name) return &member;
  }
  return nullptr;
}

Result<FleetMembership> FleetRoster::Join(const MemberEndpoint& member) {
  if (member.control_url.empty()) {
    return InvalidArgument("membership: a member needs a control_url");
  }
  MemberEndpoint endpoint{MemberName(member.control_url), member.data_endpoint};
  MutexLock lock(mutex_);
  for (const MemberStanding& other : members_) {
    if (other.endpoint.control_url != endpoint.control_url && !endpoint.data_endpoint.empty() &&
        other.endpoint.data_endpoint == endpoint.data_endpoint) {
      return InvalidArgument(
          "membership: {} cannot join with data endpoint '{}': member {} has it already",
          endpoint.control_url, endpoint.data_endpoint, other.endpoint.control_url);
    }
  }
  if (MemberStanding* known = FindLocked(endpoint.control_url); known != nullptr) {
    known->endpoint.data_endpoint = endpoint.data_endpoint;
    known->missed_syncs = 0;
    REFIT_LOG_INFO("membership: {} joined again (data endpoint {})", endpoint.control_url,
                   endpoint.data_endpoint);
  } else {
    MemberStanding standing;
    standing.endpoint = endpoint;
    standing.joined = true;
    members_.push_back(std::move(standing));
    REFIT_LOG_INFO("membership: {} joined (data endpoint {}); it takes part from the next sync",
                   endpoint.control_url, endpoint.data_endpoint);
  }
  return SnapshotLocked();
}

Result<FleetMembership> FleetRoster::Leave(const std::string& control_url) {
  const std::string name = MemberName(control_url);
  MutexLock lock(mutex_);
  const auto it = std::find_if(members_.begin(), members_.end(), [&](const MemberStanding& m) {
    return m.endpoint.control_url == name;
  });
  if (it == members_.end()) {
    return NotFound("membership: {} is not a member of this fleet ({} members)", name,
                    members_.size());
  }
  members_.erase(it);
  REFIT_LOG_INFO("membership: {} left; the next sync goes without it", name);
  return SnapshotLocked();
}

void FleetRoster::Replace(const std::vector<MemberEndpoint>& members) {
  MutexLock lock(mutex_);
  std::vector<MemberStanding> replaced;
  for (const MemberEndpoint& member : members) {
    MemberStanding standing;
    if (const MemberStanding* known = FindLocked(member.control_url); known != nullptr) {
      standing = *known;
    }
    standing.endpoint = MemberEndpoint{MemberName(member.control_url), member.data_endpoint};
    replaced.push_back(std::move(standing));
  }
  members_ = std::move(replaced);
}

std::vector<MemberEndpoint> FleetRoster::Members() const {
  MutexLock lock(mutex_);
  std::vector<MemberEndpoint> members;
  members.reserve(members_.size());
  for (const MemberStanding& member : members_) members.push_back(member.endpoint);
  return members;
}

bool FleetRoster::RecordUnreachable(const std::string& control_url, const Status& why,
                                    RosterMiss& miss) {
  const std::string name = MemberName(control_url);
  MutexLock lock(mutex_);
  MemberStanding* member = FindLocked(name);
  if (member == nullptr) return false;
  ++member->missed_syncs;
  const bool drop =
      drop_after_missed_syncs_ != 0 && member->missed_syncs >= drop_after_missed_syncs_;
  const std::string limit = drop_after_missed_syncs_ == 0
                                ? "never dropped"
                                : fmt::format("of {}", drop_after_missed_syncs_);
  miss.unreachable.push_back(fmt::format("{}: unreachable ({} {}): {}", name, member->missed_syncs,
                                         limit, why.ToString()));
  if (!drop) {
    REFIT_LOG_WARN(
        "membership: {} is unreachable ({} consecutive syncs, {}); this sync goes "
        "without it: {}",
        name, member->missed_syncs, limit, why.ToString());
    return false;
  }
  REFIT_LOG_WARN("membership: {} dropped from the fleet: unreachable for {} consecutive syncs: {}",
                 name, member->missed_syncs, why.ToString());
  miss.dropped.push_back(name);
  members_.erase(members_.begin() + (member - members_.data()));
  return true;
}

void FleetRoster::RecordReached(const std::string& control_url) {
  MutexLock lock(mutex_);
  if (MemberStanding* member = FindLocked(control_url); member != nullptr) {
    member->missed_syncs = 0;
  }
}

void FleetRoster::RecordSync(const RefitReport& report) {
  MutexLock lock(mutex_);
  fleet_version_ = report.plan.target_version;
  for (const ReceiverOutcome& outcome : report.receivers) {
    MemberStanding* member = FindLocked(outcome.name);
    if (member == nullptr) continue;
    member->version = report.plan.target_version;
    member->held_version = outcome.held_version;
    member->lag = outcome.lag;
    member->caught_up_by = outcome.caught_up_by;
    member->wire_bytes = outcome.wire_bytes;
    member->fenced = false;
  }
}

void FleetRoster::SetFleetVersion(uint64_t version) {
  MutexLock lock(mutex_);
  fleet_version_ = version;
}

FleetMembership FleetRoster::Snapshot() const {
  MutexLock lock(mutex_);
  return SnapshotLocked();
}

FleetMembership FleetRoster::SnapshotLocked() const {
  return FleetMembership{fleet_version_, members_};
}

}  // namespace refit::internal
