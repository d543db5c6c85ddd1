// The control plane against slow and oversized clients (issue 13): peers that drip request
// heads must not take the workers /healthz needs; a receiver that drips its reply must not hold
// the control client past its deadline; a prepare body is bounded by the model's tensor count;
// an unauthenticated request is answered 401, whatever its size.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "control/control_server.h"
#include "control/protocol.h"
#include "refit/control_client.h"
#include "test_data.h"
#include "test_util.h"

namespace refit {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr const char* kApiKey = "slow-clients-test-key";
// Slack on top of a deadline for scheduling on a loaded CI machine.
constexpr auto kSlack = std::chrono::milliseconds(750);

// A socket connected to 127.0.0.1:`port`, from `source` (any 127/8 address is loopback on
// Linux, so tests can be several peers); -1 on failure.
int Connect(uint16_t port, const char* source = "127.0.0.1") {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source, &from.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0) {
    ::close(fd);
    return -1;
  }
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(port);
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

class ControlSlowClientsTest : public ::testing::Test {
 protected:
  void StartServer(ControlServerOptions options) {
    store_ = WeightStore::Make();
    for (int t = 0; t < 3; ++t) {
      ASSERT_OK(
          store_->AddCopy(testing::RandomTensor("layers." + std::to_string(t) + ".weight",
                                                DType::kFloat32, {64}, static_cast<uint64_t>(t))
                              .view()));
    }
    ASSERT_OK_AND_ASSIGN(session_, internal::ReceiverSession::Make({}, *store_));
    options.api_key = kApiKey;
    ASSERT_OK_AND_ASSIGN(server_, ControlServer::Make(options, *session_, *store_));
    ASSERT_OK(server_->Start());
  }

  void TearDown() override {
    for (int fd : drippers_) ::close(fd);
    if (server_ != nullptr) server_->Stop();
  }

  // Open `n` connections from `source` that send the start of a request head and then one
  // byte at a time, never finishing it.
  void StartDripping(size_t n, const char* source) {
    for (size_t i = 0; i < n; ++i) {
      const int fd = Connect(server_->port(), source);
      if (fd < 0) continue;
      const std::string start = "GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Drip: ";
      ::send(fd, start.data(), start.size(), MSG_NOSIGNAL);
      drippers_.push_back(fd);
    }
    drip_ = std::jthread([this](std::stop_token stop) {
      while (!stop.stop_requested()) {
        for (int fd : drippers_) ::send(fd, "a", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    });
  }

  // The coordinator's client: the api key, one attempt per call within `timeout`.
  Result<std::unique_ptr<ControlClient>> CoordinatorClient(std::chrono::milliseconds timeout) {
    ControlClientOptions options;
    options.base_url = server_->base_url();
    options.api_key = kApiKey;
    options.timeout = timeout;
    options.max_retries = 0;
    return ControlClient::Make(options);
  }

  // GET /healthz on a fresh connection; the time it took, or nullopt when it failed.
  std::optional<std::chrono::milliseconds> TimeHealthz() {
    ControlClientOptions options;
    options.base_url = server_->base_url();
    options.timeout = std::chrono::seconds(3);
    options.max_retries = 0;
    auto client = ControlClient::Make(options);
    if (!client.ok()) return std::nullopt;
    const Clock::time_point start = Clock::now();
    if (!(*client)->CheckHealth().ok()) return std::nullopt;
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  }

  std::unique_ptr<WeightStore> store_;
  std::unique_ptr<internal::ReceiverSession> session_;
  std::unique_ptr<ControlServer> server_;
  std::vector<int> drippers_;
  std::jthread drip_;
};

TEST_F(ControlSlowClientsTest, HeadDrippersAsManyAsWorkersDoNotStopHealthz) {
  ControlServerOptions options;
  options.worker_threads = 4;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  // Twice as many as workers, from the health checker's own address.
  StartDripping(2 * options.worker_threads, "127.0.0.1");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::optional<std::chrono::milliseconds> took = TimeHealthz();
  ASSERT_TRUE(took.has_value()) << "/healthz did not answer while heads were dripping";
  EXPECT_LT(*took, std::chrono::seconds(1));
}

TEST_F(ControlSlowClientsTest, ManyDrippersFromOnePeerAreCappedAndOthersStillConnect) {
  ControlServerOptions options;
  options.max_connections_per_peer = 16;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  StartDripping(200, "127.0.0.2");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::optional<std::chrono::milliseconds> took = TimeHealthz();
  ASSERT_TRUE(took.has_value()) << "/healthz did not answer beside 200 dripping connections";
  EXPECT_LT(*took, std::chrono::seconds(1));
  // Beyond its cap, the dripping peer's connections were answered 503 and closed.
  size_t closed = 0;
  for (int fd : drippers_) {
    pollfd entry{fd, POLLIN, 0};
    char byte = 0;
    if (::poll(&entry, 1, 0) > 0 && ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) >= 0) ++closed;
  }
  EXPECT_GE(closed, 200u - options.max_connections_per_peer);
}

// Issue 26, finding 1: unauthenticated requests that declare a large body and then drip it (or
// send nothing) are answered 401 at once; the discarding of their bodies must not take the
// workers. Before, each held a worker for a second of lingering: 64 of them kept 4 workers busy
// and /healthz and the coordinator's calls waited seconds.
TEST_F(ControlSlowClientsTest, UnauthenticatedBodyDrippersDoNotStallHealthzOrTheCoordinator) {
  ControlServerOptions options;
  options.worker_threads = 4;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  const uint16_t port = server_->port();
  std::atomic<uint64_t> requests{0};
  // 64 connections, re-opened as the server closes them: each sends a complete head without a
  // key, declaring 100 MB, then a body byte every 50 ms.
  std::jthread flood([&](std::stop_token stop) {
    std::vector<int> open;
    const std::string head =
        "POST /v1/payload HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n";
    while (!stop.stop_requested()) {
      while (open.size() < 64) {
        const int fd = Connect(port);
        if (fd < 0) break;
        ::send(fd, head.data(), head.size(), MSG_NOSIGNAL);
        open.push_back(fd);
        ++requests;
      }
      std::erase_if(open, [](int fd) {
        pollfd entry{fd, POLLIN, 0};
        char sink[4096];
        if (::poll(&entry, 1, 0) > 0 && ::recv(fd, sink, sizeof sink, MSG_DONTWAIT) <= 0) {
          ::close(fd);
          return true;
        }
        ::send(fd, "x", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        return false;
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (int fd : open) ::close(fd);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ControlClient> client,
                       CoordinatorClient(std::chrono::seconds(5)));
  std::chrono::milliseconds slowest{0};
  for (int i = 0; i < 10; ++i) {
    const std::optional<std::chrono::milliseconds> took = TimeHealthz();
    ASSERT_TRUE(took.has_value()) << "/healthz failed during the flood (call " << i << ")";
    const Clock::time_point start = Clock::now();
    ASSERT_OK(client->GetStatus().status());
    const auto status_took =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    slowest = std::max({slowest, *took, status_took});
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  flood.request_stop();
  flood.join();
  EXPECT_GT(requests.load(), 64u) << "the flood did not churn";
  EXPECT_LT(slowest, std::chrono::milliseconds(250) + kSlack)
      << "a control call waited behind the lingering unauthenticated requests";
}

// Issue 26, finding 2: head drippers from the coordinator's own address (same host, or behind
// the same NAT) filled its per-address cap, and /healthz and the coordinator's calls got 503.
// Now a new connection over the cap replaces the oldest one that never completed a head.
TEST_F(ControlSlowClientsTest, HeadDrippersAtTheCoordinatorsAddressCannotLockItOut) {
  ControlServerOptions options;
  options.max_connections_per_peer = 16;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  StartDripping(64, "127.0.0.1");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ControlClient> client,
                       CoordinatorClient(std::chrono::seconds(3)));
  for (int i = 0; i < 5; ++i) {
    const Status status = client->GetStatus().status();
    ASSERT_TRUE(status.ok()) << "call " << i << ": " << status.ToString();
    const std::optional<std::chrono::milliseconds> took = TimeHealthz();
    ASSERT_TRUE(took.has_value()) << "/healthz refused beside 64 drippers at its own address";
    EXPECT_LT(*took, std::chrono::seconds(1));
  }
}

// Issue 26: "the client reports the server's 503 as such". Connections that completed their
// heads are being served and are never replaced, so a server whose total they fill answers 503
// (a peer's cap counts only its connections that have not sent a request: issue 45); the
// coordinator's client must say so (Unavailable with the server's reason), not report a read
// error.
TEST_F(ControlSlowClientsTest, AClientOverTheServersCapReportsTheServers503) {
  ControlServerOptions options;
  options.max_connections = 2;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  // Two authenticated requests whose heads are complete and whose bodies never come: each holds
  // its connection (and a worker) until the body read times out.
  const std::string head = fmt::format(
      "POST /v1/prepare HTTP/1.1\r\nHost: x\r\nX-Refit-Api-Key: {}\r\nContent-Type: "
      "application/json\r\nContent-Length: 100\r\n\r\n",
      kApiKey);
  for (int i = 0; i < 2; ++i) {
    const int fd = Connect(server_->port(), "127.0.0.1");
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::send(fd, head.data(), head.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(head.size()));
    drippers_.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ControlClient> client,
                       CoordinatorClient(std::chrono::seconds(3)));
  const Status refused = client->GetStatus().status();
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable) << refused.ToString();
  EXPECT_NE(refused.message().find("too many connections to this server"), std::string::npos)
      << refused.ToString();
}

// One `Connection: close` request on a fresh connection from `source`: the reply's status code,
// or 0 when the exchange failed.
int OneShotRequest(uint16_t port, const char* source, std::string_view request) {
  const int fd = Connect(port, source);
  if (fd < 0) return 0;
  int status = 0;
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
      static_cast<ssize_t>(request.size())) {
    std::string reply;
    char buffer[4096];
    while (reply.size() < sizeof "HTTP/1.1 200") {
      pollfd entry{fd, POLLIN, 0};
      if (::poll(&entry, 1, 5000) <= 0) break;
      const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
      if (n <= 0) break;
      reply.append(buffer, static_cast<size_t>(n));
    }
    if (reply.starts_with("HTTP/1.1 ") && reply.size() >= 12)
      status = std::stoi(reply.substr(9, 3));
  }
  ::close(fd);
  return status;
}

// Issue 45, item 3: 64 clients at one address, each sending `Connection: close` requests as fast
// as it can, are as many as the per-address cap, and are legitimate load: each has at most one
// connection that has not sent its request yet. Counting the connections that were being served
// or closed against the cap answered some of them 503 (59 in the issue's run).
TEST_F(ControlSlowClientsTest, AsManyFullSpeedClientsAsTheCapAtOneAddressGetNo503) {
  ControlServerOptions options;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  ASSERT_EQ(options.max_connections_per_peer, 64u);
  const uint16_t port = server_->port();
  constexpr std::string_view kRequest =
      "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  constexpr auto kLoad = std::chrono::seconds(2);
  std::atomic<uint64_t> ok{0};
  std::atomic<uint64_t> busy{0};
  std::atomic<uint64_t> failed{0};
  {
    std::vector<std::jthread> clients;
    const Clock::time_point end = Clock::now() + kLoad;
    for (size_t c = 0; c < options.max_connections_per_peer; ++c) {
      clients.emplace_back([&] {
        while (Clock::now() < end) {
          const int status = OneShotRequest(port, "127.0.0.1", kRequest);
          ++(status == 200 ? ok : status == 503 ? busy : failed);
        }
      });
    }
  }
  EXPECT_GT(ok.load(), 1000u) << "the clients did not run at full speed";
  EXPECT_EQ(busy.load(), 0u) << "of " << ok.load() + busy.load() + failed.load() << " requests";
  EXPECT_EQ(failed.load(), 0u);
}

// Issue 45, item 3: /healthz beside 200 head drippers at its own address, which re-connect as
// fast as they are replaced: the health check's head comes with its connection, so it is served
// rather than replaced. (Its connection can still be replaced when 64 newer connections of its
// address arrive before its head does: on this 2-core machine about 1 in 200 times, where
// counting every connection against the cap refused 13 in 200; docs/security.md.)
TEST_F(ControlSlowClientsTest, HealthzBesideChurningDrippersAtItsAddressIsServed) {
  ControlServerOptions options;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  const uint16_t port = server_->port();
  constexpr size_t kDrippers = 200;
  std::jthread churn([&](std::stop_token stop) {
    const std::string start = "GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Drip: ";
    std::vector<int> open;
    while (!stop.stop_requested()) {
      while (open.size() < kDrippers) {
        const int fd = Connect(port, "127.0.0.1");
        if (fd < 0) break;
        ::send(fd, start.data(), start.size(), MSG_NOSIGNAL);
        open.push_back(fd);
      }
      std::erase_if(open, [](int fd) {
        pollfd entry{fd, POLLIN, 0};
        if (::poll(&entry, 1, 0) > 0) {
          ::close(fd);
          return true;
        }
        ::send(fd, "a", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        return false;
      });
    }
    for (int fd : open) ::close(fd);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  constexpr std::string_view kHealthz =
      "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  std::map<int, int> statuses;
  for (int i = 0; i < 200; ++i) ++statuses[OneShotRequest(port, "127.0.0.1", kHealthz)];
  churn.request_stop();
  churn.join();
  constexpr int kMostReplaced = 2;
  EXPECT_GE(statuses[200], 200 - kMostReplaced)
      << "503: " << statuses[503] << ", failed: " << statuses[0];
  EXPECT_EQ(statuses[0], 0);
}

TEST_F(ControlSlowClientsTest, HeadThatNeverEndsIsClosedAtTheHeadTimeout) {
  ControlServerOptions options;
  options.request_head_timeout = std::chrono::milliseconds(500);
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  StartDripping(1, "127.0.0.1");
  ASSERT_EQ(drippers_.size(), 1u);
  pollfd entry{drippers_[0], POLLIN, 0};
  ASSERT_EQ(::poll(&entry, 1, 500 + static_cast<int>(kSlack.count()) * 2), 1);
  char reply[64] = {};
  ASSERT_GT(::recv(drippers_[0], reply, sizeof reply - 1, 0), 0);
  EXPECT_TRUE(std::string(reply).starts_with("HTTP/1.1 408")) << reply;
}

// A receiver that accepts, reads the request and then sends its reply one byte at a time, each
// byte well within any per-read timeout.
class DrippingReceiver {
 public:
  DrippingReceiver() {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof address);
    ::listen(listen_fd_, 16);
    socklen_t length = sizeof address;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::jthread([this](std::stop_token stop) { Serve(stop); });
  }
  ~DrippingReceiver() {
    thread_.request_stop();
    ::shutdown(listen_fd_, SHUT_RDWR);
    thread_.join();
    ::close(listen_fd_);
  }
  std::string url() const { return fmt::format("http://127.0.0.1:{}", port_); }

 private:
  void Serve(std::stop_token stop) {
    const std::string reply =
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"
        "{\"ok\": true, \"version\": 1, \"pad\": \"....\"}";
    while (!stop.stop_requested()) {
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) return;
      char buffer[4096];
      ::recv(fd, buffer, sizeof buffer, 0);
      for (char c : reply) {
        if (stop.stop_requested() || ::send(fd, &c, 1, MSG_NOSIGNAL) != 1) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      ::close(fd);
    }
  }

  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::jthread thread_;
};

TEST(ControlClientDeadlineTest, DrippingReceiverDoesNotHoldTheClientPastItsTimeout) {
  DrippingReceiver receiver;
  ControlClientOptions options;
  options.base_url = receiver.url();
  options.timeout = std::chrono::seconds(1);
  options.max_retries = 2;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ControlClient> client, ControlClient::Make(options));
  const Clock::time_point start = Clock::now();
  // The reply takes about 10 s to drip; every byte comes within 100 ms.
  const Status committed = client->Commit(TransferId::Random());
  const auto took = Clock::now() - start;
  EXPECT_STATUS(DeadlineExceeded, committed);
  EXPECT_LT(took, options.timeout + kSlack);
}

TEST(ControlClientDeadlineTest, ManifestAnnouncementIsBoundedByTimeoutPlusStageTime) {
  DrippingReceiver receiver;
  ControlClientOptions options;
  options.timeout = std::chrono::milliseconds(500);
  ManifestAnnouncerFactory announcers = MakeControlManifestAnnouncers(options);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<ManifestAnnouncer> announcer, announcers(receiver.url()));
  const Clock::time_point start = Clock::now();
  Result<StageResult> staged = announcer->AnnounceManifest("{}", std::chrono::milliseconds(500));
  EXPECT_STATUS(DeadlineExceeded, staged);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(1) + kSlack);
}

// ---- Body limits ---------------------------------------------------------------------------

httplib::Result Post(uint16_t port, const std::string& path, const std::string& body,
                     bool with_key) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(std::chrono::seconds(10));
  httplib::Headers headers;
  if (with_key) headers.emplace("Authorization", std::string("Bearer ") + kApiKey);
  return client.Post(path.c_str(), headers, body, "application/json");
}

// A prepare body listing `count` tensors the model does not have, about 48 bytes each.
std::string PrepareListing(size_t count) {
  std::string body = R"({"transfer_id": "0123456789abcdef0123456789abcdef", "base_version": 0,)"
                     R"( "expected_digests": {)";
  for (size_t i = 0; i < count; ++i) {
    body += fmt::format(R"({}"model.layers.{:08}.not_in_this_model":"0000000000000000")",
                        i == 0 ? "" : ",", i);
  }
  return body + "}}";
}

TEST_F(ControlSlowClientsTest, PrepareBodyIsBoundedByTheModelsTensorCount) {
  ASSERT_NO_FATAL_FAILURE(StartServer({}));
  // 3 tensors: a listing of 100,000 names (about 6 MB, far below max_json_bytes) is refused
  // before parsing, naming the limit.
  httplib::Result reply = Post(server_->port(), "/v1/prepare", PrepareListing(100000), true);
  ASSERT_TRUE(reply) << httplib::to_string(reply.error());
  EXPECT_EQ(reply->status, 413) << reply->body;
  const json body = json::parse(reply->body, nullptr, false);
  EXPECT_EQ(body.value("code", ""), "ResourceExhausted") << reply->body;
  EXPECT_NE(body.value("message", "").find("3 tensors"), std::string::npos) << reply->body;
  // Naming every tensor the model has still fits.
  std::string fits = R"({"transfer_id": "0123456789abcdef0123456789abcdef", "base_version": 0})";
  reply = Post(server_->port(), "/v1/prepare", fits, true);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->status, 200) << reply->body;
}

// Issue 26, finding 5: a body of '[' made the JSON parser allocate a value per level (20 bodies
// of 100 KB: +60 MB the allocator kept). Nesting is bounded before anything is parsed.
TEST_F(ControlSlowClientsTest, DeeplyNestedJsonIsRefusedBeforeTheParserAllocates) {
  ControlServerOptions options;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  const std::string junk(1 << 20, '[');
  httplib::Result reply = Post(server_->port(), "/v1/prepare", junk, /*with_key=*/true);
  ASSERT_TRUE(reply) << httplib::to_string(reply.error());
  EXPECT_EQ(reply->status, 400) << reply->body;
  EXPECT_NE(reply->body.find("deeper than 32"), std::string::npos) << reply->body;

  EXPECT_STATUS_MSG(InvalidArgument, "deeper than 32", internal::ParseJson(junk, "junk"));
  // Brackets inside strings are text; the bound itself is accepted.
  ASSERT_OK(
      internal::ParseJson(R"({"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["})", "strings")
          .status());
  std::string deepest =
      std::string(internal::kMaxJsonDepth, '[') + std::string(internal::kMaxJsonDepth, ']');
  ASSERT_OK(internal::ParseJson(deepest, "deepest").status());
  EXPECT_STATUS_MSG(InvalidArgument, "deeper",
                    internal::ParseJson("[" + deepest + "]", "one more"));
}

TEST_F(ControlSlowClientsTest, UnauthenticatedOversizedRequestsGet401) {
  ControlServerOptions options;
  options.max_request_bytes = 1 << 20;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  const std::string big(2 << 20, 'x');
  for (const char* path : {"/v1/prepare", "/v1/payload", "/v1/manifest", "/v1/nowhere"}) {
    SCOPED_TRACE(path);
    httplib::Result reply = Post(server_->port(), path, big, /*with_key=*/false);
    ASSERT_TRUE(reply) << httplib::to_string(reply.error());
    EXPECT_EQ(reply->status, 401) << reply->body;
    const json body = json::parse(reply->body, nullptr, false);
    EXPECT_EQ(body.value("code", ""), "PermissionDenied") << reply->body;
  }
  // With the key, the same size is refused for its size.
  httplib::Result reply = Post(server_->port(), "/v1/prepare", big, /*with_key=*/true);
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->status, 413) << reply->body;
}

}  // namespace
}  // namespace refit
