#include "pipeline/staging_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "refit/status_format.h"
#include "util/mutex.h"

namespace refit {

namespace {

/// Buffers are mapped in multiples of this (whole pages), so that a buffer released by one chunk
/// fits the next chunk of about the same size.
constexpr uint64_t kGranuleBytes = uint64_t{64} << 10;

/// Unmaps a buffer the pool mapped.
struct Unmap {
  uint64_t capacity = 0;
  void operator()(std::byte* data) const { munmap(data, capacity); }
};

/// A buffer of whole pages mapped for the pool alone: page-aligned, as a device's page-locking
/// wants, and outside malloc, whose dynamic mmap threshold a freed buffer of this size would
/// raise — after which every allocation up to that size comes from the arenas, and resident
/// memory keeps what each thread's arena once held.
struct Storage {
  std::unique_ptr<std::byte, Unmap> data;
  uint64_t capacity = 0;
};

}  // namespace

struct StagingPool::State {
  internal::Mutex mutex;
  internal::CondVar released;
  // Buffers kept for reuse, not lent.
  std::vector<Storage> kept;
  // Counts releases, so that a waiter wakes only when something came back.
  uint64_t generation = 0;
  StagingPoolStats stats;
};

namespace {

/// A lent buffer with the storage it returns to the pool.
struct LentBuffer : StagingPool::Buffer {
  Storage storage;
};

}  // namespace

StagingPool::StagingPool(uint64_t budget_bytes)
    : budget_bytes_(budget_bytes), state_(std::make_shared<State>()) {}

StagingPool::~StagingPool() = default;

Result<std::shared_ptr<StagingPool::Buffer>> StagingPool::Acquire(uint64_t size,
                                                                  std::stop_token stop) {
  if (size == 0 || size > budget_bytes_) {
    return InvalidArgument("staging pool: a buffer of {} bytes does not fit the budget of {} bytes",
                           size, budget_bytes_);
  }
  State& state = *state_;
  internal::MutexLock lock(state.mutex);
  Storage storage;
  while (true) {
    // The smallest kept buffer that fits.
    auto best = state.kept.end();
    for (auto it = state.kept.begin(); it != state.kept.end(); ++it) {
      if (it->capacity >= size && (best == state.kept.end() || it->capacity < best->capacity)) {
        best = it;
      }
    }
    if (best != state.kept.end()) {
      storage = std::move(*best);
      state.kept.erase(best);
      ++state.stats.reuses;
      break;
    }
    const uint64_t capacity =
        std::min((size + kGranuleBytes - 1) / kGranuleBytes * kGranuleBytes, budget_bytes_);
    // None fits: free kept buffers, largest first, until a new one does.
    std::sort(state.kept.begin(), state.kept.end(),
              [](const Storage& a, const Storage& b) { return a.capacity < b.capacity; });
    while (state.stats.held_bytes + capacity > budget_bytes_ && !state.kept.empty()) {
      state.stats.held_bytes -= state.kept.back().capacity;
      state.kept.pop_back();
    }
    if (state.stats.held_bytes + capacity <= budget_bytes_) {
      void* mapped =
          mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (mapped == MAP_FAILED) {
        return ResourceExhausted("staging pool: cannot map a buffer of {} bytes: {}", capacity,
                                 std::strerror(errno));
      }
      storage.data =
          std::unique_ptr<std::byte, Unmap>(static_cast<std::byte*>(mapped), Unmap{capacity});
      storage.capacity = capacity;
      state.stats.held_bytes += capacity;
      state.stats.peak_held_bytes = std::max(state.stats.peak_held_bytes, state.stats.held_bytes);
      ++state.stats.allocations;
      break;
    }
    // The budget is lent out: wait for a buffer to come back.
    const uint64_t seen = state.generation;
    if (!state.released.wait(lock, stop, [&] { return state.generation != seen; })) {
      return Cancelled(
          "staging pool: stopped while waiting for {} bytes (budget {} bytes, {} "
          "held)",
          size, budget_bytes_, state.stats.held_bytes);
    }
  }
  auto* lent = new LentBuffer();
  lent->storage = std::move(storage);
  lent->bytes_ = std::span<std::byte>(lent->storage.data.get(), size);
  std::shared_ptr<State> owner = state_;
  return std::shared_ptr<Buffer>(lent, [owner](Buffer* buffer) {
    auto* returned = static_cast<LentBuffer*>(buffer);
    {
      internal::MutexLock held(owner->mutex);
      owner->kept.push_back(std::move(returned->storage));
      ++owner->generation;
    }
    owner->released.notify_all();
    delete returned;
  });
}

StagingPoolStats StagingPool::stats() const {
  internal::MutexLock lock(state_->mutex);
  return state_->stats;
}

}  // namespace refit
