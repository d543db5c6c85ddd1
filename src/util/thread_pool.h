// Worker threads with cooperative cancellation: ThreadPool, TaskGroup and ParallelFor.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "refit/status.h"
#include "util/bounded_queue.h"
#include "util/mutex.h"

namespace refit::internal {

/// A unit of work. It should poll `stop` at convenient points (between chunks, before blocking)
/// and return Cancelled promptly once stop is requested.
using Task = std::function<Status(std::stop_token stop)>;

/// Receives a task's result exactly once: the task's own Status, or Cancelled if the task was
/// dropped unrun because its pool stopped.
using TaskCompletion = std::function<void(Status)>;

/// A fixed set of named worker threads fed by a bounded FIFO submission queue.
///
/// Lifecycle: Make() starts all workers; Stop() (or the destructor) requests stop on every
/// running task's stop_token, cancels the tasks still queued (their completions get Cancelled)
/// and joins the workers. A stopped pool refuses new tasks. Most callers submit through a
/// TaskGroup, which collects results; bare Submit() is for callers with their own completion.
///
/// Thread-safety: Submit() and Stop() may be called concurrently from any thread. Stop() must
/// not be called from one of the pool's own tasks (a worker cannot join itself), and a task must
/// not block on work it submits to its own pool (Submit blocks while the queue is full and
/// TaskGroup::Wait blocks until its tasks ran: with every worker waiting, nothing would run).
class ThreadPool {
 public:
  /// Options of Make.
  struct Options {
    /// Worker threads; 0 means one per hardware thread (std::thread::hardware_concurrency()).
    int threads = 0;
    /// Prefix of the workers' OS thread names (visible in top, gdb and log lines; Linux keeps
    /// the first 15 bytes) and of error messages.
    std::string name = "refit-pool";
    /// Capacity of the submission queue; 0 means kDefaultQueueDepthPerThread per worker.
    /// Submit blocks while it is full, which bounds the memory held by pending tasks.
    size_t queue_depth = 0;
  };

  /// Default queue slots per worker: enough that a worker finishing a task finds the next one
  /// queued (no idle gap while the submitter wakes), few enough that queued closures stay small.
  static constexpr size_t kDefaultQueueDepthPerThread = 4;
  /// Upper bound on Options::threads: far above any core count we run on, low enough that a
  /// mistyped value (e.g. a byte count) is reported instead of exhausting the process.
  static constexpr int kMaxThreads = 4096;

  /// Create a pool and start its workers. Errors: InvalidArgument for threads outside
  /// [0, kMaxThreads] or an empty name; ResourceExhausted when the OS refuses a thread.
  static Result<std::unique_ptr<ThreadPool>> Make(const Options& options);

  /// Stop() and join.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// Enqueue `task`, blocking while the submission queue is full. Unless Submit returns an
  /// error, `on_done` (if set) is called exactly once with the task's result, on the worker that
  /// ran it or on the thread that stopped the pool; without `on_done`, an error result is
  /// logged. Errors (then neither `task` nor `on_done` is ever called): Cancelled when the pool
  /// is stopped or `stop` is requested while waiting for room.
  Status Submit(Task task, TaskCompletion on_done = nullptr, std::stop_token stop = {});

  /// Request stop on running tasks, cancel queued ones, join every worker. Idempotent;
  /// concurrent callers all return after the workers are joined.
  void Stop();

  int threads() const { return static_cast<int>(workers_.size()); }
  const std::string& name() const { return name_; }

 private:
  struct Work {
    Task task;
    TaskCompletion on_done;
  };

  ThreadPool(std::string name, size_t queue_depth);
  void RunWorker(const std::stop_token& stop, int index);
  void Complete(Work& work, Status status);

  const std::string name_;
  BoundedQueue<Work> queue_;
  // Serialises Stop() so concurrent callers do not join the same thread twice.
  internal::Mutex stop_mutex_;
  bool stopped_ = false;
  std::vector<std::jthread> workers_;
};

/// A batch of tasks whose first error wins: Wait() returns it, and it requests stop on the
/// group's stop_token so the other tasks can bail out early; tasks not yet started are skipped
/// (they count as Cancelled). Stopping the pool also stops the group.
///
/// With a null pool, tasks run inline in Submit() on the calling thread, so single-threaded
/// callers use the same code path.
///
/// Thread-safety: Submit(), Wait(), RequestStop() and stop_token() may be called from any
/// thread, including from the group's own tasks (except Wait(), see ThreadPool). The group must
/// outlive its tasks: the destructor requests stop and waits for the ones still pending.
class TaskGroup {
 public:
  explicit TaskGroup(ThreadPool* pool) : pool_(pool) {}
  ~TaskGroup();
  TaskGroup(const TaskGroup&) = delete;
  TaskGroup& operator=(const TaskGroup&) = delete;

  /// Run `task` on the pool (blocking while its queue is full), or inline without a pool.
  /// Once the group has stopped, `task` is not run. Its result is reported by Wait().
  void Submit(Task task);

  /// Block until every task submitted so far has finished; return the first error, or OK.
  /// The group stays usable: later Submit()s run (unless stopped) and a later Wait() reports the
  /// same first error.
  Status Wait();

  /// Cancel the group: pending and later tasks are skipped, running ones see stop requested,
  /// and Wait() returns Cancelled unless a task failed earlier.
  void RequestStop();

  /// The token handed to the group's tasks; stop is requested on the first error.
  std::stop_token stop_token() const { return stop_source_.get_token(); }

 private:
  // Record a finished task's result; the first error requests stop on the group.
  void Finish(Status status);

  ThreadPool* const pool_;
  std::stop_source stop_source_;
  internal::Mutex mutex_;
  internal::CondVar all_done_;
  uint64_t pending_ = 0;
  Status first_error_;
};

/// The body of a ParallelFor: process indices [begin, end).
using RangeFunction = std::function<Status(uint64_t begin, uint64_t end)>;

/// Chunks per worker in ParallelFor: a few per thread even out unequal chunk costs (page faults,
/// dense vs sparse regions) at the price of a few extra hand-offs.
inline constexpr uint64_t kParallelForChunksPerThread = 4;

/// Call `fn` on disjoint chunks covering [0, n) exactly once, in parallel on `pool` (inline on
/// the calling thread when `pool` is null), each chunk at least `min_chunk` indices long except
/// possibly the last. Return the first error; after an error, chunks not yet started are
/// skipped. `fn` must be safe to call concurrently. Must not be called from a task of `pool`.
Status ParallelFor(ThreadPool* pool, uint64_t n, const RangeFunction& fn, uint64_t min_chunk = 1);

/// As above on a temporary pool of `threads` workers (0 = one per hardware thread; 1, or a
/// range that fits one chunk, runs inline without creating threads).
/// Errors: as above, plus those of ThreadPool::Make for a bad `threads`.
Status ParallelFor(int threads, uint64_t n, const RangeFunction& fn, uint64_t min_chunk = 1);

}  // namespace refit::internal
