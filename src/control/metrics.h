// The receiver's Prometheus metrics, as the control plane sees and exposes them on GET /metrics.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "receiver/receiver_session.h"
#include "refit/payload.h"
#include "refit/readiness.h"
#include "refit/status.h"
#include "util/mutex.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace refit::internal {

/// Counters, gauges and a histogram of one receiver, rendered in the Prometheus text exposition
/// format (version 0.0.4).
///
/// Counters count what arrives through the control plane (transfers it committed or aborted,
/// payloads POSTed to it); gauges are sampled from the session at each scrape, so they also
/// reflect payloads that other transports staged.
///
/// Thread-safety: every member function may be called concurrently from any thread (prometheus
/// metrics are atomic; the apply timer has its own mutex).
class ControlMetrics {
 public:
  /// The route label of requests whose path matches no route: a fixed value, so that a scanner
  /// probing random paths cannot grow the label set without bound.
  static constexpr std::string_view kUnmatchedRoute = "unmatched";

  /// Create the registry and every metric family; `place` labels refit_receiver_info.
  /// Errors: Internal if prometheus-cpp refuses a name (a programming error, reported not thrown).
  static Result<std::unique_ptr<ControlMetrics>> Make(const ReplicaPlace& place = {});
  ~ControlMetrics();
  ControlMetrics(const ControlMetrics&) = delete;
  ControlMetrics& operator=(const ControlMetrics&) = delete;

  /// Count one HTTP request by route template and status code.
  void RecordRequest(std::string_view route, int http_status);
  /// Count one POSTed payload of `bytes` bytes and how the session answered it.
  void RecordPayload(uint64_t bytes, const Result<StageResult>& staged);
  /// A transfer opened: start its apply timer.
  void RecordPrepared(const TransferId& id);
  /// A transfer flushed: observe the seconds since its Prepare (first flush only).
  void RecordFlushed(const TransferId& id);
  void RecordCommitted();
  void RecordAborted();

  /// Sample the session gauges from `status` and return every metric as exposition text.
  std::string Render(const ReceiverStatus& status, const Readiness& readiness);

 private:
  ControlMetrics();

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Counter* transfers_committed_ = nullptr;
  prometheus::Counter* transfers_aborted_ = nullptr;
  prometheus::Counter* payloads_accepted_ = nullptr;
  prometheus::Counter* payloads_duplicate_ = nullptr;
  prometheus::Counter* payloads_rejected_ = nullptr;
  prometheus::Counter* payload_bytes_ = nullptr;
  prometheus::Histogram* apply_seconds_ = nullptr;
  prometheus::Gauge* version_ = nullptr;
  prometheus::Gauge* undo_bytes_ = nullptr;
  prometheus::Gauge* undo_file_bytes_ = nullptr;
  prometheus::Gauge* device_to_bytes_ = nullptr;
  prometheus::Gauge* device_from_bytes_ = nullptr;
  prometheus::Gauge* needs_anchor_ = nullptr;
  prometheus::Gauge* queued_payloads_ = nullptr;
  prometheus::Gauge* transfer_open_ = nullptr;
  // Readiness (refit/readiness.h): 1 while ready; the fleet's version (-1 unknown), the lag
  // behind it; how the last transfer caught this receiver up (one series per way, 1 for it).
  prometheus::Gauge* ready_ = nullptr;
  prometheus::Gauge* fleet_version_ = nullptr;
  prometheus::Gauge* fleet_lag_ = nullptr;
  prometheus::Family<prometheus::Gauge>* last_catch_up_ = nullptr;
  // Mirrors ReceiverStatus::expired_leases (the session counts; Render adds what is new).
  prometheus::Counter* leases_expired_ = nullptr;

  // The transfer whose apply time is being measured, and when it was prepared.
  internal::Mutex timer_mutex_;
  std::optional<TransferId> timed_transfer_;
  std::chrono::steady_clock::time_point prepared_at_;
};

}  // namespace refit::internal
