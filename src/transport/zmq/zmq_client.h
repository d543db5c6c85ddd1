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
#include <set>
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
#include "util/mutex.h"

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

  /// Whether the last Request failed because the endpoint could not be reached on its last
  /// attempt — nothing accepted the connection there, or the other end closed an established
  /// one: a receiver that is gone, not one that is slow or said no.
  bool unreachable() const { return unreachable_; }

 private:
  // Sends one request on the DEALER it is given.
  using SendRequest = std::function<Status(void* socket)>;

  Status RequestWith(const SendRequest& send, const ReplyKey& key, const std::stop_token& stop,
                     Deadline deadline);
  Status Connect();
  void Disconnect();
  // The failure a monitor event reports (the monitor is readable): OK for a completed handshake.
  Status ReadMonitorEvent();
  // The first failure among the monitor's pending events, if any.
  std::optional<Status> PollMonitor();
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
  // The socket's handshake completed: a disconnect after it is the other end going away.
  bool handshake_done_ = false;
  // See unreachable().
  bool unreachable_ = false;
};

/// Where one request goes in a transfer's relay tree: the heap over `endpoints` rooted at index
/// `root` (position p forwards to 2p + 1 and 2p + 2), and the positions whose subtrees the
/// request is for (a sender: the root's, 0; a relay: its children's).
struct TreeBranch {
  std::shared_ptr<const std::vector<std::string>> endpoints;
  size_t root = 0;
  std::vector<size_t> positions;

  const std::string& Endpoint(size_t position) const {
    return (*endpoints)[(position + root) % endpoints->size()];
  }
};

/// The relays of one transfer found unreachable, shared by the threads that send or forward for
/// it.
class UnreachableRelays {
 public:
  bool Contains(const std::string& endpoint) const {
    internal::MutexLock lock(mutex_);
    return endpoints_.contains(endpoint);
  }
  /// Returns whether `endpoint` was not known unreachable yet.
  bool Add(const std::string& endpoint) {
    internal::MutexLock lock(mutex_);
    return endpoints_.insert(endpoint).second;
  }

 private:
  mutable internal::Mutex mutex_;
  std::set<std::string> endpoints_ REFIT_GUARDED_BY(mutex_);
};

/// Send one request to the relay at each of `branch.positions` through `request(endpoint,
/// &gone)`, which sets `gone` when its failure was the relay being unreachable
/// (Connection::unreachable). A relay that is gone is routed around: the request goes to its
/// children's subtrees instead, and its endpoint joins `unreachable`, which later requests of the
/// transfer skip at once (it missed a payload, so its flush fails whatever follows). One dead
/// receiver thus costs the transfer that receiver alone — under a quorum it is fenced — instead of
/// its whole subtree (docs/protocol.md, "Relay tree"). Returns the number of relays the request
/// reached (0 when every relay of the branch is gone: they fail their flush, not this request);
/// errors: the first failure of a relay that was reached (a NACK, a deadline).
Result<size_t> RequestAroundUnreachable(
    const TreeBranch& branch, const std::function<Status(const std::string&, bool*)>& request,
    UnreachableRelays& unreachable);

/// The sender of one producer: one Connection per sending thread to the producer's root relay.
/// `context` is the sender's own; its sockets close before it terminates.
std::unique_ptr<TransportSender> MakeZmqSender(ZmqContext context, ZmqConfig config,
                                               std::optional<CurveClientKeys> curve,
                                               SenderContext sender, PayloadLimits limits);

}  // namespace refit::internal::zmq
