// Applying decoded payloads to a WeightStore, atomically per payload, with an undo log that rolls
// a whole transfer back to its base version bit-exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "refit/payload.h"
#include "refit/status.h"
#include "refit/weight_store.h"

namespace refit {

/// The old bits of every element a transfer has touched, kept until commit or abort.
/// Memory is O(changes) for deltas (locations + old bits) and O(span) for FULL items.
///
/// Thread-safety: none; owned by the receiver's single apply stage.
class UndoLog {
 public:
  UndoLog();
  ~UndoLog();
  UndoLog(UndoLog&&) noexcept;
  UndoLog& operator=(UndoLog&&) noexcept;

  /// Restore every recorded element and digest, newest first, then clear. After Rollback the
  /// store is bit-identical to its state when the log was last cleared.
  /// Errors: NotFound if a recorded tensor vanished from the store (nothing is restored then).
  Status Rollback(WeightStore& store);
  /// Forget everything (the transfer committed).
  void Clear();

  /// Bytes held (locations + old bits).
  uint64_t bytes() const;
  /// Number of records (one per item applied without a loader; one per item and touched piece
  /// through a loader).
  size_t records() const;

  /// One applied item (or piece of one); defined and used only by the applier.
  struct Record;

 private:
  friend Status ApplyPayload(const DecodedPayload&, WeightStore&, UndoLog*);
  Status RollbackTo(WeightStore& store, size_t savepoint);
  std::vector<Record> records_;
};

/// Apply every item of a decoded (fully validated) payload to `store`, recording old bits in
/// `undo` (required). Before the first write, every item is checked against the store: the
/// tensor exists (NotFound), dtype and shape match (InvalidArgument). After applying each item,
/// the tensor's digest change is checked against the producer's; a mismatch means the receiver
/// was not at the payload's base — the payload is undone and DataLoss returned. Either the whole
/// payload applies, or the store is exactly as before the call.
///
/// With a loader attached (WeightStore::AttachLoader), items name canonical tensors: each is
/// checked against its resolved layout (NotFound for a tensor neither held nor mapped,
/// InvalidArgument naming both shapes), items of skipped tensors are ignored, and each changed
/// element inside one of the receiver's pieces is written at its local location, in O(changes),
/// keeping both the local tensors' digests and the piece digests current. The producer's
/// per-item digest is checked only where one piece holds the whole tensor; a shard's partial
/// digests are verified by the coordinator, which sums them over the shard group.
Status ApplyPayload(const DecodedPayload& payload, WeightStore& store, UndoLog* undo);

}  // namespace refit
