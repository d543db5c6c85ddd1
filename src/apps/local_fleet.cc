#include "local_fleet.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "refit/status_format.h"

namespace refit::cli {
namespace {

// How long a daemon gets to exit after SIGTERM before SIGKILL: stopping waits for in-flight HTTP
// requests and idle keep-alive connections (about a second).
constexpr auto kStopGrace = std::chrono::seconds(15);
constexpr auto kPollInterval = std::chrono::milliseconds(20);
// Characters of a daemon's log quoted in an error.
constexpr std::streamoff kLogTailChars = 2000;

}  // namespace

std::string LogTail(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "(no log)";
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  in.seekg(std::max<std::streamoff>(0, size - kLogTailChars));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

Status WriteTextFileAtomically(const std::string& path, std::string_view text) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) return IoError("cannot write {}", temporary);
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    return IoErrorFromErrno(errno, fmt::format("rename {} to {}", temporary, path));
  }
  return Status::OK();
}

Result<std::vector<uint16_t>> FreeLoopbackPorts(size_t count) {
  std::vector<int> sockets;
  std::vector<uint16_t> ports;
  Status status;
  for (size_t i = 0; i < count && status.ok(); ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
      status = IoErrorFromErrno(errno, "socket");
      break;
    }
    sockets.push_back(fd);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      status = IoErrorFromErrno(errno, "bind a free loopback port");
      break;
    }
    ports.push_back(ntohs(address.sin_port));
  }
  for (int fd : sockets) ::close(fd);
  if (!status.ok()) return status;
  return ports;
}

Result<std::string> SelfExecutable() {
  std::vector<char> buffer(4096);
  const ssize_t n = ::readlink("/proc/self/exe", buffer.data(), buffer.size() - 1);
  if (n <= 0) return IoErrorFromErrno(errno, "readlink /proc/self/exe");
  return std::string(buffer.data(), static_cast<size_t>(n));
}

Result<pid_t> SpawnWithLog(const std::vector<std::string>& argv, const std::string& log_path) {
  const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) return IoErrorFromErrno(errno, "open " + log_path);
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log);
    return IoErrorFromErrno(errno, "fork");
  }
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    ::setpgid(0, 0);
    ::dup2(log, STDOUT_FILENO);
    ::dup2(log, STDERR_FILENO);
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, STDIN_FILENO);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(log);
  return pid;
}

Result<std::unique_ptr<LocalFleet>> LocalFleet::Start(const LocalFleetOptions& options) {
  if (options.receivers == 0) return InvalidArgument("local fleet: no receivers");
  if (options.model_path.empty()) return InvalidArgument("local fleet: no model file");
  std::string binary = options.refit_binary;
  if (binary.empty()) {
    REFIT_ASSIGN_OR_RETURN(binary, SelfExecutable());
  }
  REFIT_ASSIGN_OR_RETURN(std::vector<uint16_t> ports, FreeLoopbackPorts(2 * options.receivers));
  std::vector<std::string> peers;
  for (size_t r = 0; r < options.receivers; ++r) {
    peers.push_back(fmt::format("127.0.0.1:{}", ports[2 * r]));
  }
  const std::string peer_list = fmt::format("{}", fmt::join(peers, ","));

  std::unique_ptr<LocalFleet> fleet(new LocalFleet());
  std::vector<std::string> ready_files;
  for (size_t r = 0; r < options.receivers; ++r) {
    LocalReceiver receiver;
    receiver.log_path = fmt::format("{}/receiver-{}.log", options.work_dir, r);
    ready_files.push_back(fmt::format("{}/receiver-{}.ready", options.work_dir, r));
    ::unlink(ready_files.back().c_str());
    std::vector<std::string> argv = {
        binary,         "serve",           "--model",        options.model_path,
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
    argv.insert(argv.end(), options.extra_args.begin(), options.extra_args.end());
    Result<pid_t> pid = SpawnWithLog(argv, receiver.log_path);
    if (!pid.ok()) {
      fleet->Stop().IgnoreError();
      return pid.status();
    }
    receiver.pid = *pid;
    fleet->receivers_.push_back(std::move(receiver));
  }

  const auto deadline = std::chrono::steady_clock::now() + options.start_timeout;
  for (size_t r = 0; r < fleet->receivers_.size(); ++r) {
    LocalReceiver& receiver = fleet->receivers_[r];
    while (true) {
      std::ifstream ready(ready_files[r]);
      if (ready) {
        nlohmann::json info = nlohmann::json::parse(ready, nullptr, /*allow_exceptions=*/false);
        if (info.is_object() && info.contains("control_url") && info.contains("data_endpoint") &&
            info["control_url"].is_string() && info["data_endpoint"].is_string()) {
          receiver.control_url = info["control_url"].get<std::string>();
          receiver.data_endpoint = info["data_endpoint"].get<std::string>();
          break;
        }
      }
      int wait_status = 0;
      const bool exited = ::waitpid(receiver.pid, &wait_status, WNOHANG) == receiver.pid;
      if (exited || std::chrono::steady_clock::now() > deadline) {
        if (exited) receiver.pid = -1;
        const std::string log = LogTail(receiver.log_path);
        fleet->Stop().IgnoreError();
        return Unavailable(
            "receiver {} ({}) {}; its log ends with:\n{}", r, peers[r],
            exited ? "exited before it was ready"
                   : fmt::format("was not ready within {} s", options.start_timeout.count()),
            log);
      }
      std::this_thread::sleep_for(kPollInterval);
    }
  }
  return fleet;
}

LocalFleet::~LocalFleet() {
  if (!stopped_) Stop().IgnoreError();
}

Status LocalFleet::Stop() {
  stopped_ = true;
  for (const LocalReceiver& receiver : receivers_) {
    if (receiver.pid > 0) ::kill(receiver.pid, SIGTERM);
  }
  std::vector<std::string> problems;
  for (size_t r = 0; r < receivers_.size(); ++r) {
    LocalReceiver& receiver = receivers_[r];
    if (receiver.pid <= 0) continue;
    const auto deadline = std::chrono::steady_clock::now() + kStopGrace;
    int wait_status = 0;
    pid_t done = 0;
    while ((done = ::waitpid(receiver.pid, &wait_status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(kPollInterval);
    }
    if (done == 0) {
      ::kill(receiver.pid, SIGKILL);
      ::waitpid(receiver.pid, &wait_status, 0);
      problems.push_back(
          fmt::format("receiver {} did not stop within {} s of SIGTERM and was "
                      "killed; its log ends with:\n{}",
                      r, kStopGrace.count(), LogTail(receiver.log_path)));
    } else if (!WIFEXITED(wait_status) || WEXITSTATUS(wait_status) != 0) {
      problems.push_back(
          fmt::format("receiver {} exited with {} {}; its log ends with:\n{}", r,
                      WIFEXITED(wait_status) ? "status" : "signal",
                      WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : WTERMSIG(wait_status),
                      LogTail(receiver.log_path)));
    }
    receiver.pid = -1;
  }
  if (!problems.empty()) return Internal("{}", fmt::join(problems, "\n"));
  return Status::OK();
}

std::vector<std::string> LocalFleet::data_endpoints() const {
  std::vector<std::string> endpoints;
  for (const LocalReceiver& receiver : receivers_) endpoints.push_back(receiver.data_endpoint);
  return endpoints;
}

namespace {

Result<uint64_t> PeakRssOf(const std::string& status_path) {
  std::ifstream in(status_path);
  if (!in) return NotFound("{} is not readable (the process exited?)", status_path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream fields(line.substr(6));
      uint64_t kib = 0;
      fields >> kib;
      return kib * 1024;
    }
  }
  return NotFound("{} has no VmHWM line", status_path);
}

}  // namespace

Result<uint64_t> LocalFleet::PeakRssBytes(size_t i) const {
  if (i >= receivers_.size() || receivers_[i].pid <= 0) {
    return NotFound("receiver {} is not running", i);
  }
  return PeakRssOf(fmt::format("/proc/{}/status", receivers_[i].pid));
}

Result<std::string> MakeTemporaryDirectory(std::string_view stem) {
  std::string pattern =
      (std::filesystem::temp_directory_path() / fmt::format("{}-XXXXXX", stem)).string();
  if (::mkdtemp(pattern.data()) == nullptr) return IoErrorFromErrno(errno, "mkdtemp " + pattern);
  return pattern;
}

std::string GenerateApiKey() {
  std::random_device device;
  return fmt::format("{:016x}{:016x}", (uint64_t{device()} << 32) | device(),
                     (uint64_t{device()} << 32) | device());
}

Result<uint64_t> SelfPeakRssBytes() { return PeakRssOf("/proc/self/status"); }

}  // namespace refit::cli
