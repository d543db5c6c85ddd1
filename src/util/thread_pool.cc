#include "util/thread_pool.h"

#include <algorithm>
#include <string>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "util/check.h"
#include "util/logging.h"
#include "util/mutex.h"
#include "util/thread_name.h"

namespace refit::internal {
namespace {

// The pool whose worker is running on this thread, to catch Stop() from inside a task.
thread_local const ThreadPool* current_pool = nullptr;

uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

}  // namespace

ThreadPool::ThreadPool(std::string name, size_t queue_depth)
    : name_(std::move(name)), queue_(queue_depth, fmt::format("thread pool '{}'", name_)) {}

Result<std::unique_ptr<ThreadPool>> ThreadPool::Make(const Options& options) {
  if (options.threads < 0 || options.threads > kMaxThreads) {
    return InvalidArgument("thread pool '{}': threads {} is outside [0, {}]", options.name,
                           options.threads, kMaxThreads);
  }
  if (options.name.empty()) return InvalidArgument("thread pool name is empty");
  const int threads = options.threads > 0
                          ? options.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const size_t queue_depth = options.queue_depth > 0
                                 ? options.queue_depth
                                 : static_cast<size_t>(threads) * kDefaultQueueDepthPerThread;
  // Not make_unique: the constructor is private.
  std::unique_ptr<ThreadPool> pool(new ThreadPool(options.name, queue_depth));
  pool->workers_.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) {
    // std::thread reports an OS refusal (EAGAIN: thread or memory limit) only by throwing; turn
    // it into a Status here so no exception leaves the library. The pool's destructor stops the
    // workers already started.
    try {
      pool->workers_.emplace_back(
          [raw = pool.get(), i](const std::stop_token& stop) { raw->RunWorker(stop, i); });
    } catch (const std::system_error& error) {
      return ResourceExhausted("thread pool '{}': cannot start worker {} of {}: {}", options.name,
                               i, threads, error.what());
    }
  }
  return pool;
}

ThreadPool::~ThreadPool() { Stop(); }

Status ThreadPool::Submit(Task task, TaskCompletion on_done, std::stop_token stop) {
  return queue_.Push(Work{std::move(task), std::move(on_done)}, std::move(stop));
}

void ThreadPool::Stop() {
  REFIT_DCHECK(current_pool != this, "ThreadPool::Stop called from one of its own tasks");
  internal::MutexLock lock(stop_mutex_);
  if (stopped_) return;
  stopped_ = true;
  // Stop before closing: a worker woken by the close must not start another queued task.
  for (std::jthread& worker : workers_) worker.request_stop();
  queue_.Close();
  for (std::jthread& worker : workers_) worker.join();
  // The workers are gone; whatever is still queued never ran. Its owners (TaskGroups) wait for
  // a completion, so each one gets Cancelled rather than silence.
  while (std::optional<Work> work = queue_.TryPop()) {
    Complete(*work, Cancelled("thread pool '{}' stopped before the task ran", name_));
  }
}

void ThreadPool::RunWorker(const std::stop_token& stop, int index) {
  NameCurrentThread(name_, index);
  current_pool = this;
  while (std::optional<Work> work = queue_.Pop(stop)) {
    Status status = work->task(stop);
    Complete(*work, std::move(status));
  }
  current_pool = nullptr;
}

void ThreadPool::Complete(Work& work, Status status) {
  // Destroy the task, and whatever its closure owns, before reporting it done: the completion
  // may let the owner (a returning TaskGroup::Wait) free what that closure refers to.
  work.task = nullptr;
  if (work.on_done) {
    work.on_done(std::move(status));
  } else if (!status.ok()) {
    REFIT_LOG_WARN("thread pool '{}': task failed: {}", name_, status.ToString());
  }
}

TaskGroup::~TaskGroup() {
  bool idle = false;
  {
    internal::MutexLock lock(mutex_);
    idle = pending_ == 0;
  }
  if (!idle) {
    RequestStop();
    Wait().IgnoreError();
  }
}

void TaskGroup::Submit(Task task) {
  {
    internal::MutexLock lock(mutex_);
    ++pending_;
  }
  if (stop_source_.stop_requested()) {
    // Not run, yet still reported: if the stop came from the pool rather than from an error,
    // Wait() must not claim the whole batch succeeded.
    Finish(Cancelled("task group stopped before the task was submitted"));
    return;
  }
  if (pool_ == nullptr) {
    Finish(task(stop_source_.get_token()));
    return;
  }
  Status submitted = pool_->Submit(
      [this, task = std::move(task)](const std::stop_token& pool_stop) -> Status {
        if (stop_source_.stop_requested()) {
          return Cancelled("task group stopped before the task started");
        }
        // A task sees one token; forward the pool's stop into the group's so either cancels it.
        std::stop_callback forward_pool_stop(pool_stop, [this] { stop_source_.request_stop(); });
        return task(stop_source_.get_token());
      },
      [this](Status status) { Finish(std::move(status)); }, stop_source_.get_token());
  if (!submitted.ok()) Finish(std::move(submitted));
}

Status TaskGroup::Wait() {
  internal::MutexLock lock(mutex_);
  all_done_.wait(lock, [this] { return pending_ == 0; });
  return first_error_;
}

void TaskGroup::RequestStop() {
  {
    internal::MutexLock lock(mutex_);
    if (first_error_.ok()) first_error_ = Cancelled("task group cancelled");
  }
  stop_source_.request_stop();
}

void TaskGroup::Finish(Status status) {
  bool first_error = false;
  if (!status.ok()) {
    internal::MutexLock lock(mutex_);
    if (first_error_.ok()) {
      first_error_ = std::move(status);
      first_error = true;
    }
  }
  // Request stop while this task still counts as pending, so the group cannot have been
  // destroyed by a returning Wait(); and outside mutex_, because request_stop() runs the
  // tasks' stop callbacks synchronously and one of them may call back into the group.
  if (first_error) stop_source_.request_stop();
  internal::MutexLock lock(mutex_);
  // Notify under the lock: once pending_ reaches 0 a waiter may return and destroy the group.
  if (--pending_ == 0) all_done_.notify_all();
}

Status ParallelFor(ThreadPool* pool, uint64_t n, const RangeFunction& fn, uint64_t min_chunk) {
  if (n == 0) return Status::OK();
  if (pool == nullptr) return fn(0, n);
  const uint64_t max_chunks = static_cast<uint64_t>(pool->threads()) * kParallelForChunksPerThread;
  // Rounding the chunk count down keeps every chunk but the last at least min_chunk long.
  const uint64_t chunks = std::clamp<uint64_t>(n / std::max<uint64_t>(min_chunk, 1), 1, max_chunks);
  const uint64_t chunk = CeilDiv(n, chunks);
  TaskGroup group(pool);
  for (uint64_t begin = 0; begin < n && !group.stop_token().stop_requested();) {
    const uint64_t end = begin + std::min(chunk, n - begin);
    group.Submit([&fn, begin, end](const std::stop_token&) { return fn(begin, end); });
    begin = end;
  }
  return group.Wait();
}

Status ParallelFor(int threads, uint64_t n, const RangeFunction& fn, uint64_t min_chunk) {
  if (threads == 1 || n <= std::max<uint64_t>(min_chunk, 1)) {
    return n == 0 ? Status::OK() : fn(0, n);
  }
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ThreadPool> pool,
                         ThreadPool::Make({.threads = threads, .name = "parallel-for"}));
  return ParallelFor(pool.get(), n, fn, min_chunk);
}

}  // namespace refit::internal
