// ApplyQueue: the receiver's work room — the bounded FIFO of staged payloads, the threads that
// decode them ahead of the apply, the apply itself into the WeightStore, and the undo log that
// rolls an open transfer back. It knows nothing of the transfer protocol: ReceiverSession asks
// its ledger (transfer_ledger.h) what may be staged and applied, and drives the queue.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <thread>
#include <vector>

#include "receiver/apply.h"
#include "refit/payload.h"
#include "refit/status.h"
#include "refit/transfer.h"
#include "refit/weight_store.h"
#include "util/mutex.h"

namespace refit::internal {

/// A staged payload's bytes and their decode, which a decode thread may do ahead of the apply
/// (validation, checksum, decompression: the part of a payload's work that does not touch the
/// store). Shared: a thread decoding it keeps it alive when an abort empties the queue.
struct PayloadWork {
  explicit PayloadWork(ValidatedPayload staged) : payload(std::move(staged)) {}
  /// Guarded by the queue's mutex: who decodes it, and whether that is done.
  enum class Decode : uint8_t { kPending, kRunning, kDone };
  Decode decode = Decode::kPending;
  /// As staged; the apply moves it to the undo log (an XOR item is undone by applying it again).
  /// Dropped once decoded when no item needs it (an anchor's FULL items: their undo keeps the old
  /// bits, or nothing), so that a queued anchor payload holds its body, not body and bytes.
  std::optional<ValidatedPayload> payload;
  /// Written by the thread that set kRunning, without the lock; read once kDone.
  std::optional<Result<DecodedPayload>> decoded;

  /// Decode the payload into `decoded`, then drop its bytes unless an item is undone from them.
  /// Called by the thread that set kRunning.
  void DecodeAndDropBytes(const PayloadLimits& limits);
};

/// One staged payload waiting for the apply.
struct QueuedPayload {
  PayloadIds ids;
  std::shared_ptr<PayloadWork> work;
  /// Its staged size (ValidatedPayload::size), which the queue's byte count holds while queued.
  uint64_t bytes = 0;
};

/// What one payload's apply did.
struct ApplyOutcome {
  Status status;
  uint64_t items = 0;
  uint64_t changed_elements = 0;
};

/// The queue's options (from ReceiverSessionOptions).
struct ApplyQueueOptions {
  /// Threads that decode queued payloads ahead of the apply (0: the apply decodes).
  int decode_threads = 0;
  /// Threads one payload's items apply on (ApplyPayload's `threads`).
  int apply_threads = 1;
  /// The limits a payload's decode is held to.
  PayloadLimits limits{};
  /// The undo log's policy for FULL spans.
  internal::UndoLogOptions undo{};
  /// Called before each payload is applied, without the lock (tracing, tests).
  std::function<void(const PayloadIds&)> before_apply;
};

/// The staged payloads of the open transfer, their decode and apply, and its undo log.
///
/// Thread-safety: one mutex (mutex()) guards the queue, the decode states, the apply flag and the
/// undo counters; the owner holds it for every call marked REFIT_REQUIRES and guards its own
/// transfer state with it too, so that one wait sees both (room in the queue or the transfer
/// ending). Apply runs without it, on one thread at a time, while applying() is set; the undo log
/// is otherwise touched only while nothing applies. The decode threads are the queue's own.
class ApplyQueue {
 public:
  ApplyQueue(const ApplyQueueOptions& options, WeightStore& store);
  ~ApplyQueue();
  ApplyQueue(const ApplyQueue&) = delete;
  ApplyQueue& operator=(const ApplyQueue&) = delete;

  /// Start the decode threads. Errors: ResourceExhausted when the OS refuses a thread.
  Status Start();
  /// Stop and join the decode threads; each finishes a decode it started.
  void Stop();

  /// The mutex of the queue and of its owner's state.
  Mutex& mutex() REFIT_RETURN_CAPABILITY(mutex_) { return mutex_; }

  size_t size() const REFIT_REQUIRES(mutex_) { return queue_.size(); }
  /// The staged bytes (ValidatedPayload::size) of the queued payloads.
  uint64_t queued_bytes() const REFIT_REQUIRES(mutex_) { return queued_bytes_; }
  bool empty() const REFIT_REQUIRES(mutex_) { return queue_.empty(); }
  /// Whether a payload is being applied (without the lock).
  bool applying() const REFIT_REQUIRES(mutex_) { return applying_; }
  /// Nothing queued and nothing applying.
  bool drained() const REFIT_REQUIRES(mutex_) { return queue_.empty() && !applying_; }

  /// Queue a staged payload; wakes a decode thread.
  void Push(const PayloadIds& ids, ValidatedPayload payload) REFIT_REQUIRES(mutex_);
  /// Take the oldest queued payload, or nothing.
  std::optional<QueuedPayload> Pop() REFIT_REQUIRES(mutex_);
  /// Discard every queued payload unapplied; returns how many.
  size_t Clear() REFIT_REQUIRES(mutex_);

  /// Make sure `payload` is decoded: decode it now (the lock let go meanwhile) unless a decode
  /// thread is on it, then wait for that thread. `lock` holds mutex().
  void DecodeForApply(MutexLock& lock, PayloadWork& payload) REFIT_REQUIRES(mutex_);

  /// Mark a payload as being applied, and the apply as done with its outcome's undo sizes.
  void BeginApply() REFIT_REQUIRES(mutex_) { applying_ = true; }
  void EndApply() REFIT_REQUIRES(mutex_);
  /// Apply a decoded payload to the store, recording its undo. Called without the lock, between
  /// BeginApply and EndApply, by one thread.
  ApplyOutcome Apply(QueuedPayload& payload);

  /// Roll the store back to where the undo log was last emptied (UndoLog::Rollback). Only while
  /// nothing applies.
  Status Rollback() REFIT_REQUIRES(mutex_);
  /// Forget the undo log (the transfer committed). Only while nothing applies.
  void ClearUndo() REFIT_REQUIRES(mutex_);
  /// Whether a Rollback now restores the store bit-exactly (UndoLog::exact).
  bool undo_exact() const REFIT_REQUIRES(mutex_) { return undo_.exact(); }
  /// The undo log's bytes in memory and in its spill file, as of the last apply or rollback.
  uint64_t undo_bytes() const REFIT_REQUIRES(mutex_) { return undo_bytes_; }
  uint64_t undo_file_bytes() const REFIT_REQUIRES(mutex_) { return undo_file_bytes_; }

 private:
  void RunDecodeAhead(const std::stop_token& stop);

  const ApplyQueueOptions options_;
  WeightStore& store_;
  Mutex mutex_;
  /// Decode threads wait here for a payload to decode ahead; the apply waits on `decoded_` for
  /// the decode thread to finish the payload it needs.
  CondVar decode_work_;
  CondVar decoded_;
  std::deque<QueuedPayload> queue_ REFIT_GUARDED_BY(mutex_);
  uint64_t queued_bytes_ REFIT_GUARDED_BY(mutex_) = 0;
  bool applying_ REFIT_GUARDED_BY(mutex_) = false;
  /// Written by Apply without the lock while `applying_`; otherwise under the lock.
  internal::UndoLog undo_;
  uint64_t undo_bytes_ REFIT_GUARDED_BY(mutex_) = 0;
  uint64_t undo_file_bytes_ REFIT_GUARDED_BY(mutex_) = 0;
  std::vector<std::jthread> decode_threads_;
};

}  // namespace refit::internal
