#include "transport/s3/s3_layout.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "refit/status_format.h"
#include "transport/transport_internal.h"
#include "util/environment.h"

namespace refit::internal {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kMaxTimeoutMs = uint64_t{24} * 3600 * 1000;
constexpr uint64_t kDefaultRetries = 5;
constexpr uint64_t kMaxRetries = 100;
constexpr uint64_t kMaxPartsInFlight = 256;
constexpr size_t kMacHexDigits = 64;
// A manifest is a few hundred bytes; anything far larger is not one.
constexpr size_t kMaxManifestBytes = 64 << 10;

// The environment variables the AWS SDKs and CLI read.
constexpr const char* kDefaultAccessKeyEnv = "AWS_ACCESS_KEY_ID";
constexpr const char* kDefaultSecretKeyEnv = "AWS_SECRET_ACCESS_KEY";
constexpr const char* kDefaultSessionTokenEnv = "AWS_SESSION_TOKEN";

Result<std::string> EnvParam(const TransportUri& uri, const std::string& shown,
                             std::string_view param, const char* fallback_variable, bool required,
                             std::string_view what) {
  const std::string* named = uri.Param(param);
  const std::string variable = named != nullptr ? *named : std::string(fallback_variable);
  Result<std::string> value = SecretFromEnvironment(variable, what);
  if (value.ok()) return value;
  if (!required && named == nullptr) return std::string();
  // The variable's name came in the URI: shown escaped, like the URI.
  return InvalidArgument("transport URI '{}': environment variable {} ({}) is unset or empty",
                         shown, Printable(variable), what);
}

std::string JoinKey(const S3TransportConfig& config, std::string_view rest) {
  return config.prefix.empty() ? std::string(rest) : fmt::format("{}/{}", config.prefix, rest);
}

}  // namespace

Result<S3TransportConfig> ParseS3TransportUri(const TransportUri& uri) {
  S3TransportConfig config;
  config.shown_uri = Printable(uri.ToString());
  const std::string& shown = config.shown_uri;
  REFIT_RETURN_NOT_OK(CheckKnownParams(
      uri, {"endpoint", "region", "addressing", "access_key_env", "secret_key_env",
            "session_token_env", "part_size", "parts_in_flight", "chain", "retain", "mac_key_env",
            "api_key_env", "timeout_ms", "retries", "control_ca_cert"}));

  // Target: <bucket>[/<prefix>].
  const size_t slash = uri.target.find('/');
  config.client.bucket = uri.target.substr(0, slash);
  if (config.client.bucket.empty()) {
    return InvalidArgument("transport URI '{}': no bucket (s3://<bucket>/<prefix>)", shown);
  }
  if (slash != std::string::npos) {
    std::string_view prefix = std::string_view(uri.target).substr(slash + 1);
    while (!prefix.empty() && prefix.front() == '/') prefix.remove_prefix(1);
    while (!prefix.empty() && prefix.back() == '/') prefix.remove_suffix(1);
    config.prefix = std::string(prefix);
  }
  if (const std::string* endpoint = uri.Param("endpoint")) config.client.endpoint = *endpoint;
  if (const std::string* region = uri.Param("region")) {
    config.client.region = *region;
  } else if (const char* env = std::getenv("AWS_REGION"); env != nullptr && *env != '\0') {
    config.client.region = env;
  }
  // A custom endpoint (a local server, an IP) rarely resolves <bucket>.<host>; AWS prefers it.
  config.client.addressing =
      config.client.endpoint.empty() ? S3Addressing::kVirtualHost : S3Addressing::kPath;
  if (const std::string* addressing = uri.Param("addressing")) {
    if (*addressing == "path") {
      config.client.addressing = S3Addressing::kPath;
    } else if (*addressing == "virtual") {
      config.client.addressing = S3Addressing::kVirtualHost;
    } else {
      return InvalidArgument("transport URI '{}': addressing '{}' is neither 'path' nor 'virtual'",
                             shown, Printable(*addressing));
    }
  }
  REFIT_ASSIGN_OR_RETURN(config.client.credentials.access_key_id,
                         EnvParam(uri, shown, "access_key_env", kDefaultAccessKeyEnv,
                                  /*required=*/true, "the S3 access key id"));
  REFIT_ASSIGN_OR_RETURN(config.client.credentials.secret_access_key,
                         EnvParam(uri, shown, "secret_key_env", kDefaultSecretKeyEnv,
                                  /*required=*/true, "the S3 secret access key"));
  REFIT_ASSIGN_OR_RETURN(config.client.credentials.session_token,
                         EnvParam(uri, shown, "session_token_env", kDefaultSessionTokenEnv,
                                  /*required=*/false, "the S3 session token"));

  REFIT_ASSIGN_OR_RETURN(
      config.transfer.part_size,
      UintParam(uri, "part_size", config.transfer.part_size, S3TransferOptions::kMaxPartSize));
  if (config.transfer.part_size < S3TransferOptions::kMinPartSize) {
    return InvalidArgument(
        "transport URI '{}': part_size {} is below S3's smallest part of {} bytes (5 MiB)", shown,
        config.transfer.part_size, S3TransferOptions::kMinPartSize);
  }
  REFIT_ASSIGN_OR_RETURN(
      const uint64_t parts,
      UintParam(uri, "parts_in_flight", config.transfer.max_parts_in_flight, kMaxPartsInFlight));
  if (parts == 0) {
    return InvalidArgument("transport URI '{}': parts_in_flight must be at least 1", shown);
  }
  config.transfer.max_parts_in_flight = static_cast<size_t>(parts);
  REFIT_ASSIGN_OR_RETURN(const uint64_t chain, UintParam(uri, "chain", 0, 1));
  config.chain = chain == 1;
  REFIT_ASSIGN_OR_RETURN(config.retain_versions, UintParam(uri, "retain", 0, UINT32_MAX));
  if (uri.Param("retain") != nullptr && !config.chain) {
    return InvalidArgument("transport URI '{}': retain applies to chains only (chain=1)", shown);
  }
  if (uri.Param("mac_key_env") != nullptr) {
    REFIT_ASSIGN_OR_RETURN(config.mac_key,
                           EnvParam(uri, shown, "mac_key_env", "", true, "the payload MAC key"));
  }
  if (uri.Param("api_key_env") != nullptr) {
    REFIT_ASSIGN_OR_RETURN(config.api_key, EnvParam(uri, shown, "api_key_env", "", true,
                                                    "the receivers' control-plane key"));
  }
  REFIT_ASSIGN_OR_RETURN(
      const uint64_t timeout_ms,
      UintParam(uri, "timeout_ms", static_cast<uint64_t>(config.manifest_timeout.count()),
                kMaxTimeoutMs));
  if (timeout_ms == 0) {
    return InvalidArgument("transport URI '{}': timeout_ms must be positive", shown);
  }
  config.manifest_timeout = std::chrono::milliseconds(timeout_ms);
  REFIT_ASSIGN_OR_RETURN(const uint64_t retries,
                         UintParam(uri, "retries", kDefaultRetries, kMaxRetries));
  config.client.max_retries = static_cast<int>(retries);
  config.manifest_retries = static_cast<int>(retries);
  if (const std::string* ca = uri.Param("control_ca_cert")) config.control_ca_cert = *ca;

  // The client validates what is left (endpoint syntax, bucket name, region); say which URI.
  Result<std::unique_ptr<S3Client>> probe = S3Client::Make(config.client);
  if (!probe.ok()) return probe.status().WithContext(fmt::format("transport URI '{}'", shown));
  return config;
}

std::string PayloadObjectKey(const S3TransportConfig& config, bool chain,
                             const TransferId& transfer_id, uint32_t producer_id,
                             uint32_t payload_id) {
  return fmt::format("{}{:06}/{:06}.rfpl", TransferObjectPrefix(config, chain, transfer_id),
                     producer_id, payload_id);
}

std::string TransferObjectPrefix(const S3TransportConfig& config, bool chain,
                                 const TransferId& transfer_id) {
  return JoinKey(config, fmt::format("{}/{}/", chain ? "chain" : "live", transfer_id.ToHex()));
}

std::string ChainObjectPrefix(const S3TransportConfig& config) { return JoinKey(config, "chain/"); }

std::string ChainIndexKey(const S3TransportConfig& config) {
  return JoinKey(config, "chain/index.json");
}

std::array<uint8_t, 16> ObjectChecksum(std::span<const std::byte> bytes) {
  const XXH128_hash_t hash = XXH3_128bits(bytes.data(), bytes.size());
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, hash);
  std::array<uint8_t, 16> checksum;
  std::memcpy(checksum.data(), canonical.digest, checksum.size());
  return checksum;
}

std::string ChecksumToHex(const std::array<uint8_t, 16>& checksum) {
  std::string hex;
  for (uint8_t byte : checksum) hex += fmt::format("{:02x}", byte);
  return hex;
}

Result<std::array<uint8_t, 16>> ChecksumFromHex(std::string_view hex, std::string_view what) {
  std::array<uint8_t, 16> checksum{};
  if (hex.size() != 2 * checksum.size()) {
    return InvalidArgument("{} '{}' is not 32 hex digits", what, Printable(hex));
  }
  for (size_t i = 0; i < checksum.size(); ++i) {
    unsigned value = 0;
    for (char c : hex.substr(2 * i, 2)) {
      value <<= 4;
      if (c >= '0' && c <= '9') {
        value |= static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        value |= static_cast<unsigned>(c - 'a' + 10);
      } else {
        return InvalidArgument("{} '{}' is not lower-case hex", what, Printable(hex));
      }
    }
    checksum[i] = static_cast<uint8_t>(value);
  }
  return checksum;
}

std::string MacHex(std::string_view key, std::span<const std::byte> bytes) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), mac, &length);
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) hex += fmt::format("{:02x}", mac[i]);
  return hex;
}

Status VerifyMac(std::string_view key, std::span<const std::byte> bytes, std::string_view mac_hex,
                 std::string_view what) {
  if (mac_hex.empty()) {
    return PermissionDenied("{} carries no MAC, and this receiver requires one (mac_key_env)",
                            what);
  }
  const std::string expected = MacHex(key, bytes);
  if (mac_hex.size() != kMacHexDigits ||
      CRYPTO_memcmp(expected.data(), mac_hex.data(), kMacHexDigits) != 0) {
    return PermissionDenied("{}: MAC does not verify (a forged or foreign object)", what);
  }
  return Status::OK();
}

std::string ManifestToJson(const PayloadManifest& manifest) {
  Json body{{"transfer_id", manifest.transfer_id.ToHex()},
            {"producer_id", manifest.producer_id},
            {"payload_id", manifest.payload_id},
            {"key", manifest.key},
            {"size", manifest.size},
            {"checksum", ChecksumToHex(manifest.checksum)}};
  if (!manifest.mac.empty()) body["mac"] = manifest.mac;
  return body.dump();
}

Result<PayloadManifest> ManifestFromJson(std::string_view text) {
  if (text.size() > kMaxManifestBytes) {
    return InvalidArgument("manifest of {} bytes exceeds {}", text.size(), kMaxManifestBytes);
  }
  Json body = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    return InvalidArgument("manifest is not a JSON object");
  }
  for (const auto& [name, value] : body.items()) {
    static constexpr std::string_view kFields[] = {
        "transfer_id", "producer_id", "payload_id", "key", "size", "checksum", "mac"};
    if (std::find(std::begin(kFields), std::end(kFields), name) == std::end(kFields)) {
      return InvalidArgument("manifest has unknown field '{}'", Printable(name));
    }
  }
  auto string_field = [&](const char* name, bool required) -> Result<std::string> {
    auto it = body.find(name);
    if (it == body.end()) {
      if (!required) return std::string();
      return InvalidArgument("manifest lacks '{}'", name);
    }
    if (!it->is_string()) return InvalidArgument("manifest '{}' is not a string", name);
    return it->get<std::string>();
  };
  auto uint_field = [&](const char* name, uint64_t max) -> Result<uint64_t> {
    auto it = body.find(name);
    if (it == body.end()) return InvalidArgument("manifest lacks '{}'", name);
    if (!it->is_number_unsigned() || it->get<uint64_t>() > max) {
      return InvalidArgument("manifest '{}' is not an integer in [0, {}]", name, max);
    }
    return it->get<uint64_t>();
  };
  PayloadManifest manifest;
  REFIT_ASSIGN_OR_RETURN(const std::string transfer, string_field("transfer_id", true));
  REFIT_ASSIGN_OR_RETURN(manifest.transfer_id, TransferId::FromHex(transfer));
  REFIT_ASSIGN_OR_RETURN(const uint64_t producer, uint_field("producer_id", UINT32_MAX));
  REFIT_ASSIGN_OR_RETURN(const uint64_t payload, uint_field("payload_id", UINT32_MAX));
  manifest.producer_id = static_cast<uint32_t>(producer);
  manifest.payload_id = static_cast<uint32_t>(payload);
  REFIT_ASSIGN_OR_RETURN(manifest.key, string_field("key", true));
  REFIT_ASSIGN_OR_RETURN(manifest.size, uint_field("size", UINT64_MAX));
  REFIT_ASSIGN_OR_RETURN(const std::string checksum, string_field("checksum", true));
  REFIT_ASSIGN_OR_RETURN(manifest.checksum, ChecksumFromHex(checksum, "manifest checksum"));
  REFIT_ASSIGN_OR_RETURN(manifest.mac, string_field("mac", false));
  return manifest;
}

Result<ValidatedPayload> FetchVerifiedPayload(S3Client& client, const S3TransportConfig& config,
                                              const PayloadManifest& expected,
                                              const PayloadLimits& limits) {
  const std::string what =
      fmt::format("payload object s3://{}/{}", config.client.bucket, Printable(expected.key));
  if (expected.size > limits.max_payload_bytes) {
    return ResourceExhausted("{}: {} bytes exceed the limit of {}", what, expected.size,
                             limits.max_payload_bytes);
  }
  REFIT_ASSIGN_OR_RETURN(std::vector<std::byte> bytes,
                         client.Download(expected.key, expected.size, config.transfer));
  // Checksum and MAC first: nothing reads a byte of an object that is not the one announced.
  const std::array<uint8_t, 16> checksum = ObjectChecksum(bytes);
  if (checksum != expected.checksum) {
    return DataLoss(
        "{}: checksum {} is not the expected {} (from the manifest or the chain index): the "
        "object was corrupted or replaced in the store",
        what, ChecksumToHex(checksum), ChecksumToHex(expected.checksum));
  }
  if (!config.mac_key.empty()) {
    REFIT_RETURN_NOT_OK(VerifyMac(config.mac_key, bytes, expected.mac, what));
  }
  REFIT_ASSIGN_OR_RETURN(ValidatedPayload payload, ValidatePayload(std::move(bytes), limits));
  const PayloadIds& ids = payload.ids();
  if (ids.transfer_id != expected.transfer_id || ids.producer_id != expected.producer_id ||
      ids.payload_id != expected.payload_id) {
    return DataLoss("{}: its header names transfer {} producer {} payload {}, not {} {} {}", what,
                    ids.transfer_id.ToHex(), ids.producer_id, ids.payload_id,
                    expected.transfer_id.ToHex(), expected.producer_id, expected.payload_id);
  }
  return payload;
}

}  // namespace refit::internal
