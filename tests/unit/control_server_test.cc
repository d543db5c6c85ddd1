#include "control/control_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "codec/tracker.h"
#include "control/protocol.h"
#include "core/digest.h"
#include "refit/control_client.h"
#include "refit/status_format.h"
#include "store_snapshot.h"
#include "test_data.h"
#include "test_util.h"
#include "trainer_step.h"

namespace refit {
namespace {

using Step = testing::TrainerStep;
using testing::EncodeTrainerStep;
using testing::StoreSnapshot;
using testing::TakeSnapshot;

using nlohmann::json;
using testing::Perturb;
using testing::RandomTensor;

constexpr std::string_view kApiKey = "s3cret-control-key";
// A flush timeout no correct run reaches, even on a loaded 2-core machine.
constexpr auto kGenerousTimeout = std::chrono::seconds(60);
// A flush timeout for payloads that never arrive: it only sets how long the test waits.
constexpr auto kShortTimeout = std::chrono::milliseconds(100);
// How long a test lets a request reach the server before checking that it is blocked there.
constexpr auto kSettleTime = std::chrono::milliseconds(100);
// Fraction of elements each training step changes.
constexpr double kDensity = 0.05;

json ParseBody(const httplib::Result& result) {
  return json::parse(result->body, nullptr, /*allow_exceptions=*/false);
}

/// A trainer (DeltaTracker) and one receiver (store, session, control server) that start from
/// the same weights, and a client with the right key.
class ControlServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make({}));
    store_ = WeightStore::Make();
    current_ = {RandomTensor("model.embed.weight", DType::kBFloat16, {64, 33}, 1),
                RandomTensor("model.layers.0.attn.qkv.weight", DType::kFloat16, {40, 40}, 2),
                RandomTensor("model.layers.0.mlp.up.weight", DType::kFloat32, {31, 29}, 3),
                RandomTensor("model.layers.0.mlp.down.weight", DType::kFloat8E4M3FN, {900}, 4),
                // A name that needs percent-encoding in a URL.
                RandomTensor("odd name/with?query#frag%25.weight", DType::kBFloat16, {257}, 5)};
    for (const OwnedTensor& t : current_) {
      ASSERT_OK(store_->AddCopy(t.view()));
      ASSERT_OK(tracker_->AdoptBaseline(t.view()));
    }
  }

  void TearDown() override {
    client_.reset();
    if (server_ != nullptr) server_->Stop();
  }

  /// Start session, server and client. Call once per test (after changing options if needed).
  void StartServer(const ControlServerOptions& options = DefaultOptions(),
                   const ReceiverSessionOptions& session_options = {}) {
    ASSERT_OK_AND_ASSIGN(session_, internal::ReceiverSession::Make(session_options, *store_));
    ASSERT_OK_AND_ASSIGN(server_, ControlServer::Make(options, *session_, *store_));
    ASSERT_OK(server_->Start());
    ASSERT_NE(server_->port(), 0);
    client_ = MakeClient(std::string(kApiKey));
    ASSERT_NE(client_, nullptr);
  }

  static ControlServerOptions DefaultOptions() {
    ControlServerOptions options;
    options.api_key = std::string(kApiKey);
    return options;
  }

  std::unique_ptr<ControlClient> MakeClient(std::string api_key, int max_retries = 3) {
    ControlClientOptions options;
    options.base_url = server_->base_url();
    options.api_key = std::move(api_key);
    options.max_retries = max_retries;
    options.retry_backoff = std::chrono::milliseconds(1);
    auto client = ControlClient::Make(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(client).ValueOrDie() : nullptr;
  }

  /// A raw HTTP client, to check status codes, headers and bodies the ControlClient hides.
  httplib::Client Raw() const {
    httplib::Client raw(server_->base_url());
    raw.set_read_timeout(kGenerousTimeout);
    return raw;
  }

  static httplib::Headers KeyHeaders(std::string_view key = kApiKey) {
    return {{"Authorization", "Bearer " + std::string(key)}};
  }

  Step EncodeStep(uint64_t seed, uint32_t producers = 2) {
    return EncodeTrainerStep(*tracker_, current_, seed, kDensity, producers);
  }

  static PrepareRequest Request(const Step& step) {
    return PrepareRequest{step.id, step.base_version, step.expected};
  }

  static FlushOptions Generous() {
    FlushOptions options;
    options.timeout = kGenerousTimeout;
    return options;
  }

  /// Run a whole transfer through the client and commit it on both ends.
  void Transfer(const Step& step) {
    ASSERT_OK(client_->Prepare(Request(step)));
    for (const auto& payload : step.payloads) ASSERT_OK(client_->SendPayload(payload));
    ASSERT_OK(client_->Flush(step.id, Generous()));
    ASSERT_OK(client_->Commit(step.id));
    ASSERT_OK(tracker_->Commit(step.id));
    current_ = step.next;
  }

  void ExpectStoreHolds(const std::vector<OwnedTensor>& tensors) {
    for (const OwnedTensor& t : tensors) {
      ASSERT_OK_AND_ASSIGN(TensorView got, std::as_const(*store_).Find(t.name));
      EXPECT_TRUE(std::equal(got.bytes.begin(), got.bytes.end(), t.bytes.begin(), t.bytes.end()))
          << t.name;
    }
    EXPECT_EQ(store_->Digests(), store_->RecomputeDigests());
  }

  /// The exposition text of GET /metrics.
  std::string MetricsText() {
    httplib::Client raw = Raw();
    auto result = raw.Get(std::string(internal::kMetricsPath), KeyHeaders());
    EXPECT_TRUE(result);
    if (!result) return "";
    EXPECT_EQ(result->status, 200);
    return result->body;
  }

  /// The value of one sample of the exposition text, e.g. Sample("refit_weight_version").
  std::optional<double> Sample(std::string_view series) {
    const std::string metrics = MetricsText();
    const std::string needle = std::string(series) + " ";
    for (size_t line = 0; line < metrics.size();) {
      const size_t end = std::min(metrics.find('\n', line), metrics.size());
      const std::string_view text(metrics.data() + line, end - line);
      if (text.starts_with(needle)) return std::stod(std::string(text.substr(needle.size())));
      line = end + 1;
    }
    return std::nullopt;
  }

  std::unique_ptr<internal::DeltaTracker> tracker_;
  std::unique_ptr<WeightStore> store_;
  std::vector<OwnedTensor> current_;
  std::unique_ptr<internal::ReceiverSession> session_;
  std::unique_ptr<ControlServer> server_;
  std::unique_ptr<ControlClient> client_;
};

TEST_F(ControlServerTest, FullTransfersThroughTheClientAreBitExact) {
  StartServer();
  for (uint64_t round = 0; round < 3; ++round) {
    const Step step = EncodeStep(round + 1);
    ASSERT_FALSE(step.payloads.empty());
    ASSERT_OK_AND_ASSIGN(PrepareResult prepared, client_->Prepare(Request(step)));
    EXPECT_FALSE(prepared.repeated);
    EXPECT_FALSE(prepared.implied_commit.has_value());
    // A retried Prepare (lost reply) is recognised.
    ASSERT_OK_AND_ASSIGN(PrepareResult repeated, client_->Prepare(Request(step)));
    EXPECT_TRUE(repeated.repeated);
    for (const auto& payload : step.payloads) {
      ASSERT_OK_AND_ASSIGN(StageResult staged, client_->SendPayload(payload));
      EXPECT_EQ(staged, StageResult::kAccepted);
    }
    ASSERT_OK_AND_ASSIGN(FlushReport report, client_->Flush(step.id, Generous()));
    EXPECT_EQ(report.transfer_id, step.id);
    EXPECT_EQ(report.target_version, round + 1);
    EXPECT_EQ(report.payloads, step.payloads.size());
    EXPECT_EQ(report.duplicates, 0u);
    EXPECT_EQ(report.digests, step.expected.digests);
    ASSERT_OK(client_->Commit(step.id));
    ASSERT_OK(client_->Commit(step.id));  // Idempotent.
    ASSERT_OK(tracker_->Commit(step.id));
    current_ = step.next;
    ExpectStoreHolds(current_);

    ASSERT_OK_AND_ASSIGN(ControlStatus status, client_->GetStatus());
    EXPECT_EQ(status.receiver.state, ReceiverState::kIdle);
    EXPECT_EQ(status.receiver.version, round + 1);
    EXPECT_FALSE(status.receiver.transfer_id.has_value());
    EXPECT_TRUE(status.receiver.last_error.ok());
    EXPECT_EQ(status.tensors, current_.size());
    ASSERT_TRUE(status.state_fingerprint.has_value());
    EXPECT_EQ(*status.state_fingerprint, StateFingerprint(tracker_->Digests()));
  }
  EXPECT_EQ(Sample("refit_transfers_committed_total"), 3);
  EXPECT_EQ(Sample("refit_weight_version"), 3);
  EXPECT_EQ(Sample("refit_transfer_apply_seconds_count"), 3);
}

TEST_F(ControlServerTest, ResentPayloadIsADuplicateAndAppliedOnce) {
  StartServer();
  const Step step = EncodeStep(1);
  ASSERT_OK(client_->Prepare(Request(step)));
  for (const auto& payload : step.payloads) {
    ASSERT_OK_AND_ASSIGN(StageResult first, client_->SendPayload(payload));
    EXPECT_EQ(first, StageResult::kAccepted);
    ASSERT_OK_AND_ASSIGN(StageResult second, client_->SendPayload(payload));
    EXPECT_EQ(second, StageResult::kDuplicate);
  }
  ASSERT_OK_AND_ASSIGN(FlushReport report, client_->Flush(step.id, Generous()));
  EXPECT_EQ(report.duplicates, step.payloads.size());
  ASSERT_OK(client_->Commit(step.id));
  ASSERT_OK(tracker_->Commit(step.id));
  ExpectStoreHolds(step.next);
  EXPECT_EQ(Sample("refit_payloads_staged_total"), step.payloads.size());
  EXPECT_EQ(Sample("refit_payloads_duplicate_total"), step.payloads.size());
  // What the receiver was sent, as GET /v1/status reports it: each payload once, not its resend.
  uint64_t bytes = 0;
  for (const auto& payload : step.payloads) bytes += payload.size();
  ASSERT_OK_AND_ASSIGN(ControlStatus status, client_->GetStatus());
  EXPECT_EQ(status.receiver.received_payloads, step.payloads.size());
  EXPECT_EQ(status.receiver.received_bytes, bytes);
}

TEST_F(ControlServerTest, AbortRestoresTheBaseAndARetrySucceeds) {
  StartServer();
  const StoreSnapshot base = TakeSnapshot(*store_);
  const Step step = EncodeStep(1);
  ASSERT_OK(client_->Prepare(Request(step)));
  for (const auto& payload : step.payloads) ASSERT_OK(client_->SendPayload(payload));
  ASSERT_OK(client_->Flush(step.id, Generous()));
  EXPECT_NE(TakeSnapshot(*store_), base);  // Applied, not committed.
  ASSERT_OK(client_->Abort(step.id));
  ASSERT_OK(client_->Abort(step.id));  // Idempotent.
  EXPECT_EQ(TakeSnapshot(*store_), base);
  ASSERT_OK(tracker_->Abort(step.id));
  EXPECT_EQ(Sample("refit_transfers_aborted_total"), 1);
  // The aborted id is finished: its payloads are refused, so an XOR can never apply twice.
  EXPECT_STATUS(FailedPrecondition, client_->SendPayload(step.payloads[0]));
  Transfer(EncodeStep(2));
  ExpectStoreHolds(current_);
}

TEST_F(ControlServerTest, MissingOrWrongKeyIsRefusedAndChangesNothing) {
  StartServer();
  const Step step = EncodeStep(1);
  auto no_key = MakeClient("");
  auto wrong_key = MakeClient("s3cret-control-kez");
  ASSERT_NE(no_key, nullptr);
  ASSERT_NE(wrong_key, nullptr);

  auto expect_refused_everywhere = [&](ControlClient& client, const Step& open) {
    EXPECT_STATUS(PermissionDenied, client.Prepare(Request(step)));
    EXPECT_STATUS(PermissionDenied, client.SendPayload(step.payloads[0]));
    EXPECT_STATUS(PermissionDenied, client.Flush(open.id, Generous()));
    EXPECT_STATUS(PermissionDenied, client.Commit(open.id));
    EXPECT_STATUS(PermissionDenied, client.Abort(open.id));
    EXPECT_STATUS(PermissionDenied, client.GetStatus());
    EXPECT_STATUS(PermissionDenied, client.GetTensor(current_[0].name));
  };
  const StoreSnapshot before = TakeSnapshot(*store_);
  expect_refused_everywhere(*no_key, step);
  expect_refused_everywhere(*wrong_key, step);
  EXPECT_EQ(TakeSnapshot(*store_), before);
  EXPECT_EQ(session_->GetStatus().state, ReceiverState::kIdle);

  // With a transfer prepared by the right key, the wrong one can neither abort nor commit it.
  ASSERT_OK(client_->Prepare(Request(step)));
  for (const auto& payload : step.payloads) ASSERT_OK(client_->SendPayload(payload));
  ASSERT_OK(client_->Flush(step.id, Generous()));
  const StoreSnapshot prepared = TakeSnapshot(*store_);
  expect_refused_everywhere(*wrong_key, step);
  EXPECT_EQ(TakeSnapshot(*store_), prepared);
  EXPECT_EQ(session_->GetStatus().state, ReceiverState::kPrepared);
  EXPECT_EQ(session_->GetStatus().version, 0u);

  // The HTTP codes: 401 without a key (with a challenge), 403 with a wrong one; both headers work.
  httplib::Client raw = Raw();
  auto missing = raw.Get(std::string(internal::kStatusPath));
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 401);
  EXPECT_EQ(missing->get_header_value("WWW-Authenticate"), "Bearer realm=\"refit\"");
  EXPECT_EQ(ParseBody(missing)["code"], "PermissionDenied");
  auto wrong = raw.Get(std::string(internal::kStatusPath), KeyHeaders("nope"));
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 403);
  auto wrong_scheme = raw.Get(std::string(internal::kStatusPath),
                              {{"Authorization", "Basic " + std::string(kApiKey)}});
  ASSERT_TRUE(wrong_scheme);
  EXPECT_EQ(wrong_scheme->status, 401);
  auto alternative = raw.Get(std::string(internal::kStatusPath),
                             {{std::string(internal::kApiKeyHeader), std::string(kApiKey)}});
  ASSERT_TRUE(alternative);
  EXPECT_EQ(alternative->status, 200);
  auto lower_case_scheme = raw.Get(std::string(internal::kStatusPath),
                                   {{"Authorization", "bearer " + std::string(kApiKey)}});
  ASSERT_TRUE(lower_case_scheme);
  EXPECT_EQ(lower_case_scheme->status, 200);
  auto raw_abort = raw.Post(std::string(internal::kAbortPath), KeyHeaders("nope"),
                            json{{"transfer_id", step.id.ToHex()}}.dump(), "application/json");
  ASSERT_TRUE(raw_abort);
  EXPECT_EQ(raw_abort->status, 403);
  EXPECT_EQ(TakeSnapshot(*store_), prepared);
  // An unknown path without a key is refused before routing: it does not reveal what exists.
  auto probe = raw.Get("/v1/secret-admin");
  ASSERT_TRUE(probe);
  EXPECT_EQ(probe->status, 401);
  auto probe_post = raw.Post("/v1/secret-admin", "{}", "application/json");
  ASSERT_TRUE(probe_post);
  EXPECT_EQ(probe_post->status, 401);
  // Refusals are counted per route and code: two raw requests and one by the keyless client.
  EXPECT_EQ(Sample("refit_control_requests_total{code=\"401\",route=\"/v1/status\"}"), 3);
  EXPECT_EQ(Sample("refit_control_requests_total{code=\"401\",route=\"unmatched\"}"), 2);
}

TEST_F(ControlServerTest, BodyOfARefusedRequestIsNeverParsedAsARequest) {
  StartServer();
  const Step step = EncodeStep(1);
  ASSERT_OK(client_->Prepare(Request(step)));
  // A keyless abort whose body holds a well-formed abort that carries the key. A server that
  // left the body unread would look for its next request in the bytes still in the socket:
  // httplib reads the socket in 4 KiB pieces and starts each request on a fresh stream, so the
  // embedded request is placed at byte 4096 of the connection, where that search begins.
  constexpr size_t kHttplibReadBufferBytes = 4096;
  const std::string inner_body = json{{"transfer_id", step.id.ToHex()}}.dump();
  const std::string smuggled = fmt::format(
      "POST {} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: "
      "application/json\r\nContent-Length: {}\r\n\r\n{}",
      internal::kAbortPath, kApiKey, inner_body.size(), inner_body);
  for (const std::string_view path : {internal::kAbortPath, std::string_view("/v1/unknown")}) {
    auto headers = [&](size_t body_bytes) {
      return fmt::format(
          "POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
          "{:06}\r\n\r\n",
          path, body_bytes);
    };
    // Zero-padded length: the header size does not depend on the body size.
    const size_t filler = kHttplibReadBufferBytes - headers(0).size();
    const std::string body = std::string(filler, ' ') + smuggled;
    const std::string request = headers(body.size()) + body;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(server_->port());
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    ASSERT_EQ(send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
    // The server closes an idle keep-alive connection after a second; read until then.
    std::string replies;
    std::array<char, 4096> buffer{};
    for (ssize_t n; (n = recv(fd, buffer.data(), buffer.size(), 0)) > 0;)
      replies.append(buffer.data(), n);
    close(fd);
    size_t responses = 0;
    for (size_t at = replies.find("HTTP/1.1 "); at != std::string::npos;
         at = replies.find("HTTP/1.1 ", at + 1)) {
      ++responses;
    }
    EXPECT_EQ(responses, 1u) << replies;
    EXPECT_TRUE(replies.starts_with("HTTP/1.1 401")) << replies;
  }
  EXPECT_EQ(session_->GetStatus().state, ReceiverState::kReceiving);
}

TEST_F(ControlServerTest, HealthzNeedsNoKey) {
  StartServer();
  auto no_key = MakeClient("");
  ASSERT_NE(no_key, nullptr);
  ASSERT_OK(no_key->CheckHealth());
  httplib::Client raw = Raw();
  auto health = raw.Get(std::string(internal::kHealthPath));
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(ParseBody(health)["ok"], true);
  auto metrics = raw.Get(std::string(internal::kMetricsPath));
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 401);
}

// GET /ready (no key, like a kubelet's probe): 503 with the reason until the receiver holds the
// fleet's committed version, 503 while a transfer is open, 200 after its commit; the status and
// /metrics say the same.
TEST_F(ControlServerTest, ReadyOnlyAtTheFleetsCommittedVersionAndNeverMidTransfer) {
  StartServer();
  httplib::Client raw = Raw();
  const auto ready = [&raw](int expected_status, std::string_view expected_reason) {
    auto reply = raw.Get(std::string(internal::kReadyPath));
    ASSERT_TRUE(reply);
    EXPECT_EQ(reply->status, expected_status) << reply->body;
    EXPECT_EQ(ParseBody(reply)["ready_reason"], std::string(expected_reason)) << reply->body;
  };
  ready(503, "fleet_version_unknown");
  const Step step = EncodeStep(1);
  ASSERT_OK(client_->Prepare(Request(step)).status());
  ready(503, "transfer_open");
  for (const auto& payload : step.payloads) ASSERT_OK(client_->SendPayload(payload).status());
  ASSERT_OK(client_->Flush(step.id, Generous()).status());
  ready(503, "transfer_open");
  ASSERT_OK(client_->Commit(step.id));
  ready(200, "ready");
  ASSERT_OK_AND_ASSIGN(ControlStatus status, client_->GetStatus());
  ASSERT_TRUE(status.readiness.has_value());
  EXPECT_TRUE(status.readiness->ready);
  EXPECT_EQ(status.readiness->fleet_version, 1u);
  EXPECT_EQ(status.readiness->last_catch_up, CatchUp::kDelta);
  EXPECT_EQ(Sample("refit_receiver_ready"), 1);
  EXPECT_EQ(Sample("refit_fleet_version"), 1);
  // The fleet moved on without this receiver (a quorum commit, a join reply): behind.
  server_->fleet_standing().ObserveFleetVersion(3);
  ready(503, "behind");
  EXPECT_EQ(Sample("refit_receiver_ready"), 0);
  EXPECT_EQ(Sample("refit_fleet_lag_versions"), 2);
}

TEST_F(ControlServerTest, ServerWithoutKeyAcceptsEveryone) {
  ControlServerOptions options = DefaultOptions();
  options.api_key.clear();
  StartServer(options);
  auto no_key = MakeClient("");
  ASSERT_NE(no_key, nullptr);
  ASSERT_OK_AND_ASSIGN(ControlStatus status, no_key->GetStatus());
  EXPECT_EQ(status.tensors, current_.size());
}

// A relay place set by the node is reported, and read back by the client; without one (a data
// plane without relays) the fields are absent and the client reads nullopt.
TEST_F(ControlServerTest, StatusReportsTheRelayPlace) {
  ControlServerOptions options = DefaultOptions();
  options.relay = RelayPlace{2, 3};
  StartServer(options);
  ASSERT_OK_AND_ASSIGN(ControlStatus status, client_->GetStatus());
  ASSERT_TRUE(status.relay.has_value());
  EXPECT_EQ(*status.relay, (RelayPlace{2, 3}));
  EXPECT_NE(ControlStatusToJson(status).find("\"relay_index\":2"), std::string::npos);
  status.relay.reset();
  EXPECT_EQ(ControlStatusToJson(status).find("relay"), std::string::npos);
}

// A prepare that names a relay tree hands it to the data plane (route_transfer) before the
// session opens the transfer; the client sends the tree it is given; a refusal of the data plane
// fails the prepare and opens nothing.
TEST_F(ControlServerTest, PrepareHandsItsRelayTreeToTheDataPlane) {
  ControlServerOptions options = DefaultOptions();
  std::vector<std::pair<TransferId, RelayTree>> routed;
  bool refuse = false;
  options.route_transfer = [&](const TransferId& id, const RelayTree& tree) -> Status {
    // Routed before the transfer is open.
    EXPECT_NE(session_->GetStatus().transfer_id, id);
    if (refuse) return InvalidArgument("no such relay");
    routed.emplace_back(id, tree);
    return Status::OK();
  };
  StartServer(options);
  const Step step = EncodeStep(1);
  PrepareRequest request = Request(step);
  request.relay_tree = RelayTree{{"10.0.0.1:5555", "10.0.0.2:5555", "10.0.0.3:5555"}, 1};
  refuse = true;
  EXPECT_STATUS_MSG(InvalidArgument, "no such relay", client_->Prepare(request));
  EXPECT_EQ(session_->GetStatus().state, ReceiverState::kIdle);
  refuse = false;
  ASSERT_OK(client_->Prepare(request));
  ASSERT_EQ(routed.size(), 1u);
  EXPECT_EQ(routed[0].first, step.id);
  EXPECT_EQ(routed[0].second, *request.relay_tree);
  EXPECT_EQ(session_->GetStatus().transfer_id, step.id);
  ASSERT_OK(client_->Abort(step.id));
}

// A prepare's lineage crosses the control plane both ways: the receiver holds it once the
// transfer commits and reports it in its status, and refuses a delta of another run over HTTP by
// name (docs/protocol.md "Lineage and fencing").
TEST_F(ControlServerTest, ThePreparesLineageIsHeldAndReportedAndAnotherRunIsRefused) {
  StartServer();
  ASSERT_OK_AND_ASSIGN(ControlStatus before, client_->GetStatus());
  EXPECT_EQ(before.receiver.lineage, HeldLineage{});
  const Step step = EncodeStep(1);
  PrepareRequest request = Request(step);
  request.lineage = TransferLineage{"run-a", 3, 0};
  ASSERT_OK(client_->Prepare(request));
  for (const auto& payload : step.payloads) ASSERT_OK(client_->SendPayload(payload));
  ASSERT_OK(client_->Flush(step.id, Generous()));
  ASSERT_OK(client_->Commit(step.id));
  ASSERT_OK(tracker_->Commit(step.id));
  current_ = step.next;
  ASSERT_OK_AND_ASSIGN(ControlStatus after, client_->GetStatus());
  EXPECT_EQ(after.receiver.lineage,
            (HeldLineage{"run-a", 3, StateFingerprint(step.expected.digests)}));

  const Step next = EncodeStep(2);
  PrepareRequest other = Request(next);
  other.lineage = TransferLineage{"run-b", 0, 0};
  EXPECT_STATUS_MSG(FailedPrecondition, "a delta of run 'run-b' epoch 0", client_->Prepare(other));
  EXPECT_STATUS_MSG(FailedPrecondition, "states no lineage", client_->Prepare(Request(next)));
  other.lineage = TransferLineage{"run-a", 3, StateFingerprint(step.expected.digests)};
  ASSERT_OK(client_->Prepare(other));
  ASSERT_OK(client_->Abort(next.id));
}

// A receiver without a loader holds every tensor whole: its regions are empty, whatever is asked.
TEST_F(ControlServerTest, RegionsOfAStoreWithoutALoaderAreEmpty) {
  StartServer();
  std::vector<std::string> names;
  for (const OwnedTensor& t : current_) names.push_back(t.name);
  names.push_back("not.a.tensor.of.this.store");
  ASSERT_OK_AND_ASSIGN(const HeldRegions regions, client_->Regions(names));
  EXPECT_TRUE(regions.empty());
}

TEST_F(ControlServerTest, TensorDownloadEqualsTheStore) {
  StartServer();
  Transfer(EncodeStep(1));
  for (const OwnedTensor& expected : current_) {
    ASSERT_OK_AND_ASSIGN(OwnedTensor got, client_->GetTensor(expected.name));
    EXPECT_EQ(got.name, expected.name);
    EXPECT_EQ(got.dtype, expected.dtype);
    EXPECT_EQ(got.shape, expected.shape);
    EXPECT_EQ(got.bytes, expected.bytes) << expected.name;
  }
  // The headers, read raw: canonical dtype, JSON shape, the store's digest, the version.
  httplib::Client raw = Raw();
  auto result = raw.Get("/v1/tensors/model.layers.0.mlp.up.weight", KeyHeaders());
  ASSERT_TRUE(result);
  ASSERT_EQ(result->status, 200);
  EXPECT_EQ(result->get_header_value("Content-Type"), "application/octet-stream");
  EXPECT_EQ(result->get_header_value("X-Refit-Dtype"), "float32");
  EXPECT_EQ(result->get_header_value("X-Refit-Shape"), "[31,29]");
  ASSERT_OK_AND_ASSIGN(uint64_t digest, store_->Digest("model.layers.0.mlp.up.weight"));
  EXPECT_EQ(result->get_header_value("X-Refit-Digest"), internal::DigestToHex(digest));
  EXPECT_EQ(result->get_header_value("X-Refit-Version"), "1");

  EXPECT_STATUS_MSG(NotFound, "model.no.such.weight", client_->GetTensor("model.no.such.weight"));
  auto missing = raw.Get("/v1/tensors/model.no.such.weight", KeyHeaders());
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(ParseBody(missing)["code"], "NotFound");
}

TEST_F(ControlServerTest, StoreReadsAreRefusedWhileATransferIsReceiving) {
  StartServer();
  const Step step = EncodeStep(1);
  ASSERT_OK(client_->Prepare(Request(step)));
  EXPECT_STATUS_MSG(FailedPrecondition, "receiving", client_->GetTensor(current_[0].name));
  ASSERT_OK_AND_ASSIGN(ControlStatus receiving, client_->GetStatus());
  EXPECT_EQ(receiving.receiver.state, ReceiverState::kReceiving);
  EXPECT_EQ(receiving.receiver.transfer_id, step.id);
  EXPECT_FALSE(receiving.state_fingerprint.has_value());
  for (const auto& payload : step.payloads) ASSERT_OK(client_->SendPayload(payload));
  ASSERT_OK(client_->Flush(step.id, Generous()));
  // Prepared: the applied (uncommitted) state is readable, and it is the trainer's new state.
  ASSERT_OK_AND_ASSIGN(OwnedTensor got, client_->GetTensor(step.next[0].name));
  EXPECT_EQ(got.bytes, step.next[0].bytes);
  ASSERT_OK_AND_ASSIGN(ControlStatus prepared, client_->GetStatus());
  ASSERT_TRUE(prepared.state_fingerprint.has_value());
  EXPECT_EQ(*prepared.state_fingerprint, StateFingerprint(step.expected.digests));
}

TEST_F(ControlServerTest, EveryStatusCodeMapsToItsHttpCodeAndBack) {
  ControlServerOptions options = DefaultOptions();
  options.max_request_bytes = 64 << 10;
  StartServer(options);
  const Step step = EncodeStep(1);
  httplib::Client raw = Raw();
  auto raw_post = [&](std::string_view path, const json& body) {
    auto result =
        raw.Post(std::string(path), KeyHeaders(), body.dump(), std::string("application/json"));
    EXPECT_TRUE(result);
    return result;
  };
  auto expect_http = [&](const httplib::Result& result, int http, std::string_view code) {
    ASSERT_TRUE(result);
    EXPECT_EQ(result->status, http) << result->body;
    const json body = ParseBody(result);
    EXPECT_EQ(body["ok"], false);
    EXPECT_EQ(body["code"], code);
    EXPECT_TRUE(body["message"].is_string());
  };

  // InvalidArgument → 400: an expectation that contradicts itself.
  PrepareRequest inconsistent = Request(step);
  inconsistent.expected.total_payloads = step.payloads.size() + 1;
  EXPECT_STATUS_MSG(InvalidArgument, "total_payloads", client_->Prepare(inconsistent));
  expect_http(raw_post(internal::kCommitPath, {{"transfer_id", "xyz"}}), 400, "InvalidArgument");
  // FailedPrecondition → 409: a base version the receiver is not at.
  PrepareRequest wrong_base = Request(step);
  wrong_base.base_version = 7;
  EXPECT_STATUS(FailedPrecondition, client_->Prepare(wrong_base));
  expect_http(
      raw_post(internal::kPreparePath, {{"transfer_id", step.id.ToHex()}, {"base_version", 7}}),
      409, "FailedPrecondition");
  // NotFound → 404.
  EXPECT_STATUS(NotFound, client_->GetTensor("model.missing"));

  ASSERT_OK(client_->Prepare(Request(step)));
  // AlreadyExists → 409: the same ids with another checksum.
  ASSERT_OK(client_->SendPayload(step.payloads[0]));
  std::vector<ItemView> views;
  for (const Item& item : step.items[0]) views.push_back(item.view());
  PayloadEncodeOptions flat;
  flat.byte_planes = false;
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> conflicting, EncodePayload(step.ids[0], views, flat));
  ASSERT_NE(conflicting, step.payloads[0]);
  EXPECT_STATUS(AlreadyExists, client_->SendPayload(conflicting));
  // DataLoss → 422: a damaged header.
  std::vector<std::byte> damaged = step.payloads[1];
  damaged[kPayloadHeaderSize / 2] ^= std::byte{0x40};
  EXPECT_STATUS(DataLoss, client_->SendPayload(damaged));
  auto raw_damaged = raw.Post(std::string(internal::kPayloadPath), KeyHeaders(),
                              reinterpret_cast<const char*>(damaged.data()), damaged.size(),
                              "application/octet-stream");
  expect_http(raw_damaged, 422, "DataLoss");
  // ResourceExhausted → 413: a body far over the server's limit (drained, so the client reads the
  // reply instead of a reset connection).
  std::vector<std::byte> huge(options.max_request_bytes * 256);
  EXPECT_STATUS(ResourceExhausted, client_->SendPayload(huge));
  EXPECT_EQ(Sample("refit_control_requests_total{code=\"413\",route=\"/v1/payload\"}"), 1);
  // Its bytes were drained, never parsed as further requests.
  EXPECT_EQ(MetricsText().find("route=\"unmatched\""), std::string::npos);
  // DeadlineExceeded → 504, and the client does not retry it (that would stretch the timeout).
  FlushOptions short_flush;
  short_flush.timeout = kShortTimeout;
  EXPECT_STATUS_MSG(DeadlineExceeded, "missing", client_->Flush(step.id, short_flush));
  EXPECT_EQ(Sample("refit_control_requests_total{code=\"504\",route=\"/v1/flush\"}"), 1);
  // A flush timeout beyond the server's maximum is refused up front.
  FlushOptions endless;
  endless.timeout = std::chrono::hours(1);
  EXPECT_STATUS_MSG(InvalidArgument, "maximum flush timeout", client_->Flush(step.id, endless));
  // Unavailable: nothing listens (connection refused after the retries).
  const std::string url = server_->base_url();
  server_->Stop();
  EXPECT_STATUS(Unavailable, client_->GetStatus());
  ControlClientOptions nowhere;
  nowhere.base_url = url;
  nowhere.max_retries = 0;
  ASSERT_OK_AND_ASSIGN(auto unreachable, ControlClient::Make(nowhere));
  EXPECT_STATUS(Unavailable, unreachable->CheckHealth());
}

TEST_F(ControlServerTest, MalformedRequestsAre400NamingTheField) {
  StartServer();
  httplib::Client raw = Raw();
  auto post = [&](std::string_view path, const std::string& body) {
    auto result = raw.Post(std::string(path), KeyHeaders(), body, "application/json");
    EXPECT_TRUE(result);
    return result;
  };
  auto expect_400 = [&](const httplib::Result& result, std::string_view mention) {
    ASSERT_TRUE(result);
    EXPECT_EQ(result->status, 400) << result->body;
    const json body = ParseBody(result);
    EXPECT_EQ(body["code"], "InvalidArgument");
    EXPECT_NE(body["message"].get<std::string>().find(mention), std::string::npos)
        << body["message"] << " lacks " << mention;
  };
  const std::string id = TransferId::Random().ToHex();
  expect_400(post(internal::kPreparePath, "{\"transfer_id\": "), "not valid JSON");
  expect_400(post(internal::kPreparePath, "[1, 2]"), "must be a JSON object");
  expect_400(post(internal::kPreparePath, json{{"transfer_id", id}}.dump()), "base_version");
  expect_400(post(internal::kPreparePath, json{{"base_version", 0}}.dump()), "transfer_id");
  expect_400(post(internal::kPreparePath, json{{"transfer_id", id}, {"base_version", -1}}.dump()),
             "base_version");
  expect_400(post(internal::kPreparePath,
                  json{{"transfer_id", id}, {"base_version", 0}, {"expected_digest", {}}}.dump()),
             "unknown field 'expected_digest'");
  expect_400(
      post(internal::kPreparePath,
           json{{"transfer_id", id}, {"base_version", 0}, {"expected", {{"producers", {{"x", 1}}}}}}
               .dump()),
      "producer id 'x'");
  expect_400(
      post(internal::kPreparePath,
           json{{"transfer_id", id}, {"base_version", 0}, {"expected_digests", {{"w", "123"}}}}
               .dump()),
      "expected_digests['w']");
  const auto prepare_with_lineage = [&](const json& lineage) {
    return post(internal::kPreparePath,
                json{{"transfer_id", id}, {"base_version", 0}, {"lineage", lineage}}.dump());
  };
  expect_400(prepare_with_lineage({{"run_id", "a"}, {"epoch", -1}, {"base_fingerprint", "0"}}),
             "lineage.epoch");
  expect_400(prepare_with_lineage({{"run_id", "a"}, {"epoch", 0}, {"base_fingerprint", "xyz"}}),
             "lineage.base_fingerprint");
  expect_400(prepare_with_lineage(
                 {{"run_id", std::string(300, 'r')}, {"epoch", 0}, {"base_fingerprint", "0"}}),
             "lineage.run_id is 300 bytes long, more than 256");
  expect_400(prepare_with_lineage(
                 {{"run_id", "a"}, {"epoch", 0}, {"base_fingerprint", "0"}, {"generation", 2}}),
             "unknown field 'generation'");
  const auto prepare_with_tree = [&](const json& tree) {
    return post(internal::kPreparePath,
                json{{"transfer_id", id}, {"base_version", 0}, {"relay_tree", tree}}.dump());
  };
  expect_400(prepare_with_tree({{"position", 0}}), "relay_tree.endpoints is missing");
  expect_400(prepare_with_tree({{"endpoints", json::array()}, {"position", 0}}),
             "relay_tree.endpoints must be a list of 1 to 65536 data endpoints, got array of 0");
  expect_400(prepare_with_tree({{"endpoints", {"a:1", 7}}, {"position", 0}}),
             "relay_tree.endpoints[1] must be a non-empty data endpoint, got 7");
  expect_400(prepare_with_tree({{"endpoints", {"a:1", "a:1"}}, {"position", 0}}),
             "names 'a:1' twice");
  expect_400(prepare_with_tree({{"endpoints", {"a:1", "b:2"}}, {"position", 2}}),
             "relay_tree.position is 2, not a position among its 2 endpoints");
  expect_400(prepare_with_tree({{"endpoints", {"a:1"}}, {"position", 0}, {"root", 0}}),
             "unknown field 'root'");
  // A well-formed tree, to a control plane whose data plane has no relays.
  expect_400(prepare_with_tree({{"endpoints", {"a:1"}}, {"position", 0}}),
             "names a relay tree of 1 receiver(s), but this receiver's data plane has no relays");
  expect_400(post(internal::kRegionsPath, "{}"), "tensors");
  expect_400(post(internal::kRegionsPath, json{{"tensors", "w"}}.dump()),
             "request body.tensors must be a list of at most 1048576 tensor names, got string");
  expect_400(post(internal::kRegionsPath, json{{"tensors", {"a", 3}}}.dump()),
             "request body.tensors[1] must be a non-empty tensor name, got 3");
  expect_400(post(internal::kRegionsPath, json{{"tensors", json::array()}, {"all", true}}.dump()),
             "unknown field 'all'");
  expect_400(post(internal::kFlushPath, json{{"transfer_id", id}, {"timeout_ms", "soon"}}.dump()),
             "timeout_ms");
  expect_400(post(internal::kCommitPath, "{}"), "transfer_id");
  auto wrong_type =
      raw.Post(std::string(internal::kPayloadPath), KeyHeaders(), "abc", "text/plain");
  expect_400(wrong_type, "Content-Type");
  // Nothing of this opened a transfer.
  EXPECT_EQ(session_->GetStatus().state, ReceiverState::kIdle);
  // An unknown route gets the JSON error shape too.
  auto unknown = raw.Get("/v1/nope", KeyHeaders());
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 404);
  EXPECT_EQ(ParseBody(unknown)["code"], "NotFound");
}

TEST_F(ControlServerTest, ConcurrentClientsCompleteOneTransfer) {
  StartServer();
  const Step step = EncodeStep(1, /*producers=*/4);
  ASSERT_OK(client_->Prepare(Request(step)));
  constexpr int kSenders = 4;
  std::vector<std::thread> threads;
  threads.reserve(kSenders);
  std::atomic<int> failures{0};
  for (int sender = 0; sender < kSenders; ++sender) {
    threads.emplace_back([&, sender] {
      // Each sender has its own client (its own connections); the main client is shared too.
      auto own = MakeClient(std::string(kApiKey));
      if (own == nullptr) {
        ++failures;
        return;
      }
      for (size_t i = 0; i < step.payloads.size(); ++i) {
        if (step.ids[i].producer_id != static_cast<uint32_t>(sender)) continue;
        if (!own->SendPayload(step.payloads[i]).ok()) ++failures;
        if (!client_->GetStatus().ok()) ++failures;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures, 0);
  ASSERT_OK_AND_ASSIGN(FlushReport report, client_->Flush(step.id, Generous()));
  EXPECT_EQ(report.payloads, step.payloads.size());
  ASSERT_OK(client_->Commit(step.id));
  ASSERT_OK(tracker_->Commit(step.id));
  current_ = step.next;
  ExpectStoreHolds(current_);

  // Concurrent downloads of every tensor agree with the store.
  threads.clear();
  for (int reader = 0; reader < kSenders; ++reader) {
    threads.emplace_back([&] {
      for (const OwnedTensor& expected : current_) {
        auto got = client_->GetTensor(expected.name);
        if (!got.ok() || got->bytes != expected.bytes) ++failures;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures, 0);
}

TEST_F(ControlServerTest, StopCancelsAnUploadBlockedOnAFullApplyQueue) {
  // The apply thread blocks on the first payload, the queue (depth 1) holds the second, so the
  // third upload waits inside the server.
  std::mutex mutex;
  std::condition_variable released_cv;
  bool released = false;
  ReceiverSessionOptions session_options;
  session_options.apply_queue_depth = 1;
  session_options.before_apply = [&](const PayloadIds&) {
    std::unique_lock lock(mutex);
    released_cv.wait(lock, [&] { return released; });
  };
  StartServer(DefaultOptions(), session_options);
  const Step step = EncodeStep(1);
  ASSERT_GE(step.payloads.size(), 3u);
  ASSERT_OK(client_->Prepare(Request(step)));
  ASSERT_OK(client_->SendPayload(step.payloads[0]));
  ASSERT_OK(client_->SendPayload(step.payloads[1]));
  auto blocked_client = MakeClient(std::string(kApiKey), /*max_retries=*/0);
  ASSERT_NE(blocked_client, nullptr);
  Status blocked_status;
  std::thread blocked(
      [&] { blocked_status = blocked_client->SendPayload(step.payloads[2]).status(); });
  std::this_thread::sleep_for(kSettleTime);
  server_->Stop();
  blocked.join();
  EXPECT_STATUS(Unavailable, blocked_status);
  {
    std::lock_guard lock(mutex);
    released = true;
  }
  released_cv.notify_all();
}

TEST_F(ControlServerTest, MakeAndStartRejectBadSetups) {
  ASSERT_OK_AND_ASSIGN(session_, internal::ReceiverSession::Make({}, *store_));
  ControlServerOptions options = DefaultOptions();
  options.tls_cert_path = "/nonexistent/cert.pem";
  EXPECT_STATUS(InvalidArgument, ControlServer::Make(options, *session_, *store_));
  options.tls_key_path = "/nonexistent/key.pem";
  EXPECT_STATUS(NotFound, ControlServer::Make(options, *session_, *store_));
  options = DefaultOptions();
  options.worker_threads = 0;
  EXPECT_STATUS(InvalidArgument, ControlServer::Make(options, *session_, *store_));

  ASSERT_OK_AND_ASSIGN(auto first, ControlServer::Make(DefaultOptions(), *session_, *store_));
  EXPECT_EQ(first->port(), 0);
  EXPECT_EQ(first->base_url(), "");
  ASSERT_OK(first->Start());
  EXPECT_STATUS(FailedPrecondition, first->Start());
  // A second server on the same port is refused (no silent SO_REUSEPORT sharing).
  options = DefaultOptions();
  options.port = first->port();
  ASSERT_OK_AND_ASSIGN(auto second, ControlServer::Make(options, *session_, *store_));
  EXPECT_STATUS_MSG(Unavailable, std::to_string(first->port()), second->Start());
  first->Stop();
  first->Stop();  // Idempotent.
  EXPECT_STATUS(FailedPrecondition, first->Start());

  for (const char* url : {"ftp://host:1", "http://", "http://host:0", "http://host:99999",
                          "http://host:port", "http://[::1", "http://host:1/x?y"}) {
    ControlClientOptions client_options;
    client_options.base_url = url;
    SCOPED_TRACE(url);
    EXPECT_STATUS(InvalidArgument, ControlClient::Make(client_options));
  }
  ControlClientOptions prefixed;
  prefixed.base_url = "http://[::1]:8080/refit/";
  ASSERT_OK_AND_ASSIGN(auto client, ControlClient::Make(prefixed));
  EXPECT_EQ(client->base_url(), "http://[::1]:8080/refit");
}

/// A stand-in for a proxy in front of the receiver: it answers every request with a fixed status
/// and body, and counts the attempts.
class FakeUpstream {
 public:
  FakeUpstream(int status, std::string body, std::string content_type)
      : status_(status), body_(std::move(body)), content_type_(std::move(content_type)) {
    server_.Post(".*", [this](const httplib::Request&, httplib::Response& response) {
      ++attempts_;
      response.status = status_;
      response.set_content(body_, content_type_);
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~FakeUpstream() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int attempts() const { return attempts_; }

 private:
  int status_;
  std::string body_;
  std::string content_type_;
  httplib::Server server_;
  int port_ = 0;
  std::atomic<int> attempts_{0};
  std::thread thread_;
};

// A receiver older than routing by holdings answers POST /v1/regions 404 (no such route): it is
// answered for as holding everything whole, so that it is sent every item. Any other error stays
// an error.
TEST(ControlClientTest, RegionsOfAReceiverWithoutTheRouteAreEmpty) {
  auto regions_from = [](int status, const std::string& body) {
    FakeUpstream upstream(status, body, "application/json");
    ControlClientOptions options;
    options.base_url = upstream.url();
    options.max_retries = 0;
    auto client = ControlClient::Make(options);
    EXPECT_TRUE(client.ok());
    return (*client)->Regions({"model.embed_tokens.weight"});
  };
  const Result<HeldRegions> old = regions_from(404, R"({"ok": false, "code": "NotFound",
               "message": "no route POST /v1/regions on the control channel"})");
  ASSERT_OK(old);
  EXPECT_TRUE(old->empty());
  EXPECT_STATUS_MSG(PermissionDenied, "no key",
                    regions_from(401, R"({"ok": false, "code": "PermissionDenied",
                                          "message": "no key"})"));
  EXPECT_STATUS_MSG(DataLoss, "regions reply.regions must be an object",
                    regions_from(200, R"({"ok": true, "regions": 7})"));
}

// A receiver that is not running: the error says "connection refused" and where, not httplib's
// bare "Connection".
TEST(ControlClientTest, ReceiverNotRunningIsConnectionRefusedNamingTheAddress) {
  // A port that was just free: bound, read back, closed.
  const int probe = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(probe, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(probe, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  socklen_t address_bytes = sizeof(address);
  ASSERT_EQ(::getsockname(probe, reinterpret_cast<sockaddr*>(&address), &address_bytes), 0);
  const int port = ntohs(address.sin_port);
  ::close(probe);

  ControlClientOptions options;
  options.base_url = fmt::format("http://127.0.0.1:{}", port);
  options.max_retries = 1;
  options.retry_backoff = std::chrono::milliseconds(1);
  ASSERT_OK_AND_ASSIGN(auto client, ControlClient::Make(options));
  const Result<ControlStatus> status = client->GetStatus();
  EXPECT_STATUS_MSG(Unavailable, "GET /v1/status: connection refused", status);
  EXPECT_STATUS_MSG(Unavailable, fmt::format("nothing listens on 127.0.0.1:{}", port), status);
  EXPECT_STATUS_MSG(Unavailable, "(attempt 2 of 2)", status);
}

TEST(ControlClientTest, RetriesOnlyGatewayErrorsAndQuotesForeignBodies) {
  constexpr int kRetries = 2;
  auto run = [&](int status, const std::string& body, const std::string& content_type) {
    auto upstream = std::make_unique<FakeUpstream>(status, body, content_type);
    ControlClientOptions options;
    options.base_url = upstream->url();
    options.max_retries = kRetries;
    options.retry_backoff = std::chrono::milliseconds(1);
    auto client = ControlClient::Make(options);
    EXPECT_TRUE(client.ok());
    const Status result = (*client)->Commit(TransferId::Random());
    return std::make_pair(result, upstream->attempts());
  };
  const std::string page(1000, 'x');
  {
    auto [status, attempts] = run(503, page, "text/html");
    EXPECT_EQ(status.code(), StatusCode::kUnavailable);
    EXPECT_EQ(attempts, kRetries + 1);
    // A foreign body is quoted, cut at 512 characters.
    EXPECT_NE(status.message().find(std::string(512, 'x')), std::string::npos);
    EXPECT_EQ(status.message().find(std::string(513, 'x')), std::string::npos);
  }
  {
    auto [status, attempts] = run(502, "bad gateway", "text/plain");
    EXPECT_EQ(status.code(), StatusCode::kUnavailable);
    EXPECT_EQ(attempts, kRetries + 1);
  }
  {
    auto [status, attempts] = run(504, "gateway timeout", "text/plain");
    EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded);
    EXPECT_EQ(attempts, kRetries + 1);
  }
  {
    // The receiver's own flush deadline is final.
    auto [status, attempts] =
        run(504, R"({"ok": false, "code": "DeadlineExceeded", "message": "payload 3 missing"})",
            "application/json");
    EXPECT_EQ(status, Status(StatusCode::kDeadlineExceeded, "payload 3 missing"));
    EXPECT_EQ(attempts, 1);
  }
  {
    // 500 is an application error: never retried; the server's code and message come back.
    auto [status, attempts] =
        run(500, R"({"ok": false, "code": "IoError", "message": "disk full"})", "application/json");
    EXPECT_EQ(status, Status(StatusCode::kIoError, "disk full"));
    EXPECT_EQ(attempts, 1);
  }
  {
    auto [status, attempts] = run(200, "not json", "text/plain");
    EXPECT_EQ(status.code(), StatusCode::kDataLoss);
    EXPECT_EQ(attempts, 1);
  }
}

/// A self-signed certificate for 127.0.0.1 and its key, written as PEM files.
class SelfSignedCertificate {
 public:
  SelfSignedCertificate() {
    static std::atomic<int> instances{0};
    dir_ = std::filesystem::temp_directory_path() /
           fmt::format("refit_control_tls_{}_{}", getpid(), instances++);
    std::filesystem::create_directories(dir_);
    EVP_PKEY* key = EVP_EC_gen("P-256");
    X509* cert = X509_new();
    X509_set_version(cert, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
    X509_gmtime_adj(X509_getm_notBefore(cert), 0);
    constexpr long kValiditySeconds = 3600;
    X509_gmtime_adj(X509_getm_notAfter(cert), kValiditySeconds);
    X509_set_pubkey(cert, key);
    X509_NAME* name = X509_get_subject_name(cert);
    X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                               reinterpret_cast<const unsigned char*>("127.0.0.1"), -1, -1, 0);
    X509_set_issuer_name(cert, name);
    X509V3_CTX context;
    X509V3_set_ctx_nodb(&context);
    X509V3_set_ctx(&context, cert, cert, nullptr, nullptr, 0);
    for (auto [nid, value] : {std::pair{NID_subject_alt_name, "IP:127.0.0.1"},
                              std::pair{NID_basic_constraints, "critical,CA:TRUE"}}) {
      X509_EXTENSION* extension = X509V3_EXT_conf_nid(nullptr, &context, nid, value);
      X509_add_ext(cert, extension, -1);
      X509_EXTENSION_free(extension);
    }
    X509_sign(cert, key, EVP_sha256());
    FILE* cert_file = std::fopen(cert_path().c_str(), "w");
    PEM_write_X509(cert_file, cert);
    std::fclose(cert_file);
    FILE* key_file = std::fopen(key_path().c_str(), "w");
    PEM_write_PrivateKey(key_file, key, nullptr, nullptr, 0, nullptr, nullptr);
    std::fclose(key_file);
    X509_free(cert);
    EVP_PKEY_free(key);
  }
  ~SelfSignedCertificate() { std::filesystem::remove_all(dir_); }
  std::string cert_path() const { return (dir_ / "cert.pem").string(); }
  std::string key_path() const { return (dir_ / "key.pem").string(); }

 private:
  std::filesystem::path dir_;
};

TEST_F(ControlServerTest, ServesHttpsWithATrustedCertificate) {
  SelfSignedCertificate certificate;
  ControlServerOptions options = DefaultOptions();
  options.tls_cert_path = certificate.cert_path();
  options.tls_key_path = certificate.key_path();
  ASSERT_OK_AND_ASSIGN(session_, internal::ReceiverSession::Make({}, *store_));
  ASSERT_OK_AND_ASSIGN(server_, ControlServer::Make(options, *session_, *store_));
  ASSERT_OK(server_->Start());
  EXPECT_TRUE(server_->base_url().starts_with("https://127.0.0.1:"));

  ControlClientOptions client_options;
  client_options.base_url = server_->base_url();
  client_options.api_key = std::string(kApiKey);
  client_options.tls_ca_cert_path = certificate.cert_path();
  client_options.max_retries = 0;
  ASSERT_OK_AND_ASSIGN(client_, ControlClient::Make(client_options));
  Transfer(EncodeStep(1));
  ExpectStoreHolds(current_);
  ASSERT_OK_AND_ASSIGN(OwnedTensor got, client_->GetTensor(current_[0].name));
  EXPECT_EQ(got.bytes, current_[0].bytes);

  // Without trusting the certificate the handshake fails; plain HTTP gets no answer.
  ControlClientOptions untrusting = client_options;
  untrusting.tls_ca_cert_path.clear();
  ASSERT_OK_AND_ASSIGN(auto untrusted, ControlClient::Make(untrusting));
  EXPECT_STATUS(Unavailable, untrusted->GetStatus());
  ControlClientOptions plain = client_options;
  plain.base_url = "http://127.0.0.1:" + std::to_string(server_->port());
  ASSERT_OK_AND_ASSIGN(auto plain_client, ControlClient::Make(plain));
  EXPECT_FALSE(plain_client->GetStatus().ok());

  // A key that does not match the certificate is refused at Make.
  SelfSignedCertificate other;
  ControlServerOptions mismatched = options;
  std::filesystem::copy_file(other.key_path(), certificate.key_path(),
                             std::filesystem::copy_options::overwrite_existing);
  EXPECT_STATUS(InvalidArgument, ControlServer::Make(mismatched, *session_, *store_));
}

}  // namespace
}  // namespace refit
