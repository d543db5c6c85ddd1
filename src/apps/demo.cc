// refit demo: the main job on an embedded default. A simulated trainer (fp32 master + Adam,
// bf16 export) with W producers refits N `refit serve` daemons on loopback after every
// optimizer step: deltas stream through the zmq:// relay tree (or, with --transport s3://…,
// through an object store, announced on each daemon's control plane), the coordinator drives each
// daemon's HTTP control plane through prepare → flush (state digests compared with the
// producers') → commit. A FULL transfer of the same model through the same fleet, measured first,
// is the yardstick for bytes, and a raw copy of the model's bytes (uncompressed, over ZeroMQ on
// loopback to as many receiving processes, no codec, digest or apply) the yardstick for time:
// what a plain broadcast of the weights costs. At the end every tensor is downloaded from every
// daemon and compared with the trainer's bytes.
#include <stdlib.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <iostream>

#include "cli_common.h"
#include "config_file.h"
#include "fleet_coordinator.h"
#include "local_fleet.h"
#include "mpi_demo.h"
#include "process.h"
#include "progress.h"
#include "raw_copy.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "role_options.h"
#include "step_json.h"
#include "table.h"
#include "workload/simulator.h"

namespace refit::cli {
namespace {

// The environment variable through which the demo hands its generated api key to the daemons
// and to its own zmq senders (never on a command line, where `ps` would show it).
constexpr const char* kDemoApiKeyEnv = "REFIT_DEMO_API_KEY";

struct DemoArgs {
  std::string config;
  std::string model_bytes = "64MiB";
  std::string dtype = "bfloat16";
  std::string op = "xor";
  int steps = 5;
  std::vector<double> densities = {0.01, 0.03, 0.05};
  size_t receivers = 2;
  uint32_t producers = 2;
  uint64_t seed = 42;
  int threads = 2;
  std::string work_dir;
  bool json = false;
  /// Empty: the zmq:// relay tree. Otherwise an s3:// URI (payloads through that bucket).
  std::string transport;
};

// The URI the demo's producers send through: `uri` with the demo's api key variable, which
// authenticates the data plane (zmq://) or the manifests on the control plane (s3://).
Result<std::string> WithDemoApiKey(std::string_view uri) {
  REFIT_ASSIGN_OR_RETURN(TransportUri parsed, TransportUri::Parse(uri));
  if (parsed.Param(kUriApiKeyEnvParam) == nullptr && parsed.Param(kUriApiKeyParam) == nullptr) {
    parsed.params.emplace_back(kUriApiKeyEnvParam, kDemoApiKeyEnv);
  }
  return parsed.ToString();
}

struct StepRow {
  int step = 0;
  bool anchor = false;
  double learning_rate = 0;
  RefitReport report;
};

// refit demo's line: the shared figures, the step's learning rate and transfer id, and the
// daemons' verdict (every flush compared every tensor's digest).
nlohmann::json DemoStepJson(const StepRow& row, const RefitReport& full, double raw_copy_s) {
  nlohmann::json json = StepJson(row.step, row.report, full, raw_copy_s);
  json["kind"] = row.anchor ? "full" : "delta";
  json["transfer_id"] = row.report.plan.transfer_id.ToHex();
  json["learning_rate"] = row.learning_rate;
  json["digests_verified"] = true;
  return json;
}

Status RunDemo(const DemoArgs& args) {
  // The collectives (mpi://, nccl://) run as an MPI job, which the demo starts under mpirun
  // before any transport exists: the scheme is all it can go by.
  if (args.transport.starts_with("mpi://") || args.transport.starts_with("nccl://")) {
    if (!args.config.empty()) {
      return InvalidArgument("demo: --config is not supported with --transport mpi:// (yet)");
    }
    MpiDemoSettings settings;
    settings.transport = args.transport;
    REFIT_ASSIGN_OR_RETURN(settings.model_bytes, config::ParseByteSize(args.model_bytes));
    settings.dtype = args.dtype;
    settings.op = args.op;
    settings.steps = args.steps;
    settings.densities = args.densities;
    settings.receivers = static_cast<uint32_t>(args.receivers);
    settings.producers = args.producers;
    settings.seed = args.seed;
    settings.threads = args.threads;
    settings.json = args.json;
    return RunMpiDemo(settings);
  }
  SimulatorOptions sim_options;
  REFIT_ASSIGN_OR_RETURN(sim_options.export_dtype, ParseDType(args.dtype));
  REFIT_ASSIGN_OR_RETURN(uint64_t model_bytes, config::ParseByteSize(args.model_bytes));
  sim_options.tensors = MakeTransformerSpec(model_bytes, sim_options.export_dtype);
  sim_options.seed = args.seed;
  sim_options.threads = args.threads;
  REFIT_ASSIGN_OR_RETURN(auto simulator, TrainingSimulator::Make(sim_options));
  const std::vector<TensorView> model = simulator->Exported();

  // The daemons load the trainer's initial export, as a fleet loads the run's checkpoint.
  std::string work_dir = args.work_dir;
  std::optional<std::filesystem::path> scratch;
  if (work_dir.empty()) {
    REFIT_ASSIGN_OR_RETURN(work_dir, testkit::MakeTemporaryDirectory("refit-demo"));
    scratch = work_dir;
  }
  std::error_code made_dir;
  std::filesystem::create_directories(work_dir, made_dir);
  if (made_dir) return IoError("--work-dir {}: {}", work_dir, made_dir.message());
  const std::string model_path = work_dir + "/model.safetensors";
  REFIT_RETURN_NOT_OK(WriteSafetensors(model_path, model, {{kWeightVersionMetadataKey, "0"}}));

  ::setenv(kDemoApiKeyEnv, testkit::GenerateApiKey().c_str(), /*overwrite=*/1);
  testkit::LocalFleetOptions fleet_options;
  fleet_options.receivers = testkit::LocalFleetOptions::Replicas(model_path, args.receivers);
  fleet_options.api_key_env = kDemoApiKeyEnv;
  fleet_options.work_dir = work_dir;
  fleet_options.transport_uri = args.transport;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<testkit::LocalFleet> daemons,
                         testkit::LocalFleet::Start(fleet_options));

  FleetAddress address;
  for (const testkit::LocalReceiver& receiver : daemons->receivers()) {
    address.control_urls.push_back(receiver.control_url);
    address.data_endpoints.push_back(receiver.data_endpoint);
  }
  address.api_key = ::getenv(kDemoApiKeyEnv);
  TrackerOptions tracker_options;
  internal::CoordinatorOptions options;
  if (args.config.empty()) {
    REFIT_ASSIGN_OR_RETURN(address.transport_uri,
                           WithDemoApiKey(args.transport.empty() ? "zmq://" : args.transport));
    REFIT_ASSIGN_OR_RETURN(tracker_options.op, ParseOp(args.op));
    tracker_options.compare.threads = args.threads;
    options.stream.encode_threads = args.threads;
    options.stream.serialize_threads = args.threads;
    options.stream.send_threads = args.threads;
    // Chunks of a few MiB so that every producer owns some of even a small model.
    options.stream.chunk_bytes = std::min<uint64_t>(options.stream.chunk_bytes,
                                                    std::max<uint64_t>(model_bytes / 16, 1 << 20));
  } else {
    // The file sets the codec, pipeline and transport settings; the fleet is the demo's own.
    std::vector<config::ConfigOverride> overrides = {
        {"http_refit_api_key_env_var", std::string(kDemoApiKeyEnv), "refit demo's own api key"}};
    if (!args.transport.empty()) overrides.push_back({"transport", args.transport, "--transport"});
    REFIT_ASSIGN_OR_RETURN(const config::RefitConfig config,
                           config::LoadConfigFile(args.config, overrides));
    REFIT_ASSIGN_OR_RETURN(const std::string uri, config::ToTransportUri(config));
    REFIT_ASSIGN_OR_RETURN(address.transport_uri, WithDemoApiKey(uri));
    tracker_options = config::ToTrackerOptions(config);
    options.stream = config::ToProducerStreamOptions(config);
  }
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<FleetCoordinator> fleet,
                         FleetCoordinator::Make(address, &model, args.producers, tracker_options,
                                                options, /*baseline=*/&model));

  if (!args.json) {
    std::cout << fmt::format(
        "refit demo: simulated {} model ({}, {} tensors), {} producer(s) -> {} `refit serve` "
        "daemon(s) on loopback over {} + HTTP control, {} steps\n",
        FormatBytes(simulator->exported_bytes()), DTypeName(sim_options.export_dtype), model.size(),
        args.producers, args.receivers,
        args.transport.empty() ? "zmq://" : TransportUri::Parse(args.transport)->scheme + "://",
        args.steps);
    std::cout << fmt::format("daemon logs and the model file: {}\n\n", work_dir);
  }
  ProgressReporter::Options progress_options;
  progress_options.label = "demo";
  progress_options.total = static_cast<uint64_t>(args.steps) + 1;
  progress_options.unit = "steps";
  REFIT_ASSIGN_OR_RETURN(auto progress, ProgressReporter::Make(progress_options));

  // The time yardstick, while the daemons are idle: the same bytes to as many receivers, in
  // messages of the payload size from as many send threads, nothing but the copy.
  RawCopyOptions raw_options;
  raw_options.work_dir = work_dir;
  raw_options.receivers = args.receivers;
  raw_options.message_bytes = options.stream.bucket_bytes;
  raw_options.threads = options.stream.send_threads;
  REFIT_ASSIGN_OR_RETURN(const RawCopyMeasurement raw, MeasureZmqRawCopy(model, raw_options));
  if (args.json) {
    std::cout << nlohmann::json{{"raw_copy",
                                 {{"seconds", raw.seconds},
                                  {"bytes", raw.bytes},
                                  {"receivers", raw.receivers},
                                  {"message_bytes", raw.message_bytes},
                                  {"threads", raw.threads},
                                  {"verified", true}}}}
                     .dump()
              << std::endl;
  }

  // Step 0: a FULL transfer of the unchanged model — what refitting costs without deltas.
  std::vector<StepRow> rows;
  REFIT_ASSIGN_OR_RETURN(RefitReport full, fleet->Refit(/*force_anchor=*/true));
  rows.push_back({0, true, 0.0, full});
  progress->Advance(1);
  if (args.json) std::cout << DemoStepJson(rows.back(), full, raw.seconds).dump() << std::endl;
  for (int step = 1; step <= args.steps; ++step) {
    if (!args.densities.empty()) {
      const double target = args.densities[(step - 1) % args.densities.size()];
      REFIT_RETURN_NOT_OK(simulator->CalibrateLearningRate(target));
    }
    REFIT_RETURN_NOT_OK(simulator->Step());
    REFIT_ASSIGN_OR_RETURN(RefitReport report, fleet->Refit());
    rows.push_back({step, report.plan.anchor, simulator->learning_rate(), std::move(report)});
    progress->Advance(1);
    if (args.json) std::cout << DemoStepJson(rows.back(), full, raw.seconds).dump() << std::endl;
  }
  progress->Finish();
  REFIT_RETURN_NOT_OK(fleet->CheckReceiversHold(model));
  REFIT_RETURN_NOT_OK(daemons->Stop());
  if (scratch.has_value()) std::filesystem::remove_all(*scratch);
  if (args.json) return Status::OK();

  Table table({"step", "kind", "version", "density", "changed", "payloads", "wire", "saved", "time",
               "stream", "flush", "commit", "speedup", "vs raw", "digests"});
  for (const StepRow& row : rows) {
    const nlohmann::json j = DemoStepJson(row, full, raw.seconds);
    const RefitReport& r = row.report;
    table.AddRow(
        {std::to_string(row.step), row.anchor ? "FULL" : "delta",
         std::to_string(r.plan.target_version),
         // A FULL transfer sends every element, whatever changed.
         row.anchor ? std::string("all") : fmt::format("{:.3f}%", 100 * j["density"].get<double>()),
         std::to_string(r.changed_elements), std::to_string(r.payloads), FormatBytes(r.wire_bytes),
         fmt::format("{:.1f}%", 100 * j["bytes_saved"].get<double>()), FormatDuration(r.total_s),
         FormatDuration(r.stream_s), FormatDuration(r.flush_s), FormatDuration(r.commit_s),
         fmt::format("{:.1f}x", j["speedup_vs_full"].get<double>()),
         fmt::format("{:.2f}", j["time_over_raw_copy"].get<double>()),
         fmt::format("ok x{}", r.receivers.size())});
  }
  table.Print(std::cout);
  std::cout << fmt::format(
      "\nspeedup = FULL time / step time (higher is better); vs raw = step time / raw-copy time "
      "(lower is better, below 1 beats a plain copy), where the raw copy sent the model's {} "
      "uncompressed to {} receiving process(es) over ZeroMQ on loopback ({} messages of at most "
      "{} from {} thread(s) each, no codec, digest or apply) in {}\n",
      FormatBytes(raw.bytes), raw.receivers, raw.messages, FormatBytes(raw.message_bytes),
      raw.threads, FormatDuration(raw.seconds));
  std::cout << "on loopback the link is almost free and the codec shares this machine's CPU with "
               "the daemons, so a delta can take longer than the raw copy here; over a real "
               "network the wire bytes decide: `refit estimate --link-gbps N` predicts a delta, "
               "a FULL and a raw copy for your link\n";
  std::cout << fmt::format(
      "every step committed on all {} daemons with state digests equal to the producers'; "
      "every tensor downloaded from every daemon equals the trainer's bytes\n",
      args.receivers);
  return Status::OK();
}

}  // namespace

void RegisterDemo(CLI::App& app, Status* result) {
  auto args = std::make_shared<DemoArgs>();
  CLI::App* cmd = app.add_subcommand(
      "demo",
      "Simulate an RL run and refit a fleet of local `refit serve` daemons after every step");
  cmd->add_option("--config", args->config,
                  "A refit YAML file for the codec, pipeline and transport settings (the fleet "
                  "is the demo's own; --op and --threads are then ignored)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--model-bytes", args->model_bytes, "Size of the simulated model")
      ->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "Export dtype: bfloat16 or float16")
      ->capture_default_str();
  cmd->add_option("--op", args->op, "Value op: xor, overwrite or add")->capture_default_str();
  cmd->add_option("--steps", args->steps, "Optimizer steps after the FULL transfer")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--density", args->densities,
                  "Target changed fractions, cycled over the steps (empty: the natural density "
                  "of lr 1e-6)")
      ->capture_default_str();
  cmd->add_option("--receivers", args->receivers, "`refit serve` daemons to start")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--producers", args->producers, "Producers (trainer ranks) W")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--seed", args->seed, "Random seed")->capture_default_str();
  cmd->add_option("--threads", args->threads, "Worker threads per stage")->capture_default_str();
  cmd->add_option("--work-dir", args->work_dir,
                  "Keep the model file and daemon logs here (default: a temporary directory, "
                  "removed on success)");
  cmd->add_flag("--json", args->json, "One JSON metrics line per step instead of the table");
  cmd->add_option("--transport", args->transport,
                  "Send through this s3:// URI instead of the zmq:// relay tree, e.g. "
                  "'s3://bucket/run?endpoint=http://127.0.0.1:7480', or run the demo as an MPI "
                  "job with mpi:// (it starts mpirun with producers + receivers ranks). s3: "
                  "credentials from "
                  "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY; add chain=1 to keep a chain that "
                  "`refit serve --bootstrap` replays)");
  cmd->callback([args, result] { *result = RunDemo(*args); });
}

}  // namespace refit::cli
