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
  /// Number of recorded items.
  size_t records() const;

 private:
  friend Status ApplyPayload(const DecodedPayload&, WeightStore&, UndoLog*);
  struct Record;
  Status RollbackTo(WeightStore& store, size_t savepoint);
  std::vector<Record> records_;
};

/// Apply every item of a decoded (fully validated) payload to `store`, recording old bits in
/// `undo` (required). Before the first write, every item is checked against the store: the
/// tensor exists (NotFound), dtype and shape match (InvalidArgument). After applying each item,
/// the tensor's digest change is checked against the producer's; a mismatch means the receiver
/// was not at the payload's base — the payload is undone and DataLoss returned. Either the whole
/// payload applies, or the store is exactly as before the call.
Status ApplyPayload(const DecodedPayload& payload, WeightStore& store, UndoLog* undo);

}  // namespace refit
