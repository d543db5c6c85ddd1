// The DEALER of zmq:// and a producer's sender (zmq_client.h).
#include "transport/zmq/zmq_client.h"

#include <zmq.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "transport/transport_internal.h"
#include "transport/zmq/zmq_messages.h"
#include "transport/zmq/zmq_zap.h"
#include "util/logging.h"
#include "util/mutex.h"

namespace refit::internal::zmq {
namespace {

// Backoff between attempts doubles from the first value up to the cap.
constexpr int kFirstBackoffMs = 50;
constexpr int kMaxBackoffMs = 500;

// Each DEALER's handshake monitor gets its own name: "<prefix><counter>".
constexpr std::string_view kMonitorPrefix = "inproc://refit-zmq-monitor-";
// A monitor event is two frames: event id (u16) and value (u32), then the endpoint.
constexpr size_t kMonitorEventFrames = 2;
constexpr size_t kMonitorEventBytes = 6;

// Why a handshake failed, from a monitor event: PermissionDenied when the relay refused this
// client's credentials (final), Unavailable otherwise (the next attempt may reach a relay that is
// ready). `curve`: the client presented CURVE keys; otherwise the api key (PLAIN), if any.
Status HandshakeFailure(uint16_t event, uint32_t value, const std::string& endpoint, bool curve) {
  if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
    if (curve) {
      return PermissionDenied(
          "zmq endpoint {} refused this client's CURVE key (ZAP status {}): list its public key "
          "in the relays' {}",
          endpoint, value, kAuthorizedKeysParam);
    }
    return PermissionDenied(
        "zmq endpoint {} refused this client's api key in the handshake (ZAP status {}): wrong "
        "api key",
        endpoint, value);
  }
  if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
    if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
      return Unavailable(
          "zmq endpoint {}: security mechanism mismatch in the handshake: an api key or CURVE is "
          "configured on one side only (this client: {})",
          endpoint, curve ? "CURVE" : "no CURVE");
    }
    return Unavailable("zmq endpoint {}: handshake failed with ZMTP protocol error {:#x}", endpoint,
                       value);
  }
  return Unavailable(
      "zmq endpoint {} closed the connection during the handshake ({} is not the relays' public "
      "key, or CURVE or an api key is configured on one side only?)",
      endpoint, kServerKeyParam);
}

class ZmqSender final : public TransportSender {
 public:
  ZmqSender(ZmqContext context, ZmqConfig config, std::optional<CurveClientKeys> curve,
            SenderContext sender, PayloadLimits limits)
      : TransportSender(std::move(sender), limits),
        zmq_context_(std::move(context)),
        config_(std::move(config)),
        curve_(std::move(curve)),
        tree_(std::make_shared<const std::vector<std::string>>(this->context().endpoints)),
        root_index_(this->context().producer_id % this->context().endpoints.size()),
        root_(this->context().endpoints[root_index_]) {}

  ~ZmqSender() override {
    // Sockets close before the context terminates (zmq_ctx_term waits for them).
    connections_.clear();
  }

  void CleanupThread() override {
    internal::MutexLock lock(mutex_);
    connections_.erase(std::this_thread::get_id());
  }

 private:
  Status Deliver(uint32_t payload_id, std::span<const std::byte> payload,
                 const PayloadHeader& /*header*/) override {
    const std::string root = U32Bytes(root_index_);
    const ReplyKey key{context().transfer_id.ToHex(), U32Bytes(context().producer_id),
                       U32Bytes(payload_id)};
    // Parts of at most kMaxFrameBytes, which is all a relay reads in one frame (zmq_frames.h).
    std::vector<std::string_view> frames{kProtocol, kKindData, config_.api_key, root};
    frames.reserve(kDataHeadFrames + PayloadParts(payload.size()));
    const std::string_view bytes = AsText(payload);
    for (size_t offset = 0; offset < bytes.size(); offset += kMaxFrameBytes) {
      frames.push_back(bytes.substr(offset, kMaxFrameBytes));
    }
    if (bytes.empty()) frames.push_back(bytes);
    return SendToTree(frames, key)
        .WithContext(fmt::format("sending payload {} of producer {} to root relay {}", payload_id,
                                 context().producer_id, root_));
  }

  Status EndStream(uint64_t payloads) override {
    const std::string root = U32Bytes(root_index_);
    const auto& id = context().transfer_id.bytes;
    const std::string transfer(reinterpret_cast<const char*>(id.data()), id.size());
    const std::string producer = U32Bytes(context().producer_id);
    const std::string count = U32Bytes(static_cast<uint32_t>(payloads));
    const ReplyKey key{context().transfer_id.ToHex(), producer, ""};
    REFIT_RETURN_NOT_OK(
        SendToTree({kProtocol, kKindFlush, config_.api_key, root, transfer, producer, count}, key)
            .WithContext(fmt::format("finishing producer {} ({} payloads) at root relay {}",
                                     context().producer_id, payloads, root_)));
    return Status::OK();
  }

  // Send to the root relay, or around it and any relay below it that is gone (a receiver that
  // died during the transfer): its children's subtrees get the request directly, with the same
  // root in its frames, so their relays forward it as they would have.
  Status SendToTree(const std::vector<std::string_view>& frames, const ReplyKey& key) {
    Status gone;
    REFIT_ASSIGN_OR_RETURN(const size_t reached,
                           RequestAroundUnreachable(
                               TreeBranch{tree_, root_index_, {0}},
                               [&](const std::string& endpoint, bool* is_gone) {
                                 Connection& connection = ThreadConnection(endpoint);
                                 Status status =
                                     connection.Request(frames, key, {}, context().deadline);
                                 *is_gone = connection.unreachable();
                                 if (*is_gone) gone = status;
                                 return status;
                               },
                               unreachable_));
    if (reached == 0) {
      return Unavailable("no relay of the tree of {} accepts connections{}", tree_->size(),
                         gone.ok() ? std::string() : "; the last: " + gone.ToString());
    }
    return Status::OK();
  }

  // The calling thread's connection to `endpoint` (the root, or a relay below a gone one); only
  // this thread uses it until CleanupThread.
  Connection& ThreadConnection(const std::string& endpoint) {
    internal::MutexLock lock(mutex_);
    std::unique_ptr<Connection>& connection = connections_[std::this_thread::get_id()][endpoint];
    if (connection == nullptr) {
      connection = std::make_unique<Connection>(zmq_context_.get(), endpoint, config_, curve_);
    }
    return *connection;
  }

  const ZmqContext zmq_context_;
  const ZmqConfig config_;
  const std::optional<CurveClientKeys> curve_;
  const std::shared_ptr<const std::vector<std::string>> tree_;
  const uint32_t root_index_;
  const std::string root_;
  UnreachableRelays unreachable_;
  internal::Mutex mutex_;
  std::map<std::thread::id, std::map<std::string, std::unique_ptr<Connection>>> connections_
      REFIT_GUARDED_BY(mutex_);
};

}  // namespace

Status Connection::Request(const std::vector<std::string_view>& frames, const ReplyKey& key,
                           const std::stop_token& stop, Deadline deadline) {
  return RequestWith([&](void* socket) { return SendFrames(socket, frames, endpoint_); }, key, stop,
                     deadline);
}

Status Connection::Request(const std::vector<Frame>& frames, const ReplyKey& key,
                           const std::stop_token& stop, Deadline deadline) {
  return RequestWith([&](void* socket) { return SendSharedFrames(socket, frames, endpoint_); }, key,
                     stop, deadline);
}

Status Connection::RequestWith(const SendRequest& send, const ReplyKey& key,
                               const std::stop_token& stop, Deadline deadline) {
  // The time left before `deadline`, in whole milliseconds (the configured timeout without one).
  const auto left_ms = [&]() -> int64_t {
    if (!deadline.has_value()) return config_.timeout_ms;
    return std::chrono::duration_cast<std::chrono::milliseconds>(*deadline -
                                                                 std::chrono::steady_clock::now())
        .count();
  };
  Status last;
  const auto past_deadline = [&](int attempts) {
    // The transfer's failure, not the endpoint's: nothing is routed around a deadline.
    unreachable_ = false;
    return DeadlineExceeded("zmq endpoint {}: the transfer's deadline passed after {} attempt(s){}",
                            endpoint_, attempts,
                            last.ok() ? std::string() : "; the last: " + last.ToString());
  };
  int backoff_ms = kFirstBackoffMs;
  unreachable_ = false;
  for (int attempt = 0; attempt <= config_.retries; ++attempt) {
    if (attempt > 0) {
      if (deadline.has_value() && left_ms() <= backoff_ms) return past_deadline(attempt);
      std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
      backoff_ms = std::min(2 * backoff_ms, kMaxBackoffMs);
    }
    if (stop.stop_requested()) return Cancelled("request to zmq endpoint {}", endpoint_);
    const int64_t left = left_ms();
    if (left <= 0) return past_deadline(attempt);
    const int timeout_ms = static_cast<int>(std::min<int64_t>(config_.timeout_ms, left));
    unreachable_ = false;
    Result<std::optional<Status>> reply = Attempt(send, key, stop, timeout_ms);
    if (!reply.ok()) {
      last = reply.status();
      // A fresh socket drops what the old one queued and any reply still on its way.
      Disconnect();
      continue;
    }
    if (reply->has_value()) return **reply;
    last = DeadlineExceeded("no reply from zmq endpoint {} within {} ms", endpoint_, timeout_ms);
    Disconnect();
  }
  return last.WithContext(
      fmt::format("zmq endpoint {}, {} attempts", endpoint_, config_.retries + 1));
}

Status Connection::Connect() {
  if (socket_ != nullptr) return Status::OK();
  ZmqSocket socket(zmq_socket(context_, ZMQ_DEALER));
  ZmqSocket monitor(zmq_socket(context_, ZMQ_PAIR));
  if (socket == nullptr || monitor == nullptr) {
    return Unavailable("zmq DEALER for {}: {}", endpoint_, ZmqError());
  }
  const int linger = 0;
  for (void* s : {socket.get(), monitor.get()}) {
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
  }
  // A DEALER blocks a send while it has no connection to queue on, which is the case once a
  // refused handshake took the pending one down: bound the send like the reply.
  zmq_setsockopt(socket.get(), ZMQ_SNDTIMEO, &config_.timeout_ms, sizeof(config_.timeout_ms));
  if (curve_.has_value()) {
    REFIT_RETURN_NOT_OK(SetCurveKey(socket.get(), ZMQ_CURVE_SERVERKEY, curve_->server_key));
    REFIT_RETURN_NOT_OK(SetCurveKey(socket.get(), ZMQ_CURVE_PUBLICKEY, curve_->own.public_key));
    REFIT_RETURN_NOT_OK(SetCurveKey(socket.get(), ZMQ_CURVE_SECRETKEY, curve_->own.secret_key));
  } else if (!config_.api_key.empty()) {
    // A keyed relay without CURVE admits PLAIN clients holding the key (zmq_zap.h).
    const std::string password = PlainPassword(config_.api_key);
    if (zmq_setsockopt(socket.get(), ZMQ_PLAIN_USERNAME, kPlainUsername.data(),
                       kPlainUsername.size()) != 0 ||
        zmq_setsockopt(socket.get(), ZMQ_PLAIN_PASSWORD, password.data(), password.size()) != 0) {
      return Unavailable("zmq PLAIN credentials for {}: {}", endpoint_, ZmqError());
    }
  }
  // Watch the handshake: a refused key or a mechanism mismatch would otherwise look like a
  // silent relay until the timeout. The monitor is connected before the DEALER, so it sees
  // every event.
  static std::atomic<uint64_t> next_monitor{0};
  const std::string monitor_endpoint = fmt::format("{}{}", kMonitorPrefix, next_monitor++);
  if (zmq_socket_monitor(socket.get(), monitor_endpoint.c_str(),
                         ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                             ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                             ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_CONNECT_RETRIED |
                             ZMQ_EVENT_DISCONNECTED) != 0 ||
      zmq_connect(monitor.get(), monitor_endpoint.c_str()) != 0) {
    return Unavailable("zmq handshake monitor for {}: {}", endpoint_, ZmqError());
  }
  if (zmq_connect(socket.get(), TcpAddress(endpoint_).c_str()) != 0) {
    return Unavailable("zmq connect to {}: {}", endpoint_, ZmqError());
  }
  socket_ = std::move(socket);
  monitor_ = std::move(monitor);
  return Status::OK();
}

void Connection::Disconnect() {
  socket_.reset();
  monitor_.reset();
  handshake_done_ = false;
}

Status Connection::ReadMonitorEvent() {
  REFIT_ASSIGN_OR_RETURN(const std::vector<std::string> event,
                         ReceiveFrames(monitor_.get(), kMonitorEventFrames));
  if (event.empty() || event[0].size() != kMonitorEventBytes) {
    return Unavailable("zmq endpoint {}: malformed handshake monitor event", endpoint_);
  }
  uint16_t id = 0;
  std::memcpy(&id, event[0].data(), sizeof(id));
  const std::optional<uint32_t> value = ReadU32(std::string_view(event[0]).substr(sizeof(id)));
  if (id == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
    handshake_done_ = true;
    return Status::OK();
  }
  // A TCP connect that failed (refused: nothing listens there; or unreachable), or an
  // established connection the other end closed: the receiver is gone, not slow.
  if (id == ZMQ_EVENT_CONNECT_RETRIED) {
    unreachable_ = true;
    return Unavailable(
        "zmq endpoint {}: nothing accepts connections there (refused or "
        "unreachable)",
        endpoint_);
  }
  if (id == ZMQ_EVENT_DISCONNECTED && handshake_done_) {
    unreachable_ = true;
    return Unavailable("zmq endpoint {} closed the connection", endpoint_);
  }
  return HandshakeFailure(id, value.value_or(0), endpoint_, curve_.has_value());
}

std::optional<Status> Connection::PollMonitor() {
  while (true) {
    zmq_pollitem_t item{monitor_.get(), 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, 0) <= 0) return std::nullopt;
    Status event = ReadMonitorEvent();
    if (!event.ok()) return event;
  }
}

Result<std::optional<Status>> Connection::Attempt(const SendRequest& send, const ReplyKey& key,
                                                  const std::stop_token& stop, int timeout_ms) {
  REFIT_RETURN_NOT_OK(Connect());
  // A send blocks while the DEALER has no connection to queue on: bound it like the reply.
  zmq_setsockopt(socket_.get(), ZMQ_SNDTIMEO, &timeout_ms, sizeof(timeout_ms));
  if (Status sent = send(socket_.get()); !sent.ok()) {
    // Not taken within the timeout: most likely the handshake or the connect failed, which the
    // monitor says.
    if (std::optional<Status> failure = PollMonitor()) {
      Disconnect();
      if (failure->code() == StatusCode::kPermissionDenied) return std::optional<Status>(failure);
      return *failure;
    }
    return sent;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::optional<Status>();
    if (stop.stop_requested()) return Cancelled("request to zmq endpoint {}", endpoint_);
    std::array<zmq_pollitem_t, 2> items{
        {{socket_.get(), 0, ZMQ_POLLIN, 0}, {monitor_.get(), 0, ZMQ_POLLIN, 0}}};
    // Wake up at least every kStopCheckMs to notice a stop request.
    const int ready = zmq_poll(items.data(), items.size(),
                               static_cast<long>(std::min<int64_t>(left.count(), kStopCheckMs)));
    if (ready < 0) {
      if (zmq_errno() == EINTR) continue;
      return Unavailable("zmq poll on {}: {}", endpoint_, ZmqError());
    }
    if ((items[1].revents & ZMQ_POLLIN) != 0) {
      if (std::optional<Status> failure = PollMonitor()) {
        // The connection is dead either way (libzmq does not retry a refused key).
        Disconnect();
        // A refused key stays refused: final, like a NACK. Anything else is this attempt's.
        if (failure->code() == StatusCode::kPermissionDenied) {
          return std::optional<Status>(failure);
        }
        return *failure;
      }
    }
    if ((items[0].revents & ZMQ_POLLIN) == 0) continue;
    REFIT_ASSIGN_OR_RETURN(std::vector<std::string> reply,
                           ReceiveFrames(socket_.get(), kReplyFrames));
    // Not ours (another protocol, a reply naming another request): keep waiting.
    if (std::optional<Status> answer = ReadReply(reply, key, endpoint_)) return answer;
  }
}

Result<size_t> RequestAroundUnreachable(
    const TreeBranch& branch, const std::function<Status(const std::string&, bool*)>& request,
    UnreachableRelays& unreachable) {
  const size_t n = branch.endpoints->size();
  // Depth first, in tree order: a gone relay's children take its place in the walk.
  std::vector<size_t> pending(branch.positions.rbegin(), branch.positions.rend());
  size_t reached = 0;
  while (!pending.empty()) {
    const size_t position = pending.back();
    pending.pop_back();
    const std::string& endpoint = branch.Endpoint(position);
    if (!unreachable.Contains(endpoint)) {
      bool is_gone = false;
      Status status = request(endpoint, &is_gone);
      if (status.ok()) {
        ++reached;
        continue;
      }
      if (!is_gone) return status;
      if (unreachable.Add(endpoint)) {
        REFIT_LOG_WARN(
            "zmq: relay {} is unreachable ({}): its subtree is reached around it, and "
            "it misses this transfer",
            endpoint, status.message());
      }
    }
    for (const size_t child : {2 * position + 2, 2 * position + 1}) {
      if (child < n) pending.push_back(child);
    }
  }
  return reached;
}

std::unique_ptr<TransportSender> MakeZmqSender(ZmqContext context, ZmqConfig config,
                                               std::optional<CurveClientKeys> curve,
                                               SenderContext sender, PayloadLimits limits) {
  return std::make_unique<ZmqSender>(std::move(context), std::move(config), std::move(curve),
                                     std::move(sender), limits);
}

}  // namespace refit::internal::zmq
