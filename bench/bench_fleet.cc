#include "bench_fleet.h"

#include <fmt/format.h>

#include <utility>

#include "bench_util.h"
#include "codec/tracker.h"
#include "refit/status_format.h"
#include "util/environment.h"

namespace refit::bench {

Result<BenchFleet> StartBenchFleet(std::string label, const testkit::LocalFleetOptions& options) {
  BenchFleet fleet;
  fleet.label = std::move(label);
  const double t0 = Now();
  REFIT_ASSIGN_OR_RETURN(fleet.daemons, testkit::LocalFleet::Start(options));
  fleet.start_s = Now() - t0;
  return fleet;
}

Status AttachProducers(BenchFleet& fleet, const BenchProducers& producers,
                       const std::string& api_key_env, const std::vector<TensorView>& model) {
  cli::FleetAddress address;
  for (const testkit::LocalReceiver& receiver : fleet.daemons->receivers()) {
    address.control_urls.push_back(receiver.control_url);
    address.data_endpoints.push_back(receiver.data_endpoint);
  }
  TransportUri uri = producers.transport;
  uri.params.emplace_back("api_key_env", api_key_env);
  address.transport_uri = uri.ToString();
  REFIT_ASSIGN_OR_RETURN(address.api_key,
                         SecretFromEnvironment(api_key_env, "the bench fleet's key"));
  TrackerOptions tracker_options;
  tracker_options.compare.threads = 1;
  internal::CoordinatorOptions options;
  options.stream = producers.stream;
  REFIT_ASSIGN_OR_RETURN(fleet.coordinator,
                         cli::FleetCoordinator::Make(address, &model, producers.producers,
                                                     tracker_options, options, &model));
  return Status::OK();
}

Result<RefitReport> RefitOfKind(BenchFleet& fleet, bool full) {
  const char* kind = full ? "FULL" : "delta";
  Result<RefitReport> report = fleet.coordinator->Refit(/*force_anchor=*/full);
  if (!report.ok()) {
    return report.status().WithContext(fmt::format("{} refit through {}", kind, fleet.label));
  }
  if (report->plan.anchor != full) {
    return Internal("transfer {} through {} was {} but a {} was asked for",
                    report->plan.transfer_id.ToHex(), fleet.label,
                    report->plan.anchor ? "FULL" : "a delta", kind);
  }
  return report;
}

double Density(const RefitReport& report) {
  return report.total_elements == 0 ? 0.0
                                    : static_cast<double>(report.changed_elements) /
                                          static_cast<double>(report.total_elements);
}

nlohmann::json ProducerStagesJson(const StreamReport& report) {
  return {{"source_s", report.timings.source_s},
          {"dispatch_wait_s", report.timings.dispatch_wait_s},
          {"encode_s", report.timings.encode_s},
          {"serialize_s", report.timings.serialize_s},
          {"send_s", report.timings.send_s},
          {"wall_s", report.timings.wall_s},
          {"peak_chunks_in_flight", report.peak_chunks_in_flight},
          {"peak_payloads_in_flight", report.peak_payloads_in_flight}};
}

nlohmann::json AnchorCompressionJson(const AnchorCompressionReport& report) {
  return {{"compressed_payloads", report.compressed_payloads},
          {"raw_payloads", report.raw_payloads},
          {"measured", report.measured},
          {"compress_bytes_per_s", report.compress_bytes_per_s},
          {"ratio", report.ratio},
          {"link_bytes_per_s", report.link_bytes_per_s}};
}

nlohmann::json ReceiverOutcomeJson(const ReceiverOutcome& outcome) {
  return {{"name", outcome.name},
          {"applied_payloads", outcome.flush.payloads},
          {"duplicates", outcome.flush.duplicates},
          {"changed_elements", outcome.flush.changed_elements},
          {"committed", outcome.commit_status.ok()}};
}

}  // namespace refit::bench
