#include "util/background_job.h"

#include <utility>

#include "util/thread_name.h"

namespace refit::internal {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

BackgroundJob::BackgroundJob(std::string thread_name) : thread_name_(std::move(thread_name)) {}

BackgroundJob::~BackgroundJob() {
  {
    MutexLock lock(mutex_);
    changed_.wait(lock, [this]() REFIT_REQUIRES(mutex_) { return !running_; });
    stop_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void BackgroundJob::Start(std::function<Status()> job) {
  {
    MutexLock lock(mutex_);
    changed_.wait(lock, [this]() REFIT_REQUIRES(mutex_) { return !running_; });
    job_ = std::move(job);
    running_ = true;
  }
  if (!worker_.joinable()) worker_ = std::thread([this] { Loop(); });
  changed_.notify_all();
}

Status BackgroundJob::Wait() {
  const auto start = std::chrono::steady_clock::now();
  MutexLock lock(mutex_);
  if (running_) {
    changed_.wait(lock, [this]() REFIT_REQUIRES(mutex_) { return !running_; });
    waited_seconds_ += SecondsSince(start);
  }
  return std::exchange(result_, Status::OK());
}

Status BackgroundJob::WaitIdle() const {
  MutexLock lock(mutex_);
  changed_.wait(lock, [this]() REFIT_REQUIRES(mutex_) { return !running_; });
  return result_;
}

bool BackgroundJob::idle() const {
  MutexLock lock(mutex_);
  return !running_;
}

double BackgroundJob::last_job_seconds() const {
  MutexLock lock(mutex_);
  return last_job_seconds_;
}

double BackgroundJob::waited_seconds() const {
  MutexLock lock(mutex_);
  return waited_seconds_;
}

void BackgroundJob::Loop() {
  NameCurrentThread(thread_name_);
  MutexLock lock(mutex_);
  while (true) {
    changed_.wait(lock, [this]() REFIT_REQUIRES(mutex_) { return stop_ || job_ != nullptr; });
    if (job_ == nullptr) return;  // Stopped, nothing left to run.
    std::function<Status()> job = std::exchange(job_, nullptr);
    lock.unlock();
    const auto start = std::chrono::steady_clock::now();
    Status status = job();
    const double seconds = SecondsSince(start);
    job = nullptr;  // Whatever the job captured goes before Wait returns.
    lock.lock();
    if (result_.ok()) result_ = std::move(status);
    last_job_seconds_ = seconds;
    running_ = false;
    changed_.notify_all();
  }
}

}  // namespace refit::internal
