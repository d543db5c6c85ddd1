// POST /v1/manifest through a real ControlServer: routing to ControlServerOptions::
// manifest_handler, authentication, error mapping and metrics.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "control/control_server.h"
#include "control/protocol.h"
#include "receiver/receiver_session.h"
#include "refit/status_format.h"
#include "refit/weight_store.h"
#include "test_util.h"

namespace refit {
namespace {

using nlohmann::json;

constexpr std::string_view kApiKey = "manifest-route-key";
// A read timeout no correct run reaches, even on a loaded 2-core machine.
constexpr auto kGenerousTimeout = std::chrono::seconds(60);
// What the sample handler reports as the size of the payload a manifest named.
constexpr uint64_t kPayloadBytes = 123456;
// A manifest body as the s3:// sender writes it (the route treats it as opaque text).
constexpr std::string_view kManifest =
    R"({"checksum":"00112233445566778899aabbccddeeff","key":"fleet/live/)"
    R"(a0a1a2a3a4a5a6a7a8a9aaabacadaeaf/000000/000001.rfpl","payload_id":1,"producer_id":0,)"
    R"("size":123456,"transfer_id":"a0a1a2a3a4a5a6a7a8a9aaabacadaeaf"})";

/// One receiver (an empty store, a session, a control server) whose manifest handler records
/// each call and answers what the test sets.
class ControlManifestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = WeightStore::Make();
    ASSERT_OK_AND_ASSIGN(session_, internal::ReceiverSession::Make({}, *store_));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Stop();
  }

  /// Start the server; with `install_handler`, manifests go to Handle().
  void StartServer(bool install_handler = true, uint64_t max_json_bytes = 0) {
    ControlServerOptions options;
    options.api_key = std::string(kApiKey);
    if (max_json_bytes != 0) options.max_json_bytes = max_json_bytes;
    if (install_handler) {
      options.manifest_handler = [this](std::string_view manifest, std::stop_token stop) {
        return Handle(manifest, std::move(stop));
      };
    }
    ASSERT_OK_AND_ASSIGN(server_, ControlServer::Make(options, *session_, *store_));
    ASSERT_OK(server_->Start());
  }

  Result<StagedManifest> Handle(std::string_view manifest, std::stop_token stop) {
    std::unique_lock lock(mutex_);
    ++calls_;
    bodies_.emplace_back(manifest);
    if (block_until_stop_) {
      entered_.set_value();
      // Stop() requests the token; nothing else ends the wait.
      std::condition_variable_any never_notified;
      never_notified.wait(lock, stop, [] { return false; });
      return Cancelled("manifest handler cancelled");
    }
    return reply_;
  }

  httplib::Client Raw() const {
    httplib::Client raw(server_->base_url());
    raw.set_read_timeout(kGenerousTimeout);
    return raw;
  }

  static httplib::Headers KeyHeaders(std::string_view key = kApiKey) {
    return {{"Authorization", "Bearer " + std::string(key)}};
  }

  httplib::Result Post(std::string_view body, const httplib::Headers& headers = KeyHeaders()) {
    httplib::Client raw = Raw();
    return raw.Post(std::string(internal::kManifestPath), headers, std::string(body),
                    std::string(internal::kJsonContentType));
  }

  /// The reply's JSON body (discarded when it is not JSON).
  static json Body(const httplib::Result& result) {
    return json::parse(result->body, nullptr, /*allow_exceptions=*/false);
  }

  /// The value of one sample of GET /metrics, e.g. Sample("refit_payloads_staged_total").
  std::optional<double> Sample(std::string_view series) {
    httplib::Client raw = Raw();
    auto result = raw.Get(std::string(internal::kMetricsPath), KeyHeaders());
    EXPECT_TRUE(result);
    if (!result) return std::nullopt;
    EXPECT_EQ(result->status, 200);
    const std::string needle = std::string(series) + " ";
    for (size_t line = 0; line < result->body.size();) {
      const size_t end = std::min(result->body.find('\n', line), result->body.size());
      const std::string_view text(result->body.data() + line, end - line);
      if (text.starts_with(needle)) return std::stod(std::string(text.substr(needle.size())));
      line = end + 1;
    }
    return std::nullopt;
  }

  int calls() {
    std::lock_guard lock(mutex_);
    return calls_;
  }

  std::unique_ptr<WeightStore> store_;
  std::unique_ptr<internal::ReceiverSession> session_;
  std::unique_ptr<ControlServer> server_;

  std::mutex mutex_;
  int calls_ = 0;
  std::vector<std::string> bodies_;
  Result<StagedManifest> reply_ =
      StagedManifest{.result = StageResult::kAccepted, .payload_bytes = kPayloadBytes};
  bool block_until_stop_ = false;
  std::promise<void> entered_;
};

TEST_F(ControlManifestTest, WithoutAHandlerTheRouteIsFailedPrecondition) {
  StartServer(/*install_handler=*/false);
  auto result = Post(kManifest);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->status, 409);
  const json body = Body(result);
  ASSERT_TRUE(body.is_object()) << result->body;
  EXPECT_EQ(body["ok"], false);
  EXPECT_EQ(body["code"], "FailedPrecondition");
  EXPECT_NE(body["message"].get<std::string>().find("manifest"), std::string::npos) << result->body;
  // The connection stays usable: the refused body was drained, not read as a request.
  auto health = Raw().Get(std::string(internal::kHealthPath));
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST_F(ControlManifestTest, AnAcceptedManifestRepliesWithResultAndBytes) {
  StartServer();
  auto result = Post(kManifest);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->status, 200) << result->body;
  EXPECT_EQ(Body(result), (json{{"ok", true}, {"result", "accepted"}, {"bytes", kPayloadBytes}}));
  EXPECT_EQ(calls(), 1);
}

TEST_F(ControlManifestTest, ADuplicateManifestRepliesDuplicate) {
  StartServer();
  {
    std::lock_guard lock(mutex_);
    reply_ = StagedManifest{.result = StageResult::kDuplicate, .payload_bytes = 77};
  }
  auto result = Post(kManifest);
  ASSERT_TRUE(result);
  EXPECT_EQ(result->status, 200) << result->body;
  EXPECT_EQ(Body(result), (json{{"ok", true}, {"result", "duplicate"}, {"bytes", 77}}));
}

TEST_F(ControlManifestTest, TheHandlerReceivesTheExactBody) {
  StartServer();
  // Not JSON, with a NUL, a newline and non-ASCII bytes: the route passes the body through
  // untouched and leaves judging it to the handler.
  const std::string odd = std::string("{\"key\":\"a\0b\"}\n\xc3\xa9\xff", 17);
  for (const std::string& body : {std::string(kManifest), odd, std::string()}) {
    ASSERT_TRUE(Post(body));
  }
  std::lock_guard lock(mutex_);
  ASSERT_EQ(bodies_.size(), 3u);
  EXPECT_EQ(bodies_[0], kManifest);
  EXPECT_EQ(bodies_[1], odd);
  EXPECT_EQ(bodies_[2], "");
}

TEST_F(ControlManifestTest, HandlerErrorsMapToHttpStatusAndErrorBody) {
  StartServer();
  struct Case {
    Status status;
    int http_status;
    std::string code;
  };
  const std::vector<Case> cases = {
      {DataLoss("payload object s3://b/k: checksum 00 differs from the announced 11"), 422,
       "DataLoss"},
      {InvalidArgument("manifest key 'x' is not the object of transfer t"), 400, "InvalidArgument"},
      {PermissionDenied("payload object s3://b/k: MAC does not verify"), 403, "PermissionDenied"},
      {Unavailable("S3 GET b/k: connection refused"), 503, "Unavailable"},
      {ResourceExhausted("payload object s3://b/k: 9 bytes exceed the limit of 8"), 413,
       "ResourceExhausted"},
      {FailedPrecondition("no transfer is open"), 409, "FailedPrecondition"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.code);
    {
      std::lock_guard lock(mutex_);
      reply_ = c.status;
    }
    auto result = Post(kManifest);
    ASSERT_TRUE(result);
    EXPECT_EQ(result->status, c.http_status) << result->body;
    const json body = Body(result);
    ASSERT_TRUE(body.is_object()) << result->body;
    EXPECT_EQ(body["ok"], false);
    EXPECT_EQ(body["code"], c.code);
    EXPECT_NE(body["message"].get<std::string>().find(c.status.message()), std::string::npos)
        << result->body;
  }
  EXPECT_EQ(calls(), static_cast<int>(cases.size()));
}

TEST_F(ControlManifestTest, TheApiKeyIsRequiredAndCheckedBeforeTheHandler) {
  StartServer();
  auto missing = Post(kManifest, {});
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 401);
  EXPECT_EQ(Body(missing)["ok"], false);
  auto wrong = Post(kManifest, KeyHeaders("not-the-key"));
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 403);
  EXPECT_EQ(Body(wrong)["code"], "PermissionDenied");
  EXPECT_EQ(calls(), 0);
  // Neither refusal counted a payload.
  EXPECT_EQ(Sample("refit_payloads_rejected_total"), 0);
  // Both header forms of the right key are accepted.
  auto bearer = Post(kManifest);
  ASSERT_TRUE(bearer);
  EXPECT_EQ(bearer->status, 200);
  auto header = Post(kManifest, {{std::string(internal::kApiKeyHeader), std::string(kApiKey)}});
  ASSERT_TRUE(header);
  EXPECT_EQ(header->status, 200);
  EXPECT_EQ(calls(), 2);
}

TEST_F(ControlManifestTest, AManifestOverTheJsonLimitIsRefusedUnread) {
  constexpr uint64_t kLimit = 1024;
  StartServer(/*install_handler=*/true, kLimit);
  auto result = Post(std::string(2 * kLimit, 'm'));
  ASSERT_TRUE(result);
  EXPECT_EQ(result->status, 413);
  EXPECT_EQ(Body(result)["code"], "ResourceExhausted");
  EXPECT_EQ(calls(), 0);
  auto fits = Post(kManifest);
  ASSERT_TRUE(fits);
  EXPECT_EQ(fits->status, 200);
}

TEST_F(ControlManifestTest, MetricsCountManifestPayloads) {
  StartServer();
  ASSERT_TRUE(Post(kManifest));  // Accepted, kPayloadBytes.
  {
    std::lock_guard lock(mutex_);
    reply_ = StagedManifest{.result = StageResult::kDuplicate, .payload_bytes = 1000};
  }
  ASSERT_TRUE(Post(kManifest));
  {
    std::lock_guard lock(mutex_);
    reply_ = DataLoss("checksum mismatch");
  }
  ASSERT_TRUE(Post(kManifest));
  EXPECT_EQ(Sample("refit_payloads_staged_total"), 1);
  EXPECT_EQ(Sample("refit_payloads_duplicate_total"), 1);
  EXPECT_EQ(Sample("refit_payloads_rejected_total"), 1);
  EXPECT_EQ(Sample("refit_payload_bytes_received_total"),
            static_cast<double>(kPayloadBytes + 1000));
  EXPECT_EQ(Sample("refit_control_requests_total{code=\"200\",route=\"/v1/manifest\"}"), 2);
  EXPECT_EQ(Sample("refit_control_requests_total{code=\"422\",route=\"/v1/manifest\"}"), 1);
}

TEST_F(ControlManifestTest, StopCancelsAHandlerThatIsStillFetching) {
  StartServer();
  {
    std::lock_guard lock(mutex_);
    block_until_stop_ = true;
  }
  std::future<void> entered = entered_.get_future();
  std::optional<int> http_status;
  std::string reply;
  // A jthread: should the handler never be entered, the thread is still joined (at the read
  // timeout) before the fixture goes away.
  std::jthread poster([&] {
    auto result = Post(kManifest);
    if (result) {
      http_status = result->status;
      reply = result->body;
    }
  });
  ASSERT_EQ(entered.wait_for(kGenerousTimeout), std::future_status::ready);
  server_->Stop();
  poster.join();
  ASSERT_TRUE(http_status.has_value());
  EXPECT_EQ(*http_status, 503) << reply;
  EXPECT_NE(reply.find("Unavailable"), std::string::npos) << reply;
}

}  // namespace
}  // namespace refit
