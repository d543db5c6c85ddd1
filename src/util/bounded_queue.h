// A bounded, blocking multi-producer multi-consumer queue: the stage queue of every pipeline.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "refit/status.h"
#include "refit/status_format.h"
#include "util/check.h"
#include "util/mutex.h"

namespace refit::internal {

/// A FIFO queue of at most `capacity` elements. Push blocks while the queue is full and Pop
/// while it is empty, so a fast stage cannot run ahead of a slow one by more than `capacity`
/// elements: pipeline memory stays bounded whatever the model size.
///
/// Shutdown: Close() is the pipeline's "no more input / first error" signal. After it, Push
/// fails with Cancelled, and Pop still drains the remaining elements before returning nullopt.
/// A std::stop_token passed to Push or Pop cancels that one blocked call (and every later call
/// with the same token) without closing the queue for others.
///
/// Thread-safety: every member function may be called concurrently from any number of threads
/// (one mutex guards the state; blocked callers wait on condition variables). Elements are
/// moved in and out under the lock, so T's move operations should be cheap.
/// Notifications are sent while holding the lock, so the queue may be destroyed as soon as the
/// last caller that touches it has returned.
/// Memory: the ring of `capacity` slots is allocated once, at construction.
template <typename T>
class BoundedQueue {
 public:
  /// Create an empty, open queue. `name` appears in error messages. Precondition: capacity > 0
  /// (callers validate user-supplied depths).
  explicit BoundedQueue(size_t capacity, std::string name = "queue")
      : name_(std::move(name)), slots_(capacity) {
    REFIT_DCHECK(capacity > 0, "a BoundedQueue needs room for at least one element");
  }

  BoundedQueue(const BoundedQueue&) = delete;
  BoundedQueue& operator=(const BoundedQueue&) = delete;

  /// Append `value`, blocking while the queue is full. Errors: Cancelled when the queue is
  /// closed (before or while waiting) or `stop` is requested; `value` is then dropped.
  Status Push(T value, std::stop_token stop = {}) {
    internal::MutexLock lock(mutex_);
    not_full_.wait(lock, stop, [this] { return closed_ || size_ < slots_.size(); });
    if (closed_) return ClosedError();
    if (stop.stop_requested()) return Cancelled("push to {}: stop requested", name_);
    EmplaceLocked(std::move(value));
    not_empty_.notify_one();
    return Status::OK();
  }

  /// Append `value` if there is room, without blocking. `value` is moved from only on success,
  /// so a caller may retry with it. Errors: ResourceExhausted when full, Cancelled when closed.
  Status TryPush(T&& value) {
    internal::MutexLock lock(mutex_);
    if (closed_) return ClosedError();
    if (size_ == slots_.size()) {
      return ResourceExhausted("{} is full at capacity {}", name_, slots_.size());
    }
    EmplaceLocked(std::move(value));
    not_empty_.notify_one();
    return Status::OK();
  }

  /// Remove and return the oldest element, blocking while the queue is empty and open.
  /// Return nullopt when the queue is closed and drained, or when `stop` is requested (even if
  /// elements remain: a stopped consumer must not start new work).
  std::optional<T> Pop(std::stop_token stop = {}) {
    internal::MutexLock lock(mutex_);
    not_empty_.wait(lock, stop, [this] { return closed_ || size_ > 0; });
    if (stop.stop_requested() || size_ == 0) return std::nullopt;
    T value = TakeLocked();
    not_full_.notify_one();
    return value;
  }

  /// Remove and return the oldest element if there is one, without blocking; closed or not.
  std::optional<T> TryPop() {
    internal::MutexLock lock(mutex_);
    if (size_ == 0) return std::nullopt;
    std::optional<T> value(TakeLocked());
    not_full_.notify_one();
    return value;
  }

  /// Refuse further pushes and wake every blocked caller. Idempotent.
  void Close() {
    internal::MutexLock lock(mutex_);
    closed_ = true;
    not_full_.notify_all();
    not_empty_.notify_all();
  }

  /// Return the number of queued elements (a snapshot: other threads may change it at once).
  size_t size() const {
    internal::MutexLock lock(mutex_);
    return size_;
  }

  size_t capacity() const { return slots_.size(); }

  bool closed() const {
    internal::MutexLock lock(mutex_);
    return closed_;
  }

 private:
  Status ClosedError() const { return Cancelled("{} is closed", name_); }

  void EmplaceLocked(T&& value) {
    slots_[(head_ + size_) % slots_.size()].emplace(std::move(value));
    ++size_;
  }

  T TakeLocked() {
    std::optional<T>& slot = slots_[head_];
    T value = std::move(*slot);
    slot.reset();
    head_ = (head_ + 1) % slots_.size();
    --size_;
    return value;
  }

  const std::string name_;
  mutable internal::Mutex mutex_;
  // condition_variable_any rather than condition_variable: only it can wait on a stop_token.
  internal::CondVar not_full_;
  internal::CondVar not_empty_;
  // Ring buffer: the elements are slots_[head_], …, slots_[(head_ + size_ - 1) % capacity].
  std::vector<std::optional<T>> slots_;
  size_t head_ = 0;
  size_t size_ = 0;
  bool closed_ = false;
};

}  // namespace refit::internal
