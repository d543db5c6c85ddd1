#include "local_fleet.h"

#include <signal.h>
#include <unistd.h>

#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "loopback_ports.h"
#include "process.h"
#include "refit/status_format.h"

namespace refit::testkit {
namespace {

// How long a daemon gets to exit after SIGTERM before SIGKILL: stopping waits for in-flight HTTP
// requests and idle keep-alive connections (about a second).
constexpr auto kStopGrace = std::chrono::seconds(15);

}  // namespace

Result<std::unique_ptr<LocalFleet>> LocalFleet::Start(const LocalFleetOptions& options) {
  if (options.receivers.empty()) return InvalidArgument("local fleet: no receivers");
  for (size_t r = 0; r < options.receivers.size(); ++r) {
    if (options.receivers[r].model_path.empty()) {
      return InvalidArgument("local fleet: receiver {} has no model file", r);
    }
  }
  std::string binary = options.refit_binary;
  if (binary.empty()) {
    REFIT_ASSIGN_OR_RETURN(binary, SelfExecutable());
  }
  const size_t count = options.receivers.size();
  REFIT_ASSIGN_OR_RETURN(std::vector<uint16_t> ports, FreeLoopbackPorts(2 * count));
  std::vector<std::string> peers;
  for (size_t r = 0; r < count; ++r) peers.push_back(fmt::format("127.0.0.1:{}", ports[2 * r]));
  const std::string peer_list = fmt::format("{}", fmt::join(peers, ","));

  std::unique_ptr<LocalFleet> fleet(new LocalFleet());
  std::vector<std::string> ready_files;
  for (size_t r = 0; r < count; ++r) {
    const LocalReceiverSpec& spec = options.receivers[r];
    LocalReceiver receiver;
    receiver.log_path = fmt::format("{}/{}-{}.log", options.work_dir, options.label, r);
    ready_files.push_back(fmt::format("{}/{}-{}.ready", options.work_dir, options.label, r));
    ::unlink(ready_files.back().c_str());
    std::vector<std::string> argv = {
        binary,         "serve",           "--model",        spec.model_path,
        "--bind",       "127.0.0.1",       "--control-port", std::to_string(ports[2 * r + 1]),
        "--ready-file", ready_files.back()};
    if (options.transport_uri.empty()) {
      argv.insert(argv.end(), {"--data-port", std::to_string(ports[2 * r]), "--peers", peer_list});
    } else {
      argv.insert(argv.end(), {"--transport", options.transport_uri});
    }
    if (!options.api_key_env.empty()) {
      argv.insert(argv.end(), {"--api-key-env", options.api_key_env});
    }
    if (!spec.loader_path.empty()) argv.insert(argv.end(), {"--loader", spec.loader_path});
    if (!spec.replica.empty()) argv.insert(argv.end(), {"--replica", spec.replica});
    argv.insert(argv.end(), options.extra_args.begin(), options.extra_args.end());
    Result<pid_t> pid = SpawnProcess(argv, receiver.log_path, receiver.log_path);
    if (!pid.ok()) {
      fleet->Stop().IgnoreError();
      return pid.status();
    }
    receiver.pid = *pid;
    fleet->receivers_.push_back(std::move(receiver));
  }

  const auto deadline = std::chrono::steady_clock::now() + options.start_timeout;
  for (size_t r = 0; r < count; ++r) {
    LocalReceiver& receiver = fleet->receivers_[r];
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    Result<std::string> ready =
        WaitForReadyFile(ready_files[r], receiver.pid, std::max(left, std::chrono::milliseconds(0)),
                         receiver.log_path);
    if (!ready.ok()) {
      // WaitForReadyFile reaped a daemon that exited; Stop() stops the others.
      if (::kill(receiver.pid, 0) != 0) receiver.pid = -1;
      fleet->Stop().IgnoreError();
      return ready.status().WithContext(fmt::format("local fleet: receiver {} ({})", r, peers[r]));
    }
    const nlohmann::json info = nlohmann::json::parse(*ready, nullptr, /*allow_exceptions=*/false);
    if (!info.is_object() || !info.contains("control_url") || !info.contains("data_endpoint") ||
        !info["control_url"].is_string() || !info["data_endpoint"].is_string()) {
      fleet->Stop().IgnoreError();
      return DataLoss("local fleet: receiver {}: malformed ready file {}", r, ready_files[r]);
    }
    receiver.control_url = info["control_url"].get<std::string>();
    receiver.data_endpoint = info["data_endpoint"].get<std::string>();
  }
  return fleet;
}

LocalFleet::~LocalFleet() {
  if (!stopped_) Stop().IgnoreError();
}

Status LocalFleet::Stop() {
  stopped_ = true;
  // SIGTERM all first, so that the daemons shut down in parallel.
  for (const LocalReceiver& receiver : receivers_) {
    if (receiver.pid > 0) ::kill(receiver.pid, SIGTERM);
  }
  std::vector<std::string> problems;
  for (size_t r = 0; r < receivers_.size(); ++r) {
    LocalReceiver& receiver = receivers_[r];
    if (receiver.pid <= 0) continue;
    Result<ChildExit> exit = WaitProcess(receiver.pid, kStopGrace);
    receiver.pid = -1;
    if (!exit.ok() || !exit->ok()) {
      problems.push_back(
          fmt::format("receiver {} {}; its log ends with:\n{}", r,
                      exit.ok() ? "exited with " + exit->Describe() : exit.status().ToString(),
                      FileTail(receiver.log_path)));
    }
  }
  if (!problems.empty()) return Internal("{}", fmt::join(problems, "\n"));
  return Status::OK();
}

std::vector<std::string> LocalFleet::data_endpoints() const {
  std::vector<std::string> endpoints;
  for (const LocalReceiver& receiver : receivers_) endpoints.push_back(receiver.data_endpoint);
  return endpoints;
}

Result<uint64_t> LocalFleet::PeakRssBytes(size_t i) const {
  if (i >= receivers_.size() || receivers_[i].pid <= 0) {
    return NotFound("receiver {} is not running", i);
  }
  return ProcessMemoryBytes(std::to_string(receivers_[i].pid), "VmHWM");
}

std::string GenerateApiKey() {
  std::random_device device;
  return fmt::format("{:016x}{:016x}", (uint64_t{device()} << 32) | device(),
                     (uint64_t{device()} << 32) | device());
}

}  // namespace refit::testkit
