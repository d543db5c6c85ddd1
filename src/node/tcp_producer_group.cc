// The TCP producer group: rank 0 listens, ranks 1 … W−1 connect to it, one link each.
//
// Wire (all integers little-endian). Every message is a frame:
//   [u32 kind][u64 round][u64 length][length bytes]
// Join handshake, on every new connection (round 0 in the frames unless said otherwise):
//   rank 0 → joiner  CHALLENGE  32 random bytes (the nonce)
//   joiner → rank 0  HELLO      u32 rank, u32 world size,
//                               HMAC-SHA256(api key, nonce ‖ rank ‖ world size)
//   rank 0 → joiner  WELCOME    empty; its round is rank 0's current round (below)
//                    REFUSED    u8 reason (1: api key, 2: membership), then a human-readable text
// Collectives:
//   rank 0 → rank p  BROADCAST  the message
//   rank p → rank 0  GATHER     the message
//   either way       OVERSIZED  u64 size: sent instead of a message over the sender's limit, so
//                               the waiting side fails at once instead of at its deadline
//
// Rounds. Every endpoint numbers its collectives (its k-th call is round k) and stamps its
// frames with the round. Ranks call the same collectives in the same order, so the numbers
// agree, and a frame of an earlier round — a late message of an abandoned collective that
// reached a new link, or a broadcast rank 0 sent to a reconnected rank for a round that rank
// had already given up — is recognised and discarded instead of being taken for the current
// round's. Links are dropped on every failure as well (a half-read frame cannot be resumed,
// and a dropped link tells the peer at once); the round stamp covers what dropping cannot: a
// late message written on a fresh link. A joiner adopts rank 0's round from the WELCOME on its
// first connection, so a rank whose process restarted continues with rank 0's numbering.
//
// Rank 0 runs one background thread, "refit-group": it accepts connections and runs their
// handshakes concurrently (a silent client cannot hold up the others), then registers each
// authenticated link under its rank, replacing (and shutting down) an older link of that rank.
// The collectives run on the caller's thread over non-blocking sockets, polling every link at
// once so that one slow rank does not serialize the others.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "refit/producer_group.h"
#include "refit/status_format.h"
#include "util/endian.h"
#include "util/logging.h"
#include "util/mutex.h"
#include "util/tcp_socket.h"
#include "util/thread_name.h"

namespace refit {
namespace {

using internal::AddrInfoList;
using internal::AwaitReady;
using internal::ConnectOnce;
using internal::Endpoint;
using internal::EndpointText;
using internal::ErrnoText;
using internal::ParseAddress;
using internal::PeerClosed;
using internal::PollTimeout;
using internal::Resolve;
using internal::SetNoDelay;
using internal::UniqueFd;
using std::chrono::milliseconds;

enum class FrameKind : uint32_t {
  kChallenge = 1,
  kHello = 2,
  kWelcome = 3,
  kRefused = 4,
  kBroadcast = 5,
  kGather = 6,
  kOversized = 7,
};

/// The reason byte of a REFUSED frame.
enum class Refusal : uint8_t {
  kApiKey = 1,
  kMembership = 2,
};

/// u32 kind + u64 round + u64 length.
constexpr size_t kFrameHeaderBytes = 20;
/// The challenge nonce: as long as the MAC, so a replayed answer is as unlikely as a forged one.
constexpr size_t kNonceBytes = 32;
/// HMAC-SHA256.
constexpr size_t kMacBytes = 32;
/// u32 rank + u32 world size + MAC.
constexpr size_t kHelloBytes = 8 + kMacBytes;
/// The largest frame body accepted before a peer is authenticated: the longest handshake frame
/// is a REFUSED with its text, so nothing unauthenticated can make rank 0 allocate more.
constexpr uint64_t kMaxHandshakeBodyBytes = 256;
/// How long a new connection has to complete the handshake (loopback or a datacenter network
/// needs milliseconds; this only bounds what a stuck or hostile client occupies).
constexpr milliseconds kHandshakeTimeout{10'000};
/// Handshakes in progress at once; connections beyond it are closed at once (a flood of idle
/// connections must not exhaust rank 0's descriptors).
constexpr size_t kMaxPendingJoins = 64;
/// Connection retries back off from the first pause to the last: short enough that a rank 0
/// starting a moment later is found at once, long enough not to spin.
constexpr milliseconds kFirstRetryPause{10};
constexpr milliseconds kMaxRetryPause{200};
/// After a failed accept() (out of descriptors) the listener stays readable; pause instead of
/// spinning until a descriptor frees up.
constexpr milliseconds kAcceptErrorPause{50};
/// While a collective waits for ranks that are not connected, rank 0 says which, first after
/// kFirstWaitNotice (a rank starting a moment later needs no line), then every kWaitNoticeEvery;
/// at info, and at warn once the wait passed kLongWait (a launch that went wrong, which a user at
/// the default log level must see).
constexpr milliseconds kFirstWaitNotice{2'000};
constexpr milliseconds kWaitNoticeEvery{10'000};
constexpr milliseconds kLongWait{30'000};
/// Linux limits thread names to 15 bytes plus the NUL.
constexpr char kAcceptThreadName[] = "refit-group";

/// A wait's length in the progress lines.
int64_t WholeSeconds(GroupClock::duration wait) {
  return std::chrono::duration_cast<std::chrono::seconds>(wait).count();
}

// The frame's integer fields (see the wire at the top of this file).
void StoreLe32(uint32_t value, char* out) { internal::StoreLittleEndian(out, value); }
void StoreLe64(uint64_t value, char* out) { internal::StoreLittleEndian(out, value); }
uint32_t LoadLe32(const char* in) { return internal::LoadLittleEndian<uint32_t>(in); }
uint64_t LoadLe64(const char* in) { return internal::LoadLittleEndian<uint64_t>(in); }

std::string SizeBody(uint64_t size) {
  std::string body(8, '\0');
  StoreLe64(size, body.data());
  return body;
}

/// Writes one frame to a non-blocking socket, as far as the socket takes it each time.
/// The body is borrowed and must outlive the writer.
class FrameWriter {
 public:
  FrameWriter(FrameKind kind, uint64_t round, std::string_view body) : body_(body) {
    StoreLe32(static_cast<uint32_t>(kind), header_.data());
    StoreLe64(round, header_.data() + 4);
    StoreLe64(body.size(), header_.data() + 12);
  }

  /// Whether any byte of the frame has been written.
  bool started() const { return written_ > 0; }
  /// Whether the whole frame has been written.
  bool finished() const { return written_ == kFrameHeaderBytes + body_.size(); }

  /// Write what the socket takes now; true once the whole frame is written.
  /// Errors: Unavailable (the connection failed).
  Result<bool> Advance(int fd) {
    const size_t total = kFrameHeaderBytes + body_.size();
    while (written_ < total) {
      std::array<iovec, 2> parts{};
      int count = 0;
      if (written_ < kFrameHeaderBytes) {
        parts[count++] = {header_.data() + written_, kFrameHeaderBytes - written_};
      }
      const size_t body_written = written_ > kFrameHeaderBytes ? written_ - kFrameHeaderBytes : 0;
      if (body_written < body_.size()) {
        // sendmsg never writes through iov_base; the cast only satisfies its signature.
        parts[count++] = {const_cast<char*>(body_.data()) + body_written,
                          body_.size() - body_written};
      }
      msghdr message{};
      message.msg_iov = parts.data();
      message.msg_iovlen = static_cast<size_t>(count);
      const ssize_t sent = ::sendmsg(fd, &message, MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
        return Unavailable("send: {}", ErrnoText(errno));
      }
      written_ += static_cast<size_t>(sent);
    }
    return true;
  }

 private:
  std::array<char, kFrameHeaderBytes> header_{};
  std::string_view body_;
  size_t written_ = 0;
};

struct Frame {
  FrameKind kind = FrameKind::kChallenge;
  uint64_t round = 0;
  std::string body;
};

/// Reads frames from a non-blocking socket, one at a time and never past the end of the
/// current frame (what follows belongs to a later round).
class FrameReader {
 public:
  explicit FrameReader(uint64_t max_body_bytes) : max_body_bytes_(max_body_bytes) {}

  /// Whether part of a frame has been read (the link cannot be resumed at a frame boundary).
  bool started() const { return got_ > 0; }

  /// Read what the socket holds now, up to the end of the current frame; true once the frame is
  /// complete (then frame() holds it until the next call).
  /// Errors: Unavailable (closed, reset), ResourceExhausted (a length over the limit: the body is
  /// never allocated).
  Result<bool> Advance(int fd) {
    for (;;) {
      char* target = nullptr;
      size_t want = 0;
      if (got_ < kFrameHeaderBytes) {
        target = header_.data() + got_;
        want = kFrameHeaderBytes - got_;
      } else {
        const size_t body_got = got_ - kFrameHeaderBytes;
        if (body_got == frame_.body.size()) {
          got_ = 0;
          return true;
        }
        target = frame_.body.data() + body_got;
        want = frame_.body.size() - body_got;
      }
      const ssize_t received = ::recv(fd, target, want, 0);
      if (received == 0) return Unavailable("connection closed");
      if (received < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
        return Unavailable("recv: {}", ErrnoText(errno));
      }
      got_ += static_cast<size_t>(received);
      if (got_ == kFrameHeaderBytes) {
        const uint64_t length = LoadLe64(header_.data() + 12);
        if (length > max_body_bytes_) {
          return ResourceExhausted("a frame of {} bytes exceeds the limit of {}", length,
                                   max_body_bytes_);
        }
        frame_.kind = static_cast<FrameKind>(LoadLe32(header_.data()));
        frame_.round = LoadLe64(header_.data() + 4);
        frame_.body.assign(length, '\0');
      }
    }
  }

  Frame& frame() { return frame_; }

 private:
  const uint64_t max_body_bytes_;
  std::array<char, kFrameHeaderBytes> header_{};
  Frame frame_;
  size_t got_ = 0;
};

Status WriteFrame(int fd, FrameKind kind, uint64_t round, std::string_view body,
                  GroupClock::time_point deadline) {
  FrameWriter writer(kind, round, body);
  for (;;) {
    REFIT_ASSIGN_OR_RETURN(const bool done, writer.Advance(fd));
    if (done) return Status::OK();
    REFIT_RETURN_NOT_OK(AwaitReady(fd, POLLOUT, deadline));
  }
}

Result<Frame> ReadFrame(int fd, uint64_t max_body_bytes, GroupClock::time_point deadline) {
  FrameReader reader(max_body_bytes);
  for (;;) {
    REFIT_ASSIGN_OR_RETURN(const bool done, reader.Advance(fd));
    if (done) return std::move(reader.frame());
    REFIT_RETURN_NOT_OK(AwaitReady(fd, POLLIN, deadline));
  }
}

/// HMAC-SHA256(api key, nonce ‖ rank ‖ world size), integers as 4 little-endian bytes.
Result<std::array<unsigned char, kMacBytes>> JoinMac(std::string_view api_key,
                                                     std::string_view nonce, uint32_t rank,
                                                     uint32_t world_size) {
  std::array<char, kNonceBytes + 8> message{};
  std::memcpy(message.data(), nonce.data(), kNonceBytes);
  StoreLe32(rank, message.data() + kNonceBytes);
  StoreLe32(world_size, message.data() + kNonceBytes + 4);
  std::array<unsigned char, kMacBytes> mac{};
  unsigned mac_bytes = 0;
  if (HMAC(EVP_sha256(), api_key.data(), static_cast<int>(api_key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac.data(),
           &mac_bytes) == nullptr ||
      mac_bytes != kMacBytes) {
    return Internal("tcp group: HMAC-SHA256 failed");
  }
  return mac;
}

/// A rank ≥ 1's side of the join handshake on a connected socket; return rank 0's round.
/// Errors: PermissionDenied (rank 0 refused the api key), InvalidArgument (rank 0 refused the
/// rank or world size), Unavailable / DeadlineExceeded / ResourceExhausted (the connection).
Result<uint64_t> Join(int fd, const TcpGroupOptions& options, std::string_view root,
                      GroupClock::time_point deadline) {
  REFIT_ASSIGN_OR_RETURN(Frame challenge, ReadFrame(fd, kMaxHandshakeBodyBytes, deadline));
  if (challenge.kind != FrameKind::kChallenge || challenge.body.size() != kNonceBytes) {
    return Unavailable("rank 0 at {} does not speak the group protocol (no challenge)", root);
  }
  REFIT_ASSIGN_OR_RETURN(
      const auto mac, JoinMac(options.api_key, challenge.body, options.rank, options.world_size));
  std::string hello(kHelloBytes, '\0');
  StoreLe32(options.rank, hello.data());
  StoreLe32(options.world_size, hello.data() + 4);
  std::memcpy(hello.data() + 8, mac.data(), kMacBytes);
  REFIT_RETURN_NOT_OK(WriteFrame(fd, FrameKind::kHello, 0, hello, deadline));
  REFIT_ASSIGN_OR_RETURN(Frame answer, ReadFrame(fd, kMaxHandshakeBodyBytes, deadline));
  if (answer.kind == FrameKind::kWelcome) return answer.round;
  if (answer.kind == FrameKind::kRefused && !answer.body.empty()) {
    if (static_cast<Refusal>(answer.body[0]) == Refusal::kApiKey) {
      return PermissionDenied("rank 0 at {} refused this rank's api key", root);
    }
    return InvalidArgument("rank 0 at {} refused rank {} of {}: {}", root, options.rank,
                           options.world_size, std::string_view(answer.body).substr(1));
  }
  return Unavailable("rank 0 at {} does not speak the group protocol (frame kind {})", root,
                     static_cast<uint32_t>(answer.kind));
}

struct JoinedLink {
  UniqueFd fd;
  uint64_t round = 0;
};

/// Connect to rank 0 and join, retrying with a growing pause until `deadline`.
/// Errors: PermissionDenied, InvalidArgument (refusals are final), Unavailable with the last
/// attempt's error once the deadline passed (the caller says what it was trying).
Result<JoinedLink> ConnectToRoot(const TcpGroupOptions& options, const Endpoint& endpoint,
                                 std::string_view root, GroupClock::time_point deadline) {
  milliseconds pause = kFirstRetryPause;
  const auto start = GroupClock::now();
  GroupClock::time_point next_notice = start + kFirstWaitNotice;
  for (;;) {
    Status attempt;
    Result<UniqueFd> fd = ConnectOnce(endpoint, deadline);
    if (fd.ok()) {
      Result<uint64_t> round = Join(fd->get(), options, root, deadline);
      if (round.ok()) return JoinedLink{std::move(fd).ValueOrDie(), *round};
      attempt = round.status();
      if (attempt.code() == StatusCode::kPermissionDenied ||
          attempt.code() == StatusCode::kInvalidArgument) {
        return attempt;
      }
    } else {
      attempt = fd.status();
    }
    const auto now = GroupClock::now();
    if (now >= deadline) return Unavailable("{}", attempt.message());
    if (now >= next_notice) {
      // As rank 0 does for the ranks it waits for (kFirstWaitNotice).
      const std::string text = fmt::format(
          "tcp group rank {} of {}: waiting for rank 0 at {} ({}; waited {} s, {} s left)",
          options.rank, options.world_size, root, attempt.message(), WholeSeconds(now - start),
          WholeSeconds(deadline - now));
      if (now - start >= kLongWait) {
        REFIT_LOG_WARN("{}", text);
      } else {
        REFIT_LOG_INFO("{}", text);
      }
      next_notice = now + kWaitNoticeEvery;
    }
    std::this_thread::sleep_for(std::min<GroupClock::duration>(pause, deadline - now));
    pause = std::min(2 * pause, kMaxRetryPause);
  }
}

/// Rank 0 of a TCP group.
///
/// Thread-safety: one collective at a time (the caller's thread); the accept thread shares only
/// `links_` and `round_`, under `mutex_`.
class TcpRootGroup final : public ProducerGroup {
 public:
  static Result<std::unique_ptr<TcpRootGroup>> Make(const TcpGroupOptions& options,
                                                    const Endpoint& endpoint);

  ~TcpRootGroup() override {
    if (accept_thread_.joinable()) {
      accept_thread_.request_stop();
      Signal(stop_event_.get());
      accept_thread_.join();
    }
  }

  uint32_t rank() const override { return 0; }
  uint32_t world_size() const override { return options_.world_size; }
  uint16_t port() const { return port_; }

  Result<std::string> Broadcast(std::string message, GroupClock::time_point deadline) override {
    const uint64_t round = BeginRound();
    Result<std::string> result = RunBroadcast(std::move(message), round, deadline);
    EndRound();
    return result;
  }

  Result<std::vector<std::string>> Gather(std::string message,
                                          GroupClock::time_point deadline) override {
    const uint64_t round = BeginRound();
    Result<std::vector<std::string>> result = RunGather(std::move(message), round, deadline);
    EndRound();
    return result;
  }

 private:
  /// One authenticated connection to a rank. Shared between the registry and a collective in
  /// progress, so that a replacement never closes a descriptor that is still being polled: the
  /// old link is shut down (its I/O fails) and closed when its last holder lets go.
  struct Link {
    explicit Link(UniqueFd fd_in) : fd(std::move(fd_in)) {}
    UniqueFd fd;
  };

  /// A connection whose handshake is in progress on the accept thread.
  struct PendingJoin {
    PendingJoin(UniqueFd fd_in, std::string peer_in)
        : fd(std::move(fd_in)),
          peer(std::move(peer_in)),
          deadline(GroupClock::now() + kHandshakeTimeout) {}
    UniqueFd fd;
    std::string peer;
    std::array<char, kNonceBytes> nonce{};
    /// Borrows `nonce`: a PendingJoin never moves once constructed (it lives in a std::list).
    std::optional<FrameWriter> challenge;
    FrameReader hello{kMaxHandshakeBodyBytes};
    GroupClock::time_point deadline;
  };

  /// One rank's part in a collective.
  struct PeerExchange {
    enum class Phase { kAwaitingLink, kActive, kDone, kFailed };
    Phase phase = Phase::kAwaitingLink;
    std::shared_ptr<Link> link;
    std::optional<FrameWriter> writer;
    std::optional<FrameReader> reader;
    std::string message;
    Status failure;
  };

  enum class Direction { kSend, kReceive };

  TcpRootGroup(const TcpGroupOptions& options, std::string root, uint16_t port, UniqueFd listener,
               UniqueFd stop_event, UniqueFd joined_event)
      : options_(options),
        root_(std::move(root)),
        port_(port),
        listener_(std::move(listener)),
        stop_event_(std::move(stop_event)),
        joined_event_(std::move(joined_event)),
        links_(options.world_size) {}

  static void Signal(int event_fd) {
    const uint64_t one = 1;
    // An eventfd write of 8 bytes fails only when the counter would overflow, which a wake-up
    // signal cannot reach; nothing to handle.
    [[maybe_unused]] const ssize_t written = ::write(event_fd, &one, sizeof(one));
  }

  uint64_t BeginRound() {
    internal::MutexLock lock(mutex_);
    return round_;
  }
  void EndRound() {
    internal::MutexLock lock(mutex_);
    ++round_;
  }

  std::string RankText(uint32_t rank) const {
    return fmt::format("rank {} of {}", rank, options_.world_size);
  }

  /// Forget `link` as rank's link (unless it was already replaced) and shut it down, so the
  /// peer sees the drop at once even while someone still holds the descriptor.
  void DropLink(uint32_t rank, const std::shared_ptr<Link>& link) {
    {
      internal::MutexLock lock(mutex_);
      if (links_[rank] == link) links_[rank].reset();
    }
    ::shutdown(link->fd.get(), SHUT_RDWR);
  }

  void Fail(uint32_t rank, PeerExchange& peer, Status failure, bool drop) {
    if (drop && peer.link) DropLink(rank, peer.link);
    peer.failure = std::move(failure);
    peer.phase = PeerExchange::Phase::kFailed;
  }

  /// Send one frame to every other rank, or receive one from each: wait (until the deadline)
  /// for ranks not connected yet, transfer over all links at once, and settle each rank as done
  /// or failed (dropping the links of failed ones).
  std::vector<PeerExchange> Exchange(Direction direction, FrameKind kind, uint64_t round,
                                     std::string_view body, GroupClock::time_point deadline);
  /// Log which ranks this collective still waits for to connect, `waited` into the wait with
  /// `left` before the deadline: at info, at warn once the wait is long (kLongWait).
  void NoteMissingRanks(const std::vector<PeerExchange>& peers, GroupClock::duration waited,
                        GroupClock::duration left) const;
  /// Advance one rank's transfer after poll() reported `revents` on its link.
  void Progress(Direction direction, FrameKind kind, uint64_t round, std::string_view body,
                uint32_t rank, PeerExchange& peer, short revents);

  /// The error naming every failed rank, or OK: Unavailable when any rank is gone or
  /// unreachable, else DeadlineExceeded when any was late, else the first failure's code.
  Status Outcome(std::string_view collective, uint64_t round,
                 const std::vector<PeerExchange>& peers) const;

  Result<std::string> RunBroadcast(std::string message, uint64_t round,
                                   GroupClock::time_point deadline);
  Result<std::vector<std::string>> RunGather(std::string message, uint64_t round,
                                             GroupClock::time_point deadline);

  void RunAccept(const std::stop_token& stop);
  void AcceptPending(std::list<PendingJoin>& joins);
  /// Advance one handshake; true once it is over (admitted or refused).
  bool StepJoin(PendingJoin& join);
  void Admit(PendingJoin& join);
  void Refuse(PendingJoin& join, Refusal reason, std::string_view text);

  const TcpGroupOptions options_;
  /// "HOST:PORT" with the bound port, for messages.
  const std::string root_;
  const uint16_t port_;
  const UniqueFd listener_;
  /// Written by the destructor to wake the accept thread.
  const UniqueFd stop_event_;
  /// Written by the accept thread whenever a link is registered, to wake a collective waiting
  /// for ranks to connect.
  const UniqueFd joined_event_;

  internal::Mutex mutex_;
  /// Index = rank; [0] stays empty.
  std::vector<std::shared_ptr<Link>> links_ REFIT_GUARDED_BY(mutex_);
  /// The round of the collective in progress, or of the next one; written only by the
  /// collective thread.
  uint64_t round_ REFIT_GUARDED_BY(mutex_) = 0;

  /// Declared last: it starts after every member it uses exists, and is joined first.
  std::jthread accept_thread_;
};

Result<std::unique_ptr<TcpRootGroup>> TcpRootGroup::Make(const TcpGroupOptions& options,
                                                         const Endpoint& endpoint) {
  REFIT_ASSIGN_OR_RETURN(AddrInfoList addresses, Resolve(endpoint, /*passive=*/true));
  const std::string requested = EndpointText(endpoint.host, endpoint.port);
  const auto start = GroupClock::now();
  const auto deadline = start + std::min(options.connect_timeout, options.bind_timeout);
  UniqueFd listener;
  milliseconds pause = kFirstRetryPause;
  for (;;) {
    Status last = Unavailable("'{}' resolved to no address", endpoint.host);
    bool in_use = false;
    for (const addrinfo* address = addresses.get(); address != nullptr;
         address = address->ai_next) {
      UniqueFd fd(::socket(address->ai_family, address->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                           address->ai_protocol));
      if (!fd.valid()) {
        last = Unavailable("socket: {}", ErrnoText(errno));
        continue;
      }
      // A restarted rank 0 must bind while its predecessor's connections sit in TIME_WAIT.
      const int on = 1;
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
      if (::bind(fd.get(), address->ai_addr, address->ai_addrlen) != 0) {
        in_use = in_use || errno == EADDRINUSE;
        last = Unavailable("bind: {}", ErrnoText(errno));
        continue;
      }
      if (::listen(fd.get(), SOMAXCONN) != 0) {
        last = Unavailable("listen: {}", ErrnoText(errno));
        continue;
      }
      listener = std::move(fd);
      break;
    }
    if (listener.valid()) break;
    // Only a port still held by someone else can free up; any other failure is final.
    const auto now = GroupClock::now();
    if (!in_use) {
      return Unavailable("tcp group rank 0: cannot listen on {}: {}", requested, last.message());
    }
    if (now >= deadline) {
      return Unavailable(
          "tcp group rank 0: cannot listen on {}: port {} is in use by another process ({}; "
          "retried for {} ms): is another rank 0 running, or is --group's port taken?",
          requested, endpoint.port, last.message(),
          std::chrono::duration_cast<milliseconds>(now - start).count());
    }
    std::this_thread::sleep_for(std::min<GroupClock::duration>(pause, deadline - now));
    pause = std::min(2 * pause, kMaxRetryPause);
  }

  sockaddr_storage bound{};
  socklen_t bound_bytes = sizeof(bound);
  if (::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&bound), &bound_bytes) != 0) {
    return Unavailable("tcp group rank 0: getsockname on {}: {}", requested, ErrnoText(errno));
  }
  const uint16_t port =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
  UniqueFd stop_event(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  UniqueFd joined_event(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!stop_event.valid() || !joined_event.valid()) {
    return ResourceExhausted("tcp group rank 0: eventfd: {}", ErrnoText(errno));
  }
  // Not make_unique: the constructor is private.
  std::unique_ptr<TcpRootGroup> group(
      new TcpRootGroup(options, EndpointText(endpoint.host, port), port, std::move(listener),
                       std::move(stop_event), std::move(joined_event)));
  if (options.api_key.empty()) {
    REFIT_LOG_WARN(
        "tcp group rank 0 at {}: no api key, so any process that reaches this port can join as "
        "any rank",
        group->root_);
  }
  // std::jthread reports an OS refusal (EAGAIN: thread or memory limit) only by throwing; turn it
  // into a Status so no exception leaves the library.
  try {
    group->accept_thread_ =
        std::jthread([raw = group.get()](const std::stop_token& stop) { raw->RunAccept(stop); });
  } catch (const std::system_error& error) {
    return ResourceExhausted("tcp group rank 0 at {}: cannot start the accept thread: {}",
                             group->root_, error.what());
  }
  return group;
}

void TcpRootGroup::RunAccept(const std::stop_token& stop) {
  internal::NameCurrentThread(kAcceptThreadName);
  std::list<PendingJoin> joins;
  std::vector<pollfd> entries;
  while (!stop.stop_requested()) {
    entries.clear();
    entries.push_back({stop_event_.get(), POLLIN, 0});
    entries.push_back({listener_.get(), POLLIN, 0});
    GroupClock::time_point next_expiry = GroupClock::time_point::max();
    for (const PendingJoin& join : joins) {
      // Until the challenge is out the join writes; then it waits for the answer.
      const short events = join.challenge->finished() ? POLLIN : POLLOUT;
      entries.push_back({join.fd.get(), events, 0});
      next_expiry = std::min(next_expiry, join.deadline);
    }
    const int timeout = joins.empty() ? -1 : PollTimeout(next_expiry);
    if (::poll(entries.data(), entries.size(), timeout) < 0 && errno != EINTR) {
      REFIT_LOG_ERROR("tcp group rank 0 at {}: poll: {}", root_, ErrnoText(errno));
      std::this_thread::sleep_for(kAcceptErrorPause);
      continue;
    }
    if (entries[0].revents != 0) break;
    // Step the joins first: entries[2 …] follow the list as it was when they were built.
    size_t index = 2;
    const auto now = GroupClock::now();
    for (auto join = joins.begin(); join != joins.end(); ++index) {
      bool over = false;
      if (entries[index].revents != 0) {
        over = StepJoin(*join);
      } else if (now >= join->deadline) {
        REFIT_LOG_WARN(
            "tcp group rank 0 at {}: dropped a connection from {}: no handshake within {} ms",
            root_, join->peer, kHandshakeTimeout.count());
        over = true;
      }
      join = over ? joins.erase(join) : std::next(join);
    }
    if (entries[1].revents != 0) AcceptPending(joins);
  }
}

void TcpRootGroup::AcceptPending(std::list<PendingJoin>& joins) {
  for (;;) {
    sockaddr_storage address{};
    socklen_t address_bytes = sizeof(address);
    UniqueFd fd(::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&address), &address_bytes,
                          SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd.valid()) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
      // ECONNABORTED and the like concern one connection; running out of descriptors persists
      // while the listener stays readable.
      if (errno != ECONNABORTED) {
        REFIT_LOG_WARN("tcp group rank 0 at {}: accept: {}", root_, ErrnoText(errno));
        std::this_thread::sleep_for(kAcceptErrorPause);
      }
      return;
    }
    char host[NI_MAXHOST] = "?";
    char service[NI_MAXSERV] = "?";
    ::getnameinfo(reinterpret_cast<sockaddr*>(&address), address_bytes, host, sizeof(host), service,
                  sizeof(service), NI_NUMERICHOST | NI_NUMERICSERV);
    std::string peer = fmt::format("{}:{}", host, service);
    if (joins.size() >= kMaxPendingJoins) {
      REFIT_LOG_WARN(
          "tcp group rank 0 at {}: closed a connection from {}: {} handshakes already "
          "in progress",
          root_, peer, kMaxPendingJoins);
      continue;
    }
    SetNoDelay(fd.get());
    PendingJoin& join = joins.emplace_back(std::move(fd), std::move(peer));
    if (RAND_bytes(reinterpret_cast<unsigned char*>(join.nonce.data()), kNonceBytes) != 1) {
      REFIT_LOG_ERROR("tcp group rank 0 at {}: RAND_bytes failed; closed the connection from {}",
                      root_, join.peer);
      joins.pop_back();
      continue;
    }
    join.challenge.emplace(FrameKind::kChallenge, 0,
                           std::string_view(join.nonce.data(), join.nonce.size()));
  }
}

bool TcpRootGroup::StepJoin(PendingJoin& join) {
  const auto failed = [&](const Status& status) {
    REFIT_LOG_WARN("tcp group rank 0 at {}: handshake with {} failed: {}", root_, join.peer,
                   status.message());
    return true;
  };
  Result<bool> challenged = join.challenge->Advance(join.fd.get());
  if (!challenged.ok()) return failed(challenged.status());
  if (!*challenged) return false;
  Result<bool> answered = join.hello.Advance(join.fd.get());
  if (!answered.ok()) return failed(answered.status());
  if (!*answered) return false;
  Admit(join);
  return true;
}

void TcpRootGroup::Admit(PendingJoin& join) {
  const Frame& hello = join.hello.frame();
  if (hello.kind != FrameKind::kHello || hello.body.size() != kHelloBytes) {
    REFIT_LOG_WARN("tcp group rank 0 at {}: closed a connection from {}: not a group handshake",
                   root_, join.peer);
    return;
  }
  const uint32_t rank = LoadLe32(hello.body.data());
  const uint32_t world_size = LoadLe32(hello.body.data() + 4);
  // Authenticate before trusting anything the peer claims.
  Result<std::array<unsigned char, kMacBytes>> expected =
      JoinMac(options_.api_key, std::string_view(join.nonce.data(), kNonceBytes), rank, world_size);
  if (!expected.ok() || CRYPTO_memcmp(expected->data(), hello.body.data() + 8, kMacBytes) != 0) {
    REFIT_LOG_WARN("tcp group rank 0 at {}: refused {} (claiming rank {}): wrong api key", root_,
                   join.peer, rank);
    Refuse(join, Refusal::kApiKey, "wrong api key");
    return;
  }
  if (world_size != options_.world_size || rank == 0 || rank >= options_.world_size) {
    const std::string why = fmt::format("rank {} of {} is not a member of this group of {} ranks",
                                        rank, world_size, options_.world_size);
    REFIT_LOG_WARN("tcp group rank 0 at {}: refused {}: {}", root_, join.peer, why);
    Refuse(join, Refusal::kMembership, why);
    return;
  }
  std::shared_ptr<Link> replaced;
  {
    // The WELCOME carries the round and the link is registered under one lock, so the joiner's
    // round is the one of the first collective that can see the link.
    internal::MutexLock lock(mutex_);
    std::array<char, kFrameHeaderBytes> welcome{};
    StoreLe32(static_cast<uint32_t>(FrameKind::kWelcome), welcome.data());
    StoreLe64(round_, welcome.data() + 4);
    // 20 bytes on a connection whose peer is waiting for them: the socket buffer takes them at
    // once, or the connection is broken.
    if (::send(join.fd.get(), welcome.data(), welcome.size(), MSG_NOSIGNAL | MSG_DONTWAIT) !=
        static_cast<ssize_t>(welcome.size())) {
      REFIT_LOG_WARN("tcp group rank 0 at {}: could not welcome rank {} from {}: {}", root_, rank,
                     join.peer, ErrnoText(errno));
      return;
    }
    replaced = std::exchange(links_[rank], std::make_shared<Link>(std::move(join.fd)));
  }
  if (replaced) ::shutdown(replaced->fd.get(), SHUT_RDWR);
  Signal(joined_event_.get());
  REFIT_LOG_INFO("tcp group rank 0 at {}: {} joined from {}{}", root_, RankText(rank), join.peer,
                 replaced ? " (replacing its earlier connection)" : "");
}

void TcpRootGroup::Refuse(PendingJoin& join, Refusal reason, std::string_view text) {
  std::string body(1, static_cast<char>(reason));
  body.append(text.substr(0, kMaxHandshakeBodyBytes - 1));
  FrameWriter refusal(FrameKind::kRefused, 0, body);
  // Best effort, without waiting: the connection is closed either way.
  Result<bool> sent = refusal.Advance(join.fd.get());
  sent.status().IgnoreError();
}

std::vector<TcpRootGroup::PeerExchange> TcpRootGroup::Exchange(Direction direction, FrameKind kind,
                                                               uint64_t round,
                                                               std::string_view body,
                                                               GroupClock::time_point deadline) {
  using Phase = PeerExchange::Phase;
  std::vector<PeerExchange> peers(options_.world_size);
  peers[0].phase = Phase::kDone;
  std::vector<pollfd> entries;
  std::vector<uint32_t> entry_ranks;
  const auto start = GroupClock::now();
  GroupClock::time_point next_notice = start + kFirstWaitNotice;
  for (;;) {
    bool awaiting = false;
    bool active = false;
    {
      internal::MutexLock lock(mutex_);
      for (uint32_t rank = 1; rank < options_.world_size; ++rank) {
        PeerExchange& peer = peers[rank];
        if (peer.phase == Phase::kAwaitingLink && links_[rank]) {
          peer.link = links_[rank];
          peer.phase = Phase::kActive;
          if (direction == Direction::kSend) {
            peer.writer.emplace(kind, round, body);
          } else {
            peer.reader.emplace(options_.max_message_bytes);
          }
        }
        awaiting = awaiting || peer.phase == Phase::kAwaitingLink;
        active = active || peer.phase == Phase::kActive;
      }
    }
    if (!awaiting && !active) break;
    const auto now = GroupClock::now();
    if (now >= deadline) {
      for (uint32_t rank = 1; rank < options_.world_size; ++rank) {
        PeerExchange& peer = peers[rank];
        if (peer.phase == Phase::kAwaitingLink) {
          Fail(rank, peer, Unavailable("{} is not connected", RankText(rank)), /*drop=*/false);
        } else if (peer.phase == Phase::kActive) {
          const bool started =
              direction == Direction::kSend ? peer.writer->started() : peer.reader->started();
          Fail(rank, peer,
               DeadlineExceeded(
                   "{} {} by the deadline", RankText(rank),
                   direction == Direction::kSend
                       ? (started ? "did not take the whole message" : "took none of the message")
                       : (started ? "sent only part of its message" : "sent nothing")),
               /*drop=*/true);
        }
      }
      break;
    }
    if (awaiting && now >= next_notice) {
      NoteMissingRanks(peers, now - start, deadline - now);
      next_notice = now + kWaitNoticeEvery;
    }
    entries.clear();
    entry_ranks.clear();
    if (awaiting) {
      entries.push_back({joined_event_.get(), POLLIN, 0});
      entry_ranks.push_back(0);
    }
    for (uint32_t rank = 1; rank < options_.world_size; ++rank) {
      if (peers[rank].phase != Phase::kActive) continue;
      // A sender also watches for the peer hanging up, which a writable socket hides.
      const short events = direction == Direction::kSend ? (POLLOUT | POLLRDHUP) : POLLIN;
      entries.push_back({peers[rank].link->fd.get(), events, 0});
      entry_ranks.push_back(rank);
    }
    // Waiting for ranks to connect, wake up for the next notice too.
    const int timeout = awaiting ? std::min(PollTimeout(deadline), PollTimeout(next_notice))
                                 : PollTimeout(deadline);
    if (::poll(entries.data(), entries.size(), timeout) < 0 && errno != EINTR) {
      const std::string error = ErrnoText(errno);
      for (uint32_t rank = 1; rank < options_.world_size; ++rank) {
        PeerExchange& peer = peers[rank];
        if (peer.phase == Phase::kActive || peer.phase == Phase::kAwaitingLink) {
          Fail(rank, peer, Unavailable("{}: poll: {}", RankText(rank), error),
               peer.phase == Phase::kActive);
        }
      }
      break;
    }
    for (size_t index = 0; index < entries.size(); ++index) {
      if (entries[index].revents == 0) continue;
      const uint32_t rank = entry_ranks[index];
      if (rank == 0) {
        // Drain the join signal; the next pass picks the new links up.
        uint64_t count = 0;
        [[maybe_unused]] const ssize_t drained = ::read(joined_event_.get(), &count, sizeof(count));
        continue;
      }
      Progress(direction, kind, round, body, rank, peers[rank], entries[index].revents);
    }
  }
  return peers;
}

void TcpRootGroup::NoteMissingRanks(const std::vector<PeerExchange>& peers,
                                    GroupClock::duration waited, GroupClock::duration left) const {
  std::vector<uint32_t> missing;
  for (uint32_t rank = 1; rank < options_.world_size; ++rank) {
    if (peers[rank].phase == PeerExchange::Phase::kAwaitingLink) missing.push_back(rank);
  }
  const std::string text = fmt::format(
      "tcp group rank 0 at {}: waiting for rank(s) {} of {} to connect ({} of {} connected; "
      "waited {} s, {} s left): start them with --group tcp://{} and the same api key",
      root_, fmt::join(missing, ", "), options_.world_size,
      options_.world_size - static_cast<uint32_t>(missing.size()), options_.world_size,
      WholeSeconds(waited), WholeSeconds(left), root_);
  if (waited >= kLongWait) {
    REFIT_LOG_WARN("{}", text);
  } else {
    REFIT_LOG_INFO("{}", text);
  }
}

void TcpRootGroup::Progress(Direction direction, FrameKind kind, uint64_t round,
                            std::string_view body, uint32_t rank, PeerExchange& peer,
                            short revents) {
  using Phase = PeerExchange::Phase;
  if (direction == Direction::kSend) {
    if ((revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
      if (!peer.writer->started()) {
        // The rank hung up before this round reached it: it is not connected, and may still
        // reconnect within the deadline (a restarting process).
        DropLink(rank, peer.link);
        peer.link.reset();
        peer.writer.reset();
        peer.phase = Phase::kAwaitingLink;
        return;
      }
      Fail(rank, peer, Unavailable("{} is gone: connection closed", RankText(rank)), true);
      return;
    }
    Result<bool> done = peer.writer->Advance(peer.link->fd.get());
    if (!done.ok()) {
      Fail(rank, peer, Unavailable("{} is gone: {}", RankText(rank), done.status().message()),
           true);
    } else if (*done) {
      peer.phase = Phase::kDone;
    }
    return;
  }
  // Receive: read frames until this round's arrives or the socket runs dry.
  for (;;) {
    Result<bool> complete = peer.reader->Advance(peer.link->fd.get());
    if (!complete.ok()) {
      const Status& error = complete.status();
      if (error.code() == StatusCode::kResourceExhausted) {
        Fail(rank, peer, ResourceExhausted("{}: {}", RankText(rank), error.message()), true);
      } else {
        Fail(rank, peer, Unavailable("{} is gone: {}", RankText(rank), error.message()), true);
      }
      return;
    }
    if (!*complete) return;
    Frame& frame = peer.reader->frame();
    const bool collective = frame.kind == kind || frame.kind == FrameKind::kOversized;
    if (collective && frame.round < round) continue;  // of a collective rank 0 gave up on
    if (!collective || frame.round > round) {
      Fail(rank, peer,
           Unavailable("{} is out of step: it sent a frame of kind {} for round {}", RankText(rank),
                       static_cast<uint32_t>(frame.kind), frame.round),
           true);
      return;
    }
    if (frame.kind == FrameKind::kOversized) {
      // A clean frame boundary: the link stays.
      Fail(rank, peer,
           ResourceExhausted("{}: its message of {} bytes exceeds its limit", RankText(rank),
                             frame.body.size() == 8 ? LoadLe64(frame.body.data()) : 0),
           false);
      return;
    }
    peer.message = std::move(frame.body);
    peer.phase = Phase::kDone;
    return;
  }
}

Status TcpRootGroup::Outcome(std::string_view collective, uint64_t round,
                             const std::vector<PeerExchange>& peers) const {
  std::vector<std::string> problems;
  std::optional<StatusCode> code;
  for (const PeerExchange& peer : peers) {
    if (peer.phase != PeerExchange::Phase::kFailed) continue;
    problems.push_back(peer.failure.message());
    const StatusCode failed = peer.failure.code();
    if (!code || failed == StatusCode::kUnavailable ||
        (failed == StatusCode::kDeadlineExceeded && *code != StatusCode::kUnavailable)) {
      code = failed;
    }
  }
  if (!code) return Status::OK();
  return Status(*code, fmt::format("tcp group rank 0 at {}, {} of round {}: {}", root_, collective,
                                   round, fmt::join(problems, "; ")));
}

Result<std::string> TcpRootGroup::RunBroadcast(std::string message, uint64_t round,
                                               GroupClock::time_point deadline) {
  if (message.size() > options_.max_message_bytes) {
    // Tell the others, so they fail now rather than at their deadlines.
    const std::string size = SizeBody(message.size());
    Exchange(Direction::kSend, FrameKind::kOversized, round, size, deadline);
    return ResourceExhausted(
        "tcp group rank 0 at {}, broadcast of round {}: a message of {} bytes exceeds the limit "
        "of {}",
        root_, round, message.size(), options_.max_message_bytes);
  }
  if (options_.world_size > 1) {
    const std::vector<PeerExchange> peers =
        Exchange(Direction::kSend, FrameKind::kBroadcast, round, message, deadline);
    REFIT_RETURN_NOT_OK(Outcome("broadcast", round, peers));
  }
  return message;
}

Result<std::vector<std::string>> TcpRootGroup::RunGather(std::string message, uint64_t round,
                                                         GroupClock::time_point deadline) {
  // The others' messages of this round stay unread; their round stamps get them discarded.
  if (message.size() > options_.max_message_bytes) {
    return ResourceExhausted(
        "tcp group rank 0 at {}, gather of round {}: its own message of {} bytes exceeds the "
        "limit of {}",
        root_, round, message.size(), options_.max_message_bytes);
  }
  std::vector<std::string> messages;
  messages.reserve(options_.world_size);
  messages.push_back(std::move(message));
  if (options_.world_size > 1) {
    std::vector<PeerExchange> peers =
        Exchange(Direction::kReceive, FrameKind::kGather, round, {}, deadline);
    REFIT_RETURN_NOT_OK(Outcome("gather", round, peers));
    for (uint32_t rank = 1; rank < options_.world_size; ++rank) {
      messages.push_back(std::move(peers[rank].message));
    }
  }
  return messages;
}

/// A rank ≥ 1 of a TCP group: one link to rank 0, reconnected by the collective after a drop.
///
/// Thread-safety: one collective at a time; nothing runs in the background.
class TcpMemberGroup final : public ProducerGroup {
 public:
  TcpMemberGroup(const TcpGroupOptions& options, Endpoint endpoint, JoinedLink link)
      : options_(options),
        endpoint_(std::move(endpoint)),
        root_(EndpointText(endpoint_.host, endpoint_.port)),
        link_(std::move(link.fd)),
        round_(link.round) {}

  uint32_t rank() const override { return options_.rank; }
  uint32_t world_size() const override { return options_.world_size; }

  Result<std::string> Broadcast(std::string message, GroupClock::time_point deadline) override {
    const uint64_t round = round_++;
    const std::string context = Context("broadcast", round);
    REFIT_RETURN_NOT_OK(EnsureLink(deadline).WithContext(context));
    for (;;) {
      Result<Frame> read = ReadFrame(link_.get(), options_.max_message_bytes, deadline);
      if (!read.ok()) {
        link_.Reset();
        return LinkFailure(read.status(), "sent nothing").WithContext(context);
      }
      Frame& frame = read.ValueOrDie();
      if (frame.kind != FrameKind::kBroadcast && frame.kind != FrameKind::kOversized) {
        link_.Reset();
        return Unavailable("{}: rank 0 at {} is out of step: it sent a frame of kind {}", context,
                           root_, static_cast<uint32_t>(frame.kind));
      }
      // Sent to this link for a round this rank had already given up.
      if (frame.round < round) continue;
      if (frame.round > round) {
        // Rank 0 went on without this rank; continue from rank 0's numbering so the next
        // collective is in step again.
        round_ = frame.round + 1;
        return FailedPrecondition(
            "{}: rank 0 at {} is at round {}: this rank missed {} collectives and continues from "
            "round {}",
            context, root_, frame.round, frame.round - round, round_);
      }
      if (frame.kind == FrameKind::kOversized) {
        return ResourceExhausted("{}: rank 0's message of {} bytes exceeds its limit", context,
                                 frame.body.size() == 8 ? LoadLe64(frame.body.data()) : 0);
      }
      return std::move(frame.body);
    }
  }

  Result<std::vector<std::string>> Gather(std::string message,
                                          GroupClock::time_point deadline) override {
    const uint64_t round = round_++;
    const std::string context = Context("gather", round);
    if (link_.valid() && PeerClosed(link_.get())) {
      // A write would land in the socket buffer and "succeed"; say what happened instead.
      link_.Reset();
      return Unavailable("{}: rank 0 at {} is gone: connection closed", context, root_);
    }
    REFIT_RETURN_NOT_OK(EnsureLink(deadline).WithContext(context));
    const bool oversized = message.size() > options_.max_message_bytes;
    const std::string size = oversized ? SizeBody(message.size()) : std::string();
    Status written = oversized
                         ? WriteFrame(link_.get(), FrameKind::kOversized, round, size, deadline)
                         : WriteFrame(link_.get(), FrameKind::kGather, round, message, deadline);
    if (!written.ok()) {
      link_.Reset();
      return LinkFailure(written, "did not take this rank's message").WithContext(context);
    }
    if (oversized) {
      return ResourceExhausted("{}: a message of {} bytes exceeds the limit of {}", context,
                               message.size(), options_.max_message_bytes);
    }
    return std::vector<std::string>{};
  }

 private:
  std::string Context(std::string_view collective, uint64_t round) const {
    return fmt::format("tcp group rank {} of {}, {} of round {}", options_.rank,
                       options_.world_size, collective, round);
  }

  /// Reconnect to rank 0 if the link was dropped. Errors: as ConnectToRoot.
  Status EnsureLink(GroupClock::time_point deadline) {
    if (link_.valid()) return Status::OK();
    Result<JoinedLink> joined = ConnectToRoot(options_, endpoint_, root_, deadline);
    if (!joined.ok()) {
      if (joined.status().code() != StatusCode::kUnavailable) return joined.status();
      return Unavailable("rank 0 at {} is gone: no connection by the deadline: {}", root_,
                         joined.status().message());
    }
    // This rank keeps its own round numbering: it has been counting along.
    link_ = std::move(joined->fd);
    return Status::OK();
  }

  Status LinkFailure(const Status& error, std::string_view late) const {
    switch (error.code()) {
      case StatusCode::kDeadlineExceeded:
        return DeadlineExceeded("rank 0 at {} {} by the deadline", root_, late);
      case StatusCode::kResourceExhausted:
        return ResourceExhausted("rank 0 at {}: {}", root_, error.message());
      default:
        return Unavailable("rank 0 at {} is gone: {}", root_, error.message());
    }
  }

  const TcpGroupOptions options_;
  const Endpoint endpoint_;
  /// "HOST:PORT" of rank 0, for messages.
  const std::string root_;
  /// Invalid after a failure until the next collective reconnects.
  UniqueFd link_;
  /// The round of this rank's next collective.
  uint64_t round_;
};

}  // namespace

Result<std::unique_ptr<ProducerGroup>> MakeTcpGroup(const TcpGroupOptions& options) {
  if (options.world_size == 0) return InvalidArgument("tcp group: world size 0 (need at least 1)");
  if (options.rank >= options.world_size) {
    return InvalidArgument("tcp group: rank {} is not below the world size {}", options.rank,
                           options.world_size);
  }
  Result<Endpoint> parsed = ParseAddress(options.address);
  if (!parsed.ok()) return parsed.status().WithContext("tcp group");
  Endpoint endpoint = *std::move(parsed);
  if (options.rank == 0) {
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<TcpRootGroup> root,
                           TcpRootGroup::Make(options, endpoint));
    return std::unique_ptr<ProducerGroup>(std::move(root));
  }
  if (endpoint.port == 0) {
    return InvalidArgument("tcp group rank {}: address '{}' has port 0; only rank 0 may pick one",
                           options.rank, options.address);
  }
  const std::string root = EndpointText(endpoint.host, endpoint.port);
  Result<JoinedLink> joined =
      ConnectToRoot(options, endpoint, root, GroupClock::now() + options.connect_timeout);
  if (!joined.ok()) {
    const std::string context =
        fmt::format("tcp group rank {} of {}", options.rank, options.world_size);
    if (joined.status().code() != StatusCode::kUnavailable) {
      return joined.status().WithContext(context);
    }
    return Unavailable("{}: cannot reach rank 0 at {} within {} ms: {}", context, root,
                       options.connect_timeout.count(), joined.status().message());
  }
  JoinedLink link = std::move(joined).ValueOrDie();
  return std::unique_ptr<ProducerGroup>(
      std::make_unique<TcpMemberGroup>(options, std::move(endpoint), std::move(link)));
}

uint16_t TcpGroupPort(const ProducerGroup& group) {
  const auto* root = dynamic_cast<const TcpRootGroup*>(&group);
  return root != nullptr ? root->port() : 0;
}

}  // namespace refit
