// DeltaHistory: the committed deltas a producer keeps, so that a receiver that fell k versions
// behind is caught up by one folded payload per chunk instead of an anchor (docs/protocol.md
// "Per-receiver plans").
//
// Each producer keeps the XOR items of the export chunks it owns, as its stream encoded them,
// for the last transfers it committed — bounded in versions and in bytes, oldest dropped first.
// A receiver at version v (oldest_version() ≤ v < the open transfer's base) gets, for every
// owned chunk, the fold (codec/xor_fold.h) of the retained deltas v → base and of the open
// transfer's own items of that chunk: one payload per chunk that takes it from v to the target.
//
//   retained: 4→5 {chunk 0: d5}  5→6 {chunk 0: d6, chunk 1: e6}  6→7 {chunk 1: e7}
//   open 7→8 {chunk 0: d8}       receiver at 5:  chunk 0 → fold(d6, d8)   chunk 1 → fold(e6, e7)
//
// The history keeps only what folds exactly: a transfer whose items are not all XOR (an
// OVERWRITE or ADD tracker, an anchor), one based on another version than the last retained
// target (a restarted producer), or a chunk whose tensors changed shape clears it, and receivers
// behind that point get an anchor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "refit/item.h"
#include "refit/status.h"
#include "util/mutex.h"
#include "util/thread_annotations.h"

namespace refit {

/// Options of DeltaHistory::Make.
struct DeltaHistoryOptions {
  /// Committed deltas kept: a receiver up to this many versions behind the base can be folded.
  /// Default 8: a worker restarted within a few steps, or one that missed a few syncs, is folded;
  /// one further behind gets an anchor, which by then costs little more than the fold.
  uint32_t max_versions = 8;
  /// Bytes of retained items (locations and values, before compression) on this producer. With
  /// ~2 % of bf16 elements changing per step a delta is about 3 % of the model's bytes, so the
  /// default 256 MiB keeps 8 deltas of an 8 GiB model's share. 0: keep no history.
  uint64_t max_bytes = uint64_t{256} << 20;
};

/// The retained deltas of one producer.
///
/// Thread-safety: every method takes an internal mutex; Record and FoldChunk may be called from
/// the stream's threads while nothing else runs.
class DeltaHistory {
 public:
  /// Errors: InvalidArgument for max_versions of 0 with max_bytes > 0 (say max_bytes 0 to keep
  /// nothing).
  static Result<std::unique_ptr<DeltaHistory>> Make(const DeltaHistoryOptions& options);

  /// Open the recording of the transfer base_version → base_version + 1. An anchor, or a base
  /// other than the newest retained target, clears what is retained (it no longer chains to the
  /// receivers' versions). Replaces a recording left open.
  void Begin(uint64_t base_version, bool anchor);
  /// Record what the open transfer encoded of owned chunk `chunk`: its `signature` (a hash of its
  /// tensors' names, shapes and spans, ChunkSignature) and its items. An item that is not XOR
  /// makes the transfer unfoldable (Commit then clears the history). No-op without a recording.
  void Record(uint64_t chunk, uint64_t signature, std::span<const Item> items);
  /// Keep the open recording as the newest delta, then drop the oldest until the bounds hold.
  void Commit();
  /// Drop the open recording.
  void Abort();
  /// Drop everything.
  void Clear();

  /// The oldest version a receiver may hold and still be folded to the open transfer's target:
  /// the base of the oldest retained delta, or the open base itself when nothing is retained.
  /// nullopt without an open recording.
  std::optional<uint64_t> oldest_version() const;
  /// Whether a receiver at `from` can be folded: oldest_version() ≤ from < the open base.
  bool CanFold(uint64_t from) const;

  /// The folded XOR items that take owned chunk `chunk` from version `from` to the open
  /// transfer's target: the retained deltas after `from` and `current` (the open transfer's
  /// items of the chunk), one item per tensor, in tensor-name order. Empty when nothing changed.
  /// Errors: FailedPrecondition when `from` cannot be folded (CanFold) or the chunk's signature
  /// differs from the one retained (the chunking changed; the history is cleared at the next
  /// Begin), naming the chunk and the versions; those of FoldXorItems.
  Result<std::vector<Item>> FoldChunk(uint64_t from, uint64_t chunk, uint64_t signature,
                                      std::span<const Item> current) const;

  /// What is retained: deltas and bytes.
  uint32_t retained_versions() const;
  uint64_t retained_bytes() const;
  const DeltaHistoryOptions& options() const { return options_; }

 private:
  struct ChunkDelta {
    uint64_t signature = 0;
    std::vector<Item> items;
  };
  struct Delta {
    uint64_t base_version = 0;
    std::map<uint64_t, ChunkDelta> chunks;
    uint64_t bytes = 0;
    bool foldable = true;
  };

  explicit DeltaHistory(const DeltaHistoryOptions& options) : options_(options) {}
  void ClearLocked() REFIT_REQUIRES(mutex_);

  const DeltaHistoryOptions options_;
  mutable internal::Mutex mutex_;
  // Oldest first; each based on the previous one's target.
  std::vector<Delta> retained_ REFIT_GUARDED_BY(mutex_);
  uint64_t retained_bytes_ REFIT_GUARDED_BY(mutex_) = 0;
  std::optional<Delta> open_ REFIT_GUARDED_BY(mutex_);
  // A chunk's signature differed from the retained one: clear at the next Begin.
  mutable bool stale_ REFIT_GUARDED_BY(mutex_) = false;
};

/// The signature DeltaHistory compares chunks by: a hash of each tensor's name, dtype, shape and
/// byte size, in chunk order.
uint64_t ChunkSignature(std::span<const TensorView> tensors);

}  // namespace refit
