// BackgroundJob: one job at a time on a thread of its own, for work that may finish after the call
// that started it returns (the tracker's baseline fold, codec/tracker.h): the caller starts it and
// goes on, and whatever needs its result waits for it then, if it has not finished.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "refit/status.h"
#include "util/mutex.h"

namespace refit::internal {

class BackgroundJob {
 public:
  /// `thread_name`: the worker's OS thread name (NameCurrentThread), started at the first Start.
  explicit BackgroundJob(std::string thread_name);
  /// Waits for a running job, then stops and joins the worker: a job never outlives what it
  /// works on when that is destroyed after this (declare the job after it, or Wait first).
  ~BackgroundJob();
  BackgroundJob(const BackgroundJob&) = delete;
  BackgroundJob& operator=(const BackgroundJob&) = delete;

  /// Run `job` on the worker. The previous job must have been waited for: a job started while
  /// another runs or is unreported waits for it first (its status is kept for the next Wait, which
  /// then reports the first error of the two).
  void Start(std::function<Status()> job) REFIT_EXCLUDES(mutex_);

  /// Block until no job is running; return the status of the jobs finished since the last Wait
  /// (the first error, OK if none or all succeeded) and forget it.
  Status Wait() REFIT_EXCLUDES(mutex_);

  /// Block until no job is running, as Wait, but keep the status for the next Wait: for a reader
  /// that needs the job's work done and must not take its report from the owner.
  Status WaitIdle() const REFIT_EXCLUDES(mutex_);

  /// Whether no job is running (a finished one may still be unreported).
  bool idle() const REFIT_EXCLUDES(mutex_);

  /// Seconds the last finished job ran on the worker, and how long Wait blocked in all (what a
  /// caller lost to the job not having finished yet).
  double last_job_seconds() const REFIT_EXCLUDES(mutex_);
  double waited_seconds() const REFIT_EXCLUDES(mutex_);

 private:
  void Loop() REFIT_EXCLUDES(mutex_);

  const std::string thread_name_;
  mutable Mutex mutex_;
  mutable CondVar changed_;
  std::function<Status()> job_ REFIT_GUARDED_BY(mutex_);
  bool running_ REFIT_GUARDED_BY(mutex_) = false;
  bool stop_ REFIT_GUARDED_BY(mutex_) = false;
  Status result_ REFIT_GUARDED_BY(mutex_);
  double last_job_seconds_ REFIT_GUARDED_BY(mutex_) = 0;
  double waited_seconds_ REFIT_GUARDED_BY(mutex_) = 0;
  /// Started by the first Start (a tracker that never commits starts no thread); only Start and
  /// the destructor touch it, and they do not run concurrently (the owner's contract).
  std::thread worker_;
};

}  // namespace refit::internal
