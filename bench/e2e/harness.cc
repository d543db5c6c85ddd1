// The shared harness of e2e_bench's sections (harness.h): flag parsing, the synthetic model's
// draws and steps, fleets and daemon groups, Publisher ranks, and the figures of one delta step.
#include "e2e/harness.h"

#include <signal.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <thread>

#include "bench_util.h"
#include "config_file.h"
#include "core/digest.h"
#include "core/half_float.h"
#include "flags.h"
#include "refit/control_client.h"
#include "refit/producer_group.h"
#include "refit/status_format.h"
#include "role_options.h"
#include "util/environment.h"
#include "util/splitmix64.h"
#include "util/thread_pool.h"
#include "workload/simulator.h"

namespace refit::bench::e2e {
namespace {

// The new sections (producers, tp, embedded) split their model into about this many export
// chunks, so that W = 4 ranks each own several and the pipeline overlaps chunks; the chunk target
// is clamped to [kMinSectionChunkBytes, kMaxSectionChunkBytes] (the latter the end-to-end
// section's default).
constexpr uint64_t kSectionChunksPerModel = 32;
constexpr uint64_t kMinSectionChunkBytes = 1 * kMiB;
constexpr uint64_t kMaxSectionChunkBytes = 64 * kMiB;

// The names --sections takes.
constexpr std::array<std::string_view, 6> kSectionNames = {"end-to-end", "fan-out",  "producers",
                                                           "tp",         "embedded", "elastic"};

// `text` as a comma-separated list of positive 32-bit counts. Errors: InvalidArgument naming
// `flag`.
Result<std::vector<uint32_t>> ParseCounts(std::string_view flag, std::string_view text) {
  std::vector<uint32_t> counts;
  for (std::string_view part : SplitCommas(text)) {
    REFIT_ASSIGN_OR_RETURN(uint64_t count, ParseUnsigned(flag, part));
    if (count == 0 || count > UINT32_MAX) {
      return InvalidArgument("{}: '{}' is not a count in [1, 2^32)", flag, part);
    }
    counts.push_back(static_cast<uint32_t>(count));
  }
  return counts;
}

// Entries of the N(0, 1) table: a 16-bit index, so one 64-bit draw yields four values.
constexpr size_t kNormalTableSize = size_t{1} << 16;
// Bisection steps of the inverse normal CDF: 2^-60 of the bracket is far below float precision.
constexpr int kQuantileBisections = 60;
// The bracket of every quantile: |z| of the outermost table entry is about 4.3.
constexpr double kQuantileBracket = 10.0;
// The bf16 exponent field: all ones is Inf or NaN.
constexpr uint16_t kBFloat16ExponentMask = 0x7F80;
// 2^-53: a 53-bit integer times this is a double in [0, 1).
constexpr double kTwoToMinus53 = 0x1.0p-53;

// SplitMix64 is a tiny, fast generator, good enough for drawing weights and positions; it is
// seeded per (purpose, step, tensor) so that the model is the same for any thread count.
using internal::SplitMix64;

// A uniform double in (0, 1] from the top 53 of 64 random bits.
double OpenUnit(uint64_t random) { return static_cast<double>((random >> 11) + 1) * kTwoToMinus53; }

uint64_t StreamSeed(uint64_t seed, uint64_t purpose, uint64_t step, uint64_t tensor) {
  SplitMix64 mix(seed ^ (purpose << 56) ^ (step << 32) ^ tensor);
  return mix.Next();
}

// The N(0, 1) quantiles at (i + 0.5) / 65536: a deterministic table with the exact normal shape
// (tails at ±4.3 σ), so 16 random bits give a normal variate with one load.
std::vector<float> NormalQuantileTable() {
  std::vector<float> table(kNormalTableSize);
  for (size_t i = 0; i < kNormalTableSize / 2; ++i) {
    const double p = (static_cast<double>(i) + 0.5) / static_cast<double>(kNormalTableSize);
    double low = -kQuantileBracket, high = 0.0;
    for (int k = 0; k < kQuantileBisections; ++k) {
      const double mid = 0.5 * (low + high);
      (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p ? low : high) = mid;
    }
    table[i] = static_cast<float>(0.5 * (low + high));
    table[kNormalTableSize - 1 - i] = -table[i];
  }
  return table;
}

// Move bf16 bits by one ulp in magnitude, up or down; a move into an Inf/NaN pattern (the top
// finite value up, or a zero down into the sign-flipped NaN range) goes the other way.
uint16_t NudgeOneUlp(uint16_t bits, bool up) {
  uint16_t moved = static_cast<uint16_t>(up ? bits + 1 : bits - 1);
  if ((moved & kBFloat16ExponentMask) == kBFloat16ExponentMask) {
    moved = static_cast<uint16_t>(up ? bits - 1 : bits + 1);
  }
  return moved;
}

// The flags whose value is applied after --quick (an explicit size wins over its sizes), or that
// are checked once every flag is read.
struct GivenFlags {
  std::optional<uint64_t> model_mib, fanout_model_mib, chunk_mib, producers_model_mib, tp_model_mib,
      embedded_model_mib, elastic_model_mib, steps;
  std::optional<std::vector<size_t>> fanout;
  std::optional<std::vector<std::string_view>> sections;
};

// Declare every flag of e2e_bench over `args` and `given`.
FlagSet DeclareFlags(Args& args, GivenFlags& given) {
  const auto densities = [](std::vector<double>* target) {
    return [target](std::string_view flag, std::string_view text) -> Status {
      target->clear();
      for (std::string_view part : SplitCommas(text)) {
        REFIT_ASSIGN_OR_RETURN(double density, ParseDensity(flag, part, /*allow_one=*/true));
        target->push_back(density);
      }
      return Status::OK();
    };
  };
  const auto density = [](double* target) {
    return [target](std::string_view flag, std::string_view text) -> Status {
      REFIT_ASSIGN_OR_RETURN(*target, ParseDensity(flag, text, /*allow_one=*/true));
      return Status::OK();
    };
  };
  const auto counts = [](std::vector<uint32_t>* target) {
    return [target](std::string_view flag, std::string_view text) -> Status {
      REFIT_ASSIGN_OR_RETURN(*target, ParseCounts(flag, text));
      return Status::OK();
    };
  };
  FlagSet flags("e2e_bench", std::string(kSectionsHelp));
  flags.Switch("--help", "print this and exit", &args.help);
  flags.Switch("--quick", "CI's smoke sizes (explicit sizes still win)", &args.quick);
  flags.Switch("--json", "print the report as JSON instead of tables", &args.json);
  flags.Text("--json-out", "PATH", "also write the JSON report here", &args.json_out);
  flags.Unsigned("--model-mib", "N", "the end-to-end section's model", &given.model_mib);
  flags.Value("--densities", "D,D,...", "the end-to-end section's delta densities",
              densities(&args.densities));
  flags.Value("--fanout", "N,N,...", "fan-out fleet sizes",
              [&](std::string_view flag, std::string_view text) -> Status {
                given.fanout.emplace();
                for (std::string_view part : SplitCommas(text)) {
                  REFIT_ASSIGN_OR_RETURN(uint64_t receivers, ParseUnsigned(flag, part));
                  given.fanout->push_back(receivers);
                }
                return Status::OK();
              });
  flags.Unsigned("--fanout-model-mib", "N", "the fan-out section's model", &given.fanout_model_mib);
  flags.Value("--fanout-density", "D", "the fan-out section's delta density",
              density(&args.fanout_density));
  flags.Unsigned("--chunk-mib", "N", "export chunk target", &given.chunk_mib);
  flags.Value("--bucket-mib", "N", "payload bucket size",
              [&](std::string_view flag, std::string_view text) -> Status {
                REFIT_ASSIGN_OR_RETURN(uint64_t mib, ParseUnsigned(flag, text));
                args.bucket_bytes = mib * kMiB;
                return Status::OK();
              });
  flags.Value("--delta-bucket-mib", "N",
              "payload bucket size of a delta (ProducerStreamOptions::delta_bucket_bytes; "
              "0: the bucket size)",
              [&](std::string_view flag, std::string_view text) -> Status {
                REFIT_ASSIGN_OR_RETURN(uint64_t mib, ParseUnsigned(flag, text));
                args.delta_bucket_bytes = mib * kMiB;
                return Status::OK();
              });
  flags.Value("--threads", "N", "threads per producer stage",
              [&](std::string_view flag, std::string_view text) -> Status {
                REFIT_ASSIGN_OR_RETURN(uint64_t threads, ParseUnsigned(flag, text));
                args.threads = static_cast<int>(
                    std::min<uint64_t>(threads, ProducerStreamOptions::kMaxThreads));
                return Status::OK();
              });
  flags.Switch("--mmap", "receivers map the model copy-on-write", &args.receiver_mmap);
  flags.Switch("--no-verify", "skip downloading and comparing every tensor at the end",
               [&] { args.verify_end_to_end = false; });
  flags.Value("--anchor-undo", "memory|file|none", "the daemons' anchor undo policy",
              [&](std::string_view, std::string_view text) -> Status {
                REFIT_ASSIGN_OR_RETURN(args.anchor_undo, ParseAnchorUndo(text));
                return Status::OK();
              });
  flags.Value("--anchor-compression", "auto|zstd|none", "the producers' anchor compression",
              [&](std::string_view, std::string_view text) -> Status {
                REFIT_ASSIGN_OR_RETURN(args.anchor_compression, ParseAnchorCompression(text));
                return Status::OK();
              });
  flags.Value("--apply-threads", "N", "the daemons' threads per payload",
              [&](std::string_view flag, std::string_view text) -> Status {
                REFIT_ASSIGN_OR_RETURN(const uint64_t threads, ParseUnsigned(flag, text));
                if (threads < 1 ||
                    threads > static_cast<uint64_t>(ReceiverSessionOptions::kMaxApplyThreads)) {
                  return InvalidArgument("--apply-threads {} is outside [1, {}]", threads,
                                         ReceiverSessionOptions::kMaxApplyThreads);
                }
                args.apply_threads = static_cast<int>(threads);
                return Status::OK();
              });
  flags.Unsigned("--apply-queue-mib", "N",
                 "the daemons' apply queue bound in MiB (refit serve --apply-queue-bytes; 0: the "
                 "daemon's default)",
                 &args.apply_queue_mib);
  flags.Switch("--no-raw-copy", "skip the raw-copy yardstick", [&] { args.raw_copy = false; });
  flags.Switch("--skip-end-to-end", "skip the end-to-end section", &args.skip_end_to_end);
  flags.Switch("--skip-fanout", "skip the fan-out section", &args.skip_fanout);
  flags.Switch("--skip-producers", "skip the producers section", &args.skip_producers);
  flags.Switch("--skip-tp", "skip the tp section", &args.skip_tp);
  flags.Switch("--skip-embedded", "skip the embedded section", &args.skip_embedded);
  flags.Switch("--skip-elastic", "skip the elastic section", &args.skip_elastic);
  flags.Value(
      "--sections", "S,S,...", "run only these sections",
      [&](std::string_view, std::string_view text) -> Status {
        given.sections = SplitCommas(text);
        for (std::string_view name : *given.sections) {
          if (std::find(kSectionNames.begin(), kSectionNames.end(), name) == kSectionNames.end()) {
            return InvalidArgument("--sections: unknown section '{}' (known: {})", name,
                                   fmt::join(kSectionNames, ", "));
          }
        }
        return Status::OK();
      });
  flags.Value("--producers", "W,W,...", "the producers section's rank counts",
              counts(&args.producers));
  flags.Unsigned("--producers-model-mib", "N", "the producers section's model",
                 &given.producers_model_mib);
  flags.Unsigned("--producers-receivers", "N", "the producers section's receivers",
                 &args.producers_receivers);
  flags.Value("--tp", "T,T,...", "the tp section's shard group sizes", counts(&args.tp));
  flags.Unsigned("--tp-model-mib", "N", "the tp section's model", &given.tp_model_mib);
  flags.Unsigned("--embedded-model-mib", "N", "the embedded section's model",
                 &given.embedded_model_mib);
  flags.Unsigned("--elastic-model-mib", "N", "the elastic section's model",
                 &given.elastic_model_mib);
  flags.Unsigned("--steps", "N", "delta steps of the producers and tp sections", &given.steps);
  flags.Value("--step-density", "D", "their density", density(&args.step_density));
  flags.Text("--work-dir", "DIR", "where models, logs and ready files go", &args.work_dir);
  flags.Text("--refit-binary", "PATH", "the refit executable", &args.refit_binary);
  flags.Unsigned("--seed", "N", "the synthetic model's seed", &args.seed);
  return flags;
}

}  // namespace

std::string Usage() {
  Args args;
  GivenFlags given;
  return DeclareFlags(args, given).Usage();
}

Result<Args> ParseArgs(int argc, char** argv) {
  Args args;
  GivenFlags given;
  REFIT_RETURN_NOT_OK(DeclareFlags(args, given).Parse(argc, argv));
  if (args.help) return args;
  // --quick: CI's smoke sizes (well under a minute on 2 cores); explicit sizes still win.
  if (args.quick) {
    args.model_bytes = 64 * kMiB;
    args.fanout_model_bytes = 16 * kMiB;
    args.fanout = {1, 2};
    args.producers_model_bytes = 32 * kMiB;
    args.tp_model_bytes = 64 * kMiB;
    args.embedded_model_bytes = 64 * kMiB;
    args.elastic_model_bytes = 8 * kMiB;
    args.steps = 3;
  }
  if (given.model_mib) args.model_bytes = *given.model_mib * kMiB;
  if (given.fanout_model_mib) args.fanout_model_bytes = *given.fanout_model_mib * kMiB;
  if (given.chunk_mib) args.chunk_bytes = *given.chunk_mib * kMiB;
  if (given.fanout) args.fanout = *given.fanout;
  if (given.producers_model_mib) args.producers_model_bytes = *given.producers_model_mib * kMiB;
  if (given.tp_model_mib) args.tp_model_bytes = *given.tp_model_mib * kMiB;
  if (given.embedded_model_mib) args.embedded_model_bytes = *given.embedded_model_mib * kMiB;
  if (given.elastic_model_mib) args.elastic_model_bytes = *given.elastic_model_mib * kMiB;
  if (given.steps) args.steps = *given.steps;
  if (given.sections) {
    const auto listed = [&](std::string_view name) {
      return std::find(given.sections->begin(), given.sections->end(), name) !=
             given.sections->end();
    };
    args.skip_end_to_end = args.skip_end_to_end || !listed("end-to-end");
    args.skip_fanout = args.skip_fanout || !listed("fan-out");
    args.skip_producers = args.skip_producers || !listed("producers");
    args.skip_tp = args.skip_tp || !listed("tp");
    args.skip_embedded = args.skip_embedded || !listed("embedded");
    args.skip_elastic = args.skip_elastic || !listed("elastic");
  }
  if (args.model_bytes == 0 || args.fanout_model_bytes == 0 || args.producers_model_bytes == 0 ||
      args.tp_model_bytes == 0 || args.embedded_model_bytes == 0 || args.elastic_model_bytes == 0) {
    return InvalidArgument("model sizes must be at least 1 MiB");
  }
  if (args.steps == 0) return InvalidArgument("--steps must be at least 1");
  if (args.producers_receivers == 0) {
    return InvalidArgument("--producers-receivers: a fleet needs at least 1 receiver");
  }
  for (uint32_t tp : args.tp) {
    if (tp < 2)
      return InvalidArgument(
          "--tp: {} is not a shard group (the unsharded replica is "
          "always measured)",
          tp);
  }
  if (args.chunk_bytes == 0 || args.bucket_bytes == 0) {
    return InvalidArgument("--chunk-mib and --bucket-mib must be at least 1");
  }
  if (args.threads < 1) return InvalidArgument("--threads must be at least 1");
  for (size_t receivers : args.fanout) {
    if (receivers == 0) return InvalidArgument("--fanout: a fleet needs at least 1 receiver");
  }
  return args;
}

Result<SyntheticModel> SyntheticModel::Make(uint64_t target_bytes, uint64_t seed, int threads,
                                            ProgressReporter* progress) {
  SyntheticModel model;
  model.seed_ = seed;
  model.threads_ = threads;
  const std::vector<SimulatedTensorSpec> specs =
      MakeTransformerSpec(target_bytes, DType::kBFloat16);
  const std::vector<float> normal = NormalQuantileTable();
  for (const SimulatedTensorSpec& spec : specs) {
    REFIT_ASSIGN_OR_RETURN(uint64_t numel, NumElements(spec.shape));
    model.buffers_.push_back(std::make_unique_for_overwrite<uint16_t[]>(numel));
    model.numels_.push_back(numel);
    model.views_.push_back(
        TensorView{spec.name, DType::kBFloat16, spec.shape,
                   std::as_bytes(std::span<const uint16_t>(model.buffers_.back().get(), numel))});
    model.bytes_ += numel * sizeof(uint16_t);
  }
  // Each tensor draws from its own seeded stream, so the model is the same for any thread count.
  REFIT_RETURN_NOT_OK(
      internal::ParallelFor(threads, specs.size(), [&](uint64_t begin, uint64_t end) -> Status {
        for (uint64_t t = begin; t < end; ++t) {
          SplitMix64 rng(StreamSeed(seed, kInitStream, 0, t));
          uint16_t* out = model.buffers_[t].get();
          const float mean = specs[t].init_mean, stddev = specs[t].init_std;
          const uint64_t n = model.numels_[t];
          uint64_t r = 0;
          for (uint64_t i = 0; i < n; ++i) {
            // Four 16-bit table indices per draw.
            if (i % 4 == 0) r = rng.Next();
            const float z = normal[static_cast<uint16_t>(r >> (16 * (i % 4)))];
            out[i] = FloatToBFloat16(mean + stddev * z);
          }
          if (progress != nullptr) progress->Advance(n * sizeof(uint16_t));
        }
        return Status::OK();
      }));
  return model;
}

Result<uint64_t> SyntheticModel::Step(uint64_t step, double density) {
  std::atomic<uint64_t> changed{0};
  // log(1 - density): gaps are floor(log(u) / log(1 - density)), u uniform in (0, 1].
  const double log_keep = std::log1p(-density);
  REFIT_RETURN_NOT_OK(
      internal::ParallelFor(threads_, buffers_.size(), [&](uint64_t begin, uint64_t end) -> Status {
        for (uint64_t t = begin; t < end; ++t) {
          SplitMix64 rng(StreamSeed(seed_, kStepStream, step, t));
          uint16_t* bits = buffers_[t].get();
          const double n = static_cast<double>(numels_[t]);
          uint64_t count = 0;
          // Positions are tracked in double so that a huge gap cannot overflow before the check.
          for (double position = std::floor(std::log(OpenUnit(rng.Next())) / log_keep);
               position < n;
               position += 1 + std::floor(std::log(OpenUnit(rng.Next())) / log_keep)) {
            const uint64_t i = static_cast<uint64_t>(position);
            bits[i] = NudgeOneUlp(bits[i], (rng.Next() & 1) != 0);
            ++count;
          }
          changed += count;
        }
        return Status::OK();
      }));
  return changed.load();
}

Result<BenchFleet> StartFleet(const Args& args, const std::string& work_dir,
                              const std::string& model_path, size_t receivers,
                              const std::vector<TensorView>& model) {
  testkit::LocalFleetOptions fleet_options;
  fleet_options.refit_binary = args.refit_binary;
  fleet_options.receivers = testkit::LocalFleetOptions::Replicas(model_path, receivers);
  fleet_options.api_key_env = kApiKeyEnv;
  fleet_options.work_dir = work_dir;
  if (args.receiver_mmap) fleet_options.extra_args.push_back("--mmap");
  fleet_options.extra_args.push_back("--anchor-undo");
  fleet_options.extra_args.push_back(std::string(AnchorUndoName(args.anchor_undo)));
  fleet_options.extra_args.push_back("--apply-threads");
  fleet_options.extra_args.push_back(std::to_string(args.apply_threads));
  if (args.apply_queue_mib > 0) {
    fleet_options.extra_args.push_back("--apply-queue-bytes");
    fleet_options.extra_args.push_back(std::to_string(args.apply_queue_mib * kMiB));
  }
  REFIT_ASSIGN_OR_RETURN(BenchFleet fleet, StartBenchFleet("zmq", fleet_options));

  BenchProducers producers;
  REFIT_ASSIGN_OR_RETURN(producers.transport, TransportUri::Parse("zmq://"));
  producers.stream.chunk_bytes = args.chunk_bytes;
  producers.stream.bucket_bytes = args.bucket_bytes;
  producers.stream.delta_bucket_bytes = args.delta_bucket_bytes;
  producers.stream.encode_threads = args.threads;
  producers.stream.serialize_threads = args.threads;
  producers.stream.send_threads = args.threads;
  // ProducerStream's default rule (2 × send threads) for the thread count actually used.
  producers.stream.max_payloads_in_flight = 2 * static_cast<size_t>(args.threads);
  producers.stream.anchor_compression = args.anchor_compression;
  REFIT_RETURN_NOT_OK(AttachProducers(fleet, producers, kApiKeyEnv, model));
  return fleet;
}

Result<RssWindow> OpenRssWindow(const testkit::LocalFleet& daemons) {
  RssWindow window;
  Status reset = testkit::ResetPeakRss("self");
  for (const testkit::LocalReceiver& receiver : daemons.receivers()) {
    if (reset.ok()) reset = testkit::ResetPeakRss(std::to_string(receiver.pid));
  }
  if (!reset.ok()) {
    window.reset = false;
    std::cerr << "warning: " << reset.message()
              << "; peak RSS figures are peaks since process start\n";
  }
  // Right after the reset the peak equals the current RSS.
  REFIT_ASSIGN_OR_RETURN(window.producer_before, testkit::ProcessMemoryBytes("self", "VmHWM"));
  for (size_t r = 0; r < daemons.receivers().size(); ++r) {
    REFIT_ASSIGN_OR_RETURN(uint64_t before, daemons.PeakRssBytes(r));
    window.receiver_before = std::max(window.receiver_before, before);
  }
  return window;
}

Status CloseRssWindow(const testkit::LocalFleet& daemons, RssWindow* window) {
  REFIT_ASSIGN_OR_RETURN(window->producer_peak, testkit::ProcessMemoryBytes("self", "VmHWM"));
  for (size_t r = 0; r < daemons.receivers().size(); ++r) {
    REFIT_ASSIGN_OR_RETURN(uint64_t peak, daemons.PeakRssBytes(r));
    window->receiver_peak = std::max(window->receiver_peak, peak);
  }
  return Status::OK();
}

Status VerifyFleet(const cli::FleetCoordinator& fleet, const std::vector<TensorView>& model) {
  std::map<std::string, uint64_t> producer_digests;
  for (const std::unique_ptr<internal::DeltaTracker>& tracker : fleet.trackers()) {
    producer_digests.merge(tracker->Digests());
  }
  const uint64_t fingerprint = StateFingerprint(producer_digests);
  REFIT_RETURN_NOT_OK(fleet.CheckReceiversHold(model));
  for (const std::unique_ptr<ControlClient>& client : fleet.clients()) {
    REFIT_ASSIGN_OR_RETURN(ControlStatus status, client->GetStatus());
    if (status.state_fingerprint != fingerprint) {
      return DataLoss("{}: state fingerprint {} but the producers' is {:016x}", client->base_url(),
                      status.state_fingerprint ? fmt::format("{:016x}", *status.state_fingerprint)
                                               : std::string("(none)"),
                      fingerprint);
    }
  }
  return Status::OK();
}

std::string SignedBytes(int64_t bytes) {
  return bytes < 0 ? "-" + FormatBytes(static_cast<uint64_t>(-bytes))
                   : FormatBytes(static_cast<uint64_t>(bytes));
}

std::optional<MemoryFit> FitMemory(const std::vector<std::pair<double, double>>& points) {
  if (points.size() < 2) return std::nullopt;
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [x, y] : points) {
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double n = static_cast<double>(points.size());
  const double spread = n * sxx - sx * sx;
  if (spread <= 0) return std::nullopt;
  MemoryFit fit;
  fit.bytes_per_changed = (n * sxy - sx * sy) / spread;
  fit.fixed_bytes = (sy - fit.bytes_per_changed * sx) / n;
  return fit;
}

Result<RefitRow> MeasureRefit(BenchFleet& fleet, bool full) {
  RefitRow row;
  row.full = full;
  REFIT_ASSIGN_OR_RETURN(row.rss, OpenRssWindow(*fleet.daemons));
  REFIT_ASSIGN_OR_RETURN(row.report, RefitOfKind(fleet, full));
  for (const std::unique_ptr<internal::DeltaTracker>& tracker : fleet.coordinator->trackers()) {
    // Inside the RSS window: the fold's memory (the changes it holds until folded) is the
    // producer's as much as the refit's. The wait is the benchmark's, not the trainer's.
    REFIT_RETURN_NOT_OK(tracker->WaitBaseline());
    row.baseline_fold_s = std::max(row.baseline_fold_s, tracker->last_fold().seconds);
  }
  REFIT_RETURN_NOT_OK(CloseRssWindow(*fleet.daemons, &row.rss));
  for (const std::unique_ptr<internal::DeltaTracker>& tracker : fleet.coordinator->trackers()) {
    row.baseline_bytes += tracker->baseline_bytes();
  }
  return row;
}

uint64_t SectionChunkBytes(uint64_t model_bytes) {
  return std::clamp(model_bytes / kSectionChunksPerModel, kMinSectionChunkBytes,
                    kMaxSectionChunkBytes);
}

Result<std::string> WriteRefitConfig(const Args& args, const std::string& work_dir,
                                     const std::string& stem, uint64_t chunk_bytes) {
  const std::string path = fmt::format("{}/{}.yaml", work_dir, stem);
  const std::string text = fmt::format(
      "delta_compression:\n"
      "  export_chunk_bytes: {}\n"
      "  sparse_bucket_size_bytes: {}\n"
      "tuning:\n"
      "  encode_workers: {}\n"
      "  serialize_workers: {}\n"
      "  transfer_workers: {}\n"
      "http_refit_api_key_env_var: {}\n",
      chunk_bytes, args.bucket_bytes, args.threads, args.threads, args.threads, kApiKeyEnv);
  REFIT_RETURN_NOT_OK(testkit::WriteTextFileAtomically(path, text));
  return path;
}

Result<PublisherOptions> PublisherOptionsFromConfig(const std::string& config_path,
                                                    const std::vector<PublisherReceiver>& fleet) {
  std::vector<config::ReceiverConfig> receivers;
  for (const PublisherReceiver& receiver : fleet) {
    receivers.push_back({receiver.control_url, receiver.data_endpoint});
  }
  const config::ConfigOverride fleet_override{"receivers", std::move(receivers),
                                              "the bench's fleet"};
  REFIT_ASSIGN_OR_RETURN(const config::RefitConfig config,
                         config::LoadConfigFile(config_path, {&fleet_override, 1}));
  REFIT_ASSIGN_OR_RETURN(PublisherOptions options, config::ToPublisherOptions(config));
  options.transfer_timeout = kPushTimeout;
  // Every publisher the bench makes is a trainer (re)started within the bench's one run: it
  // resumes the run the fleet holds, so it continues with deltas (docs/protocol.md "Lineage and
  // fencing").
  options.resume = true;
  return options;
}

Result<std::vector<std::unique_ptr<Publisher>>> MakeThreadRanks(uint32_t world,
                                                                const PublisherOptions& options) {
  REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<ProducerGroup>> groups,
                         MakeInProcessGroup(world));
  std::vector<std::unique_ptr<Publisher>> ranks;
  for (std::unique_ptr<ProducerGroup>& group : groups) {
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Publisher> rank,
                           Publisher::Make(options, std::move(group)));
    ranks.push_back(std::move(rank));
  }
  return ranks;
}

Status AdoptBaseline(std::vector<std::unique_ptr<Publisher>>& ranks,
                     const std::vector<TensorView>& model) {
  for (std::unique_ptr<Publisher>& rank : ranks) REFIT_RETURN_NOT_OK(rank->AdoptBaseline(model));
  return Status::OK();
}

Result<RefitReport> SyncDelta(std::vector<std::unique_ptr<Publisher>>& ranks,
                              const std::vector<TensorView>& model) {
  std::vector<Result<SyncReport>> results(ranks.size(),
                                          Status(StatusCode::kInternal, "rank did not run"));
  {
    std::vector<std::jthread> threads;
    for (size_t p = 1; p < ranks.size(); ++p) {
      threads.emplace_back([&, p] { results[p] = ranks[p]->Sync(model); });
    }
    results[0] = ranks[0]->Sync(model);
  }
  // Rank 0's error names the cause; the others' say that rank 0 aborted.
  REFIT_RETURN_NOT_OK(results[0].status());
  for (size_t p = 1; p < ranks.size(); ++p) {
    REFIT_RETURN_NOT_OK(results[p].status().WithContext(fmt::format("rank {}", p)));
  }
  RefitReport report = std::move(results[0]).ValueOrDie().transfer;
  if (report.plan.anchor) {
    return Internal("transfer {} was a FULL anchor where a delta was expected",
                    report.plan.transfer_id.ToHex());
  }
  return report;
}

Status CheckReceiverHolds(const std::string& control_url, const std::vector<TensorView>& tensors) {
  ControlClientOptions options;
  options.base_url = control_url;
  REFIT_ASSIGN_OR_RETURN(options.api_key,
                         SecretFromEnvironment(kApiKeyEnv, "the bench fleet's key"));
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client, ControlClient::Make(options));
  for (const TensorView& tensor : tensors) {
    REFIT_ASSIGN_OR_RETURN(OwnedTensor held, client->GetTensor(tensor.name));
    if (held.bytes.size() != tensor.bytes.size() ||
        std::memcmp(held.bytes.data(), tensor.bytes.data(), tensor.bytes.size()) != 0) {
      return DataLoss("{}: tensor '{}' differs from the expected bytes", control_url, tensor.name);
    }
  }
  return Status::OK();
}

Result<ChildFlags> ChildFlags::Parse(int argc, char** argv, std::string_view mode) {
  ChildFlags flags;
  flags.mode_ = mode;
  for (int i = 2; i < argc; i += 2) {
    if (i + 1 >= argc) return InvalidArgument("{}: {} needs a value", mode, argv[i]);
    flags.values_[argv[i]] = argv[i + 1];
  }
  return flags;
}

Result<std::string> ChildFlags::Text(std::string_view name) const {
  const auto found = values_.find(name);
  if (found == values_.end()) return InvalidArgument("{}: {} is required", mode_, name);
  return found->second;
}

Result<uint64_t> ChildFlags::Number(std::string_view name) const {
  REFIT_ASSIGN_OR_RETURN(const std::string text, Text(name));
  return ParseUnsigned(name, text);
}

Result<std::unique_ptr<testkit::LocalFleet>> StartDaemons(
    const Args& args, const std::string& work_dir, const std::string& label,
    std::vector<testkit::LocalReceiverSpec> specs) {
  testkit::LocalFleetOptions options;
  options.refit_binary = args.refit_binary;
  options.receivers = std::move(specs);
  options.api_key_env = kApiKeyEnv;
  options.work_dir = work_dir;
  options.label = label;
  options.start_timeout = kChildStartTimeout;
  if (args.receiver_mmap) options.extra_args.push_back("--mmap");
  return testkit::LocalFleet::Start(options);
}

std::vector<PublisherReceiver> PublisherReceivers(const testkit::LocalFleet& daemons) {
  std::vector<PublisherReceiver> fleet;
  for (const testkit::LocalReceiver& daemon : daemons.receivers()) {
    fleet.push_back({daemon.control_url, daemon.data_endpoint});
  }
  return fleet;
}

SyncStep StepFromReport(const RefitReport& report, uint64_t changed_by_step, double wall_s) {
  SyncStep step;
  step.changed_by_step = changed_by_step;
  step.changed = report.changed_elements;
  step.payloads = report.payloads;
  step.wire_bytes = report.wire_bytes;
  step.time_s = report.total_s;
  step.stream_s = report.stream_s;
  step.flush_s = report.flush_s;
  step.commit_s = report.commit_s;
  step.wall_s = wall_s;
  step.routes = report.routes.size();
  for (const ReceiverOutcome& receiver : report.receivers) {
    uint64_t bytes = 0;
    for (const StreamReport& producer : report.producers) {
      if (receiver.route < producer.routes.size())
        bytes += producer.routes[receiver.route].wire_bytes;
    }
    step.received_bytes.push_back(bytes);
  }
  return step;
}

nlohmann::json StepJson(const SyncStep& step) {
  return {{"changed_by_step", step.changed_by_step},
          {"changed", step.changed},
          {"payloads", step.payloads},
          {"wire_bytes", step.wire_bytes},
          {"time_s", step.time_s},
          {"stream_s", step.stream_s},
          {"flush_s", step.flush_s},
          {"commit_s", step.commit_s},
          {"wall_s", step.wall_s},
          {"rank_peak_rss", step.rank_peak_rss},
          {"routes", step.routes},
          {"received_bytes", step.received_bytes}};
}

nlohmann::json Spread(const std::vector<SyncStep>& steps, double SyncStep::*figure) {
  std::vector<double> values;
  for (const SyncStep& step : steps) values.push_back(step.*figure);
  return {{"median", Median(values)},
          {"min", *std::min_element(values.begin(), values.end())},
          {"max", *std::max_element(values.begin(), values.end())}};
}

}  // namespace refit::bench::e2e
