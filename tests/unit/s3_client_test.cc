// S3Client against an in-process fake S3 (cpp-httplib) that can misbehave on demand: error
// replies, throttling, dropped connections, stalls, short bodies, wrong ranges. The fake checks
// every request's SigV4 signature against the bytes that actually arrived, so what the client
// signs is what libcurl sends. Behaviour against a real server is in
// tests/integration/s3_client_integration_test.cc.
#include "transport/s3/s3_client.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>

#include "loopback.h"
#include "test_util.h"
#include "transport/s3/s3_request.h"
#include "transport/s3/s3_xml.h"
#include "transport/s3/sigv4.h"

namespace refit {
namespace {

using internal::S3QueryParams;

constexpr std::string_view kAccessKey = "FAKEACCESSKEY";
constexpr std::string_view kSecretKey = "fake/secret+key";
constexpr std::string_view kRegion = "us-east-1";
constexpr std::string_view kBucket = "fake-bucket";
constexpr uint64_t kMiB = uint64_t{1} << 20;
// Long enough for any loopback request in these tests, on a loaded machine.
constexpr auto kHandlerWaitLimit = std::chrono::seconds(10);

std::span<const std::byte> AsBytes(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

std::string AsString(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

std::vector<std::byte> RandomBytes(size_t size, uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::vector<std::byte> bytes(size);
  for (std::byte& b : bytes) b = static_cast<std::byte>(generator());
  return bytes;
}

std::string ErrorXml(std::string_view code, std::string_view message,
                     std::string_view request_id = "req-1") {
  return fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{}</Code><Message>{}</Message>"
      "<RequestId>{}</RequestId></Error>",
      code, message, request_id);
}

void ReplyError(httplib::Response& response, int http_status, std::string_view code,
                std::string_view message = "it failed") {
  response.status = http_status;
  response.set_content(ErrorXml(code, message), "application/xml");
}

// Check that `request` carries a valid SigV4 signature by kAccessKey over exactly the method,
// path, query, headers and body that arrived, and a correct x-amz-content-sha256.
std::string SignatureProblem(const httplib::Request& request) {
  const std::string authorization = request.get_header_value("Authorization");
  const std::string signed_marker = "SignedHeaders=";
  const size_t names_start = authorization.find(signed_marker);
  const size_t names_end = authorization.find(',', names_start);
  if (names_start == std::string::npos || names_end == std::string::npos) {
    return "no SignedHeaders in Authorization '" + authorization + "'";
  }
  const std::string payload_hash = request.get_header_value("x-amz-content-sha256");
  if (payload_hash != Sha256Hex(AsBytes(request.body))) {
    return "x-amz-content-sha256 '" + payload_hash + "' is not the body's SHA-256";
  }
  SigV4Request signed_request;
  signed_request.method = request.method;
  // httplib hands over the decoded path; the client encodes exactly as EncodeS3KeyPath does.
  signed_request.path = internal::EncodeS3KeyPath(request.path);
  for (const auto& [name, value] : request.params) signed_request.query.emplace_back(name, value);
  std::string names = authorization.substr(names_start + signed_marker.size(),
                                           names_end - names_start - signed_marker.size());
  for (size_t start = 0; start <= names.size();) {
    const size_t end = std::min(names.find(';', start), names.size());
    const std::string name = names.substr(start, end - start);
    if (!request.has_header(name.c_str())) return "signed header '" + name + "' was not sent";
    signed_request.headers.emplace_back(name, request.get_header_value(name.c_str()));
    start = end + 1;
  }
  signed_request.payload_sha256_hex = payload_hash;
  SigV4Credentials credentials{.access_key_id = std::string(kAccessKey),
                               .secret_access_key = std::string(kSecretKey),
                               .session_token = request.get_header_value("x-amz-security-token")};
  // The region is the third field of "Credential=<key>/<date>/<region>/s3/aws4_request".
  const std::string credential_marker = "Credential=";
  const size_t scope = authorization.find(credential_marker);
  if (scope == std::string::npos) return "no Credential in Authorization";
  std::vector<std::string> fields;
  for (size_t start = scope + credential_marker.size(); fields.size() < 3;) {
    const size_t end = authorization.find('/', start);
    if (end == std::string::npos) return "malformed Credential in '" + authorization + "'";
    fields.push_back(authorization.substr(start, end - start));
    start = end + 1;
  }
  auto expected = SignV4(signed_request, credentials, fields[2], "s3",
                         request.get_header_value("x-amz-date"), false);
  if (!expected.ok()) return "cannot recompute the signature: " + expected.status().ToString();
  if (expected->authorization != authorization) {
    return "signature mismatch; server's canonical request:\n" + expected->canonical_request;
  }
  return "";
}

// What the fake saw of one request.
struct SeenRequest {
  std::string method;
  std::string path;
  std::multimap<std::string, std::string> params;
  httplib::Headers headers;
  std::string body;
  int remote_port = 0;

  bool HasParam(const std::string& name) const { return params.count(name) != 0; }
  std::string Param(const std::string& name) const {
    const auto it = params.find(name);
    return it == params.end() ? std::string() : it->second;
  }
  std::string Header(const std::string& name) const {
    const auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

// An HTTP server on a loopback port whose every request goes to `handler`, after the signature
// check (a bad signature gets S3's 403 SignatureDoesNotMatch and never reaches the handler).
class FakeS3 {
 public:
  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;

  explicit FakeS3(Handler handler) : handler_(std::move(handler)) {
    const auto route = [this](const httplib::Request& request, httplib::Response& response) {
      {
        std::lock_guard lock(mutex_);
        seen_.push_back({request.method, request.path, request.params, request.headers,
                         request.body, request.remote_port});
      }
      const std::string problem = SignatureProblem(request);
      if (!problem.empty()) {
        ADD_FAILURE() << request.method << " " << request.path << ": " << problem;
        ReplyError(response, 403, "SignatureDoesNotMatch", problem);
        return;
      }
      handler_(request, response);
    };
    server_.Get(".*", route);
    server_.Put(".*", route);
    server_.Post(".*", route);
    server_.Delete(".*", route);
    // Idle keep-alive connections hold a worker until this runs out, which delays stop().
    server_.set_keep_alive_timeout(1);
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    const auto deadline = std::chrono::steady_clock::now() + kHandlerWaitLimit;
    while (!server_.is_running() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  ~FakeS3() {
    server_.stop();
    thread_.join();
  }

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }

  std::vector<SeenRequest> seen() const {
    std::lock_guard lock(mutex_);
    return seen_;
  }
  size_t count() const {
    std::lock_guard lock(mutex_);
    return seen_.size();
  }

 private:
  Handler handler_;
  httplib::Server server_;
  int port_ = -1;
  std::thread thread_;
  mutable std::mutex mutex_;
  std::vector<SeenRequest> seen_;
};

S3ClientOptions FastOptions(const std::string& endpoint) {
  S3ClientOptions options;
  options.endpoint = endpoint;
  options.region = std::string(kRegion);
  options.bucket = std::string(kBucket);
  options.credentials = {.access_key_id = std::string(kAccessKey),
                         .secret_access_key = std::string(kSecretKey),
                         .session_token = ""};
  options.max_retries = 3;
  options.retry_backoff = std::chrono::milliseconds(1);
  options.max_retry_backoff = std::chrono::milliseconds(5);
  options.connect_timeout = std::chrono::seconds(5);
  options.stall_timeout = std::chrono::seconds(5);
  return options;
}

std::unique_ptr<S3Client> MakeClient(const S3ClientOptions& options) {
  auto client = S3Client::Make(options);
  EXPECT_TRUE(client.ok()) << client.status().ToString();
  return client.ok() ? std::move(client).ValueOrDie() : nullptr;
}

// Counts concurrent requests in a handler and remembers the most seen at once.
class ConcurrencyGauge {
 public:
  // Enter, then hold the request until `target` requests have been inside at once (or a time
  // limit passes): on a slow machine requests would otherwise rarely overlap, and a client that
  // sends them one by one only ever reaches 1.
  void EnterAndAwaitPeak(int target) {
    const int now = ++current_;
    int seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    const auto deadline = std::chrono::steady_clock::now() + kHandlerWaitLimit;
    while (peak_.load() < target && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  void Leave() { --current_; }
  int peak() const { return peak_.load(); }

 private:
  std::atomic<int> current_{0};
  std::atomic<int> peak_{0};
};

// ---------------------------------------------------------------------------------------------
// Pure parts: endpoint, names, URLs, classification, backoff, XML.

TEST(S3EndpointTest, AcceptsHostsPortsAndAwsDefault) {
  ASSERT_OK_AND_ASSIGN(internal::S3Endpoint aws, internal::ParseS3Endpoint("", "eu-west-3"));
  EXPECT_TRUE(aws.https);
  EXPECT_EQ(aws.authority, "s3.eu-west-3.amazonaws.com");

  ASSERT_OK_AND_ASSIGN(internal::S3Endpoint local,
                       internal::ParseS3Endpoint("http://127.0.0.1:7480/", "us-east-1"));
  EXPECT_FALSE(local.https);
  EXPECT_EQ(local.host, "127.0.0.1");
  EXPECT_EQ(local.authority, "127.0.0.1:7480");
  EXPECT_TRUE(local.host_is_ip);

  ASSERT_OK_AND_ASSIGN(internal::S3Endpoint named,
                       internal::ParseS3Endpoint("https://minio.example-1.internal", "r"));
  EXPECT_TRUE(named.https);
  EXPECT_EQ(named.authority, "minio.example-1.internal");
  EXPECT_FALSE(named.host_is_ip);

  ASSERT_OK_AND_ASSIGN(internal::S3Endpoint ipv6,
                       internal::ParseS3Endpoint("http://[::1]:9000", "r"));
  EXPECT_EQ(ipv6.authority, "[::1]:9000");
  EXPECT_TRUE(ipv6.host_is_ip);
}

TEST(S3EndpointTest, RejectsWhatIsNotSchemeHostPort) {
  for (const char* endpoint :
       {"ftp://host", "host:80", "http://", "http://host/path", "http://host?x=1",
        "http://user@host", "http://host:0", "http://host:65536", "http://host:12ab",
        "http://host:", "http://ho st", "http://[::1", "http://[zz]:80", "http://host:80:81"}) {
    SCOPED_TRACE(endpoint);
    EXPECT_STATUS_MSG(InvalidArgument, "S3 endpoint", internal::ParseS3Endpoint(endpoint, "r"));
  }
}

TEST(S3BucketNameTest, FollowsS3NamingRules) {
  for (const std::string& good : {std::string("abc"), std::string("my-bucket.v2"),
                                  std::string("a0b"), std::string(63, 'a')}) {
    SCOPED_TRACE(good);
    EXPECT_OK(internal::ValidateS3BucketName(good));
  }
  for (const std::string& bad :
       {std::string("ab"), std::string(64, 'a'), std::string("Upper"), std::string("-abc"),
        std::string("abc-"), std::string("a..b"), std::string("192.168.1.10"),
        std::string("under_score"), std::string("sp ace")}) {
    SCOPED_TRACE(bad);
    EXPECT_STATUS(InvalidArgument, internal::ValidateS3BucketName(bad));
  }
}

TEST(S3KeyTest, EncodesEverythingButUnreservedAndSlash) {
  EXPECT_EQ(internal::EncodeS3KeyPath("dir/a b+c=d&e~f_g-h.i"), "dir/a%20b%2Bc%3Dd%26e~f_g-h.i");
  EXPECT_EQ(internal::EncodeS3KeyPath("\xc3\xbc%41*"), "%C3%BC%2541%2A");
  EXPECT_OK(internal::ValidateS3Key("k"));
  EXPECT_OK(internal::ValidateS3Key(std::string(1024, 'k')));
  EXPECT_STATUS(InvalidArgument, internal::ValidateS3Key(""));
  EXPECT_STATUS(InvalidArgument, internal::ValidateS3Key(std::string(1025, 'k')));
}

TEST(S3QueryTest, SortsEncodesAndKeepsEmptyValues) {
  const S3QueryParams query = {{"uploadId", "a/b c+d"}, {"partNumber", "7"}, {"uploads", ""}};
  EXPECT_EQ(internal::EncodeS3Query(query), "partNumber=7&uploadId=a%2Fb%20c%2Bd&uploads=");
}

TEST(S3RequestTargetTest, PathStyleAndVirtualHost) {
  ASSERT_OK_AND_ASSIGN(internal::S3Endpoint endpoint,
                       internal::ParseS3Endpoint("http://localhost:9000", "r"));
  const internal::S3RequestTarget path = internal::BuildS3RequestTarget(
      endpoint, S3Addressing::kPath, "bkt", "a b/c", {{"uploads", ""}});
  EXPECT_EQ(path.url, "http://localhost:9000/bkt/a%20b/c?uploads=");
  EXPECT_EQ(path.host, "localhost:9000");
  EXPECT_EQ(path.path, "/bkt/a%20b/c");

  const internal::S3RequestTarget bucket =
      internal::BuildS3RequestTarget(endpoint, S3Addressing::kPath, "bkt", "", {});
  EXPECT_EQ(bucket.url, "http://localhost:9000/bkt");

  const internal::S3RequestTarget virtual_host =
      internal::BuildS3RequestTarget(endpoint, S3Addressing::kVirtualHost, "bkt", "a b/c", {});
  EXPECT_EQ(virtual_host.url, "http://bkt.localhost:9000/a%20b/c");
  EXPECT_EQ(virtual_host.host, "bkt.localhost:9000");
  EXPECT_EQ(virtual_host.path, "/a%20b/c");

  const internal::S3RequestTarget virtual_bucket = internal::BuildS3RequestTarget(
      endpoint, S3Addressing::kVirtualHost, "bkt", "", {{"list-type", "2"}});
  EXPECT_EQ(virtual_bucket.url, "http://bkt.localhost:9000/?list-type=2");
}

TEST(S3ErrorClassificationTest, MapsCodesAndStatuses) {
  struct Case {
    long http_status;
    const char* code;
    StatusCode expected;
    bool retryable;
  };
  const Case cases[] = {
      {404, "NoSuchKey", StatusCode::kNotFound, false},
      {404, "NoSuchBucket", StatusCode::kNotFound, false},
      {404, "NoSuchUpload", StatusCode::kNotFound, false},
      {404, "", StatusCode::kNotFound, false},
      {403, "AccessDenied", StatusCode::kPermissionDenied, false},
      {403, "SignatureDoesNotMatch", StatusCode::kPermissionDenied, false},
      {403, "InvalidAccessKeyId", StatusCode::kPermissionDenied, false},
      {403, "", StatusCode::kPermissionDenied, false},
      {409, "BucketAlreadyExists", StatusCode::kAlreadyExists, false},
      {400, "EntityTooSmall", StatusCode::kInvalidArgument, false},
      {400, "InvalidPart", StatusCode::kInvalidArgument, false},
      {400, "InvalidPartOrder", StatusCode::kInvalidArgument, false},
      {400, "", StatusCode::kInvalidArgument, false},
      {412, "", StatusCode::kFailedPrecondition, false},
      {416, "InvalidRange", StatusCode::kFailedPrecondition, false},
      {301, "PermanentRedirect", StatusCode::kInvalidArgument, false},
      {500, "InternalError", StatusCode::kUnavailable, true},
      {503, "SlowDown", StatusCode::kUnavailable, true},
      {502, "", StatusCode::kUnavailable, true},
      {429, "", StatusCode::kUnavailable, true},
      {408, "", StatusCode::kDeadlineExceeded, true},
      {400, "RequestTimeout", StatusCode::kDeadlineExceeded, true},
      {400, "Throttling", StatusCode::kUnavailable, true},
      {400, "ThrottlingException", StatusCode::kUnavailable, true},
      {400, "RequestLimitExceeded", StatusCode::kUnavailable, true},
      {400, "TooManyRequestsException", StatusCode::kUnavailable, true},
      {200, "InternalError", StatusCode::kUnavailable, true},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(internal::S3ErrorStatusCode(c.http_status, c.code), c.expected)
        << c.http_status << " " << c.code;
    EXPECT_EQ(internal::IsRetryableS3Error(c.http_status, c.code), c.retryable)
        << c.http_status << " " << c.code;
  }
}

TEST(S3BackoffTest, DoublesUpToTheCap) {
  using std::chrono::milliseconds;
  EXPECT_EQ(internal::BackoffCeiling(milliseconds(100), milliseconds(5000), 0), milliseconds(100));
  EXPECT_EQ(internal::BackoffCeiling(milliseconds(100), milliseconds(5000), 1), milliseconds(200));
  EXPECT_EQ(internal::BackoffCeiling(milliseconds(100), milliseconds(5000), 5), milliseconds(3200));
  EXPECT_EQ(internal::BackoffCeiling(milliseconds(100), milliseconds(5000), 6), milliseconds(5000));
  EXPECT_EQ(internal::BackoffCeiling(milliseconds(100), milliseconds(5000), 1000000),
            milliseconds(5000));
  // No overflow with a cap near the limit of the representation.
  EXPECT_EQ(internal::BackoffCeiling(milliseconds(3), milliseconds::max(), 200),
            milliseconds::max());
  EXPECT_EQ(internal::BackoffCeiling(milliseconds(0), milliseconds(50), 10), milliseconds(0));
}

TEST(S3XmlTest, ParsesS3ShapedDocuments) {
  ASSERT_OK_AND_ASSIGN(
      internal::XmlElement root,
      internal::ParseXml(
          "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<!-- listing -->\n"
          "<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
          "<Name>b</Name><Contents><Key>a &lt;b&gt; &amp; &quot;c&quot; &apos;d&apos;</Key>"
          "<ETag>&quot;abc&quot;</ETag></Contents>"
          "<Contents><Key>&#65;&#x42;&#xe9;&#x1F600;</Key></Contents>"
          "<Contents><Key><![CDATA[<raw & text>]]></Key></Contents>"
          "<s3:Prefixed xmlns:s3='x'>p</s3:Prefixed><Empty/><Spaced>  keep  </Spaced>"
          "</ListBucketResult>\n"));
  EXPECT_EQ(root.name, "ListBucketResult");
  ASSERT_EQ(root.children.size(), 7u);
  EXPECT_EQ(*root.children[1].ChildText("Key"), "a <b> & \"c\" 'd'");
  EXPECT_EQ(*root.children[1].ChildText("ETag"), "\"abc\"");
  EXPECT_EQ(*root.children[2].ChildText("Key"), "AB\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_EQ(*root.children[3].ChildText("Key"), "<raw & text>");
  ASSERT_NE(root.ChildText("Prefixed"), nullptr);
  EXPECT_EQ(*root.ChildText("Prefixed"), "p");
  ASSERT_NE(root.ChildText("Empty"), nullptr);
  EXPECT_TRUE(root.ChildText("Empty")->empty());
  EXPECT_EQ(*root.ChildText("Spaced"), "  keep  ");
  EXPECT_EQ(root.Child("Missing"), nullptr);
}

TEST(S3XmlTest, RejectsMalformedDocuments) {
  std::string deep;
  for (int i = 0; i < 40; ++i) deep += "<a>";
  for (int i = 0; i < 40; ++i) deep += "</a>";
  for (const std::string& bad : {std::string(""),
                                 std::string("text"),
                                 std::string("<a>"),
                                 std::string("<a></b>"),
                                 std::string("<a></a><b/>"),
                                 std::string("<a>&unknown;</a>"),
                                 std::string("<a>&amp</a>"),
                                 std::string("<a>&#0;</a>"),
                                 std::string("<a>&#xD800;</a>"),
                                 std::string("<a>&#x110000;</a>"),
                                 std::string("<a>&#12x;</a>"),
                                 std::string("<!DOCTYPE a [<!ENTITY e 'x'>]><a>&e;</a>"),
                                 std::string("<a b=c></a>"),
                                 std::string("<a b='c></a>"),
                                 std::string("<a><![CDATA[x</a>"),
                                 std::string("<a><!-- x</a>"),
                                 deep,
                                 std::string("text<a/>"),
                                 std::string("<a/>text"),
                                 std::string("<a><!DOCTYPE a></a>"),
                                 std::string("<a>x</a>\0<b/>", 13),
                                 std::string("<a>x\0</a>", 9)}) {
    SCOPED_TRACE(bad);
    EXPECT_STATUS(DataLoss, internal::ParseXml(bad));
  }
}

TEST(S3XmlTest, ErrorsNameTheDefectAndItsOffset) {
  EXPECT_STATUS_MSG(DataLoss, "unknown entity '&e;' at offset 5",
                    internal::ParseXml("<a>x &e;</a>"));
  EXPECT_STATUS_MSG(DataLoss, "DOCTYPE or other markup declaration (refused)",
                    internal::ParseXml("<!DOCTYPE a [<!ENTITY e 'x'>]><a/>"));
  EXPECT_STATUS_MSG(DataLoss, "content after the root element", internal::ParseXml("<a/><b/>"));
  // pugixml would stop at the NUL and accept what came before it.
  EXPECT_STATUS_MSG(DataLoss, "NUL byte at offset 8",
                    internal::ParseXml(std::string("<a>x</a>\0<b/>", 13)));
  EXPECT_STATUS_MSG(DataLoss, "at offset", internal::ParseXml("<a><b></a>"));
  // Whitespace around the root, comments and processing instructions are fine.
  ASSERT_OK_AND_ASSIGN(internal::XmlElement root,
                       internal::ParseXml("\n<?xml version='1.0'?>\n<a><!-- c --><?p?>t</a>\n"));
  EXPECT_EQ(root.text, "t");
}

// A strict reader of an untrusted server's replies: the document is well-formed UTF-8 of XML
// characters, and element names are XML names (prefix:local, each an NCName). pugixml alone takes
// any byte above 0x7F in a name, and the local name of "a:0b" would be "0b", which cannot be
// written back as a start tag (the s3_xml_fuzz finding, in the corpus as regression-bad-name-utf8).
TEST(S3XmlTest, RefusesBadNamesAndMalformedUtf8) {
  EXPECT_STATUS_MSG(DataLoss, "malformed UTF-8 (byte 0xbb) at offset 6",
                    internal::ParseXml("<Lcati\xbb\xff\xff\xff\x92"
                                       "0:0\xc9/>"));
  EXPECT_STATUS_MSG(DataLoss, "bad element name 'Lcati:0' at offset 1",
                    internal::ParseXml("<Lcati:0/>"));
  EXPECT_STATUS_MSG(DataLoss, "bad element name 'a:0b'", internal::ParseXml("<a:0b/>"));
  EXPECT_STATUS_MSG(DataLoss, "character U+0001 is not allowed in XML at offset 3",
                    internal::ParseXml("<a>\x01</a>"));
  for (const std::string& bad :
       {std::string("<a>\xc3</a>"),              // truncated sequence
        std::string("<a>\xc0\xaf</a>"),          // overlong '/'
        std::string("<a>\xed\xa0\x80</a>"),      // an encoded surrogate
        std::string("<a>\xf4\x90\x80\x80</a>"),  // past U+10FFFF
        std::string("<a>\xef\xbf\xbe</a>"),      // U+FFFE
        std::string("<a>&#1;</a>"),              // a reference to a non-Char
        std::string("<a>&#xFFFF;</a>"), std::string("<a:>x</a:>"), std::string("<:a>x</:a>"),
        std::string("<a:b:c/>"), std::string("<-a/>"), std::string("<a><1/></a>"),
        std::string("<\xc2\xb7"
                    "a/>"),                         // U+00B7 is a NameChar, not a start
        std::string("<a><b\xe2\x80\x8e/></a>")}) {  // U+200E (LRM) is not a NameChar
    SCOPED_TRACE(bad);
    EXPECT_STATUS(DataLoss, internal::ParseXml(bad));
  }
  // Names beyond ASCII that XML allows are kept as sent.
  ASSERT_OK_AND_ASSIGN(internal::XmlElement root,
                       internal::ParseXml("<s3:R\xc3\xa9sum\xc3\xa9><a\xc2\xb7"
                                          "b-1.x_/>"
                                          "<\xe4\xb8\xad/></s3:R\xc3\xa9sum\xc3\xa9>"));
  EXPECT_EQ(root.name, "R\xc3\xa9sum\xc3\xa9");
  ASSERT_EQ(root.children.size(), 2u);
  EXPECT_EQ(root.children[0].name,
            "a\xc2\xb7"
            "b-1.x_");
  EXPECT_EQ(root.children[1].name, "\xe4\xb8\xad");
}

TEST(S3XmlTest, EscapeRoundTrips) {
  const std::string text = "<a href=\"x\">'&'</a>";
  const std::string escaped = internal::XmlEscape(text);
  EXPECT_EQ(escaped.find_first_of("<>\"'"), std::string::npos);
  ASSERT_OK_AND_ASSIGN(internal::XmlElement element, internal::ParseXml("<e>" + escaped + "</e>"));
  EXPECT_EQ(element.text, text);
}

// ---------------------------------------------------------------------------------------------
// Options and credentials.

TEST(S3ClientOptionsTest, MakeValidatesEveryOption) {
  const S3ClientOptions good = FastOptions("http://127.0.0.1:1");
  ASSERT_OK(S3Client::Make(good).status());
  const auto expect_bad = [&](const std::string& what, auto&& mutate) {
    S3ClientOptions options = good;
    mutate(options);
    SCOPED_TRACE(what);
    EXPECT_STATUS(InvalidArgument, S3Client::Make(options));
  };
  expect_bad("endpoint", [](S3ClientOptions& o) { o.endpoint = "s3://bucket"; });
  expect_bad("endpoint path", [](S3ClientOptions& o) { o.endpoint = "http://h:1/p"; });
  expect_bad("empty region", [](S3ClientOptions& o) { o.region.clear(); });
  expect_bad("region chars", [](S3ClientOptions& o) { o.region = "us/east"; });
  expect_bad("bucket", [](S3ClientOptions& o) { o.bucket = "Bad_Bucket"; });
  expect_bad("empty bucket", [](S3ClientOptions& o) { o.bucket.clear(); });
  expect_bad("access key", [](S3ClientOptions& o) { o.credentials.access_key_id.clear(); });
  expect_bad("access key chars", [](S3ClientOptions& o) { o.credentials.access_key_id = "a/b"; });
  expect_bad("secret", [](S3ClientOptions& o) { o.credentials.secret_access_key.clear(); });
  expect_bad("token line break", [](S3ClientOptions& o) { o.credentials.session_token = "a\nb"; });
  expect_bad("retries", [](S3ClientOptions& o) { o.max_retries = -1; });
  expect_bad("connect timeout", [](S3ClientOptions& o) { o.connect_timeout = {}; });
  expect_bad("stall timeout",
             [](S3ClientOptions& o) { o.stall_timeout = std::chrono::milliseconds(-1); });
  expect_bad("backoff",
             [](S3ClientOptions& o) { o.retry_backoff = std::chrono::milliseconds(-1); });
  expect_bad("max backoff",
             [](S3ClientOptions& o) { o.max_retry_backoff = std::chrono::milliseconds(-1); });
  expect_bad("page size 0", [](S3ClientOptions& o) { o.list_page_size = 0; });
  expect_bad("page size 1001", [](S3ClientOptions& o) { o.list_page_size = 1001; });
  expect_bad("ca file", [](S3ClientOptions& o) { o.tls_ca_cert_path = "/nonexistent/ca.pem"; });
  expect_bad("virtual host on IP",
             [](S3ClientOptions& o) { o.addressing = S3Addressing::kVirtualHost; });
  expect_bad("dotted bucket as TLS virtual host", [](S3ClientOptions& o) {
    o.endpoint = "https://s3.example.com";
    o.bucket = "my.bucket";
    o.addressing = S3Addressing::kVirtualHost;
  });

  S3ClientOptions virtual_host = good;
  virtual_host.endpoint = "https://s3.example.com";
  virtual_host.addressing = S3Addressing::kVirtualHost;
  EXPECT_OK(S3Client::Make(virtual_host).status());
  S3ClientOptions aws = good;
  aws.endpoint.clear();
  EXPECT_OK(S3Client::Make(aws).status());
}

TEST(S3ClientOptionsTest, CredentialsFromEnvironment) {
  const auto restore = [](const char* name, const char* value) {
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  };
  const char* names[] = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"};
  std::vector<std::optional<std::string>> saved;
  for (const char* name : names) {
    const char* value = std::getenv(name);
    saved.push_back(value == nullptr ? std::nullopt : std::optional<std::string>(value));
  }
  setenv("AWS_ACCESS_KEY_ID", "AK", 1);
  setenv("AWS_SECRET_ACCESS_KEY", "SK", 1);
  setenv("AWS_SESSION_TOKEN", "TOKEN", 1);
  auto credentials = S3CredentialsFromEnvironment();
  unsetenv("AWS_SESSION_TOKEN");
  auto without_token = S3CredentialsFromEnvironment();
  setenv("AWS_SECRET_ACCESS_KEY", "", 1);
  auto empty_secret = S3CredentialsFromEnvironment();
  unsetenv("AWS_ACCESS_KEY_ID");
  auto no_key = S3CredentialsFromEnvironment();
  for (size_t i = 0; i < saved.size(); ++i) {
    restore(names[i], saved[i].has_value() ? saved[i]->c_str() : nullptr);
  }

  ASSERT_OK(credentials.status());
  EXPECT_EQ(credentials->access_key_id, "AK");
  EXPECT_EQ(credentials->secret_access_key, "SK");
  EXPECT_EQ(credentials->session_token, "TOKEN");
  ASSERT_OK(without_token.status());
  EXPECT_TRUE(without_token->session_token.empty());
  EXPECT_STATUS_MSG(NotFound, "AWS_SECRET_ACCESS_KEY", empty_secret);
  EXPECT_STATUS_MSG(NotFound, "AWS_ACCESS_KEY_ID", no_key);
}

// ---------------------------------------------------------------------------------------------
// Requests as they arrive.

TEST(S3ClientRequestTest, SignsWhatItSendsWithoutExpectContinue) {
  FakeS3 server([](const httplib::Request&, httplib::Response& response) {
    response.set_header("ETag", "\"e\"");
  });
  S3ClientOptions options = FastOptions(server.endpoint());
  options.credentials.session_token = "session/token+=";
  std::unique_ptr<S3Client> client = MakeClient(options);
  ASSERT_NE(client, nullptr);
  // Over 1 MiB, where libcurl would otherwise wait for "100 Continue".
  const std::vector<std::byte> body = RandomBytes(2 * kMiB, 1);
  const std::string key = "dir/a b+c=d&e~f(1)*!\xc3\xbc%41";
  ASSERT_OK(client->PutObject(key, body));
  ASSERT_OK_AND_ASSIGN(std::string etag, client->UploadPart(key, "upload/id+1", 3, body));
  EXPECT_EQ(etag, "e");

  const std::vector<SeenRequest> seen = server.seen();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].method, "PUT");
  EXPECT_EQ(seen[0].path, "/fake-bucket/" + key);
  EXPECT_EQ(seen[0].body, AsString(body));
  EXPECT_EQ(seen[0].Header("Expect"), "");
  EXPECT_EQ(seen[0].Header("Content-Type"), "application/octet-stream");
  EXPECT_EQ(seen[0].Header("x-amz-security-token"), "session/token+=");
  EXPECT_EQ(seen[0].Header("x-amz-content-sha256"), Sha256Hex(body));
  EXPECT_NE(seen[0].Header("Authorization").find("x-amz-security-token"), std::string::npos);
  EXPECT_EQ(seen[1].Param("partNumber"), "3");
  EXPECT_EQ(seen[1].Param("uploadId"), "upload/id+1");
  // A part is not a form: libcurl's default Content-Type is removed.
  EXPECT_EQ(seen[1].Header("Content-Type"), "");
}

TEST(S3ClientRequestTest, VirtualHostPutsTheBucketInTheHostHeader) {
  FakeS3 server([](const httplib::Request&, httplib::Response& response) {
    response.set_content("abc", "application/octet-stream");
  });
  S3ClientOptions options = FastOptions("http://localhost:" + std::to_string(server.port()));
  options.addressing = S3Addressing::kVirtualHost;
  std::unique_ptr<S3Client> client = MakeClient(options);
  ASSERT_NE(client, nullptr);
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> read, client->GetObject("k/1"));
  EXPECT_EQ(AsString(read), "abc");
  const std::vector<SeenRequest> seen = server.seen();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].Header("Host"), "fake-bucket.localhost:" + std::to_string(server.port()));
  EXPECT_EQ(seen[0].path, "/k/1");
}

TEST(S3ClientRequestTest, ReusesConnections) {
  FakeS3 server([](const httplib::Request&, httplib::Response& response) {
    response.set_content("x", "application/octet-stream");
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  for (int i = 0; i < 3; ++i) ASSERT_OK(client->GetObject("k").status());
  const std::vector<SeenRequest> seen = server.seen();
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].remote_port, seen[1].remote_port);
  EXPECT_EQ(seen[1].remote_port, seen[2].remote_port);
}

TEST(S3ClientRequestTest, CreateBucketNamesItsRegionAndAcceptsAnOwnedBucket) {
  std::atomic<int> calls{0};
  FakeS3 server([&](const httplib::Request&, httplib::Response& response) {
    switch (calls++) {
      case 0:
        return;
      case 1:
        return ReplyError(response, 409, "BucketAlreadyOwnedByYou");
      default:
        return ReplyError(response, 409, "BucketAlreadyExists");
    }
  });
  S3ClientOptions options = FastOptions(server.endpoint());
  options.region = "eu-central-1";
  std::unique_ptr<S3Client> client = MakeClient(options);
  ASSERT_NE(client, nullptr);
  EXPECT_OK(client->CreateBucket());
  EXPECT_OK(client->CreateBucket());
  EXPECT_STATUS_MSG(AlreadyExists, "BucketAlreadyExists", client->CreateBucket());
  const std::vector<SeenRequest> seen = server.seen();
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].method, "PUT");
  EXPECT_EQ(seen[0].path, "/fake-bucket");
  EXPECT_NE(seen[0].body.find("<LocationConstraint>eu-central-1</LocationConstraint>"),
            std::string::npos)
      << seen[0].body;
}

TEST(S3ClientRequestTest, InvalidKeysAndIdsSendNothing) {
  FakeS3 server([](const httplib::Request&, httplib::Response&) {});
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  EXPECT_STATUS(InvalidArgument, client->PutObject("", AsBytes("x")));
  EXPECT_STATUS(InvalidArgument, client->GetObject(std::string(1025, 'k')));
  EXPECT_STATUS(InvalidArgument, client->UploadPart("k", "", 1, AsBytes("x")));
  EXPECT_STATUS(InvalidArgument, client->UploadPart("k", "id", 0, AsBytes("x")));
  EXPECT_STATUS(InvalidArgument, client->UploadPart("k", "id", 10001, AsBytes("x")));
  EXPECT_STATUS(InvalidArgument, client->AbortMultipartUpload("k", ""));
  EXPECT_STATUS(InvalidArgument, client->CompleteMultipartUpload("k", "", {"e"}));
  EXPECT_STATUS(InvalidArgument, client->CompleteMultipartUpload("k", "id", {}));
  const std::vector<std::byte> bytes(16);
  EXPECT_STATUS(InvalidArgument, client->Upload("k", bytes, {.part_size = 1 * kMiB}));
  EXPECT_STATUS(InvalidArgument,
                client->Upload("k", bytes, {.part_size = 5 * kMiB, .max_parts_in_flight = 0}));
  EXPECT_STATUS(InvalidArgument, client->Download("k", 16, {.part_size = (uint64_t{5} << 30) + 1}));
  EXPECT_EQ(server.count(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Errors and retries.

TEST(S3ClientRetryTest, RetriesServerErrorsAndThrottlingUntilSuccess) {
  std::atomic<int> calls{0};
  FakeS3 server([&](const httplib::Request&, httplib::Response& response) {
    switch (calls++) {
      case 0:
        return ReplyError(response, 500, "InternalError");
      case 1:
        return ReplyError(response, 503, "SlowDown");
      case 2:
        return ReplyError(response, 429, "TooManyRequests");
      case 3:
        return ReplyError(response, 408, "RequestTimeout");
      case 4:
        return ReplyError(response, 400, "Throttling");
      default:
        response.set_content("done", "application/octet-stream");
    }
  });
  S3ClientOptions options = FastOptions(server.endpoint());
  options.max_retries = 5;
  std::unique_ptr<S3Client> client = MakeClient(options);
  ASSERT_NE(client, nullptr);
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> read, client->GetObject("k"));
  EXPECT_EQ(AsString(read), "done");
  EXPECT_EQ(server.count(), 6u);
}

TEST(S3ClientRetryTest, GivesUpAfterMaxRetries) {
  FakeS3 server([](const httplib::Request&, httplib::Response& response) {
    ReplyError(response, 503, "SlowDown", "Please reduce your request rate.");
  });
  S3ClientOptions options = FastOptions(server.endpoint());
  options.max_retries = 2;
  std::unique_ptr<S3Client> client = MakeClient(options);
  ASSERT_NE(client, nullptr);
  const Status status = client->PutObject("k", AsBytes("x"));
  EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
  EXPECT_NE(status.message().find("S3 PUT fake-bucket/k (PutObject): HTTP 503 SlowDown: Please "
                                  "reduce your request rate. (request id req-1); gave up after 3 "
                                  "attempts"),
            std::string::npos)
      << status.message();
  EXPECT_EQ(server.count(), 3u);
}

TEST(S3ClientRetryTest, ClientErrorsAreFinal) {
  struct Case {
    int http_status;
    const char* code;
    StatusCode expected;
  };
  for (const Case& c : {Case{400, "InvalidArgument", StatusCode::kInvalidArgument},
                        Case{403, "AccessDenied", StatusCode::kPermissionDenied},
                        Case{403, "SignatureDoesNotMatch", StatusCode::kPermissionDenied},
                        Case{404, "NoSuchKey", StatusCode::kNotFound},
                        Case{404, "NoSuchBucket", StatusCode::kNotFound},
                        Case{412, "PreconditionFailed", StatusCode::kFailedPrecondition}}) {
    FakeS3 server([&](const httplib::Request&, httplib::Response& response) {
      ReplyError(response, c.http_status, c.code);
    });
    std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
    ASSERT_NE(client, nullptr);
    const Status status = client->GetObject("k").status();
    EXPECT_EQ(status.code(), c.expected) << status.ToString();
    EXPECT_NE(status.message().find(c.code), std::string::npos) << status.message();
    EXPECT_EQ(status.message().find("gave up"), std::string::npos) << status.message();
    EXPECT_EQ(server.count(), 1u) << c.code;
  }
}

TEST(S3ClientRetryTest, ErrorMessagesCarryS3sWords) {
  std::atomic<int> calls{0};
  FakeS3 server([&](const httplib::Request&, httplib::Response& response) {
    switch (calls++) {
      case 0:
        response.status = 403;
        response.set_content(
            ErrorXml("AccessDenied", "key &lt;a&gt; &amp; &quot;b&quot; &#x41;&#66;", "id-42"),
            "application/xml");
        return;
      case 1:
        // RGW's style: an empty message.
        response.status = 404;
        response.set_content(
            "<Error><Code>NoSuchKey</Code><Message/><RequestId>tx1</RequestId>"
            "</Error>",
            "application/xml");
        return;
      default:
        response.status = 400;
        response.set_header("x-amz-request-id", "hdr-7");
        response.set_content("<html>proxy says no</html>", "text/html");
    }
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  EXPECT_STATUS_MSG(PermissionDenied,
                    "S3 GET fake-bucket/k (GetObject): HTTP 403 AccessDenied: key <a> & \"b\" AB "
                    "(request id id-42)",
                    client->GetObject("k"));
  EXPECT_STATUS_MSG(NotFound, "HTTP 404 NoSuchKey: (no message) (request id tx1)",
                    client->GetObject("k"));
  EXPECT_STATUS_MSG(InvalidArgument, "HTTP 400: <html>proxy says no</html> (request id hdr-7)",
                    client->GetObject("k"));
}

TEST(S3ClientRetryTest, HeadErrorsUseTheStatusAlone) {
  FakeS3 server([](const httplib::Request&, httplib::Response& response) {
    response.status = 404;
    response.set_header("x-amz-request-id", "head-1");
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  EXPECT_STATUS_MSG(NotFound,
                    "S3 HEAD fake-bucket/missing (HeadObject): HTTP 404 (no error body) "
                    "(request id head-1)",
                    client->HeadObject("missing"));
  EXPECT_EQ(server.count(), 1u);
}

TEST(S3ClientRetryTest, ConnectionRefusedIsRetriedThenUnavailable) {
  const std::string closed = "http://" + testing::FreeLoopbackEndpoint();
  S3ClientOptions options = FastOptions(closed);
  options.max_retries = 2;
  std::unique_ptr<S3Client> client = MakeClient(options);
  ASSERT_NE(client, nullptr);
  EXPECT_STATUS_MSG(Unavailable, "gave up after 3 attempts", client->GetObject("k"));
  options.max_retries = 0;
  client = MakeClient(options);
  ASSERT_NE(client, nullptr);
  EXPECT_STATUS_MSG(Unavailable, "gave up after 1 attempt", client->GetObject("k"));
}

TEST(S3ClientRetryTest, BackoffIsCapped) {
  FakeS3 server([](const httplib::Request&, httplib::Response& response) {
    ReplyError(response, 500, "InternalError");
  });
  S3ClientOptions options = FastOptions(server.endpoint());
  options.max_retries = 4;
  // Uncapped, four retries would wait up to 60 s, 120 s, …; the cap keeps each under 10 ms.
  options.retry_backoff = std::chrono::seconds(60);
  options.max_retry_backoff = std::chrono::milliseconds(10);
  std::unique_ptr<S3Client> client = MakeClient(options);
  ASSERT_NE(client, nullptr);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_STATUS(Unavailable, client->GetObject("k"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(server.count(), 5u);
}

TEST(S3ClientRetryTest, StalledReplyIsDeadlineExceeded) {
  std::atomic<bool> release{false};
  FakeS3 server([&](const httplib::Request&, httplib::Response& response) {
    const auto deadline = std::chrono::steady_clock::now() + kHandlerWaitLimit;
    while (!release.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    response.set_content("late", "application/octet-stream");
  });
  S3ClientOptions options = FastOptions(server.endpoint());
  options.stall_timeout = std::chrono::seconds(1);
  options.max_retries = 0;
  std::unique_ptr<S3Client> client = MakeClient(options);
  ASSERT_NE(client, nullptr);
  const auto start = std::chrono::steady_clock::now();
  const Status status = client->GetObject("k").status();
  release = true;
  EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, kHandlerWaitLimit);
}

TEST(S3ClientRetryTest, ErrorInsideOkReplyOfCompleteIsAnError) {
  std::atomic<int> calls{0};
  FakeS3 server([&](const httplib::Request& request, httplib::Response& response) {
    switch (calls++) {
      case 0:
        // S3 sends 200 first and the failure in the body.
        response.set_content(ErrorXml("InternalError", "We encountered an internal error."),
                             "application/xml");
        return;
      case 1:
        response.set_content(
            "<CompleteMultipartUploadResult><Key>k</Key><ETag>\"x-2\"</ETag>"
            "</CompleteMultipartUploadResult>",
            "application/xml");
        return;
      default:
        response.set_content(ErrorXml("InvalidPart", "One or more parts could not be found."),
                             "application/xml");
    }
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  EXPECT_OK(client->CompleteMultipartUpload("k", "up", {"a", "b\"<"}));
  EXPECT_EQ(server.count(), 2u);
  EXPECT_STATUS_MSG(InvalidArgument, "InvalidPart",
                    client->CompleteMultipartUpload("k", "up", {"a", "b"}));
  EXPECT_EQ(server.count(), 3u);
  const std::vector<SeenRequest> seen = server.seen();
  EXPECT_EQ(seen[0].method, "POST");
  EXPECT_EQ(seen[0].Param("uploadId"), "up");
  EXPECT_EQ(seen[0].body,
            "<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>\"a\"</ETag></Part>"
            "<Part><PartNumber>2</PartNumber><ETag>\"b&quot;&lt;\"</ETag></Part>"
            "</CompleteMultipartUpload>");
}

// ---------------------------------------------------------------------------------------------
// Reply bodies: lengths, limits, ranges.

TEST(S3ClientBodyTest, ShortBodyIsRetriedThenDataLoss) {
  FakeS3 server([](const httplib::Request&, httplib::Response& response) {
    response.set_content_provider(100, "application/octet-stream",
                                  [](size_t offset, size_t length, httplib::DataSink& sink) {
                                    const std::string half(50, 'h');
                                    sink.write(half.data(), half.size());
                                    // Failing the provider closes the connection after 50 of 100
                                    // announced bytes.
                                    return false;
                                  });
  });
  S3ClientOptions options = FastOptions(server.endpoint());
  options.max_retries = 1;
  std::unique_ptr<S3Client> client = MakeClient(options);
  ASSERT_NE(client, nullptr);
  EXPECT_STATUS_MSG(DataLoss, "gave up after 2 attempts", client->GetObject("k"));
  EXPECT_EQ(server.count(), 2u);
}

TEST(S3ClientBodyTest, MaxBytesIsCheckedBeforeTheBody) {
  FakeS3 server([](const httplib::Request&, httplib::Response& response) {
    response.set_content(std::string(kMiB, 'x'), "application/octet-stream");
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  EXPECT_STATUS_MSG(ResourceExhausted,
                    "reply is 1048576 bytes (Content-Length), more than max_bytes",
                    client->GetObject("k", kMiB - 1));
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> read, client->GetObject("k", kMiB));
  EXPECT_EQ(read.size(), kMiB);
  EXPECT_EQ(server.count(), 2u);
}

TEST(S3ClientBodyTest, MaxBytesBindsBodiesWithoutLength) {
  FakeS3 server([](const httplib::Request&, httplib::Response& response) {
    response.set_chunked_content_provider("application/octet-stream",
                                          [](size_t offset, httplib::DataSink& sink) {
                                            if (offset >= kMiB) {
                                              sink.done();
                                              return true;
                                            }
                                            const std::string chunk(64 << 10, 'c');
                                            return sink.write(chunk.data(), chunk.size());
                                          });
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  EXPECT_STATUS_MSG(ResourceExhausted, "longer than max_bytes", client->GetObject("k", 100000));
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> read, client->GetObject("k"));
  EXPECT_EQ(read.size(), kMiB);
}

TEST(S3ClientBodyTest, RangedGetChecksWhatComesBack) {
  const std::string object = "0123456789abcdefghij";
  std::atomic<int> mode{0};
  FakeS3 server([&](const httplib::Request& request, httplib::Response& response) {
    if (mode.load() == 0) {
      // Honest: httplib itself serves the Range from the whole object.
      response.set_content(object, "application/octet-stream");
      return;
    }
    // Dishonest replies must reach the client as written, so httplib's own Range handling
    // (which would cut them again) is switched off for this request.
    const_cast<httplib::Request&>(request).ranges.clear();
    switch (mode.load()) {
      case 1:  // another range of the same length
        response.status = 206;
        response.set_header("Content-Range", "bytes 6-10/20");
        response.set_content(object.substr(6, 5), "application/octet-stream");
        return;
      case 2:  // Range ignored: the whole object
        response.set_content(object, "application/octet-stream");
        return;
      default:
        return ReplyError(response, 416, "InvalidRange");
    }
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  std::string window(5, '\0');
  const auto out = std::as_writable_bytes(std::span(window));
  ASSERT_OK(client->GetObjectRange("k", 5, out));
  EXPECT_EQ(window, "56789");
  EXPECT_EQ(server.seen().back().Header("Range"), "bytes=5-9");
  mode = 1;
  EXPECT_STATUS_MSG(DataLoss, "reply is for bytes 6-10, asked for 5-9",
                    client->GetObjectRange("k", 5, out));
  mode = 2;
  EXPECT_STATUS(DataLoss, client->GetObjectRange("k", 5, out));
  mode = 3;
  EXPECT_STATUS_MSG(FailedPrecondition, "416", client->GetObjectRange("k", 50, out));
  const size_t requests = server.count();
  EXPECT_OK(client->GetObjectRange("k", 5, {}));
  EXPECT_EQ(server.count(), requests);
}

// ---------------------------------------------------------------------------------------------
// Listings.

TEST(S3ClientListTest, ListObjectsFollowsContinuationTokens) {
  const std::vector<std::string> keys = {"p/a&b", "p/b", "p/c<d", "p/e", "p/f"};
  FakeS3 server([&](const httplib::Request& request, httplib::Response& response) {
    const std::string token = request.get_param_value("continuation-token");
    const size_t start = token.empty() ? 0 : std::stoul(token.substr(std::string("tok ").size()));
    const size_t page = std::stoul(request.get_param_value("max-keys"));
    std::string xml = "<?xml version=\"1.0\"?><ListBucketResult><Name>fake-bucket</Name>";
    for (size_t i = start; i < std::min(start + page, keys.size()); ++i) {
      xml += fmt::format(
          "<Contents><Key>{}</Key><LastModified>x</LastModified><ETag>&quot;etag{}&quot;</ETag>"
          "<Size>{}</Size><StorageClass>STANDARD</StorageClass></Contents>",
          internal::XmlEscape(keys[i]), i, i * 10);
    }
    const bool truncated = start + page < keys.size();
    xml += fmt::format("<IsTruncated>{}</IsTruncated>", truncated ? "true" : "false");
    if (truncated) {
      xml += fmt::format("<NextContinuationToken>tok {}</NextContinuationToken>", start + page);
    }
    xml += "</ListBucketResult>";
    response.set_content(xml, "application/xml");
  });
  S3ClientOptions options = FastOptions(server.endpoint());
  options.list_page_size = 2;
  std::unique_ptr<S3Client> client = MakeClient(options);
  ASSERT_NE(client, nullptr);
  ASSERT_OK_AND_ASSIGN(std::vector<S3ObjectInfo> listed, client->ListObjects("p/"));
  ASSERT_EQ(listed.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(listed[i].key, keys[i]);
    EXPECT_EQ(listed[i].size, i * 10);
    EXPECT_EQ(listed[i].etag, "etag" + std::to_string(i));
  }
  const std::vector<SeenRequest> seen = server.seen();
  ASSERT_EQ(seen.size(), 3u);
  for (const SeenRequest& request : seen) {
    EXPECT_EQ(request.path, "/fake-bucket");
    EXPECT_EQ(request.Param("list-type"), "2");
    EXPECT_EQ(request.Param("prefix"), "p/");
    EXPECT_EQ(request.Param("max-keys"), "2");
  }
  EXPECT_FALSE(seen[0].HasParam("continuation-token"));
  EXPECT_EQ(seen[2].Param("continuation-token"), "tok 4");
}

TEST(S3ClientListTest, MalformedListingsAreDataLoss) {
  std::atomic<int> mode{0};
  FakeS3 server([&](const httplib::Request&, httplib::Response& response) {
    const char* bodies[] = {
        "<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>",
        "<ListBucketResult><Contents><Key>k</Key><Size>-1</Size></Contents></ListBucketResult>",
        "<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>",
        "<Unexpected/>",
        "<ListBucketResult>",
    };
    response.set_content(bodies[mode.load()], "application/xml");
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  for (int i = 0; i < 5; ++i) {
    mode = i;
    SCOPED_TRACE(i);
    EXPECT_STATUS_MSG(DataLoss, "S3 GET fake-bucket (ListObjectsV2)", client->ListObjects(""));
  }
}

TEST(S3ClientListTest, ListMultipartUploadsFollowsMarkers) {
  FakeS3 server([](const httplib::Request& request, httplib::Response& response) {
    EXPECT_TRUE(request.has_param("uploads"));
    EXPECT_EQ(request.get_param_value("max-uploads"), "1000");
    if (!request.has_param("key-marker")) {
      response.set_content(
          "<ListMultipartUploadsResult><Upload><Key>a</Key><UploadId>1</UploadId></Upload>"
          "<IsTruncated>true</IsTruncated><NextKeyMarker>a</NextKeyMarker>"
          "<NextUploadIdMarker>1</NextUploadIdMarker></ListMultipartUploadsResult>",
          "application/xml");
      return;
    }
    EXPECT_EQ(request.get_param_value("key-marker"), "a");
    EXPECT_EQ(request.get_param_value("upload-id-marker"), "1");
    response.set_content(
        "<ListMultipartUploadsResult><Upload><Key>b &amp; c</Key><UploadId>2</UploadId></Upload>"
        "<IsTruncated>false</IsTruncated></ListMultipartUploadsResult>",
        "application/xml");
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  ASSERT_OK_AND_ASSIGN(std::vector<S3MultipartUpload> uploads, client->ListMultipartUploads(""));
  ASSERT_EQ(uploads.size(), 2u);
  EXPECT_EQ(uploads[0].key, "a");
  EXPECT_EQ(uploads[0].upload_id, "1");
  EXPECT_EQ(uploads[1].key, "b & c");
  EXPECT_EQ(uploads[1].upload_id, "2");
  EXPECT_EQ(server.count(), 2u);
}

TEST(S3ClientListTest, DeleteOfAMissingKeyIsOk) {
  std::atomic<int> calls{0};
  FakeS3 server([&](const httplib::Request&, httplib::Response& response) {
    switch (calls++) {
      case 0:
        response.status = 204;
        return;
      case 1:
        return ReplyError(response, 404, "NoSuchKey");
      default:
        return ReplyError(response, 404, "NoSuchBucket");
    }
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  EXPECT_OK(client->DeleteObject("k"));
  EXPECT_OK(client->DeleteObject("k"));
  EXPECT_STATUS_MSG(NotFound, "NoSuchBucket", client->DeleteObject("k"));
}

// ---------------------------------------------------------------------------------------------
// Upload and Download in parts.

// Just enough of S3's multipart API to check Upload: parts are kept and Complete assembles them
// in the order its document names them.
class FakeMultipartStore {
 public:
  // Fail UploadPart of this part number with 403 (0: never).
  std::atomic<int> fail_part{0};
  // Part uploads are held until this many are in flight at once (see ConcurrencyGauge).
  int expected_parts_in_flight = 1;
  ConcurrencyGauge gauge;

  void Handle(const httplib::Request& request, httplib::Response& response) {
    if (request.method == "POST" && request.has_param("uploads")) {
      response.set_content(
          "<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>k</Key>"
          "<UploadId>upload-1</UploadId></InitiateMultipartUploadResult>",
          "application/xml");
      return;
    }
    if (request.method == "PUT" && request.has_param("partNumber")) {
      EXPECT_EQ(request.get_param_value("uploadId"), "upload-1");
      gauge.EnterAndAwaitPeak(expected_parts_in_flight);
      gauge.Leave();
      const int part = std::stoi(request.get_param_value("partNumber"));
      if (part == fail_part.load()) return ReplyError(response, 403, "AccessDenied");
      std::lock_guard lock(mutex_);
      parts_[part] = request.body;
      response.set_header("ETag", fmt::format("\"etag-{}\"", part));
      return;
    }
    if (request.method == "POST" && request.has_param("uploadId")) {
      std::lock_guard lock(mutex_);
      complete_document_ = request.body;
      for (const auto& [number, body] : parts_) {
        const std::string entry = fmt::format(
            "<Part><PartNumber>{}</PartNumber><ETag>\"etag-{}\"</ETag></Part>", number, number);
        if (request.body.find(entry) == std::string::npos) {
          return ReplyError(response, 400, "InvalidPart");
        }
        object_ += body;
      }
      response.set_content("<CompleteMultipartUploadResult/>", "application/xml");
      return;
    }
    if (request.method == "DELETE" && request.has_param("uploadId")) {
      aborted_ = true;
      response.status = 204;
      return;
    }
    if (request.method == "PUT") {
      std::lock_guard lock(mutex_);
      object_ = request.body;
      return;
    }
    ReplyError(response, 400, "Unexpected");
  }

  std::string object() const {
    std::lock_guard lock(mutex_);
    return object_;
  }
  size_t stored_parts() const {
    std::lock_guard lock(mutex_);
    return parts_.size();
  }
  bool completed() const {
    std::lock_guard lock(mutex_);
    return !complete_document_.empty();
  }
  bool aborted() const { return aborted_.load(); }

 private:
  mutable std::mutex mutex_;
  std::map<int, std::string> parts_;
  std::string complete_document_;
  std::string object_;
  std::atomic<bool> aborted_{false};
};

TEST(S3ClientTransferTest, UploadSendsPartsConcurrentlyWithinTheBound) {
  FakeMultipartStore store;
  store.expected_parts_in_flight = 3;
  FakeS3 server([&](const httplib::Request& request, httplib::Response& response) {
    store.Handle(request, response);
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  const S3TransferOptions transfer{.part_size = 5 * kMiB, .max_parts_in_flight = 3};
  const std::vector<std::byte> object = RandomBytes(6 * transfer.part_size - 1000, 4);
  ASSERT_OK(client->Upload("big", object, transfer));
  EXPECT_TRUE(store.object() == AsString(object)) << "reassembled object differs";
  EXPECT_EQ(store.stored_parts(), 6u);
  EXPECT_EQ(store.gauge.peak(), 3);
  EXPECT_FALSE(store.aborted());

  // Up to part_size: one PUT, no multipart upload.
  const size_t requests = server.count();
  const std::vector<std::byte> small = RandomBytes(transfer.part_size, 5);
  ASSERT_OK(client->Upload("small", small, transfer));
  EXPECT_EQ(server.count(), requests + 1);
  EXPECT_TRUE(store.object() == AsString(small));
}

TEST(S3ClientTransferTest, FailedUploadIsAborted) {
  FakeMultipartStore store;
  store.fail_part = 2;
  FakeS3 server([&](const httplib::Request& request, httplib::Response& response) {
    store.Handle(request, response);
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  const S3TransferOptions transfer{.part_size = 5 * kMiB, .max_parts_in_flight = 2};
  EXPECT_STATUS_MSG(PermissionDenied, "UploadPart 2",
                    client->Upload("big", RandomBytes(3 * transfer.part_size, 6), transfer));
  EXPECT_TRUE(store.aborted());
  EXPECT_FALSE(store.completed());
}

TEST(S3ClientTransferTest, DownloadReadsRangesConcurrentlyWithinTheBound) {
  const std::vector<std::byte> object = RandomBytes(4 * 5 * kMiB + 123, 8);
  const std::string object_text = AsString(object);
  ConcurrencyGauge gauge;
  FakeS3 server([&](const httplib::Request& request, httplib::Response& response) {
    gauge.EnterAndAwaitPeak(2);
    gauge.Leave();
    // httplib serves the Range header itself (206 and Content-Range).
    response.set_content(object_text, "application/octet-stream");
  });
  std::unique_ptr<S3Client> client = MakeClient(FastOptions(server.endpoint()));
  ASSERT_NE(client, nullptr);
  const S3TransferOptions transfer{.part_size = 5 * kMiB, .max_parts_in_flight = 2};
  ASSERT_OK_AND_ASSIGN(std::vector<std::byte> read, client->Download("k", object.size(), transfer));
  EXPECT_TRUE(read == object) << "downloaded bytes differ";
  EXPECT_EQ(server.count(), 5u);
  EXPECT_EQ(gauge.peak(), 2);
  // The object's size per Content-Range is not the one asked for.
  EXPECT_STATUS_MSG(DataLoss, "expected", client->Download("k", object.size() - 1, transfer));
  // Small enough for one GET.
  const S3TransferOptions one_get{.part_size = 100 * kMiB, .max_parts_in_flight = 2};
  ASSERT_OK_AND_ASSIGN(read, client->Download("k", object.size(), one_get));
  EXPECT_TRUE(read == object);
  EXPECT_STATUS_MSG(DataLoss, "expected", client->Download("k", object.size() + 1, one_get));
}

}  // namespace
}  // namespace refit
