// S3Client on libcurl: SigV4 signing per attempt, retries with jittered backoff, reply checks
// (lengths, ranges, error documents) and the operations. Where a request goes and what a failure
// means are in s3_request.h; the XML the replies carry is read by s3_xml.h.
#include "transport/s3/s3_client.h"

#include <curl/curl.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "refit/status_format.h"
#include "transport/s3/s3_request.h"
#include "transport/s3/s3_xml.h"
#include "transport/transport_internal.h"
#include "util/environment.h"
#include "util/logging.h"
#include "util/mutex.h"
#include "util/thread_pool.h"

namespace refit {
namespace {

using internal::Printable;
using internal::S3QueryParams;

constexpr std::string_view kService = "s3";
// AWS's default region: CreateBucket there must not name a location constraint.
constexpr std::string_view kAwsDefaultRegion = "us-east-1";
constexpr std::string_view kOctetStream = "application/octet-stream";
constexpr std::string_view kXmlContentType = "application/xml";
// The largest page S3 returns from ListObjectsV2 and ListMultipartUploads.
constexpr uint32_t kMaxListPageSize = 1000;
// The contract of S3ClientOptions::stall_timeout: slower than 1 KiB/s counts as stalled.
constexpr long kStallBytesPerSecond = 1024;
// Largest XML reply accepted (listings, upload ids): a page of 1000 keys of 1024 bytes, each
// byte escaped as a 6-character entity, with its Size/ETag/etc. elements, stays below this.
constexpr uint64_t kMaxXmlReplyBytes = uint64_t{16} << 20;
// Bytes of an error reply kept for its message: S3's error documents are a few hundred bytes;
// anything longer is a proxy's page whose beginning says enough.
constexpr size_t kMaxErrorBodyBytes = size_t{64} << 10;
// Bytes reserved for a reply body on the strength of its Content-Length; larger bodies grow the
// buffer as they arrive (a few reallocations, negligible next to the transfer).
constexpr uint64_t kMaxBodyReserve = uint64_t{256} << 20;
// Characters of a non-XML error body quoted in a message.
constexpr size_t kMaxQuotedBodyChars = 200;
// Idle easy handles kept for reuse (each holds its connection cache). More than the parts in
// flight of a few concurrent Upload/Download calls; beyond it handles are freed.
constexpr size_t kMaxIdleHandles = 64;
constexpr long kHttpFirstSuccess = 200;
constexpr long kHttpFirstRedirect = 300;
constexpr long kHttpPartialContent = 206;

bool IsSuccess(long http_status) {
  return http_status >= kHttpFirstSuccess && http_status < kHttpFirstRedirect;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

Result<uint64_t> ParseDecimal(std::string_view text, std::string_view what) {
  uint64_t value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size()) {
    return DataLoss("{} '{}' is not a decimal number", what, Printable(text));
  }
  return value;
}

// An ETag as S3 sends it ("\"abc\"") without its quotes.
std::string Unquote(std::string_view etag) {
  if (etag.size() >= 2 && etag.front() == '"' && etag.back() == '"') {
    etag = etag.substr(1, etag.size() - 2);
  }
  return std::string(etag);
}

std::string AmzDateNow() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  // "YYYYMMDDTHHMMSSZ", as X-Amz-Date takes it.
  constexpr size_t kAmzDateChars = 16;
  char text[kAmzDateChars + 1];
  std::strftime(text, sizeof text, "%Y%m%dT%H%M%SZ", &utc);
  return text;
}

Status EnsureCurlInitialized() {
  static std::once_flag once;
  static CURLcode result = CURLE_OK;
  std::call_once(once, [] { result = curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (result != CURLE_OK) {
    return Internal("libcurl: curl_global_init failed: {}", curl_easy_strerror(result));
  }
  return Status::OK();
}

struct CurlEasyDeleter {
  void operator()(CURL* handle) const { curl_easy_cleanup(handle); }
};
using CurlEasy = std::unique_ptr<CURL, CurlEasyDeleter>;

struct CurlSlistDeleter {
  void operator()(curl_slist* list) const { curl_slist_free_all(list); }
};
using CurlSlist = std::unique_ptr<curl_slist, CurlSlistDeleter>;

// Easy handles kept between requests, so that their connections are reused.
//
// Thread-safety: Acquire and Release may be called concurrently.
class CurlHandlePool {
 public:
  Result<CurlEasy> Acquire() {
    {
      internal::MutexLock lock(mutex_);
      if (!idle_.empty()) {
        CurlEasy handle = std::move(idle_.back());
        idle_.pop_back();
        return handle;
      }
    }
    CurlEasy handle(curl_easy_init());
    if (handle == nullptr) return ResourceExhausted("libcurl: curl_easy_init failed");
    return handle;
  }

  void Release(CurlEasy handle) {
    internal::MutexLock lock(mutex_);
    if (idle_.size() < kMaxIdleHandles) idle_.push_back(std::move(handle));
  }

 private:
  internal::Mutex mutex_;
  std::vector<CurlEasy> idle_;
};

struct S3Reply {
  long http_status = 0;
  // Lower-case names, values trimmed.
  std::vector<std::pair<std::string, std::string>> headers;
  std::vector<std::byte> body;
  uint64_t body_bytes = 0;
  std::string error_body;
  // The <Code> of an error reply, empty when there was none.
  std::string s3_error_code;

  const std::string* Header(std::string_view name) const {
    for (const auto& [header, value] : headers) {
      if (header == name) return &value;
    }
    return nullptr;
  }

  std::string_view BodyText() const {
    return {reinterpret_cast<const char*>(body.data()), body.size()};
  }
};

// One request to make, with what its reply must look like.
struct S3Call {
  // The S3 operation, for messages ("UploadPart 3").
  std::string operation{};
  std::string_view method{};
  // Empty: the bucket itself.
  std::string_view key{};
  S3QueryParams query{};
  std::span<const std::byte> body{};
  std::string_view content_type{};
  // "bytes=first-last", or empty.
  std::string range{};
  // A successful reply's body goes here, when set, and must fill it exactly.
  std::optional<std::span<std::byte>> into{};
  // Else it is collected in S3Reply::body, up to this many bytes.
  uint64_t body_limit = kMaxXmlReplyBytes;
  // Names body_limit in messages.
  std::string_view body_limit_name = "the XML reply limit";
  // Checks a successful reply's headers before its body is read; an error ends the call.
  std::function<Status(const S3Reply&, std::optional<uint64_t> content_length)> check_headers{};
  // CompleteMultipartUpload: a 200 reply may carry an <Error> document.
  bool error_may_follow_ok = false;
};

// The code, message and request id of an S3 error reply.
struct S3ErrorDetails {
  std::string code;
  std::string message;
  std::string request_id;
  // Whether the body was an <Error> document.
  bool parsed = false;
};

S3ErrorDetails ParseErrorDocument(std::string_view body) {
  S3ErrorDetails details;
  Result<internal::XmlElement> document = internal::ParseXml(body);
  if (!document.ok() || document->name != "Error") return details;
  details.parsed = true;
  if (const std::string* code = document->ChildText("Code")) details.code = *code;
  if (const std::string* message = document->ChildText("Message")) details.message = *message;
  if (const std::string* id = document->ChildText("RequestId")) details.request_id = *id;
  return details;
}

// "HTTP 403 SignatureDoesNotMatch: <message> (request id <id>)".
std::string DescribeErrorReply(long http_status, const S3ErrorDetails& details,
                               std::string_view body, const S3Reply& reply) {
  std::string text = fmt::format("HTTP {}", http_status);
  if (details.parsed) {
    text += fmt::format(" {}: {}", details.code.empty() ? "(no code)" : Printable(details.code),
                        details.message.empty() ? "(no message)" : Printable(details.message));
  } else if (body.empty()) {
    text += " (no error body)";
  } else {
    text += fmt::format(": {}", Printable(body.substr(0, kMaxQuotedBodyChars)));
  }
  std::string request_id = details.request_id;
  if (const std::string* header = reply.Header("x-amz-request-id");
      request_id.empty() && header != nullptr) {
    request_id = *header;
  }
  if (!request_id.empty()) text += fmt::format(" (request id {})", Printable(request_id));
  return text;
}

// The state of one attempt, shared with libcurl's callbacks.
struct Transfer {
  const S3Call* call = nullptr;
  CURL* handle = nullptr;
  S3Reply* reply = nullptr;
  bool body_started = false;
  std::optional<uint64_t> content_length{};
  // Why a callback stopped the transfer.
  Status abort_status{};

  bool IsHead() const { return call->method == "HEAD"; }

  // A successful reply's headers are complete: check them before the body.
  Status BeginBody() {
    body_started = true;
    if (const std::string* length = reply->Header("content-length")) {
      REFIT_ASSIGN_OR_RETURN(content_length, ParseDecimal(*length, "Content-Length"));
    }
    if (call->check_headers) REFIT_RETURN_NOT_OK(call->check_headers(*reply, content_length));
    if (IsHead() || !content_length.has_value()) return Status::OK();
    if (call->into.has_value()) {
      if (*content_length != call->into->size()) {
        return DataLoss("reply announces {} bytes (Content-Length), expected {}", *content_length,
                        call->into->size());
      }
    } else if (*content_length > call->body_limit) {
      return ResourceExhausted("reply is {} bytes (Content-Length), more than {} ({} bytes)",
                               *content_length, call->body_limit_name, call->body_limit);
    } else {
      // The length is the server's word: reserve at most kMaxBodyReserve up front, so that a
      // bogus announcement cannot make us allocate what never arrives.
      reply->body.reserve(std::min(*content_length, kMaxBodyReserve));
    }
    return Status::OK();
  }

  Status AppendBody(const char* data, size_t size) {
    const auto* bytes = reinterpret_cast<const std::byte*>(data);
    if (call->into.has_value()) {
      if (size > call->into->size() - reply->body_bytes) {
        return DataLoss("reply body is longer than the {} bytes expected", call->into->size());
      }
      std::memcpy(call->into->data() + reply->body_bytes, bytes, size);
    } else {
      if (size > call->body_limit - reply->body_bytes) {
        return ResourceExhausted("reply body is longer than {} ({} bytes)", call->body_limit_name,
                                 call->body_limit);
      }
      reply->body.insert(reply->body.end(), bytes, bytes + size);
    }
    reply->body_bytes += size;
    return Status::OK();
  }

  // The transfer ended without error: the body must be as long as announced.
  Status FinishBody() const {
    if (IsHead()) return Status::OK();
    if (content_length.has_value() && reply->body_bytes != *content_length) {
      return DataLoss("reply body has {} bytes, Content-Length announced {}", reply->body_bytes,
                      *content_length);
    }
    if (call->into.has_value() && reply->body_bytes != call->into->size()) {
      return DataLoss("reply body has {} bytes, expected {}", reply->body_bytes,
                      call->into->size());
    }
    return Status::OK();
  }
};

size_t OnHeaderLine(char* data, size_t size, size_t count, void* user) {
  auto& transfer = *static_cast<Transfer*>(user);
  const size_t bytes = size * count;
  std::string_view line(data, bytes);
  // A new status line starts a new reply (after a 1xx): forget the previous one's headers.
  if (line.starts_with("HTTP/")) {
    transfer.reply->headers.clear();
    return bytes;
  }
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) return bytes;
  std::string name(line.substr(0, colon));
  std::transform(name.begin(), name.end(), name.begin(),
                 [](char ch) { return (ch >= 'A' && ch <= 'Z') ? ch - 'A' + 'a' : ch; });
  std::string_view value = line.substr(colon + 1);
  const size_t first = value.find_first_not_of(" \t");
  const size_t last = value.find_last_not_of(" \t\r\n");
  value =
      first == std::string_view::npos ? std::string_view() : value.substr(first, last - first + 1);
  transfer.reply->headers.emplace_back(std::move(name), std::string(value));
  return bytes;
}

size_t OnBodyData(char* data, size_t size, size_t count, void* user) {
  auto& transfer = *static_cast<Transfer*>(user);
  const size_t bytes = size * count;
  long http_status = 0;
  curl_easy_getinfo(transfer.handle, CURLINFO_RESPONSE_CODE, &http_status);
  if (!IsSuccess(http_status)) {
    std::string& error_body = transfer.reply->error_body;
    error_body.append(data, std::min(bytes, kMaxErrorBodyBytes - error_body.size()));
    return bytes;
  }
  if (!transfer.body_started) {
    transfer.reply->http_status = http_status;
    transfer.abort_status = transfer.BeginBody();
    if (!transfer.abort_status.ok()) return 0;
  }
  transfer.abort_status = transfer.AppendBody(data, bytes);
  // Returning fewer bytes than offered makes libcurl stop with CURLE_WRITE_ERROR.
  return transfer.abort_status.ok() ? bytes : 0;
}

// The outcome of one attempt: OK, or an error and whether another attempt may succeed.
struct AttemptOutcome {
  Status status;
  bool retryable = false;
};

AttemptOutcome CurlFailure(CURLcode code, const char* detail, std::string_view url,
                           std::string_view context) {
  // libcurl's detail names the address and how long it tried, e.g. "Failed to connect to
  // 127.0.0.1 port 7480 after 0 ms: Connection refused".
  const std::string message =
      *detail == '\0'
          ? fmt::format("{}: {} at {}", context, curl_easy_strerror(code), url)
          : fmt::format("{}: {} at {} ({})", context, curl_easy_strerror(code), url, detail);
  switch (code) {
    case CURLE_OPERATION_TIMEDOUT:
      return {Status(StatusCode::kDeadlineExceeded, message), true};
    case CURLE_PARTIAL_FILE:
      // The connection dropped before the announced body arrived.
      return {Status(StatusCode::kDataLoss, message), true};
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return {Status(StatusCode::kUnavailable, message), true};
    default:
      return {Status(StatusCode::kUnavailable, message), false};
  }
}

// Collects the first failing curl_easy_setopt, so that an option libcurl refuses is reported
// instead of silently changing how the request is made.
class CurlOptions {
 public:
  explicit CurlOptions(CURL* handle) : handle_(handle) {}

  template <typename T>
  void Set(CURLoption option, T value) {
    const CURLcode code = curl_easy_setopt(handle_, option, value);
    if (code != CURLE_OK && first_error_ == CURLE_OK) first_error_ = code;
  }

  Status status() const {
    if (first_error_ == CURLE_OK) return Status::OK();
    return Internal("libcurl refused an option: {}", curl_easy_strerror(first_error_));
  }

 private:
  CURL* handle_;
  CURLcode first_error_ = CURLE_OK;
};

}  // namespace

Result<SigV4Credentials> S3CredentialsFromEnvironment() {
  // NotFound rather than SecretFromEnvironment's InvalidArgument: no credentials in the
  // environment is a missing source, not a bad setting.
  const auto required = [](const char* name, std::string_view what) -> Result<std::string> {
    Result<std::string> value = SecretFromEnvironment(name, what);
    if (!value.ok()) return Status(StatusCode::kNotFound, value.status().message());
    return value;
  };
  SigV4Credentials credentials;
  REFIT_ASSIGN_OR_RETURN(credentials.access_key_id,
                         required("AWS_ACCESS_KEY_ID", "the S3 access key id"));
  REFIT_ASSIGN_OR_RETURN(credentials.secret_access_key,
                         required("AWS_SECRET_ACCESS_KEY", "the S3 secret access key"));
  // Only temporary credentials have a session token.
  if (Result<std::string> token =
          SecretFromEnvironment("AWS_SESSION_TOKEN", "the S3 session token");
      token.ok()) {
    credentials.session_token = std::move(*token);
  }
  return credentials;
}

struct S3Client::Impl {
  S3ClientOptions options;
  internal::S3Endpoint endpoint;
  CurlHandlePool handles;

  std::string Context(const S3Call& call) const {
    if (call.key.empty()) {
      return fmt::format("S3 {} {} ({})", call.method, options.bucket, call.operation);
    }
    return fmt::format("S3 {} {}/{} ({})", call.method, options.bucket, Printable(call.key),
                       call.operation);
  }

  // Make `call`, retrying what is retryable; `reply` holds the last attempt's reply.
  Status Execute(const S3Call& call, S3Reply& reply) {
    const std::string context = Context(call);
    const std::string payload_hash = Sha256Hex(call.body);
    const internal::S3RequestTarget target = internal::BuildS3RequestTarget(
        endpoint, options.addressing, options.bucket, call.key, call.query);
    REFIT_ASSIGN_OR_RETURN(CurlEasy handle, handles.Acquire());
    // Hand the handle (and its live connection) back whichever way this returns.
    struct Lease {
      CurlHandlePool& pool;
      CurlEasy& handle;
      ~Lease() { pool.Release(std::move(handle)); }
    } lease{handles, handle};

    thread_local std::mt19937_64 jitter(std::random_device{}());
    for (int attempt = 0;; ++attempt) {
      reply = S3Reply{};
      AttemptOutcome outcome = Attempt(handle.get(), call, target, payload_hash, context, reply);
      if (outcome.status.ok() || !outcome.retryable) return outcome.status;
      if (attempt >= options.max_retries) {
        return Status(outcome.status.code(),
                      fmt::format("{}; gave up after {} attempt{}", outcome.status.message(),
                                  attempt + 1, attempt == 0 ? "" : "s"));
      }
      const std::chrono::milliseconds ceiling =
          internal::BackoffCeiling(options.retry_backoff, options.max_retry_backoff, attempt);
      const auto delay = std::chrono::milliseconds(
          std::uniform_int_distribution<int64_t>(0, ceiling.count())(jitter));
      REFIT_LOG_DEBUG("{}; retry {} of {} in {} ms", outcome.status.message(), attempt + 1,
                      options.max_retries, delay.count());
      std::this_thread::sleep_for(delay);
    }
  }

  // The request's headers, signed: Host, x-amz-*, Content-Type and Range as `call` needs them,
  // then Authorization and the headers libcurl must not add by itself.
  Result<CurlSlist> SignedHeaderList(const S3Call& call, const internal::S3RequestTarget& target,
                                     const std::string& payload_hash) const {
    const std::string amz_date = AmzDateNow();
    SigV4Request request;
    request.method = std::string(call.method);
    request.path = target.path;
    request.query = call.query;
    request.payload_sha256_hex = payload_hash;
    request.headers = {
        {"Host", target.host}, {"x-amz-content-sha256", payload_hash}, {"x-amz-date", amz_date}};
    if (!options.credentials.session_token.empty()) {
      request.headers.emplace_back("x-amz-security-token", options.credentials.session_token);
    }
    if (!call.content_type.empty()) {
      request.headers.emplace_back("Content-Type", std::string(call.content_type));
    }
    if (!call.range.empty()) request.headers.emplace_back("Range", call.range);
    REFIT_ASSIGN_OR_RETURN(SigV4Signature signature,
                           SignV4(request, options.credentials, options.region, kService, amz_date,
                                  /*double_encode_path=*/false));

    std::vector<std::string> lines;
    for (const auto& [name, value] : request.headers) lines.push_back(name + ": " + value);
    lines.push_back("Authorization: " + signature.authorization);
    // Without this libcurl waits for "100 Continue" before a body over 1 MiB: a round trip
    // per PUT that S3 does not need.
    lines.emplace_back("Expect:");
    // libcurl labels a body it sends from memory as a form unless told otherwise; an empty
    // value removes the header.
    if (call.content_type.empty() && !call.body.empty()) lines.emplace_back("Content-Type:");
    CurlSlist list;
    for (const std::string& line : lines) {
      curl_slist* extended = curl_slist_append(list.get(), line.c_str());
      if (extended == nullptr) return ResourceExhausted("libcurl could not allocate a header");
      // curl_slist_append returns the head of the list, which now owns the old one.
      static_cast<void>(list.release());
      list.reset(extended);
    }
    return list;
  }

  // Set every option of one attempt on `handle` (reset first: handles are reused).
  Status Configure(CURL* handle, const S3Call& call, const internal::S3RequestTarget& target,
                   curl_slist* headers, Transfer& transfer, char* error_detail) const {
    curl_easy_reset(handle);
    CurlOptions set(handle);
    set.Set(CURLOPT_URL, target.url.c_str());
    set.Set(CURLOPT_HTTPHEADER, headers);
    // The path is signed as sent: libcurl must not squash "/./" or "/../" inside keys.
    set.Set(CURLOPT_PATH_AS_IS, 1L);
    set.Set(CURLOPT_NOSIGNAL, 1L);
    set.Set(CURLOPT_TCP_KEEPALIVE, 1L);
    set.Set(CURLOPT_ERRORBUFFER, error_detail);
    set.Set(CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options.connect_timeout.count()));
    // libcurl counts the low-speed window in whole seconds; round up so it is never shorter.
    constexpr uint64_t kMillisPerSecond = 1000;
    set.Set(CURLOPT_LOW_SPEED_LIMIT, kStallBytesPerSecond);
    set.Set(CURLOPT_LOW_SPEED_TIME,
            static_cast<long>(
                CeilDiv(static_cast<uint64_t>(options.stall_timeout.count()), kMillisPerSecond)));
    set.Set(CURLOPT_HEADERFUNCTION, OnHeaderLine);
    set.Set(CURLOPT_HEADERDATA, &transfer);
    set.Set(CURLOPT_WRITEFUNCTION, OnBodyData);
    set.Set(CURLOPT_WRITEDATA, &transfer);
    if (endpoint.https) {
      if (!options.tls_ca_cert_path.empty()) {
        set.Set(CURLOPT_CAINFO, options.tls_ca_cert_path.c_str());
      }
      set.Set(CURLOPT_SSL_VERIFYPEER, options.tls_verify ? 1L : 0L);
      set.Set(CURLOPT_SSL_VERIFYHOST, options.tls_verify ? 2L : 0L);
    }
    static constexpr char kEmptyBody[] = "";
    if (call.method == "GET") {
      set.Set(CURLOPT_HTTPGET, 1L);
    } else if (call.method == "HEAD") {
      set.Set(CURLOPT_NOBODY, 1L);
    } else if (call.method == "DELETE") {
      set.Set(CURLOPT_CUSTOMREQUEST, "DELETE");
    } else {
      // PUT and POST send the body from memory: libcurl can resend it by itself when a reused
      // connection turns out to be dead, which a read callback would have to support by seeking.
      set.Set(CURLOPT_POST, 1L);
      set.Set(CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(call.body.size()));
      set.Set(CURLOPT_POSTFIELDS,
              call.body.empty() ? kEmptyBody : reinterpret_cast<const char*>(call.body.data()));
      if (call.method == "PUT") set.Set(CURLOPT_CUSTOMREQUEST, "PUT");
    }
    return set.status();
  }

  // One try of `call`: sign it now, send it, and judge the reply.
  AttemptOutcome Attempt(CURL* handle, const S3Call& call, const internal::S3RequestTarget& target,
                         const std::string& payload_hash, const std::string& context,
                         S3Reply& reply) const {
    Result<CurlSlist> headers = SignedHeaderList(call, target, payload_hash);
    if (!headers.ok()) return {headers.status().WithContext(context), false};
    Transfer transfer{.call = &call, .handle = handle, .reply = &reply};
    char error_detail[CURL_ERROR_SIZE] = {};
    Status configured = Configure(handle, call, target, headers->get(), transfer, error_detail);
    if (!configured.ok()) return {configured.WithContext(context), false};

    const CURLcode code = curl_easy_perform(handle);
    curl_easy_getinfo(handle, CURLINFO_RESPONSE_CODE, &reply.http_status);
    if (code != CURLE_OK) {
      if (code == CURLE_WRITE_ERROR && !transfer.abort_status.ok()) {
        return {transfer.abort_status.WithContext(context), false};
      }
      return CurlFailure(code, error_detail, target.url, context);
    }
    if (IsSuccess(reply.http_status)) {
      Status body_status = transfer.body_started ? Status::OK() : transfer.BeginBody();
      if (body_status.ok()) body_status = transfer.FinishBody();
      if (!body_status.ok()) return {body_status.WithContext(context), false};
      if (!call.error_may_follow_ok) return {};
      const S3ErrorDetails details = ParseErrorDocument(reply.BodyText());
      if (!details.parsed) return {};
      reply.s3_error_code = details.code;
      return {Status(internal::S3ErrorStatusCode(reply.http_status, details.code),
                     fmt::format("{}: {} (error document in a successful reply)", context,
                                 DescribeErrorReply(reply.http_status, details, {}, reply))),
              internal::IsRetryableS3Error(reply.http_status, details.code)};
    }
    const S3ErrorDetails details = ParseErrorDocument(reply.error_body);
    reply.s3_error_code = details.code;
    return {Status(internal::S3ErrorStatusCode(reply.http_status, details.code),
                   fmt::format(
                       "{}: {}", context,
                       DescribeErrorReply(reply.http_status, details, reply.error_body, reply))),
            internal::IsRetryableS3Error(reply.http_status, details.code)};
  }

  // Parse a successful reply's XML body, whose root must be `root_name`.
  static Result<internal::XmlElement> ParseReply(const std::string& context, const S3Reply& reply,
                                                 std::string_view root_name) {
    Result<internal::XmlElement> document = internal::ParseXml(reply.BodyText());
    if (!document.ok()) return document.status().WithContext(context);
    if (document->name != root_name) {
      return DataLoss("{}: reply's root element is '{}', expected '{}'", context,
                      Printable(document->name), root_name);
    }
    return document;
  }

  // GET [offset, offset + out.size()) into `out`. With `object_size`, the object must be that
  // large (Content-Range's total).
  Status GetRange(std::string_view key, uint64_t offset, std::span<std::byte> out,
                  std::optional<uint64_t> object_size) {
    const uint64_t last = offset + out.size() - 1;
    S3Call call{.operation = fmt::format("GetObject bytes {}-{}", offset, last),
                .method = "GET",
                .key = key,
                .range = fmt::format("bytes={}-{}", offset, last),
                .into = out};
    call.check_headers = [&](const S3Reply& reply,
                             std::optional<uint64_t> content_length) -> Status {
      if (reply.http_status != kHttpPartialContent) {
        // A server that ignores Range sends the whole object: that is the range only when the
        // range is the whole object.
        if (offset == 0 && content_length == out.size() &&
            (!object_size.has_value() || *object_size == out.size())) {
          return Status::OK();
        }
        return DataLoss("server answered a ranged GET with HTTP {} and {} bytes", reply.http_status,
                        content_length.has_value() ? std::to_string(*content_length) : "unknown");
      }
      const std::string* content_range = reply.Header("content-range");
      if (content_range == nullptr) return DataLoss("206 reply without Content-Range");
      // "bytes first-last/total", total may be "*".
      constexpr std::string_view kUnit = "bytes ";
      const std::string_view text = *content_range;
      const size_t dash = text.find('-');
      const size_t slash = text.find('/');
      if (!text.starts_with(kUnit) || dash == std::string_view::npos ||
          slash == std::string_view::npos || slash < dash) {
        return DataLoss("malformed Content-Range '{}'", Printable(text));
      }
      REFIT_ASSIGN_OR_RETURN(
          uint64_t first,
          ParseDecimal(text.substr(kUnit.size(), dash - kUnit.size()), "Content-Range start"));
      REFIT_ASSIGN_OR_RETURN(
          uint64_t end, ParseDecimal(text.substr(dash + 1, slash - dash - 1), "Content-Range end"));
      if (first != offset || end != last) {
        return DataLoss("reply is for bytes {}-{}, asked for {}-{}", first, end, offset, last);
      }
      const std::string_view total = text.substr(slash + 1);
      if (object_size.has_value() && total != "*") {
        REFIT_ASSIGN_OR_RETURN(uint64_t size, ParseDecimal(total, "Content-Range total"));
        if (size != *object_size) {
          return DataLoss("object is {} bytes, expected {}", size, *object_size);
        }
      }
      return Status::OK();
    };
    S3Reply reply;
    return Execute(call, reply);
  }
};

S3Client::S3Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
S3Client::~S3Client() = default;

const S3ClientOptions& S3Client::options() const { return impl_->options; }

Result<std::unique_ptr<S3Client>> S3Client::Make(const S3ClientOptions& options) {
  const auto bad = [](std::string_view option, std::string_view why) {
    return InvalidArgument("S3 client option {}: {}", option, why);
  };
  if (options.region.empty()) return bad("region", "is empty");
  const bool region_chars = std::all_of(options.region.begin(), options.region.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '-' || ch == '_' || ch == '.';
  });
  if (!region_chars) {
    return bad("region", fmt::format("'{}' has characters outside [A-Za-z0-9._-]",
                                     Printable(options.region)));
  }
  REFIT_ASSIGN_OR_RETURN(internal::S3Endpoint endpoint,
                         internal::ParseS3Endpoint(options.endpoint, options.region));
  REFIT_RETURN_NOT_OK(internal::ValidateS3BucketName(options.bucket));
  if (options.addressing == S3Addressing::kVirtualHost) {
    if (endpoint.host_is_ip) {
      return bad("addressing", fmt::format("virtual-host addressing needs a DNS name, and "
                                           "endpoint '{}' is an IP address; use kPath",
                                           Printable(options.endpoint)));
    }
    if (endpoint.https && options.bucket.find('.') != std::string::npos) {
      return bad("addressing",
                 fmt::format("bucket '{}' has dots, which no wildcard TLS certificate covers "
                             "as a virtual host; use kPath",
                             options.bucket));
    }
  }
  if (options.credentials.access_key_id.empty()) {
    return bad("credentials", "access key id is empty");
  }
  if (options.credentials.secret_access_key.empty()) {
    return bad("credentials", "secret access key is empty");
  }
  if (options.max_retries < 0) {
    return bad("max_retries", fmt::format("{} is negative", options.max_retries));
  }
  if (options.connect_timeout.count() <= 0) {
    return bad("connect_timeout",
               fmt::format("{} ms is not positive", options.connect_timeout.count()));
  }
  if (options.stall_timeout.count() <= 0) {
    return bad("stall_timeout",
               fmt::format("{} ms is not positive", options.stall_timeout.count()));
  }
  if (options.retry_backoff.count() < 0 || options.max_retry_backoff.count() < 0) {
    return bad("retry_backoff",
               fmt::format("{} ms / max {} ms: negative", options.retry_backoff.count(),
                           options.max_retry_backoff.count()));
  }
  if (options.list_page_size < 1 || options.list_page_size > kMaxListPageSize) {
    return bad("list_page_size",
               fmt::format("{} is outside [1, {}]", options.list_page_size, kMaxListPageSize));
  }
  if (!options.tls_ca_cert_path.empty() && !std::ifstream(options.tls_ca_cert_path).good()) {
    return bad("tls_ca_cert_path",
               fmt::format("cannot read '{}'", Printable(options.tls_ca_cert_path)));
  }
  // Sign a dummy request: the signer's own rules then vet the credentials' characters (a key id
  // with '/' or a session token with a line break) now rather than at the first request.
  SigV4Request probe;
  probe.method = "GET";
  probe.path = "/";
  probe.headers = {{"host", endpoint.authority}};
  if (!options.credentials.session_token.empty()) {
    probe.headers.emplace_back("x-amz-security-token", options.credentials.session_token);
  }
  probe.payload_sha256_hex = Sha256Hex({});
  REFIT_RETURN_NOT_OK(SignV4(probe, options.credentials, options.region, kService, AmzDateNow(),
                             /*double_encode_path=*/false)
                          .status()
                          .WithContext("S3 client option credentials"));
  REFIT_RETURN_NOT_OK(EnsureCurlInitialized());
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->endpoint = std::move(endpoint);
  return std::unique_ptr<S3Client>(new S3Client(std::move(impl)));
}

Status S3Client::CreateBucket() {
  std::string configuration;
  if (impl_->options.region != kAwsDefaultRegion) {
    configuration = fmt::format(
        "<CreateBucketConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
        "<LocationConstraint>{}</LocationConstraint></CreateBucketConfiguration>",
        internal::XmlEscape(impl_->options.region));
  }
  S3Call call{.operation = "CreateBucket",
              .method = "PUT",
              .body = std::as_bytes(std::span(configuration)),
              .content_type = configuration.empty() ? std::string_view() : kXmlContentType};
  S3Reply reply;
  Status status = impl_->Execute(call, reply);
  if (!status.ok() && reply.s3_error_code == "BucketAlreadyOwnedByYou") return Status::OK();
  return status;
}

Status S3Client::PutObject(std::string_view key, std::span<const std::byte> bytes) {
  REFIT_RETURN_NOT_OK(internal::ValidateS3Key(key));
  if (bytes.size() > S3TransferOptions::kMaxPartSize) {
    return InvalidArgument("S3 PUT {}/{}: {} bytes exceed S3's single-PUT limit of {}; use Upload",
                           impl_->options.bucket, Printable(key), bytes.size(),
                           S3TransferOptions::kMaxPartSize);
  }
  S3Call call{.operation = "PutObject",
              .method = "PUT",
              .key = key,
              .body = bytes,
              .content_type = kOctetStream};
  S3Reply reply;
  return impl_->Execute(call, reply);
}

namespace {

Status ValidateTransferOptions(const S3TransferOptions& options, std::string_view what,
                               std::string_view bucket, std::string_view key) {
  if (options.part_size < S3TransferOptions::kMinPartSize ||
      options.part_size > S3TransferOptions::kMaxPartSize) {
    return InvalidArgument("S3 {} {}/{}: part_size {} is outside [{}, {}]", what, bucket,
                           Printable(key), options.part_size, S3TransferOptions::kMinPartSize,
                           S3TransferOptions::kMaxPartSize);
  }
  if (options.max_parts_in_flight < 1) {
    return InvalidArgument("S3 {} {}/{}: max_parts_in_flight is 0", what, bucket, Printable(key));
  }
  return Status::OK();
}

Status CheckUploadId(std::string_view bucket, std::string_view key, std::string_view upload_id) {
  if (upload_id.empty()) {
    return InvalidArgument("S3 multipart upload of {}/{}: upload id is empty", bucket,
                           Printable(key));
  }
  return Status::OK();
}

// Call `transfer_part(i)` for every i in [0, parts), at most `max_in_flight` at once; after the
// first error no further part starts, and that error is returned.
Status ForEachPart(uint64_t parts, size_t max_in_flight,
                   const std::function<Status(uint64_t)>& transfer_part) {
  std::atomic<uint64_t> next{0};
  const auto drain = [&](const std::stop_token& stop) -> Status {
    for (uint64_t part = next++; part < parts && !stop.stop_requested(); part = next++) {
      REFIT_RETURN_NOT_OK(transfer_part(part));
    }
    return Status::OK();
  };
  const uint64_t threads = std::min<uint64_t>(
      {parts, max_in_flight, static_cast<uint64_t>(internal::ThreadPool::kMaxThreads)});
  if (threads <= 1) return drain({});
  REFIT_ASSIGN_OR_RETURN(
      std::unique_ptr<internal::ThreadPool> pool,
      internal::ThreadPool::Make({.threads = static_cast<int>(threads), .name = "refit-s3-part"}));
  internal::TaskGroup group(pool.get());
  for (uint64_t i = 0; i < threads; ++i) group.Submit(drain);
  return group.Wait();
}

}  // namespace

Status S3Client::Upload(std::string_view key, std::span<const std::byte> bytes,
                        const S3TransferOptions& options) {
  REFIT_RETURN_NOT_OK(ValidateTransferOptions(options, "Upload", impl_->options.bucket, key));
  REFIT_RETURN_NOT_OK(internal::ValidateS3Key(key));
  if (bytes.size() <= options.part_size) return PutObject(key, bytes);
  const uint64_t parts = CeilDiv(bytes.size(), options.part_size);
  if (parts > S3TransferOptions::kMaxParts) {
    return InvalidArgument("S3 Upload {}/{}: {} bytes in parts of {} need {} parts, more than {}",
                           impl_->options.bucket, Printable(key), bytes.size(), options.part_size,
                           parts, S3TransferOptions::kMaxParts);
  }
  REFIT_ASSIGN_OR_RETURN(std::string upload_id, CreateMultipartUpload(key));
  std::vector<std::string> etags(parts);
  Status status = ForEachPart(parts, options.max_parts_in_flight, [&](uint64_t part) -> Status {
    const uint64_t offset = part * options.part_size;
    const uint64_t length = std::min<uint64_t>(options.part_size, bytes.size() - offset);
    REFIT_ASSIGN_OR_RETURN(etags[part], UploadPart(key, upload_id, static_cast<uint32_t>(part + 1),
                                                   bytes.subspan(offset, length)));
    return Status::OK();
  });
  if (status.ok()) status = CompleteMultipartUpload(key, upload_id, etags);
  if (status.ok()) return status;
  // Stored parts are billed until aborted; leave none behind. NotFound means the upload is gone
  // already (a Complete that succeeded although its reply was lost).
  const Status aborted = AbortMultipartUpload(key, upload_id);
  if (aborted.ok() || aborted.code() == StatusCode::kNotFound) return status;
  return Status(status.code(),
                fmt::format("{}; aborting upload {} failed too: {}", status.message(),
                            Printable(upload_id), aborted.message()));
}

Result<std::string> S3Client::CreateMultipartUpload(std::string_view key) {
  REFIT_RETURN_NOT_OK(internal::ValidateS3Key(key));
  S3Call call{.operation = "CreateMultipartUpload",
              .method = "POST",
              .key = key,
              .query = {{"uploads", ""}},
              .content_type = kOctetStream};
  S3Reply reply;
  REFIT_RETURN_NOT_OK(impl_->Execute(call, reply));
  const std::string context = impl_->Context(call);
  REFIT_ASSIGN_OR_RETURN(internal::XmlElement document,
                         Impl::ParseReply(context, reply, "InitiateMultipartUploadResult"));
  const std::string* upload_id = document.ChildText("UploadId");
  if (upload_id == nullptr || upload_id->empty()) {
    return DataLoss("{}: reply has no UploadId", context);
  }
  return *upload_id;
}

Result<std::string> S3Client::UploadPart(std::string_view key, std::string_view upload_id,
                                         uint32_t part_number, std::span<const std::byte> bytes) {
  REFIT_RETURN_NOT_OK(internal::ValidateS3Key(key));
  if (part_number < 1 || part_number > S3TransferOptions::kMaxParts) {
    return InvalidArgument("S3 UploadPart {}/{}: part number {} is outside [1, {}]",
                           impl_->options.bucket, Printable(key), part_number,
                           S3TransferOptions::kMaxParts);
  }
  REFIT_RETURN_NOT_OK(CheckUploadId(impl_->options.bucket, key, upload_id));
  if (bytes.size() > S3TransferOptions::kMaxPartSize) {
    return InvalidArgument("S3 UploadPart {}/{}: part {} has {} bytes, more than S3's {}",
                           impl_->options.bucket, Printable(key), part_number, bytes.size(),
                           S3TransferOptions::kMaxPartSize);
  }
  S3Call call{
      .operation = fmt::format("UploadPart {}", part_number),
      .method = "PUT",
      .key = key,
      .query = {{"partNumber", std::to_string(part_number)}, {"uploadId", std::string(upload_id)}},
      .body = bytes};
  S3Reply reply;
  REFIT_RETURN_NOT_OK(impl_->Execute(call, reply));
  const std::string* etag = reply.Header("etag");
  if (etag == nullptr || Unquote(*etag).empty()) {
    return DataLoss("{}: reply has no ETag", impl_->Context(call));
  }
  return Unquote(*etag);
}

Status S3Client::CompleteMultipartUpload(std::string_view key, std::string_view upload_id,
                                         const std::vector<std::string>& part_etags) {
  REFIT_RETURN_NOT_OK(internal::ValidateS3Key(key));
  REFIT_RETURN_NOT_OK(CheckUploadId(impl_->options.bucket, key, upload_id));
  if (part_etags.empty() || part_etags.size() > S3TransferOptions::kMaxParts) {
    return InvalidArgument("S3 CompleteMultipartUpload {}/{}: {} parts, expected 1 to {}",
                           impl_->options.bucket, Printable(key), part_etags.size(),
                           S3TransferOptions::kMaxParts);
  }
  std::string document = "<CompleteMultipartUpload>";
  for (size_t i = 0; i < part_etags.size(); ++i) {
    document += fmt::format("<Part><PartNumber>{}</PartNumber><ETag>\"{}\"</ETag></Part>", i + 1,
                            internal::XmlEscape(part_etags[i]));
  }
  document += "</CompleteMultipartUpload>";
  S3Call call{.operation = fmt::format("CompleteMultipartUpload of {} parts", part_etags.size()),
              .method = "POST",
              .key = key,
              .query = {{"uploadId", std::string(upload_id)}},
              .body = std::as_bytes(std::span(document)),
              .content_type = kXmlContentType,
              .error_may_follow_ok = true};
  S3Reply reply;
  return impl_->Execute(call, reply);
}

Status S3Client::AbortMultipartUpload(std::string_view key, std::string_view upload_id) {
  REFIT_RETURN_NOT_OK(internal::ValidateS3Key(key));
  // "DELETE key?uploadId=" could be taken for a DeleteObject of the key itself.
  REFIT_RETURN_NOT_OK(CheckUploadId(impl_->options.bucket, key, upload_id));
  S3Call call{.operation = "AbortMultipartUpload",
              .method = "DELETE",
              .key = key,
              .query = {{"uploadId", std::string(upload_id)}}};
  S3Reply reply;
  return impl_->Execute(call, reply);
}

Result<std::vector<S3MultipartUpload>> S3Client::ListMultipartUploads(std::string_view prefix) {
  std::vector<S3MultipartUpload> uploads;
  std::string key_marker;
  std::string upload_id_marker;
  for (;;) {
    S3Call call{
        .operation = "ListMultipartUploads",
        .method = "GET",
        .query = {{"uploads", ""}, {"max-uploads", std::to_string(impl_->options.list_page_size)}}};
    if (!prefix.empty()) call.query.emplace_back("prefix", std::string(prefix));
    if (!key_marker.empty()) call.query.emplace_back("key-marker", key_marker);
    if (!upload_id_marker.empty()) call.query.emplace_back("upload-id-marker", upload_id_marker);
    S3Reply reply;
    REFIT_RETURN_NOT_OK(impl_->Execute(call, reply));
    const std::string context = impl_->Context(call);
    REFIT_ASSIGN_OR_RETURN(internal::XmlElement document,
                           Impl::ParseReply(context, reply, "ListMultipartUploadsResult"));
    for (const internal::XmlElement& child : document.children) {
      if (child.name != "Upload") continue;
      const std::string* key = child.ChildText("Key");
      const std::string* upload_id = child.ChildText("UploadId");
      if (key == nullptr || upload_id == nullptr) {
        return DataLoss("{}: an Upload lacks Key or UploadId", context);
      }
      uploads.push_back({.key = *key, .upload_id = *upload_id});
    }
    const std::string* truncated = document.ChildText("IsTruncated");
    if (truncated == nullptr || *truncated != "true") return uploads;
    const std::string* next_key = document.ChildText("NextKeyMarker");
    const std::string* next_upload = document.ChildText("NextUploadIdMarker");
    if (next_key == nullptr || next_upload == nullptr ||
        (*next_key == key_marker && *next_upload == upload_id_marker)) {
      return DataLoss("{}: truncated listing without new NextKeyMarker/NextUploadIdMarker",
                      context);
    }
    key_marker = *next_key;
    upload_id_marker = *next_upload;
  }
}

Result<std::vector<std::byte>> S3Client::GetObject(std::string_view key, uint64_t max_bytes) {
  REFIT_RETURN_NOT_OK(internal::ValidateS3Key(key));
  S3Call call{.operation = "GetObject",
              .method = "GET",
              .key = key,
              .body_limit = max_bytes,
              .body_limit_name = "max_bytes"};
  S3Reply reply;
  REFIT_RETURN_NOT_OK(impl_->Execute(call, reply));
  return std::move(reply.body);
}

Status S3Client::GetObjectRange(std::string_view key, uint64_t offset, std::span<std::byte> out) {
  REFIT_RETURN_NOT_OK(internal::ValidateS3Key(key));
  if (out.empty()) return Status::OK();
  if (offset > std::numeric_limits<uint64_t>::max() - out.size()) {
    return InvalidArgument("S3 GET {}/{}: range at {} of {} bytes overflows", impl_->options.bucket,
                           Printable(key), offset, out.size());
  }
  return impl_->GetRange(key, offset, out, std::nullopt);
}

Result<std::vector<std::byte>> S3Client::Download(std::string_view key, uint64_t size,
                                                  const S3TransferOptions& options) {
  REFIT_RETURN_NOT_OK(ValidateTransferOptions(options, "Download", impl_->options.bucket, key));
  REFIT_RETURN_NOT_OK(internal::ValidateS3Key(key));
  std::vector<std::byte> object(size);
  if (size <= options.part_size) {
    S3Call call{.operation = "GetObject", .method = "GET", .key = key, .into = object};
    call.check_headers = [size](const S3Reply&, std::optional<uint64_t> content_length) {
      if (content_length.has_value() && *content_length != size) {
        return DataLoss("object is {} bytes, expected {}", *content_length, size);
      }
      return Status::OK();
    };
    S3Reply reply;
    REFIT_RETURN_NOT_OK(impl_->Execute(call, reply));
    return object;
  }
  const uint64_t parts = CeilDiv(size, options.part_size);
  REFIT_RETURN_NOT_OK(ForEachPart(parts, options.max_parts_in_flight, [&](uint64_t part) -> Status {
    const uint64_t offset = part * options.part_size;
    const uint64_t length = std::min<uint64_t>(options.part_size, size - offset);
    Status status = impl_->GetRange(key, offset, std::span(object).subspan(offset, length), size);
    if (status.code() == StatusCode::kFailedPrecondition) {
      // 416: the range starts past the object's end.
      return Status(StatusCode::kDataLoss,
                    fmt::format("{}; the object is smaller than the expected {} bytes",
                                status.message(), size));
    }
    return status;
  }));
  return object;
}

Result<S3ObjectInfo> S3Client::HeadObject(std::string_view key) {
  REFIT_RETURN_NOT_OK(internal::ValidateS3Key(key));
  S3Call call{.operation = "HeadObject", .method = "HEAD", .key = key};
  S3Reply reply;
  REFIT_RETURN_NOT_OK(impl_->Execute(call, reply));
  const std::string* length = reply.Header("content-length");
  if (length == nullptr) return DataLoss("{}: reply has no Content-Length", impl_->Context(call));
  S3ObjectInfo info;
  info.key = std::string(key);
  REFIT_ASSIGN_OR_RETURN(info.size, ParseDecimal(*length, "Content-Length"));
  if (const std::string* etag = reply.Header("etag")) info.etag = Unquote(*etag);
  return info;
}

Status S3Client::DeleteObject(std::string_view key) {
  REFIT_RETURN_NOT_OK(internal::ValidateS3Key(key));
  S3Call call{.operation = "DeleteObject", .method = "DELETE", .key = key};
  S3Reply reply;
  Status status = impl_->Execute(call, reply);
  // S3 answers 204 for a missing key; a server that says NoSuchKey means the same.
  if (!status.ok() && reply.s3_error_code == "NoSuchKey") return Status::OK();
  return status;
}

Result<std::vector<S3ObjectInfo>> S3Client::ListObjects(std::string_view prefix) {
  std::vector<S3ObjectInfo> objects;
  std::string continuation;
  for (;;) {
    S3Call call{
        .operation = "ListObjectsV2",
        .method = "GET",
        .query = {{"list-type", "2"}, {"max-keys", std::to_string(impl_->options.list_page_size)}}};
    if (!prefix.empty()) call.query.emplace_back("prefix", std::string(prefix));
    if (!continuation.empty()) call.query.emplace_back("continuation-token", continuation);
    S3Reply reply;
    REFIT_RETURN_NOT_OK(impl_->Execute(call, reply));
    const std::string context = impl_->Context(call);
    REFIT_ASSIGN_OR_RETURN(internal::XmlElement document,
                           Impl::ParseReply(context, reply, "ListBucketResult"));
    for (const internal::XmlElement& child : document.children) {
      if (child.name != "Contents") continue;
      const std::string* key = child.ChildText("Key");
      const std::string* size = child.ChildText("Size");
      if (key == nullptr || size == nullptr) {
        return DataLoss("{}: a Contents entry lacks Key or Size", context);
      }
      S3ObjectInfo info;
      info.key = *key;
      Result<uint64_t> parsed_size = ParseDecimal(*size, "Size");
      if (!parsed_size.ok()) return parsed_size.status().WithContext(context);
      info.size = *parsed_size;
      if (const std::string* etag = child.ChildText("ETag")) info.etag = Unquote(*etag);
      objects.push_back(std::move(info));
    }
    const std::string* truncated = document.ChildText("IsTruncated");
    if (truncated == nullptr || *truncated != "true") return objects;
    const std::string* next = document.ChildText("NextContinuationToken");
    if (next == nullptr || next->empty() || *next == continuation) {
      return DataLoss("{}: truncated listing without a new NextContinuationToken", context);
    }
    continuation = *next;
  }
}

}  // namespace refit
