// The harness every section of e2e_bench (sections.h) runs on: the flags, the synthetic model,
// fleets of `refit serve` daemons and the memory windows around a refit, Publisher ranks and their
// configuration, the child processes, and the figures of one delta step. What one section alone
// uses stays in that section's file.
#pragma once

#include <sys/types.h>

#include <nlohmann/json.hpp>

#include <bit>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench_fleet.h"
#include "fleet_coordinator.h"
#include "local_fleet.h"
#include "loopback_ports.h"
#include "pipeline/producer_stream.h"
#include "process.h"
#include "progress.h"
#include "refit/anchor_undo.h"
#include "refit/publisher.h"
#include "refit/status.h"

#ifndef REFIT_BINARY
#error "REFIT_BINARY must name the refit executable (set by bench/CMakeLists.txt)"
#endif

namespace refit::bench::e2e {

// bf16 bytes are written through uint16_t pointers: safetensors and the wire are little-endian.
static_assert(std::endian::native == std::endian::little);

constexpr uint64_t kMiB = uint64_t{1} << 20;
// Environment variable through which the daemons and this process share the run's api key (never
// on a command line, where `ps` shows it).
constexpr const char* kApiKeyEnv = "REFIT_E2E_BENCH_API_KEY";
// The producers section's processes and the tp section's daemons: how long one may take to start
// (load its model, bind its ports), and to exit after SIGTERM (serve waits for in-flight HTTP
// requests and idle keep-alive connections, about a second).
constexpr auto kChildStartTimeout = std::chrono::minutes(5);
constexpr auto kChildStopGrace = std::chrono::seconds(15);
// The budget of one `refit push` rank process, start to exit, and of one Sync.
constexpr auto kPushTimeout = std::chrono::minutes(10);

// --- Arguments ------------------------------------------------------------------------------

struct Args {
  uint64_t model_bytes = 4096 * kMiB;
  std::vector<double> densities = {0.01, 0.03, 0.05};
  std::vector<size_t> fanout = {1, 2, 4, 8};
  uint64_t fanout_model_bytes = 256 * kMiB;
  double fanout_density = 0.03;
  // Export chunk target: 64 MiB splits the 4 GiB model into 90 chunks (whole tensors each), so
  // encode, send and apply overlap over many units while a chunk stays far below the model.
  uint64_t chunk_bytes = 64 * kMiB;
  uint64_t bucket_bytes = ProducerStreamOptions{}.bucket_bytes;
  uint64_t delta_bucket_bytes = ProducerStreamOptions{}.delta_bucket_bytes;
  // Threads per producer stage: the machine this was written for has 2 cores.
  int threads = 2;
  // Receivers read the model into memory (default) or map it copy-on-write.
  bool receiver_mmap = false;
  // The daemons' anchor undo policy and the producer's anchor compression.
  AnchorUndo anchor_undo = AnchorUndo::kMemory;
  AnchorCompression anchor_compression = ProducerStreamOptions{}.anchor_compression;
  // The daemons' threads per payload (`refit serve --apply-threads`).
  int apply_threads = ReceiverSessionOptions{}.apply_threads;
  /// The daemons' apply queue bound (refit serve --apply-queue-bytes), MiB; 0: their default.
  uint64_t apply_queue_mib = 0;
  // Measure the raw-copy yardstick in the end-to-end section.
  bool raw_copy = true;
  // Download every tensor of the end-to-end daemon after the last refit and compare.
  bool verify_end_to_end = true;
  bool skip_end_to_end = false;
  bool skip_fanout = false;
  // Producers: W ranks as threads and as processes, against the same daemons.
  std::vector<uint32_t> producers = {1, 2, 4};
  uint64_t producers_model_bytes = 256 * kMiB;
  size_t producers_receivers = 1;
  bool skip_producers = false;
  // TP shard groups (the unsharded replica is always measured, as the reference).
  std::vector<uint32_t> tp = {2, 4};
  uint64_t tp_model_bytes = 256 * kMiB;
  bool skip_tp = false;
  // The embedded receiver.
  uint64_t embedded_model_bytes = 1024 * kMiB;
  bool skip_embedded = false;
  // The elastic fleet (a newcomer and a laggard join).
  uint64_t elastic_model_bytes = 64 * kMiB;
  bool skip_elastic = false;
  // The delta steps of the producers and tp sections: the median refit time over them is what
  // each configuration reports.
  uint64_t steps = 5;
  double step_density = 0.03;
  std::string work_dir;
  std::string refit_binary = REFIT_BINARY;
  uint64_t seed = 42;
  bool json = false;
  std::string json_out;
  bool quick = false;
  bool help = false;
};

// The sections, for the usage text.
constexpr std::string_view kSectionsHelp =
    "sections: end-to-end, fan-out, producers, tp, embedded, elastic (default: all)\n";

// The usage text: every flag with its value and help.
std::string Usage();

// The flags (argv[1…]) as Args: --quick's sizes first, explicit sizes over them, --sections as
// skips. Errors: InvalidArgument naming the flag.
Result<Args> ParseArgs(int argc, char** argv);

// --- The synthetic model ----------------------------------------------------------------------

// A bf16 model with MakeTransformerSpec's tensors, drawn as mean + std · z (z from the quantile
// table, bf16 by round-to-nearest-even), and stepped by moving a random `density` of its
// elements by ±1 ulp — what Adam's small steps do to bf16 weights, at 2 bytes per element
// instead of the simulator's 14.
class SyntheticModel {
 public:
  /// Purposes of the random streams.
  static constexpr uint64_t kInitStream = 1;
  static constexpr uint64_t kStepStream = 2;

  /// Draw the model of about `target_bytes` from `seed` on `threads` threads; `progress` (may be
  /// null) advances by the bytes drawn.
  static Result<SyntheticModel> Make(uint64_t target_bytes, uint64_t seed, int threads,
                                     ProgressReporter* progress);

  /// Apply training step `step`: each element changes with probability `density`, positions
  /// drawn by geometric gaps (one draw per change, not per element). Returns the elements
  /// changed, which is exactly what the tracker must find. Errors: those of starting the
  /// threads (internal::ParallelFor).
  Result<uint64_t> Step(uint64_t step, double density);

  const std::vector<TensorView>& views() const { return views_; }
  /// The same buffers, writable: what a receiver registers to apply refits into them in place.
  std::vector<MutableTensorView> mutable_views() {
    std::vector<MutableTensorView> views;
    for (size_t t = 0; t < views_.size(); ++t) {
      views.push_back(MutableTensorView{
          views_[t].name, views_[t].dtype, views_[t].shape,
          std::as_writable_bytes(std::span<uint16_t>(buffers_[t].get(), numels_[t]))});
    }
    return views;
  }
  uint64_t bytes() const { return bytes_; }

 private:
  SyntheticModel() = default;
  uint64_t seed_ = 0;
  int threads_ = 1;
  std::vector<std::unique_ptr<uint16_t[]>> buffers_;
  std::vector<uint64_t> numels_;
  std::vector<TensorView> views_;
  uint64_t bytes_ = 0;
};

// --- Resources --------------------------------------------------------------------------------

// Start `receivers` daemons over the model file at `model_path` with the flags of `args`, and a
// coordinator over `model` as the baseline they hold.
Result<BenchFleet> StartFleet(const Args& args, const std::string& work_dir,
                              const std::string& model_path, size_t receivers,
                              const std::vector<TensorView>& model);

// Peak RSS of this process and of every daemon, reset before a refit and read after it.
struct RssWindow {
  bool reset = true;
  uint64_t producer_before = 0;
  uint64_t producer_peak = 0;
  // The largest over the daemons.
  uint64_t receiver_before = 0;
  uint64_t receiver_peak = 0;
};

Result<RssWindow> OpenRssWindow(const testkit::LocalFleet& daemons);
Status CloseRssWindow(const testkit::LocalFleet& daemons, RssWindow* window);

// Download every tensor from every daemon and compare it with the producer's bytes; compare
// every daemon's state fingerprint with the producers' committed digests.
Status VerifyFleet(const cli::FleetCoordinator& fleet, const std::vector<TensorView>& model);

// `bytes` as FormatBytes writes it, with a minus sign when negative.
std::string SignedBytes(int64_t bytes);

// The straight line over = fixed + per_changed · changed through (changed, over) points by least
// squares: how a process's memory beyond the model grows with the changes of a refit.
struct MemoryFit {
  double fixed_bytes = 0;
  double bytes_per_changed = 0;
};

std::optional<MemoryFit> FitMemory(const std::vector<std::pair<double, double>>& points);

// --- Refits through a BenchFleet (end to end, fan-out) -----------------------------------------

// One refit of a BenchFleet and the memory around it.
struct RefitRow {
  bool full = false;
  double target_density = 0;
  // The compare alone of the same model against the same baseline on the same threads, just
  // before this delta (0: not measured).
  double compare_only_s = 0;
  uint64_t changed_by_step = 0;
  RefitReport report;
  RssWindow rss;
  uint64_t baseline_bytes = 0;
  // The trackers' background baseline fold after the refit returned (DeltaTracker::last_fold),
  // the longest over producers: not in report.total_s, which is what the trainer waits for.
  double baseline_fold_s = 0;
};

// One refit of `fleet`, a FULL when `full`, with the peak RSS of every process around it. Errors:
// Internal when the transfer was not the kind asked for.
Result<RefitRow> MeasureRefit(BenchFleet& fleet, bool full);

// --- Shared by the producers, tp and embedded sections ----------------------------------------

// The export chunk target of a new section's model: kSectionChunksPerModel chunks, clamped.
uint64_t SectionChunkBytes(uint64_t model_bytes);

// A refit configuration file (docs/configuration.md) with the bench's chunk, bucket and thread
// settings and the run's api key variable. The producers section hands it to `refit push
// --config` and reads it for its thread ranks, so that both run exactly the same options.
Result<std::string> WriteRefitConfig(const Args& args, const std::string& work_dir,
                                     const std::string& stem, uint64_t chunk_bytes);

// The options every rank of a Publisher group gets from the configuration file, as `refit push
// --config` derives them.
Result<PublisherOptions> PublisherOptionsFromConfig(const std::string& config_path,
                                                    const std::vector<PublisherReceiver>& fleet);

// W Publishers as threads of this process, over one in-process producer group.
Result<std::vector<std::unique_ptr<Publisher>>> MakeThreadRanks(uint32_t world,
                                                                const PublisherOptions& options);

// Every rank adopts `model` as what the receivers hold (they loaded it, or were refit to it).
Status AdoptBaseline(std::vector<std::unique_ptr<Publisher>>& ranks,
                     const std::vector<TensorView>& model);

// One collective Sync of every rank (rank 0 on this thread, the others on one thread each) of
// `model`, which must be a delta; returns rank 0's report of the whole transfer.
Result<RefitReport> SyncDelta(std::vector<std::unique_ptr<Publisher>>& ranks,
                              const std::vector<TensorView>& model);

// Download every tensor of `tensors` from the receiver at `control_url` and compare its bytes.
Status CheckReceiverHolds(const std::string& control_url, const std::vector<TensorView>& tensors);

// --- Child processes ------------------------------------------------------------------------

// The flags of this executable re-executed as a child (argv[2…], as --name value pairs).
class ChildFlags {
 public:
  /// The flags of `argv` after argv[1] (`mode`, which errors name). Errors: InvalidArgument when
  /// a flag has no value.
  static Result<ChildFlags> Parse(int argc, char** argv, std::string_view mode);
  /// The value of flag `name`. Errors: InvalidArgument when it was not given.
  Result<std::string> Text(std::string_view name) const;
  /// The value of flag `name` as a non-negative integer. Errors: InvalidArgument.
  Result<uint64_t> Number(std::string_view name) const;

 private:
  std::string mode_;
  std::map<std::string, std::string, std::less<>> values_;
};

// `refit serve` daemons for the producers and tp sections: one relay tree of `specs` in order,
// on the run's key (kApiKeyEnv), mapped with --receiver-mmap; logs and ready files are
// "<work_dir>/<label>-<i>.*".
Result<std::unique_ptr<testkit::LocalFleet>> StartDaemons(
    const Args& args, const std::string& work_dir, const std::string& label,
    std::vector<testkit::LocalReceiverSpec> specs);

// The daemons as a Publisher names them.
std::vector<PublisherReceiver> PublisherReceivers(const testkit::LocalFleet& daemons);

// --- Delta steps (producers, tp) --------------------------------------------------------------

// One delta refit of a configuration of the producers or tp section.
struct SyncStep {
  uint64_t changed_by_step = 0;
  uint64_t changed = 0;
  uint64_t payloads = 0;
  uint64_t wire_bytes = 0;
  // Rank 0's Coordinator::Refit, Begin to the end of commit, and its phases (threads only: a
  // `refit push` process reports the total alone).
  double time_s = 0;
  double stream_s = 0;
  double flush_s = 0;
  double commit_s = 0;
  // Threads: the Sync calls. Processes: the first rank spawned to the last one exited.
  double wall_s = 0;
  // Processes: each rank process's peak RSS (persistent ranks: over all the steps).
  std::vector<uint64_t> rank_peak_rss;
  // Threads: the wire bytes each receiver was sent, in receiver order (its route's payloads from
  // every producer), and the routes of the transfer (1 unless routed by holdings).
  std::vector<uint64_t> received_bytes;
  size_t routes = 1;
};

// The figures of one delta from the report of its transfer.
SyncStep StepFromReport(const RefitReport& report, uint64_t changed_by_step, double wall_s);

// The step as one JSON object, a key per field.
nlohmann::json StepJson(const SyncStep& step);

// Median, min and max of one figure over the steps.
nlohmann::json Spread(const std::vector<SyncStep>& steps, double SyncStep::*figure);

}  // namespace refit::bench::e2e
