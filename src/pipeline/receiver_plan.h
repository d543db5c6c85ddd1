// Per-receiver plans: how each receiver of one transfer reaches its target (docs/protocol.md
// "Per-receiver plans").
//
// A transfer moves the fleet from its base B to B + 1. Before it, the coordinator knows where each
// receiver stands (its status: version, whether it needs an anchor) and how far back the
// producers can fold (their retained deltas, codec/delta_history.h). Each receiver then gets:
//
//   at B, healthy                        → the delta (what every current member gets)
//   at v < B, within the history, and    → one folded payload per chunk, v → B + 1, prepared
//   it prepares to a named target           with its own base v and the common target
//   needs an anchor, unknown version,    → an anchor for it alone (FULL items, prepared as an
//   beyond the history, ahead of B          anchor, which a receiver at any version takes: from
//                                           the version it holds when behind B, else from B)
//
// A receiver behind B is always prepared from the version it holds, never from B: a transfer of
// its own it still has open (prepared, or receiving and quiet) is then rolled back by the
// receiver (implied abort), never committed by an implied commit. That is what keeps a receiver
// fenced by a quorum (docs/protocol.md "Stragglers and quorum") from ever committing the transfer
// it was fenced from, even when it never got its Abort.
//
// The plan never changes what a receiver at B receives: catch-up receivers get routes of their
// own (their own relay trees), so one receiver behind never turns the fleet's delta into an
// anchor. A transfer that is an anchor anyway (every producer needs one) is an anchor for all.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "refit/refit_report.h"
#include "refit/transfer.h"

namespace refit {

/// Where a receiver stands before a transfer, as its status said.
struct ReceiverStanding {
  /// Its committed version.
  uint64_t version = 0;
  /// It holds a mix of versions and accepts only an anchor (ReceiverStatus::needs_anchor).
  bool needs_anchor = false;
  /// It prepares a transfer to a target other than base + 1 (PrepareRequest::target_version),
  /// which a folded delta needs (ReceiverStatus::accepts_target_version).
  bool accepts_target = false;
};

/// How one receiver is caught up in a transfer.
struct PlannedCatchUp {
  CatchUp how = CatchUp::kDelta;
  /// The version it holds: what its prepare names as its base for kFolded.
  uint64_t from_version = 0;
  /// Versions behind the transfer's base (0 when at or ahead of it).
  uint64_t lag = 0;
  /// The base its prepare names and its payloads' headers carry: from_version for kFolded and
  /// for an anchor of its own when behind the base (and it prepares to a named target), else
  /// the transfer's base.
  uint64_t prepared_base = 0;
  /// Why, for the log: "at the base", "3 versions behind, folded", …
  std::string why;
};

/// Plan every receiver of `plan`. `standings[r]`: receiver r's standing, nullopt when not asked
/// (it is taken to be at the base, as before per-receiver plans: its prepare fences it).
/// `fold_oldest`: the oldest version every producer can fold from to plan's target
/// (DeltaHistory::oldest_version over the producers; nullopt: none can fold).
/// Complexity: O(receivers).
std::vector<PlannedCatchUp> PlanCatchUps(const TransferPlan& plan,
                                         std::span<const std::optional<ReceiverStanding>> standings,
                                         std::optional<uint64_t> fold_oldest);

}  // namespace refit
