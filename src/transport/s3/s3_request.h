// The pure parts of an S3 request, apart from libcurl so that unit tests reach them directly:
// where a request goes (endpoint parsing, bucket and key rules, percent-encoding, URL and Host
// for path-style or virtual-host addressing) and what a failed reply means (S3's error codes as
// StatusCodes, which failures are worth repeating, the backoff ceiling between tries).
// S3Client (s3_client.cc) builds every request and judges every reply with these.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "refit/status.h"
#include "transport/s3/s3_client.h"

namespace refit::internal {

/// Decoded query parameters, as SigV4Request takes them.
using S3QueryParams = std::vector<std::pair<std::string, std::string>>;

/// A validated S3ClientOptions::endpoint.
struct S3Endpoint {
  bool https = false;
  /// The host as written: a DNS name, an IPv4 address, or a bracketed IPv6 address.
  std::string host;
  /// "host" or "host:port", as written in the endpoint (the Host header of path-style requests).
  std::string authority;
  /// Whether the host is an IP address (virtual-host addressing cannot work there).
  bool host_is_ip = false;
};

/// Parse "http://host[:port]" or "https://host[:port]" (a trailing '/' is tolerated); an empty
/// endpoint is AWS's regional one, "https://s3.<region>.amazonaws.com".
/// Errors: InvalidArgument naming the endpoint and what is wrong with it.
Result<S3Endpoint> ParseS3Endpoint(std::string_view endpoint, std::string_view region);

/// Check S3's bucket naming rules: 3–63 characters of [a-z0-9.-], starting and ending with a
/// letter or digit, no "..", not shaped like an IPv4 address.
/// Errors: InvalidArgument naming the bucket and the rule it breaks.
Status ValidateS3BucketName(std::string_view bucket);

/// Check an object key: 1 to 1024 bytes (S3's limit). Errors: InvalidArgument.
Status ValidateS3Key(std::string_view key);

/// Percent-encode `key` for a URL path: every byte outside A-Za-z0-9-._~ and '/' becomes %XX
/// (upper-case hex), so the path curl sends is exactly the one SigV4 signs.
std::string EncodeS3KeyPath(std::string_view key);

/// Return "name=value&…" with names and values percent-encoded (only the unreserved set kept)
/// and sorted as SigV4's canonical query is; a parameter with an empty value keeps its '='
/// ("uploads="), which S3 requires for the signature to match.
std::string EncodeS3Query(const S3QueryParams& query);

/// Where one request goes.
struct S3RequestTarget {
  /// scheme://authority/path[?query]
  std::string url;
  /// The Host header (signed): the endpoint's authority, prefixed with "<bucket>." for
  /// virtual-host addressing.
  std::string host;
  /// The encoded path (signed): "/<bucket>/<key>" (path style) or "/<key>" (virtual host);
  /// the bucket itself is "/<bucket>" or "/".
  std::string path;
};

/// Build the URL, Host and path of a request for `key` (empty: the bucket itself).
S3RequestTarget BuildS3RequestTarget(const S3Endpoint& endpoint, S3Addressing addressing,
                                     std::string_view bucket, std::string_view key,
                                     const S3QueryParams& query);

/// Whether a reply of `http_status` carrying S3 error code `s3_code` (may be empty) is worth
/// repeating: 5xx, 408, 429, or a throttling or internal-error code whatever the status.
bool IsRetryableS3Error(long http_status, std::string_view s3_code);

/// The StatusCode of a failed reply (see the mapping in s3_client.h).
StatusCode S3ErrorStatusCode(long http_status, std::string_view s3_code);

/// The ceiling of the random delay before retry number `retry` (0 for the first retry):
/// min(cap, base · 2^retry), without overflow.
std::chrono::milliseconds BackoffCeiling(std::chrono::milliseconds base,
                                         std::chrono::milliseconds cap, int retry);

}  // namespace refit::internal
