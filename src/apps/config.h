// The `refit` configuration file: a flat YAML file whose group and key names follow NeMo RL's
// `policy.generation.refit_cfg.sparse` (plus its vLLM-level port and API-key keys), read into a
// plain struct and mapped onto the library's option structs. docs/configuration.md lists every
// key, its default and its upstream counterpart; examples/refit.yaml is a complete file.
//
// Defaults are the library's own (each one is taken from a default-constructed option struct),
// so an empty file configures exactly what the library does without one.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "refit/control_client.h"
#include "refit/control_server.h"
#include "refit/dtype.h"
#include "refit/item.h"
#include "refit/producer_stream.h"
#include "refit/receiver_session.h"
#include "refit/status.h"
#include "refit/tracker.h"

namespace refit::cli {

/// `delta_compression:` — how changes are found, encoded and packed.
struct DeltaCompressionConfig {
  /// `encoding`: the op of delta items, xor | overwrite | add.
  Op encoding = TrackerOptions{}.op;
  /// `dtype`: the delta dtype of `add` items.
  DType dtype = TrackerOptions{}.add_delta_dtype;
  /// `sparse_bucket_size_bytes`: the most item bytes coalesced into one payload.
  uint64_t sparse_bucket_size_bytes = ProducerStreamOptions{}.bucket_bytes;
  /// `export_chunk_bytes`: the chunk target of the export chunking rule.
  uint64_t export_chunk_bytes = ProducerStreamOptions{}.chunk_bytes;
  /// `full_sync_interval`: every N-th transfer is an anchor; 0 = only the first.
  uint64_t full_sync_interval = TrackerOptions{}.full_sync_interval;
  /// `zstd_level`: the compression level of payload bodies.
  int zstd_level = PayloadEncodeOptions{}.zstd_level;
  /// `anchor_compression`: auto | zstd | none, how an anchor's payloads are compressed
  /// (ProducerStreamOptions::anchor_compression).
  AnchorCompression anchor_compression = ProducerStreamOptions{}.anchor_compression;
  /// `overwrite_names`: tensors always sent as OVERWRITE in delta transfers.
  std::vector<std::string> overwrite_names;
  /// `enabled` (upstream's name): false sends every transfer as an anchor (FULL), the dense
  /// path, as full_sync_interval 1 does.
  bool enabled = true;
};

/// `baseline:` — where the producer keeps the last committed weights.
struct BaselineConfig {
  /// `in_memory`: true = process memory, false = file-backed (mmap) baselines.
  bool in_memory = TrackerOptions{}.baseline_storage == BaselineStorage::kMemory;
  /// `mmap_dir`: the directory of file-backed baselines.
  std::string mmap_dir = TrackerOptions{}.baseline_dir;
};

/// `tuning:` — thread counts, retries and queue depths.
struct TuningConfig {
  /// The zmq transport's default number of extra send attempts (its `retries` URI parameter).
  static constexpr int kDefaultZmqRetries = 3;

  /// `encode_workers`, `serialize_workers`, `transfer_workers`: the producer's stage threads.
  int encode_workers = ProducerStreamOptions{}.encode_threads;
  int serialize_workers = ProducerStreamOptions{}.serialize_threads;
  int transfer_workers = ProducerStreamOptions{}.send_threads;
  /// `zmq_retries`: extra attempts of a ZeroMQ send (the `retries` parameter of zmq:// URIs).
  int zmq_retries = kDefaultZmqRetries;
  /// `apply_queue_depth`: payloads staged and not yet applied, per receiver.
  size_t apply_queue_depth = ReceiverSessionOptions{}.apply_queue_depth;
};

/// One entry of `receivers:`, a receiver of the fleet.
struct ReceiverConfig {
  /// `control`: the base URL of its HTTP control plane, http(s)://host:port[/prefix].
  std::string control;
  /// `data`: its data endpoint in the transport's syntax (host:port for zmq://).
  std::string data;

  friend bool operator==(const ReceiverConfig&, const ReceiverConfig&) = default;
};

/// `server:` — what `refit serve` holds and how it listens.
struct ServerConfig {
  /// `bind`: the address both the control plane and the data port listen on.
  std::string bind = ControlServerOptions{}.bind_address;
  /// `model`: the safetensors file to serve; `mmap`: map it instead of reading it into memory.
  std::string model;
  bool mmap = false;
  /// `tls_cert`, `tls_key`: PEM files of the control plane's HTTPS; both empty = plain HTTP.
  std::string tls_cert = ControlServerOptions{}.tls_cert_path;
  std::string tls_key = ControlServerOptions{}.tls_key_path;
  /// `ready_file`: a file written once the server accepts connections; empty = none.
  std::string ready_file;
  /// `curve_secret_key`, `curve_server_key`, `curve_authorized_keys`: paths of the ZeroMQ
  /// CURVE key files, for the zmq transport's URI parameters of the same names; empty = not set.
  std::string curve_secret_key;
  std::string curve_server_key;
  std::string curve_authorized_keys;
  /// `transfer_lease_s`: how long a receiving transfer may go without progress before the
  /// receiver aborts it itself (ReceiverSessionOptions::transfer_lease); 0 = no lease.
  std::chrono::milliseconds transfer_lease = ReceiverSessionOptions{}.transfer_lease;
  /// `anchor_undo`: memory | file | none, what the receiver keeps to undo an anchor
  /// (ReceiverSessionOptions::anchor_undo); `anchor_undo_dir`: the spill directory for `file`.
  AnchorUndo anchor_undo = ReceiverSessionOptions{}.anchor_undo;
  std::string anchor_undo_dir;
};

/// Every setting of a configuration file. A plain value type.
struct RefitConfig {
  /// The data port `refit serve` listens on unless told otherwise: ZeroMQ's customary example
  /// port. (Upstream picks a free port in [3000, 4999], which a pushing trainer could not know.)
  static constexpr uint16_t kDefaultZmqPort = 5555;

  /// `transport` (or upstream's `refit_transport`): a transport URI. Upstream's names
  /// vllm_zmq_sparse and vllm_s3_sparse are read as "zmq://" and "s3://".
  std::string transport = "zmq://";
  DeltaCompressionConfig delta_compression;
  BaselineConfig baseline;
  TuningConfig tuning;
  /// `request_timeout_s`: the control client's per-request timeout (fractional seconds in the
  /// file, rounded up to whole milliseconds).
  std::chrono::milliseconds request_timeout = ControlClientOptions{}.timeout;
  /// `receivers`: the fleet, in tree order (`refit push`, `refit demo`).
  std::vector<ReceiverConfig> receivers;
  /// `http_refit_api_key_env_var`: the name of the environment variable that holds the shared
  /// API key; empty (null in the file) = no authentication.
  std::string http_refit_api_key_env_var;
  /// `http_refit_server_port`: the control plane's port; 0 (or null) = a free ephemeral port.
  uint16_t http_refit_server_port = ControlServerOptions{}.port;
  /// `zmq_refit_server_port`: the ZeroMQ data port of `refit serve`.
  uint16_t zmq_refit_server_port = kDefaultZmqPort;
  ServerConfig server;
};

/// Parse the text of a configuration file. `source_name` (a path) prefixes every error message,
/// followed by the line and column: "refit.yaml:7:3: delta_compression.encodng: unknown key;
/// known keys: …". An empty file (or one with only comments) gives the defaults; a null value
/// keeps its key's default.
/// Errors: InvalidArgument for YAML syntax errors, more than one YAML document, unknown or
/// duplicate keys (upstream keys that refit has no use for say why), values of the wrong type or
/// out of range (naming the key path, the value and what is allowed), and settings that
/// contradict each other.
Result<RefitConfig> ParseConfig(std::string_view yaml_text, std::string_view source_name);

/// Read and parse the configuration file at `path`.
/// Errors: NotFound naming the path when it does not exist; IoError naming it when it cannot be
/// read; InvalidArgument for a file larger than any configuration should be, and as ParseConfig.
Result<RefitConfig> LoadConfigFile(const std::string& path);

/// Return the producer's tracker options. Options without a key keep their defaults.
TrackerOptions ToTrackerOptions(const RefitConfig& config);

/// Return the producer's stream options; producer_id and num_producers are left at their
/// defaults for the caller to set.
ProducerStreamOptions ToProducerStreamOptions(const RefitConfig& config);

/// Return a receiver's session options.
ReceiverSessionOptions ToReceiverSessionOptions(const RefitConfig& config);

/// Return the control server options of `refit serve`, with the API key read from the
/// environment variable the configuration names.
/// Errors: InvalidArgument naming the variable when it is unset or empty.
Result<ControlServerOptions> ToControlServerOptions(const RefitConfig& config);

/// Return the options of a control client of `receiver`, with the API key read as above.
/// Errors: InvalidArgument naming the variable when it is unset or empty.
Result<ControlClientOptions> ToControlClientOptions(const RefitConfig& config,
                                                    const ReceiverConfig& receiver);

/// Return the transport URI to pass to MakeTransport. For zmq:// (also wrapped, as in
/// fault+zmq://) it carries tuning.zmq_retries as `retries` and, when the configuration names an
/// API key variable and the URI sets no key of its own, `api_key_env=<variable>`, so the same key
/// guards the data plane and the control plane. Other URIs are returned as written.
/// Errors: InvalidArgument for a malformed URI, or a zmq URI whose `retries` differs from
/// tuning.zmq_retries.
Result<std::string> ToTransportUri(const RefitConfig& config);

}  // namespace refit::cli
