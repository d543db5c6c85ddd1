#include "process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "refit/status_format.h"

namespace refit::testkit {

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

Result<std::vector<pid_t>> SpawnProcesses(const std::vector<ChildSpec>& children,
                                          std::chrono::milliseconds grace) {
  std::vector<pid_t> pids;
  for (const ChildSpec& child : children) {
    Result<pid_t> pid = SpawnProcess(child.argv, child.stdout_path, child.stderr_path);
    if (!pid.ok()) {
      for (pid_t started : pids) TerminateProcess(started, grace).status().IgnoreError();
      return pid.status();
    }
    pids.push_back(*pid);
  }
  return pids;
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

Result<std::string> SelfExecutable() {
  std::vector<char> buffer(4096);
  const ssize_t n = ::readlink("/proc/self/exe", buffer.data(), buffer.size() - 1);
  if (n <= 0) return IoErrorFromErrno(errno, "readlink /proc/self/exe");
  return std::string(buffer.data(), static_cast<size_t>(n));
}

Result<std::string> MakeTemporaryDirectory(std::string_view stem) {
  std::string pattern =
      (std::filesystem::temp_directory_path() / fmt::format("{}-XXXXXX", stem)).string();
  if (::mkdtemp(pattern.data()) == nullptr) return IoErrorFromErrno(errno, "mkdtemp " + pattern);
  return pattern;
}

}  // namespace refit::testkit
