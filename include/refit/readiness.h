// Readiness: whether a receiver may serve generation traffic (docs/protocol.md "Admission").
//
// A receiver is ready only while it holds, committed, the version the fleet holds: it learns the
// fleet's version from its publisher — the join reply, every Prepare (the transfer's target is one
// past the fleet's base) and every Commit — and is not ready while a transfer is open for it,
// while it is behind or ahead of the fleet, while it needs an anchor, while it is fenced (a quorum
// commit left it behind), after it left the fleet, and before it has heard of the fleet at all.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "refit/refit_report.h"

namespace refit {

/// Why a receiver is not ready (kReady when it is).
enum class ReadinessReason : uint8_t {
  kReady,
  /// It has heard nothing of the fleet yet: no join reply, Prepare or Commit.
  kFleetVersionUnknown,
  /// A transfer is open (receiving or prepared): its weights may be a mix of two versions.
  kTransferOpen,
  /// It holds an older committed version than the fleet's: it is caught up at the next sync.
  kBehind,
  /// It holds a newer version than the fleet reports (loaded from a later checkpoint).
  kAhead,
  /// An aborted anchor left a mix of versions that only an anchor repairs.
  kNeedsAnchor,
  /// A quorum commit fenced it: rolled back to the base while the fleet moved on.
  kFenced,
  /// It left the fleet (Leave); it no longer follows the fleet's version.
  kLeft,
};

/// Return "ready", "fleet_version_unknown", "transfer_open", "behind", "ahead", "needs_anchor",
/// "fenced" or "left".
std::string_view ReadinessReasonName(ReadinessReason reason);

/// Whether a receiver may serve, and what it knows of its fleet.
struct Readiness {
  bool ready = false;
  ReadinessReason reason = ReadinessReason::kFleetVersionUnknown;
  /// A sentence saying why, naming the versions (empty when ready).
  std::string detail;
  /// The committed version it holds.
  uint64_t version = 0;
  /// The fleet's committed version as last heard from the publisher; nullopt before that.
  std::optional<uint64_t> fleet_version;
  /// How its last committed transfer brought it to its version (delta, folded, chain, anchor),
  /// as the Prepare described it; nullopt before the first commit through its control plane.
  std::optional<CatchUp> last_catch_up;
  /// The publisher's membership URL it joined, while it is a member; empty otherwise.
  std::string publisher_url;
};

}  // namespace refit
