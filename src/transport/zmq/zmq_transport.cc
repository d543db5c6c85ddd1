// zmq://[?timeout_ms=10000&retries=3&api_key=K|api_key_env=NAME&curve_…=FILE]: a ZeroMQ relay
// tree (the URI reference in docs/transports.md; the wire in docs/protocol.md).
//
// This file is the factory: it parses the URI and makes senders and relays. The concepts live
// beside it: the frames of refit-zmq/2 and the socket plumbing (zmq_frames.h), what a URI
// configures and the endpoint checks (zmq_config.h), CURVE keys and the ZAP handler
// (zmq_curve.h), the DEALER and a producer's sender (zmq_client.h), and the relay listener
// (zmq_relay.h).
#include <zmq.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "refit/transport.h"
#include "transport/transport_internal.h"
#include "transport/zmq/zmq_client.h"
#include "transport/zmq/zmq_config.h"
#include "transport/zmq/zmq_curve.h"
#include "transport/zmq/zmq_frames.h"
#include "transport/zmq/zmq_relay.h"
#include "util/environment.h"

namespace refit::internal {
namespace zmq {
namespace {

constexpr TransportCapabilities kZmqCapabilities{
    .staged_ack = true, .fan_out_tree = true, .reports_stream_end = true};

// An api key longer than this is a misconfiguration, not a key.
constexpr size_t kMaxApiKeyBytes = 1024;

class ZmqTransport final : public Transport {
 public:
  ZmqTransport(TransportUri uri, ZmqConfig config, TransportOptions options)
      : Transport(std::move(uri)), config_(std::move(config)), options_(options) {}

  TransportCapabilities capabilities() const override {
    TransportCapabilities capabilities = kZmqCapabilities;
    capabilities.encrypted = config_.curve.configured();
    return capabilities;
  }

  Result<std::unique_ptr<TransportSender>> MakeSender(const SenderContext& context) override {
    REFIT_RETURN_NOT_OK(CheckSenderContext(uri(), context));
    for (const std::string& endpoint : context.endpoints) {
      REFIT_RETURN_NOT_OK(CheckEndpoint(endpoint));
    }
    REFIT_ASSIGN_OR_RETURN(std::optional<CurveClientKeys> curve, LoadSenderKeys(config_.curve));
    ZmqContext zmq_context(zmq_ctx_new());
    if (zmq_context == nullptr) return Unavailable("zmq context: {}", ZmqError());
    return MakeZmqSender(std::move(zmq_context), config_, std::move(curve), context,
                         options_.limits);
  }

  Result<std::unique_ptr<Listener>> MakeListener(const ListenerContext& context,
                                                 PayloadSink& sink) override {
    REFIT_RETURN_NOT_OK(CheckEndpoint(context.endpoint, /*any_port=*/true));
    if (EndpointPort(context.endpoint) == "0" && !context.peers.empty()) {
      return InvalidArgument(
          "zmq listener {}: port 0 (the kernel's choice) cannot be named among static relay "
          "peers; leave peers empty (each transfer names its relay tree)",
          context.endpoint);
    }
    if (!context.bind_address.empty()) {
      REFIT_RETURN_NOT_OK(CheckBindAddress(context.bind_address)
                              .WithContext(fmt::format("zmq listener {}", context.endpoint)));
    }
    size_t self = 0;
    if (!context.peers.empty()) {
      for (const std::string& peer : context.peers) REFIT_RETURN_NOT_OK(CheckEndpoint(peer));
      const auto found = std::find(context.peers.begin(), context.peers.end(), context.endpoint);
      if (found == context.peers.end() ||
          std::count(context.peers.begin(), context.peers.end(), context.endpoint) != 1) {
        return InvalidArgument("zmq listener {}: must appear once among its {} relay peers",
                               context.endpoint, context.peers.size());
      }
      self = static_cast<size_t>(found - context.peers.begin());
    }
    REFIT_ASSIGN_OR_RETURN(std::optional<CurveServerKeys> curve, LoadListenerKeys(config_.curve));
    return MakeZmqRelay(config_, std::move(curve), context, self, sink, options_.limits);
  }

 private:
  const ZmqConfig config_;
  const TransportOptions options_;
};

Result<std::unique_ptr<Transport>> Make(const TransportUri& uri, const TransportOptions& options) {
  // Error messages name the URI; never with the key in it.
  TransportUri shown = uri;
  for (auto& [name, value] : shown.params) {
    if (name == kUriApiKeyParam) value = "<redacted>";
  }
  REFIT_RETURN_NOT_OK(
      CheckKnownParams(shown, {"timeout_ms", "retries", "api_key", "api_key_env", kSecretKeyParam,
                               kServerKeyParam, kAuthorizedKeysParam}));
  if (!uri.target.empty()) {
    return InvalidArgument(
        "transport URI '{}': zmq takes no target; each endpoint names its host:port",
        Printable(shown.ToString()));
  }
  ZmqConfig config;
  REFIT_ASSIGN_OR_RETURN(const uint64_t timeout_ms,
                         UintParam(shown, "timeout_ms", kDefaultTimeoutMs, kMaxTimeoutMs));
  REFIT_ASSIGN_OR_RETURN(const uint64_t retries,
                         UintParam(shown, "retries", kDefaultRetries, kMaxRetries));
  if (timeout_ms == 0) {
    return InvalidArgument("transport URI '{}': timeout_ms must be positive",
                           Printable(shown.ToString()));
  }
  config.timeout_ms = static_cast<int>(timeout_ms);
  config.retries = static_cast<int>(retries);
  const std::string* key = uri.Param(kUriApiKeyParam);
  const std::string* key_env = uri.Param(kUriApiKeyEnvParam);
  if (key != nullptr && key_env != nullptr) {
    return InvalidArgument("transport URI '{}': give api_key or api_key_env, not both",
                           Printable(shown.ToString()));
  }
  if (key != nullptr) config.api_key = *key;
  if (key_env != nullptr) {
    Result<std::string> value = SecretFromEnvironment(*key_env, "api_key_env");
    if (!value.ok()) {
      return value.status().WithContext(
          fmt::format("transport URI '{}'", Printable(shown.ToString())));
    }
    config.api_key = std::move(value).ValueOrDie();
  }
  if (config.api_key.size() > kMaxApiKeyBytes) {
    return InvalidArgument("transport URI '{}': api key of {} bytes exceeds {}",
                           Printable(shown.ToString()), config.api_key.size(), kMaxApiKeyBytes);
  }
  REFIT_ASSIGN_OR_RETURN(config.curve, CurveParams(shown));
  return std::unique_ptr<Transport>(std::make_unique<ZmqTransport>(uri, config, options));
}

}  // namespace
}  // namespace zmq

Result<std::unique_ptr<Transport>> MakeZmqTransport(const TransportUri& uri,
                                                    const TransportOptions& options) {
  return zmq::Make(uri, options);
}

}  // namespace refit::internal
