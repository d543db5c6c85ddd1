// A mutex the thread-safety analysis understands (util/thread_annotations.h): libstdc++'s
// std::mutex carries no capability attribute, so members guarded by one cannot be checked.
#pragma once

#include <condition_variable>
#include <mutex>

#include "util/thread_annotations.h"

namespace refit::internal {

/// std::mutex, as a capability.
class REFIT_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() REFIT_ACQUIRE() { mutex_.lock(); }
  void Unlock() REFIT_RELEASE() { mutex_.unlock(); }

 private:
  std::mutex mutex_;
};

/// Holds a Mutex for its scope. A condition variable waits on it as on any lock
/// (std::condition_variable_any: the wait releases and retakes the mutex, which the analysis
/// does not see and need not: the lock is held again when the wait returns).
class REFIT_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mutex) REFIT_ACQUIRE(mutex) : mutex_(mutex) { mutex_.Lock(); }
  ~MutexLock() REFIT_RELEASE() { mutex_.Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  // BasicLockable, for std::condition_variable_any only.
  void lock() REFIT_NO_THREAD_SAFETY_ANALYSIS { mutex_.Lock(); }
  void unlock() REFIT_NO_THREAD_SAFETY_ANALYSIS { mutex_.Unlock(); }

 private:
  Mutex& mutex_;
};

/// The condition variable that waits on a MutexLock.
using CondVar = std::condition_variable_any;

}  // namespace refit::internal
