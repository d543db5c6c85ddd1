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

/// What undoes every element a transfer has touched, kept until commit or abort.
/// Memory is O(changes) for OVERWRITE and ADD items (locations + old bits: 10 bytes per changed
/// bf16 element), O(span) for FULL items, and O(wire) for XOR items applied with their payload's
/// bytes (ApplyPayload's `payload_bytes`): XOR is its own inverse, so the log keeps the compressed
/// payload (about 1–2 bytes per changed element) and rolls such an item back by applying it
/// again, instead of keeping its old bits.
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

  /// Bytes held (locations + old bits + kept payloads).
  uint64_t bytes() const;
  /// Bytes of the payloads kept to undo XOR items by applying them again.
  uint64_t payload_bytes() const;
  /// Number of records (one per item applied without a loader; one per item and touched piece
  /// through a loader).
  size_t records() const;

  /// One applied item (or piece of one); defined and used only by the applier.
  struct Record;

 private:
  friend Status ApplyPayload(const DecodedPayload&, WeightStore&, UndoLog*,
                             std::vector<std::byte>*);
  // Undo the records from `savepoint` on. `current` is the payload being applied, whose XOR
  // records are not yet bound to kept bytes.
  Status RollbackTo(WeightStore& store, size_t savepoint, const DecodedPayload* current = nullptr);
  std::vector<Record> records_;
  // The payloads whose XOR items are undone by applying them again (Record::payload).
  std::vector<std::vector<std::byte>> payloads_;
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
///
/// `payload_bytes`: the bytes `payload` was decoded from. When given, XOR items applied without
/// a loader are recorded without their old bits; instead, on success, the bytes are moved into
/// the log (left empty here), which rolls those items back by decoding and applying them again
/// (O(wire) memory instead of 10 bytes per changed element). Null: old bits, as for every other op.
Status ApplyPayload(const DecodedPayload& payload, WeightStore& store, UndoLog* undo,
                    std::vector<std::byte>* payload_bytes = nullptr);

}  // namespace refit
