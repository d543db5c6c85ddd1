// What a receiver knows of its fleet, and whether it may serve (refit/readiness.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "refit/readiness.h"
#include "refit/receiver_session_options.h"
#include "refit/refit_report.h"
#include "refit/transfer.h"
#include "util/mutex.h"

namespace refit::internal {

/// Everything readiness depends on: the one place the rule is written (EvaluateReadiness).
struct ReadinessInputs {
  /// The session's state and committed version.
  ReceiverStatus status;
  /// The fleet's committed version as last heard from the publisher.
  std::optional<uint64_t> fleet_version;
  /// The receiver left the fleet (Leave) and no longer follows it.
  bool left = false;
  /// Why a quorum commit fenced this receiver (docs/protocol.md, quorum); nullopt: not fenced.
  /// The quorum policy sets it through FleetStanding::SetFenced.
  std::optional<std::string> fenced;
  std::optional<CatchUp> last_catch_up;
  std::string publisher_url;
};

/// Decide readiness: ready iff the fleet's version is known, no transfer is open, the receiver
/// is neither fenced nor left nor in need of an anchor, and its committed version equals the
/// fleet's. The first reason that applies is reported, in that order (fenced and left first:
/// they hold whatever the version says). Pure; O(1).
Readiness EvaluateReadiness(const ReadinessInputs& inputs);

/// What one receiver has heard of its fleet through its control plane: the fleet's version
/// (from Prepare requests, Commits and join replies), how its open transfer catches it up, its
/// membership and fencing.
///
/// The fleet's version only moves forward here: a Prepare whose target is T says the fleet
/// committed T − 1 (every transfer goes from the fleet's base to base + 1, and a folded or
/// anchored receiver is prepared to the fleet's target); a Commit of T says the fleet holds T.
/// An aborted transfer says nothing new: the fleet stays at the base. A new lineage that restarts
/// versions lower is not modelled here (see docs/protocol.md "Admission").
///
/// Thread-safety: every member function may be called concurrently.
class FleetStanding {
 public:
  /// A Prepare the session accepted; `chain_replayed`: the receiver replayed an object-store
  /// chain before it (ControlServerOptions::catch_up).
  void ObservePrepare(const PrepareRequest& request, bool chain_replayed);
  /// The session committed and now holds `version`.
  void ObserveCommit(uint64_t version);
  /// The fleet's committed version as its publisher reported it (a join reply).
  void ObserveFleetVersion(uint64_t fleet_version);
  /// The receiver joined the fleet of `publisher_url` / left it.
  void Joined(std::string publisher_url);
  void Left();
  /// Hook of the quorum policy: fence this receiver (`reason`), or clear the fence (nullopt).
  /// A commit clears it too: the receiver then holds the fleet's version.
  void SetFenced(std::optional<std::string> reason);

  /// Readiness given the session's current `status`.
  Readiness Evaluate(const ReceiverStatus& status) const;

  /// While a member watches its publisher (ReceiverNode's fleet watch, every `interval`): `ask`
  /// asks the publisher for the fleet's version once and reports it through Watched. StopWatch
  /// ends it (before whatever `ask` refers to goes).
  void StartWatch(std::function<void()> ask, std::chrono::milliseconds interval);
  void StopWatch();
  /// The watch heard the fleet's version from the publisher.
  void Watched(uint64_t fleet_version);
  /// Before a readiness answer: when the watch has not heard from the publisher for two
  /// intervals — the process was stopped and its watch thread has not asked yet, or the
  /// publisher does not answer — ask now, at most once per interval, so that a member that
  /// slept through a sync does not answer "ready" at its old version. The ask is short
  /// (the node bounds it well under a probe's timeout); one that fails leaves the answer as it
  /// was.
  void RefreshIfOverdue();

 private:
  mutable Mutex mutex_;
  std::optional<uint64_t> fleet_version_ REFIT_GUARDED_BY(mutex_);
  // How the open transfer brings this receiver to its target, from its Prepare.
  std::optional<CatchUp> pending_catch_up_ REFIT_GUARDED_BY(mutex_);
  std::optional<CatchUp> last_catch_up_ REFIT_GUARDED_BY(mutex_);
  std::optional<std::string> fenced_ REFIT_GUARDED_BY(mutex_);
  std::string publisher_url_ REFIT_GUARDED_BY(mutex_);
  bool left_ REFIT_GUARDED_BY(mutex_) = false;
  // The fleet watch: how to ask, how often, when it last heard, and when a readiness answer last
  // asked.
  std::function<void()> ask_ REFIT_GUARDED_BY(mutex_);
  std::chrono::milliseconds watch_interval_ REFIT_GUARDED_BY(mutex_){0};
  std::chrono::steady_clock::time_point last_heard_ REFIT_GUARDED_BY(mutex_);
  std::chrono::steady_clock::time_point last_inline_ask_ REFIT_GUARDED_BY(mutex_);
};

}  // namespace refit::internal
