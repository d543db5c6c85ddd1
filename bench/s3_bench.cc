// s3_bench: refit through an object store (s3://), measured side by side in one run against a
// FULL transfer through the same store and against the zmq:// relay tree on the same steps.
//
// One simulated bf16 model (the Adam simulator: fp32 master weights and Adam state, bf16 export
// by round-to-nearest-even) is written once and loaded by two fleets of `refit serve` daemons on
// loopback:
//   s3   each payload is uploaded to s3://<bucket>/<run prefix> on a real S3 server, its manifest
//        POSTed to every daemon's control plane; each daemon downloads, verifies and stages it,
//        and the object is deleted once every daemon has ACKed;
//   zmq  each payload goes once to the root of the zmq:// relay tree, relays forward it.
// W producers (trackers over the same model, baseline = the model the daemons loaded) refit each
// fleet. In order: a FULL through s3, a FULL through zmq, the raw-copy yardsticks (the model's
// bytes uncompressed, in objects or messages of the payload size: through the store, this process
// uploads each object, downloads it once per daemon and deletes it; over ZeroMQ, it sends every
// byte to each of as many `refit raw-copy-sink` processes — no codec, digest, control plane or
// apply; every refit time gets a "vs raw" ratio against its transport's), then for each --densities
// value one optimizer step with the learning rate calibrated to that density and a delta refit
// through s3 and through zmq — the same model bytes against the same committed baseline, so the
// same delta. The run's prefix must be empty after every s3 refit (objects deleted after the
// ACKs, no unfinished multipart upload); after the last step every tensor of every daemon of
// both fleets is compared with the trainer's bytes. Prints a table, and JSON with --json. See
// docs/benchmarking.md.
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "bench_fleet.h"
#include "bench_util.h"
#include "cli_common.h"
#include "config_file.h"
#include "flags.h"
#include "fleet_coordinator.h"
#include "local_fleet.h"
#include "loopback_ports.h"
#include "process.h"
#include "progress.h"
#include "raw_copy.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "table.h"
#include "transport/s3/s3_client.h"
#include "transport/s3/s3_layout.h"
#include "util/environment.h"
#include "workload/simulator.h"

#ifndef REFIT_BINARY
#error "REFIT_BINARY must name the refit executable (set by bench/CMakeLists.txt)"
#endif

namespace refit::bench {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kDefaultModelBytes = 512 * kMiB;
// --quick: a smoke run of a few seconds.
constexpr uint64_t kQuickModelBytes = 32 * kMiB;
// The test server (scripts/s3-test-server.sh) keeps every object in a 4 GiB memstore, parts of
// multipart uploads included, and other engineers' tests share it. Objects are deleted after
// each ACK, but RGW frees a deleted object's data only when its garbage collector runs (every
// few seconds on the test server, after 2 hours by RGW's default), and a run killed mid-FULL
// leaves up to a whole FULL behind (about 0.7 of the model after compression); 1.5 GiB keeps a
// run's FULL and yardstick well inside the store.
constexpr uint64_t kMaxModelBytes = 3 * kGiB / 2;
// The simulator holds the fp32 master weight, Adam's m and v and the bf16 export: 14 bytes per
// element (simulator.h), i.e. 7 bytes per byte of bf16 model.
constexpr uint64_t kSimulatorBytesPerModelByte = 7;
// Memory beyond the model copies: libraries and the pipelines' bounded buffers.
constexpr uint64_t kMemoryMarginBytes = 512 * kMiB;
// Room the work directory needs beyond the model file: safetensors header, daemon logs.
constexpr uint64_t kDiskMarginBytes = 64 * kMiB;
// Export chunks: about this many per model, so that each of W producers owns several and encode,
// send and apply overlap, but no larger than e2e_bench's 64 MiB nor smaller than 1 MiB.
constexpr uint64_t kChunksPerModel = 16;
constexpr uint64_t kMinChunkBytes = kMiB;
constexpr uint64_t kMaxChunkBytes = 64 * kMiB;
// Payloads a producer keeps in flight per sending thread (ProducerStream's default rule).
constexpr size_t kPayloadsInFlightPerSender = 2;
// Environment variable through which the daemons and this process share the run's api key (never
// on a command line, where `ps` shows it).
constexpr const char* kApiKeyEnv = "REFIT_S3_BENCH_API_KEY";
// Where the default endpoint comes from: what scripts/s3-test-server.sh env exports.
constexpr const char* kEndpointEnv = "REFIT_TEST_S3_ENDPOINT";
// One bucket for every run, each run under its own prefix: S3Client can create a bucket but not
// delete one, so fresh buckets would pile up on the shared server.
constexpr std::string_view kDefaultBucket = "refit-s3-bench";
// Objects of the store yardstick live here, under the run's prefix.
constexpr std::string_view kYardstickDir = "yardstick";

uint64_t ChunkBytes(uint64_t model_bytes) {
  return std::clamp(model_bytes / kChunksPerModel, kMinChunkBytes, kMaxChunkBytes);
}

// --- Arguments ------------------------------------------------------------------------------

struct Args {
  uint64_t model_bytes = kDefaultModelBytes;
  std::vector<double> densities = {0.01, 0.03, 0.05};
  size_t receivers = 2;
  uint32_t producers = 2;
  std::string endpoint;
  std::string bucket = std::string(kDefaultBucket);
  // Extra s3:// URI parameters (part_size, parts_in_flight, …) for producers and daemons.
  std::vector<std::pair<std::string, std::string>> s3_params;
  // Encode and serialize threads per producer: 2 producers × 1 fill the 2 cores this was written
  // for.
  int threads = 1;
  // Sending threads per producer: an s3:// Send holds its thread through upload, the daemons'
  // downloads and the DELETE, so more than one keeps the store busy.
  int send_threads = 2;
  bool yardstick = true;
  // "-": JSON on stdout instead of the table.
  std::string json_path;
  bool quick = false;
  std::string work_dir;
  std::string refit_binary = REFIT_BINARY;
  uint64_t seed = 42;
  bool help = false;
};

constexpr std::string_view kCredentialsHelp =
    "The S3 server's credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; for the\n"
    "test server: eval \"$(bash scripts/s3-test-server.sh env)\"\n";

// A count in [1, max], into `*target`.
template <typename Count>
FlagSet::Setter CountFlag(Count* target, uint64_t max) {
  return [target, max](std::string_view flag, std::string_view text) -> Status {
    REFIT_ASSIGN_OR_RETURN(uint64_t value, ParseUnsigned(flag, text));
    if (value < 1 || value > max) {
      return InvalidArgument("{}: {} is not in [1, {}]", flag, value, max);
    }
    *target = static_cast<Count>(value);
    return Status::OK();
  };
}

// Bounds of the fleet flags: LocalFleet starts one process per receiver on this machine.
constexpr uint64_t kMaxReceivers = 64;
constexpr uint64_t kMaxProducers = 64;

// Declare every flag of s3_bench over `args`; --model-bytes goes to `model_bytes` (it wins over
// --quick's size, whatever the order).
FlagSet DeclareFlags(Args& args, std::optional<uint64_t>& model_bytes) {
  FlagSet flags("s3_bench", std::string(kCredentialsHelp));
  flags.Switch("--help", "print this and exit", &args.help);
  flags.Switch("--quick", "a smoke run of a few seconds (32 MiB)", &args.quick);
  flags.Value("--model-bytes", "SIZE", "the simulated model (e.g. 512MiB)",
              [&model_bytes](std::string_view, std::string_view text) -> Status {
                REFIT_ASSIGN_OR_RETURN(model_bytes, config::ParseByteSize(std::string(text)));
                return Status::OK();
              });
  flags.Value("--densities", "D,D,...", "one optimizer step and delta refit per density",
              [&args](std::string_view flag, std::string_view text) -> Status {
                args.densities.clear();
                for (std::string_view part : SplitCommas(text)) {
                  REFIT_ASSIGN_OR_RETURN(double density,
                                         ParseDensity(flag, part, /*allow_one=*/false));
                  args.densities.push_back(density);
                }
                return Status::OK();
              });
  flags.Value("--receivers", "N", "daemons per fleet", CountFlag(&args.receivers, kMaxReceivers));
  flags.Value("--producers", "W", "producers per fleet", CountFlag(&args.producers, kMaxProducers));
  flags.Text("--endpoint", "URL", "the S3 server (default: $REFIT_TEST_S3_ENDPOINT)",
             &args.endpoint);
  flags.Text("--bucket", "NAME", "the bucket every run's prefix lives in", &args.bucket);
  flags.Value("--s3-param", "KEY=VALUE", "an s3:// URI parameter (repeatable)",
              [&args](std::string_view, std::string_view text) -> Status {
                const size_t equals = text.find('=');
                if (equals == std::string_view::npos || equals == 0) {
                  return InvalidArgument("--s3-param: '{}' is not KEY=VALUE", text);
                }
                args.s3_params.emplace_back(std::string(text.substr(0, equals)),
                                            std::string(text.substr(equals + 1)));
                return Status::OK();
              });
  flags.Value("--threads", "N", "encode and serialize threads per producer",
              CountFlag(&args.threads, ProducerStreamOptions::kMaxThreads));
  flags.Value("--send-threads", "N", "sending threads per producer",
              CountFlag(&args.send_threads, ProducerStreamOptions::kMaxThreads));
  flags.Switch("--no-yardstick", "skip the raw-copy yardsticks",
               [&args] { args.yardstick = false; });
  flags.Text("--json", "FILE|-", "write the JSON report (-: on stdout, instead of the table)",
             &args.json_path);
  flags.Text("--work-dir", "DIR", "where the model and the daemons' logs go", &args.work_dir);
  flags.Text("--refit-binary", "PATH", "the refit executable", &args.refit_binary);
  flags.Unsigned("--seed", "N", "the simulator's seed", &args.seed);
  return flags;
}

std::string Usage() {
  Args args;
  std::optional<uint64_t> model_bytes;
  return DeclareFlags(args, model_bytes).Usage();
}

Result<Args> ParseArgs(int argc, char** argv) {
  Args args;
  std::optional<uint64_t> model_bytes;
  REFIT_RETURN_NOT_OK(DeclareFlags(args, model_bytes).Parse(argc, argv));
  if (args.help) return args;
  if (args.quick) args.model_bytes = kQuickModelBytes;
  // An explicit size wins over --quick.
  if (model_bytes) args.model_bytes = *model_bytes;
  if (args.model_bytes < kMiB) {
    return InvalidArgument("--model-bytes {} is below 1 MiB", args.model_bytes);
  }
  if (args.model_bytes > kMaxModelBytes) {
    return InvalidArgument(
        "--model-bytes {} is over {}: the S3 test server keeps every object in a 4 GiB memstore "
        "shared with other users, and a run cut short can leave a whole FULL there",
        FormatBytes(args.model_bytes), FormatBytes(kMaxModelBytes));
  }
  if (args.densities.empty()) return InvalidArgument("--densities: give at least one density");
  std::sort(args.densities.begin(), args.densities.end());
  if (args.endpoint.empty()) {
    const char* endpoint = std::getenv(kEndpointEnv);
    if (endpoint == nullptr || *endpoint == '\0') {
      return InvalidArgument(
          "no S3 endpoint: pass --endpoint http://host:port or set {} (for the test server: "
          "eval \"$(bash scripts/s3-test-server.sh env)\")",
          kEndpointEnv);
    }
    args.endpoint = endpoint;
  }
  for (const auto& [key, unused] : args.s3_params) {
    if (key == "endpoint" || key == "api_key_env" || key == "api_key" || key == "chain") {
      return InvalidArgument("--s3-param {}: the bench sets it itself", key);
    }
  }
  return args;
}

// --- Resources --------------------------------------------------------------------------------

// The 1, 5 and 15 minute load averages: other work on the machine skews every time measured.
std::vector<double> LoadAverages() {
  std::ifstream in("/proc/loadavg");
  std::vector<double> loads(3, 0.0);
  for (double& load : loads) in >> load;
  return loads;
}

// --- The object store -------------------------------------------------------------------------

// The run's place in the bucket, and a client with the transport's own settings.
struct Store {
  TransportUri uri;
  internal::S3TransportConfig config;
  std::unique_ptr<S3Client> client;
  std::string prefix;
};

std::string RandomHex() {
  std::random_device device;
  return fmt::format("{:08x}{:08x}", device(), device());
}

// Parse the run's s3:// URI as the transport does, and create the bucket (an existing one of this
// account is fine).
Result<Store> OpenStore(const Args& args) {
  Store store;
  store.prefix = "run-" + RandomHex();
  store.uri.scheme = "s3";
  store.uri.target = args.bucket + "/" + store.prefix;
  store.uri.params.emplace_back("endpoint", args.endpoint);
  store.uri.params.insert(store.uri.params.end(), args.s3_params.begin(), args.s3_params.end());
  Result<internal::S3TransportConfig> config = internal::ParseS3TransportUri(store.uri);
  if (!config.ok()) {
    return config.status().WithContext(
        "the S3 settings (for the test server: eval \"$(bash scripts/s3-test-server.sh env)\")");
  }
  store.config = std::move(config).ValueOrDie();
  REFIT_ASSIGN_OR_RETURN(store.client, S3Client::Make(store.config.client));
  Status created = store.client->CreateBucket();
  if (!created.ok()) {
    return created.WithContext(fmt::format(
        "cannot create bucket '{}' at {} (is the server up? bash scripts/s3-test-server.sh "
        "status)",
        args.bucket, args.endpoint));
  }
  return store;
}

// What the run's prefix holds: objects and unfinished multipart uploads.
struct Leftovers {
  std::vector<std::string> objects;
  std::vector<S3MultipartUpload> uploads;
  bool empty() const { return objects.empty() && uploads.empty(); }
};

Result<Leftovers> ListLeftovers(S3Client& client, const std::string& prefix) {
  Leftovers left;
  REFIT_ASSIGN_OR_RETURN(std::vector<S3ObjectInfo> objects, client.ListObjects(prefix + "/"));
  for (const S3ObjectInfo& object : objects) left.objects.push_back(object.key);
  REFIT_ASSIGN_OR_RETURN(left.uploads, client.ListMultipartUploads(prefix + "/"));
  return left;
}

// Fail naming what an s3 refit left behind: every object must be deleted once all daemons ACKed.
Status CheckStoreEmpty(const Store& store, std::string_view after) {
  Result<Leftovers> listed = ListLeftovers(*store.client, store.prefix);
  if (!listed.ok()) {
    return listed.status().WithContext(fmt::format(
        "listing s3://{}/{} after {}", store.config.client.bucket, store.prefix, after));
  }
  const Leftovers& left = *listed;
  if (left.empty()) return Status::OK();
  return DataLoss(
      "after {}: s3://{}/{} holds {} object(s) and {} unfinished multipart upload(s), first "
      "'{}'; every object should be deleted once all daemons ACKed",
      after, store.config.client.bucket, store.prefix, left.objects.size(), left.uploads.size(),
      left.objects.empty() ? left.uploads.front().key : left.objects.front());
}

// Delete whatever a failed run left under its prefix, so that the shared server's memstore gets
// its memory back. Best effort: the run's outcome is already known.
void CleanStore(const Store& store) {
  Result<Leftovers> left = ListLeftovers(*store.client, store.prefix);
  if (!left.ok()) return;
  for (const std::string& key : left->objects) store.client->DeleteObject(key).IgnoreError();
  for (const S3MultipartUpload& upload : left->uploads) {
    store.client->AbortMultipartUpload(upload.key, upload.upload_id).IgnoreError();
  }
}

// The store's raw copy, the s3 fleet's yardstick: the model's bytes, uncompressed, in objects of
// `object_bytes` (the payload size), `concurrency` at a time (the producers' sending threads),
// each uploaded, downloaded once per daemon (concurrently, as the daemons do) and deleted — what
// the transport does per payload, without encoding, manifests, staging or applying. Every
// download is compared with what was uploaded.
struct StoreYardstick {
  uint64_t bytes = 0;
  uint64_t objects = 0;
  uint64_t object_bytes = 0;
  size_t concurrency = 0;
  size_t downloads_per_object = 0;
  double time_s = 0;
  // Summed over the workers.
  double upload_s = 0;
  double download_s = 0;
  double delete_s = 0;
};

// Copy bytes [offset, offset + out.size()) of the tensors' concatenation into `out`.
void CopyModelRange(const std::vector<TensorView>& model, uint64_t offset,
                    std::span<std::byte> out) {
  uint64_t start = 0;
  size_t copied = 0;
  for (const TensorView& tensor : model) {
    const uint64_t size = tensor.bytes.size();
    if (copied < out.size() && offset + copied < start + size) {
      const uint64_t from = offset + copied - start;
      const size_t n = static_cast<size_t>(std::min<uint64_t>(size - from, out.size() - copied));
      std::memcpy(out.data() + copied, tensor.bytes.data() + from, n);
      copied += n;
    }
    start += size;
  }
}

Result<StoreYardstick> MeasureStore(const Store& store, const std::vector<TensorView>& model,
                                    uint64_t object_bytes, size_t concurrency, size_t receivers) {
  uint64_t total = 0;
  for (const TensorView& tensor : model) total += tensor.bytes.size();
  object_bytes = std::max<uint64_t>(object_bytes, 1);
  const uint64_t objects = (total + object_bytes - 1) / object_bytes;
  StoreYardstick out{.bytes = total,
                     .objects = objects,
                     .object_bytes = object_bytes,
                     .concurrency = concurrency,
                     .downloads_per_object = receivers};
  std::atomic<uint64_t> next{0};
  std::mutex mutex;
  Status first_error;
  auto worker = [&] {
    double upload_s = 0, download_s = 0, delete_s = 0;
    std::vector<std::byte> bytes(object_bytes);
    for (uint64_t i = next++; i < objects; i = next++) {
      const std::span<std::byte> object(bytes.data(),
                                        std::min(object_bytes, total - i * object_bytes));
      CopyModelRange(model, i * object_bytes, object);
      const std::string key = fmt::format("{}/{}/{:06}", store.prefix, kYardstickDir, i);
      double t0 = Now();
      Status status = store.client->Upload(key, object, store.config.transfer);
      upload_s += Now() - t0;
      t0 = Now();
      std::vector<Status> downloaded(receivers);
      {
        std::vector<std::jthread> readers;
        for (size_t r = 0; status.ok() && r < receivers; ++r) {
          readers.emplace_back([&, r] {
            Result<std::vector<std::byte>> got =
                store.client->Download(key, object.size(), store.config.transfer);
            if (!got.ok()) {
              downloaded[r] = got.status();
            } else if (got->size() != object.size() ||
                       std::memcmp(got->data(), object.data(), object.size()) != 0) {
              downloaded[r] = DataLoss("{}: download {} differs from what was uploaded", key, r);
            }
          });
        }
      }
      download_s += Now() - t0;
      for (const Status& s : downloaded) {
        if (status.ok()) status = s;
      }
      t0 = Now();
      Status deleted = store.client->DeleteObject(key);
      delete_s += Now() - t0;
      if (status.ok()) status = deleted;
      std::lock_guard lock(mutex);
      if (!status.ok() && first_error.ok()) first_error = status;
      if (!first_error.ok()) return;
    }
    std::lock_guard lock(mutex);
    out.upload_s += upload_s;
    out.download_s += download_s;
    out.delete_s += delete_s;
  };
  const double t0 = Now();
  {
    std::vector<std::jthread> workers;
    for (size_t k = 1; k < concurrency; ++k) workers.emplace_back(worker);
    worker();
  }
  out.time_s = Now() - t0;
  REFIT_RETURN_NOT_OK(first_error.WithContext("store yardstick"));
  return out;
}

// --- Fleets -----------------------------------------------------------------------------------

// Start the daemons of one fleet, labelled `transport`. `daemon_uri`: their --transport (empty:
// the zmq:// relay tree); both planes' api key is kApiKeyEnv's.
Result<BenchFleet> StartDaemons(const Args& args, const std::string& transport,
                                const std::string& work_dir, const std::string& model_path,
                                const std::string& daemon_uri) {
  std::error_code made_dir;
  std::filesystem::create_directories(work_dir, made_dir);
  if (made_dir) return IoError("cannot create {}: {}", work_dir, made_dir.message());
  testkit::LocalFleetOptions fleet_options;
  fleet_options.refit_binary = args.refit_binary;
  fleet_options.receivers = testkit::LocalFleetOptions::Replicas(model_path, args.receivers);
  fleet_options.api_key_env = kApiKeyEnv;
  fleet_options.work_dir = work_dir;
  fleet_options.transport_uri = daemon_uri;
  return StartBenchFleet(transport, fleet_options);
}

// Make the fleet's producers and coordinator, sending through `producer_uri`, with the model as
// every tracker's baseline (once both fleets' daemons are started: AttachProducers says why).
Status MakeCoordinator(const Args& args, const TransportUri& producer_uri,
                       const std::vector<TensorView>& model, BenchFleet& fleet) {
  BenchProducers producers;
  producers.transport = producer_uri;
  producers.producers = args.producers;
  producers.stream.chunk_bytes = ChunkBytes(args.model_bytes);
  producers.stream.encode_threads = args.threads;
  producers.stream.serialize_threads = args.threads;
  producers.stream.send_threads = args.send_threads;
  producers.stream.max_payloads_in_flight =
      kPayloadsInFlightPerSender * static_cast<size_t>(args.send_threads);
  return AttachProducers(fleet, producers, kApiKeyEnv, model);
}

// --- Refits -----------------------------------------------------------------------------------

struct Row {
  std::string transport;
  bool full = false;
  // The optimizer step before this refit (0: the model the daemons loaded).
  uint64_t step = 0;
  double target_density = 0;
  double learning_rate = 0;
  RefitReport report;
};

Result<Row> MeasureRefit(BenchFleet& fleet, bool full, uint64_t step) {
  Row row;
  row.transport = fleet.label;
  row.full = full;
  row.step = step;
  Result<RefitReport> report = RefitOfKind(fleet, full);
  if (!report.ok()) return report.status().WithContext(fmt::format("after step {}", step));
  row.report = std::move(report).ValueOrDie();
  return row;
}

double Ratio(double numerator, double denominator) {
  return numerator / std::max(denominator, 1e-9);
}

// `full`: the FULL through the same transport; `s3_full`: the FULL through s3; `zmq_peer`: for an
// s3 row, the zmq row of the same step.
// `raw_copy_s`: the raw copy through the same transport (0: not measured).
nlohmann::json RowJson(const Row& row, const Row& full, const Row& s3_full, const Row* zmq_peer,
                       size_t receivers, double raw_copy_s) {
  const RefitReport& r = row.report;
  nlohmann::json producers = nlohmann::json::array();
  for (const StreamReport& s : r.producers) {
    producers.push_back({{"owned_chunks", s.owned_chunks},
                         {"payloads", s.payloads},
                         {"items", s.items},
                         {"item_bytes", s.item_bytes},
                         {"wire_bytes", s.wire_bytes},
                         {"stages", ProducerStagesJson(s)}});
  }
  nlohmann::json daemons = nlohmann::json::array();
  for (const ReceiverOutcome& outcome : r.receivers)
    daemons.push_back(ReceiverOutcomeJson(outcome));
  nlohmann::json out = {
      {"transport", row.transport},
      {"kind", row.full ? "full" : "delta"},
      {"step", row.step},
      {"transfer_id", r.plan.transfer_id.ToHex()},
      {"target_version", r.plan.target_version},
      {"target_density", row.full ? nlohmann::json(nullptr) : nlohmann::json(row.target_density)},
      {"learning_rate", row.full ? nlohmann::json(nullptr) : nlohmann::json(row.learning_rate)},
      {"density", Density(r)},
      {"changed", r.changed_elements},
      {"total_elements", r.total_elements},
      {"payloads", r.payloads},
      {"wire_bytes", r.wire_bytes},
      {"wire_over_full",
       Ratio(static_cast<double>(r.wire_bytes), static_cast<double>(full.report.wire_bytes))},
      {"wire_bytes_per_changed",
       r.changed_elements ? static_cast<double>(r.wire_bytes) / r.changed_elements : 0.0},
      {"time_s", r.total_s},
      {"prepare_s", r.prepare_s},
      {"stream_s", r.stream_s},
      {"flush_s", r.flush_s},
      {"commit_s", r.commit_s},
      {"speedup_vs_full", Ratio(full.report.total_s, r.total_s)},
      {"speedup_vs_s3_full", Ratio(s3_full.report.total_s, r.total_s)},
      {"time_over_raw_copy",
       raw_copy_s > 0 ? nlohmann::json(Ratio(r.total_s, raw_copy_s)) : nlohmann::json(nullptr)},
      {"producers", producers},
      {"receivers", daemons}};
  if (row.transport == "s3") {
    // One upload, one download per daemon: every byte crosses the store 1 + N times.
    out["store_traffic_bytes"] = r.wire_bytes * (1 + receivers);
  }
  if (zmq_peer != nullptr) {
    out["s3_over_zmq_time"] = Ratio(r.total_s, zmq_peer->report.total_s);
    out["same_wire_bytes_as_zmq"] = r.wire_bytes == zmq_peer->report.wire_bytes;
  }
  return out;
}

// --- Main -------------------------------------------------------------------------------------

Result<nlohmann::json> RunBench(const Args& args, const std::string& work_dir, const Store& store) {
  nlohmann::json out;
  out["load_average_start"] = LoadAverages();
  const std::string model_path = work_dir + "/model.safetensors";

  SimulatorOptions sim_options;
  sim_options.export_dtype = DType::kBFloat16;
  sim_options.tensors = MakeTransformerSpec(args.model_bytes, DType::kBFloat16);
  sim_options.seed = args.seed;
  sim_options.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  double t0 = Now();
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<TrainingSimulator> simulator,
                         TrainingSimulator::Make(sim_options));
  const std::vector<TensorView> model = simulator->Exported();
  out["model"] = {{"bytes", simulator->exported_bytes()},
                  {"tensors", model.size()},
                  {"dtype", "bfloat16"},
                  {"generator", "TrainingSimulator (fp32 master + Adam, bf16 RNE export)"},
                  {"generate_s", Now() - t0}};
  t0 = Now();
  REFIT_RETURN_NOT_OK(WriteSafetensors(model_path, model, {{kWeightVersionMetadataKey, "0"}}));
  out["model"]["write_s"] = Now() - t0;

  ::setenv(kApiKeyEnv, testkit::GenerateApiKey().c_str(), /*overwrite=*/1);
  REFIT_ASSIGN_OR_RETURN(
      BenchFleet s3, StartDaemons(args, "s3", work_dir + "/s3", model_path, store.uri.ToString()));
  REFIT_ASSIGN_OR_RETURN(
      BenchFleet zmq, StartDaemons(args, "zmq", work_dir + "/zmq", model_path, /*daemon_uri=*/""));
  REFIT_RETURN_NOT_OK(MakeCoordinator(args, store.uri, model, s3));
  REFIT_ASSIGN_OR_RETURN(TransportUri zmq_uri, TransportUri::Parse("zmq://"));
  REFIT_RETURN_NOT_OK(MakeCoordinator(args, zmq_uri, model, zmq));
  // Both fleets read the file into memory: the path can go, and with it its page cache.
  std::filesystem::remove(model_path);
  out["daemon_start_s"] = {{"s3", s3.start_s}, {"zmq", zmq.start_s}};

  std::unique_ptr<ProgressReporter> progress =
      Progress("s3_bench", 2 * (1 + args.densities.size()) + (args.yardstick ? 2 : 0), "refits");
  auto advance = [&] {
    if (progress) progress->Advance(1);
  };
  // rows[0], rows[1]: the FULLs; then an (s3, zmq) pair per density.
  std::vector<Row> rows;
  REFIT_ASSIGN_OR_RETURN(Row s3_full_row, MeasureRefit(s3, /*full=*/true, /*step=*/0));
  rows.push_back(std::move(s3_full_row));
  REFIT_RETURN_NOT_OK(CheckStoreEmpty(store, "the FULL"));
  advance();
  REFIT_ASSIGN_OR_RETURN(Row zmq_full_row, MeasureRefit(zmq, /*full=*/true, /*step=*/0));
  rows.push_back(std::move(zmq_full_row));
  advance();
  // The yardsticks, while the daemons are idle: the model's bytes, uncompressed, in messages or
  // objects of the payload size, from as many sending threads as the producers have together.
  double store_raw_s = 0, zmq_raw_s = 0;
  if (args.yardstick) {
    const size_t senders =
        static_cast<size_t>(args.producers) * static_cast<size_t>(args.send_threads);
    const uint64_t bucket_bytes = ProducerStreamOptions().bucket_bytes;
    REFIT_ASSIGN_OR_RETURN(StoreYardstick yardstick,
                           MeasureStore(store, model, bucket_bytes, senders, args.receivers));
    REFIT_RETURN_NOT_OK(CheckStoreEmpty(store, "the store yardstick"));
    store_raw_s = yardstick.time_s;
    out["store_yardstick"] = {{"bytes", yardstick.bytes},
                              {"objects", yardstick.objects},
                              {"object_bytes", yardstick.object_bytes},
                              {"concurrency", yardstick.concurrency},
                              {"downloads_per_object", yardstick.downloads_per_object},
                              {"time_s", yardstick.time_s},
                              {"upload_s", yardstick.upload_s},
                              {"download_s", yardstick.download_s},
                              {"delete_s", yardstick.delete_s},
                              {"verified", true}};
    advance();
    cli::RawCopyOptions raw_options;
    raw_options.refit_binary = args.refit_binary;
    raw_options.work_dir = work_dir;
    raw_options.receivers = args.receivers;
    raw_options.message_bytes = bucket_bytes;
    raw_options.threads = static_cast<int>(senders);
    REFIT_ASSIGN_OR_RETURN(const cli::RawCopyMeasurement raw,
                           cli::MeasureZmqRawCopy(model, raw_options));
    zmq_raw_s = raw.seconds;
    out["zmq_raw_copy"] = {{"seconds", raw.seconds},   {"bytes", raw.bytes},
                           {"messages", raw.messages}, {"message_bytes", raw.message_bytes},
                           {"threads", raw.threads},   {"receivers", raw.receivers},
                           {"verified", true}};
    advance();
  }
  for (size_t k = 0; k < args.densities.size(); ++k) {
    const uint64_t step = k + 1;
    REFIT_ASSIGN_OR_RETURN(double learning_rate,
                           simulator->CalibrateLearningRate(args.densities[k]));
    REFIT_RETURN_NOT_OK(simulator->Step());
    for (BenchFleet* fleet : {&s3, &zmq}) {
      REFIT_ASSIGN_OR_RETURN(Row row, MeasureRefit(*fleet, /*full=*/false, step));
      row.target_density = args.densities[k];
      row.learning_rate = learning_rate;
      rows.push_back(std::move(row));
      if (fleet == &s3) {
        REFIT_RETURN_NOT_OK(CheckStoreEmpty(store, fmt::format("the delta of step {}", step)));
      }
      advance();
    }
    // Same model bytes against the same committed baseline: the trackers must agree.
    const RefitReport& via_s3 = rows[rows.size() - 2].report;
    const RefitReport& via_zmq = rows.back().report;
    if (via_s3.changed_elements != via_zmq.changed_elements) {
      return DataLoss(
          "step {}: the s3 fleet's producers found {} changed elements, the zmq "
          "fleet's {}",
          step, via_s3.changed_elements, via_zmq.changed_elements);
    }
  }
  if (progress) progress->Finish();

  // Bit-exact: every tensor of every daemon of both fleets against the trainer's bytes.
  t0 = Now();
  for (const BenchFleet* fleet : {&s3, &zmq}) {
    Status held = fleet->coordinator->CheckReceiversHold(model);
    if (!held.ok()) return held.WithContext(fmt::format("the {} fleet", fleet->label));
  }
  out["verify_s"] = Now() - t0;
  out["verified_bit_identical"] = true;
  REFIT_RETURN_NOT_OK(CheckStoreEmpty(store, "the last refit"));
  out["store_left_empty"] = true;
  REFIT_RETURN_NOT_OK(s3.daemons->Stop());
  REFIT_RETURN_NOT_OK(zmq.daemons->Stop());

  out["rows"] = nlohmann::json::array();
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    const Row& full = row.transport == "s3" ? rows[0] : rows[1];
    // Rows come in (s3, zmq) pairs of the same step.
    const Row* zmq_peer = row.transport == "s3" ? &rows[i + 1] : nullptr;
    out["rows"].push_back(RowJson(row, full, rows[0], zmq_peer, args.receivers,
                                  row.transport == "s3" ? store_raw_s : zmq_raw_s));
  }
  out["load_average_end"] = LoadAverages();
  return out;
}

std::string Loads(const nlohmann::json& loads) {
  return fmt::format("{:.2f} {:.2f} {:.2f}", loads[0].get<double>(), loads[1].get<double>(),
                     loads[2].get<double>());
}

void PrintReport(const nlohmann::json& report, const Args& args) {
  const nlohmann::json& model = report["model"];
  const nlohmann::json& config = report["config"];
  std::cout << fmt::format(
      "== s3_bench: simulated bf16 model {} ({} tensors), {} producer(s) -> {} `refit serve` "
      "daemon(s) per fleet on loopback; s3 fleet via {} (run prefix {}), zmq fleet via the "
      "relay tree; chunks {}, buckets {}, {} encode/serialize + {} send thread(s) per producer\n",
      FormatBytes(model["bytes"]), model["tensors"].get<size_t>(), args.producers, args.receivers,
      config["s3_uri"].get<std::string>(), config["s3_prefix"].get<std::string>(),
      FormatBytes(config["chunk_bytes"]), FormatBytes(config["bucket_bytes"]), args.threads,
      args.send_threads);
  Table table({"transport", "kind", "target", "density", "changed", "payloads", "wire", "wire/full",
               "store traffic", "time", "stream", "flush", "commit", "speedup", "vs raw",
               "s3/zmq"});
  for (const nlohmann::json& row : report["rows"]) {
    const bool full = row["kind"] == "full";
    const bool via_s3 = row["transport"] == "s3";
    table.AddRow({row["transport"].get<std::string>(), full ? "FULL" : "delta",
                  full ? "-" : fmt::format("{:.0f}%", 100 * row["target_density"].get<double>()),
                  full ? "-" : fmt::format("{:.3f}%", 100 * row["density"].get<double>()),
                  std::to_string(row["changed"].get<uint64_t>()),
                  std::to_string(row["payloads"].get<uint64_t>()), FormatBytes(row["wire_bytes"]),
                  fmt::format("{:.4f}", row["wire_over_full"].get<double>()),
                  via_s3 ? FormatBytes(row["store_traffic_bytes"]) : "-",
                  FormatDuration(row["time_s"]), FormatDuration(row["stream_s"]),
                  FormatDuration(row["flush_s"]), FormatDuration(row["commit_s"]),
                  fmt::format("{:.1f}x", row["speedup_vs_full"].get<double>()),
                  row["time_over_raw_copy"].is_null()
                      ? "-"
                      : fmt::format("{:.2f}", row["time_over_raw_copy"].get<double>()),
                  via_s3 ? fmt::format("{:.2f}", row["s3_over_zmq_time"].get<double>()) : "-"});
  }
  table.Print(std::cout);
  std::cout << fmt::format(
      "wire = bytes out of the producers; wire/full and speedup (FULL time / this time) are "
      "against the FULL through the same transport; store traffic = wire x (1 upload + {} "
      "downloads); vs raw = this time / the raw copy through the same transport (below); s3/zmq "
      "= s3 time / zmq time on the same step\n",
      args.receivers);
  if (report.contains("store_yardstick")) {
    const nlohmann::json& y = report["store_yardstick"];
    const double objects = static_cast<double>(y["objects"].get<uint64_t>());
    std::cout << fmt::format(
        "raw copy through the store (the s3 rows' yardstick): the model's {} uncompressed in {} "
        "objects of {} ({} at a time), each PUT, GET x{} (compared with what was PUT) and DELETE "
        "by this process: {} ({}; per object PUT {}, the GETs {}, DELETE {})\n",
        FormatBytes(y["bytes"]), y["objects"].get<uint64_t>(), FormatBytes(y["object_bytes"]),
        y["concurrency"].get<size_t>(), y["downloads_per_object"].get<size_t>(),
        FormatDuration(y["time_s"]),
        FormatRate(static_cast<double>(y["bytes"].get<uint64_t>()) /
                   std::max(y["time_s"].get<double>(), 1e-9)),
        FormatDuration(y["upload_s"].get<double>() / objects),
        FormatDuration(y["download_s"].get<double>() / objects),
        FormatDuration(y["delete_s"].get<double>() / objects));
  }
  if (report.contains("zmq_raw_copy")) {
    const nlohmann::json& raw = report["zmq_raw_copy"];
    std::cout << fmt::format(
        "raw copy over ZeroMQ (the zmq rows' yardstick): the model's {} uncompressed to each of {} "
        "`refit raw-copy-sink` processes on loopback, {} messages of at most {} from {} thread(s) "
        "each, "
        "checksums verified: {}\n",
        FormatBytes(raw["bytes"]), raw["receivers"].get<size_t>(), raw["messages"].get<uint64_t>(),
        FormatBytes(raw["message_bytes"]), raw["threads"].get<int>(),
        FormatDuration(raw["seconds"]));
  }
  std::cout << fmt::format(
      "checks: every tensor of every daemon of both fleets bit-identical to the trainer's ({}); "
      "s3://{}/{} empty after every s3 refit (objects deleted once all daemons ACKed, no "
      "unfinished multipart upload)\n",
      FormatDuration(report["verify_s"]), config["s3_bucket"].get<std::string>(),
      config["s3_prefix"].get<std::string>());
  std::cout << fmt::format(
      "model generated in {}, written in {}; daemons loaded it in {} (s3) and {} (zmq); load "
      "average {} at the start, {} at the end ({} hardware threads)\n",
      FormatDuration(model["generate_s"]), FormatDuration(model["write_s"]),
      FormatDuration(report["daemon_start_s"]["s3"]),
      FormatDuration(report["daemon_start_s"]["zmq"]), Loads(report["load_average_start"]),
      Loads(report["load_average_end"]), report["machine"]["hardware_threads"].get<unsigned>());
}

Status Run(const Args& args) {
  // At the peak (a FULL): the simulator (7 bytes per model byte), each fleet's trackers' baseline
  // (one model each), and per daemon of both fleets its model and the FULL's undo log.
  const uint64_t memory = kMemoryMarginBytes + kSimulatorBytesPerModelByte * args.model_bytes +
                          2 * args.model_bytes + 2 * 2 * args.receivers * args.model_bytes;
  const std::string temp_dir = std::filesystem::temp_directory_path().string();
  if (!args.work_dir.empty()) {
    std::error_code made_dir;
    std::filesystem::create_directories(args.work_dir, made_dir);
    if (made_dir) return IoError("--work-dir {}: {}", args.work_dir, made_dir.message());
  }
  REFIT_RETURN_NOT_OK(CheckRoom(args.work_dir.empty() ? temp_dir : args.work_dir,
                                args.model_bytes + kDiskMarginBytes, memory,
                                "the simulator, two trackers' baselines, and per daemon of both "
                                "fleets its model and, during the FULL, an undo log as large",
                                "use a smaller --model-bytes or fewer --receivers"));
  REFIT_ASSIGN_OR_RETURN(Store store, OpenStore(args));

  std::string work_dir = args.work_dir;
  bool scratch = false;
  if (work_dir.empty()) {
    REFIT_ASSIGN_OR_RETURN(work_dir, testkit::MakeTemporaryDirectory("refit-s3-bench"));
    scratch = true;
  }

  Result<nlohmann::json> measured = RunBench(args, work_dir, store);
  // Whatever happened, give the shared server its memory back.
  CleanStore(store);
  if (!measured.ok()) {
    return measured.status().WithContext("work dir " + work_dir + " (daemon logs kept)");
  }
  nlohmann::json report = std::move(measured).ValueOrDie();
  report["machine"] = {{"hardware_threads", std::thread::hardware_concurrency()}};
  ProducerStreamOptions defaults;
  report["config"] = {{"quick", args.quick},
                      {"receivers", args.receivers},
                      {"producers", args.producers},
                      {"densities", args.densities},
                      {"chunk_bytes", ChunkBytes(args.model_bytes)},
                      {"bucket_bytes", defaults.bucket_bytes},
                      {"threads_per_producer", args.threads},
                      {"send_threads_per_producer", args.send_threads},
                      {"s3_uri", store.config.shown_uri},
                      {"s3_bucket", store.config.client.bucket},
                      {"s3_prefix", store.prefix},
                      {"s3_part_size", store.config.transfer.part_size},
                      {"s3_parts_in_flight", store.config.transfer.max_parts_in_flight},
                      {"zmq_uri", "zmq:// (loopback relay tree)"},
                      {"seed", args.seed}};
  if (args.json_path == "-") {
    std::cout << report.dump(2) << "\n";
  } else {
    PrintReport(report, args);
    if (!args.json_path.empty()) {
      std::ofstream file(args.json_path);
      file << report.dump(2) << "\n";
      if (!file) return IoError("cannot write the JSON report to {}", args.json_path);
    }
  }
  if (scratch) std::filesystem::remove_all(work_dir);
  return Status::OK();
}

int Main(int argc, char** argv) {
  return RunBenchmark("s3_bench", ParseArgs(argc, argv), Usage(), Run);
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) { return refit::bench::Main(argc, argv); }
