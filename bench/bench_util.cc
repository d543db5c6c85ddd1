#include "bench_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "refit/status_format.h"

namespace refit::bench {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Result<uint64_t> ParseUnsigned(std::string_view flag, std::string_view text) {
  uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) {
    return InvalidArgument("{}: '{}' is not a non-negative integer", flag, text);
  }
  return value;
}

Result<double> ParseDensity(std::string_view flag, std::string_view text, bool allow_one) {
  double value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  const bool in_range = value > 0 && (allow_one ? value <= 1 : value < 1);
  if (error != std::errc() || end != text.data() + text.size() || !in_range) {
    return InvalidArgument("{}: '{}' is not a changed fraction in (0, 1{}", flag, text,
                           allow_one ? "]" : ")");
  }
  return value;
}

std::vector<std::string_view> SplitCommas(std::string_view text) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    parts.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return parts;
}

Result<uint64_t> AvailableMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return NotFound("/proc/meminfo has no MemAvailable line");
}

Status CheckRoom(const std::string& dir, uint64_t disk_bytes, uint64_t memory_bytes,
                 std::string_view memory_use, std::string_view how_to_shrink) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) return IoErrorFromErrno(errno, "statvfs " + dir);
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (free_bytes < disk_bytes) {
    return ResourceExhausted(
        "work dir {} has {} free but the model files need {}: pass --work-dir on a bigger "
        "filesystem or {}",
        dir, FormatBytes(free_bytes), FormatBytes(disk_bytes), how_to_shrink);
  }
  REFIT_ASSIGN_OR_RETURN(uint64_t available, AvailableMemoryBytes());
  if (available < memory_bytes) {
    return ResourceExhausted("the run needs about {} of memory ({}) but MemAvailable is {}: {}",
                             FormatBytes(memory_bytes), memory_use, FormatBytes(available),
                             how_to_shrink);
  }
  return Status::OK();
}

std::unique_ptr<ProgressReporter> Progress(const std::string& label, uint64_t total,
                                           const std::string& unit) {
  ProgressReporter::Options options;
  options.label = label;
  options.total = total;
  options.unit = unit;
  Result<std::unique_ptr<ProgressReporter>> made = ProgressReporter::Make(options);
  return made.ok() ? std::move(made).ValueOrDie() : nullptr;
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const size_t middle = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + middle, values.end());
  if (values.size() % 2 == 1) return values[middle];
  const double upper = values[middle];
  return 0.5 * (upper + *std::max_element(values.begin(), values.begin() + middle));
}

namespace {

// How often a waiting loop looks at a child again.
constexpr auto kPollInterval = std::chrono::milliseconds(10);
// Writing this to /proc/<pid>/clear_refs resets the process's peak RSS (VmHWM) to its current
// RSS (proc(5), Linux 4.0+).
constexpr std::string_view kResetPeakRss = "5";

// Reap `pid` if it has ended, without waiting: its exit (peak RSS not set), or nullopt while it
// runs.
Result<std::optional<ChildExit>> ReapIfEnded(pid_t pid) {
  int status = 0;
  const pid_t done = ::waitpid(pid, &status, WNOHANG);
  if (done < 0) return IoErrorFromErrno(errno, fmt::format("waitpid {}", pid));
  if (done == 0) return std::optional<ChildExit>();
  ChildExit exit;
  exit.exited = WIFEXITED(status);
  exit.code = exit.exited ? WEXITSTATUS(status) : WTERMSIG(status);
  return std::optional<ChildExit>(exit);
}

}  // namespace

std::string ChildExit::Describe() const {
  return fmt::format("{} {}", exited ? "status" : "signal", code);
}

Result<pid_t> SpawnProcess(const std::vector<std::string>& argv, const std::string& stdout_path,
                           const std::string& stderr_path) {
  if (argv.empty()) return InvalidArgument("spawn: empty command line");
  const int out = ::open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0) return IoErrorFromErrno(errno, "open " + stdout_path);
  int err = out;
  if (stderr_path != stdout_path) {
    err = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (err < 0) {
      ::close(out);
      return IoErrorFromErrno(errno, "open " + stderr_path);
    }
  }
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    ::setpgid(0, 0);
    ::dup2(out, STDOUT_FILENO);
    ::dup2(err, STDERR_FILENO);
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, STDIN_FILENO);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::close(out);
  if (err != out) ::close(err);
  if (pid < 0) return IoErrorFromErrno(fork_errno, "fork");
  return pid;
}

Result<std::vector<ChildExit>> WaitProcesses(const std::vector<pid_t>& pids,
                                             std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<ChildExit> exits(pids.size());
  std::vector<uint64_t> peaks(pids.size(), 0);
  std::vector<bool> ended(pids.size(), false);
  size_t running = pids.size();
  while (running > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (ended[i]) continue;
      // Sampled before the reap: a child that has exited (a zombie) has no VmHWM any more. The
      // last sample counts, not the largest: until exec the child's VmHWM is its copy of the
      // parent's memory, and exec starts it afresh.
      if (Result<uint64_t> peak = ProcessMemoryBytes(std::to_string(pids[i]), "VmHWM"); peak.ok()) {
        peaks[i] = *peak;
      }
      REFIT_ASSIGN_OR_RETURN(std::optional<ChildExit> exit, ReapIfEnded(pids[i]));
      if (!exit.has_value()) continue;
      exits[i] = *exit;
      exits[i].peak_rss_bytes = peaks[i];
      ended[i] = true;
      --running;
    }
    if (running == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      std::vector<std::string> killed;
      for (size_t i = 0; i < pids.size(); ++i) {
        if (ended[i]) continue;
        ::kill(pids[i], SIGKILL);
        int status = 0;
        ::waitpid(pids[i], &status, 0);
        killed.push_back(std::to_string(pids[i]));
      }
      return DeadlineExceeded("process(es) {} did not end within {} ms and were killed",
                              fmt::join(killed, ", "), timeout.count());
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  return exits;
}

Result<ChildExit> WaitProcess(pid_t pid, std::chrono::milliseconds timeout) {
  REFIT_ASSIGN_OR_RETURN(std::vector<ChildExit> exits, WaitProcesses({pid}, timeout));
  return exits[0];
}

Result<ChildExit> TerminateProcess(pid_t pid, std::chrono::milliseconds grace) {
  ::kill(pid, SIGTERM);
  return WaitProcess(pid, grace);
}

Result<std::string> WaitForReadyFile(const std::string& path, pid_t pid,
                                     std::chrono::milliseconds timeout,
                                     const std::string& log_path) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    std::ifstream in(path);
    if (in) {
      std::stringstream text;
      text << in.rdbuf();
      return text.str();
    }
    REFIT_ASSIGN_OR_RETURN(std::optional<ChildExit> exit, ReapIfEnded(pid));
    if (exit.has_value()) {
      return Unavailable("process {} ended ({}) before it wrote {}; its log ends with:\n{}", pid,
                         exit->Describe(), path, FileTail(log_path));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Unavailable("process {} did not write {} within {} ms; its log ends with:\n{}", pid,
                         path, timeout.count(), FileTail(log_path));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

std::string FileTail(const std::string& path, size_t max_chars) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "(no log)";
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  in.seekg(std::max<std::streamoff>(0, size - static_cast<std::streamoff>(max_chars)));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

Result<uint64_t> ProcessMemoryBytes(const std::string& pid, std::string_view field) {
  const std::string path = fmt::format("/proc/{}/status", pid);
  std::ifstream in(path);
  if (!in) return NotFound("{} is not readable (the process exited?)", path);
  const std::string prefix = fmt::format("{}:", field);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) {
      std::istringstream fields(line.substr(prefix.size()));
      uint64_t kib = 0;
      fields >> kib;
      return kib * 1024;
    }
  }
  return NotFound("{} has no {} line", path, field);
}

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

}  // namespace refit::bench
