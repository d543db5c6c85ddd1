// LocalFleet: `refit serve` daemons on loopback, each its own process — the receivers of `refit
// demo`, of the benchmarks and of the tests that drive the CLI. Every byte between trainer and
// receivers crosses real sockets, and each receiver's memory is its own process's. The one way
// this project starts a fleet of daemons.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "refit/status.h"

namespace refit::testkit {

/// What one daemon holds: its model file, and where it is one shard of a tensor-parallel replica
/// its loader spec and replica name.
struct LocalReceiverSpec {
  std::string model_path;
  /// A loader spec file (`refit serve --loader`); empty: none.
  std::string loader_path;
  /// The replica this daemon is a shard of (`--replica`); empty: none.
  std::string replica;
};

/// Options of LocalFleet::Start.
struct LocalFleetOptions {
  /// The `refit` executable; empty: this process's own executable.
  std::string refit_binary;
  /// The daemons, in relay-tree order.
  std::vector<LocalReceiverSpec> receivers;
  /// The name of an environment variable (set in this process) holding the api key the daemons
  /// require; empty runs them without a key.
  std::string api_key_env;
  /// Where ready files and each daemon's log go (must exist).
  std::string work_dir;
  /// The stem of each daemon's log and ready file: "<work_dir>/<label>-<i>.log".
  std::string label = "receiver";
  /// The daemons' data-plane transport: empty for the zmq:// relay tree (a data port each, the
  /// relay list in receiver order), or an s3:// URI (no data port: manifests arrive on the
  /// control plane).
  std::string transport_uri;
  /// More `refit serve` arguments for every daemon (e.g. "--mmap").
  std::vector<std::string> extra_args;
  /// How long a daemon may take to load the model and bind its ports.
  std::chrono::seconds start_timeout{std::chrono::minutes(5)};

  /// `count` daemons of the same model file.
  static std::vector<LocalReceiverSpec> Replicas(const std::string& model_path, size_t count) {
    return std::vector<LocalReceiverSpec>(count, LocalReceiverSpec{model_path, "", ""});
  }
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

/// Return a random api key (32 hex digits) for a fleet that lives only as long as this process.
std::string GenerateApiKey();

}  // namespace refit::testkit
