// refit serve: the receiver daemon, a thin CLI over ReceiverNode (refit/receiver_node.h). It holds
// one model (a safetensors file read into memory or mapped copy-on-write, optionally mapped onto
// its own layout by a loader: --loader, e.g. one tensor-parallel shard of --replica), takes
// payloads from its data plane — a relay-tree data port (zmq://), or an object store whose payloads
// the producers announce through the control plane (s3://) — and the coordinator on an HTTP
// control plane, and serves until SIGTERM or SIGINT. With --bootstrap s3://… it first catches up
// from a versioned chain (refit/s3_chain.h). At shutdown the node rolls an open transfer back to
// the committed version bit-exactly.
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
#include "config.h"
#include "progress.h"
#include "refit/environment.h"
#include "refit/loader.h"
#include "refit/logging.h"
#include "refit/receiver_node.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#if REFIT_HAVE_MPI
#include "refit/mpi.h"
#endif

namespace refit::cli {
namespace {

/// Everything `refit serve` is configured with, whatever fills it (flags now, a config file too).
struct ServeSettings {
  /// The safetensors file to serve (required).
  std::string model_path;
  /// Map the model copy-on-write instead of reading it into memory.
  bool mmap = false;
  bool device_memory_test = false;
  /// The address both planes bind.
  std::string bind_address = "127.0.0.1";
  /// The host other relays and producers reach this receiver by. Empty: bind_address, which
  /// must then not be a wildcard (kWildcardAddresses).
  std::string advertise_address;
  /// The HTTP control port; 0 picks a free one (reported on stdout and in the ready file).
  uint16_t control_port = 0;
  /// The data port: its endpoint "<advertised host>:<data_port>" is this receiver's name in
  /// `peers` and in the ready file. 0: one the kernel chooses as the listener binds (reported in
  /// the ready file and the log); not with `peers`, which must name it before it exists.
  uint16_t data_port = 0;
  /// Every relay's data endpoint in tree order, the same list on every receiver of the fleet,
  /// this one's included. Empty: this receiver is the only relay.
  std::vector<std::string> peers;
  /// The data-plane transport and its parameters; the endpoint and peers come from the fields
  /// above.
  std::string transport_uri = "zmq://";
  /// The environment variable holding the shared key of both planes. Empty: no key.
  std::string api_key_env;
  /// PEM certificate and key of the control plane: both or neither.
  std::string tls_cert_path;
  std::string tls_key_path;
  /// Payloads staged but not yet applied (ReceiverSessionOptions::apply_queue_depth).
  size_t apply_queue_depth = ReceiverSessionOptions{}.apply_queue_depth;
  /// How long a receiving transfer may make no progress before this receiver aborts it
  /// (ReceiverSessionOptions::transfer_lease); zero: no lease.
  std::chrono::milliseconds transfer_lease = ReceiverSessionOptions{}.transfer_lease;
  /// What the receiver keeps to undo an anchor, and where `file` spills it
  /// (ReceiverSessionOptions::anchor_undo, anchor_undo_directory).
  AnchorUndo anchor_undo = ReceiverSessionOptions{}.anchor_undo;
  std::string anchor_undo_dir;
  /// Threads that apply one payload (ReceiverSessionOptions::apply_threads).
  int apply_threads = ReceiverSessionOptions{}.apply_threads;
  /// Threads that decode payloads ahead of the apply (ReceiverSessionOptions::decode_threads).
  int decode_threads = ReceiverSessionOptions{}.decode_threads;
  /// The largest payload (header + compressed body) either plane accepts; it bounds the memory
  /// one message can take. Unset: sized to the model and the producers' bucket size
  /// (DefaultMaxPayloadBytes).
  std::optional<uint64_t> max_payload_bytes;
  /// The producers' bucket size (the config's delta_compression.sparse_bucket_size_bytes).
  uint64_t producer_bucket_bytes = kDefaultBucketBytes;
  /// The version the model is at; unset: the file's "refit.version" metadata, else 0.
  std::optional<uint64_t> version;
  /// Written atomically once both planes listen; removed at a clean shutdown.
  std::string ready_file;
  /// Where to write the weights held at a clean shutdown (safetensors, with their version):
  /// what an MPI job's receivers keep when the job ends. Empty: nothing is written.
  std::string save_on_exit;
  /// An s3:// chain to catch up from before serving (empty: serve the model as loaded).
  std::string bootstrap_uri;
  /// A loader spec (YAML) mapping canonical tensors onto this receiver's (e.g. one TP shard).
  std::string loader_path;
  /// The replica this receiver belongs to (required with a tensor-parallel loader).
  std::string replica;
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
  if (settings.model_path.empty()) return InvalidArgument("serve: --model is required");
  if (!relay) {
    if (settings.data_port != 0 || !settings.peers.empty()) {
      return InvalidArgument(
          "serve: --data-port and --peers are for relay-tree transports (zmq://); an object-store "
          "transport announces payloads through the control plane");
    }
  } else if (settings.data_port == 0 && !settings.peers.empty()) {
    return InvalidArgument(
        "serve: --peers needs a fixed --data-port (1-65535) to name this receiver in; port 0 "
        "(the kernel's choice, the default) is for receivers without --peers, whose relay tree "
        "each transfer names");
  }
  if (settings.bind_address.empty()) return InvalidArgument("serve: --bind is empty");
  const bool wildcard = std::find(std::begin(kWildcardAddresses), std::end(kWildcardAddresses),
                                  settings.bind_address) != std::end(kWildcardAddresses);
  if (wildcard && settings.advertise_address.empty()) {
    return InvalidArgument(
        "serve: --bind {} listens on every interface, which names no receiver: give --advertise "
        "HOST, the address other relays and producers reach this receiver by",
        settings.bind_address);
  }
  return Status::OK();
}

// The host other relays and producers reach this receiver by (--advertise, else --bind).
const std::string& AdvertisedHost(const ServeSettings& settings) {
  return settings.advertise_address.empty() ? settings.bind_address : settings.advertise_address;
}

// Return the key held by the variable --api-key-env names. Errors: InvalidArgument when unset
// or empty.
Result<std::string> ApiKeyFromEnv(const std::string& name) {
  Result<std::string> key = SecretFromEnvironment(name, "--api-key-env");
  if (!key.ok()) return key.status().WithContext("serve");
  return key;
}

// Return the transport URI with the data-plane key named by --api-key-env added, unless the URI
// names the same variable already. Errors: InvalidArgument for a malformed URI or a URI that
// names another key.
Result<TransportUri> DataPlaneUri(const ServeSettings& settings) {
  REFIT_ASSIGN_OR_RETURN(TransportUri uri, TransportUri::Parse(settings.transport_uri));
  if (settings.api_key_env.empty()) return uri;
  const std::string* env = uri.Param(kUriApiKeyEnvParam);
  if (uri.Param(kUriApiKeyParam) != nullptr || (env != nullptr && *env != settings.api_key_env)) {
    return InvalidArgument(
        "serve: --transport sets its own api key while --api-key-env {} sets the key of both "
        "planes; give it once",
        settings.api_key_env);
  }
  if (env == nullptr) uri.params.emplace_back(kUriApiKeyEnvParam, settings.api_key_env);
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

Status RunServe(const ServeSettings& settings) {
  const sigset_t shutdown_signals = BlockShutdownSignals();
  // A client that disconnects while the control plane writes to it must cost that request, not
  // the daemon: the HTTP library writes without MSG_NOSIGNAL.
  std::signal(SIGPIPE, SIG_IGN);
  // A ready file left by an earlier run must not announce this one before it listens.
  if (!settings.ready_file.empty()) std::remove(settings.ready_file.c_str());

  std::string api_key;
  if (!settings.api_key_env.empty()) {
    REFIT_ASSIGN_OR_RETURN(api_key, ApiKeyFromEnv(settings.api_key_env));
  }
  // The flags a data plane needs depend on its kind (a relay tree binds a data port).
  REFIT_ASSIGN_OR_RETURN(TransportUri uri, TransportUri::Parse(settings.transport_uri));
  REFIT_ASSIGN_OR_RETURN(const std::unique_ptr<Transport> kind, MakeTransport(uri));
  // A collective's data plane is the job's communicator, which takes no key (its HTTP control
  // plane still does); the others carry --api-key-env's key.
  if (!kind->capabilities().carries_control) {
    REFIT_ASSIGN_OR_RETURN(uri, DataPlaneUri(settings));
  }
  const bool relay = kind->capabilities().fan_out_tree;
  // A collective (mpi://): this process is one receiver rank of an MPI job, which ends when the
  // producers close it.
  const bool collective = kind->capabilities().carries_control;
  REFIT_RETURN_NOT_OK(CheckSettings(settings, relay));

  ReceiverNodeOptions options;
  options.model_path = settings.model_path;
  options.store_mode = settings.device_memory_test ? StoreMode::kDeviceTest
                       : settings.mmap             ? StoreMode::kMmap
                                                   : StoreMode::kMemory;
  options.version = settings.version;
  if (!settings.loader_path.empty()) {
    REFIT_ASSIGN_OR_RETURN(options.loader, LoaderSpecFromYamlFile(settings.loader_path));
  }
  options.place.replica = settings.replica;
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
    if (settings.replica.empty()) options.place = info.place;
  }
#endif
  if (relay) {
    options.data_endpoint = fmt::format("{}:{}", AdvertisedHost(settings), settings.data_port);
    if (!settings.peers.empty() &&
        std::count(settings.peers.begin(), settings.peers.end(), options.data_endpoint) != 1) {
      return InvalidArgument(
          "serve: --peers must list this receiver's data endpoint {} exactly once "
          "(--advertise:--data-port, --advertise defaulting to --bind), the same list on every "
          "receiver",
          options.data_endpoint);
    }
    options.peers = settings.peers;
    if (AdvertisedHost(settings) != settings.bind_address) {
      options.data_bind_address = settings.bind_address;
    }
  }
  options.control.bind_address = settings.bind_address;
  options.control.port = settings.control_port;
  options.control.api_key = api_key;
  options.control.tls_cert_path = settings.tls_cert_path;
  options.control.tls_key_path = settings.tls_key_path;
  options.session.apply_queue_depth = settings.apply_queue_depth;
  options.session.transfer_lease = settings.transfer_lease;
  options.session.anchor_undo = settings.anchor_undo;
  options.session.anchor_undo_directory = settings.anchor_undo_dir;
  options.session.apply_threads = settings.apply_threads;
  options.session.decode_threads = settings.decode_threads;
  // The node applies it to the decompressed body too, so that a small payload declaring a huge
  // body (a decompression bomb) is refused by its header.
  options.max_payload_bytes = settings.max_payload_bytes;
  options.producer_bucket_bytes = settings.producer_bucket_bytes;
  options.bootstrap_uri = settings.bootstrap_uri;
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
  // Said once at start: a producer whose payload is over it is refused (ResourceExhausted).
  const std::string limit_source =
      settings.max_payload_bytes.has_value()
          ? std::string("--max-payload-bytes")
          : fmt::format(
                "default: twice the larger of the producers' {} bucket and the model's largest "
                "tensor, at least {}",
                FormatBytes(settings.producer_bucket_bytes),
                FormatBytes(kMinDefaultMaxPayloadBytes));
  std::printf("refit serve: payloads of up to %s on either plane (%s)\n",
              FormatBytes(node->max_payload_bytes()).c_str(), limit_source.c_str());
  if (api_key.empty()) {
    ServeLogger().warn(
        "serve: no api key on the control plane (--api-key-env): anyone who can reach {} can "
        "write this receiver's weights",
        settings.bind_address);
  }

  const uint64_t version = node->status().version;
  const size_t tensors = node->store().size();
  const std::string control_url = node->control_url();
  if (!settings.ready_file.empty()) {
    REFIT_RETURN_NOT_OK(
        WriteReadyFile(settings.ready_file,
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
  if (!settings.ready_file.empty()) std::remove(settings.ready_file.c_str());
  if (!settings.save_on_exit.empty()) {
    const uint64_t held = node->store().version();
    REFIT_RETURN_NOT_OK(WriteSafetensors(settings.save_on_exit, node->store().tensors(),
                                         {{kWeightVersionMetadataKey, std::to_string(held)}})
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

// The settings a configuration file gives `refit serve` (docs/configuration.md): the server
// section, the ports, the fleet's data endpoints as the relay list, the transport with the
// CURVE key files of a relay, and the api key variable.
Result<ServeSettings> SettingsFromConfig(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const RefitConfig config, LoadConfigFile(path));
  ServeSettings settings;
  settings.model_path = config.server.model;
  settings.mmap = config.server.mmap;
  settings.bind_address = config.server.bind;
  settings.control_port = config.http_refit_server_port;
  settings.data_port = config.zmq_refit_server_port;
  for (const ReceiverConfig& receiver : config.receivers) settings.peers.push_back(receiver.data);
  settings.api_key_env = config.http_refit_api_key_env_var;
  settings.tls_cert_path = config.server.tls_cert;
  settings.tls_key_path = config.server.tls_key;
  settings.apply_queue_depth = config.tuning.apply_queue_depth;
  settings.transfer_lease = config.server.transfer_lease;
  settings.anchor_undo = config.server.anchor_undo;
  settings.anchor_undo_dir = config.server.anchor_undo_dir;
  settings.ready_file = config.server.ready_file;
  settings.producer_bucket_bytes = config.delta_compression.sparse_bucket_size_bytes;
  // The key travels as --api-key-env does (serve adds api_key_env itself), so take the URI
  // without it and add what only a relay needs: its CURVE key files.
  RefitConfig transport_only = config;
  transport_only.http_refit_api_key_env_var.clear();
  REFIT_ASSIGN_OR_RETURN(const std::string uri_text, ToTransportUri(transport_only));
  REFIT_ASSIGN_OR_RETURN(TransportUri uri, TransportUri::Parse(uri_text));
  for (const auto& [key, value] :
       {std::pair{"curve_secret_key", config.server.curve_secret_key},
        std::pair{"curve_server_key", config.server.curve_server_key},
        std::pair{"curve_authorized_keys", config.server.curve_authorized_keys}}) {
    if (value.empty()) continue;
    if (uri.Param(key) != nullptr) {
      return InvalidArgument("{}: server.{} and the transport URI's {} parameter both set it", path,
                             key, key);
    }
    uri.params.emplace_back(key, value);
  }
  settings.transport_uri = uri.ToString();
  return settings;
}

}  // namespace

void RegisterServe(CLI::App& app, Status* result) {
  auto settings = std::make_shared<ServeSettings>();
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "Run a receiver: hold a model, take payloads on a relay-tree data port and transfers on "
      "an HTTP control plane, until SIGTERM or SIGINT");
  auto config_path = std::make_shared<std::string>();
  cmd->add_option("--config", *config_path,
                  "A refit YAML file (docs/configuration.md): its server section, ports, "
                  "receivers (the relay list), transport and api key variable; flags override it")
      ->check(CLI::ExistingFile);
  cmd->add_option("--model", settings->model_path, "Model to serve (safetensors; required)");
  cmd->add_flag("--mmap", settings->mmap,
                "Map the model copy-on-write instead of reading it into memory");
  cmd->add_flag("--device-memory-test", settings->device_memory_test,
                "Hold every tensor behind the device boundary's test backend, reached only through "
                "gather / scatter / byte ranges as GPU memory would be (for tests of the device "
                "path; docs/architecture.md, \"Device memory\")");
  cmd->add_option("--bind", settings->bind_address, "Address both planes bind")
      ->capture_default_str();
  cmd->add_option("--advertise", settings->advertise_address,
                  "Host other relays and producers reach this receiver by: its data endpoint is "
                  "HOST:--data-port in --peers and the ready file (default: --bind; required "
                  "when --bind is a wildcard such as 0.0.0.0)");
  cmd->add_option("--control-port", settings->control_port, "HTTP control port (0: any free one)")
      ->capture_default_str();
  cmd->add_option("--data-port", settings->data_port,
                  "Data port; 0 (default): one the kernel chooses as it binds, reported in the "
                  "log and the ready file (not with --peers)");
  cmd->add_option("--peers", settings->peers,
                  "A static relay tree, only for coordinators that name none (refit push and "
                  "Publisher name each transfer's tree): every relay's data endpoint host:port "
                  "in tree order, this one's included (default: none)")
      ->delimiter(',');
  cmd->add_option("--transport", settings->transport_uri,
                  "Data-plane transport URI with its parameters, e.g. zmq://?timeout_ms=5000")
      ->capture_default_str();
  cmd->add_option("--api-key-env", settings->api_key_env,
                  "Environment variable holding the shared key of both planes");
  cmd->add_option("--tls-cert", settings->tls_cert_path, "PEM certificate of the control plane");
  cmd->add_option("--tls-key", settings->tls_key_path, "PEM private key of the control plane");
  cmd->add_option("--apply-queue-depth", settings->apply_queue_depth,
                  "Payloads staged but not yet applied")
      ->capture_default_str();
  cmd->add_option_function<double>(
         "--transfer-lease",
         [settings](const double& seconds) {
           // Whole milliseconds, rounded up, so that a tiny positive lease is not "no lease".
           settings->transfer_lease =
               std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0)));
         },
         "Seconds a transfer may go without progress (prepare, payload, apply, flush) while "
         "receiving before this receiver aborts and rolls it back itself; 0: no lease (default "
         "300). A prepared transfer has no lease: it waits for commit or abort")
      ->check(CLI::Range(0.0, 86400.0));
  cmd->add_option_function<std::string>(
         "--anchor-undo",
         [settings](const std::string& name) {
           Result<AnchorUndo> policy = ParseAnchorUndo(name);
           if (!policy.ok()) throw CLI::ValidationError("--anchor-undo", policy.status().message());
           settings->anchor_undo = *policy;
         },
         "What undoes an anchor (FULL): memory (old bits in RAM, ~2x the model during a FULL), "
         "file (old bits spilled to --anchor-undo-dir, ~1x), none (~1x; an aborted FULL leaves "
         "the receiver needing the next anchor, refusing deltas)")
      ->default_str("memory");
  cmd->add_option("--anchor-undo-dir", settings->anchor_undo_dir,
                  "Directory of the spill file of --anchor-undo file (default: $TMPDIR or /tmp)");
  cmd->add_option("--apply-threads", settings->apply_threads,
                  "Threads that apply one payload, one tensor per thread at a time (an anchor's "
                  "FULL items, a delta's items); payloads still apply in arrival order")
      ->capture_default_str()
      ->check(CLI::Range(1, ReceiverSession::kMaxApplyThreads));
  cmd->add_option("--decode-threads", settings->decode_threads,
                  "Threads that decode (checksum, decompress, parse) queued payloads ahead of the "
                  "apply, each holding one decompressed payload; 0: the apply thread decodes")
      ->capture_default_str()
      ->check(CLI::Range(0, ReceiverSession::kMaxApplyThreads));
  cmd->add_option_function<std::string>(
      "--max-payload-bytes",
      [settings](const std::string& text) {
        Result<uint64_t> bytes = ParseByteSize(text);
        if (!bytes.ok())
          throw CLI::ValidationError("--max-payload-bytes", bytes.status().message());
        settings->max_payload_bytes = *bytes;
      },
      "Largest payload either plane accepts, and largest decompressed payload body, e.g. 256MiB "
      "(default: twice the larger of the producers' bucket size and the model's largest tensor, "
      "at least 256MiB)");
  cmd->add_option_function<uint64_t>(
      "--version", [settings](const uint64_t& version) { settings->version = version; },
      "Weight version of the model (default: its refit.version metadata, else 0)");
  cmd->add_option("--bootstrap", settings->bootstrap_uri,
                  "Before serving, catch up from the versioned chain at this s3:// URI (the "
                  "trainer's transport URI with chain=1): replay its newest anchor and deltas, "
                  "verifying each version's state fingerprint; later, when a transfer is "
                  "prepared from a newer version than this receiver holds, replay the deltas "
                  "it missed first");
  cmd->add_option("--loader", settings->loader_path,
                  "A loader spec (YAML: tp_rank, tp_size, rules) mapping canonical tensors onto "
                  "this receiver's tensors: rename, skip, row/column shards, fused qkv and "
                  "gate_up, vocabulary-parallel embeddings (docs/configuration.md)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--replica", settings->replica,
                  "The replica this receiver belongs to: the shards of a tensor-parallel group "
                  "share it and are verified together");
  cmd->add_option("--ready-file", settings->ready_file,
                  "Write {pid, control_url, data_endpoint, version, tensors} as JSON here once "
                  "both planes listen; removed at a clean shutdown");
  cmd->add_option("--save-on-exit", settings->save_on_exit,
                  "Write the weights held at a clean shutdown to this safetensors file, with "
                  "their version (what an MPI job's receivers keep when the job ends)");
  cmd->callback([cmd, config_path, settings, result] {
    if (config_path->empty()) {
      *result = RunServe(*settings);
      return;
    }
    Result<ServeSettings> from_file = SettingsFromConfig(*config_path);
    if (!from_file.ok()) {
      *result = from_file.status();
      return;
    }
    // Flags given on the command line win over the file.
    ServeSettings merged = *std::move(from_file);
    const ServeSettings& flags = *settings;
    auto given = [cmd](const char* flag) { return cmd->count(flag) > 0; };
    if (given("--model")) merged.model_path = flags.model_path;
    if (given("--mmap")) merged.mmap = flags.mmap;
    if (given("--device-memory-test")) merged.device_memory_test = flags.device_memory_test;
    if (given("--bind")) merged.bind_address = flags.bind_address;
    if (given("--advertise")) merged.advertise_address = flags.advertise_address;
    if (given("--control-port")) merged.control_port = flags.control_port;
    if (given("--data-port")) merged.data_port = flags.data_port;
    if (given("--peers")) merged.peers = flags.peers;
    if (given("--transport")) merged.transport_uri = flags.transport_uri;
    if (given("--api-key-env")) merged.api_key_env = flags.api_key_env;
    if (given("--tls-cert")) merged.tls_cert_path = flags.tls_cert_path;
    if (given("--tls-key")) merged.tls_key_path = flags.tls_key_path;
    if (given("--apply-queue-depth")) merged.apply_queue_depth = flags.apply_queue_depth;
    if (given("--transfer-lease")) merged.transfer_lease = flags.transfer_lease;
    if (given("--anchor-undo")) merged.anchor_undo = flags.anchor_undo;
    if (given("--anchor-undo-dir")) merged.anchor_undo_dir = flags.anchor_undo_dir;
    if (given("--max-payload-bytes")) merged.max_payload_bytes = flags.max_payload_bytes;
    if (given("--version")) merged.version = flags.version;
    if (given("--ready-file")) merged.ready_file = flags.ready_file;
    if (given("--save-on-exit")) merged.save_on_exit = flags.save_on_exit;
    if (given("--bootstrap")) merged.bootstrap_uri = flags.bootstrap_uri;
    if (given("--loader")) merged.loader_path = flags.loader_path;
    if (given("--replica")) merged.replica = flags.replica;
    *result = RunServe(merged);
  });
}

}  // namespace refit::cli
