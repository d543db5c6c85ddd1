// A bounded pool of reusable host buffers, which a trainer's device tensors are staged through on
// their way to the compare (StagedTensorSource, src/pipeline/staged_source.h): host memory for
// the export stays within a budget, whatever the model's size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stop_token>

#include "refit/status.h"

namespace refit {

/// What a StagingPool did so far.
struct StagingPoolStats {
  /// Host memory the pool holds now (buffers in use and kept for reuse), and the most it held.
  uint64_t held_bytes = 0;
  uint64_t peak_held_bytes = 0;
  /// Buffers allocated, and acquisitions served by a buffer released before.
  uint64_t allocations = 0;
  uint64_t reuses = 0;
};

/// A pool of host buffers whose total size never exceeds a budget. Acquire waits while the
/// budget is spent; a released buffer returns to the pool and serves the next acquisition that
/// fits in it (staging buffers are page-locked on a real device, which is expensive to repeat:
/// they are kept, not freed). A buffer kept for reuse that is too small for a request is freed to
/// make room.
///
/// Thread-safety: every method may be called from any thread; buffers may be released on any
/// thread (the stream's encode workers drop them). The pool outlives its buffers by construction
/// (they share its state).
class StagingPool {
 public:
  /// A pool of at most `budget_bytes` (> 0).
  explicit StagingPool(uint64_t budget_bytes);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  /// One buffer lent by the pool; returned to it when the last reference drops.
  class Buffer {
   public:
    std::span<std::byte> bytes() const { return bytes_; }

   private:
    friend class StagingPool;
    std::span<std::byte> bytes_;
  };

  /// Wait until `size` bytes fit within the budget, then lend a buffer of exactly `size` bytes
  /// (its storage may be larger).
  /// Errors: InvalidArgument (size 0 or over the budget); Cancelled if `stop` is requested while
  /// waiting; ResourceExhausted if the allocation fails.
  Result<std::shared_ptr<Buffer>> Acquire(uint64_t size, std::stop_token stop = {});

  uint64_t budget_bytes() const { return budget_bytes_; }
  StagingPoolStats stats() const;

 private:
  struct State;
  const uint64_t budget_bytes_;
  std::shared_ptr<State> state_;
};

}  // namespace refit
