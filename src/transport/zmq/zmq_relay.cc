// The relay listener of zmq:// (zmq_relay.h).
#include "transport/zmq/zmq_relay.h"

#include <malloc.h>
#include <zmq.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/api_key.h"
#include "refit/status_format.h"
#include "transport/transport_internal.h"
#include "transport/zmq/zmq_client.h"
#include "transport/zmq/zmq_frames.h"
#include "transport/zmq/zmq_messages.h"
#include "transport/zmq/zmq_zap.h"
#include "util/mutex.h"

namespace refit::internal::zmq {
namespace {

const char* const kReplyInbox = "inproc://refit-zmq-replies";

// How many transfers a relay remembers stream seals and staged checksums for. Transfers run one
// at a time per receiver; older ones are refused by the session itself, which remembers its
// finished transfers.
constexpr size_t kSealedTransfers = kRememberedTransfers;
// Producers per transfer whose streams a relay remembers (and whose stream ends it hands to its
// sink): far more than a fleet has trainer ranks, few enough that forged producer ids cannot
// grow a relay's memory without bound (about 100 bytes per stream, a few MiB per transfer).
constexpr size_t kMaxStreamsPerTransfer = size_t{1} << 16;
// Requests for one payload that may wait for its forward in flight. It reaches a relay from one
// upstream (its sender or parent relay), which makes at most kMaxRetries + 1 attempts.
constexpr size_t kMaxWaitingDuplicates = kMaxRetries + 1;
// Complete requests ZeroMQ queues per upstream connection before it stops reading it. An honest
// upstream (a sender's DEALER, a parent relay's) has one request outstanding: it waits for the
// reply, and replaces its socket after a timeout. One more leaves room for nothing but a
// misbehaving peer's next request.
constexpr int kMaxQueuedRequests = 2;
// A forward's job id, which travels with its reply from the forwarding thread to the I/O thread.
constexpr size_t kJobIdBytes = sizeof(uint64_t);
// Connections the forwarding thread keeps open: a relay has two children per tree (one tree per
// root), and a few trees in turn while the fleet changes.
constexpr size_t kMaxIdleConnections = 16;
// How long a connection may take from its accept to a completed handshake (ZMQ_HANDSHAKE_IVL;
// libzmq's default is 30 s). A handshake is a few round trips and one ZAP reply: 5 s is ample
// across data centres, and bounds how long a peer that never finishes one holds its connection.
constexpr int kHandshakeTimeoutMs = 5'000;
// The listen backlog (ZMQ_BACKLOG; libzmq's default is 100, which a connect flood overflows);
// the kernel caps it at net.core.somaxconn.
constexpr int kListenBacklog = 4096;
// Returning memory after a flood of connections: once at least kTrimAfterClosedConnections
// connections closed since the last trim and none closed or opened for kTrimQuietMs, the I/O
// thread hands the allocator's free memory back to the system (malloc_trim). libzmq frees what a
// connection held, but the allocator keeps freed blocks for reuse, which after thousands of
// refused handshakes kept tens of MB resident for good.
constexpr uint64_t kTrimAfterClosedConnections = 64;
constexpr int64_t kTrimQuietMs = 1'000;
const char* const kConnectionMonitor = "inproc://refit-zmq-relay-connections";
// A socket monitor event (libzmq 4.x): a u16 event id and a u32 value, then the endpoint.
constexpr size_t kMonitorEventFrames = 2;
constexpr size_t kMonitorEventBytes = 6;

// A request that must reach the children before its upstream reply.
struct ForwardJob {
  // Numbers the forward, so that its outcome finds the payload and the requests waiting on it.
  uint64_t id = 0;
  std::string identity;
  // The request's frames without the identity; the payload frame is the one the relay received.
  std::vector<Frame> request;
  ReplyKey key;
  // The relays below this one in the request's tree: its children, and theirs in place of any
  // that is gone (RequestAroundUnreachable).
  TreeBranch children;
};

// The relay tree of a transfer as this relay sees it: every relay's endpoint in tree order, and
// this relay's position among them (no endpoints: a tree of its own, with no children).
struct TreeView {
  std::shared_ptr<const std::vector<std::string>> endpoints;
  size_t self = 0;

  size_t relays() const { return std::max<size_t>(endpoints->size(), 1); }
};

// A payload a relay's sink staged (accepted or duplicate), and how far its subtree has it.
struct StagedPayload {
  // The header checksum: a copy with another one is not this payload.
  std::array<uint8_t, 16> checksum{};
  // The root of the tree whose subtree below this relay ACKed the payload (or in which this
  // relay is a leaf), if any: a duplicate of that tree is ACKed at once.
  std::optional<uint32_t> acked_root = std::nullopt;
  // The forward in flight (its job id and the root of its tree), if any.
  std::optional<std::pair<uint64_t, uint32_t>> forwarding = std::nullopt;
};

// What a relay staged of one producer's stream in one transfer, and whether the stream ended.
struct StreamRecord {
  // The stream end was handed to the sink: later payloads are refused (see "Seal" above).
  bool sealed = false;
  // Each payload id the sink staged.
  std::map<uint32_t, StagedPayload> staged;
};

// A payload's forward in flight, and the identities of the duplicates waiting for its verdict.
struct PendingForward {
  TransferId transfer_id;
  uint32_t producer_id = 0;
  uint32_t payload_id = 0;
  std::vector<std::string> waiting;
};

class ZmqListener final : public Listener {
 public:
  // `curve`: the relay's CURVE keys, or nullopt for a plain relay.
  ZmqListener(ZmqConfig config, std::optional<CurveServerKeys> curve, ListenerContext context,
              size_t self, PayloadSink& sink, PayloadLimits limits)
      : config_(std::move(config)),
        api_key_(config_.api_key),
        curve_(std::move(curve)),
        bind_(context.bind_address.empty()
                  ? context.endpoint
                  : fmt::format("{}:{}", context.bind_address, EndpointPort(context.endpoint))),
        endpoint_(std::move(context.endpoint)),
        static_tree_{std::make_shared<const std::vector<std::string>>(std::move(context.peers)),
                     self},
        sink_(sink),
        limits_(limits) {}

  ~ZmqListener() override { Stop(); }

  Status Start() override {
    internal::MutexLock lock(lifecycle_mutex_);
    if (started_ || stopped_) {
      return FailedPrecondition("zmq listener at {} was started or stopped before", endpoint_);
    }
    started_ = true;
    context_.reset(zmq_ctx_new());
    if (context_ == nullptr) return Unavailable("zmq context for {}: {}", endpoint_, ZmqError());
    router_.reset(zmq_socket(context_.get(), ZMQ_ROUTER));
    replies_in_.reset(zmq_socket(context_.get(), ZMQ_PULL));
    replies_out_.reset(zmq_socket(context_.get(), ZMQ_PUSH));
    if (router_ == nullptr || replies_in_ == nullptr || replies_out_ == nullptr) {
      return Unavailable("zmq sockets for {}: {}", endpoint_, ZmqError());
    }
    const int linger = 0;
    for (void* socket : {router_.get(), replies_in_.get(), replies_out_.get()}) {
      zmq_setsockopt(socket, ZMQ_LINGER, &linger, sizeof(linger));
    }
    // A keyed or CURVE-listed relay refuses unauthenticated peers in the handshake
    // (SetUpSecurity), before they can send a message. What a peer can make the relay hold
    // before that is what libzmq reads of its handshake: commands are frames, read whole, so
    // ZMQ_MAXMSGSIZE (every frame at most kMaxFrameBytes: payloads travel in parts) bounds each
    // one, and ZMQ_HANDSHAKE_IVL how long a connection may stay unauthenticated. ZeroMQ reads
    // whole messages before the relay sees their first frame, so the frame limit and
    // kMaxQueuedRequests complete requests per connection (ZMQ_RCVHWM, after which ZeroMQ stops
    // reading that connection until the relay has taken one) bound what an admitted peer, or any
    // peer of an open relay, can make it hold. The backlog lets a burst of connects queue in the
    // kernel instead of being dropped (a dropped SYN costs a client a second).
    const int64_t max_frame = static_cast<int64_t>(kMaxFrameBytes);
    const int queued = kMaxQueuedRequests;
    const int handshake_ms = kHandshakeTimeoutMs;
    const int backlog = kListenBacklog;
    if (zmq_setsockopt(router_.get(), ZMQ_MAXMSGSIZE, &max_frame, sizeof(max_frame)) != 0 ||
        zmq_setsockopt(router_.get(), ZMQ_RCVHWM, &queued, sizeof(queued)) != 0 ||
        zmq_setsockopt(router_.get(), ZMQ_HANDSHAKE_IVL, &handshake_ms, sizeof(handshake_ms)) !=
            0 ||
        zmq_setsockopt(router_.get(), ZMQ_BACKLOG, &backlog, sizeof(backlog)) != 0) {
      return Unavailable("zmq listener {}: receive limits: {}", endpoint_, ZmqError());
    }
    REFIT_RETURN_NOT_OK(SetUpSecurity());
    REFIT_RETURN_NOT_OK(WatchConnections());
    if (zmq_bind(router_.get(), TcpAddress(bind_).c_str()) != 0) {
      const bool taken = zmq_errno() == EADDRINUSE;
      const std::string error = ZmqError();
      const std::string where =
          bind_ == endpoint_ ? endpoint_ : fmt::format("{} (endpoint {})", bind_, endpoint_);
      if (taken) return AlreadyExists("zmq listener: endpoint {} is taken: {}", where, error);
      return Unavailable("zmq listener: bind {}: {}", where, error);
    }
    if (EndpointPort(endpoint_) == "0") {
      // Port 0: the kernel chose one as it bound (no probe to race); the endpoint names it from
      // here on. The threads that read endpoint_ start below.
      char bound[256] = {};
      size_t size = sizeof(bound);
      if (zmq_getsockopt(router_.get(), ZMQ_LAST_ENDPOINT, bound, &size) != 0) {
        return Unavailable("zmq listener {}: the bound port: {}", endpoint_, ZmqError());
      }
      const std::string_view last(bound);
      endpoint_ = fmt::format("{}:{}", std::string_view(endpoint_).substr(0, endpoint_.rfind(':')),
                              last.substr(last.rfind(':') + 1));
    }
    if (zmq_bind(replies_in_.get(), kReplyInbox) != 0 ||
        zmq_connect(replies_out_.get(), kReplyInbox) != 0) {
      return Unavailable("zmq listener {}: reply channel: {}", endpoint_, ZmqError());
    }
    io_thread_ = std::jthread([this](std::stop_token stop) {
      NameCurrentThread("refit-zmq-relay");
      ServeLoop(stop);
    });
    forward_thread_ = std::jthread([this](std::stop_token stop) {
      NameCurrentThread("refit-zmq-fwd");
      ForwardLoop(stop);
    });
    if (zap_ != nullptr) {
      zap_thread_ = std::jthread([this](std::stop_token stop) {
        NameCurrentThread("refit-zmq-zap");
        ServeZap(
            zap_.get(), admit_, endpoint_,
            [this](const Status& failure) { RecordFailure(failure); }, stop);
      });
    }
    return Status::OK();
  }

  void Stop() override {
    internal::MutexLock lock(lifecycle_mutex_);
    if (stopped_) return;
    stopped_ = true;
    // Request every stop before joining any: the I/O thread's sink call, the forwarder's queue
    // wait and requests, and the ZAP handler's poll all watch their own stop tokens.
    io_thread_.request_stop();
    forward_thread_.request_stop();
    zap_thread_.request_stop();
    for (std::jthread* thread : {&io_thread_, &forward_thread_, &zap_thread_}) {
      if (thread->joinable()) thread->join();
    }
    if (router_ != nullptr) zmq_socket_monitor(router_.get(), nullptr, 0);
    monitor_.reset();
    router_.reset();
    replies_in_.reset();
    replies_out_.reset();
    zap_.reset();
    context_.reset();
  }

  ListenerStats stats() const override {
    internal::MutexLock lock(stats_mutex_);
    return stats_;
  }

  const std::string& endpoint() const override { return endpoint_; }

  Status RouteTransfer(const TransferId& transfer_id, const RelayTree& tree) override {
    const auto where = [&] {
      return fmt::format("zmq relay {}: relay tree of transfer {}", endpoint_, transfer_id.ToHex());
    };
    if (tree.endpoints.empty() || tree.position >= tree.endpoints.size()) {
      return InvalidArgument("{}: position {} is not among its {} endpoints", where(),
                             tree.position, tree.endpoints.size());
    }
    std::set<std::string_view> seen;
    for (const std::string& endpoint : tree.endpoints) {
      REFIT_RETURN_NOT_OK(CheckEndpoint(endpoint).WithContext(where()));
      if (!seen.insert(endpoint).second) {
        return InvalidArgument("{}: names {} more than once", where(), endpoint);
      }
    }
    TreeView view{std::make_shared<const std::vector<std::string>>(tree.endpoints), tree.position};
    internal::MutexLock lock(trees_mutex_);
    const auto it = std::find_if(trees_.begin(), trees_.end(),
                                 [&](const auto& entry) { return entry.first == transfer_id; });
    if (it != trees_.end()) {
      // A prepare sent again (a retry) names its tree again; the latest word holds.
      it->second = std::move(view);
      return Status::OK();
    }
    if (trees_.size() == kSealedTransfers) trees_.erase(trees_.begin());
    trees_.emplace_back(transfer_id, std::move(view));
    return Status::OK();
  }

 private:
  // The tree `transfer`'s payloads take: the one its prepare named, else the static peers list.
  TreeView TreeOf(const TransferId& transfer) const {
    internal::MutexLock lock(trees_mutex_);
    for (const auto& [id, view] : trees_) {
      if (id == transfer) return view;
    }
    return static_tree_;
  }

  // Errors: InvalidArgument when `root` is not a relay of `tree`.
  Status CheckRoot(const TreeView& tree, uint32_t root) const {
    if (root >= tree.relays()) {
      return InvalidArgument("zmq listener {}: root relay index {} is not one of {} relays",
                             endpoint_, root, tree.relays());
    }
    return Status::OK();
  }

  void RecordFailure(const Status& status) {
    internal::MutexLock lock(stats_mutex_);
    ++stats_.failures;
    stats_.last_error = status;
  }

  // Authenticate in the handshake, before a peer can send a message: a CURVE relay admits the
  // listed client keys (curve_authorized_keys), a keyed relay without CURVE admits PLAIN clients
  // holding the api key (zmq_zap.h). The ZAP handler is bound before the ROUTER accepts anyone:
  // libzmq admits every client while no handler is bound. A CURVE relay without listed keys
  // admits whoever knows the (public) server key; its api key is checked in each request.
  Status SetUpSecurity() {
    const auto fail = [this](std::string_view what) {
      return Unavailable("zmq listener {}: {}: {}", endpoint_, what, ZmqError());
    };
    const int on = 1;
    if (curve_.has_value()) {
      if (zmq_setsockopt(router_.get(), ZMQ_CURVE_SERVER, &on, sizeof(on)) != 0) {
        return fail("CURVE server");
      }
      REFIT_RETURN_NOT_OK(SetCurveKey(router_.get(), ZMQ_CURVE_SECRETKEY, curve_->fleet.secret_key)
                              .WithContext(fmt::format("zmq listener {}", endpoint_)));
      if (!curve_->authorized.has_value()) return Status::OK();
      admit_ = AdmitCurveKeys(*curve_->authorized, endpoint_);
    } else if (!config_.api_key.empty()) {
      if (zmq_setsockopt(router_.get(), ZMQ_PLAIN_SERVER, &on, sizeof(on)) != 0) {
        return fail("PLAIN server");
      }
      admit_ = AdmitApiKey(config_.api_key, endpoint_);
    } else {
      return Status::OK();
    }
    REFIT_ASSIGN_OR_RETURN(zap_, BindZapHandler(context_.get(), endpoint_));
    return Status::OK();
  }

  // Watch the ROUTER's connections come and go (a socket monitor, read by the I/O thread), so
  // that memory is returned after a flood of them (TrimAfterFlood).
  Status WatchConnections() {
    monitor_.reset(zmq_socket(context_.get(), ZMQ_PAIR));
    const int linger = 0;
    if (monitor_ == nullptr ||
        zmq_setsockopt(monitor_.get(), ZMQ_LINGER, &linger, sizeof(linger)) != 0 ||
        zmq_socket_monitor(router_.get(), kConnectionMonitor,
                           ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED) != 0 ||
        zmq_connect(monitor_.get(), kConnectionMonitor) != 0) {
      return Unavailable("zmq listener {}: connection monitor: {}", endpoint_, ZmqError());
    }
    return Status::OK();
  }

  // Read the monitor's pending events (the I/O thread's).
  void CountConnectionEvents() {
    while (true) {
      zmq_pollitem_t item{monitor_.get(), 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, 0) <= 0) return;
      Result<std::vector<std::string>> event = ReceiveFrames(monitor_.get(), kMonitorEventFrames);
      if (!event.ok() || event->empty() || (*event)[0].size() != kMonitorEventBytes) return;
      uint16_t id = 0;
      std::memcpy(&id, (*event)[0].data(), sizeof(id));
      if (id == ZMQ_EVENT_DISCONNECTED) ++closed_since_trim_;
      last_connection_event_ = std::chrono::steady_clock::now();
    }
  }

  // Return the allocator's free memory to the system once a burst of connections is over (see
  // kTrimAfterClosedConnections).
  void TrimAfterFlood() {
    if (closed_since_trim_ < kTrimAfterClosedConnections ||
        std::chrono::steady_clock::now() - last_connection_event_ <
            std::chrono::milliseconds(kTrimQuietMs)) {
      return;
    }
    closed_since_trim_ = 0;
    malloc_trim(0);
  }

  // The record of (transfer, producer), or null when this relay staged nothing of it and saw
  // no stream end.
  StreamRecord* FindStream(const TransferId& transfer, uint32_t producer) {
    for (auto& [id, producers] : streams_) {
      if (id != transfer) continue;
      const auto found = producers.find(producer);
      return found == producers.end() ? nullptr : &found->second;
    }
    return nullptr;
  }

  // The record of (transfer, producer), made if needed; the oldest transfer is forgotten beyond
  // kSealedTransfers.
  StreamRecord& Stream(const TransferId& transfer, uint32_t producer) {
    auto it = std::find_if(streams_.begin(), streams_.end(),
                           [&](const auto& entry) { return entry.first == transfer; });
    if (it == streams_.end()) {
      if (streams_.size() == kSealedTransfers) streams_.erase(streams_.begin());
      streams_.emplace_back(transfer, std::map<uint32_t, StreamRecord>{});
      it = streams_.end() - 1;
    }
    return it->second[producer];
  }

  void ServeLoop(std::stop_token stop) {
    while (!stop.stop_requested()) {
      std::array<zmq_pollitem_t, 3> items{{{router_.get(), 0, ZMQ_POLLIN, 0},
                                           {replies_in_.get(), 0, ZMQ_POLLIN, 0},
                                           {monitor_.get(), 0, ZMQ_POLLIN, 0}}};
      if (zmq_poll(items.data(), items.size(), kStopCheckMs) < 0) {
        if (zmq_errno() != EINTR) RecordFailure(Unavailable("zmq poll: {}", ZmqError()));
        continue;
      }
      if ((items[1].revents & ZMQ_POLLIN) != 0) {
        Result<std::vector<std::string>> outcome =
            ReceiveFrames(replies_in_.get(), 2 + kReplyFrames);
        if (outcome.ok()) FinishForward(std::move(outcome).ValueOrDie());
      }
      if ((items[2].revents & ZMQ_POLLIN) != 0) CountConnectionEvents();
      TrimAfterFlood();
      if ((items[0].revents & ZMQ_POLLIN) != 0) {
        Result<std::vector<Frame>> request =
            ReceiveMessage(router_.get(), MaxRequestFrames(limits_.max_payload_bytes));
        if (!request.ok()) {
          RecordFailure(request.status().WithContext(endpoint_));
          continue;
        }
        HandleRequest(std::move(request).ValueOrDie(), stop);
      }
    }
  }

  void Reply(const std::string& identity, const ReplyKey& key, const Status& status) {
    if (!status.ok()) RecordFailure(status);
    std::vector<std::string> frames = MakeReply(key, status);
    frames.insert(frames.begin(), identity);
    SendUpstream(frames);
  }

  // Send a reply, identity first, through the ROUTER.
  void SendUpstream(const std::vector<std::string>& frames) {
    Status sent = SendFrames(router_.get(), frames, "upstream");
    if (!sent.ok()) RecordFailure(sent);
  }

  // The relays below this one in `tree`'s heap rooted at `root` (none in a tree of its own, or
  // at a leaf).
  static TreeBranch Children(const TreeView& tree, size_t root) {
    TreeBranch branch{tree.endpoints, root, {}};
    const size_t n = tree.endpoints->size();
    if (n == 0) return branch;
    const size_t position = (tree.self + n - root) % n;
    for (const size_t child : {2 * position + 1, 2 * position + 2}) {
      if (child < n) branch.positions.push_back(child);
    }
    return branch;
  }

  void HandleRequest(std::vector<Frame> frames, const std::stop_token& stop) {
    std::vector<std::string_view> texts;
    texts.reserve(frames.size());
    for (const Frame& frame : frames) texts.push_back(frame.text());
    Result<std::optional<RequestHead>> head = ReadRequestHead(texts, endpoint_);
    if (head.ok() && !head->has_value()) {
      RecordFailure(
          InvalidArgument("zmq listener {}: dropped a request of {} frames that does not speak {}",
                          endpoint_, frames.size() - 1, kProtocol));
      return;
    }
    const std::string identity(frames[0].text());
    if (!head.ok()) {
      Reply(identity, {}, head.status());
      return;
    }
    // Authenticate before reading anything else of the request: a client without the key gets
    // no diagnostics about its payload, and its bytes are never parsed. Such refusals name no
    // ids (see "A NACK names no ids").
    if (Status access = CheckAccess((*head)->api_key, (*head)->root); !access.ok()) {
      Reply(identity, {}, access);
      return;
    }
    const uint32_t root = *(*head)->root;
    if ((*head)->kind == RequestKind::kData) {
      HandleData(identity, std::move(frames), root, stop);
      return;
    }
    Result<StreamEnd> end = ReadFlush(texts, endpoint_);
    if (!end.ok()) {
      Reply(identity, {}, end.status());
      return;
    }
    HandleFlush(identity, std::move(frames), *end, root);
  }

  // Check the key, then that a root index is given (its range depends on the transfer's tree).
  // Errors: PermissionDenied; InvalidArgument.
  Status CheckAccess(std::string_view key, std::optional<uint32_t> root) const {
    // An empty key frame presents no key.
    switch (api_key_.Check(key.empty() ? std::nullopt : std::optional<std::string_view>(key))) {
      case AuthResult::kAllowed:
        break;
      case AuthResult::kMissing:
        return PermissionDenied("zmq listener {}: no api key", endpoint_);
      case AuthResult::kWrong:
        return PermissionDenied("zmq listener {}: wrong api key", endpoint_);
    }
    if (!root.has_value()) {
      return InvalidArgument("zmq listener {}: the request's root relay index is not a u32",
                             endpoint_);
    }
    return Status::OK();
  }

  // Refuse a stream of a producer this relay has no record of in `transfer` once the transfer
  // has kMaxStreamsPerTransfer of them. Errors: ResourceExhausted.
  Status CheckStreamRoom(const TransferId& transfer, uint32_t producer) const {
    for (const auto& [id, producers] : streams_) {
      if (id != transfer || producers.size() < kMaxStreamsPerTransfer) continue;
      return ResourceExhausted(
          "zmq relay {}: producer {} of transfer {}: the transfer has streams of {} producers "
          "already, the most a relay takes",
          endpoint_, producer, transfer.ToHex(), kMaxStreamsPerTransfer);
    }
    return Status::OK();
  }

  void CountStaged(StageResult result) {
    internal::MutexLock lock(stats_mutex_);
    ++(result == StageResult::kDuplicate ? stats_.duplicates : stats_.delivered);
  }

  // The payload of a DATA request (its parts, frames 5 … on): the one copy the sink keeps. A
  // payload in one part is copied only once its header passed; one in several is joined first.
  // Errors: ResourceExhausted when the parts add up to more than the payload limit; those of
  // ValidatePayload.
  Result<ValidatedPayload> JoinPayload(const std::vector<Frame>& frames) const {
    constexpr size_t kFirstPart = 1 + kDataHeadFrames;
    if (frames.size() == kFirstPart + 1)
      return ValidatePayload(frames[kFirstPart].bytes(), limits_);
    uint64_t total = 0;
    for (size_t i = kFirstPart; i < frames.size(); ++i) total += frames[i].size();
    if (total > limits_.max_payload_bytes) {
      return ResourceExhausted("payload of {} bytes in {} parts exceeds the limit of {} bytes",
                               total, frames.size() - kFirstPart, limits_.max_payload_bytes);
    }
    std::vector<std::byte> joined;
    joined.reserve(total);
    for (size_t i = kFirstPart; i < frames.size(); ++i) {
      const std::span<const std::byte> part = frames[i].bytes();
      joined.insert(joined.end(), part.begin(), part.end());
    }
    return ValidatePayload(std::move(joined), limits_);
  }

  void HandleData(const std::string& identity, std::vector<Frame> frames, uint32_t root,
                  const std::stop_token& stop) {
    // The children get the frames ZeroMQ received the payload in (Connection::Request shares
    // them); the sink gets the one copy it keeps, handed on typed once the header is validated.
    // (A retried copy of a staged payload is copied and dropped: rare, and one memcpy.)
    Result<ValidatedPayload> payload = JoinPayload(frames);
    if (!payload.ok()) {
      Reply(identity, {}, payload.status().WithContext(fmt::format("zmq listener {}", endpoint_)));
      return;
    }
    const PayloadHeader header = payload->header();
    const PayloadIds& ids = header.ids;
    const ReplyKey key{ids.transfer_id.ToHex(), U32Bytes(ids.producer_id),
                       U32Bytes(ids.payload_id)};
    const TreeView tree = TreeOf(ids.transfer_id);
    if (Status rooted = CheckRoot(tree, root); !rooted.ok()) {
      Reply(identity, key, rooted);
      return;
    }
    StreamRecord* stream = FindStream(ids.transfer_id, ids.producer_id);
    if (stream != nullptr && stream->sealed) {
      const auto staged = stream->staged.find(ids.payload_id);
      if (staged == stream->staged.end() || staged->second.checksum != header.checksum) {
        Reply(identity, key,
              FailedPrecondition("zmq relay {}: payload {} of producer {} (transfer {}) came "
                                 "after the producer's stream end: the stream is sealed",
                                 endpoint_, ids.payload_id, ids.producer_id,
                                 ids.transfer_id.ToHex()));
        return;
      }
      // A late copy of a staged payload (a retried request): staged here already, so not
      // delivered again, and answered like any duplicate.
      CountStaged(StageResult::kDuplicate);
      ReplyOnceSubtreeHas(identity, std::move(frames), key, ids, staged->second, tree, root);
      return;
    }
    if (stream == nullptr) {
      if (Status room = CheckStreamRoom(ids.transfer_id, ids.producer_id); !room.ok()) {
        Reply(identity, key, room);
        return;
      }
    }
    // A leaf forwards nothing: its frames go before the sink may wait for room in the apply
    // queue, so that a relay waiting there holds the payload once, not twice.
    if (Children(tree, root).positions.empty()) frames.resize(1 + kDataHeadFrames);
    Result<StageResult> staged = sink_.Deliver(std::move(*payload), stop);
    if (!staged.ok()) {
      Reply(identity, key, staged.status());
      return;
    }
    CountStaged(*staged);
    // The record is made only now, so refused payloads (of transfers never prepared, say) cannot
    // push the streams of real transfers out of streams_.
    StagedPayload& record =
        Stream(ids.transfer_id, ids.producer_id)
            .staged.try_emplace(ids.payload_id, StagedPayload{.checksum = header.checksum})
            .first->second;
    ReplyOnceSubtreeHas(identity, std::move(frames), key, ids, record, tree, root);
  }

  // Answer a request for `staged` once the subtree below this relay in the tree of `root` has
  // it: at once when this relay is a leaf there or an earlier forward was ACKed; with the
  // verdict of the forward in flight; else after forwarding it now (again, if an earlier
  // forward failed: the children deduplicate). An ACK thus always means "staged on the whole
  // subtree", for a retry too.
  void ReplyOnceSubtreeHas(const std::string& identity, std::vector<Frame> frames,
                           const ReplyKey& key, const PayloadIds& ids, StagedPayload& staged,
                           const TreeView& tree, uint32_t root) {
    TreeBranch children = Children(tree, root);
    if (children.positions.empty()) staged.acked_root = root;
    if (staged.acked_root == root) {
      Reply(identity, key, Status::OK());
      return;
    }
    if (staged.forwarding.has_value() && staged.forwarding->second == root) {
      const auto pending = pending_.find(staged.forwarding->first);
      if (pending != pending_.end()) {
        if (pending->second.waiting.size() >= kMaxWaitingDuplicates) {
          Reply(identity, key,
                ResourceExhausted("zmq relay {}: payload {} of producer {} (transfer {}): {} "
                                  "copies wait for its forward already",
                                  endpoint_, ids.payload_id, ids.producer_id,
                                  ids.transfer_id.ToHex(), kMaxWaitingDuplicates));
          return;
        }
        pending->second.waiting.push_back(identity);
        return;
      }
    }
    const uint64_t job = next_job_++;
    staged.forwarding.emplace(job, root);
    pending_.emplace(job, PendingForward{ids.transfer_id, ids.producer_id, ids.payload_id, {}});
    Forward(job, identity, std::move(frames), key, std::move(children));
  }

  void HandleFlush(const std::string& identity, std::vector<Frame> frames, const StreamEnd& end,
                   uint32_t root) {
    const ReplyKey key{end.transfer_id.ToHex(), U32Bytes(end.producer_id), ""};
    const TreeView tree = TreeOf(end.transfer_id);
    if (Status rooted = CheckRoot(tree, root); !rooted.ok()) {
      Reply(identity, key, rooted);
      return;
    }
    if (!sink_.IsTransferOpen(end.transfer_id)) {
      Reply(identity, key,
            FailedPrecondition("zmq relay {}: stream end of producer {} for transfer {}, which "
                               "this receiver does not have open: the coordinator prepares "
                               "every receiver before producers stream",
                               endpoint_, end.producer_id, end.transfer_id.ToHex()));
      return;
    }
    if (FindStream(end.transfer_id, end.producer_id) == nullptr) {
      if (Status room = CheckStreamRoom(end.transfer_id, end.producer_id); !room.ok()) {
        Reply(identity, key, room);
        return;
      }
    }
    if (Status ended = sink_.EndOfStream(end); !ended.ok()) {
      Reply(identity, key, ended);
      return;
    }
    Stream(end.transfer_id, end.producer_id).sealed = true;
    {
      internal::MutexLock lock(stats_mutex_);
      ++stats_.streams_ended;
    }
    TreeBranch children = Children(tree, root);
    if (children.positions.empty()) {
      Reply(identity, key, Status::OK());
      return;
    }
    // A repeated FLUSH is forwarded again: the children take an equal stream end again.
    Forward(next_job_++, identity, std::move(frames), key, std::move(children));
  }

  // Hand the request to the forwarding thread, which replies once `children` answered.
  void Forward(uint64_t job, const std::string& identity, std::vector<Frame> frames,
               const ReplyKey& key, TreeBranch children) {
    frames.erase(frames.begin());
    {
      internal::MutexLock lock(jobs_mutex_);
      jobs_.push_back(ForwardJob{job, identity, std::move(frames), key, std::move(children)});
    }
    jobs_changed_.notify_one();
  }

  // A forward ended ([job id, identity, reply…] from the forwarding thread): pass the reply
  // upstream and to the duplicates that waited for it, and remember whether the subtree ACKed.
  void FinishForward(std::vector<std::string> outcome) {
    if (outcome.size() != 2 + kReplyFrames || outcome[0].size() != kJobIdBytes) {
      RecordFailure(Internal("zmq listener {}: malformed forward outcome of {} frames", endpoint_,
                             outcome.size()));
      return;
    }
    uint64_t job = 0;
    std::memcpy(&job, outcome[0].data(), kJobIdBytes);
    std::vector<std::string> reply(std::make_move_iterator(outcome.begin() + 1),
                                   std::make_move_iterator(outcome.end()));
    SendUpstream(reply);
    const auto pending = pending_.find(job);
    // A FLUSH: nobody waits for it.
    if (pending == pending_.end()) return;
    const PendingForward& forward = pending->second;
    if (StreamRecord* stream = FindStream(forward.transfer_id, forward.producer_id);
        stream != nullptr) {
      const auto staged = stream->staged.find(forward.payload_id);
      if (staged != stream->staged.end() && staged->second.forwarding.has_value() &&
          staged->second.forwarding->first == job) {
        // reply[2] is the kind (after the identity and the protocol).
        if (reply[2] == kKindAck) staged->second.acked_root = staged->second.forwarding->second;
        staged->second.forwarding.reset();
      }
    }
    for (const std::string& waiting : forward.waiting) {
      reply[0] = waiting;
      SendUpstream(reply);
    }
    pending_.erase(pending);
  }

  // A relay forwards as a CURVE client holding the fleet key pair, which every relay admits.
  std::optional<CurveClientKeys> ForwardKeys() const {
    if (!curve_.has_value()) return std::nullopt;
    return CurveClientKeys{curve_->fleet.public_key, curve_->fleet};
  }

  void ForwardLoop(std::stop_token stop) {
    // By child endpoint. Trees change from transfer to transfer (receivers join and leave), so
    // connections to relays no longer a child are closed once there are more than a relay needs.
    std::map<std::string, std::unique_ptr<Connection>> connections;
    // The relays found unreachable, per transfer (the kSealedTransfers most recent).
    std::deque<std::pair<std::string, std::unique_ptr<UnreachableRelays>>> unreachable;
    while (true) {
      ForwardJob job;
      {
        internal::MutexLock lock(jobs_mutex_);
        if (!jobs_changed_.wait(lock, stop, [&] { return !jobs_.empty(); })) break;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      if (connections.size() > kMaxIdleConnections) {
        std::erase_if(connections, [&](const auto& entry) {
          return std::none_of(
              job.children.positions.begin(), job.children.positions.end(),
              [&](size_t position) { return job.children.Endpoint(position) == entry.first; });
        });
      }
      auto gone = std::find_if(unreachable.begin(), unreachable.end(), [&](const auto& entry) {
        return entry.first == job.key.transfer_hex;
      });
      if (gone == unreachable.end()) {
        if (unreachable.size() >= kSealedTransfers) unreachable.pop_front();
        unreachable.emplace_back(job.key.transfer_hex, std::make_unique<UnreachableRelays>());
        gone = std::prev(unreachable.end());
      }
      const Status status =
          RequestAroundUnreachable(
              job.children,
              [&](const std::string& child, bool* is_gone) {
                std::unique_ptr<Connection>& connection = connections[child];
                if (connection == nullptr) {
                  connection =
                      std::make_unique<Connection>(context_.get(), child, config_, ForwardKeys());
                }
                Status forwarded = connection->Request(job.request, job.key, stop);
                *is_gone = connection->unreachable();
                return forwarded;
              },
              *gone->second)
              .status()
              .WithContext(fmt::format("relay {} forwarding", endpoint_));
      if (!status.ok()) RecordFailure(status);
      std::string job_id(kJobIdBytes, '\0');
      std::memcpy(job_id.data(), &job.id, kJobIdBytes);
      std::vector<std::string> outcome = MakeReply(job.key, status);
      outcome.insert(outcome.begin(), {std::move(job_id), job.identity});
      if (Status sent = SendFrames(replies_out_.get(), outcome, kReplyInbox); !sent.ok()) {
        RecordFailure(sent);
      }
    }
  }

  const ZmqConfig config_;
  // Checks the api key of every request (SHA-256 and CRYPTO_memcmp, as the control plane does).
  const ApiKeyVerifier api_key_;
  const std::optional<CurveServerKeys> curve_;
  // The host:port the ROUTER binds; the endpoint unless ListenerContext::bind_address is set.
  const std::string bind_;
  // Port 0 until Start binds the port the kernel chooses; fixed from then on.
  std::string endpoint_;
  // The tree of transfers no prepare named one for: ListenerContext::peers.
  const TreeView static_tree_;
  PayloadSink& sink_;
  const PayloadLimits limits_;

  internal::Mutex lifecycle_mutex_;
  bool started_ = false;
  bool stopped_ = false;
  // Declared before the sockets: they close first. The router and replies_in_ belong to the
  // I/O thread, replies_out_ to the forwarding thread, once started.
  ZmqContext context_;
  ZmqSocket router_;
  ZmqSocket replies_in_;
  ZmqSocket replies_out_;
  // Receives the ROUTER's connection events; the I/O thread's, with the two counters below.
  ZmqSocket monitor_;
  uint64_t closed_since_trim_ = 0;
  std::chrono::steady_clock::time_point last_connection_event_{};
  // The ZAP handler's socket and whom it admits (PLAIN with an api key, or CURVE with
  // curve_authorized_keys; none otherwise), owned by the ZAP thread.
  ZmqSocket zap_;
  ZapAdmit admit_;
  std::jthread io_thread_;
  std::jthread forward_thread_;
  std::jthread zap_thread_;

  // The streams this relay staged payloads of, per transfer, most recent last; at most
  // kSealedTransfers, each of at most kMaxStreamsPerTransfer producers. The I/O thread's alone.
  std::vector<std::pair<TransferId, std::map<uint32_t, StreamRecord>>> streams_;
  // The payload forwards in flight by job id, and the next job id. The I/O thread's alone.
  std::map<uint64_t, PendingForward> pending_;
  uint64_t next_job_ = 0;

  internal::Mutex jobs_mutex_;
  // Waits with the forwarding thread's stop token, so Stop needs no notification.
  internal::CondVar jobs_changed_;
  std::deque<ForwardJob> jobs_;

  mutable internal::Mutex stats_mutex_;
  ListenerStats stats_;

  // The trees prepares named (RouteTransfer, on a control-plane thread), most recent last; at
  // most kSealedTransfers.
  mutable internal::Mutex trees_mutex_;
  std::vector<std::pair<TransferId, TreeView>> trees_;
};
}  // namespace

std::unique_ptr<Listener> MakeZmqRelay(ZmqConfig config, std::optional<CurveServerKeys> curve,
                                       ListenerContext context, size_t self, PayloadSink& sink,
                                       PayloadLimits limits) {
  return std::make_unique<ZmqListener>(std::move(config), std::move(curve), std::move(context),
                                       self, sink, limits);
}

}  // namespace refit::internal::zmq
