// What the end-to-end benchmarks (e2e_bench, s3_bench) share: flag parsing, pre-flight checks of
// disk and memory, a monotonic clock, progress reporting, and the child processes they start
// (daemons, producer ranks) with their memory figures.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "local_fleet.h"
#include "progress.h"
#include "refit/status.h"

namespace refit::bench {

/// Seconds on the steady clock.
double Now();

/// `text` as a non-negative decimal integer. Errors: InvalidArgument naming `flag`.
Result<uint64_t> ParseUnsigned(std::string_view flag, std::string_view text);

/// `text` as a changed fraction in (0, 1], or (0, 1) when `allow_one` is false (a simulator
/// calibrated to a density cannot change every element). Errors: InvalidArgument naming `flag`.
Result<double> ParseDensity(std::string_view flag, std::string_view text, bool allow_one);

/// The comma-separated parts of `text` (an empty part for each empty field).
std::vector<std::string_view> SplitCommas(std::string_view text);

/// MemAvailable from /proc/meminfo, in bytes. Errors: NotFound without that line.
Result<uint64_t> AvailableMemoryBytes();

/// Check that `dir` can take `disk_bytes` more and that `memory_bytes` are available.
/// `memory_use` says what the memory is for and `how_to_shrink` which flags make the run
/// smaller; both go into the ResourceExhausted error.
Status CheckRoom(const std::string& dir, uint64_t disk_bytes, uint64_t memory_bytes,
                 std::string_view memory_use, std::string_view how_to_shrink);

/// A progress reporter (quiet when not on a TTY), or null when one cannot be made.
std::unique_ptr<ProgressReporter> Progress(const std::string& label, uint64_t total,
                                           const std::string& unit);

/// The median of `values` (the mean of the middle two for an even count; 0 for none).
double Median(std::vector<double> values);

// --- Child processes and their memory ---------------------------------------------------------

// Free loopback ports and this executable's path: cli::FreeLoopbackPorts and
// cli::SelfExecutable (local_fleet.h).

/// Start `argv` (argv[0] is a path) in a process group of its own, so that a Ctrl-C at the
/// terminal reaches only the benchmark, which then stops its children in order; stdin is
/// /dev/null, stdout and stderr go to `stdout_path` and `stderr_path` (truncated; they may be the
/// same file). Errors: IoError (open, fork).
Result<pid_t> SpawnProcess(const std::vector<std::string>& argv, const std::string& stdout_path,
                           const std::string& stderr_path);

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

using cli::WriteTextFileAtomically;

/// The last `max_chars` characters of the file at `path`, or "(no log)".
std::string FileTail(const std::string& path, size_t max_chars = 2000);

/// The value of memory field `field` of /proc/<pid>/status ("VmRSS" resident now, "VmHWM" its
/// peak), in bytes; `pid` "self" is this process. Errors: NotFound (no such process or field).
Result<uint64_t> ProcessMemoryBytes(const std::string& pid, std::string_view field);

/// Reset the peak RSS (VmHWM) of process `pid` ("self" for this one) to its current RSS, so that
/// a peak read afterwards belongs to what ran in between (writes 5 to /proc/<pid>/clear_refs,
/// Linux 4.0+). Errors: IoError (not the owner, or a kernel without clear_refs).
Status ResetPeakRss(const std::string& pid);

}  // namespace refit::bench
