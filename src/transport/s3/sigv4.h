// AWS Signature Version 4 request signing (AWS4-HMAC-SHA256), as used by the S3 transport.
//
// A pure function of its inputs: no clock, no I/O, no global state. The caller supplies the
// request exactly as it will be sent, the credentials, and the X-Amz-Date timestamp; the result
// carries the intermediate strings (for debugging a SignatureDoesNotMatch reply) and the value of
// the Authorization header.
//
// Reference: AWS General Reference, "Create a signed AWS API request", and the Amazon S3 API
// Reference, "Signature Calculations for the Authorization Header: Transferring Payload in a
// Single Chunk".
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "refit/status.h"

namespace refit {

/// Long-term or temporary AWS credentials.
struct SigV4Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  /// STS session token; empty for long-term keys. When set, the request must carry it in an
  /// `x-amz-security-token` header, which is then signed like any other header.
  std::string session_token;
};

/// The parts of an HTTP request that SigV4 signs.
struct SigV4Request {
  /// HTTP method, e.g. "GET", "PUT".
  std::string method;
  /// The URI path as sent, starting with '/'; empty means "/". For S3 it is already
  /// percent-encoded (S3 does not encode twice); bytes outside the unreserved set that are not
  /// part of a %XX escape are encoded once. For other services each segment is normalised
  /// (".", ".." and empty segments removed) and percent-encoded again.
  std::string path;
  /// Decoded query parameters as name/value pairs, in any order; a name may repeat. A parameter
  /// without a value (`?uploads`) has an empty value and signs as `uploads=`.
  std::vector<std::pair<std::string, std::string>> query;
  /// Headers to sign, in sending order; names are case-insensitive and may repeat (values are
  /// then joined with ',' in this order). Must include `host`. Every header given is signed.
  std::vector<std::pair<std::string, std::string>> headers;
  /// Lower-case hex SHA-256 of the body (see Sha256Hex), or "UNSIGNED-PAYLOAD".
  std::string payload_sha256_hex;
};

/// The signature and the strings it was computed from.
struct SigV4Signature {
  std::string canonical_request;
  std::string string_to_sign;
  /// 64 lower-case hex characters.
  std::string signature_hex;
  /// The value of the Authorization header: "AWS4-HMAC-SHA256 Credential=..., SignedHeaders=...,
  /// Signature=...".
  std::string authorization;
};

/// Sign `request` with `credentials` for `region` and `service` at `amz_date`.
///
/// `amz_date` is the ISO 8601 basic UTC timestamp sent in X-Amz-Date, e.g. "20150830T123600Z";
/// its first eight characters form the credential scope date. `double_encode_path` selects the
/// canonical-URI rule: true for every service except S3 (normalise the path, encode each segment
/// again), false for S3 (use the path as sent).
///
/// Thread-safety: reentrant. Complexity: linear in the request size plus sorting of the headers
/// and query parameters.
/// Errors: InvalidArgument for a malformed amz_date, a missing `host` header, an empty region,
/// service, access key id or secret, a method or header name with characters outside the HTTP
/// token set, a header value with a CR, LF or NUL, a path not starting with '/', a payload hash
/// that is neither 64 lower-case hex digits nor "UNSIGNED-PAYLOAD", or a session token that the
/// headers do not carry. Internal if OpenSSL fails.
Result<SigV4Signature> SignV4(const SigV4Request& request, const SigV4Credentials& credentials,
                              std::string_view region, std::string_view service,
                              std::string_view amz_date, bool double_encode_path);

/// Return the canonical query string of `query` (decoded name/value pairs): each name and value
/// percent-encoded (RFC 3986 unreserved characters kept), sorted by name then value, joined with
/// '&'. A client that sends its query in exactly this form signs what it sends.
std::string SigV4CanonicalQuery(const std::vector<std::pair<std::string, std::string>>& query);

/// Return the lower-case hex SHA-256 of `bytes`, the form `x-amz-content-sha256` takes.
std::string Sha256Hex(std::span<const std::byte> bytes);

}  // namespace refit
