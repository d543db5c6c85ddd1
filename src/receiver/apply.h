// Applying decoded payloads to a WeightStore, atomically per payload, with an undo log that rolls
// a whole transfer back to its base version bit-exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "refit/anchor_undo.h"
#include "refit/payload.h"
#include "refit/status.h"
#include "refit/weight_store.h"

namespace refit::internal {

/// Options of an UndoLog.
struct UndoLogOptions {
  AnchorUndo anchor_undo = AnchorUndo::kMemory;
  /// kFile: the directory of the spill file; empty: $TMPDIR, or /tmp.
  std::string spill_directory{};
};

/// What undoes every element a transfer has touched, kept until commit or abort.
/// Memory is O(changes) for OVERWRITE and ADD items (locations + old bits: 10 bytes per changed
/// bf16 element), O(span) for FULL items (or none, by UndoLogOptions::anchor_undo), and O(wire)
/// for XOR items applied with their payload's bytes (ApplyPayload's `received`): XOR is its
/// own inverse, so the log keeps the compressed payload (about 1–2 bytes per changed element) and
/// rolls such an item back by applying it again, instead of keeping its old bits.
///
/// Thread-safety: none; owned by the receiver's single apply stage.
class UndoLog {
 public:
  UndoLog();
  explicit UndoLog(UndoLogOptions options);
  ~UndoLog();
  UndoLog(UndoLog&&) noexcept;
  UndoLog& operator=(UndoLog&&) noexcept;

  /// Check the options (a kFile spill directory that is not a writable directory is
  /// InvalidArgument naming it). The log opens its spill file only when it first needs it.
  static Status Validate(const UndoLogOptions& options);

  /// Restore every recorded element and digest, newest first, then clear. When exact(), the
  /// store is afterwards bit-identical to its state when the log was last cleared. Otherwise
  /// (AnchorUndo::kNone after a FULL item) the spans whose old bits were not kept keep the bits
  /// they were given, and the digests of their tensors are recomputed from the bytes, so that the
  /// store stays self-consistent for the anchor that must follow.
  /// Errors: NotFound if a recorded tensor vanished from the store (nothing is restored then);
  /// IoError if the spill file cannot be read back (the records not yet restored are kept).
  Status Rollback(WeightStore& store);
  /// Forget everything (the transfer committed), and give the spill file's space back.
  void Clear();

  /// Whether a Rollback now restores the store bit-exactly: false once a FULL item was applied
  /// under AnchorUndo::kNone, until the log is emptied (Clear or Rollback; a failed payload's own
  /// rollback does not make it exact again: its FULL spans stay written).
  bool exact() const { return exact_; }

  /// Bytes held in memory (locations + old bits + kept payloads).
  uint64_t bytes() const;
  /// Bytes of old bits in the spill file (AnchorUndo::kFile).
  uint64_t spilled_bytes() const { return spill_end_; }
  /// Bytes of the payloads kept to undo XOR items by applying them again.
  uint64_t payload_bytes() const;
  /// Number of records (one per item applied without a loader; one per item and touched piece
  /// through a loader).
  size_t records() const;

  /// One applied item (or piece of one); defined in apply_internal.h and made only by the
  /// applier.
  struct Record;

  // ---- What the applier (apply.cc, apply_loader.cc) records while a payload applies. ---------

  /// Where the records of the next payload begin: RollbackTo(savepoint) undoes exactly it.
  size_t Savepoint() const;
  /// Add `record`; the reference is valid until the next record is added.
  Record& AddRecord(Record record);
  /// Add records made apart (by the threads of a parallel apply), in order, after the others.
  void AppendRecords(std::vector<Record>&& records);
  /// The records from `savepoint` on.
  std::span<Record> RecordsFrom(size_t savepoint);
  /// Whether the old bits of a FULL span are kept (anchor_undo is not kNone).
  bool KeepsFullBits() const { return options_.anchor_undo != AnchorUndo::kNone; }
  /// Whether KeepFullSpan of distinct records may run on several threads at once without a lock
  /// (kMemory: each record keeps its own bits; the others share the spill file or the flag).
  bool KeepsFullBitsPerRecord() const { return options_.anchor_undo == AnchorUndo::kMemory; }
  /// Keep `payload`: the XOR records from `savepoint` on that re-apply the payload being applied
  /// now refer to it, and are undone by applying it again.
  void KeepPayload(size_t savepoint, ValidatedPayload payload);
  /// Undo the records from `savepoint` on, newest first. `current` is the payload being applied,
  /// whose XOR records are not yet bound to kept bytes. Errors: as Rollback.
  Status RollbackTo(WeightStore& store, size_t savepoint, const DecodedPayload* current = nullptr);
  /// Keep the old bits of a FULL record's span, as the anchor_undo policy says, before they are
  /// overwritten. Errors: IoError when the spill file cannot be made or written.
  Status KeepFullSpan(Record& record, std::span<const std::byte> old_bits);
  /// Before FULL spans of `records` (of `span_bytes` each) are kept from several threads at once:
  /// set aside each record's range of the spill file, size its memory, or mark the log inexact,
  /// so that KeepFullSpan of distinct records touches nothing shared. Errors: IoError.
  Status ReserveFullSpans(std::span<Record> records, std::span<const uint64_t> span_bytes);

 private:
  // Read `length` spilled bytes at `offset` back into `out`. Errors: IoError.
  Status ReadSpill(uint64_t offset, std::span<std::byte> out) const;
  // Shrink the spill file to what the remaining records use.
  void TrimSpill();
  // Make the spill file if there is none. Errors: IoError.
  Status OpenSpillFile();

  UndoLogOptions options_;
  std::vector<Record> records_;
  // The payloads whose XOR items are undone by applying them again (Record::payload).
  std::vector<ValidatedPayload> payloads_;
  // kFile: the spill file (unlinked; -1 until first needed), its path for messages, and the end
  // of what this transfer wrote.
  int spill_fd_ = -1;
  std::string spill_path_;
  uint64_t spill_end_ = 0;
  bool exact_ = true;
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
/// `received`: the payload `payload` was decoded from. When given, XOR items applied without a
/// loader are recorded without their old bits; instead, on success, the payload is moved into the
/// log, which rolls those items back by decoding and applying them again (O(wire) memory instead
/// of 10 bytes per changed element). Null: old bits, as for every other op.
///
/// `threads` > 1: a payload of more than one tensor whose items are all FULL (an anchor's) or all
/// deltas applies its tensors on up to that many threads, one tensor (with its items in order)
/// per thread at a time, with the same all-or-nothing result. A tensor whose one item is an XOR
/// delta recorded by `received` splits further, into slices of kLocationMarkInterval changes
/// that decode from the item's location marks and apply on any of the threads, so that a payload
/// of one large tensor uses them too (its rollback re-applies the item whole, once every slice
/// ran). A payload that mixes FULL and
/// delta items applies its items in order on the calling thread. Through a loader, any payload:
/// a thread takes every item that writes one of its local tensors (q, k and v into one fused
/// qkv_proj go together); a FULL span's old bits are then kept under a lock (spill file, or the
/// log marked inexact) unless the policy keeps them in memory.
Status ApplyPayload(const DecodedPayload& payload, WeightStore& store, UndoLog* undo,
                    ValidatedPayload* received = nullptr, int threads = 1);

}  // namespace refit::internal
