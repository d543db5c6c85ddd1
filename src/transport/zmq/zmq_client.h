// The client side of zmq://: one DEALER's request/reply with retries (Connection), used by
// producers' senders and by relays forwarding to their children, and the TransportSender of a
// producer.
//
// A sender holds one DEALER per sending thread, connected to its producer's root relay
// endpoints[producer_id % n]. A DEALER presents the api key in the handshake (PLAIN) or its CURVE
// keys, and watches its handshake through a socket monitor, so a refused key is PermissionDenied
// at once and a failed handshake (wrong server key, a key or CURVE on one side only) is
// Unavailable after the retries, instead of a silent timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include "refit/payload.h"
#include "refit/status.h"
#include "refit/transport.h"
#include "transport/zmq/zmq_config.h"
#include "transport/zmq/zmq_curve.h"
#include "transport/zmq/zmq_frames.h"

namespace refit::internal::zmq {

/// One DEALER connected to one endpoint.
///
/// Thread-safety: used by one thread at a time; the context must outlive it.
class Connection {
 public:
  /// `curve`: the keys to present, or nullopt for a plain connection.
  Connection(void* context, std::string endpoint, const ZmqConfig& config,
             const std::optional<CurveClientKeys>& curve)
      : context_(context), endpoint_(std::move(endpoint)), config_(config), curve_(curve) {}

  using Deadline = std::optional<std::chrono::steady_clock::time_point>;

  /// Send `frames` and wait for the reply that matches `key`, retrying with backoff; every
  /// attempt, wait and backoff ends by `deadline` when one is given.
  /// Errors: the receiver's NACK; PermissionDenied when the relay refuses this client's api key
  /// or CURVE key in the handshake; DeadlineExceeded when no attempt got a reply, or at
  /// `deadline`; Unavailable (a failed handshake among them); Cancelled soon after `stop` is
  /// requested.
  Status Request(const std::vector<std::string_view>& frames, const ReplyKey& key,
                 const std::stop_token& stop = {}, Deadline deadline = std::nullopt);

  /// As above, for frames a relay received: each attempt sends a Share() of them, so the
  /// payload is not copied, however many children and attempts it takes.
  Status Request(const std::vector<Frame>& frames, const ReplyKey& key,
                 const std::stop_token& stop = {}, Deadline deadline = std::nullopt);

 private:
  // Sends one request on the DEALER it is given.
  using SendRequest = std::function<Status(void* socket)>;

  Status RequestWith(const SendRequest& send, const ReplyKey& key, const std::stop_token& stop,
                     Deadline deadline);
  Status Connect();
  void Disconnect();
  // The failure a monitor event reports (the monitor is readable).
  Status ReadHandshakeFailure();
  // One attempt of at most `timeout_ms`: the reply's verdict, or nullopt on timeout.
  Result<std::optional<Status>> Attempt(const SendRequest& send, const ReplyKey& key,
                                        const std::stop_token& stop, int timeout_ms);

  void* const context_;
  const std::string endpoint_;
  const ZmqConfig config_;
  const std::optional<CurveClientKeys> curve_;
  // The DEALER and the PAIR that receives its handshake failures; both set or both null.
  ZmqSocket socket_;
  ZmqSocket monitor_;
};

/// The sender of one producer: one Connection per sending thread to the producer's root relay.
/// `context` is the sender's own; its sockets close before it terminates.
std::unique_ptr<TransportSender> MakeZmqSender(ZmqContext context, ZmqConfig config,
                                               std::optional<CurveClientKeys> curve,
                                               SenderContext sender, PayloadLimits limits);

}  // namespace refit::internal::zmq
