#include "control/http_connections.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "util/mutex.h"
#include "util/thread_name.h"

namespace refit::internal {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::string_view kHeadEnd = "\r\n\r\n";
// Bytes read from a socket at once, by the collector and by a worker's stream.
constexpr size_t kReadChunk = 16 << 10;
// The longest the collector sleeps without looking at deadlines (a coarse tick keeps the code
// simple; deadlines are seconds).
constexpr std::chrono::milliseconds kMaxCollectorSleep{100};
// After a reply that refuses the rest of a request body: how long, and how much, to read and
// discard before closing, so the client reads the reply instead of a reset (RFC 9112 §9.6).
// Discarding costs no memory and no worker (see below); the byte bound covers a
// client that writes its whole body before it reads (most do: httplib, libcurl, urllib) at
// loopback or datacenter speed, which a reset would otherwise leave with a write error instead
// of the reply.
// The collector does the discarding, not a worker: a client that sends a refused body slowly, or
// never closes, costs a socket for kLinger and nothing else. Lingering connections are
// bounded in total and per peer; past either bound a connection is closed at once.
constexpr std::chrono::milliseconds kLinger{1000};
constexpr size_t kLingerBytes = size_t{256} << 20;
constexpr size_t kMaxLingering = 256;
constexpr size_t kMaxLingeringPerPeer = 8;
// Bytes one lingering connection may drop per collector round, so that a fast client's body
// does not keep the collector from the heads of others.
constexpr size_t kLingerBytesPerRound = size_t{1} << 20;

// Canned replies the server writes itself, before any handler runs.
constexpr std::string_view kPeerBusyMessage =
    "too many connections from this peer that have not sent a request";
constexpr std::string_view kServerBusyMessage = "too many connections to this server";
// The 503 with its Content-Length counted from the body (a hand-counted length once made every
// client wait for three bytes that never came, and report a read error instead of the 503).
std::string MakeBusyReply(std::string_view message) {
  const std::string body =
      fmt::format("{{\"ok\":false,\"code\":\"Unavailable\",\"message\":\"{}\"}}\n", message);
  return fmt::format(
      "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: "
      "application/json\r\nContent-Length: {}\r\n\r\n{}",
      body.size(), body);
}
// The 503 of a connection over its peer's cap (`per_peer`) or over the total.
const std::string& BusyReply(bool per_peer) {
  static const std::string peer_reply = MakeBusyReply(kPeerBusyMessage);
  static const std::string server_reply = MakeBusyReply(kServerBusyMessage);
  return per_peer ? peer_reply : server_reply;
}
constexpr std::string_view kHeadTimeoutReply =
    "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n";
constexpr std::string_view kHeadTooLargeReply =
    "HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: "
    "0\r\n\r\n";

// Set by a worker around each request it runs: where CloseConnectionAfterReply records its ask.
thread_local bool* current_close_request = nullptr;

// Write `reply` if the socket takes it at once; a peer that does not read gets nothing.
void SendBestEffort(int fd, std::string_view reply) {
  [[maybe_unused]] const ssize_t sent =
      ::send(fd, reply.data(), reply.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

std::string PeerAddress(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return "?";
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw =
      address.ss_family == AF_INET6
          ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&address)->sin6_addr)
          : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&address)->sin_addr);
  return ::inet_ntop(address.ss_family, raw, text, sizeof text) != nullptr ? text : "?";
}

void AddressOf(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  const int got = peer ? ::getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length)
                       : ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  if (got != 0) return;
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&address);
    ::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text);
    port = ntohs(v6->sin6_port);
  } else {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&address);
    ::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text);
    port = ntohs(v4->sin_port);
  }
  ip = text;
}

// Wait up to `timeout` for `events` on `fd`; false on timeout or error.
bool PollFor(int fd, short events, std::chrono::milliseconds timeout) {
  pollfd entry{fd, events, 0};
  int ready = 0;
  do {
    ready = ::poll(&entry, 1, static_cast<int>(timeout.count()));
  } while (ready < 0 && errno == EINTR);
  return ready > 0 && (entry.revents & (events | POLLHUP | POLLERR)) != 0;
}

// httplib's view of one request on a connection: the bytes the collector buffered first, then
// the socket, each read and write limited to `io_timeout`. Reads are buffered (httplib reads a
// request head byte by byte); what is buffered past the request stays for the next one.
class BufferedSocketStream final : public httplib::Stream {
 public:
  BufferedSocketStream(int fd, std::string buffered, std::chrono::milliseconds io_timeout)
      : fd_(fd), buffer_(std::move(buffered)), io_timeout_(io_timeout) {}

  bool is_readable() const override {
    return offset_ < buffer_.size() || PollFor(fd_, POLLIN, io_timeout_);
  }
  bool is_writable() const override { return PollFor(fd_, POLLOUT, io_timeout_); }

  ssize_t read(char* ptr, size_t size) override {
    if (offset_ == buffer_.size()) {
      buffer_.clear();
      offset_ = 0;
      if (!PollFor(fd_, POLLIN, io_timeout_)) return -1;
      buffer_.resize(kReadChunk);
      ssize_t n = 0;
      do {
        n = ::recv(fd_, buffer_.data(), buffer_.size(), 0);
      } while (n < 0 && errno == EINTR);
      buffer_.resize(n > 0 ? static_cast<size_t>(n) : 0);
      if (n <= 0) return n;
    }
    const size_t take = std::min(size, buffer_.size() - offset_);
    std::memcpy(ptr, buffer_.data() + offset_, take);
    offset_ += take;
    return static_cast<ssize_t>(take);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!PollFor(fd_, POLLOUT, io_timeout_)) return -1;
    ssize_t n = 0;
    do {
      // MSG_NOSIGNAL: a client that went away is an error here, not a SIGPIPE for the process.
      n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    AddressOf(fd_, /*peer=*/true, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    AddressOf(fd_, /*peer=*/false, ip, port);
  }
  socket_t socket() const override { return fd_; }

  // The bytes read from the socket that the request did not use (a pipelined next request).
  std::string TakeUnread() { return buffer_.substr(offset_); }

 private:
  const int fd_;
  std::string buffer_;
  size_t offset_ = 0;
  const std::chrono::milliseconds io_timeout_;
};

}  // namespace

// Admission, the head collector and the workers (see the header's file comment).
class GuardedHttpServer::Connections {
 public:
  using ServeRequest =
      std::function<bool(httplib::Stream& stream, bool close, bool& connection_closed)>;

  explicit Connections(const HttpConnectionLimits& limits) : limits_(limits) {}
  ~Connections() { Shutdown(); }

  void set_serve(ServeRequest serve) { serve_ = std::move(serve); }

  // Start the collector and the workers. Errors: ResourceExhausted when the OS refuses.
  Status Start() {
    if (wake_fd_ >= 0) return FailedPrecondition("control server connections started twice");
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) {
      return ResourceExhausted("control server: eventfd failed: {}", std::strerror(errno));
    }
    // std::thread reports an OS refusal only by throwing; no exception may leave the library.
    try {
      collector_ = std::jthread([this] {
        NameCurrentThread("refit-http-head");
        Collect();
      });
      for (size_t i = 0; i < limits_.worker_threads; ++i) {
        workers_.emplace_back([this, i] {
          NameCurrentThread("refit-http", static_cast<int>(i));
          Work();
        });
      }
    } catch (const std::system_error& error) {
      Shutdown();
      return ResourceExhausted("control server: cannot start its threads: {}", error.what());
    }
    return Status::OK();
  }

  // Take an accepted socket (httplib's accept loop): refuse it over the limits, else wait for
  // its request head.
  //
  // Over a limit, the new connection is not refused outright: it takes the place of the oldest
  // connection of the same peer (or, over the total, of any peer) that has not yet sent one
  // complete request head, which the collector then closes (Evict). A peer that opens many
  // connections and never completes a head — a dripper — therefore cannot lock a well-behaved
  // client out, even one at the same address (the coordinator behind the same NAT): that
  // client's head arrives with its connection and is served. Only when nothing can be evicted
  // is the new connection answered 503 (and lingered on, so that the client reads the 503).
  void Admit(int fd) {
    std::string peer = PeerAddress(fd);
    Waiting waiting{fd, peer, {}, 0, Clock::now() + limits_.head_timeout};
    waiting.accepted = Clock::now();
    {
      internal::MutexLock lock(mutex_);
      if (stopping_) {
        ::close(fd);
        return;
      }
      size_t& unproven = unproven_per_peer_[peer];
      if (unproven >= limits_.max_connections_per_peer) {
        waiting.evict = Eviction::kSamePeer;
      } else if (open_ >= limits_.max_connections) {
        waiting.evict = Eviction::kAnyPeer;
      }
      ++unproven;
      ++open_;
    }
    Wait(std::move(waiting));
  }

  // Stop: close what waits for a head or a worker, let running requests finish, join. Only the
  // first call does anything.
  void Shutdown() {
    {
      internal::MutexLock lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    Wake();
    ready_changed_.notify_all();
    if (collector_.joinable()) collector_.join();
    for (std::jthread& worker : workers_) {
      if (worker.joinable()) worker.join();
    }
    workers_.clear();
    internal::MutexLock lock(mutex_);
    for (Waiting& waiting : incoming_) CloseLocked(waiting);
    incoming_.clear();
    for (Waiting& ready : ready_) CloseLocked(ready);
    ready_.clear();
    if (wake_fd_ >= 0) {
      ::close(wake_fd_);
      wake_fd_ = -1;
    }
  }

 private:
  // What a connection admitted over a limit must evict to stay (see Admit).
  enum class Eviction : uint8_t { kNone, kSamePeer, kAnyPeer };

  struct Waiting {
    int fd = -1;
    std::string peer;
    // What arrived so far; a complete head, then perhaps more.
    std::string head;
    // Bytes of `head` already searched for its end.
    size_t scanned = 0;
    Clock::time_point deadline;
    // When the connection was accepted: the oldest head-waiter is evicted first.
    Clock::time_point accepted{};
    // Whether a complete request head ever arrived on it. Until then the connection is
    // unproven: it counts against its peer's cap and may be replaced by a new one (Admit).
    bool served = false;
    Eviction evict = Eviction::kNone;
    // Lingering: the reply is out, the write side shut; the collector drops what the client
    // still sends until `deadline` or `dropped` reaches kLingerBytes, then closes.
    bool lingering = false;
    size_t dropped = 0;
  };

  void Wake() const {
    if (wake_fd_ < 0) return;
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t written = ::write(wake_fd_, &one, sizeof one);
  }

  static bool HeadComplete(Waiting& waiting) {
    const size_t from =
        waiting.scanned >= kHeadEnd.size() ? waiting.scanned - kHeadEnd.size() + 1 : 0;
    const bool complete = waiting.head.find(kHeadEnd, from) != std::string::npos;
    waiting.scanned = waiting.head.size();
    return complete;
  }

  // Queue `waiting` for a worker when its head is complete, else for the collector (which also
  // takes every connection admitted over a limit, and every lingering one).
  void Wait(Waiting waiting) {
    const bool complete =
        !waiting.lingering && waiting.evict == Eviction::kNone && HeadComplete(waiting);
    internal::MutexLock lock(mutex_);
    if (stopping_) return CloseLocked(waiting);
    if (complete) return ReadyLocked(std::move(waiting));
    incoming_.push_back(std::move(waiting));
    Wake();
  }

  // `w` completed a request head: it stops counting against its peer's cap of unproven
  // connections (once), and waits for a worker.
  void ReadyLocked(Waiting w) {
    if (!w.served) {
      w.served = true;
      ForgetUnprovenLocked(w.peer);
    }
    ready_.push_back(std::move(w));
    ready_changed_.notify_one();
  }
  void ForgetUnprovenLocked(const std::string& peer) {
    if (auto it = unproven_per_peer_.find(peer);
        it != unproven_per_peer_.end() && --it->second == 0) {
      unproven_per_peer_.erase(it);
    }
  }

  void CloseLocked(const Waiting& w) {
    ::shutdown(w.fd, SHUT_RDWR);
    ::close(w.fd);
    --open_;
    if (!w.served) ForgetUnprovenLocked(w.peer);
  }
  void Close(const Waiting& w) {
    internal::MutexLock lock(mutex_);
    CloseLocked(w);
  }

  // The collector thread: poll every connection that waits for its head, and every lingering
  // one; make room for connections admitted over a limit.
  void Collect() {
    std::vector<Waiting> waiting;
    std::vector<pollfd> polled;
    // Lingering connections, in total and per peer (only this thread changes them).
    size_t lingering = 0;
    std::map<std::string, size_t> lingering_per_peer;
    const auto close_one = [&](Waiting& w) {
      if (w.lingering) {
        --lingering;
        if (auto it = lingering_per_peer.find(w.peer); --it->second == 0) {
          lingering_per_peer.erase(it);
        }
      }
      Close(w);
    };
    // Start lingering on `w` (its reply sent, its write side shut) if the bounds allow.
    const auto linger_or_close = [&](Waiting w) {
      size_t& from_peer = lingering_per_peer[w.peer];
      if (lingering >= kMaxLingering || from_peer >= kMaxLingeringPerPeer) {
        if (from_peer == 0) lingering_per_peer.erase(w.peer);
        w.lingering = false;
        return Close(w);
      }
      ++from_peer;
      ++lingering;
      w.lingering = true;
      w.dropped = 0;
      w.deadline = Clock::now() + kLinger;
      waiting.push_back(std::move(w));
    };
    while (true) {
      std::vector<Waiting> added;
      {
        internal::MutexLock lock(mutex_);
        if (stopping_) break;
        added.swap(incoming_);
      }
      for (Waiting& w : added) {
        if (w.lingering) {
          linger_or_close(std::move(w));
        } else if (w.evict != Eviction::kNone) {
          MakeRoomFor(std::move(w), waiting, linger_or_close);
        } else {
          waiting.push_back(std::move(w));
        }
      }
      const Clock::time_point now = Clock::now();
      Clock::time_point next = now + kMaxCollectorSleep;
      for (const Waiting& w : waiting) next = std::min(next, w.deadline);
      polled.assign(1, pollfd{wake_fd_, POLLIN, 0});
      for (const Waiting& w : waiting) polled.push_back(pollfd{w.fd, POLLIN, 0});
      const auto sleep = std::chrono::duration_cast<std::chrono::milliseconds>(next - now);
      const int ready = ::poll(polled.data(), polled.size(),
                               static_cast<int>(std::max<int64_t>(sleep.count(), 0)));
      if (ready < 0 && errno != EINTR) break;
      if ((polled[0].revents & POLLIN) != 0) {
        uint64_t count = 0;
        [[maybe_unused]] const ssize_t read = ::read(wake_fd_, &count, sizeof count);
      }
      const Clock::time_point after = Clock::now();
      std::vector<Waiting> still;
      still.reserve(waiting.size());
      for (size_t i = 0; i < waiting.size(); ++i) {
        Waiting& w = waiting[i];
        const short events = polled[i + 1].revents;
        if (w.lingering) {
          if ((events != 0 && !Drop(w)) || after >= w.deadline) {
            close_one(w);
          } else {
            still.push_back(std::move(w));
          }
        } else if (events != 0 && !ReadHead(w)) {
          Close(w);
        } else if (events != 0 && HeadComplete(w)) {
          internal::MutexLock lock(mutex_);
          ReadyLocked(std::move(w));
        } else if (w.head.size() >= kMaxRequestHeadBytes) {
          SendBestEffort(w.fd, kHeadTooLargeReply);
          Close(w);
        } else if (after >= w.deadline) {
          // An idle keep-alive connection just ends; a request cut short is told why.
          if (!w.head.empty()) SendBestEffort(w.fd, kHeadTimeoutReply);
          Close(w);
        } else {
          still.push_back(std::move(w));
        }
      }
      waiting = std::move(still);
    }
    for (Waiting& w : waiting) close_one(w);
  }

  // Make room for `w`, admitted over a limit (see Admit). What has already arrived on the
  // connections involved is read first (without blocking): one whose complete head is there is
  // proven, and one its peer closed is gone, so neither is replaced. Over its peer's cap, `w`
  // then replaces the oldest unproven connection of its peer, unless it is proven itself. Over
  // the total, it replaces the oldest unproven connection of any peer, else the oldest idle
  // keep-alive one (a client reconnects for its next request). With nothing to replace, `w` is
  // answered 503 and lingered on.
  template <typename LingerOrClose>
  void MakeRoomFor(Waiting w, std::vector<Waiting>& waiting, const LingerOrClose& linger_or_close) {
    std::vector<Waiting> still;
    still.reserve(waiting.size());
    for (Waiting& candidate : waiting) {
      if (candidate.lingering || candidate.served) {
        still.push_back(std::move(candidate));
      } else if (!ReadHead(candidate)) {
        Close(candidate);
      } else if (HeadComplete(candidate)) {
        internal::MutexLock lock(mutex_);
        ReadyLocked(std::move(candidate));
      } else {
        still.push_back(std::move(candidate));
      }
    }
    waiting = std::move(still);
    if (!ReadHead(w)) return Close(w);
    // Read here, a complete head raises no poll event later: it goes to a worker from here.
    const bool proven = HeadComplete(w);
    {
      internal::MutexLock lock(mutex_);
      const auto unproven = unproven_per_peer_.find(w.peer);
      const bool over_peer = !proven && unproven != unproven_per_peer_.end() &&
                             unproven->second > limits_.max_connections_per_peer;
      const bool over_total = open_ > limits_.max_connections;
      w.evict = over_peer ? Eviction::kSamePeer : Eviction::kAnyPeer;
      if (!over_peer && !over_total) {
        // Proven, or room was made by connections read or closed above.
        w.evict = Eviction::kNone;
        if (proven) return ReadyLocked(std::move(w));
        waiting.push_back(std::move(w));
        return;
      }
    }
    std::optional<size_t> victim;
    for (size_t i = 0; i < waiting.size(); ++i) {
      const Waiting& candidate = waiting[i];
      if (candidate.lingering || candidate.served) continue;
      if (w.evict == Eviction::kSamePeer && candidate.peer != w.peer) continue;
      if (!victim || candidate.accepted < waiting[*victim].accepted) victim = i;
    }
    if (!victim && w.evict == Eviction::kAnyPeer) {
      for (size_t i = 0; i < waiting.size(); ++i) {
        const Waiting& candidate = waiting[i];
        if (candidate.lingering || !candidate.head.empty()) continue;
        if (!victim || candidate.accepted < waiting[*victim].accepted) victim = i;
      }
    }
    const bool per_peer = w.evict == Eviction::kSamePeer;
    if (!victim) {
      SendBestEffort(w.fd, BusyReply(per_peer));
      ::shutdown(w.fd, SHUT_WR);
      w.evict = Eviction::kNone;
      return linger_or_close(std::move(w));
    }
    if (!waiting[*victim].served) SendBestEffort(waiting[*victim].fd, BusyReply(per_peer));
    Close(waiting[*victim]);
    waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(*victim));
    w.evict = Eviction::kNone;
    if (proven) {
      internal::MutexLock lock(mutex_);
      return ReadyLocked(std::move(w));
    }
    waiting.push_back(std::move(w));
  }

  // Drop what a lingering connection sent (at most kLingerBytesPerRound now); false when it is
  // done: closed by the peer, failed, or past kLingerBytes.
  static bool Drop(Waiting& w) {
    char sink[kReadChunk];
    for (size_t round = 0; round < kLingerBytesPerRound; round += sizeof sink) {
      const ssize_t n = ::recv(w.fd, sink, sizeof sink, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      w.dropped += static_cast<size_t>(n);
      if (w.dropped >= kLingerBytes) return false;
    }
    return true;
  }

  // Read what the socket has (without blocking) into the head; false when the peer closed or
  // the socket failed.
  static bool ReadHead(Waiting& w) {
    const size_t room = kMaxRequestHeadBytes - std::min(w.head.size(), kMaxRequestHeadBytes);
    if (room == 0) return true;
    const size_t old_size = w.head.size();
    w.head.resize(old_size + std::min(room, kReadChunk));
    ssize_t n = 0;
    do {
      n = ::recv(w.fd, w.head.data() + old_size, w.head.size() - old_size, MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    w.head.resize(old_size + (n > 0 ? static_cast<size_t>(n) : 0));
    if (n == 0) return false;
    return n > 0 || errno == EAGAIN || errno == EWOULDBLOCK;
  }

  // A worker thread: run one request of each ready connection.
  void Work() {
    while (true) {
      Waiting next;
      {
        internal::MutexLock lock(mutex_);
        ready_changed_.wait(lock, [&] { return stopping_ || !ready_.empty(); });
        if (stopping_) return;
        next = std::move(ready_.front());
        ready_.pop_front();
      }
      Serve(std::move(next));
    }
  }

  void Serve(Waiting connection) {
    BufferedSocketStream stream(connection.fd, std::move(connection.head), limits_.io_timeout);
    bool close_requested = false;
    bool connection_closed = false;
    bool served = false;
    current_close_request = &close_requested;
    // httplib's handlers are guarded by ControlServer; this catches what httplib itself throws.
    try {
      bool stopping = false;
      {
        internal::MutexLock lock(mutex_);
        stopping = stopping_;
      }
      served = serve_(stream, stopping, connection_closed);
    } catch (...) {
      served = false;
    }
    current_close_request = nullptr;
    if (close_requested) {
      // Stop sending, and let the collector read and drop what the client still sends for a
      // moment, so that the reply is not destroyed by a reset: this worker is free at once.
      ::shutdown(connection.fd, SHUT_WR);
      connection.lingering = true;
      connection.head.clear();
      return Wait(std::move(connection));
    }
    if (!served || connection_closed) return Close(connection);
    Waiting next{connection.fd, std::move(connection.peer), stream.TakeUnread(), 0,
                 Clock::now() + limits_.head_timeout};
    next.accepted = connection.accepted;
    next.served = true;
    Wait(std::move(next));
  }

  const HttpConnectionLimits limits_;
  ServeRequest serve_;
  int wake_fd_ = -1;

  internal::Mutex mutex_;
  bool stopping_ = false;
  size_t open_ = 0;
  // Per peer address, its open connections that have not completed a request head yet.
  std::map<std::string, size_t> unproven_per_peer_;
  // Handed to the collector (by Admit and by workers), taken by it at its next round.
  std::vector<Waiting> incoming_;
  // Complete heads waiting for a worker.
  std::deque<Waiting> ready_;
  internal::CondVar ready_changed_;

  std::jthread collector_;
  std::vector<std::jthread> workers_;
};

namespace {

// httplib's task queue for GuardedHttpServer: the accept loop's closure runs at once on the
// accept thread; it only admits the socket (process_and_close_socket below), never blocks.
class InlineTaskQueue final : public httplib::TaskQueue {
 public:
  explicit InlineTaskQueue(std::function<void()> on_shutdown)
      : on_shutdown_(std::move(on_shutdown)) {}
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override { on_shutdown_(); }

 private:
  std::function<void()> on_shutdown_;
};

}  // namespace

Result<std::unique_ptr<GuardedHttpServer>> GuardedHttpServer::Make(
    const HttpConnectionLimits& limits) {
  if (limits.worker_threads == 0 || limits.max_connections == 0 ||
      limits.max_connections_per_peer == 0 || limits.head_timeout.count() <= 0 ||
      limits.io_timeout.count() <= 0) {
    return InvalidArgument(
        "control server connection limits must be positive (workers {}, connections {}, per "
        "peer {}, head timeout {} ms, io timeout {} ms)",
        limits.worker_threads, limits.max_connections, limits.max_connections_per_peer,
        limits.head_timeout.count(), limits.io_timeout.count());
  }
  auto connections = std::make_unique<Connections>(limits);
  std::unique_ptr<GuardedHttpServer> server(new GuardedHttpServer(std::move(connections)));
  GuardedHttpServer* raw = server.get();
  raw->connections_->set_serve([raw](httplib::Stream& stream, bool close, bool& closed) {
    return raw->process_request(stream, close, closed, nullptr);
  });
  // httplib owns (and deletes) the queue it gets; it asks once, when it starts listening.
  raw->new_task_queue = [raw]() -> httplib::TaskQueue* {
    return new InlineTaskQueue([raw] { raw->connections_->Shutdown(); });
  };
  return server;
}

GuardedHttpServer::GuardedHttpServer(std::unique_ptr<Connections> connections)
    : connections_(std::move(connections)) {}

GuardedHttpServer::~GuardedHttpServer() { connections_->Shutdown(); }

Status GuardedHttpServer::StartThreads() { return connections_->Start(); }

bool GuardedHttpServer::process_and_close_socket(socket_t sock) {
  connections_->Admit(sock);
  return true;
}

bool GuardedHttpServer::CloseConnectionAfterReply(httplib::Response& response) {
  response.set_header("Connection", "close");
  if (current_close_request == nullptr) return false;
  *current_close_request = true;
  return true;
}

}  // namespace refit::internal
