// Child processes for tests, benchmarks and `refit demo`: start one with its output in files,
// wait for it (sampling its peak memory), stop it, wait for the ready file it writes; plus the
// small process facts they need (this executable, a private work directory, /proc memory fields).
// One implementation, so that a fleet of daemons and a benchmark's rank processes are started and
// stopped the same way.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "refit/status.h"

namespace refit::testkit {

/// Start `argv` (argv[0] is a path) in a process group of its own, so that a Ctrl-C at the
/// terminal reaches only the parent (a benchmark, `refit demo`), which then stops its children in
/// order; stdin is /dev/null, stdout and stderr go to `stdout_path` and `stderr_path` (truncated;
/// they may be the same file). Errors: IoError (open, fork).
Result<pid_t> SpawnProcess(const std::vector<std::string>& argv, const std::string& stdout_path,
                           const std::string& stderr_path);

/// One child of SpawnProcesses: its command line and where its output goes (as SpawnProcess).
struct ChildSpec {
  std::vector<std::string> argv;
  std::string stdout_path;
  std::string stderr_path;
};

/// Start every child of `children` in order, or none: when one cannot start, the ones started
/// before it — which may be waiting for it, as the ranks of one job do — are terminated (SIGTERM,
/// then SIGKILL after `grace`) and its error is returned. Errors: as SpawnProcess.
Result<std::vector<pid_t>> SpawnProcesses(const std::vector<ChildSpec>& children,
                                          std::chrono::milliseconds grace);

/// How a child process ended.
struct ChildExit {
  /// True when it exited (`code` is its exit status); false when a signal ended it (`code` is
  /// the signal).
  bool exited = false;
  int code = 0;
  /// Its peak resident memory (VmHWM) at the last poll before it ended, in bytes: the peak of
  /// the program it exec'd, provided it ran longer than one poll; 0 when it ended before the first
  /// sample. Not wait4's ru_maxrss: that survives exec and so starts at the forking parent's RSS.
  uint64_t peak_rss_bytes = 0;

  bool ok() const { return exited && code == 0; }
  /// "status 3" or "signal 9".
  std::string Describe() const;
};

/// Wait up to `timeout` for children `pids` to end and reap them, sampling the peak RSS of each
/// while it runs; the exits come back in the order of `pids`. Past the timeout the children
/// still running are killed (SIGKILL) and reaped, and DeadlineExceeded names them.
/// Errors: IoError from waitpid.
Result<std::vector<ChildExit>> WaitProcesses(const std::vector<pid_t>& pids,
                                             std::chrono::milliseconds timeout);

/// WaitProcesses for one child.
Result<ChildExit> WaitProcess(pid_t pid, std::chrono::milliseconds timeout);

/// Send SIGTERM to child `pid` and wait up to `grace` for it (then SIGKILL: DeadlineExceeded).
Result<ChildExit> TerminateProcess(pid_t pid, std::chrono::milliseconds grace);

/// Wait until the file at `path` exists (its writer renames it into place complete) and return
/// its text. Errors: Unavailable when child `pid` exits first or `timeout` passes, quoting the end
/// of `log_path`; the child is then reaped (exited) or left running (timeout).
Result<std::string> WaitForReadyFile(const std::string& path, pid_t pid,
                                     std::chrono::milliseconds timeout,
                                     const std::string& log_path);

/// Write `text` to `path` atomically (a temporary file renamed into place), as a child's ready
/// and result files are written. Errors: IoError.
Status WriteTextFileAtomically(const std::string& path, std::string_view text);

/// The last `max_chars` characters of the file at `path`, or "(no log)".
std::string FileTail(const std::string& path, size_t max_chars = 2000);

/// The value of memory field `field` of /proc/<pid>/status ("VmRSS" resident now, "VmHWM" its
/// peak), in bytes; `pid` "self" is this process. Errors: NotFound (no such process or field).
Result<uint64_t> ProcessMemoryBytes(const std::string& pid, std::string_view field);

/// Reset the peak RSS (VmHWM) of process `pid` ("self" for this one) to its current RSS, so that
/// a peak read afterwards belongs to what ran in between (writes 5 to /proc/<pid>/clear_refs,
/// Linux 4.0+). Errors: IoError (not the owner, or a kernel without clear_refs).
Status ResetPeakRss(const std::string& pid);

/// The path of this process's executable (/proc/self/exe). Errors: IoError.
Result<std::string> SelfExecutable();

/// Create a fresh, private directory "<system temp dir>/<stem>-XXXXXX" (mkdtemp) for a fleet's
/// model file, ready files and logs, and return its path. Errors: IoError.
Result<std::string> MakeTemporaryDirectory(std::string_view stem);

}  // namespace refit::testkit
