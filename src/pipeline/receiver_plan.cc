#include "pipeline/receiver_plan.h"

#include <fmt/format.h>

namespace refit {

std::string_view CatchUpName(CatchUp how) {
  switch (how) {
    case CatchUp::kDelta:
      return "delta";
    case CatchUp::kFolded:
      return "folded";
    case CatchUp::kPeer:
      return "peer";
    case CatchUp::kChain:
      return "chain";
    case CatchUp::kAnchor:
      return "anchor";
  }
  return "unknown";
}

std::vector<PlannedCatchUp> PlanCatchUps(const TransferPlan& plan,
                                         std::span<const std::optional<ReceiverStanding>> standings,
                                         std::optional<uint64_t> fold_oldest) {
  const uint64_t base = plan.base_version;
  std::vector<PlannedCatchUp> plans(standings.size());
  for (size_t r = 0; r < standings.size(); ++r) {
    PlannedCatchUp& planned = plans[r];
    planned.from_version = base;
    planned.prepared_base = base;
    if (!standings[r].has_value()) {
      planned.how = plan.anchor ? CatchUp::kAnchor : CatchUp::kDelta;
      planned.why = "standing not asked";
      continue;
    }
    const ReceiverStanding& standing = *standings[r];
    planned.from_version = standing.version;
    planned.lag = standing.version < base ? base - standing.version : 0;
    if (plan.anchor) {
      planned.how = CatchUp::kAnchor;
      planned.why = "the transfer is an anchor";
    } else if (standing.needs_anchor) {
      planned.how = CatchUp::kAnchor;
      planned.why = "it needs an anchor";
    } else if (standing.version == base) {
      planned.how = CatchUp::kDelta;
      planned.why = "at the base";
    } else if (standing.version > base) {
      planned.how = CatchUp::kAnchor;
      planned.why = fmt::format("at version {}, ahead of the base {}", standing.version, base);
    } else if (fold_oldest.has_value() && *fold_oldest <= standing.version &&
               standing.accepts_target) {
      planned.how = CatchUp::kFolded;
      planned.why = fmt::format("{} version(s) behind, within the retained history (from {})",
                                planned.lag, *fold_oldest);
    } else {
      planned.how = CatchUp::kAnchor;
      planned.why =
          !fold_oldest.has_value() || *fold_oldest > standing.version
              ? fmt::format("{} version(s) behind, beyond the retained history", planned.lag)
              : fmt::format("{} version(s) behind; it does not prepare to a named target",
                            planned.lag);
    }
    // Behind the base: prepared from what it holds (folded, or an anchor of its own), so that a
    // transfer it still has open from that version is rolled back, never implicitly committed.
    if (standing.version < base && standing.accepts_target &&
        (planned.how == CatchUp::kFolded || planned.how == CatchUp::kAnchor)) {
      planned.prepared_base = standing.version;
    }
  }
  return plans;
}

}  // namespace refit
