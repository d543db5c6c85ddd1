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
//   producers   W = 1, 2, 4 trainer ranks (--producers) refit the same daemons with the same
//               delta steps, once as W Publisher threads of this process (in-process group) and
//               once as W `refit push --group tcp://…` processes; time per refit, wire bytes and
//               processes / threads per W.
//   tp          one replica unsharded, then as a tensor-parallel shard group of TP = 2, 4 (--tp)
//               `refit serve --loader … --replica …` daemons, each holding only its shard of a
//               Llama-layout model (fused qkv and gate_up, column-sharded o/down, vocabulary-
//               parallel embedding and lm_head); the same steps; time per refit against the
//               unsharded one, and each shard's peak memory against its slice.
//   embedded    a ReceiverNode embedded in a process of its own (this executable, re-executed)
//               over buffers that process allocated and registered (no model file): its RSS
//               after registering, during each delta and after commit.
//
// The model is not trained by the Adam simulator (14 bytes per element: a 4 GiB bf16 model would
// need 30 GiB); it is drawn cheaply with a realistic value distribution and stepped by 1-ulp
// moves, see SyntheticModel. Prints a table per section, or with --json one JSON document with
// every figure. See docs/benchmarking.md.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
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
#include "config_file.h"
#include "fleet_coordinator.h"
#include "local_fleet.h"
#include "progress.h"
#include "raw_copy.h"
#include "refit/apply.h"
#include "refit/compare.h"
#include "refit/control_client.h"
#include "refit/digest.h"
#include "refit/environment.h"
#include "refit/half_float.h"
#include "refit/producer_group.h"
#include "refit/producer_stream.h"
#include "refit/publisher.h"
#include "refit/receiver_node.h"
#include "refit/safetensors.h"
#include "refit/simulator.h"
#include "refit/status_format.h"
#include "role_options.h"
#include "table.h"
#include "util/splitmix64.h"
#include "util/thread_pool.h"

#ifndef REFIT_BINARY
#error "REFIT_BINARY must name the refit executable (set by bench/CMakeLists.txt)"
#endif

namespace refit::bench {
namespace {

// bf16 bytes are written through uint16_t pointers: safetensors and the wire are little-endian.
static_assert(std::endian::native == std::endian::little);

constexpr uint64_t kMiB = uint64_t{1} << 20;
// The density whose speedup the target is stated at, and the target itself (the issue's figure).
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
// The new sections (producers, tp, embedded) split their model into about this many export
// chunks, so that W = 4 ranks each own several and the pipeline overlaps chunks; the chunk target
// is clamped to [kMinSectionChunkBytes, kMaxSectionChunkBytes] (the latter the end-to-end
// section's default).
constexpr uint64_t kSectionChunksPerModel = 32;
constexpr uint64_t kMinSectionChunkBytes = 1 * kMiB;
constexpr uint64_t kMaxSectionChunkBytes = 64 * kMiB;
// The producers section's processes and the tp section's daemons: how long one may take to start
// (load its model, bind its ports), and to exit after SIGTERM (serve waits for in-flight HTTP
// requests and idle keep-alive connections, about a second).
constexpr auto kChildStartTimeout = std::chrono::minutes(5);
constexpr auto kChildStopGrace = std::chrono::seconds(15);
// The budget of one `refit push` rank process, start to exit, and of one Sync.
constexpr auto kPushTimeout = std::chrono::minutes(10);
// The TP target: a TP = 4 replica's refit time within this factor of an unsharded one's (the
// issue's figure), and the TP degree it is stated at.
constexpr double kTargetTpSlowdown = 1.3;
constexpr uint32_t kTargetTp = 4;
// The routing target: the bytes a TP = 4 shard receives, within this fraction of what an
// unsharded receiver receives for the same delta.
constexpr double kTargetTpReceived = 0.3;
// The replica name of the tp section's shard group.
constexpr const char* kTpReplica = "replica-0";
// Attention head width the tp section's loader assumes (Llama's 128 at full size; the bench's
// small models use 64, halved until the heads divide among every TP degree asked for).
constexpr uint64_t kHeadDim = 64;
// Vocabulary padding multiple per TP rank of the vocabulary-parallel rule (Megatron / vLLM).
constexpr uint64_t kVocabPadTo = 64;
// argv[1] of this executable re-executed as the embedded section's receiver process, or as one
// rank of the producers section's persistent rank processes.
constexpr std::string_view kEmbeddedChildFlag = "--internal-embedded-receiver";
constexpr std::string_view kProducerRankFlag = "--internal-producer-rank";
// Targets of the throughput figures (the issue's table), each printed MET or NOT MET.
constexpr double kTargetFullOverRaw = 1.3;
constexpr double kTargetDeltaOverRaw = 0.5;
constexpr double kTargetReceiverBytesPerChanged = 2.0;
constexpr double kTargetProducerBytesPerChanged = 12.0;
constexpr double kTargetFullPeakOverModel = 1.1;
constexpr double kTargetCommitShare = 0.05;
constexpr double kTargetDeltaOverCompare = 2.0;
// Elements the compare-only pass compares at a time: its locations go into one reused buffer of
// this many, so that the pass allocates nothing the refit's memory figures would then carry.
constexpr uint64_t kCompareOnlyBlock = uint64_t{1} << 20;

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
  // The daemons' anchor undo policy and the producer's anchor compression.
  AnchorUndo anchor_undo = AnchorUndo::kMemory;
  AnchorCompression anchor_compression = ProducerStreamOptions{}.anchor_compression;
  // The daemons' threads per payload (`refit serve --apply-threads`).
  int apply_threads = ReceiverSessionOptions{}.apply_threads;
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
};

constexpr std::string_view kUsage =
    "usage: e2e_bench [--quick] [--json] [--json-out PATH] [--model-mib N]\n"
    "                 [--densities D,D,...] [--fanout N,N,...] [--fanout-model-mib N]\n"
    "                 [--fanout-density D] [--chunk-mib N] [--bucket-mib N] [--threads N]\n"
    "                 [--mmap] [--no-verify] [--skip-end-to-end] [--skip-fanout]\n"
    "                 [--anchor-undo memory|file|none] [--anchor-compression auto|zstd|none]\n"
    "                 [--apply-threads N]\n"
    "                 [--no-raw-copy]\n"
    "                 [--sections S,S,...] [--producers W,W,...] [--producers-model-mib N]\n"
    "                 [--producers-receivers N] [--tp T,T,...] [--tp-model-mib N]\n"
    "                 [--embedded-model-mib N] [--steps N] [--step-density D]\n"
    "                 [--skip-producers] [--skip-tp] [--skip-embedded]\n"
    "                 [--work-dir DIR] [--refit-binary PATH] [--seed N]\n"
    "sections: end-to-end, fan-out, producers, tp, embedded (default: all)\n";

// The names --sections takes.
constexpr std::array<std::string_view, 5> kSectionNames = {"end-to-end", "fan-out", "producers",
                                                           "tp", "embedded"};

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

Result<Args> ParseArgs(int argc, char** argv) {
  Args args;
  std::optional<uint64_t> model_mib, fanout_model_mib, chunk_mib, producers_model_mib, tp_model_mib,
      embedded_model_mib, steps;
  std::optional<std::vector<size_t>> fanout;
  std::optional<std::vector<std::string_view>> sections;
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
    } else if (flag == "--anchor-undo") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(args.anchor_undo, ParseAnchorUndo(text));
    } else if (flag == "--apply-threads") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(const uint64_t threads, ParseUnsigned(flag, text));
      if (threads < 1 || threads > static_cast<uint64_t>(ReceiverSession::kMaxApplyThreads)) {
        return InvalidArgument("--apply-threads {} is outside [1, {}]", threads,
                               ReceiverSession::kMaxApplyThreads);
      }
      args.apply_threads = static_cast<int>(threads);
    } else if (flag == "--anchor-compression") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(args.anchor_compression, ParseAnchorCompression(text));
    } else if (flag == "--no-raw-copy") {
      args.raw_copy = false;
    } else if (flag == "--skip-end-to-end") {
      args.skip_end_to_end = true;
    } else if (flag == "--skip-fanout") {
      args.skip_fanout = true;
    } else if (flag == "--skip-producers") {
      args.skip_producers = true;
    } else if (flag == "--skip-tp") {
      args.skip_tp = true;
    } else if (flag == "--skip-embedded") {
      args.skip_embedded = true;
    } else if (flag == "--sections") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      sections = SplitCommas(text);
      for (std::string_view name : *sections) {
        if (std::find(kSectionNames.begin(), kSectionNames.end(), name) == kSectionNames.end()) {
          return InvalidArgument("--sections: unknown section '{}' (known: {})", name,
                                 fmt::join(kSectionNames, ", "));
        }
      }
    } else if (flag == "--producers") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(args.producers, ParseCounts(flag, text));
    } else if (flag == "--producers-model-mib") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(producers_model_mib, ParseUnsigned(flag, text));
    } else if (flag == "--producers-receivers") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(args.producers_receivers, ParseUnsigned(flag, text));
    } else if (flag == "--tp") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(args.tp, ParseCounts(flag, text));
    } else if (flag == "--tp-model-mib") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(tp_model_mib, ParseUnsigned(flag, text));
    } else if (flag == "--embedded-model-mib") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(embedded_model_mib, ParseUnsigned(flag, text));
    } else if (flag == "--steps") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(steps, ParseUnsigned(flag, text));
    } else if (flag == "--step-density") {
      REFIT_ASSIGN_OR_RETURN(std::string_view text, value());
      REFIT_ASSIGN_OR_RETURN(args.step_density, ParseDensity(flag, text, /*allow_one=*/true));
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
    args.producers_model_bytes = 32 * kMiB;
    args.tp_model_bytes = 64 * kMiB;
    args.embedded_model_bytes = 64 * kMiB;
    args.steps = 3;
  }
  if (model_mib) args.model_bytes = *model_mib * kMiB;
  if (fanout_model_mib) args.fanout_model_bytes = *fanout_model_mib * kMiB;
  if (chunk_mib) args.chunk_bytes = *chunk_mib * kMiB;
  if (fanout) args.fanout = *fanout;
  if (producers_model_mib) args.producers_model_bytes = *producers_model_mib * kMiB;
  if (tp_model_mib) args.tp_model_bytes = *tp_model_mib * kMiB;
  if (embedded_model_mib) args.embedded_model_bytes = *embedded_model_mib * kMiB;
  if (steps) args.steps = *steps;
  if (sections) {
    const auto listed = [&](std::string_view name) {
      return std::find(sections->begin(), sections->end(), name) != sections->end();
    };
    args.skip_end_to_end = args.skip_end_to_end || !listed("end-to-end");
    args.skip_fanout = args.skip_fanout || !listed("fan-out");
    args.skip_producers = args.skip_producers || !listed("producers");
    args.skip_tp = args.skip_tp || !listed("tp");
    args.skip_embedded = args.skip_embedded || !listed("embedded");
  }
  if (args.model_bytes == 0 || args.fanout_model_bytes == 0 || args.producers_model_bytes == 0 ||
      args.tp_model_bytes == 0 || args.embedded_model_bytes == 0) {
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
        out[i] = FloatToBFloat16(mean + stddev * z);
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
      for (double position = std::floor(std::log(OpenUnit(rng.Next())) / log_keep); position < n;
           position += 1 + std::floor(std::log(OpenUnit(rng.Next())) / log_keep)) {
        const uint64_t i = static_cast<uint64_t>(position);
        bits[i] = NudgeOneUlp(bits[i], (rng.Next() & 1) != 0);
        ++count;
      }
      changed += count;
    });
    return changed.load();
  }

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
  fleet_options.extra_args.push_back("--anchor-undo");
  fleet_options.extra_args.push_back(std::string(AnchorUndoName(args.anchor_undo)));
  fleet_options.extra_args.push_back("--apply-threads");
  fleet_options.extra_args.push_back(std::to_string(args.apply_threads));
  const double t0 = Now();
  REFIT_ASSIGN_OR_RETURN(fleet.daemons, cli::LocalFleet::Start(fleet_options));
  fleet.start_s = Now() - t0;

  cli::FleetAddress address;
  for (const cli::LocalReceiver& receiver : fleet.daemons->receivers()) {
    address.control_urls.push_back(receiver.control_url);
    address.data_endpoints.push_back(receiver.data_endpoint);
  }
  address.transport_uri = fmt::format("zmq://?api_key_env={}", kApiKeyEnv);
  REFIT_ASSIGN_OR_RETURN(address.api_key,
                         SecretFromEnvironment(kApiKeyEnv, "the bench fleet's key"));
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
  options.stream.anchor_compression = args.anchor_compression;
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

// The raw-copy yardstick (below, after the child-process flags it uses).
Result<nlohmann::json> MeasureRawCopy(const Args& args, const std::string& work_dir,
                                      const std::vector<TensorView>& model);

// --- End to end -------------------------------------------------------------------------------

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
};

// The compare alone: every tensor of `model` against the producer's baseline, bit by bit, with
// the changed indices extracted (AppendChangedLocations, what the tracker's compare does) on as
// many threads as the producer encodes with, one tensor at a time per thread — what a delta
// refit cannot do without. Only with one producer, whose tracker holds every tensor (zero
// otherwise: not measured).
Result<double> MeasureCompareOnly(const Fleet& fleet, const std::vector<TensorView>& model,
                                  int threads) {
  const auto& trackers = fleet.coordinator->trackers();
  if (trackers.size() != 1) return 0.0;
  const DeltaTracker& tracker = *trackers.front();
  std::vector<TensorView> baselines;
  for (const TensorView& tensor : model) {
    REFIT_ASSIGN_OR_RETURN(TensorView baseline, tracker.Baseline(tensor.name));
    baselines.push_back(baseline);
  }
  std::atomic<uint64_t> changed{0};
  const double t0 = Now();
  REFIT_RETURN_NOT_OK(
      internal::ParallelFor(threads, model.size(), [&](uint64_t begin, uint64_t end) -> Status {
        std::vector<uint64_t> locations;
        locations.reserve(kCompareOnlyBlock);
        uint64_t found = 0;
        for (uint64_t t = begin; t < end; ++t) {
          const uint32_t width = DTypeSize(model[t].dtype);
          const uint64_t numel = model[t].bytes.size() / width;
          for (uint64_t b = 0; b < numel; b += kCompareOnlyBlock) {
            locations.clear();
            AppendChangedLocations(baselines[t].bytes, model[t].bytes, width, b,
                                   std::min(numel, b + kCompareOnlyBlock), &locations);
            found += locations.size();
          }
        }
        changed += found;
        return Status::OK();
      }));
  const double seconds = Now() - t0;
  // The compare must see the step's changes, or it measured nothing.
  if (changed.load() == 0) return Internal("the compare-only pass found no change");
  return seconds;
}

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
      {"compare_only_s", row.compare_only_s > 0 ? nlohmann::json(row.compare_only_s) : nullptr},
      {"time_over_compare_only",
       row.compare_only_s > 0 ? nlohmann::json(r.total_s / row.compare_only_s) : nullptr},
      {"producer_stages",
       {{"source_s", s.timings.source_s},
        {"dispatch_wait_s", s.timings.dispatch_wait_s},
        {"encode_s", s.timings.encode_s},
        {"serialize_s", s.timings.serialize_s},
        {"send_s", s.timings.send_s},
        {"wall_s", s.timings.wall_s},
        {"peak_chunks_in_flight", s.peak_chunks_in_flight},
        {"peak_payloads_in_flight", s.peak_payloads_in_flight}}},
      {"anchor_compression",
       {{"compressed_payloads", s.anchor_compression.compressed_payloads},
        {"raw_payloads", s.anchor_compression.raw_payloads},
        {"measured", s.anchor_compression.measured},
        {"compress_bytes_per_s", s.anchor_compression.compress_bytes_per_s},
        {"ratio", s.anchor_compression.ratio},
        {"link_bytes_per_s", s.anchor_compression.link_bytes_per_s}}},
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

// One figure against its target: {figure, value, target, met} (value null: not measured).
nlohmann::json TargetFigure(std::string figure, std::optional<double> value, double target,
                            std::string note = "") {
  return {{"figure", std::move(figure)},
          {"value", value ? nlohmann::json(*value) : nullptr},
          {"target", target},
          {"met", value ? nlohmann::json(*value <= target) : nullptr},
          {"note", std::move(note)}};
}

// The issue's throughput targets that the end-to-end section measures, each a ratio or a slope
// of one run: every one printed MET or NOT MET, never adjusted.
nlohmann::json ThroughputTargets(const nlohmann::json& e2e, const nlohmann::json* target_row,
                                 uint64_t model_bytes) {
  const nlohmann::json* full = nullptr;
  for (const nlohmann::json& row : e2e["rows"]) {
    if (row["kind"] == "full") full = &row;
  }
  const auto ratio = [](const nlohmann::json* row, std::string_view key) {
    return row != nullptr && !(*row)[key].is_null() ? std::optional<double>((*row)[key])
                                                    : std::nullopt;
  };
  const auto slope = [&](std::string_view who) -> std::optional<double> {
    if (!e2e.contains("memory_fit") || !e2e["memory_fit"].contains(who)) return std::nullopt;
    return e2e["memory_fit"][who]["bytes_per_changed"].get<double>();
  };
  nlohmann::json targets = nlohmann::json::array();
  targets.push_back(TargetFigure("FULL time / raw-copy time", ratio(full, "time_over_raw_copy"),
                                 kTargetFullOverRaw));
  targets.push_back(TargetFigure("3% delta time / raw-copy time",
                                 ratio(target_row, "time_over_raw_copy"), kTargetDeltaOverRaw));
  targets.push_back(TargetFigure("3% delta time / compare-only time (same model, threads)",
                                 ratio(target_row, "time_over_compare_only"),
                                 kTargetDeltaOverCompare));
  targets.push_back(TargetFigure("receiver bytes per changed element (XOR deltas)",
                                 slope("receiver"), kTargetReceiverBytesPerChanged));
  targets.push_back(TargetFigure("producer bytes per changed element over model + baseline",
                                 slope("producer"), kTargetProducerBytesPerChanged));
  std::optional<double> full_peak;
  if (full != nullptr) {
    full_peak = (*full)["receiver_peak_rss"].get<double>() / static_cast<double>(model_bytes);
  }
  const std::string undo = e2e["anchor_undo"];
  targets.push_back(TargetFigure(
      "receiver peak during a FULL / model", full_peak, kTargetFullPeakOverModel,
      undo == "none" ? "anchor_undo none" : "anchor_undo " + undo + " (the target is for none)"));
  std::optional<double> commit_share;
  if (target_row != nullptr) {
    commit_share = (*target_row)["commit_s"].get<double>() / (*target_row)["time_s"].get<double>();
  }
  targets.push_back(
      TargetFigure("commit phase / delta time at 3%", commit_share, kTargetCommitShare));
  return targets;
}

void PrintTargets(const nlohmann::json& targets) {
  Table table({"figure", "measured", "target", "result"});
  for (const nlohmann::json& t : targets) {
    const bool measured = !t["value"].is_null();
    table.AddRow(
        {t["figure"].get<std::string>() + (t["note"].get<std::string>().empty()
                                               ? ""
                                               : " (" + t["note"].get<std::string>() + ")"),
         measured ? fmt::format("{:.3f}", t["value"].get<double>()) : "-",
         fmt::format("<= {:.2f}", t["target"].get<double>()),
         measured ? (t["met"].get<bool>() ? "MET" : "NOT MET") : "not measured"});
  }
  table.Print(std::cout);
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
      WriteSafetensors(model_path, model.views(), {{kWeightVersionMetadataKey, "0"}}));
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
    REFIT_ASSIGN_OR_RETURN(const double compare_only_s,
                           MeasureCompareOnly(fleet, model.views(), args.threads));
    REFIT_ASSIGN_OR_RETURN(RefitRow row, MeasureRefit(fleet, /*full=*/false));
    row.compare_only_s = compare_only_s;
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
  out["anchor_undo"] = std::string(AnchorUndoName(args.anchor_undo));
  out["receiver_apply_threads"] = args.apply_threads;
  out["anchor_compression"] = std::string(AnchorCompressionName(args.anchor_compression));
  // The yardstick, after the daemon is gone (its memory with it): the same bytes, the same
  // loopback and send threads, nothing but the copy.
  double raw_s = 0;
  if (args.raw_copy) {
    REFIT_ASSIGN_OR_RETURN(out["raw_copy"], MeasureRawCopy(args, work_dir, model.views()));
    raw_s = out["raw_copy"]["seconds"];
  }

  out["rows"] = nlohmann::json::array();
  for (const RefitRow& row : rows) {
    nlohmann::json json = RowJson(row, full, model.bytes());
    json["time_over_raw_copy"] = raw_s > 0 ? nlohmann::json(row.report.total_s / raw_s) : nullptr;
    out["rows"].push_back(std::move(json));
  }
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
  out["targets"] = ThroughputTargets(out, target_row, model.bytes());
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
               "flush", "commit", "speedup", "vs raw", "prod peak", "prod over", "recv peak",
               "recv over"});
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
         row["time_over_raw_copy"].is_null()
             ? std::string("-")
             : fmt::format("{:.2f}", row["time_over_raw_copy"].get<double>()),
         FormatBytes(row["producer_peak_rss"]), SignedBytes(row["producer_over_held_bytes"]),
         FormatBytes(row["receiver_peak_rss"]), SignedBytes(row["receiver_over_model_bytes"])});
  }
  table.Print(std::cout);
  if (e2e.contains("raw_copy")) {
    const nlohmann::json& raw = e2e["raw_copy"];
    std::cout << fmt::format(
        "raw copy (the yardstick): {} over ZeroMQ/TCP loopback into a `refit raw-copy-sink` "
        "process in {} "
        "({:.0f} MB/s), {} messages of at most {} from {} threads, no codec, digest or apply; "
        "checksum "
        "verified. vs raw = refit time / raw-copy time\n",
        FormatBytes(raw["bytes"]), FormatDuration(raw["seconds"]),
        raw["bytes_per_s"].get<double>() / 1e6, raw["messages"].get<uint64_t>(),
        FormatBytes(raw["message_bytes"]), raw["threads"].get<int>());
  }
  for (const nlohmann::json& row : e2e["rows"]) {
    if (row["kind"] != "full") continue;
    const nlohmann::json& c = row["anchor_compression"];
    std::cout << fmt::format(
        "FULL: anchor_compression {} -> {} payloads zstd, {} raw{}; receivers' anchor_undo {}, "
        "{} apply thread(s)\n",
        e2e["anchor_compression"].get<std::string>(), c["compressed_payloads"].get<uint64_t>(),
        c["raw_payloads"].get<uint64_t>(),
        c["measured"].get<bool>()
            ? fmt::format(" (measured: zstd {:.0f} MB/s to {:.3f} of the body, link {:.0f} MB/s)",
                          c["compress_bytes_per_s"].get<double>() / 1e6, c["ratio"].get<double>(),
                          c["link_bytes_per_s"].get<double>() / 1e6)
            : "",
        e2e["anchor_undo"].get<std::string>(), e2e["receiver_apply_threads"].get<int>());
  }
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
  std::cout << "throughput targets (one run; each figure a ratio or slope of this run):\n";
  PrintTargets(e2e["targets"]);
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
        WriteSafetensors(model_path, model.views(), {{kWeightVersionMetadataKey, "0"}}));
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

// --- Shared by the producers, tp and embedded sections ----------------------------------------

// The export chunk target of a new section's model: kSectionChunksPerModel chunks, clamped.
uint64_t SectionChunkBytes(uint64_t model_bytes) {
  return std::clamp(model_bytes / kSectionChunksPerModel, kMinSectionChunkBytes,
                    kMaxSectionChunkBytes);
}

// A refit configuration file (docs/configuration.md) with the bench's chunk, bucket and thread
// settings and the run's api key variable. The producers section hands it to `refit push
// --config` and reads it for its thread ranks, so that both run exactly the same options.
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
  REFIT_RETURN_NOT_OK(WriteTextFileAtomically(path, text));
  return path;
}

// The options every rank of a Publisher group gets from the configuration file, as `refit push
// --config` derives them.
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
  return options;
}

// W Publishers as threads of this process, over one in-process producer group.
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

// Every rank adopts `model` as what the receivers hold (they loaded it, or were refit to it).
Status AdoptBaseline(std::vector<std::unique_ptr<Publisher>>& ranks,
                     const std::vector<TensorView>& model) {
  for (std::unique_ptr<Publisher>& rank : ranks) REFIT_RETURN_NOT_OK(rank->AdoptBaseline(model));
  return Status::OK();
}

// One collective Sync of every rank (rank 0 on this thread, the others on one thread each) of
// `model`, which must be a delta; returns rank 0's report of the whole transfer.
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

// Download every tensor of `tensors` from the receiver at `control_url` and compare its bytes.
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

std::vector<TensorView> ViewsOf(const std::vector<OwnedTensor>& tensors) {
  std::vector<TensorView> views;
  for (const OwnedTensor& tensor : tensors) views.push_back(tensor.view());
  return views;
}

uint64_t BytesOf(const std::vector<TensorView>& tensors) {
  uint64_t bytes = 0;
  for (const TensorView& tensor : tensors) bytes += tensor.bytes.size();
  return bytes;
}

// The state fingerprint of `tensors` (refit/digest.h), computed from their bytes.
uint64_t FingerprintOf(const std::vector<TensorView>& tensors) {
  std::map<std::string, uint64_t> digests;
  for (const TensorView& tensor : tensors) digests[tensor.name] = TensorDigest(tensor);
  return StateFingerprint(digests);
}

// The flags of this executable re-executed as a child (argv[2…], as --name value pairs).
// Stops a child process (SIGTERM, then SIGKILL after kChildStopGrace) on every early return,
// unless `done` says it was waited for.
struct ChildGuard {
  pid_t pid;
  bool done = false;
  ~ChildGuard() {
    if (!done) TerminateProcess(pid, kChildStopGrace).status().IgnoreError();
  }
};

class ChildFlags {
 public:
  static Result<ChildFlags> Parse(int argc, char** argv, std::string_view mode) {
    ChildFlags flags;
    flags.mode_ = mode;
    for (int i = 2; i < argc; i += 2) {
      if (i + 1 >= argc) return InvalidArgument("{}: {} needs a value", mode, argv[i]);
      flags.values_[argv[i]] = argv[i + 1];
    }
    return flags;
  }
  Result<std::string> Text(std::string_view name) const {
    const auto found = values_.find(name);
    if (found == values_.end()) return InvalidArgument("{}: {} is required", mode_, name);
    return found->second;
  }
  Result<uint64_t> Number(std::string_view name) const {
    REFIT_ASSIGN_OR_RETURN(const std::string text, Text(name));
    return ParseUnsigned(name, text);
  }

 private:
  std::string mode_;
  std::map<std::string, std::string, std::less<>> values_;
};

// --- Raw-copy yardstick ------------------------------------------------------------------------

// The model's bytes, uncompressed, over ZeroMQ into another process on loopback, in messages of
// the bucket size from the same number of send threads as the refits: no codec, digest or apply.
Result<nlohmann::json> MeasureRawCopy(const Args& args, const std::string& work_dir,
                                      const std::vector<TensorView>& model) {
  cli::RawCopyOptions options;
  options.refit_binary = args.refit_binary;
  options.work_dir = work_dir;
  options.receivers = 1;
  options.message_bytes = args.bucket_bytes;
  options.threads = args.threads;
  REFIT_ASSIGN_OR_RETURN(const cli::RawCopyMeasurement copy,
                         cli::MeasureZmqRawCopy(model, options));
  return nlohmann::json{{"seconds", copy.seconds},
                        {"bytes", copy.bytes},
                        {"messages", copy.messages},
                        {"message_bytes", copy.message_bytes},
                        {"threads", copy.threads},
                        {"receivers", copy.receivers},
                        {"bytes_per_s", copy.bytes / std::max(copy.seconds, 1e-9)},
                        {"verified", true}};
}

// `refit serve` daemons started one by one, each with its own model file and optionally a loader
// and a replica, forming one relay tree (the same --peers list on each, in start order).
struct DaemonSpec {
  std::string model_path;
  std::string loader_path;
  std::string replica;
};

struct Daemon {
  pid_t pid = -1;
  std::string control_url;
  std::string data_endpoint;
  std::string log_path;
};

// Not thread-safe; one owner. Stops its daemons when destroyed.
class DaemonGroup {
 public:
  static Result<std::unique_ptr<DaemonGroup>> Start(const Args& args, const std::string& work_dir,
                                                    const std::string& label,
                                                    const std::vector<DaemonSpec>& specs) {
    std::unique_ptr<DaemonGroup> group(new DaemonGroup());
    REFIT_ASSIGN_OR_RETURN(std::vector<uint16_t> ports, cli::FreeLoopbackPorts(2 * specs.size()));
    std::vector<std::string> peers;
    for (size_t d = 0; d < specs.size(); ++d) {
      peers.push_back(fmt::format("127.0.0.1:{}", ports[2 * d]));
    }
    const std::string peer_list = fmt::format("{}", fmt::join(peers, ","));
    std::vector<std::string> ready_files;
    for (size_t d = 0; d < specs.size(); ++d) {
      Daemon daemon;
      daemon.log_path = fmt::format("{}/{}-{}.log", work_dir, label, d);
      ready_files.push_back(fmt::format("{}/{}-{}.ready", work_dir, label, d));
      std::filesystem::remove(ready_files.back());
      std::vector<std::string> argv = {args.refit_binary, "serve",
                                       "--model",         specs[d].model_path,
                                       "--bind",          "127.0.0.1",
                                       "--control-port",  std::to_string(ports[2 * d + 1]),
                                       "--data-port",     std::to_string(ports[2 * d]),
                                       "--peers",         peer_list,
                                       "--api-key-env",   kApiKeyEnv,
                                       "--ready-file",    ready_files.back()};
      if (!specs[d].loader_path.empty()) {
        argv.insert(argv.end(), {"--loader", specs[d].loader_path});
      }
      if (!specs[d].replica.empty()) argv.insert(argv.end(), {"--replica", specs[d].replica});
      if (args.receiver_mmap) argv.push_back("--mmap");
      REFIT_ASSIGN_OR_RETURN(daemon.pid, SpawnProcess(argv, daemon.log_path, daemon.log_path));
      group->daemons_.push_back(std::move(daemon));
    }
    for (size_t d = 0; d < specs.size(); ++d) {
      Daemon& daemon = group->daemons_[d];
      Result<std::string> ready =
          WaitForReadyFile(ready_files[d], daemon.pid, kChildStartTimeout, daemon.log_path);
      if (!ready.ok()) {
        // WaitForReadyFile reaped a daemon that exited; the others are stopped by the group.
        if (::kill(daemon.pid, 0) != 0) daemon.pid = -1;
        return ready.status().WithContext(fmt::format("{} daemon {}", label, d));
      }
      const nlohmann::json info = nlohmann::json::parse(*ready, nullptr, false);
      if (!info.is_object() || !info.contains("control_url") || !info.contains("data_endpoint")) {
        return DataLoss("{} daemon {}: malformed ready file {}", label, d, ready_files[d]);
      }
      daemon.control_url = info["control_url"].get<std::string>();
      daemon.data_endpoint = info["data_endpoint"].get<std::string>();
    }
    return group;
  }

  ~DaemonGroup() { Stop().IgnoreError(); }
  DaemonGroup(const DaemonGroup&) = delete;
  DaemonGroup& operator=(const DaemonGroup&) = delete;

  // SIGTERM every daemon, then wait for each. Errors: Internal naming each daemon that did not
  // exit with status 0 (with the end of its log).
  Status Stop() {
    std::vector<std::string> problems;
    for (const Daemon& daemon : daemons_) {
      if (daemon.pid > 0) ::kill(daemon.pid, SIGTERM);
    }
    for (size_t d = 0; d < daemons_.size(); ++d) {
      Daemon& daemon = daemons_[d];
      if (daemon.pid <= 0) continue;
      Result<ChildExit> exit = WaitProcess(daemon.pid, kChildStopGrace);
      daemon.pid = -1;
      if (!exit.ok() || !exit->ok()) {
        problems.push_back(
            fmt::format("daemon {} {}; its log ends with:\n{}", d,
                        exit.ok() ? "exited with " + exit->Describe() : exit.status().ToString(),
                        FileTail(daemon.log_path)));
      }
    }
    if (!problems.empty()) return Internal("{}", fmt::join(problems, "\n"));
    return Status::OK();
  }

  const std::vector<Daemon>& daemons() const { return daemons_; }
  std::vector<PublisherReceiver> receivers() const {
    std::vector<PublisherReceiver> fleet;
    for (const Daemon& daemon : daemons_)
      fleet.push_back({daemon.control_url, daemon.data_endpoint});
    return fleet;
  }

 private:
  DaemonGroup() = default;
  std::vector<Daemon> daemons_;
};

// Per daemon: reset its peak RSS and read its RSS (before a refit), or read its peak (after).
// Without a reset (no clear_refs) a peak is the peak since the daemon started.
struct DaemonMemory {
  bool reset = true;
  std::vector<uint64_t> before;
  std::vector<uint64_t> peak;
};

Result<DaemonMemory> OpenDaemonMemory(const DaemonGroup& group) {
  DaemonMemory memory;
  for (const Daemon& daemon : group.daemons()) {
    const std::string pid = std::to_string(daemon.pid);
    if (Status reset = ResetPeakRss(pid); !reset.ok() && memory.reset) {
      memory.reset = false;
      std::cerr << "warning: " << reset.message()
                << "; peak RSS figures are peaks since the daemon started\n";
    }
    REFIT_ASSIGN_OR_RETURN(uint64_t rss, ProcessMemoryBytes(pid, "VmRSS"));
    memory.before.push_back(rss);
  }
  return memory;
}

Status CloseDaemonMemory(const DaemonGroup& group, DaemonMemory* memory) {
  for (const Daemon& daemon : group.daemons()) {
    REFIT_ASSIGN_OR_RETURN(uint64_t peak, ProcessMemoryBytes(std::to_string(daemon.pid), "VmHWM"));
    memory->peak.push_back(peak);
  }
  return Status::OK();
}

// --- Producers: threads vs processes ----------------------------------------------------------

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

// Median, min and max of one figure over the steps.
nlohmann::json Spread(const std::vector<SyncStep>& steps, double SyncStep::*figure) {
  std::vector<double> values;
  for (const SyncStep& step : steps) values.push_back(step.*figure);
  return {{"median", Median(values)},
          {"min", *std::min_element(values.begin(), values.end())},
          {"max", *std::max_element(values.begin(), values.end())}};
}

// One delta as W `refit push` processes of one TCP producer group: `next_path` against
// `base_path` (what the fleet holds), with the options of `config_path`.
Result<SyncStep> PushAsProcesses(const Args& args, const std::string& work_dir, uint32_t world,
                                 const std::string& config_path, const std::string& base_path,
                                 const std::string& next_path,
                                 const std::vector<PublisherReceiver>& fleet) {
  REFIT_ASSIGN_OR_RETURN(std::vector<uint16_t> port, cli::FreeLoopbackPorts(1));
  std::vector<std::string> common = {args.refit_binary,
                                     "push",
                                     next_path,
                                     "--base",
                                     base_path,
                                     "--config",
                                     config_path,
                                     "--group",
                                     fmt::format("tcp://127.0.0.1:{}", port[0]),
                                     "--world-size",
                                     std::to_string(world),
                                     "--timeout",
                                     std::to_string(std::chrono::seconds(kPushTimeout).count()),
                                     "--json"};
  for (const PublisherReceiver& receiver : fleet) {
    common.insert(common.end(), {"--receiver", fmt::format("{}={}", receiver.control_url,
                                                           receiver.data_endpoint)});
  }
  std::vector<pid_t> pids;
  std::vector<std::string> outputs, logs;
  const double t0 = Now();
  for (uint32_t rank = 0; rank < world; ++rank) {
    std::vector<std::string> argv = common;
    argv.insert(argv.end(), {"--rank", std::to_string(rank)});
    outputs.push_back(fmt::format("{}/push-rank-{}.out", work_dir, rank));
    logs.push_back(fmt::format("{}/push-rank-{}.log", work_dir, rank));
    Result<pid_t> pid = SpawnProcess(argv, outputs.back(), logs.back());
    if (!pid.ok()) {
      // The ranks already started would wait for the missing one until their timeout.
      for (pid_t started : pids) TerminateProcess(started, kChildStopGrace).status().IgnoreError();
      return pid.status();
    }
    pids.push_back(*pid);
  }
  Result<std::vector<ChildExit>> exits = WaitProcesses(pids, kPushTimeout);
  std::vector<std::string> problems;
  SyncStep step;
  for (uint32_t rank = 0; rank < world; ++rank) {
    if (!exits.ok() || !(*exits)[rank].ok()) {
      problems.push_back(fmt::format(
          "`refit push` rank {} of {} {}; its log ends with:\n{}", rank, world,
          exits.ok() ? "exited with " + (*exits)[rank].Describe() : exits.status().ToString(),
          FileTail(logs[rank])));
    } else {
      step.rank_peak_rss.push_back((*exits)[rank].peak_rss_bytes);
    }
  }
  step.wall_s = Now() - t0;
  if (!problems.empty()) return Internal("{}", fmt::join(problems, "\n"));
  // Rank 0 prints one JSON line for the whole transfer (push.cc PrintReport).
  std::ifstream printed(outputs[0]);
  nlohmann::json line;
  for (std::string text; std::getline(printed, text);) {
    nlohmann::json parsed = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_object()) line = std::move(parsed);
  }
  if (!line.is_object() || !line.contains("time_s") || line.value("kind", "") != "delta") {
    return DataLoss("`refit push` rank 0 printed no delta report: '{}'", FileTail(outputs[0]));
  }
  step.changed = line.value("changed", uint64_t{0});
  step.payloads = line.value("payloads", uint64_t{0});
  step.wire_bytes = line.value("wire_bytes", uint64_t{0});
  step.time_s = line.value("time_s", 0.0);
  return step;
}

// One rank of the producers section's persistent rank processes (this executable re-executed):
// what one process of a W-process trainer job does. It draws the initial model (the same seed as
// the benchmark), joins the TCP producer group and a second TCP group used only as a barrier,
// adopts the model as the fleet's, then per step: applies the step to its copy, waits at the
// barrier (so that the timed Sync starts with every rank ready, as a job's ranks arrive after the
// same optimizer step) and Syncs. Rank 0 writes every step's report to --result-file.
Status RunProducerRank(const ChildFlags& flags) {
  REFIT_ASSIGN_OR_RETURN(const uint64_t rank, flags.Number("--rank"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t world, flags.Number("--world-size"));
  REFIT_ASSIGN_OR_RETURN(const std::string group_address, flags.Text("--group"));
  REFIT_ASSIGN_OR_RETURN(const std::string barrier_address, flags.Text("--barrier"));
  REFIT_ASSIGN_OR_RETURN(const std::string config_path, flags.Text("--config"));
  REFIT_ASSIGN_OR_RETURN(const std::string fleet_text, flags.Text("--receivers"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t model_bytes, flags.Number("--model-bytes"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t seed, flags.Number("--seed"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t threads, flags.Number("--threads"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t steps, flags.Number("--steps"));
  REFIT_ASSIGN_OR_RETURN(const std::string density_text, flags.Text("--density"));
  REFIT_ASSIGN_OR_RETURN(const double density,
                         ParseDensity("--density", density_text, /*allow_one=*/true));
  REFIT_ASSIGN_OR_RETURN(const std::string result_path, flags.Text("--result-file"));
  std::vector<PublisherReceiver> fleet;
  for (std::string_view entry : SplitCommas(fleet_text)) {
    const size_t equals = entry.find('=');
    if (equals == std::string_view::npos) {
      return InvalidArgument("{}: --receivers entry '{}' is not URL=ENDPOINT", kProducerRankFlag,
                             entry);
    }
    fleet.push_back({std::string(entry.substr(0, equals)), std::string(entry.substr(equals + 1))});
  }
  REFIT_ASSIGN_OR_RETURN(SyntheticModel model,
                         SyntheticModel::Make(model_bytes, seed,
                                              static_cast<int>(std::clamp<uint64_t>(
                                                  threads, 1, ProducerStream::kMaxThreads)),
                                              nullptr));
  const char* key = std::getenv(kApiKeyEnv);
  TcpGroupOptions group_options;
  group_options.rank = static_cast<uint32_t>(rank);
  group_options.world_size = static_cast<uint32_t>(world);
  group_options.api_key = key == nullptr ? "" : key;
  group_options.address = barrier_address;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ProducerGroup> barrier, MakeTcpGroup(group_options));
  group_options.address = group_address;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ProducerGroup> group, MakeTcpGroup(group_options));
  REFIT_ASSIGN_OR_RETURN(const PublisherOptions options,
                         PublisherOptionsFromConfig(config_path, fleet));
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Publisher> publisher,
                         Publisher::Make(options, std::move(group)));
  REFIT_RETURN_NOT_OK(publisher->AdoptBaseline(model.views()));
  nlohmann::json reports = nlohmann::json::array();
  for (uint64_t s = 1; s <= steps; ++s) {
    const uint64_t changed = model.Step(s, density);
    const GroupClock::time_point deadline = GroupClock::now() + kPushTimeout;
    REFIT_RETURN_NOT_OK(barrier->Gather({}, deadline).status().WithContext("barrier"));
    REFIT_RETURN_NOT_OK(barrier->Broadcast({}, deadline).status().WithContext("barrier"));
    const double t0 = Now();
    REFIT_ASSIGN_OR_RETURN(const SyncReport sync, publisher->Sync(model.views()));
    const double wall = Now() - t0;
    if (sync.transfer.plan.anchor) {
      return Internal("rank {}: step {} was a FULL anchor where a delta was expected", rank, s);
    }
    if (rank == 0) reports.push_back(StepJson(StepFromReport(sync.transfer, changed, wall)));
  }
  if (rank != 0) return Status::OK();
  return WriteTextFileAtomically(result_path, nlohmann::json{{"steps", reports}}.dump() + "\n");
}

// The steps of one configuration as W persistent rank processes (RunProducerRank), from the
// model the fleet holds (the initial one) on.
Result<std::vector<SyncStep>> SyncAsRankProcesses(const Args& args, const std::string& work_dir,
                                                  uint32_t world, const std::string& config_path,
                                                  const std::vector<PublisherReceiver>& fleet) {
  REFIT_ASSIGN_OR_RETURN(const std::string self, cli::SelfExecutable());
  REFIT_ASSIGN_OR_RETURN(const std::vector<uint16_t> ports, cli::FreeLoopbackPorts(2));
  std::vector<std::string> entries;
  for (const PublisherReceiver& receiver : fleet) {
    entries.push_back(fmt::format("{}={}", receiver.control_url, receiver.data_endpoint));
  }
  const std::string result_path = fmt::format("{}/rank-processes.result", work_dir);
  std::filesystem::remove(result_path);
  const std::vector<std::string> common = {self,
                                           std::string(kProducerRankFlag),
                                           "--world-size",
                                           std::to_string(world),
                                           "--group",
                                           fmt::format("tcp://127.0.0.1:{}", ports[0]),
                                           "--barrier",
                                           fmt::format("tcp://127.0.0.1:{}", ports[1]),
                                           "--config",
                                           config_path,
                                           "--receivers",
                                           fmt::format("{}", fmt::join(entries, ",")),
                                           "--model-bytes",
                                           std::to_string(args.producers_model_bytes),
                                           "--seed",
                                           std::to_string(args.seed),
                                           "--threads",
                                           std::to_string(args.threads),
                                           "--steps",
                                           std::to_string(args.steps),
                                           "--density",
                                           fmt::format("{}", args.step_density),
                                           "--result-file",
                                           result_path};
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  for (uint32_t rank = 0; rank < world; ++rank) {
    std::vector<std::string> argv = common;
    argv.insert(argv.end(), {"--rank", std::to_string(rank)});
    logs.push_back(fmt::format("{}/rank-process-{}.log", work_dir, rank));
    Result<pid_t> pid = SpawnProcess(argv, logs.back(), logs.back());
    if (!pid.ok()) {
      for (pid_t started : pids) TerminateProcess(started, kChildStopGrace).status().IgnoreError();
      return pid.status();
    }
    pids.push_back(*pid);
  }
  Result<std::vector<ChildExit>> exits = WaitProcesses(pids, kPushTimeout);
  std::vector<std::string> problems;
  std::vector<uint64_t> rank_peaks;
  for (uint32_t rank = 0; rank < world; ++rank) {
    if (!exits.ok() || !(*exits)[rank].ok()) {
      problems.push_back(fmt::format(
          "rank process {} of {} {}; its log ends with:\n{}", rank, world,
          exits.ok() ? "exited with " + (*exits)[rank].Describe() : exits.status().ToString(),
          FileTail(logs[rank])));
    } else {
      rank_peaks.push_back((*exits)[rank].peak_rss_bytes);
    }
  }
  if (!problems.empty()) return Internal("{}", fmt::join(problems, "\n"));
  std::ifstream result_file(result_path);
  const nlohmann::json result = nlohmann::json::parse(result_file, nullptr, false);
  if (!result.is_object() || !result.contains("steps") || result["steps"].size() != args.steps) {
    return DataLoss("rank process 0 wrote no report of its {} steps to {}", args.steps,
                    result_path);
  }
  std::vector<SyncStep> steps;
  for (const nlohmann::json& reported : result["steps"]) {
    SyncStep step;
    step.changed_by_step = reported["changed_by_step"];
    step.changed = reported["changed"];
    step.payloads = reported["payloads"];
    step.wire_bytes = reported["wire_bytes"];
    step.time_s = reported["time_s"];
    step.stream_s = reported["stream_s"];
    step.flush_s = reported["flush_s"];
    step.commit_s = reported["commit_s"];
    step.wall_s = reported["wall_s"];
    step.rank_peak_rss = rank_peaks;
    steps.push_back(step);
  }
  return steps;
}

Result<nlohmann::json> RunProducers(const Args& args, const std::string& work_dir) {
  nlohmann::json out;
  const uint64_t chunk_bytes = SectionChunkBytes(args.producers_model_bytes);
  REFIT_ASSIGN_OR_RETURN(
      SyntheticModel model,
      SyntheticModel::Make(args.producers_model_bytes, args.seed, args.threads, nullptr));
  std::vector<uint64_t> tensor_bytes;
  for (const TensorView& tensor : model.views()) tensor_bytes.push_back(tensor.bytes.size());
  out["model_bytes"] = model.bytes();
  out["tensors"] = model.views().size();
  out["chunk_bytes"] = chunk_bytes;
  out["chunks"] = PlanChunks(tensor_bytes, chunk_bytes).size();
  out["receivers"] = args.producers_receivers;
  out["steps"] = args.steps;
  out["step_density"] = args.step_density;
  out["threads_per_stage_per_rank"] = args.threads;

  const std::string initial_path = work_dir + "/producers-model.safetensors";
  REFIT_RETURN_NOT_OK(
      WriteSafetensors(initial_path, model.views(), {{kWeightVersionMetadataKey, "0"}}));
  const std::vector<DaemonSpec> specs(args.producers_receivers, DaemonSpec{initial_path, "", ""});
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<DaemonGroup> daemons,
                         DaemonGroup::Start(args, work_dir, "producers", specs));
  std::filesystem::remove(initial_path);
  REFIT_ASSIGN_OR_RETURN(const std::string config_path,
                         WriteRefitConfig(args, work_dir, "producers", chunk_bytes));
  REFIT_ASSIGN_OR_RETURN(const PublisherOptions options,
                         PublisherOptionsFromConfig(config_path, daemons->receivers()));
  const std::string base_path = work_dir + "/producers-base.safetensors";
  const std::string next_path = work_dir + "/producers-next.safetensors";

  // Per W: the ranks as threads of this process, as persistent processes, and as one `refit
  // push --group` process set per step (the CLI).
  constexpr std::array<std::string_view, 3> kModes = {"threads", "processes", "push"};
  std::unique_ptr<ProgressReporter> progress =
      Progress("producers", kModes.size() * args.producers.size(), "configurations");
  out["rows"] = nlohmann::json::array();
  double reset_s = 0;
  {
    // Warm-up, not measured: one delta (step 0, which no configuration repeats), so that the
    // first configuration does not pay the fleet's first transfer alone (first-touch pages of the
    // daemon's apply path, first connections); the first configuration's reset refits it back.
    REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Publisher>> warm,
                           MakeThreadRanks(1, options));
    REFIT_RETURN_NOT_OK(AdoptBaseline(warm, model.views()));
    model.Step(/*step=*/0, args.step_density);
    REFIT_RETURN_NOT_OK(SyncDelta(warm, model.views()).status().WithContext("warm-up"));
  }
  bool fleet_at_initial = false;
  for (uint32_t world : args.producers) {
    for (const std::string_view mode : kModes) {
      if (!fleet_at_initial) {
        // Refit the daemons back to the initial model (not measured), so that every
        // configuration sends exactly the same deltas from exactly the same state.
        const double t0 = Now();
        REFIT_ASSIGN_OR_RETURN(
            SyntheticModel initial,
            SyntheticModel::Make(args.producers_model_bytes, args.seed, args.threads, nullptr));
        REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Publisher>> reset,
                               MakeThreadRanks(1, options));
        REFIT_RETURN_NOT_OK(AdoptBaseline(reset, model.views()));
        REFIT_RETURN_NOT_OK(SyncDelta(reset, initial.views())
                                .status()
                                .WithContext("refit back to the initial model"));
        model = std::move(initial);
        reset_s += Now() - t0;
      }
      fleet_at_initial = false;
      std::vector<SyncStep> steps;
      if (mode == "processes") {
        REFIT_ASSIGN_OR_RETURN(
            steps, SyncAsRankProcesses(args, work_dir, world, config_path, daemons->receivers()));
        // This process's copy follows, for the next reset and the final check.
        for (uint64_t s = 1; s <= args.steps; ++s) model.Step(s, args.step_density);
      } else if (mode == "threads") {
        REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Publisher>> ranks,
                               MakeThreadRanks(world, options));
        REFIT_RETURN_NOT_OK(AdoptBaseline(ranks, model.views()));
        for (uint64_t s = 1; s <= args.steps; ++s) {
          const uint64_t changed = model.Step(s, args.step_density);
          const double t0 = Now();
          REFIT_ASSIGN_OR_RETURN(RefitReport report, SyncDelta(ranks, model.views()));
          steps.push_back(StepFromReport(report, changed, Now() - t0));
        }
      } else {
        REFIT_RETURN_NOT_OK(WriteSafetensors(base_path, model.views()));
        for (uint64_t s = 1; s <= args.steps; ++s) {
          const uint64_t changed = model.Step(s, args.step_density);
          REFIT_RETURN_NOT_OK(WriteSafetensors(next_path, model.views()));
          REFIT_ASSIGN_OR_RETURN(SyncStep step,
                                 PushAsProcesses(args, work_dir, world, config_path, base_path,
                                                 next_path, daemons->receivers()));
          step.changed_by_step = changed;
          steps.push_back(step);
          std::filesystem::rename(next_path, base_path);
        }
        std::filesystem::remove(base_path);
      }
      nlohmann::json row = {{"mode", std::string(mode)},
                            {"producers", world},
                            {"time_s", Spread(steps, &SyncStep::time_s)},
                            {"wall_s", Spread(steps, &SyncStep::wall_s)},
                            {"steps", nlohmann::json::array()}};
      uint64_t wire = 0, payloads = 0, changed = 0, rank_peak = 0;
      for (const SyncStep& step : steps) {
        if (step.changed != step.changed_by_step) {
          return DataLoss(
              "producers W = {} ({}): a step changed {} elements but the producers "
              "found {}",
              world, row["mode"].get<std::string>(), step.changed_by_step, step.changed);
        }
        row["steps"].push_back(StepJson(step));
        wire += step.wire_bytes;
        payloads += step.payloads;
        changed += step.changed;
        for (uint64_t peak : step.rank_peak_rss) rank_peak = std::max(rank_peak, peak);
      }
      row["wire_bytes_per_step"] = static_cast<double>(wire) / steps.size();
      row["payloads_per_step"] = static_cast<double>(payloads) / steps.size();
      row["changed_per_step"] = static_cast<double>(changed) / steps.size();
      if (mode != "threads") row["rank_peak_rss"] = rank_peak;
      out["rows"].push_back(std::move(row));
      if (progress) progress->Advance(1);
    }
  }
  if (progress) progress->Finish();
  // Every daemon holds the last model bit for bit.
  for (const Daemon& daemon : daemons->daemons()) {
    REFIT_RETURN_NOT_OK(CheckReceiverHolds(daemon.control_url, model.views()));
  }
  out["verified_bit_identical"] = true;
  out["reset_s"] = reset_s;
  REFIT_RETURN_NOT_OK(daemons->Stop());

  // Per row: its time and wall over the threads row of the same W, and whether it sent the same
  // bytes at every step.
  bool wire_identical = true;
  for (size_t r = 0; r < out["rows"].size(); ++r) {
    nlohmann::json& row = out["rows"][r];
    const nlohmann::json& threads = out["rows"][r - r % kModes.size()];
    bool same = true;
    for (size_t s = 0; s < threads["steps"].size(); ++s) {
      same = same && threads["steps"][s]["wire_bytes"] == row["steps"][s]["wire_bytes"];
    }
    wire_identical = wire_identical && same;
    row["wire_identical_to_threads"] = same;
    row["time_over_threads"] = row["time_s"]["median"].get<double>() /
                               std::max(threads["time_s"]["median"].get<double>(), 1e-9);
    row["wall_over_threads"] = row["wall_s"]["median"].get<double>() /
                               std::max(threads["wall_s"]["median"].get<double>(), 1e-9);
  }
  out["wire_identical_across_modes"] = wire_identical;
  return out;
}

void PrintProducers(const nlohmann::json& section) {
  std::cout << fmt::format(
      "== producers, threads vs processes: bf16 model {} ({} tensors, {} export chunks of <= {}), "
      "W ranks -> {} `refit serve` daemon(s) over zmq://; {} delta steps at {:.0f}%, the same "
      "deltas for every configuration; {} threads/stage per rank\n",
      FormatBytes(section["model_bytes"]), section["tensors"].get<size_t>(),
      section["chunks"].get<size_t>(), FormatBytes(section["chunk_bytes"]),
      section["receivers"].get<size_t>(), section["steps"].get<uint64_t>(),
      100 * section["step_density"].get<double>(),
      section["threads_per_stage_per_rank"].get<int>());
  Table table({"W", "ranks as", "changed/step", "payloads", "wire/step", "time", "min", "max",
               "vs threads", "wall", "wall vs threads", "rank peak"});
  for (const nlohmann::json& row : section["rows"]) {
    const std::string mode = row["mode"];
    const bool threads = mode == "threads";
    table.AddRow({std::to_string(row["producers"].get<uint32_t>()),
                  threads               ? "threads"
                  : mode == "processes" ? "processes"
                                        : "push CLI",
                  fmt::format("{:.0f}", row["changed_per_step"].get<double>()),
                  fmt::format("{:.1f}", row["payloads_per_step"].get<double>()),
                  FormatBytes(static_cast<uint64_t>(row["wire_bytes_per_step"].get<double>())),
                  FormatDuration(row["time_s"]["median"]), FormatDuration(row["time_s"]["min"]),
                  FormatDuration(row["time_s"]["max"]),
                  threads ? "-" : fmt::format("{:.2f}x", row["time_over_threads"].get<double>()),
                  FormatDuration(row["wall_s"]["median"]),
                  threads ? "-" : fmt::format("{:.2f}x", row["wall_over_threads"].get<double>()),
                  threads ? std::string("-") : FormatBytes(row["rank_peak_rss"])});
  }
  table.Print(std::cout);
  std::cout << fmt::format(
      "threads = W Publishers in this process (in-process group); processes = W persistent rank "
      "processes (TCP group), each with its own copy of the model, meeting at a barrier after each "
      "step; push CLI = W `refit push --group` processes per step (each maps the checkpoint and "
      "its base, adopts the baseline and joins the group, then syncs once)\n"
      "time = median over the steps of rank 0's Coordinator::Refit (Begin to the end of commit); "
      "wall = threads and processes: rank 0's Sync call; push CLI: first rank spawned to last "
      "exited; rank peak = the largest rank process's peak RSS (its VmHWM at the last 10 ms poll "
      "before it exited)\n"
      "wire bytes identical for every mode at every W and step: {}; every daemon bit-identical "
      "to the producers' last model\n\n",
      section["wire_identical_across_modes"].get<bool>() ? "yes" : "NO");
}

// --- TP shard groups --------------------------------------------------------------------------

// The dimensions of a MakeTransformerSpec model, read from its tensors, and the attention heads
// the tp section's loader assumes (MakeTransformerSpec's k and v are [hidden, hidden]: as many
// kv heads as heads).
struct LlamaLayout {
  uint64_t hidden = 0;
  uint64_t intermediate = 0;
  uint64_t vocab = 0;
  uint64_t layers = 0;
  uint64_t heads = 0;
};

Result<LlamaLayout> DescribeLlama(const std::vector<TensorView>& model,
                                  const std::vector<uint32_t>& degrees) {
  LlamaLayout layout;
  for (const TensorView& tensor : model) {
    if (tensor.name == "model.embed_tokens.weight" && tensor.shape.size() == 2) {
      layout.vocab = static_cast<uint64_t>(tensor.shape[0]);
      layout.hidden = static_cast<uint64_t>(tensor.shape[1]);
    } else if (tensor.name.ends_with(".mlp.gate_proj.weight") && tensor.shape.size() == 2) {
      layout.intermediate = static_cast<uint64_t>(tensor.shape[0]);
    } else if (tensor.name.ends_with(".input_layernorm.weight")) {
      ++layout.layers;
    }
  }
  if (layout.hidden == 0 || layout.intermediate == 0 || layout.layers == 0) {
    return InvalidArgument("tp: the model has no Llama layout (embedding, layers, MLP)");
  }
  const auto divides_all = [&](uint64_t heads) {
    return std::all_of(degrees.begin(), degrees.end(),
                       [heads](uint32_t tp) { return heads % tp == 0; });
  };
  layout.heads = std::max<uint64_t>(1, layout.hidden / kHeadDim);
  while (!divides_all(layout.heads) && layout.hidden % (2 * layout.heads) == 0) layout.heads *= 2;
  for (uint32_t tp : degrees) {
    if (layout.heads % tp != 0 || layout.intermediate % tp != 0 || layout.hidden % tp != 0) {
      return InvalidArgument(
          "--tp {}: the model's {} heads (hidden {}) and MLP width {} do not divide among {} "
          "shards; use other degrees or --tp-model-mib",
          tp, layout.heads, layout.hidden, layout.intermediate, tp);
    }
  }
  return layout;
}

// The vocabulary rows of each shard's embedding and lm_head: V rounded up to kVocabPadTo × TP.
uint64_t PaddedVocabulary(const LlamaLayout& layout, uint32_t tp) {
  const uint64_t multiple = kVocabPadTo * tp;
  return (layout.vocab + multiple - 1) / multiple * multiple;
}

// The loader spec of shard `rank` of `tp` (include/refit/loader.h): fused qkv and gate_up (row
// blocks), o_proj and down_proj split by columns, vocabulary-parallel embedding and lm_head; the
// norms are replicated in every shard (the identity fallback).
std::string LoaderYaml(const LlamaLayout& layout, uint32_t rank, uint32_t tp) {
  return fmt::format(R"(tp_rank: {}
tp_size: {}
rules:
  - kind: qkv
    q: 'model\.layers\.(\d+)\.self_attn\.q_proj\.weight'
    k: 'model\.layers\.(\d+)\.self_attn\.k_proj\.weight'
    v: 'model\.layers\.(\d+)\.self_attn\.v_proj\.weight'
    to: 'model.layers.$1.self_attn.qkv_proj.weight'
    num_heads: {}
    num_kv_heads: {}
  - kind: gate_up
    gate: 'model\.layers\.(\d+)\.mlp\.gate_proj\.weight'
    up: 'model\.layers\.(\d+)\.mlp\.up_proj\.weight'
    to: 'model.layers.$1.mlp.gate_up_proj.weight'
  - {{kind: column, match: 'model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight'}}
  - {{kind: vocab, match: 'model\.embed_tokens\.weight|lm_head\.weight', vocab_size: {}, pad_to: {}}}
)",
                     rank, tp, layout.heads, layout.heads, layout.vocab, kVocabPadTo);
}

// Shard `rank` of `tp` of the canonical `model` in the layout LoaderYaml describes, computed here
// from the layout's definition (as vLLM lays out its weights), not through the loader: the
// daemons' flush then checks the loader against it, by the replica's piece digests, and the
// final download byte for byte.
std::vector<OwnedTensor> ShardModel(const std::vector<TensorView>& model, const LlamaLayout& layout,
                                    uint32_t rank, uint32_t tp) {
  std::map<std::string, const TensorView*, std::less<>> by_name;
  for (const TensorView& tensor : model) by_name[tensor.name] = &tensor;
  // Append rows [begin, begin + count) of `tensor`, seen as 2-D [shape[0], rest], to `out`.
  const auto append_rows = [](const TensorView& tensor, uint64_t begin, uint64_t count,
                              std::vector<std::byte>* out) {
    const uint64_t row_bytes = tensor.bytes.size() / static_cast<uint64_t>(tensor.shape[0]);
    out->insert(out->end(), tensor.bytes.begin() + begin * row_bytes,
                tensor.bytes.begin() + (begin + count) * row_bytes);
  };
  const auto prefix_of = [](const std::string& name, std::string_view suffix) {
    return name.substr(0, name.size() - suffix.size());
  };
  std::vector<OwnedTensor> shard;
  for (const TensorView& tensor : model) {
    const std::string& name = tensor.name;
    const uint64_t rows = static_cast<uint64_t>(tensor.shape[0]);
    OwnedTensor local{name, tensor.dtype, tensor.shape, {}};
    if (name.ends_with(".self_attn.q_proj.weight")) {
      // [q rows of the rank's heads | k rows of its kv heads | v rows of its kv heads].
      const std::string prefix = prefix_of(name, "q_proj.weight");
      const uint64_t block = rows / tp;
      local.name = prefix + "qkv_proj.weight";
      local.shape = {static_cast<int64_t>(3 * block), tensor.shape[1]};
      for (std::string_view part : {"q_proj.weight", "k_proj.weight", "v_proj.weight"}) {
        append_rows(*by_name.at(prefix + std::string(part)), rank * block, block, &local.bytes);
      }
    } else if (name.ends_with(".self_attn.k_proj.weight") ||
               name.ends_with(".self_attn.v_proj.weight") ||
               name.ends_with(".mlp.up_proj.weight")) {
      continue;  // Fused into qkv_proj or gate_up_proj above.
    } else if (name.ends_with(".mlp.gate_proj.weight")) {
      // [gate rows block r | up rows block r].
      const std::string prefix = prefix_of(name, "gate_proj.weight");
      const uint64_t block = rows / tp;
      local.name = prefix + "gate_up_proj.weight";
      local.shape = {static_cast<int64_t>(2 * block), tensor.shape[1]};
      append_rows(tensor, rank * block, block, &local.bytes);
      append_rows(*by_name.at(prefix + "up_proj.weight"), rank * block, block, &local.bytes);
    } else if (name.ends_with(".self_attn.o_proj.weight") ||
               name.ends_with(".mlp.down_proj.weight")) {
      // Column block r of every row.
      const uint64_t cols = static_cast<uint64_t>(tensor.shape[1]);
      const uint64_t block = cols / tp;
      const uint64_t width = tensor.bytes.size() / (rows * cols);
      local.shape = {tensor.shape[0], static_cast<int64_t>(block)};
      local.bytes.reserve(rows * block * width);
      for (uint64_t row = 0; row < rows; ++row) {
        const auto begin = tensor.bytes.begin() + (row * cols + rank * block) * width;
        local.bytes.insert(local.bytes.end(), begin, begin + block * width);
      }
    } else if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
      // Padded rows [r·Vp/TP, (r+1)·Vp/TP); rows past the vocabulary are zero padding.
      const uint64_t block = PaddedVocabulary(layout, tp) / tp;
      const uint64_t begin = rank * block;
      const uint64_t held = begin < rows ? std::min(block, rows - begin) : 0;
      local.shape = {static_cast<int64_t>(block), tensor.shape[1]};
      append_rows(tensor, begin, held, &local.bytes);
      local.bytes.resize(block * (tensor.bytes.size() / rows), std::byte{0});
    } else {
      local.bytes.assign(tensor.bytes.begin(), tensor.bytes.end());  // Replicated (norms).
    }
    shard.push_back(std::move(local));
  }
  return shard;
}

// Elements (2-byte) that differ between two versions of one shard.
uint64_t CountChanged(const std::vector<OwnedTensor>& before,
                      const std::vector<OwnedTensor>& after) {
  uint64_t changed = 0;
  for (size_t t = 0; t < before.size(); ++t) {
    const size_t n = before[t].bytes.size() / sizeof(uint16_t);
    const auto* old_bits = reinterpret_cast<const uint16_t*>(before[t].bytes.data());
    const auto* new_bits = reinterpret_cast<const uint16_t*>(after[t].bytes.data());
    for (size_t i = 0; i < n; ++i) changed += old_bits[i] != new_bits[i];
  }
  return changed;
}

Result<nlohmann::json> RunTensorParallel(const Args& args, const std::string& work_dir) {
  nlohmann::json out;
  const uint64_t chunk_bytes = SectionChunkBytes(args.tp_model_bytes);
  REFIT_ASSIGN_OR_RETURN(SyntheticModel model, SyntheticModel::Make(args.tp_model_bytes, args.seed,
                                                                    args.threads, nullptr));
  REFIT_ASSIGN_OR_RETURN(const LlamaLayout layout, DescribeLlama(model.views(), args.tp));
  out["model_bytes"] = model.bytes();
  out["tensors"] = model.views().size();
  out["layout"] = {{"hidden", layout.hidden},
                   {"intermediate", layout.intermediate},
                   {"vocab", layout.vocab},
                   {"layers", layout.layers},
                   {"heads", layout.heads},
                   {"kv_heads", layout.heads},
                   {"head_dim", layout.hidden / layout.heads},
                   {"vocab_pad_to", kVocabPadTo}};
  out["chunk_bytes"] = chunk_bytes;
  out["steps"] = args.steps;
  out["step_density"] = args.step_density;
  REFIT_ASSIGN_OR_RETURN(const std::string config_path,
                         WriteRefitConfig(args, work_dir, "tp", chunk_bytes));

  std::vector<uint32_t> degrees = {1};
  degrees.insert(degrees.end(), args.tp.begin(), args.tp.end());
  std::unique_ptr<ProgressReporter> progress = Progress("tp", degrees.size(), "layouts");
  out["rows"] = nlohmann::json::array();
  for (size_t c = 0; c < degrees.size(); ++c) {
    const uint32_t tp = degrees[c];
    // The same initial model and the same steps for every layout: identical deltas.
    if (c > 0) {
      REFIT_ASSIGN_OR_RETURN(
          model, SyntheticModel::Make(args.tp_model_bytes, args.seed, args.threads, nullptr));
    }
    const std::string label = fmt::format("tp{}", tp);
    std::vector<std::vector<OwnedTensor>> shards;
    std::vector<DaemonSpec> specs;
    std::vector<uint64_t> slice_bytes;
    if (tp == 1) {
      specs.push_back({fmt::format("{}/{}-model.safetensors", work_dir, label), "", ""});
      REFIT_RETURN_NOT_OK(
          WriteSafetensors(specs[0].model_path, model.views(), {{kWeightVersionMetadataKey, "0"}}));
      slice_bytes.push_back(model.bytes());
    } else {
      for (uint32_t rank = 0; rank < tp; ++rank) {
        shards.push_back(ShardModel(model.views(), layout, rank, tp));
        DaemonSpec spec{fmt::format("{}/{}-shard-{}.safetensors", work_dir, label, rank),
                        fmt::format("{}/{}-loader-{}.yaml", work_dir, label, rank), kTpReplica};
        REFIT_RETURN_NOT_OK(WriteSafetensors(spec.model_path, ViewsOf(shards.back()),
                                             {{kWeightVersionMetadataKey, "0"}}));
        REFIT_RETURN_NOT_OK(
            WriteTextFileAtomically(spec.loader_path, LoaderYaml(layout, rank, tp)));
        slice_bytes.push_back(BytesOf(ViewsOf(shards.back())));
        specs.push_back(std::move(spec));
      }
    }
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<DaemonGroup> daemons,
                           DaemonGroup::Start(args, work_dir, label, specs));
    for (const DaemonSpec& spec : specs) std::filesystem::remove(spec.model_path);
    std::vector<uint64_t> loaded_rss;
    for (const Daemon& daemon : daemons->daemons()) {
      REFIT_ASSIGN_OR_RETURN(uint64_t rss, ProcessMemoryBytes(std::to_string(daemon.pid), "VmRSS"));
      loaded_rss.push_back(rss);
    }
    REFIT_ASSIGN_OR_RETURN(const PublisherOptions options,
                           PublisherOptionsFromConfig(config_path, daemons->receivers()));
    REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Publisher>> ranks,
                           MakeThreadRanks(1, options));
    REFIT_RETURN_NOT_OK(AdoptBaseline(ranks, model.views()));
    // Warm-up, not measured: one delta (step 0, the same for every layout), so that no measured
    // step pays the daemons' first transfer (first-touch pages of the apply path, connections).
    model.Step(/*step=*/0, args.step_density);
    REFIT_RETURN_NOT_OK(SyncDelta(ranks, model.views()).status().WithContext("warm-up"));
    for (uint32_t rank = 0; rank < shards.size(); ++rank) {
      shards[rank] = ShardModel(model.views(), layout, rank, tp);
    }

    std::vector<SyncStep> steps;
    nlohmann::json step_rows = nlohmann::json::array();
    // Per shard, over the steps: the largest peak and growth, the changes to its slice, and its
    // growth per own change.
    std::vector<uint64_t> max_peak(tp, 0), max_growth(tp, 0), own_changed(tp, 0);
    std::vector<std::vector<double>> growth_per_own(tp), growth_per_changed(tp);
    std::vector<double> received_per_step(tp, 0);
    bool rss_reset = true;
    for (uint64_t s = 1; s <= args.steps; ++s) {
      REFIT_ASSIGN_OR_RETURN(DaemonMemory memory, OpenDaemonMemory(*daemons));
      rss_reset = rss_reset && memory.reset;
      const uint64_t changed = model.Step(s, args.step_density);
      const double t0 = Now();
      REFIT_ASSIGN_OR_RETURN(RefitReport report, SyncDelta(ranks, model.views()));
      const double wall = Now() - t0;
      REFIT_RETURN_NOT_OK(CloseDaemonMemory(*daemons, &memory));
      if (report.changed_elements != changed) {
        return DataLoss("tp {}: step {} changed {} elements but the producer found {}", tp, s,
                        changed, report.changed_elements);
      }
      std::vector<uint64_t> own(tp, changed);
      if (tp > 1) {
        for (uint32_t rank = 0; rank < tp; ++rank) {
          std::vector<OwnedTensor> next = ShardModel(model.views(), layout, rank, tp);
          own[rank] = CountChanged(shards[rank], next);
          shards[rank] = std::move(next);
        }
      }
      steps.push_back(StepFromReport(report, changed, wall));
      nlohmann::json step = StepJson(steps.back());
      step["shards"] = nlohmann::json::array();
      for (uint32_t rank = 0; rank < tp; ++rank) {
        const int64_t growth =
            static_cast<int64_t>(memory.peak[rank]) - static_cast<int64_t>(memory.before[rank]);
        step["shards"].push_back({{"shard", rank},
                                  {"rss_before", memory.before[rank]},
                                  {"peak_rss", memory.peak[rank]},
                                  {"growth_bytes", growth},
                                  {"own_changed", own[rank]}});
        max_peak[rank] = std::max(max_peak[rank], memory.peak[rank]);
        max_growth[rank] = std::max<uint64_t>(max_growth[rank], std::max<int64_t>(growth, 0));
        own_changed[rank] += own[rank];
        if (own[rank] > 0) {
          growth_per_own[rank].push_back(static_cast<double>(growth) / own[rank]);
        }
        if (changed > 0) {
          growth_per_changed[rank].push_back(static_cast<double>(growth) / changed);
        }
      }
      step_rows.push_back(std::move(step));
    }
    // Every shard holds exactly its slice of the last model.
    for (size_t d = 0; d < daemons->daemons().size(); ++d) {
      REFIT_RETURN_NOT_OK(CheckReceiverHolds(daemons->daemons()[d].control_url,
                                             tp == 1 ? model.views() : ViewsOf(shards[d])));
    }
    REFIT_RETURN_NOT_OK(daemons->Stop());

    nlohmann::json row = {{"tp", tp},
                          {"layout", tp == 1 ? "unsharded" : fmt::format("TP={}", tp)},
                          {"shards", tp},
                          {"time_s", Spread(steps, &SyncStep::time_s)},
                          {"wall_s", Spread(steps, &SyncStep::wall_s)},
                          {"rss_reset_per_refit", rss_reset},
                          {"verified_bit_identical", true},
                          {"steps", step_rows},
                          {"per_shard", nlohmann::json::array()}};
    uint64_t wire = 0, payloads = 0;
    for (const SyncStep& step : steps) {
      wire += step.wire_bytes;
      payloads += step.payloads;
    }
    row["wire_bytes_per_step"] = static_cast<double>(wire) / steps.size();
    row["payloads_per_step"] = static_cast<double>(payloads) / steps.size();
    row["routes"] = steps.back().routes;
    for (uint32_t rank = 0; rank < tp; ++rank) {
      uint64_t received = 0;
      for (const SyncStep& step : steps) {
        if (rank < step.received_bytes.size()) received += step.received_bytes[rank];
      }
      received_per_step[rank] = static_cast<double>(received) / steps.size();
    }
    for (uint32_t rank = 0; rank < tp; ++rank) {
      const double own_per_step = static_cast<double>(own_changed[rank]) / steps.size();
      const double changed_per_step = row["steps"][0]["changed"].get<double>();
      const int64_t over_loaded =
          static_cast<int64_t>(max_peak[rank]) - static_cast<int64_t>(loaded_rss[rank]);
      row["per_shard"].push_back(
          {{"shard", rank},
           {"slice_bytes", slice_bytes[rank]},
           {"rss_loaded", loaded_rss[rank]},
           {"loaded_over_slice_bytes",
            static_cast<int64_t>(loaded_rss[rank]) - static_cast<int64_t>(slice_bytes[rank])},
           {"max_peak_rss", max_peak[rank]},
           {"peak_over_loaded_bytes", over_loaded},
           {"peak_over_loaded_per_own_changed",
            own_per_step > 0 ? over_loaded / own_per_step : 0.0},
           {"peak_over_loaded_per_changed",
            changed_per_step > 0 ? over_loaded / changed_per_step : 0.0},
           {"peak_over_slice_bytes",
            static_cast<int64_t>(max_peak[rank]) - static_cast<int64_t>(slice_bytes[rank])},
           {"peak_over_slice_ratio",
            static_cast<double>(max_peak[rank]) / static_cast<double>(slice_bytes[rank])},
           {"max_growth_bytes", max_growth[rank]},
           {"own_changed_per_step", own_per_step},
           {"received_bytes_per_step", received_per_step[rank]},
           {"growth_per_own_changed_median", Median(growth_per_own[rank])},
           {"growth_per_changed_median", Median(growth_per_changed[rank])}});
    }
    out["rows"].push_back(std::move(row));
    if (progress) progress->Advance(1);
  }
  if (progress) progress->Finish();

  // Against the unsharded replica: time ratios, and the bytes each shard receives (the same
  // deltas to any layout; routed by holdings, a shard receives only its cut).
  const double unsharded_s = out["rows"][0]["time_s"]["median"];
  const double unsharded_received =
      out["rows"][0]["per_shard"][0]["received_bytes_per_step"].get<double>();
  bool changed_identical = true;
  for (nlohmann::json& row : out["rows"]) {
    row["time_over_unsharded"] =
        row["time_s"]["median"].get<double>() / std::max(unsharded_s, 1e-9);
    double received = 0;
    for (const nlohmann::json& shard : row["per_shard"]) {
      received = std::max(received, shard["received_bytes_per_step"].get<double>());
    }
    row["received_over_unsharded"] = received / std::max(unsharded_received, 1.0);
    for (size_t s = 0; s < row["steps"].size(); ++s) {
      changed_identical =
          changed_identical && row["steps"][s]["changed"] == out["rows"][0]["steps"][s]["changed"];
    }
  }
  out["changed_identical_across_layouts"] = changed_identical;
  out["target"] = {{"tp", kTargetTp},
                   {"max_time_over_unsharded", kTargetTpSlowdown},
                   {"max_received_over_unsharded", kTargetTpReceived}};
  out["target"]["met"] = nullptr;
  out["target"]["received_met"] = nullptr;
  for (const nlohmann::json& row : out["rows"]) {
    if (row["tp"] == kTargetTp) {
      const double ratio = row["time_over_unsharded"];
      out["target"]["time_over_unsharded"] = ratio;
      out["target"]["met"] = ratio <= kTargetTpSlowdown;
      const double received = row["received_over_unsharded"];
      out["target"]["received_over_unsharded"] = received;
      out["target"]["received_met"] = received <= kTargetTpReceived;
    }
  }
  return out;
}

void PrintTensorParallel(const nlohmann::json& section) {
  const nlohmann::json& layout = section["layout"];
  std::cout << fmt::format(
      "== tp shard groups: Llama-layout bf16 model {} ({} tensors: hidden {}, {} layers, {} heads "
      "of {}, MLP {}, vocabulary {}), 1 producer -> one replica, unsharded or as a TP group of "
      "`refit serve --loader --replica` shard daemons (fused qkv and gate_up, column-split o/down, "
      "vocabulary-parallel embedding and lm_head padded to {} x TP); {} delta steps at {:.0f}%, "
      "the same deltas for every layout\n",
      FormatBytes(section["model_bytes"]), section["tensors"].get<size_t>(),
      layout["hidden"].get<uint64_t>(), layout["layers"].get<uint64_t>(),
      layout["heads"].get<uint64_t>(), layout["head_dim"].get<uint64_t>(),
      layout["intermediate"].get<uint64_t>(), layout["vocab"].get<uint64_t>(),
      layout["vocab_pad_to"].get<uint64_t>(), section["steps"].get<uint64_t>(),
      100 * section["step_density"].get<double>());
  Table table({"layout", "shards", "slice/shard", "payloads", "wire/step", "recv/shard",
               "recv vs unsharded", "time", "min", "max", "vs unsharded", "own changes",
               "loaded-slice", "shard peak", "peak/slice", "peak-loaded", "per own", "per change"});
  for (const nlohmann::json& row : section["rows"]) {
    // The largest shard figures of the row (shard 0's for the unsharded replica).
    uint64_t slice = 0, peak = 0;
    int64_t fixed = 0, over = 0;
    double ratio = 0, own = 0, per_own = 0, per_changed = 0, received = 0;
    for (const nlohmann::json& shard : row["per_shard"]) {
      received = std::max(received, shard["received_bytes_per_step"].get<double>());
      slice = std::max(slice, shard["slice_bytes"].get<uint64_t>());
      peak = std::max(peak, shard["max_peak_rss"].get<uint64_t>());
      fixed = std::max(fixed, shard["loaded_over_slice_bytes"].get<int64_t>());
      over = std::max(over, shard["peak_over_loaded_bytes"].get<int64_t>());
      ratio = std::max(ratio, shard["peak_over_slice_ratio"].get<double>());
      own = std::max(own, shard["own_changed_per_step"].get<double>());
      per_own = std::max(per_own, shard["peak_over_loaded_per_own_changed"].get<double>());
      per_changed = std::max(per_changed, shard["peak_over_loaded_per_changed"].get<double>());
    }
    table.AddRow({row["layout"].get<std::string>(), std::to_string(row["shards"].get<uint32_t>()),
                  FormatBytes(slice), fmt::format("{:.1f}", row["payloads_per_step"].get<double>()),
                  FormatBytes(static_cast<uint64_t>(row["wire_bytes_per_step"].get<double>())),
                  FormatBytes(static_cast<uint64_t>(received)),
                  fmt::format("{:.2f}", row["received_over_unsharded"].get<double>()),
                  FormatDuration(row["time_s"]["median"]), FormatDuration(row["time_s"]["min"]),
                  FormatDuration(row["time_s"]["max"]),
                  fmt::format("{:.2f}x", row["time_over_unsharded"].get<double>()),
                  fmt::format("{:.0f}", own), SignedBytes(fixed), FormatBytes(peak),
                  fmt::format("{:.2f}", ratio), SignedBytes(over), fmt::format("{:.1f} B", per_own),
                  fmt::format("{:.1f} B", per_changed)});
  }
  table.Print(std::cout);
  const nlohmann::json& target = section["target"];
  if (target["met"].is_null()) {
    std::cout << fmt::format(
        "target: a TP={} replica's refit time within {:.1f}x of an unsharded one: not measured "
        "(no {} in --tp)\n",
        kTargetTp, kTargetTpSlowdown, kTargetTp);
  } else {
    std::cout << fmt::format(
        "target: a TP={} replica's refit time within {:.1f}x of an unsharded one: {:.2f}x "
        "measured -> {}\n",
        kTargetTp, kTargetTpSlowdown, target["time_over_unsharded"].get<double>(),
        target["met"].get<bool>() ? "met" : "NOT MET");
    std::cout << fmt::format(
        "target: the bytes a TP={} shard receives within {:.2f}x of an unsharded receiver's: "
        "{:.2f}x measured -> {}\n",
        kTargetTp, kTargetTpReceived, target["received_over_unsharded"].get<double>(),
        target["received_met"].get<bool>() ? "met" : "NOT MET");
  }
  std::cout << fmt::format(
      "time = median over the steps of the Publisher's Coordinator::Refit (Begin to the end of "
      "commit), every shard's flush verified as one replica by its canonical piece digests. "
      "Shard figures are the largest over the shards (and steps), each shard a daemon process of "
      "its own: slice = the bytes of its own tensors; own changes = elements of its slice a step "
      "changed; loaded-slice = its RSS once loaded minus the slice (libraries, digests); shard "
      "peak = its peak RSS during a delta (VmHWM reset before each); peak-loaded = that peak "
      "minus its RSS once loaded: the refits' memory; per own, per change = peak-loaded per own "
      "change, per change of the whole model (per step); recv/shard = the wire bytes the largest "
      "shard was sent per step (payloads are routed by holdings: each class of shards gets only "
      "its cut)\n"
      "changed elements identical for every layout: {}; every shard's tensors downloaded and "
      "equal to its slice computed independently of the loader\n\n",
      section["changed_identical_across_layouts"].get<bool>() ? "yes" : "NO");
}

// --- Embedded receiver ------------------------------------------------------------------------

// What the embedded section's receiver process is told on its command line.
struct EmbeddedChildArgs {
  uint64_t model_bytes = 0;
  uint64_t seed = 0;
  int threads = 1;
  std::string data_endpoint;
  std::string ready_file;
  std::string result_file;
};

Result<EmbeddedChildArgs> ParseEmbeddedChildArgs(int argc, char** argv) {
  REFIT_ASSIGN_OR_RETURN(const ChildFlags flags, ChildFlags::Parse(argc, argv, kEmbeddedChildFlag));
  EmbeddedChildArgs args;
  REFIT_ASSIGN_OR_RETURN(args.model_bytes, flags.Number("--model-bytes"));
  REFIT_ASSIGN_OR_RETURN(args.seed, flags.Number("--seed"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t threads, flags.Number("--threads"));
  args.threads = static_cast<int>(std::clamp<uint64_t>(threads, 1, ProducerStream::kMaxThreads));
  REFIT_ASSIGN_OR_RETURN(args.data_endpoint, flags.Text("--data-endpoint"));
  REFIT_ASSIGN_OR_RETURN(args.ready_file, flags.Text("--ready-file"));
  REFIT_ASSIGN_OR_RETURN(args.result_file, flags.Text("--result-file"));
  return args;
}

// The embedded section's receiver process: it draws the same synthetic model as the benchmark
// (same seed), registers those buffers with a ReceiverNode (no model file), serves until
// SIGTERM, then reports the fingerprint of its own buffers, read directly, not through the node.
// Its RSS at each stage goes into the ready file.
Status RunEmbeddedChild(const EmbeddedChildArgs& args) {
  // Before any thread starts, so that only sigwait below takes SIGTERM.
  sigset_t shutdown;
  sigemptyset(&shutdown);
  sigaddset(&shutdown, SIGTERM);
  sigaddset(&shutdown, SIGINT);
  pthread_sigmask(SIG_BLOCK, &shutdown, nullptr);

  REFIT_ASSIGN_OR_RETURN(const uint64_t rss_start, ProcessMemoryBytes("self", "VmRSS"));
  REFIT_ASSIGN_OR_RETURN(SyntheticModel model,
                         SyntheticModel::Make(args.model_bytes, args.seed, args.threads, nullptr));
  REFIT_ASSIGN_OR_RETURN(const uint64_t rss_model, ProcessMemoryBytes("self", "VmRSS"));
  const char* key = std::getenv(kApiKeyEnv);
  ReceiverNodeOptions options;
  options.transport_uri = fmt::format("zmq://?api_key_env={}", kApiKeyEnv);
  options.data_endpoint = args.data_endpoint;
  options.peers = {args.data_endpoint};
  options.control.bind_address = "127.0.0.1";
  options.control.port = 0;
  options.control.api_key = key == nullptr ? "" : key;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ReceiverNode> node, ReceiverNode::Make(options));
  const std::vector<MutableTensorView> buffers = model.mutable_views();
  for (const MutableTensorView& tensor : buffers) REFIT_RETURN_NOT_OK(node->RegisterTensor(tensor));
  REFIT_ASSIGN_OR_RETURN(const uint64_t rss_registered, ProcessMemoryBytes("self", "VmRSS"));
  REFIT_RETURN_NOT_OK(node->Start());
  REFIT_ASSIGN_OR_RETURN(const uint64_t rss_started, ProcessMemoryBytes("self", "VmRSS"));
  // Zero-copy: every tensor of the node's store is one of this process's buffers.
  const std::vector<TensorView> held = node->store().tensors();
  bool store_is_registered_memory = held.size() == buffers.size();
  for (size_t t = 0; store_is_registered_memory && t < held.size(); ++t) {
    store_is_registered_memory = held[t].bytes.data() == buffers[t].bytes.data() &&
                                 held[t].bytes.size() == buffers[t].bytes.size();
  }
  const nlohmann::json ready = {{"pid", static_cast<int64_t>(::getpid())},
                                {"control_url", node->control_url()},
                                {"data_endpoint", node->producer_endpoint()},
                                {"model_bytes", model.bytes()},
                                {"tensors", buffers.size()},
                                {"rss_start", rss_start},
                                {"rss_model", rss_model},
                                {"rss_registered", rss_registered},
                                {"rss_started", rss_started},
                                {"store_is_registered_memory", store_is_registered_memory}};
  REFIT_RETURN_NOT_OK(WriteTextFileAtomically(args.ready_file, ready.dump() + "\n"));
  int received = 0;
  sigwait(&shutdown, &received);
  node->Stop();
  REFIT_ASSIGN_OR_RETURN(const uint64_t rss_end, ProcessMemoryBytes("self", "VmRSS"));
  const nlohmann::json result = {
      {"fingerprint", fmt::format("{:016x}", FingerprintOf(model.views()))},
      {"version", node->store().version()},
      {"rss_end", rss_end}};
  return WriteTextFileAtomically(args.result_file, result.dump() + "\n");
}

Result<nlohmann::json> RunEmbedded(const Args& args, const std::string& work_dir) {
  nlohmann::json out;
  REFIT_ASSIGN_OR_RETURN(const std::string self, cli::SelfExecutable());
  REFIT_ASSIGN_OR_RETURN(std::vector<uint16_t> port, cli::FreeLoopbackPorts(1));
  const std::string ready_path = work_dir + "/embedded.ready";
  const std::string result_path = work_dir + "/embedded.result";
  const std::string log_path = work_dir + "/embedded.log";
  const std::vector<std::string> argv = {self,
                                         std::string(kEmbeddedChildFlag),
                                         "--model-bytes",
                                         std::to_string(args.embedded_model_bytes),
                                         "--seed",
                                         std::to_string(args.seed),
                                         "--threads",
                                         std::to_string(args.threads),
                                         "--data-endpoint",
                                         fmt::format("127.0.0.1:{}", port[0]),
                                         "--ready-file",
                                         ready_path,
                                         "--result-file",
                                         result_path};
  REFIT_ASSIGN_OR_RETURN(const pid_t pid, SpawnProcess(argv, log_path, log_path));
  // Stops the receiver process on every early return.
  ChildGuard guard{pid};
  REFIT_ASSIGN_OR_RETURN(const std::string ready_text,
                         WaitForReadyFile(ready_path, pid, kChildStartTimeout, log_path));
  const nlohmann::json ready = nlohmann::json::parse(ready_text, nullptr, false);
  if (!ready.is_object() || !ready.contains("control_url")) {
    return DataLoss("embedded receiver: malformed ready file {}", ready_path);
  }
  out["receiver"] = ready;
  const std::string child = std::to_string(pid);

  // The producer: this process, with the same model.
  REFIT_ASSIGN_OR_RETURN(
      SyntheticModel model,
      SyntheticModel::Make(args.embedded_model_bytes, args.seed, args.threads, nullptr));
  out["model_bytes"] = model.bytes();
  out["tensors"] = model.views().size();
  REFIT_ASSIGN_OR_RETURN(
      const std::string config_path,
      WriteRefitConfig(args, work_dir, "embedded", SectionChunkBytes(args.embedded_model_bytes)));
  REFIT_ASSIGN_OR_RETURN(
      const PublisherOptions options,
      PublisherOptionsFromConfig(config_path, {{ready["control_url"].get<std::string>(),
                                                ready["data_endpoint"].get<std::string>()}}));
  REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Publisher>> ranks,
                         MakeThreadRanks(1, options));
  REFIT_RETURN_NOT_OK(AdoptBaseline(ranks, model.views()));

  // Ascending densities, as the end-to-end section does (so that each delta's memory stays above
  // what the previous one left behind).
  std::vector<double> densities = args.densities;
  std::sort(densities.begin(), densities.end());
  out["rows"] = nlohmann::json::array();
  bool rss_reset = true;
  std::vector<std::pair<double, double>> points;
  for (size_t k = 0; k < densities.size(); ++k) {
    if (Status reset = ResetPeakRss(child); !reset.ok() && rss_reset) {
      rss_reset = false;
      std::cerr << "warning: " << reset.message()
                << "; peak RSS figures are peaks since the receiver process started\n";
    }
    REFIT_ASSIGN_OR_RETURN(const uint64_t before, ProcessMemoryBytes(child, "VmRSS"));
    const uint64_t changed = model.Step(/*step=*/k + 1, densities[k]);
    REFIT_ASSIGN_OR_RETURN(const RefitReport report, SyncDelta(ranks, model.views()));
    REFIT_ASSIGN_OR_RETURN(const uint64_t peak, ProcessMemoryBytes(child, "VmHWM"));
    REFIT_ASSIGN_OR_RETURN(const uint64_t after, ProcessMemoryBytes(child, "VmRSS"));
    if (report.changed_elements != changed) {
      return DataLoss("embedded: step {} changed {} elements but the producer found {}", k + 1,
                      changed, report.changed_elements);
    }
    const int64_t growth = static_cast<int64_t>(peak) - static_cast<int64_t>(before);
    points.emplace_back(static_cast<double>(changed), static_cast<double>(growth));
    out["rows"].push_back(
        {{"target_density", densities[k]},
         {"density", Density(report)},
         {"changed", changed},
         {"payloads", report.payloads},
         {"wire_bytes", report.wire_bytes},
         {"time_s", report.total_s},
         {"rss_before", before},
         {"peak_rss", peak},
         {"rss_after_commit", after},
         {"peak_growth_bytes", growth},
         {"peak_growth_per_changed", changed ? static_cast<double>(growth) / changed : 0.0},
         {"after_commit_growth_bytes", static_cast<int64_t>(after) - static_cast<int64_t>(before)},
         {"peak_over_model_bytes",
          static_cast<int64_t>(peak) - static_cast<int64_t>(model.bytes())}});
  }
  out["rss_reset_per_refit"] = rss_reset;
  if (std::optional<MemoryFit> fit = FitMemory(points)) {
    out["growth_fit"] = {{"fixed_bytes", fit->fixed_bytes},
                         {"bytes_per_changed", fit->bytes_per_changed}};
  }

  // The receiver's own buffers, read by that process after it stopped, against this model.
  REFIT_ASSIGN_OR_RETURN(const ChildExit exit, TerminateProcess(pid, kChildStopGrace));
  guard.done = true;
  if (!exit.ok()) {
    return Internal("embedded receiver exited with {}; its log ends with:\n{}", exit.Describe(),
                    FileTail(log_path));
  }
  std::ifstream result_file(result_path);
  const nlohmann::json result = nlohmann::json::parse(result_file, nullptr, false);
  if (!result.is_object() || !result.contains("fingerprint")) {
    return DataLoss("embedded receiver: no result in {}", result_path);
  }
  out["result"] = result;
  out["receiver_peak_rss_lifetime"] = exit.peak_rss_bytes;
  const std::string expected = fmt::format("{:016x}", FingerprintOf(model.views()));
  out["buffers_hold_last_model"] = result["fingerprint"] == expected;
  if (!out["buffers_hold_last_model"].get<bool>()) {
    return DataLoss("embedded receiver: its buffers' fingerprint {} is not the producer's {}",
                    result["fingerprint"].get<std::string>(), expected);
  }
  return out;
}

void PrintEmbedded(const nlohmann::json& section) {
  const nlohmann::json& receiver = section["receiver"];
  const uint64_t model_bytes = section["model_bytes"];
  std::cout << fmt::format(
      "== embedded receiver: a ReceiverNode in a process of its own over {} of buffers that "
      "process allocated and registered ({} tensors, RegisterTensor, no model file), 1 producer "
      "(Publisher) -> it over zmq:// + HTTP control\n",
      FormatBytes(model_bytes), receiver["tensors"].get<size_t>());
  const uint64_t start = receiver["rss_start"], filled = receiver["rss_model"];
  const uint64_t registered = receiver["rss_registered"], started = receiver["rss_started"];
  Table stages({"receiver process", "RSS", "step", "over model"});
  const auto over_model = [&](uint64_t rss) {
    return SignedBytes(static_cast<int64_t>(rss) - static_cast<int64_t>(model_bytes));
  };
  stages.AddRow({"started (libraries)", FormatBytes(start), "-", over_model(start)});
  stages.AddRow({"buffers drawn", FormatBytes(filled),
                 SignedBytes(static_cast<int64_t>(filled) - static_cast<int64_t>(start)),
                 over_model(filled)});
  stages.AddRow({"tensors registered", FormatBytes(registered),
                 SignedBytes(static_cast<int64_t>(registered) - static_cast<int64_t>(filled)),
                 over_model(registered)});
  stages.AddRow({"node started", FormatBytes(started),
                 SignedBytes(static_cast<int64_t>(started) - static_cast<int64_t>(registered)),
                 over_model(started)});
  stages.Print(std::cout);
  Table table({"density", "changed", "wire", "time", "RSS before", "peak", "growth",
               "growth/changed", "after commit", "after - before", "peak over model"});
  for (const nlohmann::json& row : section["rows"]) {
    table.AddRow({fmt::format("{:.3f}%", 100 * row["density"].get<double>()),
                  std::to_string(row["changed"].get<uint64_t>()), FormatBytes(row["wire_bytes"]),
                  FormatDuration(row["time_s"]), FormatBytes(row["rss_before"]),
                  FormatBytes(row["peak_rss"]), SignedBytes(row["peak_growth_bytes"]),
                  fmt::format("{:.1f} B", row["peak_growth_per_changed"].get<double>()),
                  FormatBytes(row["rss_after_commit"]),
                  SignedBytes(row["after_commit_growth_bytes"]),
                  SignedBytes(row["peak_over_model_bytes"])});
  }
  table.Print(std::cout);
  if (section.contains("growth_fit")) {
    const nlohmann::json& fit = section["growth_fit"];
    const double fixed = fit["fixed_bytes"];
    std::cout << fmt::format(
        "peak growth over the deltas (least squares): {} {} + {:.1f} B per changed element\n",
        fixed < 0 ? "-" : "+", FormatBytes(static_cast<uint64_t>(std::fabs(fixed))),
        fit["bytes_per_changed"].get<double>());
  }
  std::cout << fmt::format(
      "registering {} of buffers and starting the node added {} of RSS (a copy of the model would "
      "add {}); the node's store is the registered memory (same addresses): {}; after the last "
      "commit that process's own buffers, read directly, hold the producer's model: {}. Peaks are "
      "per refit (VmHWM reset before each); growth = peak - RSS before the refit\n\n",
      FormatBytes(model_bytes),
      SignedBytes(static_cast<int64_t>(started) - static_cast<int64_t>(filled)),
      FormatBytes(model_bytes), receiver["store_is_registered_memory"].get<bool>() ? "yes" : "NO",
      section["buffers_hold_last_model"].get<bool>() ? "yes" : "NO");
}

// --- Main -------------------------------------------------------------------------------------

// The 1, 5 and 15 minute load averages (/proc/loadavg): other work on the machine moves every
// figure, so the report says how busy it was.
std::vector<double> LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::vector<double> load(3, 0.0);
  in >> load[0] >> load[1] >> load[2];
  return load;
}

Status Run(const Args& args) {
  // One model file at a time is on disk. Memory, at the FULL refit: this process holds the model
  // and the tracker's baseline; each daemon its copy (read into memory, or every page written
  // copy-on-write by the FULL) and the FULL's undo log, the old bits of every element until
  // commit.
  const uint64_t e2e_bytes = args.skip_end_to_end ? 0 : args.model_bytes;
  const uint64_t largest_fanout =
      args.fanout.empty() ? 0 : *std::max_element(args.fanout.begin(), args.fanout.end());
  const uint64_t fanout_bytes = args.skip_fanout ? 0 : args.fanout_model_bytes;
  // The new sections, one at a time: producers — this process's model and baseline (the reset's
  // second model briefly), each daemon's model, each persistent rank process's copy of the model
  // (the baselines of all ranks add up to one), and two checkpoint files; tp — this process's
  // model, baseline and two copies of the shards, the shards' daemons (one model in all), and the
  // shard files; embedded — this process's model and baseline and the receiver process's model.
  const uint64_t producers_bytes = args.skip_producers ? 0 : args.producers_model_bytes;
  const uint64_t largest_world =
      args.producers.empty() ? 0 : *std::max_element(args.producers.begin(), args.producers.end());
  const uint64_t tp_bytes = args.skip_tp ? 0 : args.tp_model_bytes;
  const uint64_t embedded_bytes = args.skip_embedded ? 0 : args.embedded_model_bytes;
  const uint64_t memory =
      kMemoryMarginBytes +
      std::max({(2 + 2 * kEndToEndReceivers) * e2e_bytes, (2 + 2 * largest_fanout) * fanout_bytes,
                (4 + args.producers_receivers + largest_world) * producers_bytes, 5 * tp_bytes,
                3 * embedded_bytes});
  const uint64_t disk =
      std::max({e2e_bytes, fanout_bytes, 2 * producers_bytes, tp_bytes}) + kDiskMarginBytes;
  const std::string temp_dir = std::filesystem::temp_directory_path().string();
  if (!args.work_dir.empty()) {
    std::error_code made;
    std::filesystem::create_directories(args.work_dir, made);
    if (made) return IoError("--work-dir {}: cannot create it: {}", args.work_dir, made.message());
  }
  REFIT_RETURN_NOT_OK(CheckRoom(args.work_dir.empty() ? temp_dir : args.work_dir, disk, memory,
                                "the model and the tracker's baseline in this process; per daemon "
                                "its model and, during the FULL, an undo log as large",
                                "use a smaller --model-mib, --fanout-model-mib, "
                                "--producers-model-mib, --tp-model-mib or --embedded-model-mib"));
  std::string work_dir = args.work_dir;
  bool scratch = false;
  if (work_dir.empty()) {
    REFIT_ASSIGN_OR_RETURN(work_dir, cli::MakeTemporaryDirectory("refit-e2e-bench"));
    scratch = true;
  }
  ::setenv(kApiKeyEnv, cli::GenerateApiKey().c_str(), /*overwrite=*/1);

  nlohmann::json report;
  report["machine"] = {{"hardware_threads", std::thread::hardware_concurrency()},
                       {"compare_simd_target", std::string(BestCompareTarget())},
                       {"load_average_start", LoadAverage()}};
  if (!args.json) {
    std::cout << fmt::format(
        "e2e_bench: compare kernel {} (Highway, chosen at run time), {} "
        "hardware threads\n\n",
        BestCompareTarget(), std::thread::hardware_concurrency());
  }
  report["config"] = {{"quick", args.quick},
                      {"chunk_bytes", args.chunk_bytes},
                      {"bucket_bytes", args.bucket_bytes},
                      {"threads_per_stage", args.threads},
                      {"receiver_mode", args.receiver_mmap ? "mmap" : "ram"},
                      {"transport", "zmq:// (loopback) + HTTP control"},
                      {"steps", args.steps},
                      {"step_density", args.step_density},
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
  if (!args.skip_producers && !args.producers.empty()) {
    Result<nlohmann::json> producers = RunProducers(args, work_dir);
    if (!producers.ok()) {
      return producers.status().WithContext("producers (work dir " + work_dir + ")");
    }
    report["producers"] = *producers;
    if (!args.json) PrintProducers(*producers);
  }
  if (!args.skip_tp) {
    Result<nlohmann::json> tp = RunTensorParallel(args, work_dir);
    if (!tp.ok()) return tp.status().WithContext("tp (work dir " + work_dir + ")");
    report["tp"] = *tp;
    if (!args.json) PrintTensorParallel(*tp);
  }
  if (!args.skip_embedded) {
    Result<nlohmann::json> embedded = RunEmbedded(args, work_dir);
    if (!embedded.ok())
      return embedded.status().WithContext("embedded (work dir " + work_dir + ")");
    report["embedded"] = *embedded;
    if (!args.json) PrintEmbedded(*embedded);
  }
  report["machine"]["load_average_end"] = LoadAverage();
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
  if (argc >= 2 && (std::string_view(argv[1]) == kEmbeddedChildFlag ||
                    std::string_view(argv[1]) == kProducerRankFlag)) {
    Status status;
    if (std::string_view(argv[1]) == kEmbeddedChildFlag) {
      Result<EmbeddedChildArgs> child = ParseEmbeddedChildArgs(argc, argv);
      status = child.ok() ? RunEmbeddedChild(*child) : child.status();
    } else {
      Result<ChildFlags> flags = ChildFlags::Parse(argc, argv, kProducerRankFlag);
      status = flags.ok() ? RunProducerRank(*flags) : flags.status();
    }
    if (!status.ok()) {
      std::cerr << "e2e_bench " << argv[1] << ": " << status.ToString() << "\n";
      return 1;
    }
    return 0;
  }
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
