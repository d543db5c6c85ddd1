#include "control/metrics.h"

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "refit/status_format.h"
#include "util/mutex.h"

namespace refit::internal {
namespace {

// Bucket bounds (seconds) of the prepare-to-flush histogram: a factor of ~3 per bucket from a
// small delta of a test model (milliseconds) to a full anchor of a large model (minutes).
const std::vector<double>& ApplySecondsBuckets() {
  static const std::vector<double> kBuckets = {0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300};
  return kBuckets;
}

prometheus::Counter& AddCounter(prometheus::Registry& registry, const std::string& name,
                                const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({});
}

prometheus::Gauge& AddGauge(prometheus::Registry& registry, const std::string& name,
                            const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({});
}

}  // namespace

ControlMetrics::ControlMetrics() = default;
ControlMetrics::~ControlMetrics() = default;

Result<std::unique_ptr<ControlMetrics>> ControlMetrics::Make(const ReplicaPlace& place) {
  // Not make_unique: the constructor is private.
  std::unique_ptr<ControlMetrics> metrics(new ControlMetrics());
  // prometheus-cpp reports invalid names and labels by throwing; none can occur with the fixed
  // names below, but no exception may leave the library, so turn one into a Status.
  try {
    metrics->registry_ = std::make_shared<prometheus::Registry>();
    prometheus::Registry& registry = *metrics->registry_;
    metrics->requests_ = &prometheus::BuildCounter()
                              .Name("refit_control_requests_total")
                              .Help("HTTP requests to the control plane by route and status code")
                              .Register(registry);
    metrics->transfers_committed_ =
        &AddCounter(registry, "refit_transfers_committed_total",
                    "Transfers committed through the control plane (including implied commits)");
    metrics->transfers_aborted_ = &AddCounter(registry, "refit_transfers_aborted_total",
                                              "Open transfers aborted through the control plane");
    metrics->leases_expired_ = &AddCounter(
        registry, "refit_transfer_leases_expired_total",
        "Transfers the receiver aborted and rolled back itself: no progress within their lease");
    metrics->payloads_accepted_ = &AddCounter(registry, "refit_payloads_staged_total",
                                              "Payloads POSTed and queued for apply");
    metrics->payloads_duplicate_ =
        &AddCounter(registry, "refit_payloads_duplicate_total",
                    "Payloads POSTed again with the same checksum (ACKed, not re-applied)");
    metrics->payloads_rejected_ = &AddCounter(registry, "refit_payloads_rejected_total",
                                              "Payloads POSTed and refused (NACK)");
    metrics->payload_bytes_ = &AddCounter(registry, "refit_payload_bytes_received_total",
                                          "Bytes of every payload POSTed, refused ones included");
    metrics->apply_seconds_ =
        &prometheus::BuildHistogram()
             .Name("refit_transfer_apply_seconds")
             .Help(
                 "Seconds from Prepare to the first successful Flush of a transfer (staged, "
                 "applied and verified)")
             .Register(registry)
             .Add({}, ApplySecondsBuckets());
    metrics->version_ = &AddGauge(registry, "refit_weight_version",
                                  "The committed weight version the receiver holds");
    metrics->undo_bytes_ =
        &AddGauge(registry, "refit_undo_bytes", "Bytes held by the undo log of the open transfer");
    metrics->undo_file_bytes_ =
        &AddGauge(registry, "refit_undo_file_bytes",
                  "Bytes the open transfer's undo log spilled to disk (anchor_undo: file)");
    metrics->device_to_bytes_ = &AddGauge(
        registry, "refit_device_to_bytes",
        "Bytes sent into device tensors since start (positions, new bits, written ranges)");
    metrics->device_from_bytes_ =
        &AddGauge(registry, "refit_device_from_bytes",
                  "Bytes read from device tensors since start (old bits, read ranges)");
    metrics->needs_anchor_ = &AddGauge(
        registry, "refit_needs_anchor",
        "1 while the weights are a mix of versions that only an anchor heals (an aborted FULL "
        "under anchor_undo: none); deltas are refused");
    metrics->queued_payloads_ = &AddGauge(registry, "refit_queued_payloads",
                                          "Payloads staged and waiting for the apply thread");
    metrics->transfer_open_ = &AddGauge(registry, "refit_transfer_open",
                                        "1 while a transfer is open (receiving or prepared)");
    metrics->ready_ = &AddGauge(
        registry, "refit_receiver_ready",
        "1 while the receiver may serve: it holds the fleet's committed version, no transfer is "
        "open, it is neither behind, fenced nor left (GET /ready)");
    metrics->fleet_version_ =
        &AddGauge(registry, "refit_fleet_version",
                  "The fleet's committed version as the receiver last heard it (-1: not yet)");
    metrics->fleet_lag_ = &AddGauge(
        registry, "refit_fleet_lag_versions",
        "Versions the receiver's committed version is behind the fleet's (0 when unknown)");
    metrics->last_catch_up_ =
        &prometheus::BuildGauge()
             .Name("refit_last_catch_up")
             .Help(
                 "How the last committed transfer brought the receiver to its version: 1 for "
                 "the way it took (delta, folded, peer, chain, anchor), 0 for the others")
             .Register(registry);
    // The info-metric idiom: a constant 1 whose labels say where the receiver sits, so a
    // dashboard can group a shard group's receivers by replica.
    prometheus::BuildGauge()
        .Name("refit_receiver_info")
        .Help("Where this receiver sits: its replica and its shard of the replica's group")
        .Register(registry)
        .Add({{"replica", place.replica},
              {"shard", std::to_string(place.shard)},
              {"shards", std::to_string(place.shards)}})
        .Set(1);
  } catch (const std::exception& error) {
    return Internal("cannot create the control plane metrics: {}", error.what());
  }
  return metrics;
}

void ControlMetrics::RecordRequest(std::string_view route, int http_status) {
  requests_->Add({{"route", std::string(route)}, {"code", std::to_string(http_status)}})
      .Increment();
}

void ControlMetrics::RecordPayload(uint64_t bytes, const Result<StageResult>& staged) {
  payload_bytes_->Increment(static_cast<double>(bytes));
  if (!staged.ok()) {
    payloads_rejected_->Increment();
  } else if (*staged == StageResult::kDuplicate) {
    payloads_duplicate_->Increment();
  } else {
    payloads_accepted_->Increment();
  }
}

void ControlMetrics::RecordPrepared(const TransferId& id) {
  internal::MutexLock lock(timer_mutex_);
  timed_transfer_ = id;
  prepared_at_ = std::chrono::steady_clock::now();
}

void ControlMetrics::RecordFlushed(const TransferId& id) {
  internal::MutexLock lock(timer_mutex_);
  if (timed_transfer_ != id) return;
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - prepared_at_;
  apply_seconds_->Observe(elapsed.count());
  timed_transfer_.reset();
}

void ControlMetrics::RecordCommitted() { transfers_committed_->Increment(); }

void ControlMetrics::RecordAborted() { transfers_aborted_->Increment(); }

std::string ControlMetrics::Render(const ReceiverStatus& status, const Readiness& readiness) {
  ready_->Set(readiness.ready ? 1 : 0);
  fleet_version_->Set(
      readiness.fleet_version.has_value() ? static_cast<double>(*readiness.fleet_version) : -1.0);
  fleet_lag_->Set(readiness.fleet_version.has_value() && *readiness.fleet_version > status.version
                      ? static_cast<double>(*readiness.fleet_version - status.version)
                      : 0.0);
  for (CatchUp how :
       {CatchUp::kDelta, CatchUp::kFolded, CatchUp::kPeer, CatchUp::kChain, CatchUp::kAnchor}) {
    last_catch_up_->Add({{"how", std::string(CatchUpName(how))}})
        .Set(readiness.last_catch_up == how ? 1 : 0);
  }
  version_->Set(static_cast<double>(status.version));
  undo_bytes_->Set(static_cast<double>(status.undo_bytes));
  undo_file_bytes_->Set(static_cast<double>(status.undo_file_bytes));
  device_to_bytes_->Set(static_cast<double>(status.device_to_bytes));
  device_from_bytes_->Set(static_cast<double>(status.device_from_bytes));
  needs_anchor_->Set(status.needs_anchor ? 1 : 0);
  queued_payloads_->Set(static_cast<double>(status.queued_payloads));
  transfer_open_->Set(status.transfer_id.has_value() ? 1 : 0);
  {
    // Under a lock: two concurrent scrapes must not both add the same expiries.
    internal::MutexLock lock(timer_mutex_);
    const auto counted = static_cast<uint64_t>(leases_expired_->Value());
    if (status.expired_leases > counted) {
      leases_expired_->Increment(static_cast<double>(status.expired_leases - counted));
    }
  }
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace refit::internal
