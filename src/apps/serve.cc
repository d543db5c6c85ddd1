// refit serve: the receiver daemon. It holds one model (a safetensors file read into memory or
// mapped copy-on-write), takes payloads from its data plane — a relay-tree data port (zmq://), or
// an object store whose payloads the producers announce through the control plane (s3://) — and
// the coordinator on an HTTP control plane, and serves until SIGTERM or SIGINT. With
// --bootstrap s3://… it first catches up from a versioned chain (refit/s3_chain.h).
//
//   model ─▶ WeightStore ─▶ ReceiverSession ◀─ SessionSink ◀─ Listener (zmq: data port, relay tree)
//                                 ▲                              ▲ (s3: AcceptManifest)
//                                 └──────────── ControlServer ───┘ (control port: prepare, …)
//
// Shutdown stops the control plane first (no new transfer can start), then the data plane (no
// payload arrives any more), then the session, whose destructor rolls an open transfer back to
// the committed version bit-exactly.
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "config.h"
#include "refit/control_server.h"
#include "refit/logging.h"
#include "refit/receiver_session.h"
#include "refit/s3_chain.h"
#include "refit/safetensors.h"
#include "refit/transport.h"
#include "refit/weight_store.h"

namespace refit::cli {
namespace {

/// Everything `refit serve` is configured with, whatever fills it (flags now, a config file too).
struct ServeSettings {
  /// The safetensors file to serve (required).
  std::string model_path;
  /// Map the model copy-on-write instead of reading it into memory.
  bool mmap = false;
  /// The address both planes bind.
  std::string bind_address = "127.0.0.1";
  /// The host other relays and producers reach this receiver by. Empty: bind_address, which
  /// must then not be a wildcard (kWildcardAddresses).
  std::string advertise_address;
  /// The HTTP control port; 0 picks a free one (reported on stdout and in the ready file).
  uint16_t control_port = 0;
  /// The data port (required): its endpoint "<advertised host>:<data_port>" is this receiver's
  /// name in `peers` and in the ready file, so it cannot be ephemeral.
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
  /// The largest payload (header + compressed body) either plane accepts; it bounds the memory
  /// one message can take.
  uint64_t max_payload_bytes = PayloadLimits{}.max_payload_bytes;
  /// The version the model is at; unset: the file's "refit.version" metadata, else 0.
  std::optional<uint64_t> version;
  /// Written atomically once both planes listen; removed at a clean shutdown.
  std::string ready_file;
  /// An s3:// chain to catch up from before serving (empty: serve the model as loaded).
  std::string bootstrap_uri;
};

// The URI parameters that carry the data plane's key (zmq://).
constexpr std::string_view kUriKeyParam = "api_key";
constexpr std::string_view kUriKeyEnvParam = "api_key_env";
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
  } else if (settings.data_port == 0) {
    return InvalidArgument(
        "serve: --data-port is required (1-65535): other relays and producers address this "
        "receiver by it");
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

// Return the value of environment variable `name`. Errors: InvalidArgument when unset or empty.
Result<std::string> ApiKeyFromEnv(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr || *value == '\0') {
    return InvalidArgument("serve: environment variable {} (--api-key-env) is unset or empty",
                           name);
  }
  return std::string(value);
}

// Return the transport URI with the data-plane key named by --api-key-env added, unless the URI
// names the same variable already. Errors: InvalidArgument for a malformed URI or a URI that
// names another key.
Result<TransportUri> DataPlaneUri(const ServeSettings& settings) {
  REFIT_ASSIGN_OR_RETURN(TransportUri uri, TransportUri::Parse(settings.transport_uri));
  if (settings.api_key_env.empty()) return uri;
  const std::string* env = uri.Param(kUriKeyEnvParam);
  if (uri.Param(kUriKeyParam) != nullptr || (env != nullptr && *env != settings.api_key_env)) {
    return InvalidArgument(
        "serve: --transport sets its own api key while --api-key-env {} sets the key of both "
        "planes; give it once",
        settings.api_key_env);
  }
  if (env == nullptr) uri.params.emplace_back(kUriKeyEnvParam, settings.api_key_env);
  return uri;
}

// Block SIGTERM and SIGINT in the calling thread and return the set. Threads inherit the mask,
// so when this runs before any thread starts, only sigwait on this thread ever takes them.
sigset_t BlockShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
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
  REFIT_ASSIGN_OR_RETURN(const TransportUri uri, DataPlaneUri(settings));
  PayloadLimits limits;
  limits.max_payload_bytes = settings.max_payload_bytes;
  TransportOptions transport_options;
  transport_options.limits = limits;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Transport> transport,
                         MakeTransport(uri, transport_options));
  const TransportCapabilities caps = transport->capabilities();
  if (!caps.fan_out_tree && !caps.needs_manifest) {
    return InvalidArgument(
        "serve: --transport '{}' is neither a relay tree (zmq://) nor an object store (s3://)",
        uri.scheme);
  }
  REFIT_RETURN_NOT_OK(CheckSettings(settings, caps.fan_out_tree));

  // The model.
  uint64_t version = 0;
  if (settings.version.has_value()) {
    version = *settings.version;
  } else {
    Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(settings.model_path);
    if (!file.ok()) return file.status().WithContext("serve: --model");
    version = VersionOf(**file);
  }
  Result<std::unique_ptr<WeightStore>> opened =
      WeightStore::Open(settings.model_path, settings.mmap ? StoreMode::kMmap : StoreMode::kMemory);
  if (!opened.ok()) return opened.status().WithContext("serve: --model");
  std::unique_ptr<WeightStore> store = std::move(opened).ValueOrDie();
  store->set_version(version);

  ReceiverSessionOptions session_options;
  session_options.apply_queue_depth = settings.apply_queue_depth;
  session_options.limits = limits;
  if (!settings.bootstrap_uri.empty()) {
    ChainBootstrapOptions bootstrap;
    bootstrap.session = session_options;
    bootstrap.on_version = [](const ChainVersion& replayed) {
      ServeLogger().info("serve: bootstrap: replayed {} {} ({} payloads)",
                         replayed.anchor ? "anchor" : "delta", replayed.version,
                         replayed.payloads.size());
    };
    Result<ChainBootstrapReport> caught_up =
        BootstrapFromChain(settings.bootstrap_uri, *store, bootstrap);
    if (!caught_up.ok()) return caught_up.status().WithContext("serve: --bootstrap");
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
    version = store->version();
  }
  Result<std::unique_ptr<ReceiverSession>> made = ReceiverSession::Make(session_options, *store);
  if (!made.ok()) return made.status().WithContext("serve: --apply-queue-depth");
  std::unique_ptr<ReceiverSession> session = std::move(made).ValueOrDie();
  SessionSink sink(*session);

  // The data plane. An object store's listener binds nothing; it is named by the control plane
  // that hands it the manifests.
  ListenerContext listener_context;
  if (caps.fan_out_tree) {
    listener_context.endpoint = fmt::format("{}:{}", AdvertisedHost(settings), settings.data_port);
    listener_context.peers = settings.peers;
    if (AdvertisedHost(settings) != settings.bind_address) {
      listener_context.bind_address = settings.bind_address;
    }
  } else {
    listener_context.endpoint = fmt::format("{}://{}", uri.scheme, uri.target);
  }
  Result<std::unique_ptr<Listener>> listener_made = transport->MakeListener(listener_context, sink);
  if (!listener_made.ok()) {
    return listener_made.status().WithContext(
        "serve: --bind/--advertise/--data-port and --peers (the peers must list this receiver's "
        "endpoint exactly as --advertise:--data-port, --advertise defaulting to --bind)");
  }
  std::unique_ptr<Listener> listener = std::move(listener_made).ValueOrDie();
  REFIT_RETURN_NOT_OK(listener->Start().WithContext("serve: data plane"));

  // The control plane.
  ControlServerOptions control_options;
  control_options.bind_address = settings.bind_address;
  control_options.port = settings.control_port;
  control_options.api_key = api_key;
  control_options.tls_cert_path = settings.tls_cert_path;
  control_options.tls_key_path = settings.tls_key_path;
  control_options.max_request_bytes = settings.max_payload_bytes;
  if (!settings.bootstrap_uri.empty()) {
    // Fallen behind (the fleet moved on while this receiver was cut off): replay the chain's
    // deltas through the live session, then take the prepare.
    control_options.catch_up = [&settings, &session, &store,
                                session_options](uint64_t base_version) -> Status {
      ChainBootstrapOptions catch_up;
      catch_up.session = session_options;
      REFIT_ASSIGN_OR_RETURN(
          const ChainBootstrapReport report,
          CatchUpFromChain(settings.bootstrap_uri, *session, *store, base_version, catch_up));
      ServeLogger().info("serve: caught up from version {} to {}: {} version(s), {} payloads",
                         report.start_version, report.final_version, report.versions_replayed,
                         report.payloads);
      return Status::OK();
    };
  }
  if (caps.needs_manifest) {
    control_options.manifest_handler = [&listener](std::string_view manifest,
                                                   std::stop_token stop) -> Result<StagedManifest> {
      REFIT_ASSIGN_OR_RETURN(const ManifestDelivery delivered,
                             listener->AcceptManifest(manifest, std::move(stop)));
      return StagedManifest{.result = delivered.result, .payload_bytes = delivered.payload_bytes};
    };
  }
  Result<std::unique_ptr<ControlServer>> server_made =
      ControlServer::Make(control_options, *session, *store);
  if (!server_made.ok()) return server_made.status().WithContext("serve: control plane");
  std::unique_ptr<ControlServer> server = std::move(server_made).ValueOrDie();
  REFIT_RETURN_NOT_OK(server->Start().WithContext("serve: control plane"));

  const bool data_plane_keyed =
      uri.Param(kUriKeyParam) != nullptr || uri.Param(kUriKeyEnvParam) != nullptr;
  if (api_key.empty() || !data_plane_keyed) {
    const std::string_view planes = api_key.empty() && !data_plane_keyed ? "control and data planes"
                                    : api_key.empty()                    ? "control plane"
                                                                         : "data plane";
    ServeLogger().warn(
        "serve: no api key on the {} (--api-key-env): anyone who can reach {} can write this "
        "receiver's weights",
        planes, settings.bind_address);
  }

  const std::string control_url = server->base_url();
  // Producers address an object-store receiver by its control plane, where manifests go.
  const std::string data_endpoint = caps.fan_out_tree ? listener_context.endpoint : control_url;
  if (!settings.ready_file.empty()) {
    REFIT_RETURN_NOT_OK(WriteReadyFile(
        settings.ready_file, ReadyFileText(control_url, data_endpoint, version, store->size())));
  }
  const std::string data_plane =
      caps.fan_out_tree
          ? fmt::format("{} ({} relay{})", listener_context.endpoint,
                        std::max<size_t>(settings.peers.size(), 1),
                        settings.peers.size() > 1 ? "s" : "")
          : fmt::format("{} (manifests on the control plane)", listener_context.endpoint);
  std::printf("refit serve: ready: control %s, data %s, version %llu, %zu tensors\n",
              control_url.c_str(), data_plane.c_str(), static_cast<unsigned long long>(version),
              store->size());
  std::fflush(stdout);

  int signal_number = 0;
  if (const int error = sigwait(&shutdown_signals, &signal_number); error != 0) {
    return Internal("serve: sigwait: {}", std::strerror(error));
  }
  const std::string_view signal_name = signal_number == SIGTERM ? "SIGTERM" : "SIGINT";
  ServeLogger().info("serve: {} received; shutting down", signal_name);

  server->Stop();
  listener->Stop();
  const ListenerStats stats = listener->stats();
  ServeLogger().info("serve: data plane delivered {} payloads ({} duplicates), {} failures ({})",
                     stats.delivered, stats.duplicates, stats.failures,
                     stats.last_error.ok() ? "none" : "last: " + stats.last_error.ToString());
  // Nothing may call into the session once it is gone.
  server.reset();
  listener.reset();
  const ReceiverStatus open = session->GetStatus();
  if (open.state != ReceiverState::kIdle) {
    ServeLogger().warn(
        "serve: transfer {} is {} at shutdown ({} payloads applied): rolling it back to "
        "version {}",
        open.transfer_id.value_or(TransferId{}).ToHex(), ReceiverStateName(open.state),
        open.applied_payloads, open.base_version);
  }
  session.reset();
  if (!settings.ready_file.empty()) std::remove(settings.ready_file.c_str());
  std::printf("refit serve: clean shutdown on %s at version %llu\n",
              std::string(signal_name).c_str(), static_cast<unsigned long long>(store->version()));
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
  settings.ready_file = config.server.ready_file;
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
  cmd->add_option("--bind", settings->bind_address, "Address both planes bind")
      ->capture_default_str();
  cmd->add_option("--advertise", settings->advertise_address,
                  "Host other relays and producers reach this receiver by: its data endpoint is "
                  "HOST:--data-port in --peers and the ready file (default: --bind; required "
                  "when --bind is a wildcard such as 0.0.0.0)");
  cmd->add_option("--control-port", settings->control_port, "HTTP control port (0: any free one)")
      ->capture_default_str();
  cmd->add_option("--data-port", settings->data_port, "Data port (required)");
  cmd->add_option("--peers", settings->peers,
                  "Every relay's data endpoint host:port in tree order, the same on every "
                  "receiver, this one's included (default: this receiver alone)")
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
  cmd->add_option_function<std::string>(
      "--max-payload-bytes",
      [settings](const std::string& text) {
        Result<uint64_t> bytes = ParseByteSize(text);
        if (!bytes.ok())
          throw CLI::ValidationError("--max-payload-bytes", bytes.status().message());
        settings->max_payload_bytes = *bytes;
      },
      "Largest payload either plane accepts, e.g. 256MiB (default 4GiB)");
  cmd->add_option_function<uint64_t>(
      "--version", [settings](const uint64_t& version) { settings->version = version; },
      "Weight version of the model (default: its refit.version metadata, else 0)");
  cmd->add_option("--bootstrap", settings->bootstrap_uri,
                  "Before serving, catch up from the versioned chain at this s3:// URI (the "
                  "trainer's transport URI with chain=1): replay its newest anchor and deltas, "
                  "verifying each version's state fingerprint; later, when a transfer is "
                  "prepared from a newer version than this receiver holds, replay the deltas "
                  "it missed first");
  cmd->add_option("--ready-file", settings->ready_file,
                  "Write {pid, control_url, data_endpoint, version, tensors} as JSON here once "
                  "both planes listen; removed at a clean shutdown");
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
    if (given("--max-payload-bytes")) merged.max_payload_bytes = flags.max_payload_bytes;
    if (given("--version")) merged.version = flags.version;
    if (given("--ready-file")) merged.ready_file = flags.ready_file;
    if (given("--bootstrap")) merged.bootstrap_uri = flags.bootstrap_uri;
    *result = RunServe(merged);
  });
}

}  // namespace refit::cli
