// refit push: send a safetensors checkpoint to a fleet of `refit serve` daemons and commit it —
// as a delta against the checkpoint they hold (--base) or as a FULL anchor — with the same
// two-phase protocol as a trainer: prepare, stream, flush with state digests, commit; any
// failure rolls every receiver back.
#include <stdlib.h>

#include <nlohmann/json.hpp>

#include <iostream>

#include "cli_common.h"
#include "config.h"
#include "fleet_coordinator.h"
#include "refit/progress.h"
#include "refit/safetensors.h"

namespace refit::cli {
namespace {

struct PushArgs {
  std::string config;
  std::string checkpoint;
  std::string base;
  /// "CONTROL_URL=DATA_ENDPOINT", one per receiver, in tree order.
  std::vector<std::string> receivers;
  std::string transport = "zmq://";
  std::string api_key_env;
  uint32_t producers = 1;
  int threads = 4;
  double timeout_s = 600;
  bool anchor = false;
  bool json = false;
  // Which flags were given, so that they override the configuration file.
  bool transport_given = false;
  bool threads_given = false;
};

// The configuration file (or the defaults) with the flags applied on top.
Result<RefitConfig> ResolveConfig(const PushArgs& args) {
  RefitConfig config;
  if (!args.config.empty()) {
    REFIT_ASSIGN_OR_RETURN(config, LoadConfigFile(args.config));
  }
  if (!args.receivers.empty()) {
    config.receivers.clear();
    for (const std::string& spec : args.receivers) {
      // A control URL alone serves transports that announce payloads on it (s3://).
      const size_t equals = spec.find('=');
      if (equals == std::string::npos) {
        config.receivers.push_back({spec, ""});
        continue;
      }
      if (equals == 0 || equals + 1 == spec.size()) {
        return InvalidArgument(
            "--receiver '{}': expected CONTROL_URL=DATA_ENDPOINT, e.g. "
            "http://10.0.0.5:8081=10.0.0.5:5555 (or CONTROL_URL alone for s3://)",
            spec);
      }
      config.receivers.push_back({spec.substr(0, equals), spec.substr(equals + 1)});
    }
  }
  if (config.receivers.empty()) {
    return InvalidArgument(
        "no receivers: give --receiver CONTROL_URL=DATA_ENDPOINT or a --config "
        "file with a receivers list");
  }
  if (args.transport_given) config.transport = args.transport;
  if (!args.api_key_env.empty()) config.http_refit_api_key_env_var = args.api_key_env;
  if (args.threads_given) {
    config.tuning.encode_workers = args.threads;
    config.tuning.transfer_workers = args.threads;
  }
  return config;
}

Result<FleetAddress> AddressOf(const RefitConfig& config) {
  FleetAddress address;
  for (const ReceiverConfig& receiver : config.receivers) {
    address.control_urls.push_back(receiver.control);
    address.data_endpoints.push_back(receiver.data);
    REFIT_ASSIGN_OR_RETURN(address.client, ToControlClientOptions(config, receiver));
  }
  address.api_key = address.client.api_key;
  REFIT_ASSIGN_OR_RETURN(address.transport_uri, ToTransportUri(config));
  return address;
}

// The version every receiver holds; they must agree and be idle.
Result<uint64_t> FleetVersion(const FleetAddress& address) {
  std::optional<uint64_t> version;
  for (const std::string& url : address.control_urls) {
    ControlClientOptions options = address.client;
    options.base_url = url;
    options.api_key = address.api_key;
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client, ControlClient::Make(options));
    REFIT_ASSIGN_OR_RETURN(ControlStatus status, client->GetStatus());
    if (status.receiver.state != ReceiverState::kIdle) {
      return FailedPrecondition(
          "receiver {} is {} (transfer {}): wait for it or abort it first", url,
          ReceiverStateName(status.receiver.state),
          status.receiver.transfer_id ? status.receiver.transfer_id->ToHex() : std::string("?"));
    }
    if (version.has_value() && *version != status.receiver.version) {
      return FailedPrecondition(
          "receivers disagree on their version: {} holds {}, {} holds {}; refit them from one "
          "checkpoint first",
          address.control_urls.front(), *version, url, status.receiver.version);
    }
    version = status.receiver.version;
  }
  return *version;
}

Status RunPush(const PushArgs& args) {
  REFIT_ASSIGN_OR_RETURN(const RefitConfig config, ResolveConfig(args));
  REFIT_ASSIGN_OR_RETURN(const FleetAddress address, AddressOf(config));
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> checkpoint,
                         SafetensorsFile::Open(args.checkpoint));
  const std::vector<TensorView> model = checkpoint->tensors();
  std::unique_ptr<SafetensorsFile> base_file;
  std::vector<TensorView> base;
  if (!args.base.empty()) {
    REFIT_ASSIGN_OR_RETURN(base_file, SafetensorsFile::Open(args.base));
    base = base_file->tensors();
  }
  REFIT_ASSIGN_OR_RETURN(const uint64_t version, FleetVersion(address));

  TrackerOptions tracker_options = ToTrackerOptions(config);
  tracker_options.initial_version = version;
  CoordinatorOptions options;
  options.stream = ToProducerStreamOptions(config);
  options.transfer_timeout = std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1e3));
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<FleetCoordinator> fleet,
                         FleetCoordinator::Make(address, &model, args.producers, tracker_options,
                                                options, args.base.empty() ? nullptr : &base));
  REFIT_ASSIGN_OR_RETURN(RefitReport report, fleet->Refit(args.anchor || args.base.empty()));

  uint64_t model_bytes = 0;
  for (const TensorView& tensor : model) model_bytes += tensor.bytes.size();
  if (args.json) {
    nlohmann::json line = {{"transfer_id", report.plan.transfer_id.ToHex()},
                           {"kind", report.plan.anchor ? "full" : "delta"},
                           {"base_version", report.plan.base_version},
                           {"version", report.plan.target_version},
                           {"receivers", report.receivers.size()},
                           {"payloads", report.payloads},
                           {"changed", report.changed_elements},
                           {"elements", report.total_elements},
                           {"model_bytes", model_bytes},
                           {"wire_bytes", report.wire_bytes},
                           {"time_s", report.total_s}};
    nlohmann::json commits = nlohmann::json::array();
    for (const ReceiverOutcome& receiver : report.receivers) {
      commits.push_back({{"receiver", receiver.name},
                         {"committed", receiver.commit_status.ok()},
                         {"error", receiver.commit_status.ok()
                                       ? nlohmann::json(nullptr)
                                       : nlohmann::json(receiver.commit_status.ToString())}});
    }
    line["commits"] = std::move(commits);
    std::cout << line.dump() << std::endl;
  } else {
    std::cout << fmt::format(
        "pushed {} as {} v{} -> v{} to {} receiver(s): {} changed of {} elements, {} payloads, "
        "{} on the wire ({} model), {} (stream {}, flush {}, commit {})\n",
        args.checkpoint, report.plan.anchor ? "a FULL anchor" : "a delta", report.plan.base_version,
        report.plan.target_version, report.receivers.size(), report.changed_elements,
        report.total_elements, report.payloads, FormatBytes(report.wire_bytes),
        FormatBytes(model_bytes), FormatDuration(report.total_s), FormatDuration(report.stream_s),
        FormatDuration(report.flush_s), FormatDuration(report.commit_s));
  }
  for (const ReceiverOutcome& receiver : report.receivers) {
    if (!receiver.commit_status.ok()) {
      std::cerr << fmt::format(
          "warning: {} did not confirm the commit ({}); it is prepared and commits at the next "
          "transfer\n",
          receiver.name, receiver.commit_status.ToString());
    }
  }
  return Status::OK();
}

}  // namespace

void RegisterPush(CLI::App& app, Status* result) {
  auto args = std::make_shared<PushArgs>();
  CLI::App* cmd = app.add_subcommand(
      "push", "Send a safetensors checkpoint to running `refit serve` daemons and commit it");
  cmd->add_option("checkpoint", args->checkpoint, "The checkpoint to send (safetensors)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--config", args->config,
                  "A refit YAML file (docs/configuration.md); flags override its values")
      ->check(CLI::ExistingFile);
  cmd->add_option("--receiver", args->receivers,
                  "CONTROL_URL=DATA_ENDPOINT of each receiver, in relay-tree order (repeat), "
                  "e.g. http://127.0.0.1:8081=127.0.0.1:5555; replaces the file's receivers")
      ->allow_extra_args(false);
  cmd->add_option("--base", args->base,
                  "The checkpoint the receivers hold now: send only what changed (default: a "
                  "FULL anchor)")
      ->check(CLI::ExistingFile);
  cmd->add_flag("--anchor", args->anchor, "Send every element even with --base");
  cmd->add_option("--transport", args->transport,
                  "Transport URI for the payloads (zmq://?timeout_ms=…&api_key_env=…&curve_…)")
      ->capture_default_str();
  cmd->add_option("--api-key-env", args->api_key_env,
                  "Environment variable holding the control plane's api key");
  cmd->add_option("--producers", args->producers, "Producer streams W (chunk k goes to k % W)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--threads", args->threads, "Worker threads per stage")->capture_default_str();
  cmd->add_option("--timeout", args->timeout_s, "Seconds the whole transfer may take")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--json", args->json, "Print the result as one JSON line");
  cmd->callback([cmd, args, result] {
    args->transport_given = cmd->count("--transport") > 0;
    args->threads_given = cmd->count("--threads") > 0;
    *result = RunPush(*args);
  });
}

}  // namespace refit::cli
