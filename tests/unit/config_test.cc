#include "config_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "pipeline/producer_stream.h"
#include "refit/transport.h"
#include "role_options.h"
#include "test_util.h"

namespace refit::config {
namespace {

constexpr const char* kKeyVar = "REFIT_CONFIG_TEST_API_KEY";

Result<RefitConfig> Parse(std::string_view text) { return ParseConfig(text, "test.yaml"); }

// Sets (or unsets, with nullopt) an environment variable for the scope of a test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::filesystem::path SourceRoot() {
  return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path();
}

// Expect every option a configuration maps to equal a default-constructed option struct.
void ExpectLibraryDefaults(const RefitConfig& config) {
  EXPECT_EQ(config.commit_policy, CommitPolicy{});
  const TrackerOptions tracker = ToTrackerOptions(config);
  const TrackerOptions tracker_default;
  EXPECT_EQ(tracker.baseline_storage, tracker_default.baseline_storage);
  EXPECT_EQ(tracker.baseline_dir, tracker_default.baseline_dir);
  EXPECT_EQ(tracker.full_sync_interval, tracker_default.full_sync_interval);
  EXPECT_EQ(tracker.max_drift_fraction, tracker_default.max_drift_fraction);
  EXPECT_EQ(tracker.op, tracker_default.op);
  EXPECT_EQ(tracker.add_delta_dtype, tracker_default.add_delta_dtype);
  EXPECT_EQ(tracker.overwrite_names, tracker_default.overwrite_names);
  EXPECT_EQ(tracker.force_location_encoding, tracker_default.force_location_encoding);
  EXPECT_EQ(tracker.compare.threads, tracker_default.compare.threads);
  EXPECT_EQ(tracker.initial_version, tracker_default.initial_version);

  const ProducerStreamOptions stream = ToProducerStreamOptions(config);
  const ProducerStreamOptions stream_default;
  EXPECT_EQ(stream.producer_id, stream_default.producer_id);
  EXPECT_EQ(stream.num_producers, stream_default.num_producers);
  EXPECT_EQ(stream.chunk_bytes, stream_default.chunk_bytes);
  EXPECT_EQ(stream.bucket_bytes, stream_default.bucket_bytes);
  EXPECT_EQ(stream.encode_threads, stream_default.encode_threads);
  EXPECT_EQ(stream.serialize_threads, stream_default.serialize_threads);
  EXPECT_EQ(stream.send_threads, stream_default.send_threads);
  EXPECT_EQ(stream.max_chunks_in_flight, stream_default.max_chunks_in_flight);
  EXPECT_EQ(stream.max_payloads_in_flight, stream_default.max_payloads_in_flight);
  EXPECT_EQ(stream.payload.zstd_level, stream_default.payload.zstd_level);
  EXPECT_EQ(stream.payload.byte_planes, stream_default.payload.byte_planes);

  const ReceiverSessionOptions session = ToReceiverSessionOptions(config);
  const ReceiverSessionOptions session_default;
  EXPECT_EQ(session.apply_queue_depth, session_default.apply_queue_depth);
  EXPECT_EQ(session.remembered_transfers, session_default.remembered_transfers);
  EXPECT_EQ(session.limits.max_payload_bytes, session_default.limits.max_payload_bytes);

  ASSERT_OK_AND_ASSIGN(const ControlServerOptions server, ToControlServerOptions(config));
  const ControlServerOptions server_default;
  EXPECT_EQ(server.bind_address, server_default.bind_address);
  EXPECT_EQ(server.port, server_default.port);
  EXPECT_EQ(server.api_key, server_default.api_key);
  EXPECT_EQ(server.tls_cert_path, server_default.tls_cert_path);
  EXPECT_EQ(server.tls_key_path, server_default.tls_key_path);
  EXPECT_EQ(server.max_request_bytes, server_default.max_request_bytes);
  EXPECT_EQ(server.worker_threads, server_default.worker_threads);

  ASSERT_OK_AND_ASSIGN(const ControlClientOptions client,
                       ToControlClientOptions(config, {"http://127.0.0.1:1", "127.0.0.1:2"}));
  const ControlClientOptions client_default;
  EXPECT_EQ(client.base_url, "http://127.0.0.1:1");
  EXPECT_EQ(client.api_key, client_default.api_key);
  EXPECT_EQ(client.timeout, client_default.timeout);
  EXPECT_EQ(client.max_retries, client_default.max_retries);
  EXPECT_EQ(client.tls_verify, client_default.tls_verify);

  // The zmq transport's defaults, spelled out.
  ASSERT_OK_AND_ASSIGN(const std::string uri, ToTransportUri(config));
  EXPECT_EQ(uri, "zmq://?retries=3");
  EXPECT_TRUE(config.receivers.empty());
  EXPECT_EQ(config.zmq_refit_server_port, 5555);
  EXPECT_TRUE(config.server.model.empty());
  EXPECT_FALSE(config.server.mmap);
}

TEST(ConfigTest, DefaultsEqualLibraryDefaults) { ExpectLibraryDefaults(RefitConfig{}); }

TEST(ConfigTest, CommitPolicyReachesThePublisherAndBadOnesAreNamed) {
  ASSERT_OK_AND_ASSIGN(RefitConfig config, Parse("commit_policy: quorum:0.5\n"));
  ASSERT_OK_AND_ASSIGN(PublisherOptions options, ToPublisherOptions(config));
  EXPECT_EQ(options.commit_policy.kind, CommitPolicy::Kind::kQuorum);
  EXPECT_EQ(options.commit_policy.fraction, 0.5);
  ASSERT_OK_AND_ASSIGN(config, Parse("commit_policy: quorum:3\n"));
  EXPECT_EQ(config.commit_policy.count, 3u);
  for (const std::string_view bad : {"commit_policy: most\n", "commit_policy: quorum:0\n",
                                     "commit_policy: quorum:1.5\n", "commit_policy: 'quorum:'\n"}) {
    SCOPED_TRACE(bad);
    const Status status = Parse(bad).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("commit_policy"), std::string_view::npos) << status.message();
    EXPECT_NE(status.message().find("quorum"), std::string_view::npos) << status.message();
  }
}

TEST(ConfigTest, EmptyFilesAndNullValuesGiveDefaults) {
  for (const std::string_view text :
       {"", "# nothing but a comment\n", "---\n", "tuning:\nserver: ~\nbaseline: null\n",
        "delta_compression: {encoding: ~, zstd_level: }\nhttp_refit_api_key_env_var: null\n"}) {
    SCOPED_TRACE(text);
    ASSERT_OK_AND_ASSIGN(const RefitConfig config, Parse(text));
    ExpectLibraryDefaults(config);
  }
}

TEST(ConfigTest, EveryKeyRoundTripsToTheOptionStructs) {
  ScopedEnv key(kKeyVar, "s3cret");
  ASSERT_OK_AND_ASSIGN(const RefitConfig config, Parse(R"(
transport: file:///tmp/drop?poll_ms=50
delta_compression:
  encoding: add
  dtype: fp32
  sparse_bucket_size_bytes: 1MiB
  export_chunk_bytes: 67108864
  full_sync_interval: 20
  zstd_level: 3
  zstd_threads: 0
  overwrite_names: [lm_head.weight, model.embed_tokens.weight]
baseline:
  in_memory: false
  mmap_dir: /var/tmp/refit
tuning:
  encode_workers: 16
  serialize_workers: 2
  transfer_workers: 32
  zmq_retries: 5
  apply_queue_depth: 32
request_timeout_s: 600.0005
receivers:
  - {control: https://gen-0:8443/refit, data: inbox-0}
  - control: http://gen-1:8081
    data: inbox-1
http_refit_api_key_env_var: REFIT_CONFIG_TEST_API_KEY
http_refit_server_port: 9000
zmq_refit_server_port: 6000
server:
  bind: 0.0.0.0
  model: /models/m.safetensors
  mmap: yes
  tls_cert: /etc/refit/cert.pem
  tls_key: /etc/refit/key.pem
  ready_file: /run/refit.ready
  curve_secret_key: secret-z85
  curve_server_key: public-z85
  curve_authorized_keys: /etc/refit/authorized
)"));

  const TrackerOptions tracker = ToTrackerOptions(config);
  EXPECT_EQ(tracker.op, Op::kAdd);
  EXPECT_EQ(tracker.add_delta_dtype, DType::kFloat32);
  EXPECT_EQ(tracker.full_sync_interval, 20u);
  EXPECT_EQ(tracker.baseline_storage, BaselineStorage::kFile);
  EXPECT_EQ(tracker.baseline_dir, "/var/tmp/refit");
  EXPECT_EQ(tracker.overwrite_names,
            (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight"}));

  const ProducerStreamOptions stream = ToProducerStreamOptions(config);
  EXPECT_EQ(stream.bucket_bytes, uint64_t{1} << 20);
  EXPECT_EQ(stream.chunk_bytes, uint64_t{64} << 20);
  EXPECT_EQ(stream.encode_threads, 16);
  EXPECT_EQ(stream.serialize_threads, 2);
  EXPECT_EQ(stream.send_threads, 32);
  EXPECT_EQ(stream.payload.zstd_level, 3);
  // Every option it sets is one ProducerStream accepts.
  EXPECT_OK(ProducerStream::Make(stream));

  EXPECT_EQ(ToReceiverSessionOptions(config).apply_queue_depth, 32u);

  ASSERT_OK_AND_ASSIGN(const ControlServerOptions server, ToControlServerOptions(config));
  EXPECT_EQ(server.bind_address, "0.0.0.0");
  EXPECT_EQ(server.port, 9000);
  EXPECT_EQ(server.api_key, "s3cret");
  EXPECT_EQ(server.tls_cert_path, "/etc/refit/cert.pem");
  EXPECT_EQ(server.tls_key_path, "/etc/refit/key.pem");

  ASSERT_EQ(config.receivers.size(), 2u);
  EXPECT_EQ(config.receivers[0], (ReceiverConfig{"https://gen-0:8443/refit", "inbox-0"}));
  EXPECT_EQ(config.receivers[1], (ReceiverConfig{"http://gen-1:8081", "inbox-1"}));
  ASSERT_OK_AND_ASSIGN(const ControlClientOptions client,
                       ToControlClientOptions(config, config.receivers[0]));
  EXPECT_EQ(client.base_url, "https://gen-0:8443/refit");
  EXPECT_EQ(client.api_key, "s3cret");
  // 600.0005 s rounds up to whole milliseconds.
  EXPECT_EQ(client.timeout, std::chrono::milliseconds(600'001));

  // Not zmq: returned as written.
  ASSERT_OK_AND_ASSIGN(const std::string uri, ToTransportUri(config));
  EXPECT_EQ(uri, "file:///tmp/drop?poll_ms=50");
  EXPECT_EQ(config.tuning.zmq_retries, 5);

  EXPECT_EQ(config.zmq_refit_server_port, 6000);
  EXPECT_EQ(config.server.model, "/models/m.safetensors");
  EXPECT_TRUE(config.server.mmap);
  EXPECT_EQ(config.server.ready_file, "/run/refit.ready");
  EXPECT_EQ(config.server.curve_secret_key, "secret-z85");
  EXPECT_EQ(config.server.curve_server_key, "public-z85");
  EXPECT_EQ(config.server.curve_authorized_keys, "/etc/refit/authorized");
}

TEST(ConfigTest, UnknownKeysNamePathLineAndKnownKeys) {
  EXPECT_STATUS_MSG(InvalidArgument,
                    "test.yaml:4:3: delta_compression.encodng: unknown key; known keys: encoding, "
                    "dtype, sparse_bucket_size_bytes",
                    Parse("tuning:\n  encode_workers: 4\ndelta_compression:\n  encodng: xor\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "test.yaml:1:1: transprot: unknown key; known keys: transport",
                    Parse("transprot: zmq://\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "test.yaml:2:3: server.bnd: unknown key",
                    Parse("server:\n  bnd: 0.0.0.0\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "receivers[1].ctrl: unknown key; known keys: control, data",
                    Parse("receivers:\n  - {control: http://a:1, data: a:2}\n"
                          "  - {ctrl: http://b:1, data: b:2}\n"));
}

TEST(ConfigTest, UpstreamKeysRefitDoesNotUseSayWhy) {
  EXPECT_STATUS_MSG(InvalidArgument,
                    "verify_samples_per_payload: upstream key not used by refit: refit verifies",
                    Parse("verify_samples_per_payload: 0\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "s3://<bucket>/<prefix>",
                    Parse("storage: {s3_bucket: my-bucket}\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "tuning.apply_batch_size: upstream key not used by refit",
                    Parse("tuning: {apply_batch_size: 8}\n"));
}

TEST(ConfigTest, DeltaCompressionDisabledMakesEveryTransferAnAnchor) {
  ASSERT_OK_AND_ASSIGN(const RefitConfig off,
                       Parse("delta_compression: {enabled: false, full_sync_interval: 20}\n"));
  EXPECT_FALSE(off.delta_compression.enabled);
  EXPECT_EQ(ToTrackerOptions(off).full_sync_interval, 1u);
  ASSERT_OK_AND_ASSIGN(const RefitConfig on,
                       Parse("delta_compression: {enabled: true, full_sync_interval: 20}\n"));
  EXPECT_EQ(ToTrackerOptions(on).full_sync_interval, 20u);
  EXPECT_STATUS_MSG(InvalidArgument, "delta_compression.enabled",
                    Parse("delta_compression: {enabled: maybe}\n"));
}

TEST(ConfigTest, DuplicateKeysAreRejected) {
  EXPECT_STATUS_MSG(InvalidArgument,
                    "test.yaml:3:3: tuning.encode_workers: duplicate key (first at line 2)",
                    Parse("tuning:\n  encode_workers: 4\n  encode_workers: 5\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "test.yaml:3:1: tuning: duplicate key (first at line 1)",
                    Parse("tuning: {}\nbaseline: {}\ntuning: {}\n"));
}

TEST(ConfigTest, WrongTypesNameThePath) {
  EXPECT_STATUS_MSG(InvalidArgument,
                    "test.yaml:1:1: tuning: expected a mapping of keys, got a "
                    "scalar",
                    Parse("tuning: 4\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "transport: expected a scalar value, got a sequence",
                    Parse("transport: [zmq://]\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "tuning.encode_workers: expected an integer, got 'eight'",
                    Parse("tuning: {encode_workers: eight}\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "tuning.encode_workers: expected an integer, got '4.5'",
                    Parse("tuning: {encode_workers: 4.5}\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "baseline.in_memory: expected true or false, got 'maybe'",
                    Parse("baseline: {in_memory: maybe}\n"));
  EXPECT_STATUS_MSG(InvalidArgument,
                    "delta_compression.overwrite_names: expected a sequence, got a scalar",
                    Parse("delta_compression: {overwrite_names: lm_head.weight}\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "receivers: expected a sequence",
                    Parse("receivers: {control: http://a:1, data: a:2}\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "(top level): expected a mapping of keys, got a sequence",
                    Parse("- transport: zmq://\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "keys must be scalars", Parse("? [a, b]\n: 1\n"));
}

TEST(ConfigTest, BadValuesNamePathValueAndAllowedRange) {
  struct Case {
    std::string_view yaml;
    std::string_view message;
  };
  const Case cases[] = {
      {"tuning: {encode_workers: 0}", "tuning.encode_workers: 0 is outside [1, 4096]"},
      {"tuning: {serialize_workers: 4097}", "tuning.serialize_workers: 4097 is outside [1, 4096]"},
      {"tuning: {transfer_workers: -1}", "tuning.transfer_workers: -1 is outside [1, 4096]"},
      {"tuning: {apply_queue_depth: 0}", "tuning.apply_queue_depth: 0 is outside [1, 65536]"},
      {"tuning: {apply_queue_depth: 65537}", "tuning.apply_queue_depth: 65537 is outside"},
      {"tuning: {zmq_retries: 101}", "tuning.zmq_retries: 101 is outside [0, 100]"},
      {"tuning: {encode_workers: 99999999999999999999}",
       "tuning.encode_workers: 99999999999999999999 is outside [1, 4096]"},
      {"http_refit_server_port: 65536", "http_refit_server_port: 65536 is outside [0, 65535]"},
      {"zmq_refit_server_port: 65536", "zmq_refit_server_port: 65536 is outside [0, 65535]"},
      {"delta_compression: {sparse_bucket_size_bytes: 0}",
       "delta_compression.sparse_bucket_size_bytes: '0' must be a positive byte size"},
      {"delta_compression: {export_chunk_bytes: 0KiB}",
       "delta_compression.export_chunk_bytes: '0KiB' must be a positive byte size"},
      {"delta_compression: {export_chunk_bytes: 12 parsecs}",
       "delta_compression.export_chunk_bytes: '12 parsecs' is not a byte size"},
      {"delta_compression: {encoding: zstd}",
       "delta_compression.encoding: 'zstd' is not one of xor, overwrite, add"},
      {"delta_compression: {encoding: full}",
       "delta_compression.encoding: 'full' is not one of xor, overwrite, add"},
      {"delta_compression: {dtype: int32}",
       "delta_compression.dtype: 'int32' cannot carry add deltas"},
      {"delta_compression: {dtype: float8_e4m3fn}",
       "delta_compression.dtype: 'float8_e4m3fn' cannot carry add deltas"},
      {"delta_compression: {zstd_level: 23}", "delta_compression.zstd_level: 23 is outside"},
      {"delta_compression: {zstd_threads: 2}",
       "delta_compression.zstd_threads: 2 is not supported"},
      {"delta_compression: {full_sync_interval: -1}",
       "delta_compression.full_sync_interval: -1 is outside [0, "},
      {"delta_compression: {overwrite_names: ['']}",
       "delta_compression.overwrite_names[0]: must not be empty"},
      {"request_timeout_s: 0", "request_timeout_s: 0 is outside (0, 86400] seconds"},
      {"request_timeout_s: -5", "request_timeout_s: -5 is outside (0, 86400] seconds"},
      {"request_timeout_s: 600000", "request_timeout_s: 600000 is outside (0, 86400] seconds"},
      {"request_timeout_s: soon", "request_timeout_s: expected a number of seconds, got 'soon'"},
      {"request_timeout_s: .nan", "request_timeout_s: expected a number of seconds, got '.nan'"},
      {"http_refit_api_key_env_var: MY-KEY",
       "http_refit_api_key_env_var: 'MY-KEY' is not an environment variable name"},
      {"baseline: {mmap_dir: ''}", "baseline.mmap_dir: must not be empty"},
      {"server: {bind: ''}", "server.bind: must not be empty"},
      {"transport: zmq", "transport: "},
      {"transport: 'zmq://#frag'", "transport: "},
      {"server: {tls_cert: /c.pem}",
       "server.tls_cert: set both server.tls_cert and server.tls_key for HTTPS, or neither"},
      {"server: {tls_key: /k.pem}", "server.tls_key: set both"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.yaml);
    EXPECT_STATUS_MSG(InvalidArgument, std::string(c.message), Parse(c.yaml));
  }
}

TEST(ConfigTest, ReceiversNeedControlUrlAndDataEndpoint) {
  struct Case {
    std::string_view yaml;
    std::string_view message;
  };
  const Case cases[] = {
      {"receivers: [{control: http://a:1}]",
       "test.yaml:1:13: receivers[0].data: '' has no :port (the zmq transport needs host:port)"},
      {"receivers: [{data: a:2}]", "receivers[0]: missing control"},
      {"receivers: [a:2]", "receivers[0]: expected a {control, data} mapping, got a scalar"},
      {"receivers: [{control: ftp://a:1, data: a:2}]",
       "receivers[0].control: 'ftp://a:1' is not an http:// or https:// URL"},
      {"receivers: [{control: http://a/x, data: a:2}]",
       "receivers[0].control: 'http://a/x' has no :port"},
      {"receivers: [{control: 'http://a:0', data: a:2}]",
       "receivers[0].control: 'http://a:0' has no port in [1, 65535]"},
      {"receivers: [{control: http://a:1, data: a}]",
       "receivers[0].data: 'a' has no :port (the zmq transport needs host:port)"},
      {"transport: fault+zmq://?seed=1\nreceivers: [{control: http://a:1, data: ':5'}]",
       "receivers[0].data: ':5' has no host"},
      {"receivers: [{control: http://a:1, data: a:2}, {control: http://b:1, data: a:2}]",
       "receivers[1].data: 'a:2' repeats receivers[0]"},
      {"receivers: [{control: http://a:1, data: a:2}, {control: http://a:1, data: b:2}]",
       "receivers[1].control: 'http://a:1' repeats receivers[0]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.yaml);
    EXPECT_STATUS_MSG(InvalidArgument, std::string(c.message), Parse(c.yaml));
  }
  // Outside zmq the data endpoint is the transport's own syntax (an inbox for file://).
  ASSERT_OK_AND_ASSIGN(const RefitConfig config,
                       Parse("transport: file:///mnt/drop\n"
                             "receivers: [{control: 'http://[::1]:8081', data: inbox-a}]\n"));
  EXPECT_EQ(config.receivers.at(0).data, "inbox-a");
  // An object store's receivers are reached on their control plane alone.
  ASSERT_OK_AND_ASSIGN(const RefitConfig store,
                       Parse("transport: s3://bucket/run\n"
                             "receivers: [{control: 'http://a:1'}, {control: 'http://b:1'}]\n"));
  EXPECT_EQ(store.receivers.at(1), (ReceiverConfig{"http://b:1", ""}));
}

// ---- The merge rule: defaults, then the file, then the overrides in order ------------------

TEST(ConfigOverrideTest, OverridesWinOverTheFileAndLaterOverridesWinOverEarlierOnes) {
  const ConfigOverride overrides[] = {
      {"tuning.apply_queue_depth", "8", "--apply-queue-depth"},
      {"server.model", "/m/a.safetensors", "--model"},
      {"server.model", "/m/b.safetensors", "Receiver(model_path=)"},
      {"server.mmap", "yes", "--mmap"},
      {"delta_compression.overwrite_names", std::vector<std::string>{"lm_head.weight"}, ""},
  };
  ASSERT_OK_AND_ASSIGN(const RefitConfig config,
                       ParseConfig("tuning: {apply_queue_depth: 4, encode_workers: 3}\n"
                                   "server: {model: /m/file.safetensors}\n",
                                   "test.yaml", overrides));
  EXPECT_EQ(config.tuning.apply_queue_depth, 8u);
  EXPECT_EQ(config.tuning.encode_workers, 3);  // the file's, not overridden
  EXPECT_EQ(config.server.model, "/m/b.safetensors");
  EXPECT_TRUE(config.server.mmap);
  EXPECT_EQ(config.delta_compression.overwrite_names, std::vector<std::string>{"lm_head.weight"});
  // Without a file: the defaults with the overrides; a mapping on the way is made.
  ASSERT_OK_AND_ASSIGN(const RefitConfig bare, LoadConfigFile("", overrides));
  EXPECT_EQ(bare.tuning.apply_queue_depth, 8u);
  EXPECT_EQ(bare.tuning.encode_workers, TuningConfig{}.encode_workers);
  EXPECT_EQ(bare.server.model, "/m/b.safetensors");
  ASSERT_OK_AND_ASSIGN(const RefitConfig none, LoadConfigFile("", {}));
  ExpectLibraryDefaults(none);
}

TEST(ConfigOverrideTest, OverridesAreCheckedAsTheFileIsAndErrorsNameTheirOrigin) {
  struct Case {
    ConfigOverride entry;
    std::string_view message;
  };
  const Case cases[] = {
      {{"tuning.apply_queue_depth", "0", "--apply-queue-depth"},
       "--apply-queue-depth (tuning.apply_queue_depth): 0 is outside [1, 65536]"},
      {{"server.anchor_undo", "sometimes", "Receiver(anchor_undo=)"},
       "Receiver(anchor_undo=) (server.anchor_undo): "},
      {{"delta_compression.export_chunk_bytes", "0", "Publisher(chunk_bytes=)"},
       "Publisher(chunk_bytes=) (delta_compression.export_chunk_bytes): '0' must be a positive"},
      {{"tuning.apply_queu_depth", "8", "--typo"}, "--typo (tuning.apply_queu_depth): unknown key"},
      {{"tuning..x", "8", "--dots"}, "--dots: 'tuning..x' is not a key path"},
      {{"tuning.encode_workers.x", "1", "--nested"},
       "--nested (tuning.encode_workers.x): the configuration's tuning.encode_workers is a scalar, "
       "not a mapping"},
      {{"transport", "zmq://?retries=500", "--transport"},
       "--transport (transport): retries=500 is outside [0, 100]"},
      {{"receivers", std::vector<ReceiverConfig>{{"http://a:1", "a"}}, "--receiver"},
       "--receiver (receivers[0].data): 'a' has no :port"},
      {{"server.max_payload_bytes", "lots", "--max-payload-bytes"},
       "--max-payload-bytes (server.max_payload_bytes): 'lots' is not a byte size"},
      {{"tuning.apply_threads", "0", "--apply-threads"},
       "--apply-threads (tuning.apply_threads): 0 is outside [1, 256]"},
      {{"tuning.decode_threads", "257", "--decode-threads"},
       "--decode-threads (tuning.decode_threads): 257 is outside [0, 256]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.entry.key);
    EXPECT_STATUS_MSG(InvalidArgument, std::string(c.message),
                      ParseConfig("tuning: {encode_workers: 2}\n", "test.yaml", {&c.entry, 1}));
  }
  // An error in the file itself still names the file, line and column.
  const ConfigOverride fine{"tuning.apply_queue_depth", "8", "--apply-queue-depth"};
  EXPECT_STATUS_MSG(InvalidArgument, "test.yaml:1:10: tuning.encode_workers: 0 is outside",
                    ParseConfig("tuning: {encode_workers: 0}\n", "test.yaml", {&fine, 1}));
}

TEST(ConfigOverrideTest, ATransportOverrideReplacesUpstreamsKeyAndAdoptsItsRetries) {
  const ConfigOverride transport{"transport", "zmq://?retries=7", "--transport"};
  ASSERT_OK_AND_ASSIGN(const RefitConfig config, ParseConfig("refit_transport: vllm_s3_sparse\n",
                                                             "test.yaml", {&transport, 1}));
  EXPECT_EQ(config.transport, "zmq://?retries=7");
  EXPECT_EQ(config.tuning.zmq_retries, 7);
  // The URI's value and the adopted tuning value are one setting, compared as numbers.
  const ConfigOverride padded{"transport", "zmq://?retries=03", "--transport"};
  ASSERT_OK_AND_ASSIGN(const RefitConfig three, LoadConfigFile("", {&padded, 1}));
  ASSERT_OK_AND_ASSIGN(const std::string uri, ToTransportUri(three));
  EXPECT_EQ(uri, "zmq://?retries=03");
  // The file's own tuning.zmq_retries still contradicts it, by name.
  EXPECT_STATUS_MSG(InvalidArgument, "tuning.zmq_retries: 3 contradicts retries=7",
                    ParseConfig("tuning: {zmq_retries: 3}\n", "test.yaml", {&transport, 1}));
}

TEST(ConfigOverrideTest, ReceiverKeysMapOntoTheReceiverNodesOptions) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "refit_config_role";
  std::filesystem::create_directories(dir);
  const std::string loader_path = (dir / "loader.yaml").string();
  std::ofstream(loader_path) << "tp_rank: 1\ntp_size: 2\n";
  ScopedEnv key(kKeyVar, "secret-1");
  const ConfigOverride overrides[] = {
      {"server.loader", loader_path, "--loader"},
      {"tuning.apply_threads", "3", "--apply-threads"},
      {"tuning.decode_threads", "2", "--decode-threads"},
      {"server.max_payload_bytes", "64MiB", "--max-payload-bytes"},
  };
  ASSERT_OK_AND_ASSIGN(
      const RefitConfig config,
      ParseConfig(fmt::format("http_refit_api_key_env_var: {}\n"
                              "delta_compression: {{sparse_bucket_size_bytes: 32MiB}}\n"
                              "server: {{model: /m.safetensors, mmap: true, replica: r1, bind: "
                              "10.0.0.5, curve_secret_key: /k/server.key, bootstrap: "
                              "'s3://b/p?chain=1', anchor_undo: file, anchor_undo_dir: /spill}}\n",
                              kKeyVar),
                  "test.yaml", overrides));
  ASSERT_OK_AND_ASSIGN(const ReceiverNodeOptions node, ToReceiverNodeOptions(config));
  EXPECT_EQ(node.model_path, "/m.safetensors");
  EXPECT_EQ(node.store_mode, StoreMode::kMmap);
  ASSERT_TRUE(node.loader.has_value());
  EXPECT_EQ(node.loader->tp_rank, 1u);
  EXPECT_EQ(node.loader->tp_size, 2u);
  EXPECT_EQ(node.place.replica, "r1");
  EXPECT_EQ(node.max_payload_bytes, uint64_t{64} << 20);
  EXPECT_EQ(node.producer_bucket_bytes, uint64_t{32} << 20);
  EXPECT_EQ(node.bootstrap_uri, "s3://b/p?chain=1");
  EXPECT_EQ(node.control.api_key, "secret-1");
  EXPECT_EQ(node.control.bind_address, "10.0.0.5");
  EXPECT_EQ(node.session.apply_threads, 3);
  EXPECT_EQ(node.session.decode_threads, 2);
  EXPECT_EQ(node.session.anchor_undo, AnchorUndo::kFile);
  EXPECT_EQ(node.session.anchor_undo_directory, "/spill");
  EXPECT_EQ(node.transport_uri,
            fmt::format("zmq://?retries=3&api_key_env={}&curve_secret_key=/k/server.key", kKeyVar));
  // A key file set twice, and a loader spec that cannot be read, are refused by name.
  const ConfigOverride twice{"transport", "zmq://?curve_secret_key=/other", "--transport"};
  ASSERT_OK_AND_ASSIGN(
      const RefitConfig both,
      ParseConfig("server: {curve_secret_key: /k/server.key}\n", "test.yaml", {&twice, 1}));
  EXPECT_STATUS_MSG(InvalidArgument, "server.curve_secret_key and the transport URI's",
                    ToReceiverNodeOptions(both));
  const ConfigOverride missing{"server.loader", (dir / "absent.yaml").string(), "--loader"};
  ASSERT_OK_AND_ASSIGN(const RefitConfig no_loader, LoadConfigFile("", {&missing, 1}));
  EXPECT_STATUS_MSG(NotFound, "server.loader", ToReceiverNodeOptions(no_loader));
  std::filesystem::remove_all(dir);
}

TEST(ConfigOverrideTest, ProducerKeysMapOntoThePublishersOptions) {
  ScopedEnv key(kKeyVar, "secret-2");
  const ConfigOverride receivers{
      "receivers",
      std::vector<ReceiverConfig>{{"http://10.0.0.5:8081", "10.0.0.5:5555"},
                                  {"http://10.0.0.6:8081", "10.0.0.6:5555"}},
      "Publisher(receivers=)"};
  ASSERT_OK_AND_ASSIGN(
      const RefitConfig config,
      ParseConfig(fmt::format("http_refit_api_key_env_var: {}\nrequest_timeout_s: 2.5\n"
                              "delta_compression: {{full_sync_interval: 5, export_chunk_bytes: "
                              "1MiB, encoding: add}}\ntuning: {{transfer_workers: 6}}\n",
                              kKeyVar),
                  "test.yaml", {&receivers, 1}));
  ASSERT_OK_AND_ASSIGN(const PublisherOptions options, ToPublisherOptions(config));
  ASSERT_EQ(options.receivers.size(), 2u);
  EXPECT_EQ(options.receivers[1].control_url, "http://10.0.0.6:8081");
  EXPECT_EQ(options.receivers[1].data_endpoint, "10.0.0.6:5555");
  EXPECT_EQ(options.control.api_key, "secret-2");
  EXPECT_EQ(options.control.timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(options.tracker.full_sync_interval, 5u);
  EXPECT_EQ(options.tracker.op, Op::kAdd);
  EXPECT_EQ(options.stream.chunk_bytes, uint64_t{1} << 20);
  EXPECT_EQ(options.stream.send_threads, 6);
  EXPECT_EQ(options.transport_uri, fmt::format("zmq://?retries=3&api_key_env={}", kKeyVar));
}

TEST(ConfigTest, YamlSyntaxErrorsHaveLineAndColumn) {
  EXPECT_STATUS_MSG(InvalidArgument,
                    "test.yaml:2:2: YAML syntax error:", Parse("transport: [zmq://\nb: 3\n"));
  EXPECT_STATUS_MSG(InvalidArgument,
                    "test.yaml:1:12: YAML syntax error:", Parse("transport: *undefined\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "test.yaml: holds 2 YAML documents; a configuration is one",
                    Parse("transport: zmq://\n---\ntransport: file:///x\n"));
}

// Regression: yaml-cpp 0.7's LoadAll never returns on a lone ',' (jbeder/yaml-cpp#1040), which
// hung `refit push` and `refit serve` on a one-character typo while memory grew.
TEST(ConfigTest, AOneCharacterTypoIsAnErrorNamingTheFileNotAHang) {
  EXPECT_STATUS_MSG(InvalidArgument, "test.yaml: is not a YAML document yaml-cpp can read",
                    Parse(","));
  EXPECT_STATUS_MSG(InvalidArgument, "test.yaml:2:1: YAML syntax error",
                    Parse("transport: zmq://\n,\n"));
}

TEST(ConfigTest, UpstreamTransportNamesAreAliases) {
  ASSERT_OK_AND_ASSIGN(RefitConfig config, Parse("refit_transport: vllm_zmq_sparse\n"));
  EXPECT_EQ(config.transport, "zmq://");
  ASSERT_OK_AND_ASSIGN(config, Parse("transport: vllm_s3_sparse\n"));
  EXPECT_EQ(config.transport, "s3://");
  ASSERT_OK_AND_ASSIGN(const std::string uri, ToTransportUri(config));
  EXPECT_EQ(uri, "s3://");
  EXPECT_STATUS_MSG(InvalidArgument,
                    "test.yaml:2:1: refit_transport: give transport or upstream's "
                    "refit_transport, not both",
                    Parse("transport: zmq://\nrefit_transport: vllm_zmq_sparse\n"));
}

TEST(ConfigTest, SizeStrings) {
  const std::pair<std::string_view, uint64_t> sizes[] = {
      {"4096", 4096},
      {"64KiB", 64 << 10},
      {"1.5GiB", uint64_t{3} << 29},
      {"2GB", 2'000'000'000},
      {"32MiB", uint64_t{32} << 20},
      {"1e3", 1000},
      {"8M", uint64_t{8} << 20},
  };
  for (const auto& [text, bytes] : sizes) {
    SCOPED_TRACE(text);
    ASSERT_OK_AND_ASSIGN(const RefitConfig config,
                         Parse(fmt::format("delta_compression: "
                                           "{{sparse_bucket_size_bytes: {}}}\n",
                                           text)));
    EXPECT_EQ(config.delta_compression.sparse_bucket_size_bytes, bytes);
  }
}

TEST(ConfigTest, ParseByteSizeIsExactAndBounded) {
  // Whole numbers beyond a double's 53 bits stay exact.
  ASSERT_OK_AND_ASSIGN(uint64_t bytes, ParseByteSize("9007199254740993"));
  EXPECT_EQ(bytes, uint64_t{9007199254740993});
  ASSERT_OK_AND_ASSIGN(bytes, ParseByteSize("18446744073709551615"));
  EXPECT_EQ(bytes, std::numeric_limits<uint64_t>::max());
  ASSERT_OK_AND_ASSIGN(bytes, ParseByteSize("0.5KiB"));
  EXPECT_EQ(bytes, 512u);
  EXPECT_STATUS_MSG(InvalidArgument, "exceeds 2^64 - 1 bytes",
                    ParseByteSize("18446744073709551616"));
  EXPECT_STATUS_MSG(InvalidArgument, "exceeds 2^64 - 1 bytes", ParseByteSize("16777216TiB"));
  EXPECT_STATUS_MSG(InvalidArgument, "exceeds 2^64 - 1 bytes", ParseByteSize("16777216.5TiB"));
  for (const char* bad : {"", "MiB", "-1", "-1KiB", "0x10", "inf", "nan", " 5", "5 MiB", "5XB"}) {
    SCOPED_TRACE(bad);
    EXPECT_STATUS_MSG(InvalidArgument, "is not a byte size", ParseByteSize(bad));
  }
}

TEST(ConfigTest, ApiKeyComesFromTheNamedEnvironmentVariable) {
  const std::string yaml = fmt::format("http_refit_api_key_env_var: {}\n", kKeyVar);
  ASSERT_OK_AND_ASSIGN(const RefitConfig config, Parse(yaml));
  EXPECT_EQ(config.http_refit_api_key_env_var, kKeyVar);
  const ReceiverConfig receiver{"http://127.0.0.1:8081", "127.0.0.1:5555"};
  {
    ScopedEnv key(kKeyVar, "token-123");
    ASSERT_OK_AND_ASSIGN(const ControlServerOptions server, ToControlServerOptions(config));
    EXPECT_EQ(server.api_key, "token-123");
    ASSERT_OK_AND_ASSIGN(const ControlClientOptions client,
                         ToControlClientOptions(config, receiver));
    EXPECT_EQ(client.api_key, "token-123");
  }
  for (const std::optional<std::string>& value :
       {std::optional<std::string>(), std::optional<std::string>("")}) {
    ScopedEnv key(kKeyVar, value);
    EXPECT_STATUS_MSG(InvalidArgument, std::string(kKeyVar), ToControlServerOptions(config));
    EXPECT_STATUS_MSG(InvalidArgument, "unset or empty", ToControlClientOptions(config, receiver));
  }
  // No variable named: no key, whatever the environment holds.
  ScopedEnv key(kKeyVar, "token-123");
  ASSERT_OK_AND_ASSIGN(const RefitConfig open, Parse("http_refit_api_key_env_var: null\n"));
  ASSERT_OK_AND_ASSIGN(const ControlServerOptions server, ToControlServerOptions(open));
  EXPECT_EQ(server.api_key, "");
}

TEST(ConfigTest, ZmqTransportUriCarriesRetriesAndKeyVariable) {
  ScopedEnv key(kKeyVar, "token-123");
  ASSERT_OK_AND_ASSIGN(
      RefitConfig config,
      Parse(fmt::format("transport: zmq://?timeout_ms=2000\ntuning: {{zmq_retries: 7}}\n"
                        "http_refit_api_key_env_var: {}\n",
                        kKeyVar)));
  ASSERT_OK_AND_ASSIGN(std::string uri, ToTransportUri(config));
  EXPECT_EQ(uri, fmt::format("zmq://?timeout_ms=2000&retries=7&api_key_env={}", kKeyVar));
  // The real zmq factory accepts what the configuration produces.
  EXPECT_OK(MakeTransport(uri));

  // A key in the URI is left alone.
  config.transport = "zmq://?api_key=inline";
  ASSERT_OK_AND_ASSIGN(uri, ToTransportUri(config));
  EXPECT_EQ(uri, "zmq://?api_key=inline&retries=7");

  // Wrapped zmq gets the same parameters.
  config.transport = "fault+zmq://?seed=3";
  ASSERT_OK_AND_ASSIGN(uri, ToTransportUri(config));
  EXPECT_EQ(uri, fmt::format("fault+zmq://?seed=3&retries=7&api_key_env={}", kKeyVar));
}

TEST(ConfigTest, RetriesInTheUriAndInTuningAreOneSetting) {
  ASSERT_OK_AND_ASSIGN(RefitConfig config, Parse("transport: zmq://?retries=9\n"));
  EXPECT_EQ(config.tuning.zmq_retries, 9);
  ASSERT_OK_AND_ASSIGN(std::string uri, ToTransportUri(config));
  EXPECT_EQ(uri, "zmq://?retries=9");

  ASSERT_OK_AND_ASSIGN(config, Parse("transport: zmq://?retries=2\ntuning: {zmq_retries: 2}\n"));
  EXPECT_EQ(config.tuning.zmq_retries, 2);

  EXPECT_STATUS_MSG(InvalidArgument,
                    "test.yaml:2:10: tuning.zmq_retries: 2 contradicts retries=9 in the "
                    "transport URI",
                    Parse("transport: zmq://?retries=9\ntuning: {zmq_retries: 2}\n"));
  EXPECT_STATUS_MSG(InvalidArgument, "transport: retries=500 is outside [0, 100]",
                    Parse("transport: zmq://?retries=500\n"));

  // A flag that changes one side after parsing is caught when the URI is made.
  config.tuning.zmq_retries = 4;
  EXPECT_STATUS_MSG(InvalidArgument, "sets retries=2 but tuning.zmq_retries is 4",
                    ToTransportUri(config));
}

TEST(ConfigTest, LoadConfigFileNamesThePath) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / fmt::format("refit_config_test_{}", ::getpid());
  std::filesystem::create_directories(dir);
  const std::string missing = (dir / "missing.yaml").string();
  EXPECT_STATUS_MSG(NotFound, missing, LoadConfigFile(missing));
  EXPECT_STATUS_MSG(IoError, dir.string(), LoadConfigFile(dir.string()));

  const std::string good = (dir / "good.yaml").string();
  std::ofstream(good) << "tuning:\n  encode_workers: 3\n";
  ASSERT_OK_AND_ASSIGN(const RefitConfig config, LoadConfigFile(good));
  EXPECT_EQ(config.tuning.encode_workers, 3);

  const std::string bad = (dir / "bad.yaml").string();
  std::ofstream(bad) << "tuning:\n  encode_workers: 0\n";
  EXPECT_STATUS_MSG(InvalidArgument, bad + ":2:3: tuning.encode_workers", LoadConfigFile(bad));

  // A file far larger than any configuration (a model given by mistake) is refused unparsed.
  const std::string huge = (dir / "huge.yaml").string();
  const int fd = ::open(huge.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, off_t{17} << 20), 0);
  ::close(fd);
  EXPECT_STATUS_MSG(InvalidArgument, "exceeds", LoadConfigFile(huge));
  std::filesystem::remove_all(dir);
}

TEST(ConfigTest, ExampleFileParsesAndTheDocsShowIt) {
  const std::filesystem::path example = SourceRoot() / "examples" / "refit.yaml";
  ScopedEnv key("NRL_REFIT_API_KEY", "example-token");
  ASSERT_OK_AND_ASSIGN(const RefitConfig config, LoadConfigFile(example.string()));
  ASSERT_EQ(config.receivers.size(), 2u);
  EXPECT_EQ(config.receivers[1], (ReceiverConfig{"http://127.0.0.1:8082", "127.0.0.1:5556"}));
  EXPECT_EQ(config.http_refit_server_port, 8081);
  EXPECT_EQ(config.server.model, "/path/to/model.safetensors");
  ASSERT_OK_AND_ASSIGN(const std::string uri, ToTransportUri(config));
  EXPECT_EQ(uri, "zmq://?timeout_ms=10000&retries=3&api_key_env=NRL_REFIT_API_KEY");
  EXPECT_OK(MakeTransport(uri));
  ASSERT_OK_AND_ASSIGN(const ControlServerOptions server, ToControlServerOptions(config));
  EXPECT_EQ(server.api_key, "example-token");

  // Apart from the fleet, the API key variable, the control port and the model, every value in
  // the example is the default.
  RefitConfig defaults_but_those = config;
  defaults_but_those.receivers.clear();
  defaults_but_those.http_refit_api_key_env_var.clear();
  defaults_but_those.http_refit_server_port = 0;
  defaults_but_those.server.model.clear();
  defaults_but_those.transport = "zmq://";
  ExpectLibraryDefaults(defaults_but_those);

  const std::string docs = ReadText(SourceRoot() / "docs" / "configuration.md");
  const std::string example_text = ReadText(example);
  ASSERT_FALSE(example_text.empty());
  EXPECT_NE(docs.find(example_text), std::string::npos)
      << "docs/configuration.md must show examples/refit.yaml verbatim";
}

}  // namespace
}  // namespace refit::config
