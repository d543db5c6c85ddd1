// The `refit` configuration: a flat YAML file whose group and key names follow NeMo RL's
// `policy.generation.refit_cfg.sparse` (plus its vLLM-level port and API-key keys), read into a
// plain struct, with settings given beside the file (command-line flags, Python keywords) merged
// in by one rule (ConfigOverride). role_options.h maps the result onto each role's options.
// docs/configuration.md lists every key, its default and its upstream counterpart;
// examples/refit.yaml is a complete file.
//
// Defaults are the library's own (each one is taken from a default-constructed option struct),
// so an empty file configures exactly what the library does without one.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "refit/commit_policy.h"
#include "refit/control_client.h"
#include "refit/control_server_options.h"
#include "refit/dtype.h"
#include "refit/item.h"
#include "refit/receiver_session_options.h"
#include "refit/status.h"
#include "refit/stream_options.h"
#include "refit/tracker_options.h"

namespace refit::config {

/// Parse "4096", "64KiB", "1.5GiB", "2GB" into bytes: the byte sizes of the file and of the
/// flags. Errors: InvalidArgument naming the text.
Result<uint64_t> ParseByteSize(const std::string& text);

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
  /// `item_coding`: auto | context | plain, whether a delta's XOR items are context-coded
  /// (payload format v2; ProducerStreamOptions::item_coding). Not `encoding`, which is the op.
  ItemCoding item_coding = ProducerStreamOptions{}.item_coding;
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
  /// `apply_queue_bytes`: the staged bytes not yet applied, per receiver
  /// (ReceiverSessionOptions::apply_queue_bytes).
  uint64_t apply_queue_bytes = ReceiverSessionOptions{}.apply_queue_bytes;
  /// `apply_threads`: threads that apply one payload, per receiver
  /// (ReceiverSessionOptions::apply_threads).
  int apply_threads = ReceiverSessionOptions{}.apply_threads;
  /// `decode_threads`: threads that decode queued payloads ahead of the apply, per receiver;
  /// 0: the apply thread decodes (ReceiverSessionOptions::decode_threads).
  int decode_threads = ReceiverSessionOptions{}.decode_threads;
};

/// One entry of `receivers:`, a receiver of the fleet.
struct ReceiverConfig {
  /// `control`: the base URL of its HTTP control plane, http(s)://host:port[/prefix].
  std::string control;
  /// `data`: its data endpoint in the transport's syntax (host:port for zmq://); may be left out
  /// for a transport that announces payloads on the control plane (s3://).
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
  /// `preempt_after_s`: how long a receiving transfer must have been quiet before a Prepare of
  /// another transfer from the same base rolls it back (ReceiverSessionOptions::preempt_after);
  /// 0 = never.
  std::chrono::milliseconds preempt_after = ReceiverSessionOptions{}.preempt_after;
  /// `anchor_undo`: memory | file | none, what the receiver keeps to undo an anchor
  /// (ReceiverSessionOptions::anchor_undo); `anchor_undo_dir`: the spill directory for `file`.
  AnchorUndo anchor_undo = ReceiverSessionOptions{}.anchor_undo;
  std::string anchor_undo_dir;
  /// `advertise`: the host other relays and producers reach this receiver by; empty: `bind`.
  std::string advertise;
  /// `max_payload_bytes`: the largest payload either plane accepts (ReceiverNodeOptions::
  /// max_payload_bytes); unset: sized to the model and the producers' bucket size.
  std::optional<uint64_t> max_payload_bytes;
  /// `loader`: a loader spec (YAML) mapping canonical tensors onto this receiver's; empty: none.
  std::string loader;
  /// `replica`: the replica this receiver belongs to (its tensor-parallel group).
  std::string replica;
  /// `bootstrap`: an s3:// chain to catch up from before serving; empty: none.
  std::string bootstrap;
  /// `bootstrap_peer`: the control URL of a receiver of the fleet with the same tensors to copy
  /// the fleet's version from before serving; empty: none.
  std::string bootstrap_peer;
  /// `fleet_watch_s`: while joined to a fleet, how often to ask the publisher for the fleet's
  /// version (ReceiverNodeOptions::fleet_watch_interval); 0: never.
  std::chrono::milliseconds fleet_watch_interval{std::chrono::seconds(1)};
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
  /// `zmq_refit_server_port`: the ZeroMQ data port of `refit serve`; 0 = one the kernel chooses
  /// as the listener binds (reported in the log and the ready file), which a static relay tree
  /// (a receivers list that `refit serve` takes as its peers) cannot name.
  uint16_t zmq_refit_server_port = kDefaultZmqPort;
  /// `commit_policy`: all | quorum:N | quorum:F | quorum:P% — when a transfer commits although
  /// some replicas did not flush (PublisherOptions::commit_policy, refit/commit_policy.h).
  CommitPolicy commit_policy;
  ServerConfig server;
};

/// A value given beside the file: text (a scalar, read as the file's would be: "8", "64MiB",
/// "true"), a list of strings, or the receivers list.
using ConfigValue =
    std::variant<std::string, std::vector<std::string>, std::vector<ReceiverConfig>>;

/// One setting given beside the file, by a command-line flag or a Python keyword: the key path of
/// the file's schema ("tuning.apply_queue_depth", "server.model", "receivers") and its value.
struct ConfigOverride {
  std::string key;
  ConfigValue value;
  /// Who gave it, for error messages ("--apply-queue-depth", "Receiver(anchor_undo=)"); empty:
  /// the key.
  std::string origin;
};

/// Parse the text of a configuration file. `source_name` (a path) prefixes every error message,
/// followed by the line and column: "refit.yaml:7:3: delta_compression.encodng: unknown key;
/// known keys: …". An empty file (or one with only comments) gives the defaults; a null value
/// keeps its key's default.
/// Errors: InvalidArgument for YAML syntax errors, more than one YAML document, unknown or
/// duplicate keys (upstream keys that refit has no use for say why), values of the wrong type or
/// out of range (naming the key path, the value and what is allowed), and settings that
/// contradict each other.
///
/// The one merge rule: a setting is its default, unless the file gives it, unless an override
/// does (a later override wins over an earlier one). Overrides are checked exactly as the file's
/// keys are — ranges, syntax and the checks across keys, after the merge — and errors about them
/// name their origin: "--apply-queue-depth (tuning.apply_queue_depth): 0 is outside [1, 1024]".
/// An override of `transport` replaces upstream's `refit_transport` in the file.
Result<RefitConfig> ParseConfig(std::string_view yaml_text, std::string_view source_name,
                                std::span<const ConfigOverride> overrides = {});

/// Read the text of the configuration file at `path`.
/// Errors: NotFound naming the path when it does not exist; IoError naming it when it cannot be
/// read; InvalidArgument for a file larger than any configuration should be.
Result<std::string> ReadConfigFile(const std::string& path);

/// Read and parse the configuration file at `path` with `overrides` on top; an empty `path`
/// reads no file (the defaults with `overrides`).
/// Errors: NotFound naming the path when it does not exist; IoError naming it when it cannot be
/// read; InvalidArgument for a file larger than any configuration should be, and as ParseConfig.
Result<RefitConfig> LoadConfigFile(const std::string& path,
                                   std::span<const ConfigOverride> overrides = {});

}  // namespace refit::config
