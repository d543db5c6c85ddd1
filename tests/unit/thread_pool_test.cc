#include "util/thread_pool.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <stop_token>
#include <thread>
#include <vector>

#include "refit/status_format.h"
#include "test_util.h"

namespace refit::internal {
namespace {

// Block until `stop` is requested; return Cancelled, as a well-behaved task does.
Status WaitForStop(std::stop_token stop) {
  std::mutex mutex;
  std::condition_variable_any stopped;
  std::unique_lock lock(mutex);
  stopped.wait(lock, stop, [] { return false; });
  return Cancelled("task saw stop");
}

TEST(ThreadPoolTest, MakeRejectsBadOptions) {
  EXPECT_STATUS_MSG(InvalidArgument, "threads -1",
                    ThreadPool::Make({.threads = -1, .name = "compare"}));
  EXPECT_STATUS_MSG(InvalidArgument, "threads 4097",
                    ThreadPool::Make({.threads = ThreadPool::kMaxThreads + 1, .name = "compare"}));
  EXPECT_STATUS(InvalidArgument, ThreadPool::Make({.threads = 1, .name = ""}));
}

TEST(ThreadPoolTest, ZeroThreadsMeansOnePerHardwareThread) {
  ASSERT_OK_AND_ASSIGN(auto pool, ThreadPool::Make({.threads = 0}));
  EXPECT_EQ(pool->threads(), std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
  EXPECT_EQ(pool->name(), "refit-pool");
}

TEST(ThreadPoolTest, AllTasksRunOnWorkerThreads) {
  constexpr int kThreads = 3;
  constexpr int kTasks = 200;
  ASSERT_OK_AND_ASSIGN(auto pool, ThreadPool::Make({.threads = kThreads, .name = "runner"}));
  std::atomic<int> ran{0};
  std::mutex mutex;
  std::set<std::thread::id> thread_ids;
  TaskGroup group(pool.get());
  for (int i = 0; i < kTasks; ++i) {
    group.Submit([&](std::stop_token) {
      ++ran;
      std::lock_guard lock(mutex);
      thread_ids.insert(std::this_thread::get_id());
      return Status::OK();
    });
  }
  ASSERT_OK(group.Wait());
  EXPECT_EQ(ran, kTasks);
  EXPECT_FALSE(thread_ids.contains(std::this_thread::get_id()));
  EXPECT_LE(thread_ids.size(), static_cast<size_t>(kThreads));
}

TEST(ThreadPoolTest, SubmitCallsTheCompletionWithTheResult) {
  ASSERT_OK_AND_ASSIGN(auto pool, ThreadPool::Make({.threads = 1, .name = "completion"}));
  std::mutex mutex;
  std::condition_variable done;
  std::vector<Status> results;
  for (int i = 0; i < 2; ++i) {
    ASSERT_OK(pool->Submit(
        [i](std::stop_token) { return i == 0 ? Status::OK() : NotFound("tensor {}", i); },
        [&](Status status) {
          std::lock_guard lock(mutex);
          results.push_back(std::move(status));
          done.notify_all();
        }));
  }
  std::unique_lock lock(mutex);
  done.wait(lock, [&] { return results.size() == 2; });
  // One worker runs tasks in submission order.
  EXPECT_TRUE(results[0].ok());
  EXPECT_EQ(results[1], NotFound("tensor 1"));
}

TEST(ThreadPoolTest, FirstErrorWinsAndStopsTheOtherTasks) {
  constexpr int kThreads = 4;
  constexpr int kBlockedTasks = 20;
  ASSERT_OK_AND_ASSIGN(auto pool, ThreadPool::Make({.threads = kThreads, .name = "first-error"}));
  TaskGroup group(pool.get());
  // The failing task is queued first, so a worker takes it before any of the blocking tasks can
  // occupy every worker; each blocking task returns only once it sees stop requested.
  group.Submit([](std::stop_token) { return DataLoss("payload 7: checksum mismatch"); });
  std::atomic<int> started{0};
  std::atomic<int> saw_stop{0};
  for (int i = 0; i < kBlockedTasks; ++i) {
    group.Submit([&](std::stop_token stop) {
      ++started;
      Status status = WaitForStop(stop);
      ++saw_stop;
      return status;
    });
  }
  const Status status = group.Wait();
  // The real error, not the Cancelled of the tasks it stopped.
  EXPECT_EQ(status, DataLoss("payload 7: checksum mismatch"));
  EXPECT_TRUE(group.stop_token().stop_requested());
  // Every task that started saw the stop and finished before Wait() returned; the others were
  // skipped without running.
  EXPECT_EQ(saw_stop, started);
  // The group stays stopped: a later task is skipped and the first error is kept.
  std::atomic<bool> ran_late{false};
  group.Submit([&](std::stop_token) {
    ran_late = true;
    return Status::OK();
  });
  EXPECT_EQ(group.Wait(), DataLoss("payload 7: checksum mismatch"));
  EXPECT_FALSE(ran_late);
}

TEST(ThreadPoolTest, InlineGroupRunsOnTheCallingThread) {
  TaskGroup group(nullptr);
  std::thread::id ran_on;
  group.Submit([&](std::stop_token) {
    ran_on = std::this_thread::get_id();
    return Status::OK();
  });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  group.Submit([](std::stop_token) { return Unavailable("peer 2 down"); });
  std::atomic<bool> ran_after_error{false};
  group.Submit([&](std::stop_token) {
    ran_after_error = true;
    return Status::OK();
  });
  EXPECT_EQ(group.Wait(), Unavailable("peer 2 down"));
  EXPECT_FALSE(ran_after_error);
}

TEST(ThreadPoolTest, RequestStopCancelsTheGroup) {
  ASSERT_OK_AND_ASSIGN(auto pool, ThreadPool::Make({.threads = 2, .name = "cancel"}));
  TaskGroup group(pool.get());
  group.Submit(WaitForStop);
  group.Submit(WaitForStop);
  group.RequestStop();
  EXPECT_STATUS_MSG(Cancelled, "task group cancelled", group.Wait());
}

TEST(ThreadPoolTest, StopCancelsRunningAndQueuedTasks) {
  ASSERT_OK_AND_ASSIGN(auto pool, ThreadPool::Make({.threads = 1, .name = "stopper"}));
  TaskGroup group(pool.get());
  std::atomic<bool> running{false};
  group.Submit([&](std::stop_token stop) {
    running = true;
    return WaitForStop(stop);
  });
  std::atomic<int> queued_ran{0};
  for (int i = 0; i < 3; ++i) {
    group.Submit([&](std::stop_token) {
      ++queued_ran;
      return Status::OK();
    });
  }
  // Stop only once the single worker holds the blocking task, so the others are still queued.
  while (!running) std::this_thread::yield();
  pool->Stop();
  EXPECT_STATUS(Cancelled, group.Wait());
  EXPECT_EQ(queued_ran, 0);

  // A stopped pool refuses work; a group on it reports Cancelled rather than hanging.
  EXPECT_STATUS_MSG(Cancelled, "stopper",
                    pool->Submit([](std::stop_token) { return Status::OK(); }));
  TaskGroup late(pool.get());
  late.Submit([](std::stop_token) { return Status::OK(); });
  EXPECT_STATUS(Cancelled, late.Wait());
  pool->Stop();  // idempotent
}

TEST(ThreadPoolTest, DestroyingAGroupCancelsAndWaitsForItsTasks) {
  ASSERT_OK_AND_ASSIGN(auto pool, ThreadPool::Make({.threads = 2, .name = "scoped"}));
  std::atomic<int> started{0};
  std::atomic<int> finished{0};
  {
    TaskGroup group(pool.get());
    for (int i = 0; i < 2; ++i) {
      group.Submit([&](std::stop_token stop) {
        ++started;
        Status status = WaitForStop(stop);
        ++finished;
        return status;
      });
    }
    while (started == 0) std::this_thread::yield();
  }  // no Wait(): the destructor must stop the blocked tasks and wait for them
  EXPECT_EQ(finished, started);
  TaskGroup next(pool.get());
  next.Submit([](std::stop_token) { return Status::OK(); });
  EXPECT_OK(next.Wait());
}

// Check that ParallelFor over [0, n) calls fn on disjoint chunks covering each index once.
void ExpectCoversOnce(ThreadPool* pool, uint64_t n, uint64_t min_chunk) {
  std::vector<std::atomic<int>> hits(n);
  std::atomic<int> calls{0};
  ASSERT_OK(ParallelFor(
      pool, n,
      [&](uint64_t begin, uint64_t end) {
        EXPECT_LT(begin, end);
        EXPECT_LE(end, n);
        if (end < n) {
          EXPECT_GE(end - begin, min_chunk) << "chunk [" << begin << ", " << end << ")";
        }
        for (uint64_t i = begin; i < end; ++i) ++hits[i];
        ++calls;
        return Status::OK();
      },
      min_chunk));
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << "index " << i << " of " << n;
  if (n > 0) {
    // Chunks are at least min_chunk long, so there are at most ceil(n / min_chunk) of them.
    EXPECT_LE(static_cast<uint64_t>(calls), (n + min_chunk - 1) / min_chunk);
  }
}

TEST(ParallelForTest, CoversTheRangeExactlyOnce) {
  ASSERT_OK_AND_ASSIGN(auto pool, ThreadPool::Make({.threads = 3, .name = "pfor"}));
  for (uint64_t n : {0, 1, 2, 3, 7, 12, 13, 97, 1000, 4099}) {
    SCOPED_TRACE(n);
    ExpectCoversOnce(pool.get(), n, 1);
    ExpectCoversOnce(pool.get(), n, 10);
    ExpectCoversOnce(nullptr, n, 1);
  }
}

TEST(ParallelForTest, ThreadCountOverload) {
  for (int threads : {0, 1, 2, 5}) {
    SCOPED_TRACE(threads);
    std::vector<std::atomic<int>> hits(1000);
    ASSERT_OK(ParallelFor(threads, hits.size(), [&](uint64_t begin, uint64_t end) {
      for (uint64_t i = begin; i < end; ++i) ++hits[i];
      return Status::OK();
    }));
    for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "index " << i;
  }
  EXPECT_STATUS(InvalidArgument,
                ParallelFor(-2, 100, [](uint64_t, uint64_t) { return Status::OK(); }));
}

TEST(ParallelForTest, ReturnsTheFirstError) {
  ASSERT_OK_AND_ASSIGN(auto pool, ThreadPool::Make({.threads = 4, .name = "pfor-error"}));
  constexpr uint64_t kBadIndex = 517;
  const Status status = ParallelFor(pool.get(), 1000, [&](uint64_t begin, uint64_t end) {
    if (begin <= kBadIndex && kBadIndex < end) {
      return InvalidArgument("location {} >= numel 517", kBadIndex);
    }
    return Status::OK();
  });
  EXPECT_EQ(status, InvalidArgument("location 517 >= numel 517"));
  EXPECT_EQ(
      ParallelFor(1, 1000, [&](uint64_t, uint64_t) { return DataLoss("inline chunk failed"); }),
      DataLoss("inline chunk failed"));
}

}  // namespace
}  // namespace refit::internal
