// AWS Signature Version 4: canonical request, string to sign, signing key, signature.
#include "transport/s3/sigv4.h"

#include <fmt/format.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "refit/status_format.h"
#include "transport/transport_internal.h"

namespace refit {
namespace {

constexpr std::string_view kAlgorithm = "AWS4-HMAC-SHA256";
constexpr std::string_view kScopeTerminator = "aws4_request";
constexpr std::string_view kUnsignedPayload = "UNSIGNED-PAYLOAD";
// "YYYYMMDDTHHMMSSZ": ISO 8601 basic format, the only form X-Amz-Date takes.
constexpr size_t kAmzDateLength = 16;
constexpr size_t kAmzDateDateLength = 8;
constexpr size_t kAmzDateTPos = 8;
constexpr size_t kAmzDateTimeDigits = 6;
// SHA-256 digests are 32 bytes, 64 hex digits.
constexpr size_t kSha256Bytes = 32;
constexpr size_t kSha256HexDigits = 2 * kSha256Bytes;

using Digest = std::array<unsigned char, kSha256Bytes>;

std::string ToHex(std::span<const unsigned char> bytes) {
  static constexpr std::string_view kDigits = "0123456789abcdef";
  std::string out;
  out.reserve(2 * bytes.size());
  for (unsigned char b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 0xF]);
  }
  return out;
}

Result<Digest> Sha256(std::string_view text) {
  Digest digest{};
  unsigned int length = 0;
  if (EVP_Digest(text.data(), text.size(), digest.data(), &length, EVP_sha256(), nullptr) != 1 ||
      length != kSha256Bytes) {
    return Internal("sigv4: EVP_Digest(SHA-256) failed on {} bytes", text.size());
  }
  return digest;
}

Result<Digest> HmacSha256(std::span<const unsigned char> key, std::string_view message) {
  Digest mac{};
  unsigned int length = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac.data(),
           &length) == nullptr ||
      length != kSha256Bytes) {
    return Internal("sigv4: HMAC-SHA256 failed on a {}-byte message", message.size());
  }
  return mac;
}

bool IsUnreserved(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '.' || c == '_' || c == '~';
}

bool IsHexDigit(unsigned char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

void AppendEscaped(unsigned char c, std::string& out) {
  static constexpr std::string_view kUpperDigits = "0123456789ABCDEF";
  out.push_back('%');
  out.push_back(kUpperDigits[c >> 4]);
  out.push_back(kUpperDigits[c & 0xF]);
}

// RFC 3986 encoding as SigV4 defines it: everything but the unreserved set becomes %XX with
// upper-case hex, including '/' (query names and values, path segments).
std::string UriEncode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (IsUnreserved(c)) {
      out.push_back(ch);
    } else {
      AppendEscaped(c, out);
    }
  }
  return out;
}

// HTTP token characters (RFC 9110 section 5.6.2): the only bytes allowed in a method or a header
// name. Anything else could split the canonical request into different lines.
bool IsTokenChar(unsigned char c) {
  if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(static_cast<char>(c)) != std::string_view::npos;
}

bool IsToken(std::string_view text) {
  return !text.empty() && std::all_of(text.begin(), text.end(), [](char ch) {
    return IsTokenChar(static_cast<unsigned char>(ch));
  });
}

bool IsDigits(std::string_view text) {
  return std::all_of(text.begin(), text.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
}

int TwoDigits(std::string_view text, size_t pos) {
  return (text[pos] - '0') * 10 + (text[pos + 1] - '0');
}

Status ValidateAmzDate(std::string_view amz_date) {
  // Field bounds of the calendar and the clock; 60 admits a leap second.
  constexpr int kMaxMonth = 12;
  constexpr int kMaxDay = 31;
  constexpr int kMaxHour = 23;
  constexpr int kMaxMinute = 59;
  constexpr int kMaxSecond = 60;
  const bool shape_ok = amz_date.size() == kAmzDateLength && amz_date[kAmzDateTPos] == 'T' &&
                        amz_date.back() == 'Z' && IsDigits(amz_date.substr(0, kAmzDateTPos)) &&
                        IsDigits(amz_date.substr(kAmzDateTPos + 1, kAmzDateTimeDigits));
  if (!shape_ok) {
    return InvalidArgument("sigv4: amz_date '{}' is not of the form YYYYMMDDTHHMMSSZ",
                           internal::Printable(amz_date));
  }
  // Offsets of MM, DD, HH, MM, SS within YYYYMMDDTHHMMSSZ.
  const int month = TwoDigits(amz_date, 4);
  const int day = TwoDigits(amz_date, 6);
  const int hour = TwoDigits(amz_date, 9);
  const int minute = TwoDigits(amz_date, 11);
  const int second = TwoDigits(amz_date, 13);
  if (month < 1 || month > kMaxMonth || day < 1 || day > kMaxDay || hour > kMaxHour ||
      minute > kMaxMinute || second > kMaxSecond) {
    return InvalidArgument("sigv4: amz_date '{}' has a field out of range", amz_date);
  }
  return Status::OK();
}

// Scope parts and the key id are joined with '/' and ',' in the Authorization header, so those
// bytes (and anything non-printable) would make it ambiguous.
Status ValidateScopePart(std::string_view what, std::string_view value) {
  if (value.empty()) return InvalidArgument("sigv4: {} is empty", what);
  for (char ch : value) {
    const auto c = static_cast<unsigned char>(ch);
    if (c <= ' ' || c >= 0x7F || ch == '/' || ch == ',' || ch == ';' || ch == '=') {
      return InvalidArgument("sigv4: {} '{}' contains a byte not allowed in a credential scope",
                             what, internal::Printable(value));
    }
  }
  return Status::OK();
}

bool IsPayloadHash(std::string_view hash) {
  if (hash == kUnsignedPayload) return true;
  return hash.size() == kSha256HexDigits && std::all_of(hash.begin(), hash.end(), [](char ch) {
           return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f');
         });
}

// S3 signs the path as sent: keep '/', unreserved bytes and existing %XX escapes; encode any
// other byte once so that an unencoded '$' or space still yields what the server computes.
std::string CanonicalS3Path(std::string_view path) {
  std::string out;
  out.reserve(path.size());
  for (size_t i = 0; i < path.size(); ++i) {
    const auto c = static_cast<unsigned char>(path[i]);
    const bool escape = c == '%' && i + 2 < path.size() &&
                        IsHexDigit(static_cast<unsigned char>(path[i + 1])) &&
                        IsHexDigit(static_cast<unsigned char>(path[i + 2]));
    if (IsUnreserved(c) || c == '/' || escape) {
      out.push_back(path[i]);
    } else {
      AppendEscaped(c, out);
    }
  }
  return out;
}

// Every other service normalises the path (RFC 3986 section 5.2.4 dot-segment removal, empty
// segments dropped) and encodes each segment, so an escape already in the path is encoded again.
std::string CanonicalNormalizedPath(std::string_view path) {
  std::vector<std::string_view> segments;
  std::string_view last_raw;
  size_t start = 1;  // skip the leading '/'
  while (start <= path.size()) {
    const size_t end = std::min(path.find('/', start), path.size());
    const std::string_view segment = path.substr(start, end - start);
    last_raw = segment;
    if (segment == "..") {
      if (!segments.empty()) segments.pop_back();
    } else if (!segment.empty() && segment != ".") {
      segments.push_back(segment);
    }
    start = end + 1;
  }
  std::string out;
  for (std::string_view segment : segments) {
    out.push_back('/');
    out += UriEncode(segment);
  }
  // A path naming a directory ("/a/", "/a/b/..") keeps its trailing slash.
  const bool directory = last_raw.empty() || last_raw == "." || last_raw == "..";
  if (out.empty() || directory) out.push_back('/');
  return out;
}

// Trim leading and trailing blanks and collapse inner runs of blanks to one space.
std::string CanonicalHeaderValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  bool pending_space = false;
  for (char ch : value) {
    if (ch == ' ' || ch == '\t') {
      pending_space = !out.empty();
      continue;
    }
    if (pending_space) out.push_back(' ');
    pending_space = false;
    out.push_back(ch);
  }
  return out;
}

struct CanonicalHeaders {
  std::string block;         // "name:value\n" per header, sorted by name
  std::string signed_names;  // "name1;name2"
};

Result<CanonicalHeaders> BuildCanonicalHeaders(const SigV4Request& request,
                                               const SigV4Credentials& credentials) {
  // std::map keeps the names sorted; repeated names join their values in sending order.
  std::map<std::string, std::string> by_name;
  for (const auto& [name, value] : request.headers) {
    if (!IsToken(name)) {
      return InvalidArgument("sigv4: header name '{}' is not an HTTP token",
                             internal::Printable(name));
    }
    if (value.find_first_of(std::string_view("\r\n\0", 3)) != std::string::npos) {
      return InvalidArgument("sigv4: value of header '{}' contains CR, LF or NUL", name);
    }
    std::string lower(name);
    std::transform(lower.begin(), lower.end(), lower.begin(),
                   [](char ch) { return (ch >= 'A' && ch <= 'Z') ? ch - 'A' + 'a' : ch; });
    auto [it, inserted] = by_name.try_emplace(std::move(lower), CanonicalHeaderValue(value));
    if (!inserted) {
      it->second.push_back(',');
      it->second += CanonicalHeaderValue(value);
    }
  }
  if (!by_name.contains("host")) {
    return InvalidArgument("sigv4: request to '{}' has no host header",
                           internal::Printable(request.path));
  }
  if (!credentials.session_token.empty()) {
    const auto token = by_name.find("x-amz-security-token");
    if (token == by_name.end() ||
        token->second != CanonicalHeaderValue(credentials.session_token)) {
      return InvalidArgument(
          "sigv4: credentials carry a session token but the request has no matching "
          "x-amz-security-token header");
    }
  }
  CanonicalHeaders out;
  for (const auto& [name, value] : by_name) {
    out.block += name;
    out.block.push_back(':');
    out.block += value;
    out.block.push_back('\n');
    if (!out.signed_names.empty()) out.signed_names.push_back(';');
    out.signed_names += name;
  }
  return out;
}

std::span<const unsigned char> Bytes(std::string_view text) {
  return {reinterpret_cast<const unsigned char*>(text.data()), text.size()};
}

}  // namespace

std::string Sha256Hex(std::span<const std::byte> bytes) {
  Digest digest{};
  unsigned int length = 0;
  // EVP_Digest fails only on allocation failure inside OpenSSL. The empty string returned then
  // is refused by SignV4 as a payload hash, so the failure surfaces as an error, never as a
  // signature over a wrong hash.
  if (EVP_Digest(bytes.data(), bytes.size(), digest.data(), &length, EVP_sha256(), nullptr) != 1 ||
      length != kSha256Bytes) {
    return {};
  }
  return ToHex(digest);
}

Result<SigV4Signature> SignV4(const SigV4Request& request, const SigV4Credentials& credentials,
                              std::string_view region, std::string_view service,
                              std::string_view amz_date, bool double_encode_path) {
  REFIT_RETURN_NOT_OK(ValidateAmzDate(amz_date));
  REFIT_RETURN_NOT_OK(ValidateScopePart("region", region));
  REFIT_RETURN_NOT_OK(ValidateScopePart("service", service));
  REFIT_RETURN_NOT_OK(ValidateScopePart("access key id", credentials.access_key_id));
  if (credentials.secret_access_key.empty()) {
    return InvalidArgument("sigv4: secret access key of '{}' is empty", credentials.access_key_id);
  }
  if (!IsToken(request.method)) {
    return InvalidArgument("sigv4: method '{}' is not an HTTP token",
                           internal::Printable(request.method));
  }
  if (!request.path.empty() && request.path.front() != '/') {
    return InvalidArgument("sigv4: path '{}' does not start with '/'",
                           internal::Printable(request.path));
  }
  if (!IsPayloadHash(request.payload_sha256_hex)) {
    return InvalidArgument(
        "sigv4: payload hash '{}' is neither 64 lower-case hex digits nor UNSIGNED-PAYLOAD",
        internal::Printable(request.payload_sha256_hex));
  }
  REFIT_ASSIGN_OR_RETURN(CanonicalHeaders headers, BuildCanonicalHeaders(request, credentials));

  const std::string_view path = request.path.empty() ? std::string_view("/") : request.path;
  SigV4Signature out;
  out.canonical_request = request.method;
  out.canonical_request.push_back('\n');
  out.canonical_request +=
      double_encode_path ? CanonicalNormalizedPath(path) : CanonicalS3Path(path);
  out.canonical_request.push_back('\n');
  out.canonical_request += SigV4CanonicalQuery(request.query);
  out.canonical_request.push_back('\n');
  out.canonical_request += headers.block;
  out.canonical_request.push_back('\n');
  out.canonical_request += headers.signed_names;
  out.canonical_request.push_back('\n');
  out.canonical_request += request.payload_sha256_hex;

  const std::string_view date = amz_date.substr(0, kAmzDateDateLength);
  const std::string scope = fmt::format("{}/{}/{}/{}", date, region, service, kScopeTerminator);
  REFIT_ASSIGN_OR_RETURN(Digest request_hash, Sha256(out.canonical_request));
  out.string_to_sign =
      fmt::format("{}\n{}\n{}\n{}", kAlgorithm, amz_date, scope, ToHex(request_hash));

  // kSigning = HMAC(HMAC(HMAC(HMAC("AWS4" + secret, date), region), service), "aws4_request").
  const std::string secret_key = "AWS4" + credentials.secret_access_key;
  REFIT_ASSIGN_OR_RETURN(Digest k_date, HmacSha256(Bytes(secret_key), date));
  REFIT_ASSIGN_OR_RETURN(Digest k_region, HmacSha256(k_date, region));
  REFIT_ASSIGN_OR_RETURN(Digest k_service, HmacSha256(k_region, service));
  REFIT_ASSIGN_OR_RETURN(Digest k_signing, HmacSha256(k_service, kScopeTerminator));
  REFIT_ASSIGN_OR_RETURN(Digest signature, HmacSha256(k_signing, out.string_to_sign));
  out.signature_hex = ToHex(signature);
  out.authorization =
      fmt::format("{} Credential={}/{}, SignedHeaders={}, Signature={}", kAlgorithm,
                  credentials.access_key_id, scope, headers.signed_names, out.signature_hex);
  return out;
}

std::string SigV4CanonicalQuery(const std::vector<std::pair<std::string, std::string>>& query) {
  std::vector<std::pair<std::string, std::string>> encoded;
  encoded.reserve(query.size());
  for (const auto& [name, value] : query) encoded.emplace_back(UriEncode(name), UriEncode(value));
  // Sorted by encoded name, then encoded value (byte order), as the canonical form requires.
  std::sort(encoded.begin(), encoded.end());
  std::string out;
  for (const auto& [name, value] : encoded) {
    if (!out.empty()) out.push_back('&');
    out += name;
    out.push_back('=');
    out += value;
  }
  return out;
}

}  // namespace refit
