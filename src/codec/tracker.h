// DeltaTracker: the producer side of a transfer. It keeps the last committed bits of every owned
// canonical tensor (the baseline) and turns "the weights now" into items of exact changes.
//
// Lifecycle of one transfer:
//   Begin(id)                  decides anchor (FULL) or delta, fixes base/target versions
//   Encode(id, tensor[, span]) compares against the baseline, returns items, and records the
//                              *pending* new bits of changed elements only (O(changes))
//   Commit(id)                 makes the pending bits the baseline: the version and digests at
//                              once, the scatter of the changed elements (O(changes)) in the
//                              background (the baseline fold), off the trainer's critical path
//   Abort(id)                  drops pending bits: the next transfer re-emits the same changes
//
// Everything that reads or replaces a baseline's bytes (Begin, BeginPlanned, AdoptBaseline, Place,
// Forget, MarkBaselineAdopted, Baseline, the destructor) first waits for a fold still running, so
// no compare ever sees a half-folded baseline; with a training step between two syncs the fold has
// long finished and nothing waits.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "codec/canonical_box.h"
#include "refit/compare_options.h"
#include "refit/item.h"
#include "refit/payload.h"
#include "refit/status.h"
#include "refit/tensor.h"
#include "refit/tracker_options.h"
#include "refit/transfer.h"

namespace refit::internal {

/// The result of encoding one tensor (or span).
struct EncodeResult {
  /// Zero items when nothing changed (delta), one per op otherwise (ADD may add an OVERWRITE
  /// item for demoted elements).
  std::vector<Item> items;
  uint64_t changed_elements = 0;
  uint64_t total_elements = 0;
};

/// What the last Commit's background baseline fold did (DeltaTracker::last_fold).
struct BaselineFoldReport {
  /// Changed elements scattered into baselines, and the seconds that took on the fold's thread.
  uint64_t elements = 0;
  double seconds = 0;
  /// Whether it is still running.
  bool running = false;
  /// Seconds callers blocked waiting for folds not yet finished, over the tracker's life: the part
  /// of the folds that came back onto the caller's path.
  double waited_seconds = 0;
};

/// The producer-side tracker (docs/architecture.md).
///
/// Thread-safety: Encode may run concurrently from many threads on distinct tensors or disjoint
/// spans of one tensor. Begin, Commit, Abort and the accessors must not run concurrently with
/// Encode or with each other. The baseline fold Commit starts runs on a thread the tracker owns
/// and touches nothing but the bytes of the baselines it scatters into (see the top of the file).
class DeltaTracker {
 public:
  ~DeltaTracker();
  DeltaTracker(const DeltaTracker&) = delete;
  DeltaTracker& operator=(const DeltaTracker&) = delete;

  /// Errors: InvalidArgument for inconsistent options (e.g. kFull as the delta op).
  static Result<std::unique_ptr<DeltaTracker>> Make(const TrackerOptions& options);

  /// Open a transfer. `force_anchor` makes it FULL regardless of cadence.
  /// Errors: FailedPrecondition if another transfer is open.
  Result<TransferPlan> Begin(const TransferId& id, bool force_anchor = false);

  /// Encode elements [span_begin, span_end) of `current` (the whole tensor by default) for the
  /// open transfer. In a delta transfer the tensor must have a baseline of the same dtype and
  /// shape; an anchor may introduce or reshape tensors. Spans of one tensor must be disjoint and,
  /// for a tensor new at this anchor, cover it completely before Commit.
  /// Errors: FailedPrecondition (wrong transfer id, missing or reshaped baseline outside an
  /// anchor), InvalidArgument (bad span, size mismatch).
  Result<EncodeResult> Encode(const TransferId& id, const TensorView& current,
                              uint64_t span_begin = 0, uint64_t span_end = UINT64_MAX);

  /// Encode elements [span_begin, span_end) of `current` as FULL items of its bits now, for a
  /// receiver that gets an anchor of its own inside a delta transfer (docs/protocol.md
  /// "Per-receiver plans"). Reads only `current` and records nothing: the transfer's pending
  /// state comes from Encode. Items are in canonical coordinates for a placed box (as an
  /// anchor's). Errors: FailedPrecondition (wrong transfer id), InvalidArgument (bad span, size
  /// mismatch, a box of another extent).
  Result<std::vector<Item>> EncodeFull(const TransferId& id, const TensorView& current,
                                       uint64_t span_begin = 0,
                                       uint64_t span_end = UINT64_MAX) const;

  /// Check that the open delta transfer encoded every element of every baseline tensor: a sync
  /// that leaves a tensor out would commit with that tensor silently stale. OK for an anchor
  /// (whose Commit drops the baseline of every tensor it did not send).
  /// Errors: FailedPrecondition naming the first tensor not covered, or a wrong transfer id.
  Status CheckModelCovered(const TransferId& id) const;

  /// Adopt `tensor` as committed baseline at the current version, without a transfer: for a
  /// producer whose receivers already hold exactly these weights (all loaded one checkpoint, or
  /// a trainer restarting against a live fleet). Counts as an anchor for the cadence rules, so
  /// the next transfer is a delta. Errors: FailedPrecondition while a transfer is open,
  /// InvalidArgument (size mismatch).
  Status AdoptBaseline(const TensorView& tensor);

  /// Track `name` as one box of a canonical tensor — what a sharded trainer rank holds
  /// (src/codec/canonical_box.h): from now on Encode and AdoptBaseline take `name` with shape
  /// `extent` (the box's elements, row-major), and everything that leaves the tracker is in the
  /// canonical tensor's coordinates: items are named `box.tensor` with its shape, spans and
  /// locations are canonical element indices, and digests (of items, Digests, PendingDigests)
  /// are Σ h(canonical index, bits) over the box, so the boxes of a tensor add up to its
  /// digest. A delta item's span is the canonical range its changes lie in; an anchor sends the
  /// box as one FULL item per run (one for a row shard). The baseline stays O(box).
  /// Placing again under the same box is a no-op; under another box (the trainer resharded) it
  /// drops the tensor's baseline and makes the next transfer an anchor.
  /// Errors: FailedPrecondition while a transfer is open; InvalidArgument (BoxIndexMap::Make).
  Status Place(const std::string& name, const CanonicalBox& box, const Shape& extent);
  /// Stop tracking `name` (its baseline and placement), without a transfer: a box this producer
  /// adopted but another producer sends (a data-parallel copy, DeltaTracker::Place). No-op for a
  /// name not tracked. Errors: FailedPrecondition while a transfer is open.
  Status Forget(const std::string& name);
  /// The box `name` was placed at, if any.
  std::optional<CanonicalBox> PlacementOf(const std::string& name) const;
  /// Open the transfer a coordinator planned for every producer (as Begin, with the plan's
  /// versions). An anchor may start from any version: it rebuilds every baseline it encodes,
  /// which is how a restarted producer rejoins its group. Commit moves to plan.target_version.
  /// Errors: FailedPrecondition (a transfer is open; a delta from another version than the
  /// tracker's); InvalidArgument (target ≠ base + 1).
  Result<TransferPlan> BeginPlanned(const TransferPlan& plan);

  /// Record that the tracker's baseline (possibly empty) is what the receivers hold now, as
  /// AdoptBaseline does for each tensor: the next transfer is a delta. For a producer that owns
  /// no chunk of the model (more producers than chunks), whose empty baseline is complete.
  /// Errors: FailedPrecondition while a transfer is open.
  Status MarkBaselineAdopted();

  /// Relabel the committed state as `version`, keeping every baseline: for a producer that
  /// adopted what the receivers hold without knowing which version that is (a trainer rank that
  /// cannot ask the fleet), once its coordinator tells it. Errors: FailedPrecondition while a
  /// transfer is open.
  Status Rebase(uint64_t version);

  /// Return whether the next Begin without force_anchor opens an anchor: the first transfer,
  /// the full_sync_interval cadence, or the drift bound. A coordinator asks every producer and
  /// opens an anchor on all of them if any says yes, so that their plans agree.
  bool NextIsAnchor() const;

  /// Make the pending bits of the open transfer the new baseline and advance the version. The
  /// version, the digests, and tensors an anchor introduced, reshaped or dropped change before it
  /// returns; the changed elements of the other tensors are scattered into their baselines by a
  /// background fold, which everything that reads a baseline waits for (WaitBaseline).
  /// Errors: FailedPrecondition (wrong id; a new tensor not fully covered — nothing changes).
  Status Commit(const TransferId& id);

  /// Wait for the last Commit's baseline fold if it has not finished. Called by every entry point
  /// that reads or replaces a baseline; public for a caller that wants the fold's time on its own
  /// clock (a benchmark) or its result before a pause. Errors: DataLoss (or the fold's error) if
  /// the fold failed — only a bug gets there: the tensors it folded are dropped from the baseline,
  /// and the next transfer is an anchor (NextIsAnchor), which rebuilds them.
  Status WaitBaseline();

  /// The last baseline fold (zeros before the first).
  BaselineFoldReport last_fold() const;

  /// Tests only: run `hook` on the fold's thread before it scatters anything, e.g. to delay the
  /// fold so that a test can race the next transfer against it; an error it returns fails the
  /// fold as a scatter's error would.
  void SetFoldHookForTesting(std::function<Status()> hook);
  /// Drop the pending bits of the open transfer. Errors: FailedPrecondition (wrong id).
  Status Abort(const TransferId& id);

  /// The committed version.
  uint64_t version() const;
  /// The open transfer, if any.
  std::optional<TransferPlan> open_transfer() const;
  /// The committed state digest of every baseline tensor.
  std::map<std::string, uint64_t> Digests() const;
  /// The state digest each tensor will have if the open transfer commits.
  std::map<std::string, uint64_t> PendingDigests() const;
  /// Bytes held by baselines, and by pending changes of the open transfer.
  uint64_t baseline_bytes() const;
  uint64_t pending_bytes() const;
  /// Read-only view of a committed baseline tensor (for tests and tools); waits for a fold still
  /// running. Errors: NotFound; the fold's error for a tensor a failed fold left half-folded.
  Result<TensorView> Baseline(const std::string& name) const;

 private:
  struct State;
  explicit DeltaTracker(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace refit::internal
