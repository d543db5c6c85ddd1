// LocalFleet: N `refit serve` daemons on loopback, each its own process — the receivers of
// `refit demo` and of the end-to-end benchmark. Every byte between trainer and receivers crosses
// real sockets, and each receiver's memory is its own process's.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "refit/status.h"

namespace refit::cli {

/// Options of LocalFleet::Start.
struct LocalFleetOptions {
  /// The `refit` executable; empty: this process's own executable.
  std::string refit_binary;
  /// The safetensors file every receiver loads.
  std::string model_path;
  size_t receivers = 1;
  /// The name of an environment variable (set in this process) holding the api key the daemons
  /// require; empty runs them without a key.
  std::string api_key_env;
  /// Where ready files and each daemon's log go (must exist).
  std::string work_dir;
  /// The daemons' data-plane transport: empty for the zmq:// relay tree (a data port each, the
  /// relay list in receiver order), or an s3:// URI (no data port: manifests arrive on the
  /// control plane).
  std::string transport_uri;
  /// More `refit serve` arguments for every daemon (e.g. "--mmap").
  std::vector<std::string> extra_args;
  /// How long a daemon may take to load the model and bind its ports.
  std::chrono::seconds start_timeout{std::chrono::minutes(5)};
};

/// One running daemon.
struct LocalReceiver {
  pid_t pid = -1;
  std::string control_url;
  /// What producers send to: the ZeroMQ relay endpoint host:port, or for s3:// the control URL.
  std::string data_endpoint;
  std::string log_path;
};

/// Starts and stops the daemons. Not thread-safe; one owner.
class LocalFleet {
 public:
  /// Start every daemon (on free loopback ports, the relay list in receiver order) and wait
  /// until each has written its ready file. Errors: InvalidArgument (no receivers, no model);
  /// IoError (fork/exec failed); Unavailable naming the daemon, with the end of its log, when one
  /// exits or is not ready within start_timeout (the others are stopped).
  static Result<std::unique_ptr<LocalFleet>> Start(const LocalFleetOptions& options);

  /// Stop() if not stopped.
  ~LocalFleet();
  LocalFleet(const LocalFleet&) = delete;
  LocalFleet& operator=(const LocalFleet&) = delete;

  /// SIGTERM every daemon and wait for it (SIGKILL after a grace period). Errors: Internal
  /// naming each daemon that did not exit with status 0 (with the end of its log).
  Status Stop();

  const std::vector<LocalReceiver>& receivers() const { return receivers_; }
  /// The data endpoints in receiver order: the relay list of the tree.
  std::vector<std::string> data_endpoints() const;
  /// Peak resident memory of daemon `i` so far (VmHWM). Errors: NotFound once it exited.
  Result<uint64_t> PeakRssBytes(size_t i) const;

 private:
  LocalFleet() = default;
  std::vector<LocalReceiver> receivers_;
  bool stopped_ = false;
};

/// Return `count` distinct free TCP ports on 127.0.0.1: each is bound to port 0 and held until all
/// are chosen, so none repeats; another process may still take one before it is used.
/// Errors: IoError.
Result<std::vector<uint16_t>> FreeLoopbackPorts(size_t count);

/// Start `argv` (argv[0] a path) with stdout and stderr appended to `log_path`. The child is put
/// in its own process group, so a Ctrl-C at the terminal reaches the parent, which then stops its
/// children in order. Errors: IoError (the log cannot be opened, fork failed).
Result<pid_t> SpawnWithLog(const std::vector<std::string>& argv, const std::string& log_path);

/// Write `text` to `path` atomically (a temporary file renamed into place), as a child's ready
/// and result files are written. Errors: IoError.
Status WriteTextFileAtomically(const std::string& path, std::string_view text);

/// The last 2000 characters of the file at `path` (a child's log), or "(no log)".
std::string LogTail(const std::string& path);

/// The path of this process's executable (/proc/self/exe). Errors: IoError.
Result<std::string> SelfExecutable();

/// Create a fresh, private directory "<system temp dir>/<stem>-XXXXXX" (mkdtemp) for a fleet's
/// model file, ready files and logs, and return its path. Errors: IoError.
Result<std::string> MakeTemporaryDirectory(std::string_view stem);

/// Return a random api key (32 hex digits) for a fleet that lives only as long as this process.
std::string GenerateApiKey();

/// Return the peak resident memory (VmHWM) of this process.
Result<uint64_t> SelfPeakRssBytes();

}  // namespace refit::cli
