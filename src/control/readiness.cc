#include "control/readiness.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

namespace refit {

std::string_view ReadinessReasonName(ReadinessReason reason) {
  switch (reason) {
    case ReadinessReason::kReady:
      return "ready";
    case ReadinessReason::kFleetVersionUnknown:
      return "fleet_version_unknown";
    case ReadinessReason::kTransferOpen:
      return "transfer_open";
    case ReadinessReason::kBehind:
      return "behind";
    case ReadinessReason::kAhead:
      return "ahead";
    case ReadinessReason::kNeedsAnchor:
      return "needs_anchor";
    case ReadinessReason::kFenced:
      return "fenced";
    case ReadinessReason::kLeft:
      return "left";
  }
  return "unknown";
}

namespace internal {

Readiness EvaluateReadiness(const ReadinessInputs& inputs) {
  const ReceiverStatus& status = inputs.status;
  Readiness readiness;
  readiness.version = status.version;
  readiness.fleet_version = inputs.fleet_version;
  readiness.last_catch_up = inputs.last_catch_up;
  readiness.publisher_url = inputs.publisher_url;
  const auto not_ready = [&](ReadinessReason reason, std::string detail) {
    readiness.ready = false;
    readiness.reason = reason;
    readiness.detail = std::move(detail);
    return readiness;
  };
  if (inputs.fenced.has_value()) {
    return not_ready(ReadinessReason::kFenced,
                     fmt::format("fenced at version {}: {}", status.version, *inputs.fenced));
  }
  if (inputs.left) {
    return not_ready(ReadinessReason::kLeft,
                     fmt::format("left the fleet; holds version {}, which it no longer follows",
                                 status.version));
  }
  if (status.state != ReceiverState::kIdle) {
    return not_ready(
        ReadinessReason::kTransferOpen,
        fmt::format("transfer {} is {} ({} -> {}): the weights may mix two versions",
                    status.transfer_id.has_value() ? status.transfer_id->ToHex() : std::string("?"),
                    ReceiverStateName(status.state), status.base_version, status.target_version));
  }
  if (status.needs_anchor) {
    return not_ready(ReadinessReason::kNeedsAnchor,
                     fmt::format("needs an anchor: {}", status.needs_anchor_reason));
  }
  if (!inputs.fleet_version.has_value()) {
    return not_ready(ReadinessReason::kFleetVersionUnknown,
                     fmt::format("holds version {}; the fleet's version is not known yet (no "
                                 "join reply, prepare or commit from a publisher)",
                                 status.version));
  }
  if (status.version < *inputs.fleet_version) {
    return not_ready(ReadinessReason::kBehind,
                     fmt::format("holds version {}, {} behind the fleet's {}", status.version,
                                 *inputs.fleet_version - status.version, *inputs.fleet_version));
  }
  if (status.version > *inputs.fleet_version) {
    return not_ready(ReadinessReason::kAhead,
                     fmt::format("holds version {}, ahead of the fleet's {}", status.version,
                                 *inputs.fleet_version));
  }
  readiness.ready = true;
  readiness.reason = ReadinessReason::kReady;
  return readiness;
}

void FleetStanding::ObservePrepare(const PrepareRequest& request, bool chain_replayed) {
  const uint64_t target =
      request.target_version != 0 ? request.target_version : request.base_version + 1;
  CatchUp how = CatchUp::kDelta;
  if (request.anchor) {
    how = CatchUp::kAnchor;
  } else if (target > request.base_version + 1) {
    how = CatchUp::kFolded;
  } else if (chain_replayed) {
    how = CatchUp::kChain;
  }
  MutexLock lock(mutex_);
  fleet_version_ = std::max(fleet_version_.value_or(0), target - 1);
  pending_catch_up_ = how;
}

void FleetStanding::ObserveCommit(uint64_t version) {
  MutexLock lock(mutex_);
  fleet_version_ = std::max(fleet_version_.value_or(0), version);
  if (pending_catch_up_.has_value()) last_catch_up_ = pending_catch_up_;
  pending_catch_up_.reset();
  fenced_.reset();
}

void FleetStanding::ObserveFleetVersion(uint64_t fleet_version) {
  MutexLock lock(mutex_);
  fleet_version_ = std::max(fleet_version_.value_or(0), fleet_version);
}

void FleetStanding::Joined(std::string publisher_url) {
  MutexLock lock(mutex_);
  publisher_url_ = std::move(publisher_url);
  left_ = false;
}

void FleetStanding::Left() {
  MutexLock lock(mutex_);
  publisher_url_.clear();
  left_ = true;
}

void FleetStanding::SetFenced(std::optional<std::string> reason) {
  MutexLock lock(mutex_);
  fenced_ = std::move(reason);
}

void FleetStanding::StartWatch(std::function<void()> ask, std::chrono::milliseconds interval) {
  MutexLock lock(mutex_);
  ask_ = std::move(ask);
  watch_interval_ = interval;
  last_heard_ = std::chrono::steady_clock::now();  // the join reply
  last_inline_ask_ = {};
}

void FleetStanding::StopWatch() {
  MutexLock lock(mutex_);
  ask_ = nullptr;
}

void FleetStanding::Watched(uint64_t fleet_version) {
  MutexLock lock(mutex_);
  fleet_version_ = std::max(fleet_version_.value_or(0), fleet_version);
  last_heard_ = std::chrono::steady_clock::now();
}

void FleetStanding::RefreshIfOverdue() {
  std::function<void()> ask;
  {
    MutexLock lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    if (!ask_ || now - last_heard_ < 2 * watch_interval_ ||
        now - last_inline_ask_ < watch_interval_) {
      return;
    }
    last_inline_ask_ = now;
    ask = ask_;
  }
  ask();  // Without the lock: a network call, bounded by the node.
}

Readiness FleetStanding::Evaluate(const ReceiverStatus& status) const {
  ReadinessInputs inputs;
  inputs.status = status;
  {
    MutexLock lock(mutex_);
    inputs.fleet_version = fleet_version_;
    inputs.left = left_;
    inputs.fenced = fenced_;
    inputs.last_catch_up = last_catch_up_;
    inputs.publisher_url = publisher_url_;
  }
  return EvaluateReadiness(inputs);
}

}  // namespace internal
}  // namespace refit
