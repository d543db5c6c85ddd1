#include "receiver/apply_queue.h"

#include <algorithm>
#include <span>
#include <system_error>
#include <utility>

#include "refit/status_format.h"
#include "util/thread_name.h"

namespace refit::internal {
namespace {

/// The OS name of a decode thread (Linux keeps at most 15 bytes).
constexpr const char* kDecodeThreadName = "refit-decode";

}  // namespace

ApplyQueue::ApplyQueue(const ApplyQueueOptions& options, WeightStore& store)
    : options_(options), store_(store), undo_(options.undo) {}

ApplyQueue::~ApplyQueue() { Stop(); }

Status ApplyQueue::Start() {
  // std::jthread reports an OS refusal (EAGAIN: thread or memory limit) only by throwing; turn it
  // into a Status so no exception leaves the library.
  try {
    for (int t = 0; t < options_.decode_threads; ++t) {
      decode_threads_.emplace_back([this](const std::stop_token& stop) { RunDecodeAhead(stop); });
    }
  } catch (const std::system_error& error) {
    Stop();
    return ResourceExhausted("receiver: cannot start {} decode threads: {}",
                             options_.decode_threads, error.what());
  }
  return Status::OK();
}

void ApplyQueue::Stop() {
  for (std::jthread& thread : decode_threads_) thread.request_stop();
  for (std::jthread& thread : decode_threads_) {
    if (thread.joinable()) thread.join();
  }
  decode_threads_.clear();
}

void ApplyQueue::Push(const PayloadIds& ids, ValidatedPayload payload) {
  const uint64_t bytes = payload.size();
  queue_.push_back(QueuedPayload{ids, std::make_shared<PayloadWork>(std::move(payload)), bytes});
  queued_bytes_ += bytes;
  decode_work_.notify_one();
}

std::optional<QueuedPayload> ApplyQueue::Pop() {
  if (queue_.empty()) return std::nullopt;
  QueuedPayload payload = std::move(queue_.front());
  queue_.pop_front();
  queued_bytes_ -= payload.bytes;
  decode_work_.notify_one();  // Room to decode the next one ahead.
  return payload;
}

void PayloadWork::DecodeAndDropBytes(const PayloadLimits& limits) {
  if (payload->header().stored_body) {
    // An anchor's raw payload: decoded in its own bytes, which the decoded payload keeps (its
    // FULL items are never undone from them).
    decoded = DecodePayload(std::move(*payload), limits);
    payload.reset();
    return;
  }
  decoded = DecodePayload(*payload, limits);
  if (!decoded->ok()) return;
  // Only XOR items are undone by applying their bytes again (ApplyPayload's `received`).
  const std::span<const ItemView> items = (*decoded)->items();
  if (std::none_of(items.begin(), items.end(),
                   [](const ItemView& item) { return item.op == Op::kXor; })) {
    payload.reset();
  }
}

size_t ApplyQueue::Clear() {
  const size_t discarded = queue_.size();
  queue_.clear();
  queued_bytes_ = 0;
  return discarded;
}

void ApplyQueue::DecodeForApply(MutexLock& lock, PayloadWork& payload) {
  if (payload.decode == PayloadWork::Decode::kPending) {
    payload.decode = PayloadWork::Decode::kRunning;
    lock.unlock();
    payload.DecodeAndDropBytes(options_.limits);
    lock.lock();
    payload.decode = PayloadWork::Decode::kDone;
    return;
  }
  // The decode thread finishes what it started (a bounded decode), whatever stop says.
  decoded_.wait(lock, [&] { return payload.decode == PayloadWork::Decode::kDone; });
}

ApplyOutcome ApplyQueue::Apply(QueuedPayload& payload) {
  if (options_.before_apply) options_.before_apply(payload.ids);
  ApplyOutcome outcome;
  PayloadWork& staged = *payload.work;
  if (!staged.decoded->ok()) {
    outcome.status = staged.decoded->status();
    return outcome;
  }
  const DecodedPayload& decoded_payload = **staged.decoded;
  for (const ItemView& item : decoded_payload.items()) {
    ++outcome.items;
    outcome.changed_elements += item.count;
  }
  // The payload's bytes go to the undo log, which rolls its XOR items back by applying them
  // again: O(wire) instead of the old bits (docs/architecture.md, "Rollback").
  outcome.status = internal::ApplyPayload(decoded_payload, store_, &undo_,
                                          staged.payload.has_value() ? &*staged.payload : nullptr,
                                          options_.apply_threads);
  return outcome;
}

void ApplyQueue::EndApply() {
  applying_ = false;
  // O(records) but records grow by one per item, so this stays small next to the apply.
  undo_bytes_ = undo_.bytes();
  undo_file_bytes_ = undo_.spilled_bytes();
}

Status ApplyQueue::Rollback() {
  Status rollback = undo_.Rollback(store_);
  undo_bytes_ = undo_.bytes();
  undo_file_bytes_ = undo_.spilled_bytes();
  return rollback;
}

void ApplyQueue::ClearUndo() {
  undo_.Clear();
  undo_bytes_ = 0;
  undo_file_bytes_ = 0;
}

// A decode thread: decode the first queued payload nobody has started, so that the next payloads
// are decoded while the apply thread applies this one. Nothing it does touches the store; a
// payload it decodes is applied (or dropped by an abort) by the apply thread.
void ApplyQueue::RunDecodeAhead(const std::stop_token& stop) {
  NameCurrentThread(kDecodeThreadName);
  MutexLock lock(mutex_);
  while (!stop.stop_requested()) {
    std::shared_ptr<PayloadWork> next;
    // At most decode_threads queued payloads decoded (or being decoded) ahead of the apply: each
    // holds its decompressed body until it is applied.
    const auto pending = [&]() REFIT_REQUIRES(mutex_) {
      size_t ahead = 0;
      for (const QueuedPayload& queued : queue_) {
        if (queued.work->decode != PayloadWork::Decode::kPending) {
          if (++ahead == static_cast<size_t>(options_.decode_threads)) return false;
          continue;
        }
        next = queued.work;
        return true;
      }
      return false;
    };
    if (!decode_work_.wait(lock, stop, pending)) break;
    next->decode = PayloadWork::Decode::kRunning;
    lock.unlock();
    next->DecodeAndDropBytes(options_.limits);
    lock.lock();
    next->decode = PayloadWork::Decode::kDone;
    decoded_.notify_all();
  }
}

}  // namespace refit::internal
