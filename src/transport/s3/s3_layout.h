// How the s3:// transport lays payloads out in a bucket and protects them: the URI's settings,
// object keys (derived from ids only, never from tensor names), checksums and MACs, the manifest
// a sender posts to receivers, and the verified download every reader uses.
//
//   <prefix>/live/<transfer hex>/<producer %06u>/<payload %06u>.rfpl    deleted once ACKed
//   <prefix>/chain/<transfer hex>/<producer %06u>/<payload %06u>.rfpl   kept (chain=1)
//   <prefix>/chain/index.json                                           the chain's versions
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/payload.h"
#include "refit/status.h"
#include "refit/transport.h"
#include "transport/s3/s3_client.h"

namespace refit::internal {

/// The settings an s3:// URI carries (see the transport table in transport.h).
struct S3TransportConfig {
  S3ClientOptions client;
  /// Without leading or trailing '/'; empty puts everything at the bucket's root.
  std::string prefix;
  S3TransferOptions transfer;
  /// Keep committed payloads as a versioned chain instead of deleting them once ACKed.
  bool chain = false;
  /// The newest versions the chain keeps (PruneChain), extended back to their anchor; the
  /// active chain is always kept.
  uint64_t retain_versions = 0;
  /// The shared MAC secret; empty: no MAC.
  std::string mac_key;
  /// The receivers' control-plane key (sent with each manifest); empty: none.
  std::string api_key;
  /// Limit of one manifest POST (the receiver downloads and stages before it answers), and the
  /// extra attempts after a connection error or a 502/503/504.
  std::chrono::milliseconds manifest_timeout{std::chrono::minutes(2)};
  int manifest_retries = 5;
  /// PEM certificates to trust for https:// control planes; empty: the system's store.
  std::string control_ca_cert;
  /// The URI with secrets redacted, for messages.
  std::string shown_uri;
};

/// Parse and validate an s3:// URI (no I/O; credentials come from the environment variables the
/// URI names, or the AWS defaults). Errors: InvalidArgument naming the URI and the parameter.
Result<S3TransportConfig> ParseS3TransportUri(const TransportUri& uri);

/// The key of one payload object (see the file comment).
std::string PayloadObjectKey(const S3TransportConfig& config, bool chain,
                             const TransferId& transfer_id, uint32_t producer_id,
                             uint32_t payload_id);
/// The key prefix of every object of one transfer (for cleaning up after an abort).
std::string TransferObjectPrefix(const S3TransportConfig& config, bool chain,
                                 const TransferId& transfer_id);
/// <prefix>/chain/ and <prefix>/chain/index.json.
std::string ChainObjectPrefix(const S3TransportConfig& config);
std::string ChainIndexKey(const S3TransportConfig& config);

/// XXH3-128 of `bytes`, and its 32 lower-case hex digits.
std::array<uint8_t, 16> ObjectChecksum(std::span<const std::byte> bytes);
std::string ChecksumToHex(const std::array<uint8_t, 16>& checksum);
Result<std::array<uint8_t, 16>> ChecksumFromHex(std::string_view hex, std::string_view what);

/// HMAC-SHA256 of `bytes` under `key`, as 64 lower-case hex digits.
std::string MacHex(std::string_view key, std::span<const std::byte> bytes);
/// Check `mac_hex` against MacHex(key, bytes) in constant time. `what` names the object.
/// Errors: PermissionDenied for a missing or wrong MAC.
Status VerifyMac(std::string_view key, std::span<const std::byte> bytes, std::string_view mac_hex,
                 std::string_view what);

/// What a sender tells each receiver about one uploaded payload.
struct PayloadManifest {
  TransferId transfer_id;
  uint32_t producer_id = 0;
  uint32_t payload_id = 0;
  std::string key;
  uint64_t size = 0;
  std::array<uint8_t, 16> checksum{};
  /// Empty without a MAC key.
  std::string mac;
};
std::string ManifestToJson(const PayloadManifest& manifest);
/// Errors: InvalidArgument for malformed JSON, a missing, unknown or mistyped field.
Result<PayloadManifest> ManifestFromJson(std::string_view text);

/// Download the payload object `key` of `size` bytes and verify, before anything decodes it:
/// its size against `limits`, its XXH3-128 against `checksum`, its MAC when `config.mac_key` is
/// set, and its header (ValidatePayload) naming `expected_ids`' transfer, producer and payload.
/// Errors: ResourceExhausted (a size over the limit); DataLoss (a checksum mismatch, a short
/// object, a header naming other ids); PermissionDenied (a MAC mismatch); those of the download.
Result<ValidatedPayload> FetchVerifiedPayload(S3Client& client, const S3TransportConfig& config,
                                              const PayloadManifest& expected,
                                              const PayloadLimits& limits);

}  // namespace refit::internal
