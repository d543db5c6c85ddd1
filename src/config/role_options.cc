#include "role_options.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdint>
#include <string>
#include <system_error>
#include <utility>

#include "refit/loader.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "util/environment.h"

namespace refit::config {
namespace {

Result<std::string> ResolveApiKey(const RefitConfig& config) {
  const std::string& name = config.http_refit_api_key_env_var;
  if (name.empty()) return std::string();
  return SecretFromEnvironment(name, "http_refit_api_key_env_var");
}

// The zmq transport's CURVE key-file parameters that `server.curve_*` set.
Status AddCurveKeyFiles(const RefitConfig& config, TransportUri* uri) {
  for (const auto& [key, value] :
       {std::pair{"curve_secret_key", config.server.curve_secret_key},
        std::pair{"curve_server_key", config.server.curve_server_key},
        std::pair{"curve_authorized_keys", config.server.curve_authorized_keys}}) {
    if (value.empty()) continue;
    if (uri->Param(key) != nullptr) {
      return InvalidArgument("server.{} and the transport URI's {} parameter both set it", key,
                             key);
    }
    uri->params.emplace_back(key, value);
  }
  return Status::OK();
}

}  // namespace

TrackerOptions ToTrackerOptions(const RefitConfig& config) {
  const DeltaCompressionConfig& delta = config.delta_compression;
  TrackerOptions options;
  options.baseline_storage =
      config.baseline.in_memory ? BaselineStorage::kMemory : BaselineStorage::kFile;
  options.baseline_dir = config.baseline.mmap_dir;
  // Without delta compression every transfer is an anchor.
  options.full_sync_interval = delta.enabled ? delta.full_sync_interval : 1;
  options.op = delta.encoding;
  options.add_delta_dtype = delta.dtype;
  options.overwrite_names = delta.overwrite_names;
  return options;
}

ProducerStreamOptions ToProducerStreamOptions(const RefitConfig& config) {
  ProducerStreamOptions options;
  options.chunk_bytes = config.delta_compression.export_chunk_bytes;
  options.bucket_bytes = config.delta_compression.sparse_bucket_size_bytes;
  options.encode_threads = config.tuning.encode_workers;
  options.serialize_threads = config.tuning.serialize_workers;
  options.send_threads = config.tuning.transfer_workers;
  options.payload.zstd_level = config.delta_compression.zstd_level;
  options.anchor_compression = config.delta_compression.anchor_compression;
  options.item_coding = config.delta_compression.item_coding;
  // The link hint of item_coding's auto: the transport the payloads go through.
  options.link_uri = config.transport;
  return options;
}

ReceiverSessionOptions ToReceiverSessionOptions(const RefitConfig& config) {
  ReceiverSessionOptions options;
  options.apply_queue_depth = config.tuning.apply_queue_depth;
  options.apply_queue_bytes = config.tuning.apply_queue_bytes;
  options.apply_threads = config.tuning.apply_threads;
  options.decode_threads = config.tuning.decode_threads;
  options.transfer_lease = config.server.transfer_lease;
  options.preempt_after = config.server.preempt_after;
  options.anchor_undo = config.server.anchor_undo;
  options.anchor_undo_directory = config.server.anchor_undo_dir;
  return options;
}

Result<ControlServerOptions> ToControlServerOptions(const RefitConfig& config) {
  ControlServerOptions options;
  REFIT_ASSIGN_OR_RETURN(options.api_key, ResolveApiKey(config));
  options.bind_address = config.server.bind;
  options.port = config.http_refit_server_port;
  options.tls_cert_path = config.server.tls_cert;
  options.tls_key_path = config.server.tls_key;
  return options;
}

Result<ControlClientOptions> ToControlClientOptions(const RefitConfig& config,
                                                    const ReceiverConfig& receiver) {
  ControlClientOptions options;
  REFIT_ASSIGN_OR_RETURN(options.api_key, ResolveApiKey(config));
  options.base_url = receiver.control;
  options.timeout = config.request_timeout;
  return options;
}

Result<std::string> ToTransportUri(const RefitConfig& config) {
  REFIT_ASSIGN_OR_RETURN(TransportUri uri, TransportUri::Parse(config.transport));
  if (!uri.is_zmq()) return config.transport;
  const std::string retries = std::to_string(config.tuning.zmq_retries);
  if (const std::string* given = uri.Param("retries")) {
    // Compared as numbers: ParseConfig adopts the URI's value into tuning.zmq_retries, so
    // "retries=03" and 3 are the same setting.
    uint64_t value = 0;
    const auto [end, error] = std::from_chars(given->data(), given->data() + given->size(), value);
    if (error != std::errc() || end != given->data() + given->size() ||
        value != static_cast<uint64_t>(config.tuning.zmq_retries)) {
      // The URI is not echoed: it may hold an api_key.
      return InvalidArgument(
          "the {} transport URI sets retries={} but tuning.zmq_retries is {}; "
          "set one of them",
          uri.scheme, *given, retries);
    }
  } else {
    uri.params.emplace_back("retries", retries);
  }
  const std::string& key_env = config.http_refit_api_key_env_var;
  if (!key_env.empty() && uri.Param(kUriApiKeyParam) == nullptr &&
      uri.Param(kUriApiKeyEnvParam) == nullptr) {
    uri.params.emplace_back(kUriApiKeyEnvParam, key_env);
  }
  return uri.ToString();
}

Result<PublisherOptions> ToPublisherOptions(const RefitConfig& config) {
  PublisherOptions options;
  options.tracker = ToTrackerOptions(config);
  options.stream = ToProducerStreamOptions(config);
  REFIT_ASSIGN_OR_RETURN(options.transport_uri, ToTransportUri(config));
  options.commit_policy = config.commit_policy;
  for (const ReceiverConfig& receiver : config.receivers) {
    options.receivers.push_back({receiver.control, receiver.data});
  }
  // One client configuration serves every receiver; its base URL is set per receiver.
  REFIT_ASSIGN_OR_RETURN(
      options.control,
      ToControlClientOptions(
          config, config.receivers.empty() ? ReceiverConfig{} : config.receivers.front()));
  return options;
}

Result<ReceiverNodeOptions> ToReceiverNodeOptions(const RefitConfig& config) {
  const ServerConfig& server = config.server;
  ReceiverNodeOptions options;
  options.model_path = server.model;
  options.store_mode = server.mmap ? StoreMode::kMmap : StoreMode::kMemory;
  options.session = ToReceiverSessionOptions(config);
  REFIT_ASSIGN_OR_RETURN(options.control, ToControlServerOptions(config));
  if (!server.loader.empty()) {
    Result<LoaderSpec> loader = LoaderSpecFromYamlFile(server.loader);
    if (!loader.ok()) return loader.status().WithContext("server.loader");
    options.loader = *std::move(loader);
  }
  options.place.replica = server.replica;
  options.max_payload_bytes = server.max_payload_bytes;
  options.producer_bucket_bytes = config.delta_compression.sparse_bucket_size_bytes;
  options.bootstrap_uri = server.bootstrap;
  options.bootstrap_peer = server.bootstrap_peer;
  options.fleet_watch_interval = server.fleet_watch_interval;
  REFIT_ASSIGN_OR_RETURN(const std::string uri_text, ToTransportUri(config));
  REFIT_ASSIGN_OR_RETURN(TransportUri uri, TransportUri::Parse(uri_text));
  REFIT_RETURN_NOT_OK(AddCurveKeyFiles(config, &uri));
  options.transport_uri = uri.ToString();
  return options;
}

}  // namespace refit::config
