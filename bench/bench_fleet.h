// A fleet of `refit serve` daemons on this machine and the trainer side that refits it — what
// e2e_bench's end-to-end and fan-out sections and s3_bench measure refits through — with the
// JSON of a refit's producers and receivers that their reports share.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fleet_coordinator.h"
#include "local_fleet.h"
#include "pipeline/coordinator.h"
#include "pipeline/producer_stream.h"
#include "refit/status.h"
#include "refit/tensor.h"
#include "refit/transport.h"

namespace refit::bench {

/// Daemons and the coordinator that refits them.
struct BenchFleet {
  /// What errors call the fleet ("s3", "zmq").
  std::string label;
  std::unique_ptr<testkit::LocalFleet> daemons;
  /// Made by AttachProducers.
  std::unique_ptr<cli::FleetCoordinator> coordinator;
  /// Seconds from the first daemon spawned to the last one ready.
  double start_s = 0;
};

/// Start the daemons of `options`, timing their start.
Result<BenchFleet> StartBenchFleet(std::string label, const testkit::LocalFleetOptions& options);

/// The trainer side of a bench fleet.
struct BenchProducers {
  /// The transport the producers send through, without its api key (AttachProducers adds the
  /// daemons' api_key_env).
  TransportUri transport;
  uint32_t producers = 1;
  /// Chunk, bucket, threads and anchor compression of every producer's stream.
  ProducerStreamOptions stream;
};

/// Make `fleet`'s coordinator: `producers.producers` trackers, each holding `model` as the
/// baseline the daemons loaded, comparing on one thread (parallelism comes from encoding chunks
/// concurrently; a parallel compare inside each would oversubscribe the cores), on the control
/// planes' key in environment variable `api_key_env`.
///
/// Make it only once every daemon of the run is started: LocalFleet forks, and a fork
/// write-protects every page this process holds (copy-on-write), so the first write to each page
/// of a baseline made before a later fork takes a page fault. The first delta commit scatters into
/// nearly every page of the baseline: with a coordinator made between two fleets' starts, that
/// fleet's first delta commit took about 0.3 ms per MiB of model longer than the other's.
Status AttachProducers(BenchFleet& fleet, const BenchProducers& producers,
                       const std::string& api_key_env, const std::vector<TensorView>& model);

/// One refit of `fleet`, a FULL when `full`. Errors: the refit's, naming the fleet; Internal
/// when the transfer was not the kind asked for.
Result<RefitReport> RefitOfKind(BenchFleet& fleet, bool full);

/// The fraction of the model's elements a refit changed (0 for an empty model).
double Density(const RefitReport& report);

/// A producer's pipeline stages: the time in each and the most chunks and payloads in flight.
nlohmann::json ProducerStagesJson(const StreamReport& report);
/// What a producer's anchor compression decided, and the rates it measured.
nlohmann::json AnchorCompressionJson(const AnchorCompressionReport& report);
/// One receiver's flush and commit.
nlohmann::json ReceiverOutcomeJson(const ReceiverOutcome& outcome);

}  // namespace refit::bench
