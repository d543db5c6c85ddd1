// The embedded section (sections.h): a ReceiverNode in a process of its own (this executable
// re-executed, RunEmbeddedChild) over buffers that process registered, no model file; its RSS
// after registering, during each delta and after commit.
#include "e2e/sections.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/digest.h"
#include "e2e/harness.h"
#include "refit/receiver_node.h"
#include "refit/status_format.h"
#include "table.h"

namespace refit::bench::e2e {
namespace {

// The state fingerprint of `tensors` (src/core/digest.h), computed from their bytes.
uint64_t FingerprintOf(const std::vector<TensorView>& tensors) {
  std::map<std::string, uint64_t> digests;
  for (const TensorView& tensor : tensors) digests[tensor.name] = TensorDigest(tensor);
  return StateFingerprint(digests);
}

// Stops a child process (SIGTERM, then SIGKILL after kChildStopGrace) on every early return,
// unless `done` says it was waited for.
struct ChildGuard {
  pid_t pid;
  bool done = false;
  ~ChildGuard() {
    if (!done) testkit::TerminateProcess(pid, kChildStopGrace).status().IgnoreError();
  }
};

}  // namespace

Result<EmbeddedChildArgs> ParseEmbeddedChildArgs(int argc, char** argv) {
  REFIT_ASSIGN_OR_RETURN(const ChildFlags flags, ChildFlags::Parse(argc, argv, kEmbeddedChildFlag));
  EmbeddedChildArgs args;
  REFIT_ASSIGN_OR_RETURN(args.model_bytes, flags.Number("--model-bytes"));
  REFIT_ASSIGN_OR_RETURN(args.seed, flags.Number("--seed"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t threads, flags.Number("--threads"));
  args.threads =
      static_cast<int>(std::clamp<uint64_t>(threads, 1, ProducerStreamOptions::kMaxThreads));
  REFIT_ASSIGN_OR_RETURN(args.data_endpoint, flags.Text("--data-endpoint"));
  REFIT_ASSIGN_OR_RETURN(args.ready_file, flags.Text("--ready-file"));
  REFIT_ASSIGN_OR_RETURN(args.result_file, flags.Text("--result-file"));
  return args;
}

Status RunEmbeddedChild(const EmbeddedChildArgs& args) {
  // Before any thread starts, so that only sigwait below takes SIGTERM.
  sigset_t shutdown;
  sigemptyset(&shutdown);
  sigaddset(&shutdown, SIGTERM);
  sigaddset(&shutdown, SIGINT);
  pthread_sigmask(SIG_BLOCK, &shutdown, nullptr);

  REFIT_ASSIGN_OR_RETURN(const uint64_t rss_start, testkit::ProcessMemoryBytes("self", "VmRSS"));
  REFIT_ASSIGN_OR_RETURN(SyntheticModel model,
                         SyntheticModel::Make(args.model_bytes, args.seed, args.threads, nullptr));
  REFIT_ASSIGN_OR_RETURN(const uint64_t rss_model, testkit::ProcessMemoryBytes("self", "VmRSS"));
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
  REFIT_ASSIGN_OR_RETURN(const uint64_t rss_registered,
                         testkit::ProcessMemoryBytes("self", "VmRSS"));
  REFIT_RETURN_NOT_OK(node->Start());
  REFIT_ASSIGN_OR_RETURN(const uint64_t rss_started, testkit::ProcessMemoryBytes("self", "VmRSS"));
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
  REFIT_RETURN_NOT_OK(testkit::WriteTextFileAtomically(args.ready_file, ready.dump() + "\n"));
  int received = 0;
  sigwait(&shutdown, &received);
  node->Stop();
  REFIT_ASSIGN_OR_RETURN(const uint64_t rss_end, testkit::ProcessMemoryBytes("self", "VmRSS"));
  const nlohmann::json result = {
      {"fingerprint", fmt::format("{:016x}", FingerprintOf(model.views()))},
      {"version", node->store().version()},
      {"rss_end", rss_end}};
  return testkit::WriteTextFileAtomically(args.result_file, result.dump() + "\n");
}

Result<nlohmann::json> RunEmbedded(const Args& args, const std::string& work_dir) {
  nlohmann::json out;
  REFIT_ASSIGN_OR_RETURN(const std::string self, testkit::SelfExecutable());
  REFIT_ASSIGN_OR_RETURN(std::vector<uint16_t> port, testkit::FreeLoopbackPorts(1));
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
  REFIT_ASSIGN_OR_RETURN(const pid_t pid, testkit::SpawnProcess(argv, log_path, log_path));
  // Stops the receiver process on every early return.
  ChildGuard guard{pid};
  REFIT_ASSIGN_OR_RETURN(const std::string ready_text,
                         testkit::WaitForReadyFile(ready_path, pid, kChildStartTimeout, log_path));
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
    if (Status reset = testkit::ResetPeakRss(child); !reset.ok() && rss_reset) {
      rss_reset = false;
      std::cerr << "warning: " << reset.message()
                << "; peak RSS figures are peaks since the receiver process started\n";
    }
    REFIT_ASSIGN_OR_RETURN(const uint64_t before, testkit::ProcessMemoryBytes(child, "VmRSS"));
    REFIT_ASSIGN_OR_RETURN(const uint64_t changed, model.Step(/*step=*/k + 1, densities[k]));
    REFIT_ASSIGN_OR_RETURN(const RefitReport report, SyncDelta(ranks, model.views()));
    REFIT_ASSIGN_OR_RETURN(const uint64_t peak, testkit::ProcessMemoryBytes(child, "VmHWM"));
    REFIT_ASSIGN_OR_RETURN(const uint64_t after, testkit::ProcessMemoryBytes(child, "VmRSS"));
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
  REFIT_ASSIGN_OR_RETURN(const testkit::ChildExit exit,
                         testkit::TerminateProcess(pid, kChildStopGrace));
  guard.done = true;
  if (!exit.ok()) {
    return Internal("embedded receiver exited with {}; its log ends with:\n{}", exit.Describe(),
                    testkit::FileTail(log_path));
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

}  // namespace refit::bench::e2e
