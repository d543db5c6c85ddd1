// refit serve: the receiver daemon, a thin CLI over ReceiverNode (refit/receiver_node.h). It holds
// one model (a safetensors file read into memory or mapped copy-on-write, optionally mapped onto
// its own layout by a loader: --loader, e.g. one tensor-parallel shard of --replica), takes
// payloads from its data plane — a relay-tree data port (zmq://), or an object store whose payloads
// the producers announce through the control plane (s3://) — and the coordinator on an HTTP
// control plane, and serves until SIGTERM or SIGINT. With --bootstrap s3://… it first catches up
// from a versioned chain (src/transport/s3/s3_chain.h). At shutdown the node rolls an open transfer
// back to the committed version bit-exactly.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "config_file.h"
#include "progress.h"
#include "refit/lineage.h"
#include "refit/loader.h"
#include "refit/logging.h"
#include "refit/receiver_node.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "role_options.h"
#if REFIT_HAVE_MPI
#include "refit/mpi.h"
#endif

namespace refit::cli {
namespace {

/// Everything `refit serve` is configured with: the configuration (the file, with the flags
/// that name its keys on top) and what only a command line says.
struct ServeSettings {
  /// The model, both planes, the session, the loader and the transport (docs/configuration.md).
  config::RefitConfig config;
  /// Hold every tensor behind the device boundary's test backend (StoreMode::kDeviceTest).
  bool device_memory_test = false;
  /// Every relay's data endpoint in tree order, the same list on every receiver of the fleet,
  /// this one's included (--peers, else the file's receivers). Empty: each transfer names its
  /// tree.
  std::vector<std::string> peers;
  /// The version the model is at; unset: the file's "refit.version" metadata, else 0.
  std::optional<uint64_t> version;
  /// A publisher's membership URL to join once both planes listen (left at a clean shutdown),
  /// and the addresses to advertise there instead of the node's own. Empty: join none.
  std::string join_publisher;
  std::string advertise_control;
  std::string advertise_data;
  /// Where to write the weights held at a clean shutdown (safetensors, with their version):
  /// what an MPI job's receivers keep when the job ends. Empty: nothing is written.
  std::string save_on_exit;
};

// Bind addresses that mean "every interface" (IPv4, ZeroMQ's and IPv6's spellings): nobody can
// reach a receiver by them, so a receiver bound there needs --advertise.
constexpr std::string_view kWildcardAddresses[] = {"0.0.0.0", "*", "::", "[::]"};

// The CLI's own logger, on stderr like the library's and at the library's level (--log-level):
// the library's logger is internal, and serve's lifecycle events belong with its messages.
spdlog::logger& ServeLogger() {
  static const std::shared_ptr<spdlog::logger> logger = [] {
    auto created = std::make_shared<spdlog::logger>(
        "refit-serve", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    // The library logger's layout (time, level, name), so both read as one log.
    created->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] [%n] %v");
    created->set_level(spdlog::level::from_str(std::string(CurrentLogLevel())));
    return created;
  }();
  return *logger;
}

// `relay`: the data plane is a relay tree (zmq://), which needs a data port; an object store
// (s3://) binds nothing and takes its manifests on the control plane.
Status CheckSettings(const ServeSettings& settings, bool relay) {
  const config::ServerConfig& server = settings.config.server;
  if (!relay) {
    if (settings.config.zmq_refit_server_port != 0 || !settings.peers.empty()) {
      return InvalidArgument(
          "serve: --data-port and --peers are for relay-tree transports (zmq://); an object-store "
          "transport announces payloads through the control plane");
    }
  } else if (settings.config.zmq_refit_server_port == 0 && !settings.peers.empty()) {
    return InvalidArgument(
        "serve: a static relay tree (--peers, or the configuration's receivers) needs a fixed "
        "--data-port (1-65535) to name this receiver in; port 0 (the kernel's choice, the "
        "default without --config) is for receivers without one, whose relay tree each transfer "
        "names");
  }
  const bool wildcard = std::find(std::begin(kWildcardAddresses), std::end(kWildcardAddresses),
                                  server.bind) != std::end(kWildcardAddresses);
  if (wildcard && server.advertise.empty()) {
    return InvalidArgument(
        "serve: --bind {} listens on every interface, which names no receiver: give --advertise "
        "HOST, the address other relays and producers reach this receiver by",
        server.bind);
  }
  return Status::OK();
}

// The host other relays and producers reach this receiver by (--advertise, else --bind).
const std::string& AdvertisedHost(const config::ServerConfig& server) {
  return server.advertise.empty() ? server.bind : server.advertise;
}

// Return the transport URI with the data-plane key named by --api-key-env added, unless the URI
// names the same variable already. Errors: InvalidArgument for a malformed URI or a URI that
// names another key.
Result<TransportUri> DataPlaneUri(TransportUri uri, const std::string& api_key_env) {
  if (api_key_env.empty()) return uri;
  const std::string* env = uri.Param(kUriApiKeyEnvParam);
  if (uri.Param(kUriApiKeyParam) != nullptr || (env != nullptr && *env != api_key_env)) {
    return InvalidArgument(
        "serve: --transport sets its own api key while --api-key-env {} sets the key of both "
        "planes; give it once",
        api_key_env);
  }
  if (env == nullptr) uri.params.emplace_back(kUriApiKeyEnvParam, api_key_env);
  return uri;
}

// Block SIGTERM and SIGINT in the calling thread and return the set. Threads inherit the mask,
// so when this runs before any thread starts, only sigwait on this thread ever takes them.
sigset_t BlockShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGUSR1);
  // The mask is never restored: serve is the process's last act, and unblocking after shutdown
  // would let a second signal kill the process before it reports how it ended.
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

std::string ReadyFileText(const std::string& control_url, const std::string& data_endpoint,
                          uint64_t version, size_t tensors) {
  const nlohmann::json ready = {{"pid", static_cast<int64_t>(::getpid())},
                                {"control_url", control_url},
                                {"data_endpoint", data_endpoint},
                                {"version", version},
                                {"tensors", tensors}};
  return ready.dump() + "\n";
}

Status WriteReadyFile(const std::string& path, const std::string& text) {
  const auto* bytes = reinterpret_cast<const std::byte*>(text.data());
  return WriteFileAtomically(path, {std::vector<std::byte>(bytes, bytes + text.size())})
      .WithContext("--ready-file");
}

// Payload-sized buffers (a received payload, a decoded body: up to a bucket, 32 MiB by default)
// come and go once per payload. glibc raises its mmap threshold to the size of the first such
// buffer freed, and carves later ones from arenas it does not give back to the system: an anchor
// left the daemon about 0.2 × the model above what it holds (e2e_bench, 1 GiB). A fixed threshold
// maps every buffer of 1 MiB or more and unmaps it when it is freed, at the cost of page faults on
// fresh buffers (about 1 ms per 32 MiB payload).
constexpr int kMmapThresholdBytes = 1 << 20;

Status RunServe(const ServeSettings& settings) {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
#endif
  const config::RefitConfig& config = settings.config;
  const config::ServerConfig& server = config.server;
  const sigset_t shutdown_signals = BlockShutdownSignals();
  // A client that disconnects while the control plane writes to it must cost that request, not
  // the daemon: the HTTP library writes without MSG_NOSIGNAL.
  std::signal(SIGPIPE, SIG_IGN);
  // A ready file left by an earlier run must not announce this one before it listens.
  if (!server.ready_file.empty()) std::remove(server.ready_file.c_str());
  if (server.model.empty()) return InvalidArgument("serve: --model is required");

  // The model, the session, the control plane (with the key --api-key-env names), the loader.
  Result<ReceiverNodeOptions> configured = config::ToReceiverNodeOptions(config);
  if (!configured.ok()) return configured.status().WithContext("serve");
  ReceiverNodeOptions options = *std::move(configured);
  const std::string& api_key = options.control.api_key;
  // The flags a data plane needs depend on its kind (a relay tree binds a data port).
  REFIT_ASSIGN_OR_RETURN(TransportUri uri, TransportUri::Parse(options.transport_uri));
  REFIT_ASSIGN_OR_RETURN(const std::unique_ptr<Transport> kind, MakeTransport(uri));
  // A collective's data plane is the job's communicator, which takes no key (its HTTP control
  // plane still does); the others carry --api-key-env's key.
  if (!kind->capabilities().carries_control) {
    REFIT_ASSIGN_OR_RETURN(uri, DataPlaneUri(std::move(uri), config.http_refit_api_key_env_var));
  }
  const bool relay = kind->capabilities().fan_out_tree;
  // A collective (mpi://): this process is one receiver rank of an MPI job, which ends when the
  // producers close it.
  const bool collective = kind->capabilities().carries_control;
  REFIT_RETURN_NOT_OK(CheckSettings(settings, relay));

  if (settings.device_memory_test) options.store_mode = StoreMode::kDeviceTest;
  options.version = settings.version;
  options.transport_uri = uri.ToString();
#if REFIT_HAVE_MPI
  if (collective) {
    REFIT_ASSIGN_OR_RETURN(const MpiJobInfo info, CurrentMpiJob());
    if (info.producer) {
      return InvalidArgument(
          "serve: rank {} is producer {} of the MPI job: run `refit push` on the first {} "
          "rank(s) (mpirun -np P refit push … : -np R refit serve …)",
          info.rank, info.index, info.producers);
    }
    // The job's layout says where this rank sits (mpi://?shard_group=G), unless --replica does.
    if (server.replica.empty()) options.place = info.place;
  }
#endif
  if (relay) {
    options.data_endpoint =
        fmt::format("{}:{}", AdvertisedHost(server), config.zmq_refit_server_port);
    if (!settings.peers.empty() &&
        std::count(settings.peers.begin(), settings.peers.end(), options.data_endpoint) != 1) {
      return InvalidArgument(
          "serve: --peers must list this receiver's data endpoint {} exactly once "
          "(--advertise:--data-port, --advertise defaulting to --bind), the same list on every "
          "receiver",
          options.data_endpoint);
    }
    options.peers = settings.peers;
    if (AdvertisedHost(server) != server.bind) options.data_bind_address = server.bind;
  }
  options.on_bootstrap_version = [](const ChainVersion& replayed) {
    ServeLogger().info("serve: bootstrap: replayed {} {} ({} payloads)",
                       replayed.anchor ? "anchor" : "delta", replayed.version,
                       replayed.payloads.size());
  };
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ReceiverNode> node, ReceiverNode::Make(options));
  REFIT_RETURN_NOT_OK(node->Start().WithContext("serve"));
  if (const std::optional<ChainBootstrapReport>& caught_up = node->bootstrap_report()) {
    std::printf(
        "refit serve: bootstrap: version %llu -> %llu: %llu version(s) replayed%s, %llu payloads, "
        "%.1f MiB in %.2f s\n",
        static_cast<unsigned long long>(caught_up->start_version),
        static_cast<unsigned long long>(caught_up->final_version),
        static_cast<unsigned long long>(caught_up->versions_replayed),
        caught_up->replayed_anchor ? " from the anchor" : "",
        static_cast<unsigned long long>(caught_up->payloads),
        static_cast<double>(caught_up->bytes) / (1 << 20), caught_up->seconds);
    std::fflush(stdout);
  }
  if (!options.bootstrap_peer.empty()) {
    std::printf("refit serve: bootstrap: version %llu, copied from peer %s\n",
                static_cast<unsigned long long>(node->status().version),
                options.bootstrap_peer.c_str());
    std::fflush(stdout);
  }
  // Said once at start: a producer whose payload is over it is refused (ResourceExhausted).
  const std::string limit_source =
      server.max_payload_bytes.has_value()
          ? std::string("server.max_payload_bytes, --max-payload-bytes")
          : fmt::format(
                "default: twice the larger of the producers' {} bucket and the model's largest "
                "tensor, at least {}",
                FormatBytes(options.producer_bucket_bytes),
                FormatBytes(kMinDefaultMaxPayloadBytes));
  std::printf("refit serve: payloads of up to %s on either plane (%s)\n",
              FormatBytes(node->max_payload_bytes()).c_str(), limit_source.c_str());
  if (api_key.empty()) {
    ServeLogger().warn(
        "serve: no api key on the control plane (--api-key-env): anyone who can reach {} can "
        "write this receiver's weights",
        server.bind);
  }

  const uint64_t version = node->status().version;
  const size_t tensors = node->store().size();
  const std::string control_url = node->control_url();
  if (!server.ready_file.empty()) {
    REFIT_RETURN_NOT_OK(
        WriteReadyFile(server.ready_file,
                       ReadyFileText(control_url, node->producer_endpoint(), version, tensors)));
  }
  const std::string data_plane =
      relay ? (settings.peers.empty()
                   ? fmt::format("{} (a relay: each transfer names its tree)",
                                 node->producer_endpoint())
                   : fmt::format("{} (static tree of {} relay{})", node->producer_endpoint(),
                                 settings.peers.size(), settings.peers.size() > 1 ? "s" : ""))
      : collective
          ? fmt::format("{} (an MPI job: payloads and control on its communicator)",
                        node->producer_endpoint())
          : fmt::format("{}://{} (manifests on the control plane)", uri.scheme, uri.target);
  const std::string place =
      options.place.replica.empty() && !options.loader.has_value()
          ? std::string()
          : fmt::format(", replica '{}' shard {} of {}", node->options().place.replica,
                        node->options().place.shard, node->options().place.shards);
  std::printf("refit serve: ready: control %s, data %s, version %llu, %zu tensors%s\n",
              control_url.c_str(), data_plane.c_str(), static_cast<unsigned long long>(version),
              tensors, place.c_str());
  std::fflush(stdout);
  if (!settings.join_publisher.empty()) {
    REFIT_ASSIGN_OR_RETURN(
        const FleetMembership joined,
        node->Join(settings.join_publisher,
                   MemberEndpoint{settings.advertise_control, settings.advertise_data}));
    std::printf("refit serve: joined the fleet of %s (fleet version %s, %zu members)\n",
                settings.join_publisher.c_str(),
                joined.fleet_version.has_value() ? std::to_string(*joined.fleet_version).c_str()
                                                 : "unknown",
                joined.members.size());
    std::fflush(stdout);
  }

  // An MPI job ends when its producers close it: a thread waits for that and wakes the sigwait
  // below with SIGUSR1 (blocked like the others, so it is only ever taken here).
  std::jthread job_end;
#if REFIT_HAVE_MPI
  if (collective) {
    job_end = std::jthread([](const std::stop_token& stop) {
      if (WaitForMpiJobEnd(stop).ok()) kill(getpid(), SIGUSR1);
    });
  }
#endif
  int signal_number = 0;
  if (const int error = sigwait(&shutdown_signals, &signal_number); error != 0) {
    return Internal("serve: sigwait: {}", std::strerror(error));
  }
  const std::string_view signal_name = signal_number == SIGTERM  ? "SIGTERM"
                                       : signal_number == SIGINT ? "SIGINT"
                                                                 : "the end of the MPI job";
  ServeLogger().info("serve: {} received; shutting down", signal_name);
  job_end.request_stop();
  const ReceiverStatus open = node->status();
  if (open.state != ReceiverState::kIdle) {
    ServeLogger().warn(
        "serve: transfer {} is {} at shutdown ({} payloads applied): rolling it back to "
        "version {}",
        open.transfer_id.value_or(TransferId{}).ToHex(), ReceiverStateName(open.state),
        open.applied_payloads, open.base_version);
  }
  node->Stop();
#if REFIT_HAVE_MPI
  if (collective) FinalizeMpi();
#endif
  if (!server.ready_file.empty()) std::remove(server.ready_file.c_str());
  if (!settings.save_on_exit.empty()) {
    const uint64_t held = node->store().version();
    // The lineage is saved with the version, so that a receiver restarted from this file keeps
    // refusing what it refused before (docs/protocol.md "Lineage and fencing").
    std::map<std::string, std::string> metadata = LineageMetadata(node->store().lineage());
    metadata[kWeightVersionMetadataKey] = std::to_string(held);
    REFIT_RETURN_NOT_OK(WriteSafetensors(settings.save_on_exit, node->store().tensors(), metadata)
                            .WithContext("serve: --save-on-exit"));
    std::printf("refit serve: wrote version %llu to %s\n", static_cast<unsigned long long>(held),
                settings.save_on_exit.c_str());
  }
  std::printf("refit serve: clean shutdown on %s at version %llu\n",
              std::string(signal_name).c_str(),
              static_cast<unsigned long long>(node->store().version()));
  std::fflush(stdout);
  return Status::OK();
}

// What a `refit serve` command line says: the configuration file, the flags that set its keys
// (in the order given) and the flags only a command line has.
struct ServeArgs {
  std::string config_path;
  std::vector<config::ConfigOverride> overrides;
  ServeSettings settings;
};

// The settings of the command line: the file (if any) with the flags that set its keys on top;
// its receivers' data endpoints are the relay list unless --peers gives one.
Result<ServeSettings> ResolveSettings(const ServeArgs& args, bool peers_given) {
  std::vector<config::ConfigOverride> overrides;
  // Without a file, the data port is the kernel's choice: each transfer names its relay tree.
  // (The file's default is a fixed port, for fleets that list their receivers.)
  if (args.config_path.empty()) {
    overrides.push_back({"zmq_refit_server_port", "0", "refit serve without --config"});
  }
  overrides.insert(overrides.end(), args.overrides.begin(), args.overrides.end());
  ServeSettings settings = args.settings;
  REFIT_ASSIGN_OR_RETURN(settings.config, config::LoadConfigFile(args.config_path, overrides));
  if (!peers_given) {
    settings.peers.clear();
    for (const config::ReceiverConfig& receiver : settings.config.receivers) {
      if (!receiver.data.empty()) settings.peers.push_back(receiver.data);
    }
  }
  return settings;
}

}  // namespace

void RegisterServe(CLI::App& app, Status* result) {
  auto args = std::make_shared<ServeArgs>();
  ServeSettings& settings = args->settings;
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "Run a receiver: hold a model, take payloads on a relay-tree data port and transfers on "
      "an HTTP control plane, until SIGTERM or SIGINT");
  cmd->add_option("--config", args->config_path,
                  "A refit YAML file (docs/configuration.md): its server section, ports, tuning, "
                  "receivers (the relay list), transport and api key variable; flags override it")
      ->check(CLI::ExistingFile);
  // A flag that sets a key of the configuration file: its value is read and checked as the
  // file's would be, and wins over the file. `key` is named in --help.
  const auto config_option = [&](const char* flag, const char* key, const std::string& help,
                                 const char* type_name = "TEXT") {
    return cmd
        ->add_option_function<std::string>(
            flag,
            [args, flag, key](const std::string& value) {
              args->overrides.push_back({key, value, flag});
            },
            fmt::format("{} [{}]", help, key))
        ->type_name(type_name);
  };
  const config::RefitConfig defaults;
  config_option("--model", "server.model", "Model to serve (safetensors; required)");
  cmd->add_flag_callback(
      "--mmap",
      [args] {
        args->overrides.push_back({"server.mmap", "true", "--mmap"});
      },
      "Map the model copy-on-write instead of reading it into memory [server.mmap]");
  cmd->add_flag("--device-memory-test", settings.device_memory_test,
                "Hold every tensor behind the device boundary's test backend, reached only through "
                "gather / scatter / byte ranges as GPU memory would be (for tests of the device "
                "path; docs/architecture.md, \"Device memory\")");
  config_option("--bind", "server.bind", "Address both planes bind")
      ->default_str(defaults.server.bind);
  config_option("--advertise", "server.advertise",
                "Host other relays and producers reach this receiver by: its data endpoint is "
                "HOST:--data-port in --peers and the ready file (default: --bind; required "
                "when --bind is a wildcard such as 0.0.0.0)");
  config_option("--control-port", "http_refit_server_port", "HTTP control port (0: any free one)",
                "PORT")
      ->default_str("0");
  config_option("--data-port", "zmq_refit_server_port",
                "Data port; 0 (the default without --config): one the kernel chooses as it binds, "
                "reported in the log and the ready file (not with --peers)",
                "PORT");
  cmd->add_option("--peers", settings.peers,
                  "A static relay tree, only for coordinators that name none (refit push and "
                  "Publisher name each transfer's tree): every relay's data endpoint host:port "
                  "in tree order, this one's included (default: the file's receivers, else none)")
      ->delimiter(',');
  config_option("--transport", "transport",
                "Data-plane transport URI with its parameters, e.g. zmq://?timeout_ms=5000")
      ->default_str(defaults.transport);
  config_option("--api-key-env", "http_refit_api_key_env_var",
                "Environment variable holding the shared key of both planes");
  config_option("--tls-cert", "server.tls_cert", "PEM certificate of the control plane");
  config_option("--tls-key", "server.tls_key", "PEM private key of the control plane");
  config_option("--apply-queue-depth", "tuning.apply_queue_depth",
                "Payloads staged but not yet applied", "INT")
      ->default_str(std::to_string(defaults.tuning.apply_queue_depth));
  config_option("--apply-queue-bytes", "tuning.apply_queue_bytes",
                "Bytes of payloads staged but not yet applied (an anchor's payloads are up to a "
                "bucket each); one payload larger than this still passes alone",
                "BYTES")
      ->default_str(std::to_string(defaults.tuning.apply_queue_bytes));
  config_option("--transfer-lease", "server.transfer_lease_s",
                "Seconds a transfer may go without progress (prepare, payload, apply, flush) while "
                "receiving before this receiver aborts and rolls it back itself; 0: no lease "
                "(default 300). A prepared transfer has no lease: it waits for commit or abort",
                "SECONDS");
  config_option("--anchor-undo", "server.anchor_undo",
                "What undoes an anchor (FULL): memory (old bits in RAM, ~2x the model during a "
                "FULL), file (old bits spilled to --anchor-undo-dir, ~1x), none (~1x; an aborted "
                "FULL leaves the receiver needing the next anchor, refusing deltas)")
      ->default_str("memory");
  config_option("--anchor-undo-dir", "server.anchor_undo_dir",
                "Directory of the spill file of --anchor-undo file (default: $TMPDIR or /tmp)");
  config_option("--apply-threads", "tuning.apply_threads",
                "Threads that apply one payload, one tensor per thread at a time (an anchor's "
                "FULL items, a delta's items); payloads still apply in arrival order",
                "INT")
      ->default_str(std::to_string(defaults.tuning.apply_threads));
  config_option("--decode-threads", "tuning.decode_threads",
                "Threads that decode (checksum, decompress, parse) queued payloads ahead of the "
                "apply, each holding one decompressed payload; 0: the apply thread decodes",
                "INT")
      ->default_str(std::to_string(defaults.tuning.decode_threads));
  config_option("--max-payload-bytes", "server.max_payload_bytes",
                "Largest payload either plane accepts, and largest decompressed payload body, e.g. "
                "256MiB (default: twice the larger of the producers' bucket size and the model's "
                "largest tensor, at least 256MiB)",
                "BYTES");
  cmd->add_option_function<uint64_t>(
      "--version", [args](const uint64_t& version) { args->settings.version = version; },
      "Weight version of the model (default: its refit.version metadata, else 0)");
  config_option("--bootstrap", "server.bootstrap",
                "Before serving, catch up from the versioned chain at this s3:// URI (the "
                "trainer's transport URI with chain=1): replay its newest anchor and deltas, "
                "verifying each version's state fingerprint; later, when a transfer is "
                "prepared from a newer version than this receiver holds, replay the deltas "
                "it missed first");
  config_option("--bootstrap-peer", "server.bootstrap_peer",
                "Before serving, copy the fleet's version from this peer (the control URL of a "
                "receiver with the same tensors, or, with --loader, of one without a loader, "
                "whose tensors the loader cuts), verified by its state fingerprint, instead of "
                "being sent an anchor by the trainer; the --api-key authenticates it",
                "URL");
  config_option("--loader", "server.loader",
                "A loader spec (YAML: tp_rank, tp_size, rules) mapping canonical tensors onto "
                "this receiver's tensors: rename, skip, row/column shards, fused qkv and "
                "gate_up, vocabulary-parallel embeddings (docs/configuration.md)")
      ->check(CLI::ExistingFile);
  config_option("--replica", "server.replica",
                "The replica this receiver belongs to: the shards of a tensor-parallel group "
                "share it and are verified together");
  config_option("--ready-file", "server.ready_file",
                "Write {pid, control_url, data_endpoint, version, tensors} as JSON here once "
                "both planes listen; removed at a clean shutdown");
  cmd->add_option("--join", settings.join_publisher,
                  "Join the fleet of this publisher membership URL once serving (leave it at a "
                  "clean shutdown); the fleet's key is the control plane's (--api-key-env)");
  cmd->add_option("--advertise-control", settings.advertise_control,
                  "With --join: the control URL the publisher reaches this receiver at");
  cmd->add_option("--advertise-data", settings.advertise_data,
                  "With --join: the data endpoint the publisher sends to");
  cmd->add_option("--save-on-exit", settings.save_on_exit,
                  "Write the weights held at a clean shutdown to this safetensors file, with "
                  "their version (what an MPI job's receivers keep when the job ends)");
  cmd->callback([cmd, args, result] {
    Result<ServeSettings> resolved = ResolveSettings(*args, cmd->count("--peers") > 0);
    *result = resolved.ok() ? RunServe(*resolved) : resolved.status();
  });
}

}  // namespace refit::cli
