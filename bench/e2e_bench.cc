// e2e_bench: networked refit end to end on loopback, measured side by side in one run.
//
//   end-to-end  one producer (this process) refits one `refit serve` daemon over zmq:// + the
//               HTTP control plane, on a bf16 model of --model-mib: one training step at each
//               --densities value, each followed by a delta refit, then a FULL transfer of the
//               same model (the yardstick: same transport, same fleet, same run). Per refit:
//               wire bytes, time, and the peak RSS of both processes during that refit, against
//               the model bytes each holds.
//   fan-out     1, 2, 4, 8 daemons (--fanout) through the relay tree on a smaller model: one
//               delta at --fanout-density and a FULL for each fleet size. The producer sends every
//               payload once to its root relay, so its wire bytes must not grow with N; every
//               daemon is downloaded tensor by tensor and compared with the producer's bytes.
//
// The model is not trained by the Adam simulator (14 bytes per element: a 4 GiB bf16 model would
// need 30 GiB); it is drawn cheaply with a realistic value distribution and stepped by 1-ulp
// moves, see SyntheticModel. Prints two tables, or with --json one JSON document with every
// figure. See docs/benchmarking.md.
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "cli_common.h"
#include "control/protocol.h"
#include "core/half_float.h"
#include "fleet_coordinator.h"
#include "local_fleet.h"
#include "refit/digest.h"
#include "refit/progress.h"
#include "refit/safetensors.h"
#include "refit/simulator.h"

#ifndef REFIT_BINARY
#error "REFIT_BINARY must name the refit executable (set by bench/CMakeLists.txt)"
#endif

namespace refit::bench {
namespace {

// bf16 bytes are written through uint16_t pointers: safetensors and the wire are little-endian.
static_assert(std::endian::native == std::endian::little);

constexpr uint64_t kMiB = uint64_t{1} << 20;
// The density whose speedup the target is stated at, and the target itself (the figure).
constexpr double kTargetDensity = 0.03;
constexpr double kTargetSpeedup = 10.0;
// The end-to-end section refits one daemon: the fan-out section covers more.
constexpr size_t kEndToEndReceivers = 1;
// Room the work directory needs beyond the model file: safetensors header, daemon logs.
constexpr uint64_t kDiskMarginBytes = 64 * kMiB;
// Memory this process and the daemons need beyond the model copies they hold: libraries and the
// pipelines' bounded buffers (chunks, payloads and staged payloads in flight).
constexpr uint64_t kMemoryMarginBytes = 512 * kMiB;
// Environment variable through which the daemons and this process share the run's api key (never
// on a command line, where `ps` shows it).
constexpr const char* kApiKeyEnv = "REFIT_E2E_BENCH_API_KEY";
// Writing this to /proc/<pid>/clear_refs resets the process's peak RSS (VmHWM) to its current
// RSS (proc(5), Linux 4.0+), so that a peak read afterwards belongs to what ran in between.
constexpr std::string_view kResetPeakRss = "5";

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
  // Threads per producer stage: the machine this was written for has 2 cores.
  int threads = 2;
  // Receivers read the model into memory (default) or map it copy-on-write.
  bool receiver_mmap = false;
  // Download every tensor of the end-to-end daemon after the last refit and compare.
  bool verify_end_to_end = true;
  bool skip_end_to_end = false;
  bool skip_fanout = false;
  std::string work_dir;
  std::string refit_binary = REFIT_BINARY;
  uint64_t seed = 42;
  bool json = false;
  std::string json_out;
  bool quick = false;
};

constexpr std::string_view kUsage =
    "usage: e2e_bench [--quick] [--json] [--json-out PATH] [--model-mib N]\n"
    "                 [--densities D,D,...] [--fanout N,N,...] [--fanout-model-mib N]\n"
    "                 [--fanout-density D] [--chunk-mib N] [--bucket-mib N] [--threads N]\n"
    "                 [--mmap] [--no-verify] [--skip-end-to-end] [--skip-fanout]\n"
    "                 [--work-dir DIR] [--refit-binary PATH] [--seed N]\n";

Result<Args> ParseArgs(int argc, char** argv) {
  Args args;
  std::optional<uint64_t> model_mib, fanout_model_mib, chunk_mib;
  std::optional<std::vector<size_t>> fanout;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    auto value = [&]() -> Result<std::string_view> {
      if (i + 1 >= argc) return InvalidArgument("{} needs a value", flag);
      return std::string_view(argv[++i]);
    };
    if (flag == "--quick") {
      args.quick = true;
    } else if (flag == "--json") {
      args.json = true;
    } else if (flag == "--json-out") {
      REFIT_ASSIGN_OR_RETURN(args.json_out, value());
    } else if (flag == "--model-mib") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(model_mib, ParseUnsigned(flag, text));
    } else if (flag == "--fanout-model-mib") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(fanout_model_mib, ParseUnsigned(flag, text));
    } else if (flag == "--chunk-mib") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(chunk_mib, ParseUnsigned(flag, text));
    } else if (flag == "--bucket-mib") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(uint64_t mib, ParseUnsigned(flag, text));
      args.bucket_bytes = mib * kMiB;
    } else if (flag == "--densities") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      args.densities.clear();
      for (std::string_view part : SplitCommas(text)) {
        REFIT_ASSIGN_OR_RETURN(double density, ParseDensity(flag, part, /*allow_one=*/true));
        args.densities.push_back(density);
      }
    } else if (flag == "--fanout") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      fanout.emplace();
      for (std::string_view part : SplitCommas(text)) {
        REFIT_ASSIGN_OR_RETURN(uint64_t receivers, ParseUnsigned(flag, part));
        fanout->push_back(receivers);
      }
    } else if (flag == "--fanout-density") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(args.fanout_density, ParseDensity(flag, text, /*allow_one=*/true));
    } else if (flag == "--threads") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(uint64_t threads, ParseUnsigned(flag, text));
      args.threads = static_cast<int>(std::min<uint64_t>(threads, ProducerStream::kMaxThreads));
    } else if (flag == "--mmap") {
      args.receiver_mmap = true;
    } else if (flag == "--no-verify") {
      args.verify_end_to_end = false;
    } else if (flag == "--skip-end-to-end") {
      args.skip_end_to_end = true;
    } else if (flag == "--skip-fanout") {
      args.skip_fanout = true;
    } else if (flag == "--work-dir") {
      REFIT_ASSIGN_OR_RETURN(args.work_dir, value());
    } else if (flag == "--refit-binary") {
      REFIT_ASSIGN_OR_RETURN(args.refit_binary, value());
    } else if (flag == "--seed") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(args.seed, ParseUnsigned(flag, text));
    } else {
      return InvalidArgument("unknown argument '{}'", flag);
    }
  }
  // --quick: CI's smoke sizes (well under a minute on 2 cores); explicit sizes still win.
  if (args.quick) {
    args.model_bytes = 64 * kMiB;
    args.fanout_model_bytes = 16 * kMiB;
    args.fanout = {1, 2};
  }
  if (model_mib) args.model_bytes = *model_mib * kMiB;
  if (fanout_model_mib) args.fanout_model_bytes = *fanout_model_mib * kMiB;
  if (chunk_mib) args.chunk_bytes = *chunk_mib * kMiB;
  if (fanout) args.fanout = *fanout;
  if (args.model_bytes == 0 || args.fanout_model_bytes == 0) {
    return InvalidArgument("model sizes must be at least 1 MiB");
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

// --- The synthetic model ----------------------------------------------------------------------

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

// SplitMix64 (Steele, Lea, Flood 2014): a tiny, fast 64-bit generator (period 2^64), good enough
// for drawing weights and positions, and seeded per (purpose, step, tensor) so that the model is
// the same for any thread count.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // A uniform double in (0, 1].
  double NextOpenUnit() { return static_cast<double>((Next() >> 11) + 1) * kTwoToMinus53; }

 private:
  uint64_t state_;
};

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

// Run fn(t) for t in [0, count) on `threads` threads (this one included), each taking the next
// index from a shared counter, so that a thread done with a small tensor moves on at once.
template <typename Fn>
void ParallelFor(size_t count, int threads, Fn&& fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t t = next++; t < count; t = next++) fn(t);
  };
  std::vector<std::jthread> workers;
  for (int k = 1; k < threads; ++k) workers.emplace_back(work);
  work();
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

// A bf16 model with MakeTransformerSpec's tensors, drawn as mean + std · z (z from the quantile
// table, bf16 by round-to-nearest-even), and stepped by moving a random `density` of its
// elements by ±1 ulp — what Adam's small steps do to bf16 weights, at 2 bytes per element
// instead of the simulator's 14.
class SyntheticModel {
 public:
  /// Purposes of the random streams.
  static constexpr uint64_t kInitStream = 1;
  static constexpr uint64_t kStepStream = 2;

  static Result<SyntheticModel> Make(uint64_t target_bytes, uint64_t seed, int threads,
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
    ParallelFor(specs.size(), threads, [&](size_t t) {
      SplitMix64 rng(StreamSeed(seed, kInitStream, 0, t));
      uint16_t* out = model.buffers_[t].get();
      const float mean = specs[t].init_mean, stddev = specs[t].init_std;
      const uint64_t n = model.numels_[t];
      uint64_t r = 0;
      for (uint64_t i = 0; i < n; ++i) {
        // Four 16-bit table indices per draw.
        if (i % 4 == 0) r = rng.Next();
        const float z = normal[static_cast<uint16_t>(r >> (16 * (i % 4)))];
        out[i] = internal::FloatToBFloat16(mean + stddev * z);
      }
      if (progress != nullptr) progress->Advance(n * sizeof(uint16_t));
    });
    return model;
  }

  /// Apply training step `step`: each element changes with probability `density`, positions
  /// drawn by geometric gaps (one draw per change, not per element). Returns the elements
  /// changed, which is exactly what the tracker must find.
  uint64_t Step(uint64_t step, double density) {
    std::atomic<uint64_t> changed{0};
    // log(1 - density): gaps are floor(log(u) / log(1 - density)), u uniform in (0, 1].
    const double log_keep = std::log1p(-density);
    ParallelFor(buffers_.size(), threads_, [&](size_t t) {
      SplitMix64 rng(StreamSeed(seed_, kStepStream, step, t));
      uint16_t* bits = buffers_[t].get();
      const double n = static_cast<double>(numels_[t]);
      uint64_t count = 0;
      // Positions are tracked in double so that a huge gap cannot overflow before the check.
      for (double position = std::floor(std::log(rng.NextOpenUnit()) / log_keep); position < n;
           position += 1 + std::floor(std::log(rng.NextOpenUnit()) / log_keep)) {
        const uint64_t i = static_cast<uint64_t>(position);
        bits[i] = NudgeOneUlp(bits[i], (rng.Next() & 1) != 0);
        ++count;
      }
      changed += count;
    });
    return changed.load();
  }

  const std::vector<TensorView>& views() const { return views_; }
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

// Reset the peak RSS of process `pid` ("self" for this one). Errors: IoError (not root, or a
// kernel without clear_refs).
Status ResetPeakRss(const std::string& pid) {
  const std::string path = fmt::format("/proc/{}/clear_refs", pid);
  std::ofstream out(path);
  if (out) out << kResetPeakRss;
  if (!out) {
    return IoError("cannot write '{}' to {} (needs root or own process)", kResetPeakRss, path);
  }
  out.close();
  if (!out) return IoError("cannot write '{}' to {}", kResetPeakRss, path);
  return Status::OK();
}

// A fleet of daemons over one model file and a coordinator with the model as baseline.
struct Fleet {
  std::unique_ptr<cli::LocalFleet> daemons;
  std::unique_ptr<cli::FleetCoordinator> coordinator;
  double start_s = 0;
};

Result<Fleet> StartFleet(const Args& args, const std::string& work_dir,
                         const std::string& model_path, size_t receivers,
                         const std::vector<TensorView>& model) {
  Fleet fleet;
  cli::LocalFleetOptions fleet_options;
  fleet_options.refit_binary = args.refit_binary;
  fleet_options.model_path = model_path;
  fleet_options.receivers = receivers;
  fleet_options.api_key_env = kApiKeyEnv;
  fleet_options.work_dir = work_dir;
  if (args.receiver_mmap) fleet_options.extra_args.push_back("--mmap");
  const double t0 = Now();
  REFIT_ASSIGN_OR_RETURN(fleet.daemons, cli::LocalFleet::Start(fleet_options));
  fleet.start_s = Now() - t0;

  cli::FleetAddress address;
  for (const cli::LocalReceiver& receiver : fleet.daemons->receivers()) {
    address.control_urls.push_back(receiver.control_url);
    address.data_endpoints.push_back(receiver.data_endpoint);
  }
  address.transport_uri = fmt::format("zmq://?api_key_env={}", kApiKeyEnv);
  address.api_key = std::getenv(kApiKeyEnv);
  TrackerOptions tracker_options;
  // Parallelism comes from encoding chunks concurrently; a parallel compare inside each encode
  // would oversubscribe the cores.
  tracker_options.compare.threads = 1;
  CoordinatorOptions options;
  options.stream.chunk_bytes = args.chunk_bytes;
  options.stream.bucket_bytes = args.bucket_bytes;
  options.stream.encode_threads = args.threads;
  options.stream.serialize_threads = args.threads;
  options.stream.send_threads = args.threads;
  // ProducerStream's default rule (2 × send threads) for the thread count actually used.
  options.stream.max_payloads_in_flight = 2 * static_cast<size_t>(args.threads);
  REFIT_ASSIGN_OR_RETURN(fleet.coordinator,
                         cli::FleetCoordinator::Make(address, &model, /*producers=*/1,
                                                     tracker_options, options, &model));
  return fleet;
}

// Peak RSS of this process and of every daemon, reset before a refit and read after it.
struct RssWindow {
  bool reset = true;
  uint64_t producer_before = 0;
  uint64_t producer_peak = 0;
  // The largest over the daemons.
  uint64_t receiver_before = 0;
  uint64_t receiver_peak = 0;
};

Result<RssWindow> OpenRssWindow(const cli::LocalFleet& daemons) {
  RssWindow window;
  Status reset = ResetPeakRss("self");
  for (const cli::LocalReceiver& receiver : daemons.receivers()) {
    if (reset.ok()) reset = ResetPeakRss(std::to_string(receiver.pid));
  }
  if (!reset.ok()) {
    window.reset = false;
    std::cerr << "warning: " << reset.message()
              << "; peak RSS figures are peaks since process start\n";
  }
  // Right after the reset the peak equals the current RSS.
  REFIT_ASSIGN_OR_RETURN(window.producer_before, cli::SelfPeakRssBytes());
  for (size_t r = 0; r < daemons.receivers().size(); ++r) {
    REFIT_ASSIGN_OR_RETURN(uint64_t before, daemons.PeakRssBytes(r));
    window.receiver_before = std::max(window.receiver_before, before);
  }
  return window;
}

Status CloseRssWindow(const cli::LocalFleet& daemons, RssWindow* window) {
  REFIT_ASSIGN_OR_RETURN(window->producer_peak, cli::SelfPeakRssBytes());
  for (size_t r = 0; r < daemons.receivers().size(); ++r) {
    REFIT_ASSIGN_OR_RETURN(uint64_t peak, daemons.PeakRssBytes(r));
    window->receiver_peak = std::max(window->receiver_peak, peak);
  }
  return Status::OK();
}

// Download every tensor from every daemon and compare it with the producer's bytes; compare
// every daemon's state fingerprint with the producers' committed digests.
Status VerifyFleet(const cli::FleetCoordinator& fleet, const std::vector<TensorView>& model) {
  std::map<std::string, uint64_t> producer_digests;
  for (const std::unique_ptr<DeltaTracker>& tracker : fleet.trackers()) {
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

// The straight line over = fixed + per_changed · changed through (changed, over) points by least
// squares: how a process's memory beyond the model grows with the changes of a refit.
struct MemoryFit {
  double fixed_bytes = 0;
  double bytes_per_changed = 0;
};

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

// --- End to end -------------------------------------------------------------------------------

struct RefitRow {
  bool full = false;
  double target_density = 0;
  uint64_t changed_by_step = 0;
  RefitReport report;
  RssWindow rss;
  uint64_t baseline_bytes = 0;
};

Result<RefitRow> MeasureRefit(Fleet& fleet, bool full) {
  RefitRow row;
  row.full = full;
  REFIT_ASSIGN_OR_RETURN(row.rss, OpenRssWindow(*fleet.daemons));
  REFIT_ASSIGN_OR_RETURN(row.report, fleet.coordinator->Refit(/*force_anchor=*/full));
  REFIT_RETURN_NOT_OK(CloseRssWindow(*fleet.daemons, &row.rss));
  if (row.report.plan.anchor != full) {
    return Internal("transfer {} was {} but a {} was asked for",
                    row.report.plan.transfer_id.ToHex(),
                    row.report.plan.anchor ? "FULL" : "a delta", full ? "FULL" : "delta");
  }
  for (const std::unique_ptr<DeltaTracker>& tracker : fleet.coordinator->trackers()) {
    row.baseline_bytes += tracker->baseline_bytes();
  }
  return row;
}

double Density(const RefitReport& report) {
  return report.total_elements == 0 ? 0.0
                                    : static_cast<double>(report.changed_elements) /
                                          static_cast<double>(report.total_elements);
}

nlohmann::json RowJson(const RefitRow& row, const RefitRow& full, uint64_t model_bytes) {
  const RefitReport& r = row.report;
  const StreamReport& s = r.producers.front();
  const uint64_t producer_held = model_bytes + row.baseline_bytes;
  const auto over = [](uint64_t peak, uint64_t held) {
    return static_cast<int64_t>(peak) - static_cast<int64_t>(held);
  };
  nlohmann::json receivers = nlohmann::json::array();
  for (const ReceiverOutcome& outcome : r.receivers) {
    receivers.push_back({{"name", outcome.name},
                         {"applied_payloads", outcome.flush.payloads},
                         {"duplicates", outcome.flush.duplicates},
                         {"changed_elements", outcome.flush.changed_elements},
                         {"committed", outcome.commit_status.ok()}});
  }
  return {
      {"kind", row.full ? "full" : "delta"},
      {"transfer_id", r.plan.transfer_id.ToHex()},
      {"target_version", r.plan.target_version},
      {"target_density", row.target_density},
      {"density", Density(r)},
      {"changed", r.changed_elements},
      {"changed_by_step", row.changed_by_step},
      {"total_elements", r.total_elements},
      {"chunks", s.chunks},
      {"payloads", r.payloads},
      {"items", s.items},
      {"item_bytes", s.item_bytes},
      {"wire_bytes", r.wire_bytes},
      {"wire_over_full", static_cast<double>(r.wire_bytes) /
                             static_cast<double>(std::max<uint64_t>(full.report.wire_bytes, 1))},
      {"wire_bytes_per_changed",
       r.changed_elements ? static_cast<double>(r.wire_bytes) / r.changed_elements : 0.0},
      {"time_s", r.total_s},
      {"prepare_s", r.prepare_s},
      {"stream_s", r.stream_s},
      {"flush_s", r.flush_s},
      {"commit_s", r.commit_s},
      {"speedup_vs_full", full.report.total_s / std::max(r.total_s, 1e-9)},
      {"producer_stages",
       {{"source_s", s.timings.source_s},
        {"dispatch_wait_s", s.timings.dispatch_wait_s},
        {"encode_s", s.timings.encode_s},
        {"serialize_s", s.timings.serialize_s},
        {"send_s", s.timings.send_s},
        {"wall_s", s.timings.wall_s},
        {"peak_chunks_in_flight", s.peak_chunks_in_flight},
        {"peak_payloads_in_flight", s.peak_payloads_in_flight}}},
      {"rss_reset_per_refit", row.rss.reset},
      {"producer_rss_before", row.rss.producer_before},
      {"producer_peak_rss", row.rss.producer_peak},
      {"producer_held_bytes", producer_held},
      {"producer_over_held_bytes", over(row.rss.producer_peak, producer_held)},
      {"producer_peak_over_before_bytes", over(row.rss.producer_peak, row.rss.producer_before)},
      {"tracker_baseline_bytes", row.baseline_bytes},
      {"receiver_rss_before", row.rss.receiver_before},
      {"receiver_peak_rss", row.rss.receiver_peak},
      {"receiver_over_model_bytes", over(row.rss.receiver_peak, model_bytes)},
      {"receiver_peak_over_before_bytes", over(row.rss.receiver_peak, row.rss.receiver_before)},
      {"receivers", receivers}};
}

Result<nlohmann::json> RunEndToEnd(const Args& args, const std::string& work_dir) {
  nlohmann::json out;
  const std::string model_path = work_dir + "/e2e-model.safetensors";
  double t0 = Now();
  std::unique_ptr<ProgressReporter> progress =
      Progress("e2e: generate model", args.model_bytes, "B");
  REFIT_ASSIGN_OR_RETURN(SyntheticModel model, SyntheticModel::Make(args.model_bytes, args.seed,
                                                                    args.threads, progress.get()));
  if (progress) progress->Finish();
  out["model_bytes"] = model.bytes();
  out["tensors"] = model.views().size();
  out["generate_s"] = Now() - t0;
  t0 = Now();
  REFIT_RETURN_NOT_OK(
      WriteSafetensors(model_path, model.views(), {{cli::kWeightVersionMetadataKey, "0"}}));
  out["write_s"] = Now() - t0;
  REFIT_ASSIGN_OR_RETURN(Fleet fleet,
                         StartFleet(args, work_dir, model_path, kEndToEndReceivers, model.views()));
  // Loaded (read into memory, or mapped: the open mapping keeps the file's pages): the path can
  // go, and with it the page cache a RAM-loading daemon no longer needs.
  std::filesystem::remove(model_path);
  out["daemon_start_s"] = fleet.start_s;
  out["receiver_mode"] = args.receiver_mmap ? "mmap" : "ram";

  progress = Progress("e2e: refits", 1 + args.densities.size(), "refits");
  // The deltas run first, in ascending density, and the FULL last: a FULL's undo log holds the
  // old bits of the whole model until commit, and the allocator keeps much of that memory after
  // freeing it, which would hide the deltas' O(changes) memory inside the peak RSS. Ascending
  // densities likewise keep each delta's memory above what the previous one left behind.
  std::vector<double> densities = args.densities;
  std::sort(densities.begin(), densities.end());
  std::vector<RefitRow> rows(1);
  for (size_t k = 0; k < densities.size(); ++k) {
    const uint64_t changed = model.Step(/*step=*/k + 1, densities[k]);
    REFIT_ASSIGN_OR_RETURN(RefitRow row, MeasureRefit(fleet, /*full=*/false));
    row.target_density = densities[k];
    row.changed_by_step = changed;
    if (row.report.changed_elements != changed) {
      return DataLoss("step {} changed {} elements but the tracker found {}", k + 1, changed,
                      row.report.changed_elements);
    }
    rows.push_back(std::move(row));
    if (progress) progress->Advance(1);
  }
  // The yardstick: every element of the same model through the same fleet.
  REFIT_ASSIGN_OR_RETURN(rows.front(), MeasureRefit(fleet, /*full=*/true));
  const RefitRow& full = rows.front();
  if (progress) progress->Finish();
  if (args.verify_end_to_end) {
    t0 = Now();
    REFIT_RETURN_NOT_OK(VerifyFleet(*fleet.coordinator, model.views()));
    out["verify_s"] = Now() - t0;
  }
  out["verified_bit_identical"] = args.verify_end_to_end;
  REFIT_RETURN_NOT_OK(fleet.daemons->Stop());

  out["rows"] = nlohmann::json::array();
  for (const RefitRow& row : rows) out["rows"].push_back(RowJson(row, full, model.bytes()));
  // The target row: the density closest to kTargetDensity, if one was measured close enough.
  const nlohmann::json* target_row = nullptr;
  for (const nlohmann::json& row : out["rows"]) {
    if (row["kind"] == "delta" &&
        std::fabs(row["target_density"].get<double>() - kTargetDensity) < 1e-9) {
      target_row = &row;
    }
  }
  // Memory beyond what each process must hold, against the changes of each delta.
  std::vector<std::pair<double, double>> producer_points, receiver_points;
  for (const nlohmann::json& row : out["rows"]) {
    if (row["kind"] != "delta") continue;
    const double changed = static_cast<double>(row["changed"].get<uint64_t>());
    producer_points.emplace_back(
        changed, static_cast<double>(row["producer_over_held_bytes"].get<int64_t>()));
    receiver_points.emplace_back(
        changed, static_cast<double>(row["receiver_over_model_bytes"].get<int64_t>()));
  }
  for (const auto& [name, points] :
       {std::pair{"producer", &producer_points}, std::pair{"receiver", &receiver_points}}) {
    if (std::optional<MemoryFit> fit = FitMemory(*points)) {
      out["memory_fit"][name] = {{"fixed_bytes", fit->fixed_bytes},
                                 {"bytes_per_changed", fit->bytes_per_changed}};
    }
  }
  out["target"] = {{"density", kTargetDensity}, {"min_speedup_vs_full", kTargetSpeedup}};
  if (target_row != nullptr) {
    const double speedup = (*target_row)["speedup_vs_full"];
    out["target"]["speedup_vs_full"] = speedup;
    out["target"]["met"] = speedup >= kTargetSpeedup;
  } else {
    out["target"]["met"] = nullptr;
  }
  return out;
}

void PrintEndToEnd(const nlohmann::json& e2e, const Args& args) {
  const uint64_t model_bytes = e2e["model_bytes"];
  std::cout << fmt::format(
      "== end to end: bf16 model {} ({} tensors), 1 producer -> {} `refit serve` daemon "
      "({} load) on loopback, zmq:// + HTTP control; chunks {}, buckets {}, {} threads/stage\n",
      FormatBytes(model_bytes), e2e["tensors"].get<size_t>(), kEndToEndReceivers,
      e2e["receiver_mode"].get<std::string>(), FormatBytes(args.chunk_bytes),
      FormatBytes(args.bucket_bytes), args.threads);
  Table table({"kind", "density", "changed", "payloads", "wire", "wire/full", "time", "stream",
               "flush", "commit", "speedup", "prod peak", "prod over", "recv peak", "recv over"});
  for (const nlohmann::json& row : e2e["rows"]) {
    const bool full = row["kind"] == "full";
    table.AddRow(
        {full ? "FULL" : "delta",
         full ? "-" : fmt::format("{:.3f}%", 100 * row["density"].get<double>()),
         std::to_string(row["changed"].get<uint64_t>()),
         std::to_string(row["payloads"].get<uint64_t>()), FormatBytes(row["wire_bytes"]),
         fmt::format("{:.4f}", row["wire_over_full"].get<double>()), FormatDuration(row["time_s"]),
         FormatDuration(row["stream_s"]), FormatDuration(row["flush_s"]),
         FormatDuration(row["commit_s"]),
         fmt::format("{:.1f}x", row["speedup_vs_full"].get<double>()),
         FormatBytes(row["producer_peak_rss"]), SignedBytes(row["producer_over_held_bytes"]),
         FormatBytes(row["receiver_peak_rss"]), SignedBytes(row["receiver_over_model_bytes"])});
  }
  table.Print(std::cout);
  const nlohmann::json& target = e2e["target"];
  if (target["met"].is_null()) {
    std::cout << fmt::format(
        "target: delta at {:.0f}% >= {:.0f}x faster than FULL: not measured "
        "(no {:.0f}% row in --densities)\n",
        100 * kTargetDensity, kTargetSpeedup, 100 * kTargetDensity);
  } else {
    std::cout << fmt::format(
        "target: delta at {:.0f}% >= {:.0f}x faster than FULL: {:.1f}x measured -> {}\n",
        100 * kTargetDensity, kTargetSpeedup, target["speedup_vs_full"].get<double>(),
        target["met"].get<bool>() ? "MET" : "NOT MET");
  }
  std::cout << "prod over = producer peak RSS - (model + tracker baseline); recv over = receiver "
               "peak RSS - model. Peaks are per refit (VmHWM reset before each).\n";
  if (e2e.contains("memory_fit")) {
    // "+ 64.0 MiB" or "- 64.0 MiB": a term of the fitted line.
    const auto term = [](const nlohmann::json& fit) {
      const double fixed = fit["fixed_bytes"];
      return fmt::format("{} {} + {:.1f} B per changed element", fixed < 0 ? "-" : "+",
                         FormatBytes(static_cast<uint64_t>(std::fabs(fixed))),
                         fit["bytes_per_changed"].get<double>());
    };
    std::cout << fmt::format(
        "memory over the deltas (least squares): producer = model + baseline {}; receiver = "
        "model {}\n",
        term(e2e["memory_fit"]["producer"]), term(e2e["memory_fit"]["receiver"]));
  }
  std::cout << fmt::format(
      "model generated in {}, written in {}, daemon loaded it in {}{}\n\n",
      FormatDuration(e2e["generate_s"]), FormatDuration(e2e["write_s"]),
      FormatDuration(e2e["daemon_start_s"]),
      e2e.contains("verify_s")
          ? fmt::format("; every tensor downloaded and compared in {}: bit-identical",
                        FormatDuration(e2e["verify_s"]))
          : "");
}

// --- Fan-out ----------------------------------------------------------------------------------

Result<nlohmann::json> RunFanOut(const Args& args, const std::string& work_dir) {
  nlohmann::json out;
  out["density"] = args.fanout_density;
  out["rows"] = nlohmann::json::array();
  const std::string model_path = work_dir + "/fanout-model.safetensors";
  std::unique_ptr<ProgressReporter> progress = Progress("fan-out", args.fanout.size(), "fleets");
  for (size_t receivers : args.fanout) {
    // The same model and the same step for every fleet size: the producer's payloads are a
    // function of its inputs, so its wire bytes must come out identical.
    REFIT_ASSIGN_OR_RETURN(
        SyntheticModel model,
        SyntheticModel::Make(args.fanout_model_bytes, args.seed, args.threads, nullptr));
    out["model_bytes"] = model.bytes();
    out["tensors"] = model.views().size();
    REFIT_RETURN_NOT_OK(
        WriteSafetensors(model_path, model.views(), {{cli::kWeightVersionMetadataKey, "0"}}));
    REFIT_ASSIGN_OR_RETURN(Fleet fleet,
                           StartFleet(args, work_dir, model_path, receivers, model.views()));
    std::filesystem::remove(model_path);
    // Delta first, FULL second, for the reason RunEndToEnd gives.
    const uint64_t changed = model.Step(/*step=*/1, args.fanout_density);
    REFIT_ASSIGN_OR_RETURN(RefitRow delta, MeasureRefit(fleet, /*full=*/false));
    if (delta.report.changed_elements != changed) {
      return DataLoss("fan-out x{}: the step changed {} elements but the tracker found {}",
                      receivers, changed, delta.report.changed_elements);
    }
    REFIT_ASSIGN_OR_RETURN(RefitRow full, MeasureRefit(fleet, /*full=*/true));
    const double t0 = Now();
    REFIT_RETURN_NOT_OK(VerifyFleet(*fleet.coordinator, model.views()));
    const double verify_s = Now() - t0;
    REFIT_RETURN_NOT_OK(fleet.daemons->Stop());
    out["rows"].push_back(
        {{"receivers", receivers},
         {"daemon_start_s", fleet.start_s},
         {"full_wire_bytes", full.report.wire_bytes},
         {"full_payloads", full.report.payloads},
         {"full_time_s", full.report.total_s},
         {"full_flush_s", full.report.flush_s},
         {"delta_density", Density(delta.report)},
         {"delta_changed", delta.report.changed_elements},
         {"delta_payloads", delta.report.payloads},
         {"delta_wire_bytes", delta.report.wire_bytes},
         {"delta_time_s", delta.report.total_s},
         {"delta_stream_s", delta.report.stream_s},
         {"delta_flush_s", delta.report.flush_s},
         {"delta_commit_s", delta.report.commit_s},
         {"delta_speedup_vs_full", full.report.total_s / std::max(delta.report.total_s, 1e-9)},
         {"receiver_peak_rss_full", full.rss.receiver_peak},
         {"receiver_peak_rss_delta", delta.rss.receiver_peak},
         {"verify_s", verify_s},
         {"verified_bit_identical", true}});
    if (progress) progress->Advance(1);
  }
  if (progress) progress->Finish();
  // Bytes out of the producer must not depend on the fleet size.
  bool constant = true;
  for (const nlohmann::json& row : out["rows"]) {
    constant = constant && row["full_wire_bytes"] == out["rows"][0]["full_wire_bytes"] &&
               row["delta_wire_bytes"] == out["rows"][0]["delta_wire_bytes"];
  }
  out["producer_wire_constant_in_receivers"] = constant;
  return out;
}

void PrintFanOut(const nlohmann::json& fanout) {
  std::cout << fmt::format(
      "== fan-out: bf16 model {} ({} tensors), 1 producer -> N daemons through the zmq:// "
      "relay tree, one {:.0f}% delta and a FULL\n",
      FormatBytes(fanout["model_bytes"]), fanout["tensors"].get<size_t>(),
      100 * fanout["density"].get<double>());
  Table table({"receivers", "full wire", "full time", "density", "delta wire", "delta time",
               "flush", "speedup", "delta vs N=1", "recv peak", "verified"});
  const double first_delta_s = fanout["rows"][0]["delta_time_s"];
  for (const nlohmann::json& row : fanout["rows"]) {
    table.AddRow({std::to_string(row["receivers"].get<size_t>()),
                  FormatBytes(row["full_wire_bytes"]), FormatDuration(row["full_time_s"]),
                  fmt::format("{:.3f}%", 100 * row["delta_density"].get<double>()),
                  FormatBytes(row["delta_wire_bytes"]), FormatDuration(row["delta_time_s"]),
                  FormatDuration(row["delta_flush_s"]),
                  fmt::format("{:.1f}x", row["delta_speedup_vs_full"].get<double>()),
                  fmt::format("{:.2f}x", row["delta_time_s"].get<double>() / first_delta_s),
                  FormatBytes(row["receiver_peak_rss_delta"]),
                  fmt::format("ok x{}", row["receivers"].get<size_t>())});
  }
  table.Print(std::cout);
  std::cout << fmt::format(
      "producer wire bytes constant in N (each payload sent once, to the root relay): {}\n"
      "verified: every tensor downloaded from every daemon equals the producer's bytes, and "
      "every daemon's state fingerprint equals the producer's\n\n",
      fanout["producer_wire_constant_in_receivers"].get<bool>() ? "yes" : "NO");
}

// --- Main -------------------------------------------------------------------------------------

Status Run(const Args& args) {
  // One model file at a time is on disk. Memory, at the FULL refit: this process holds the model
  // and the tracker's baseline; each daemon its copy (read into memory, or every page written
  // copy-on-write by the FULL) and the FULL's undo log, the old bits of every element until
  // commit.
  const uint64_t e2e_bytes = args.skip_end_to_end ? 0 : args.model_bytes;
  const uint64_t largest_fanout =
      args.fanout.empty() ? 0 : *std::max_element(args.fanout.begin(), args.fanout.end());
  const uint64_t fanout_bytes = args.skip_fanout ? 0 : args.fanout_model_bytes;
  const uint64_t memory = kMemoryMarginBytes + std::max((2 + 2 * kEndToEndReceivers) * e2e_bytes,
                                                        (2 + 2 * largest_fanout) * fanout_bytes);
  const std::string temp_dir = std::filesystem::temp_directory_path().string();
  REFIT_RETURN_NOT_OK(CheckRoom(args.work_dir.empty() ? temp_dir : args.work_dir,
                                std::max(e2e_bytes, fanout_bytes) + kDiskMarginBytes, memory,
                                "the model and the tracker's baseline in this process; per daemon "
                                "its model and, during the FULL, an undo log as large",
                                "use a smaller --model-mib or --fanout-model-mib"));
  std::string work_dir = args.work_dir;
  bool scratch = false;
  if (work_dir.empty()) {
    REFIT_ASSIGN_OR_RETURN(work_dir, cli::MakeTemporaryDirectory("refit-e2e-bench"));
    scratch = true;
  }
  ::setenv(kApiKeyEnv, cli::GenerateApiKey().c_str(), /*overwrite=*/1);

  nlohmann::json report;
  report["machine"] = {{"hardware_threads", std::thread::hardware_concurrency()}};
  report["config"] = {{"quick", args.quick},
                      {"chunk_bytes", args.chunk_bytes},
                      {"bucket_bytes", args.bucket_bytes},
                      {"threads_per_stage", args.threads},
                      {"receiver_mode", args.receiver_mmap ? "mmap" : "ram"},
                      {"transport", "zmq:// (loopback) + HTTP control"},
                      {"seed", args.seed}};
  if (!args.skip_end_to_end) {
    Result<nlohmann::json> e2e = RunEndToEnd(args, work_dir);
    if (!e2e.ok()) return e2e.status().WithContext("end to end (work dir " + work_dir + ")");
    report["end_to_end"] = *e2e;
    if (!args.json) PrintEndToEnd(*e2e, args);
  }
  if (!args.skip_fanout && !args.fanout.empty()) {
    Result<nlohmann::json> fanout = RunFanOut(args, work_dir);
    if (!fanout.ok()) return fanout.status().WithContext("fan-out (work dir " + work_dir + ")");
    report["fan_out"] = *fanout;
    if (!args.json) PrintFanOut(*fanout);
  }
  if (args.json) std::cout << report.dump(2) << "\n";
  if (!args.json_out.empty()) {
    std::ofstream file(args.json_out);
    file << report.dump(2) << "\n";
    if (!file) return IoError("cannot write the JSON report to {}", args.json_out);
  }
  if (scratch) std::filesystem::remove_all(work_dir);
  return Status::OK();
}

int Main(int argc, char** argv) {
  Result<Args> args = ParseArgs(argc, argv);
  if (!args.ok()) {
    std::cerr << "e2e_bench: " << args.status().message() << "\n" << kUsage;
    return 2;
  }
  Status status = Run(*args);
  if (!status.ok()) {
    std::cerr << "e2e_bench: " << status.ToString() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) { return refit::bench::Main(argc, argv); }
