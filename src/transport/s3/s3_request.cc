// Request addressing and S3 error classification; see s3_request.h.
#include "transport/s3/s3_request.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <limits>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "transport/s3/sigv4.h"
#include "transport/transport_internal.h"

namespace refit::internal {
namespace {

// S3's bucket naming rules (Amazon S3 User Guide, "Bucket naming rules").
constexpr size_t kMinBucketNameLength = 3;
constexpr size_t kMaxBucketNameLength = 63;
// S3's longest object key, in bytes of its UTF-8 form.
constexpr size_t kMaxKeyBytes = 1024;
constexpr uint64_t kMaxPort = 65535;
// An IPv4 address has four dot-separated decimal groups.
constexpr size_t kIpv4Groups = 4;

bool IsUnreserved(char ch) {
  return (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') ||
         ch == '-' || ch == '.' || ch == '_' || ch == '~';
}

bool IsDigit(char ch) { return ch >= '0' && ch <= '9'; }

void AppendPercentEscape(char ch, std::string& out) {
  static constexpr std::string_view kHexDigits = "0123456789ABCDEF";
  const auto byte = static_cast<unsigned char>(ch);
  out.push_back('%');
  out.push_back(kHexDigits[byte >> 4]);
  out.push_back(kHexDigits[byte & 0xF]);
}

bool IsIpv4Shaped(std::string_view text) {
  size_t groups = 0;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find('.', start), text.size());
    const std::string_view group = text.substr(start, end - start);
    if (group.empty() || !std::all_of(group.begin(), group.end(), IsDigit)) return false;
    ++groups;
    start = end + 1;
  }
  return groups == kIpv4Groups;
}

// HTTP statuses the classification names.
constexpr long kHttpRequestTimeout = 408;
constexpr long kHttpUnauthorized = 401;
constexpr long kHttpForbidden = 403;
constexpr long kHttpNotFound = 404;
constexpr long kHttpConflict = 409;
constexpr long kHttpPreconditionFailed = 412;
constexpr long kHttpRangeNotSatisfiable = 416;
constexpr long kHttpTooManyRequests = 429;
constexpr long kHttpFirstServerError = 500;

// Throttling codes S3 and its clones send with 503 or 400 (AWS SDKs retry the same list).
bool IsThrottlingCode(std::string_view code) {
  return code == "SlowDown" || code == "Throttling" || code == "ThrottlingException" ||
         code == "RequestLimitExceeded" || code == "TooManyRequestsException";
}

// Server-side failures that may be reported inside a 200 reply (CompleteMultipartUpload).
bool IsInternalErrorCode(std::string_view code) {
  return code == "InternalError" || code == "ServiceUnavailable";
}

// A 400 sent when the client was too slow to send its body; repeating it usually works.
constexpr std::string_view kRequestTimeoutCode = "RequestTimeout";

}  // namespace

Result<S3Endpoint> ParseS3Endpoint(std::string_view endpoint, std::string_view region) {
  if (endpoint.empty()) {
    S3Endpoint aws;
    aws.https = true;
    aws.host = fmt::format("s3.{}.amazonaws.com", region);
    aws.authority = aws.host;
    return aws;
  }
  const auto bad = [&](std::string_view why) {
    return InvalidArgument(
        "S3 endpoint '{}': {}; expected http://host[:port] or https://host[:port]",
        Printable(endpoint), why);
  };
  constexpr std::string_view kHttp = "http://";
  constexpr std::string_view kHttps = "https://";
  S3Endpoint out;
  std::string_view rest;
  if (endpoint.starts_with(kHttp)) {
    rest = endpoint.substr(kHttp.size());
  } else if (endpoint.starts_with(kHttps)) {
    out.https = true;
    rest = endpoint.substr(kHttps.size());
  } else {
    return bad("the scheme is not http:// or https://");
  }
  if (rest.ends_with('/')) rest.remove_suffix(1);
  if (rest.find_first_of("/?#@") != std::string_view::npos) {
    return bad("it has a path, a query or user info");
  }
  if (rest.empty()) return bad("the host is empty");
  std::string_view host;
  std::string_view after_host;
  if (rest.front() == '[') {
    const size_t close = rest.find(']');
    if (close == std::string_view::npos) return bad("the IPv6 address has no ']'");
    host = rest.substr(0, close + 1);
    const std::string_view inner = host.substr(1, host.size() - 2);
    const bool ipv6_chars = !inner.empty() && std::all_of(inner.begin(), inner.end(), [](char ch) {
      return IsDigit(ch) || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F') || ch == ':' ||
             ch == '.';
    });
    if (!ipv6_chars) return bad("the IPv6 address has characters outside [0-9a-fA-F:.]");
    out.host_is_ip = true;
    after_host = rest.substr(close + 1);
  } else {
    const size_t colon = std::min(rest.find(':'), rest.size());
    host = rest.substr(0, colon);
    after_host = rest.substr(colon);
    const bool host_chars = !host.empty() && std::all_of(host.begin(), host.end(), [](char ch) {
      return IsUnreserved(ch) && ch != '~';
    });
    if (!host_chars) return bad("the host is empty or has characters outside [A-Za-z0-9._-]");
    out.host_is_ip = IsIpv4Shaped(host);
  }
  if (!after_host.empty()) {
    if (after_host.front() != ':') return bad("unexpected text after the host");
    const std::string_view port = after_host.substr(1);
    uint64_t value = 0;
    const auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
    if (port.empty() || ec != std::errc() || ptr != port.data() + port.size() || value == 0 ||
        value > kMaxPort) {
      return bad("the port is not a number in [1, 65535]");
    }
  }
  out.host = std::string(host);
  out.authority = std::string(rest);
  return out;
}

Status ValidateS3BucketName(std::string_view bucket) {
  const auto bad = [&](std::string_view rule) {
    return InvalidArgument("S3 bucket name '{}' {}", Printable(bucket), rule);
  };
  if (bucket.size() < kMinBucketNameLength || bucket.size() > kMaxBucketNameLength) {
    return bad(fmt::format("has {} characters, not 3 to 63", bucket.size()));
  }
  const auto lower_or_digit = [](char ch) { return (ch >= 'a' && ch <= 'z') || IsDigit(ch); };
  if (!std::all_of(bucket.begin(), bucket.end(),
                   [&](char ch) { return lower_or_digit(ch) || ch == '.' || ch == '-'; })) {
    return bad("has characters outside [a-z0-9.-]");
  }
  if (!lower_or_digit(bucket.front()) || !lower_or_digit(bucket.back())) {
    return bad("does not start and end with a letter or digit");
  }
  if (bucket.find("..") != std::string_view::npos) return bad("contains '..'");
  if (IsIpv4Shaped(bucket)) return bad("is shaped like an IP address");
  return Status::OK();
}

Status ValidateS3Key(std::string_view key) {
  if (key.empty()) return InvalidArgument("S3 object key is empty");
  if (key.size() > kMaxKeyBytes) {
    // Quote only the start: the whole key would drown the message.
    constexpr size_t kQuotedKeyBytes = 64;
    return InvalidArgument("S3 object key '{}...' has {} bytes, more than S3's limit of {}",
                           Printable(key.substr(0, kQuotedKeyBytes)), key.size(), kMaxKeyBytes);
  }
  return Status::OK();
}

std::string EncodeS3KeyPath(std::string_view key) {
  std::string out;
  out.reserve(key.size());
  for (char ch : key) {
    if (IsUnreserved(ch) || ch == '/') {
      out.push_back(ch);
    } else {
      AppendPercentEscape(ch, out);
    }
  }
  return out;
}

std::string EncodeS3Query(const S3QueryParams& query) { return SigV4CanonicalQuery(query); }

S3RequestTarget BuildS3RequestTarget(const S3Endpoint& endpoint, S3Addressing addressing,
                                     std::string_view bucket, std::string_view key,
                                     const S3QueryParams& query) {
  S3RequestTarget target;
  if (addressing == S3Addressing::kVirtualHost) {
    target.host = fmt::format("{}.{}", bucket, endpoint.authority);
    target.path = "/" + EncodeS3KeyPath(key);
  } else {
    target.host = endpoint.authority;
    target.path = key.empty() ? fmt::format("/{}", bucket)
                              : fmt::format("/{}/{}", bucket, EncodeS3KeyPath(key));
  }
  target.url =
      fmt::format("{}://{}{}", endpoint.https ? "https" : "http", target.host, target.path);
  if (!query.empty()) {
    target.url.push_back('?');
    target.url += EncodeS3Query(query);
  }
  return target;
}

bool IsRetryableS3Error(long http_status, std::string_view s3_code) {
  return http_status >= kHttpFirstServerError || http_status == kHttpRequestTimeout ||
         http_status == kHttpTooManyRequests || IsThrottlingCode(s3_code) ||
         IsInternalErrorCode(s3_code) || s3_code == kRequestTimeoutCode;
}

StatusCode S3ErrorStatusCode(long http_status, std::string_view s3_code) {
  if (IsThrottlingCode(s3_code) || IsInternalErrorCode(s3_code)) return StatusCode::kUnavailable;
  if (s3_code == kRequestTimeoutCode) return StatusCode::kDeadlineExceeded;
  if (s3_code == "NoSuchKey" || s3_code == "NoSuchBucket" || s3_code == "NoSuchUpload") {
    return StatusCode::kNotFound;
  }
  if (s3_code == "AccessDenied" || s3_code == "SignatureDoesNotMatch" ||
      s3_code == "InvalidAccessKeyId") {
    return StatusCode::kPermissionDenied;
  }
  if (s3_code == "BucketAlreadyExists") return StatusCode::kAlreadyExists;
  if (s3_code == "EntityTooSmall" || s3_code == "InvalidPart" || s3_code == "InvalidPartOrder" ||
      s3_code == "InvalidArgument") {
    return StatusCode::kInvalidArgument;
  }
  switch (http_status) {
    case kHttpNotFound:
      return StatusCode::kNotFound;
    case kHttpUnauthorized:
    case kHttpForbidden:
      return StatusCode::kPermissionDenied;
    case kHttpConflict:
      return StatusCode::kAlreadyExists;
    case kHttpPreconditionFailed:
    case kHttpRangeNotSatisfiable:
      return StatusCode::kFailedPrecondition;
    case kHttpRequestTimeout:
      return StatusCode::kDeadlineExceeded;
    case kHttpTooManyRequests:
      return StatusCode::kUnavailable;
    default:
      return http_status >= kHttpFirstServerError ? StatusCode::kUnavailable
                                                  : StatusCode::kInvalidArgument;
  }
}

std::chrono::milliseconds BackoffCeiling(std::chrono::milliseconds base,
                                         std::chrono::milliseconds cap, int retry) {
  const int64_t limit = std::max<int64_t>(cap.count(), 0);
  int64_t ceiling = std::max<int64_t>(base.count(), 0);
  // Doubling stops at the cap, so the loop runs at most ~63 times whatever `retry` is.
  for (int i = 0; i < retry && ceiling > 0 && ceiling < limit; ++i) {
    if (ceiling > std::numeric_limits<int64_t>::max() / 2) return std::chrono::milliseconds(limit);
    ceiling *= 2;
  }
  return std::chrono::milliseconds(std::min(ceiling, limit));
}

}  // namespace refit::internal
