#include "transport/s3/s3_layout.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "refit/control_client.h"
#include "refit/transport.h"
#include "test_util.h"

namespace refit::internal {
namespace {

using nlohmann::json;

// Test-specific credential variables, so no test depends on the machine's AWS_* settings.
constexpr const char* kAccessKeyVar = "REFIT_S3_LAYOUT_TEST_ACCESS_KEY";
constexpr const char* kSecretKeyVar = "REFIT_S3_LAYOUT_TEST_SECRET_KEY";
constexpr const char* kSessionTokenVar = "REFIT_S3_LAYOUT_TEST_SESSION_TOKEN";
constexpr const char* kMacKeyVar = "REFIT_S3_LAYOUT_TEST_MAC_KEY";
constexpr const char* kApiKeyVar = "REFIT_S3_LAYOUT_TEST_API_KEY";
// Never set by any test: naming it must be refused.
constexpr const char* kUnsetVar = "REFIT_S3_LAYOUT_TEST_NEVER_SET";
constexpr std::string_view kAccessKey = "AKIDEXAMPLE";
constexpr std::string_view kSecretKey = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
constexpr std::string_view kBucket = "refit-test-bucket";
// Port 1 on loopback: nothing listens, so any S3 request fails at once with Unavailable.
constexpr std::string_view kClosedEndpoint = "http://127.0.0.1:1";
// S3's smallest multipart part (5 MiB), restated so the test catches a changed constant.
constexpr uint64_t kFiveMiB = uint64_t{5} << 20;

/// Set (or unset, with nullopt) an environment variable for the scope, then restore it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string_view> value) : name_(name) {
    if (const char* old = std::getenv(name)) saved_ = std::string(old);
    if (value.has_value()) {
      setenv(name, std::string(*value).c_str(), /*overwrite=*/1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (saved_.has_value()) {
      setenv(name_, saved_->c_str(), /*overwrite=*/1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

std::span<const std::byte> AsBytes(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

/// An s3:// URI over `target` with the test's credential variables, the closed endpoint and no
/// retries, plus `extra` parameters ("k=v&k2=v2").
std::string Uri(std::string_view target, std::string_view extra = "") {
  std::string uri = fmt::format("s3://{}?endpoint={}&access_key_env={}&secret_key_env={}&retries=0",
                                target, kClosedEndpoint, kAccessKeyVar, kSecretKeyVar);
  if (!extra.empty()) uri += fmt::format("&{}", extra);
  return uri;
}

Result<S3TransportConfig> Parse(std::string_view text) {
  REFIT_ASSIGN_OR_RETURN(const TransportUri uri, TransportUri::Parse(text));
  return ParseS3TransportUri(uri);
}

TransferId FixedTransferId() {
  TransferId id;
  for (size_t i = 0; i < id.bytes.size(); ++i) id.bytes[i] = static_cast<uint8_t>(0xa0 + i);
  return id;
}

/// Fixture: the test's credential variables hold a key pair; the optional ones are unset.
class S3LayoutTest : public ::testing::Test {
 protected:
  ScopedEnv access_{kAccessKeyVar, kAccessKey};
  ScopedEnv secret_{kSecretKeyVar, kSecretKey};
  ScopedEnv token_{kSessionTokenVar, std::nullopt};
  ScopedEnv mac_{kMacKeyVar, std::nullopt};
  ScopedEnv api_{kApiKeyVar, std::nullopt};
  ScopedEnv unset_{kUnsetVar, std::nullopt};
};

// ---- ParseS3TransportUri ----------------------------------------------------------------------

TEST_F(S3LayoutTest, ParsesBucketPrefixAndDefaults) {
  ASSERT_OK_AND_ASSIGN(const S3TransportConfig config, Parse(Uri("refit-test-bucket/fleet/a")));
  EXPECT_EQ(config.client.bucket, kBucket);
  EXPECT_EQ(config.prefix, "fleet/a");
  EXPECT_EQ(config.client.endpoint, kClosedEndpoint);
  // A custom endpoint (here an IP) defaults to path-style addressing.
  EXPECT_EQ(config.client.addressing, S3Addressing::kPath);
  EXPECT_EQ(config.client.credentials.access_key_id, kAccessKey);
  EXPECT_EQ(config.client.credentials.secret_access_key, kSecretKey);
  const S3TransferOptions default_transfer;
  EXPECT_EQ(config.transfer.part_size, default_transfer.part_size);
  EXPECT_EQ(config.transfer.max_parts_in_flight, default_transfer.max_parts_in_flight);
  EXPECT_FALSE(config.chain);
  EXPECT_EQ(config.retain_versions, 0u);
  EXPECT_TRUE(config.mac_key.empty());
  EXPECT_TRUE(config.api_key.empty());
  EXPECT_EQ(config.manifest_timeout, S3TransportConfig{}.manifest_timeout);
  EXPECT_EQ(config.client.max_retries, 0);
  EXPECT_EQ(config.manifest_retries, 0);
  EXPECT_TRUE(config.control_ca_cert.empty());
  EXPECT_NE(config.shown_uri.find("refit-test-bucket/fleet/a"), std::string::npos)
      << config.shown_uri;
}

TEST_F(S3LayoutTest, WithoutAnEndpointAwsAndVirtualHostAddressingAreTheDefault) {
  // Unset: the client's default region, not the machine's.
  ScopedEnv region("AWS_REGION", std::nullopt);
  ASSERT_OK_AND_ASSIGN(const S3TransportConfig config,
                       Parse(fmt::format("s3://{}/p?access_key_env={}&secret_key_env={}", kBucket,
                                         kAccessKeyVar, kSecretKeyVar)));
  EXPECT_TRUE(config.client.endpoint.empty());
  EXPECT_EQ(config.client.addressing, S3Addressing::kVirtualHost);
  // The defaults transport.h documents for the URI.
  EXPECT_EQ(config.client.region, "us-east-1");
  EXPECT_EQ(config.transfer.part_size, uint64_t{64} << 20);
  EXPECT_EQ(config.transfer.max_parts_in_flight, 8u);
  EXPECT_EQ(config.manifest_timeout, std::chrono::milliseconds(120000));
  EXPECT_EQ(config.client.max_retries, 5);
  EXPECT_EQ(config.manifest_retries, 5);
}

TEST_F(S3LayoutTest, RegionComesFromTheUriOrAwsRegion) {
  ScopedEnv region("AWS_REGION", "ap-south-1");
  ASSERT_OK_AND_ASSIGN(const S3TransportConfig from_env, Parse(Uri("refit-test-bucket")));
  EXPECT_EQ(from_env.client.region, "ap-south-1");
  // The URI wins over the environment.
  ASSERT_OK_AND_ASSIGN(const S3TransportConfig from_uri,
                       Parse(Uri("refit-test-bucket", "region=eu-west-3")));
  EXPECT_EQ(from_uri.client.region, "eu-west-3");
}

TEST_F(S3LayoutTest, ParsesEveryParameter) {
  ScopedEnv token(kSessionTokenVar, "session-token-value");
  ScopedEnv mac(kMacKeyVar, "payload-mac-secret");
  ScopedEnv api(kApiKeyVar, "control-plane-secret");
  const std::string uri = fmt::format(
      "s3://{}/fleet?endpoint=http://s3.example.test:9000&region=eu-central-1&addressing=virtual"
      "&access_key_env={}&secret_key_env={}&session_token_env={}&part_size={}"
      "&parts_in_flight=3&chain=1&retain=4&mac_key_env={}&api_key_env={}&timeout_ms=1500"
      "&retries=7&control_ca_cert=/etc/refit/control-ca.pem",
      kBucket, kAccessKeyVar, kSecretKeyVar, kSessionTokenVar, 2 * kFiveMiB, kMacKeyVar,
      kApiKeyVar);
  ASSERT_OK_AND_ASSIGN(const S3TransportConfig config, Parse(uri));
  EXPECT_EQ(config.client.endpoint, "http://s3.example.test:9000");
  EXPECT_EQ(config.client.region, "eu-central-1");
  EXPECT_EQ(config.client.addressing, S3Addressing::kVirtualHost);
  EXPECT_EQ(config.client.credentials.access_key_id, kAccessKey);
  EXPECT_EQ(config.client.credentials.secret_access_key, kSecretKey);
  EXPECT_EQ(config.client.credentials.session_token, "session-token-value");
  EXPECT_EQ(config.transfer.part_size, 2 * kFiveMiB);
  EXPECT_EQ(config.transfer.max_parts_in_flight, 3u);
  EXPECT_TRUE(config.chain);
  EXPECT_EQ(config.retain_versions, 4u);
  EXPECT_EQ(config.mac_key, "payload-mac-secret");
  EXPECT_EQ(config.api_key, "control-plane-secret");
  EXPECT_EQ(config.manifest_timeout, std::chrono::milliseconds(1500));
  EXPECT_EQ(config.client.max_retries, 7);
  EXPECT_EQ(config.manifest_retries, 7);
  EXPECT_EQ(config.control_ca_cert, "/etc/refit/control-ca.pem");
  // Secrets are read from the environment; the shown URI names only the variables.
  EXPECT_EQ(config.shown_uri.find("payload-mac-secret"), std::string::npos) << config.shown_uri;
  EXPECT_EQ(config.shown_uri.find(kSecretKey), std::string::npos) << config.shown_uri;

  ASSERT_OK_AND_ASSIGN(const S3TransportConfig path,
                       Parse(Uri("refit-test-bucket", "addressing=path")));
  EXPECT_EQ(path.client.addressing, S3Addressing::kPath);
  // Exactly the smallest part S3 allows is accepted.
  ASSERT_OK_AND_ASSIGN(const S3TransportConfig smallest,
                       Parse(Uri("refit-test-bucket", fmt::format("part_size={}", kFiveMiB))));
  EXPECT_EQ(smallest.transfer.part_size, kFiveMiB);
  ASSERT_OK_AND_ASSIGN(const S3TransportConfig chain_only,
                       Parse(Uri("refit-test-bucket", "chain=1")));
  EXPECT_TRUE(chain_only.chain);
  EXPECT_EQ(chain_only.retain_versions, 0u);
  ASSERT_OK_AND_ASSIGN(const S3TransportConfig no_chain,
                       Parse(Uri("refit-test-bucket", "chain=0")));
  EXPECT_FALSE(no_chain.chain);
}

TEST_F(S3LayoutTest, RefusesBadParametersNamingThem) {
  struct Case {
    std::string uri;
    std::string named;
  };
  const std::vector<Case> cases = {
      {Uri("refit-test-bucket/p", "bucket_region=us-east-1"), "bucket_region"},
      {Uri("refit-test-bucket/p", "addressing=dns"), "dns"},
      {Uri("refit-test-bucket/p", fmt::format("part_size={}", kFiveMiB - 1)), "part_size"},
      {Uri("refit-test-bucket/p", "part_size=lots"), "part_size"},
      {Uri("refit-test-bucket/p", "parts_in_flight=0"), "parts_in_flight"},
      {Uri("refit-test-bucket/p", "parts_in_flight=-1"), "parts_in_flight"},
      {Uri("refit-test-bucket/p", "chain=2"), "chain"},
      {Uri("refit-test-bucket/p", "chain=yes"), "chain"},
      {Uri("refit-test-bucket/p", "retain=3"), "retain"},
      {Uri("refit-test-bucket/p", "chain=0&retain=3"), "retain"},
      {Uri("refit-test-bucket/p", "timeout_ms=0"), "timeout_ms"},
      {Uri("refit-test-bucket/p", "retries=many"), "retries"},
      {Uri("refit-test-bucket/p", fmt::format("mac_key_env={}", kUnsetVar)), kUnsetVar},
      {Uri("refit-test-bucket/p", fmt::format("api_key_env={}", kUnsetVar)), kUnsetVar},
      {Uri("refit-test-bucket/p", fmt::format("session_token_env={}", kUnsetVar)), kUnsetVar},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.uri);
    EXPECT_STATUS_MSG(InvalidArgument, c.named, Parse(c.uri));
  }
}

TEST_F(S3LayoutTest, RefusesAUriWithoutABucket) {
  for (std::string_view target : {"", "/prefix/only"}) {
    SCOPED_TRACE(target);
    EXPECT_STATUS_MSG(InvalidArgument, "bucket", Parse(Uri(target)));
  }
}

TEST_F(S3LayoutTest, RefusesWhatTheClientRefusesNamingTheUri) {
  // A bucket name S3 does not allow, and an endpoint without a scheme.
  EXPECT_STATUS_MSG(InvalidArgument, "s3://", Parse(Uri("Refit_Bucket/p")));
  EXPECT_STATUS_MSG(
      InvalidArgument, "s3://",
      Parse(fmt::format("s3://{}/p?endpoint=localhost:9000&access_key_env={}&secret_key_env={}",
                        kBucket, kAccessKeyVar, kSecretKeyVar)));
}

TEST_F(S3LayoutTest, UnsetCredentialVariablesAreRefusedByName) {
  for (const char* param : {"access_key_env", "secret_key_env"}) {
    SCOPED_TRACE(param);
    const std::string other = std::string_view(param) == "access_key_env"
                                  ? fmt::format("secret_key_env={}", kSecretKeyVar)
                                  : fmt::format("access_key_env={}", kAccessKeyVar);
    const std::string uri = fmt::format("s3://{}/p?endpoint={}&{}={}&{}", kBucket, kClosedEndpoint,
                                        param, kUnsetVar, other);
    EXPECT_STATUS_MSG(InvalidArgument, kUnsetVar, Parse(uri));
  }
  // Set but empty is as good as unset.
  ScopedEnv empty(kAccessKeyVar, "");
  EXPECT_STATUS_MSG(InvalidArgument, kAccessKeyVar, Parse(Uri("refit-test-bucket/p")));
}

TEST_F(S3LayoutTest, CredentialsDefaultToTheAwsVariables) {
  // Process-local values, restored afterwards: the machine's own settings play no part.
  ScopedEnv access("AWS_ACCESS_KEY_ID", "AKIDDEFAULTVARIABLE");
  ScopedEnv secret("AWS_SECRET_ACCESS_KEY", "default-variable-secret");
  ScopedEnv token("AWS_SESSION_TOKEN", "default-variable-token");
  const std::string uri = fmt::format("s3://{}/p?endpoint={}", kBucket, kClosedEndpoint);
  ASSERT_OK_AND_ASSIGN(const S3TransportConfig config, Parse(uri));
  EXPECT_EQ(config.client.credentials.access_key_id, "AKIDDEFAULTVARIABLE");
  EXPECT_EQ(config.client.credentials.secret_access_key, "default-variable-secret");
  EXPECT_EQ(config.client.credentials.session_token, "default-variable-token");
  {
    // The session token is optional; the key pair is not.
    ScopedEnv no_token("AWS_SESSION_TOKEN", std::nullopt);
    ASSERT_OK_AND_ASSIGN(const S3TransportConfig without_token, Parse(uri));
    EXPECT_TRUE(without_token.client.credentials.session_token.empty());
  }
  ScopedEnv no_secret("AWS_SECRET_ACCESS_KEY", std::nullopt);
  EXPECT_STATUS_MSG(InvalidArgument, "AWS_SECRET_ACCESS_KEY", Parse(uri));
}

TEST_F(S3LayoutTest, PrefixSlashesAreStripped) {
  struct Case {
    std::string target;
    std::string prefix;
  };
  const std::vector<Case> cases = {
      {"refit-test-bucket", ""},
      {"refit-test-bucket/", ""},
      {"refit-test-bucket///", ""},
      {"refit-test-bucket/fleet", "fleet"},
      {"refit-test-bucket//fleet/", "fleet"},
      {"refit-test-bucket/a/b/c//", "a/b/c"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.target);
    ASSERT_OK_AND_ASSIGN(const S3TransportConfig config, Parse(Uri(c.target)));
    EXPECT_EQ(config.client.bucket, kBucket);
    EXPECT_EQ(config.prefix, c.prefix);
  }
}

// ---- Keys -------------------------------------------------------------------------------------

TEST_F(S3LayoutTest, KeysDeriveFromIdsUnderThePrefix) {
  const TransferId id = FixedTransferId();
  const std::string hex = "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf";
  ASSERT_EQ(id.ToHex(), hex);
  ASSERT_OK_AND_ASSIGN(const S3TransportConfig config, Parse(Uri("refit-test-bucket/fleet/a/")));
  EXPECT_EQ(PayloadObjectKey(config, /*chain=*/false, id, 2, 3),
            "fleet/a/live/" + hex + "/000002/000003.rfpl");
  EXPECT_EQ(PayloadObjectKey(config, /*chain=*/true, id, 2, 3),
            "fleet/a/chain/" + hex + "/000002/000003.rfpl");
  // Ids wider than six digits are written in full, never truncated.
  EXPECT_EQ(PayloadObjectKey(config, /*chain=*/false, id, UINT32_MAX, 1234567),
            "fleet/a/live/" + hex + "/4294967295/1234567.rfpl");
  EXPECT_EQ(TransferObjectPrefix(config, /*chain=*/false, id), "fleet/a/live/" + hex + "/");
  EXPECT_EQ(TransferObjectPrefix(config, /*chain=*/true, id), "fleet/a/chain/" + hex + "/");
  EXPECT_EQ(ChainObjectPrefix(config), "fleet/a/chain/");
  EXPECT_EQ(ChainIndexKey(config), "fleet/a/chain/index.json");
  // Every payload key lies under its transfer's prefix (what an abort deletes).
  EXPECT_TRUE(PayloadObjectKey(config, false, id, 0, 0)
                  .starts_with(TransferObjectPrefix(config, false, id)));
}

TEST_F(S3LayoutTest, AnEmptyPrefixPutsKeysAtTheBucketRoot) {
  const TransferId id = FixedTransferId();
  const std::string hex = id.ToHex();
  ASSERT_OK_AND_ASSIGN(const S3TransportConfig config, Parse(Uri("refit-test-bucket/")));
  EXPECT_EQ(PayloadObjectKey(config, false, id, 2, 3), "live/" + hex + "/000002/000003.rfpl");
  EXPECT_EQ(PayloadObjectKey(config, true, id, 0, 0), "chain/" + hex + "/000000/000000.rfpl");
  EXPECT_EQ(TransferObjectPrefix(config, false, id), "live/" + hex + "/");
  EXPECT_EQ(ChainObjectPrefix(config), "chain/");
  EXPECT_EQ(ChainIndexKey(config), "chain/index.json");
}

// ---- Checksums and MACs -----------------------------------------------------------------------

TEST(S3ChecksumTest, ObjectChecksumIsCanonicalXxh3_128) {
  for (std::string_view text : {std::string_view(""), std::string_view("refit payload bytes")}) {
    SCOPED_TRACE(text);
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits(text.data(), text.size()));
    std::array<uint8_t, 16> expected;
    std::memcpy(expected.data(), canonical.digest, expected.size());
    EXPECT_EQ(ObjectChecksum(AsBytes(text)), expected);
  }
  EXPECT_NE(ObjectChecksum(AsBytes("abc")), ObjectChecksum(AsBytes("abd")));
}

TEST(S3ChecksumTest, HexRoundTrips) {
  std::array<uint8_t, 16> checksum;
  for (size_t i = 0; i < checksum.size(); ++i) checksum[i] = static_cast<uint8_t>(i * 0x11);
  const std::string hex = ChecksumToHex(checksum);
  EXPECT_EQ(hex, "00112233445566778899aabbccddeeff");
  ASSERT_OK_AND_ASSIGN(const auto parsed, ChecksumFromHex(hex, "test checksum"));
  EXPECT_EQ(parsed, checksum);
  const std::array<uint8_t, 16> real = ObjectChecksum(AsBytes("payload"));
  ASSERT_OK_AND_ASSIGN(const auto real_parsed, ChecksumFromHex(ChecksumToHex(real), "real"));
  EXPECT_EQ(real_parsed, real);
}

TEST(S3ChecksumTest, MalformedHexIsRefusedNamingTheThing) {
  const std::string good = "00112233445566778899aabbccddeeff";
  for (const std::string& bad :
       {std::string(""), good.substr(1), good + "0", good.substr(0, 30) + "fg",
        std::string("0x") + good.substr(2), std::string("00112233445566778899AABBCCDDEEFF"),
        good.substr(0, 31) + " "}) {
    SCOPED_TRACE(bad);
    EXPECT_STATUS_MSG(InvalidArgument, "manifest checksum",
                      ChecksumFromHex(bad, "manifest checksum"));
  }
}

TEST(S3MacTest, MacHexMatchesRfc4231TestCase2) {
  EXPECT_EQ(MacHex("Jefe", AsBytes("what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(S3MacTest, VerifyMacRefusesMissingAndWrongMacs) {
  constexpr std::string_view kKey = "shared mac key";
  const std::span<const std::byte> bytes = AsBytes("payload bytes");
  const std::string mac = MacHex(kKey, bytes);
  ASSERT_EQ(mac.size(), 64u);
  EXPECT_OK(VerifyMac(kKey, bytes, mac, "payload object x"));
  EXPECT_STATUS_MSG(PermissionDenied, "payload object x",
                    VerifyMac(kKey, bytes, "", "payload object x"));
  // One digit changed, the MAC of other bytes, under another key, truncated, extended.
  std::string flipped = mac;
  flipped[10] = flipped[10] == '0' ? '1' : '0';
  for (const std::string& wrong : {flipped, MacHex(kKey, AsBytes("other bytes")),
                                   MacHex("other key", bytes), mac.substr(0, 63), mac + "0"}) {
    SCOPED_TRACE(wrong);
    EXPECT_STATUS_MSG(PermissionDenied, "payload object x",
                      VerifyMac(kKey, bytes, wrong, "payload object x"));
  }
}

// ---- Manifests --------------------------------------------------------------------------------

PayloadManifest SampleManifest() {
  PayloadManifest manifest;
  manifest.transfer_id = FixedTransferId();
  manifest.producer_id = 4;
  manifest.payload_id = 17;
  manifest.key = "fleet/live/" + manifest.transfer_id.ToHex() + "/000004/000017.rfpl";
  manifest.size = uint64_t{9} << 32;  // Beyond 32 bits: sizes are 64-bit.
  manifest.checksum = ObjectChecksum(AsBytes("payload"));
  return manifest;
}

void ExpectSameManifest(const PayloadManifest& got, const PayloadManifest& want) {
  EXPECT_EQ(got.transfer_id, want.transfer_id);
  EXPECT_EQ(got.producer_id, want.producer_id);
  EXPECT_EQ(got.payload_id, want.payload_id);
  EXPECT_EQ(got.key, want.key);
  EXPECT_EQ(got.size, want.size);
  EXPECT_EQ(got.checksum, want.checksum);
  EXPECT_EQ(got.mac, want.mac);
}

TEST(S3ManifestTest, JsonRoundTripsWithAndWithoutMac) {
  PayloadManifest manifest = SampleManifest();
  ASSERT_OK_AND_ASSIGN(const PayloadManifest plain, ManifestFromJson(ManifestToJson(manifest)));
  ExpectSameManifest(plain, manifest);
  EXPECT_FALSE(json::parse(ManifestToJson(manifest)).contains("mac"));

  manifest.mac = MacHex("key", AsBytes("payload"));
  manifest.producer_id = UINT32_MAX;
  manifest.payload_id = UINT32_MAX;
  manifest.size = UINT64_MAX;
  ASSERT_OK_AND_ASSIGN(const PayloadManifest with_mac, ManifestFromJson(ManifestToJson(manifest)));
  ExpectSameManifest(with_mac, manifest);
}

TEST(S3ManifestTest, MalformedManifestsAreRefused) {
  const json good = json::parse(ManifestToJson(SampleManifest()));
  ASSERT_OK(ManifestFromJson(good.dump()));
  struct Case {
    std::string name;
    std::string text;
  };
  std::vector<Case> cases = {
      {"not JSON", "{\"transfer_id\": "},
      {"empty", ""},
      {"an array", json::array({good}).dump()},
      {"a string", "\"manifest\""},
  };
  auto mutated = [&](std::string name, auto&& change) {
    json body = good;
    change(body);
    cases.push_back({std::move(name), body.dump()});
  };
  mutated("unknown field", [](json& b) { b["bucket"] = "other"; });
  for (const char* field :
       {"transfer_id", "producer_id", "payload_id", "key", "size", "checksum"}) {
    mutated(fmt::format("missing {}", field), [&](json& b) { b.erase(field); });
  }
  mutated("transfer_id a number", [](json& b) { b["transfer_id"] = 7; });
  mutated("producer_id a string", [](json& b) { b["producer_id"] = "4"; });
  mutated("producer_id negative", [](json& b) { b["producer_id"] = -1; });
  mutated("producer_id fractional", [](json& b) { b["producer_id"] = 1.5; });
  mutated("producer_id > UINT32_MAX", [](json& b) { b["producer_id"] = uint64_t{UINT32_MAX} + 1; });
  mutated("payload_id > UINT32_MAX", [](json& b) { b["payload_id"] = uint64_t{UINT32_MAX} + 1; });
  mutated("key a number", [](json& b) { b["key"] = 1; });
  mutated("size a string", [](json& b) { b["size"] = "9"; });
  mutated("size negative", [](json& b) { b["size"] = -9; });
  mutated("checksum a number", [](json& b) { b["checksum"] = 0; });
  mutated("mac a number", [](json& b) { b["mac"] = 5; });
  mutated("transfer_id short", [](json& b) { b["transfer_id"] = "a0a1a2"; });
  mutated("transfer_id not hex",
          [](json& b) { b["transfer_id"] = "zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz"; });
  mutated("checksum short", [](json& b) { b["checksum"] = "0011"; });
  mutated("checksum not hex", [](json& b) { b["checksum"] = "0011223344556677889900112233445g"; });
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_STATUS(InvalidArgument, ManifestFromJson(c.text));
  }
}

TEST(S3ManifestTest, OversizeManifestsAreRefused) {
  PayloadManifest manifest = SampleManifest();
  // A long key keeps a manifest valid; a megabyte is no manifest this library writes.
  manifest.key = std::string(1024, 'k');
  ASSERT_OK(ManifestFromJson(ManifestToJson(manifest)));
  manifest.key = std::string(size_t{1} << 20, 'k');
  EXPECT_STATUS_MSG(InvalidArgument, "bytes", ManifestFromJson(ManifestToJson(manifest)));
}

// ---- The s3:// transport ----------------------------------------------------------------------

/// A sink that counts deliveries and accepts everything.
class CountingSink final : public PayloadSink {
 public:
  Result<StageResult> Deliver(ValidatedPayload, std::stop_token) override {
    ++delivered;
    return StageResult::kAccepted;
  }
  std::atomic<int> delivered{0};
};

ListenerContext ListenerAt(std::string endpoint) {
  ListenerContext context;
  context.endpoint = std::move(endpoint);
  return context;
}

SenderContext SampleSenderContext(std::vector<std::string> endpoints) {
  SenderContext context;
  context.transfer_id = FixedTransferId();
  context.producer_id = 1;
  context.base_version = 3;
  context.target_version = 4;
  context.endpoints = std::move(endpoints);
  return context;
}

TEST_F(S3LayoutTest, TransportIsRegisteredWithManifestCapabilities) {
  const std::vector<std::string> schemes = DefaultTransportRegistry().Schemes();
  EXPECT_NE(std::find(schemes.begin(), schemes.end(), "s3"), schemes.end());
  ASSERT_OK_AND_ASSIGN(auto transport, MakeTransport(Uri("refit-test-bucket/fleet")));
  const TransportCapabilities caps = transport->capabilities();
  EXPECT_TRUE(caps.staged_ack);
  EXPECT_TRUE(caps.needs_manifest);
  EXPECT_FALSE(caps.fan_out_tree);
  EXPECT_FALSE(caps.in_process);
  EXPECT_FALSE(caps.shared_filesystem);
  EXPECT_EQ(transport->uri().scheme, "s3");
  // The factory validates the URI like ParseS3TransportUri.
  EXPECT_STATUS(InvalidArgument, MakeTransport(Uri("refit-test-bucket/fleet", "chain=2")));
  EXPECT_STATUS_MSG(InvalidArgument, kUnsetVar,
                    MakeTransport(fmt::format("s3://{}/p?access_key_env={}&secret_key_env={}",
                                              kBucket, kUnsetVar, kSecretKeyVar)));
}

TEST_F(S3LayoutTest, SendersNeedAnAnnouncer) {
  ASSERT_OK_AND_ASSIGN(auto transport, MakeTransport(Uri("refit-test-bucket/fleet")));
  EXPECT_STATUS_MSG(FailedPrecondition, "manifest_announcers",
                    transport->MakeSender(SampleSenderContext({"http://127.0.0.1:1"})));
}

TEST_F(S3LayoutTest, SendersNeedControlPlaneUrls) {
  TransportOptions options;
  options.manifest_announcers = MakeControlManifestAnnouncers({});
  ASSERT_OK_AND_ASSIGN(auto transport, MakeTransport(Uri("refit-test-bucket/fleet"), options));
  for (const char* endpoint : {"127.0.0.1:8080", "zmq://127.0.0.1:5555", "inbox", "ftp://host"}) {
    SCOPED_TRACE(endpoint);
    EXPECT_STATUS_MSG(InvalidArgument, endpoint,
                      transport->MakeSender(SampleSenderContext({"http://127.0.0.1:1", endpoint})));
  }
  EXPECT_STATUS(InvalidArgument, transport->MakeSender(SampleSenderContext({})));
  EXPECT_OK(transport->MakeSender(
      SampleSenderContext({"http://127.0.0.1:1", "https://receiver.example.test:8443/"})));
}

TEST_F(S3LayoutTest, ListenersBindNothingAndRelayNothing) {
  ASSERT_OK_AND_ASSIGN(auto transport, MakeTransport(Uri("refit-test-bucket/fleet")));
  CountingSink sink;
  EXPECT_STATUS(
      InvalidArgument,
      transport->MakeListener(ListenerContext{"receiver-0", {"receiver-0", "receiver-1"}}, sink));
  EXPECT_STATUS(InvalidArgument,
                transport->MakeListener(ListenerContext{"receiver-0", {}, "0.0.0.0"}, sink));
  ASSERT_OK_AND_ASSIGN(auto listener, transport->MakeListener(ListenerAt("receiver-0"), sink));
  EXPECT_EQ(listener->endpoint(), "receiver-0");
}

TEST_F(S3LayoutTest, ListenerTakesManifestsOnlyWhileRunning) {
  ASSERT_OK_AND_ASSIGN(auto transport, MakeTransport(Uri("refit-test-bucket/fleet")));
  CountingSink sink;
  ASSERT_OK_AND_ASSIGN(auto listener, transport->MakeListener(ListenerAt("receiver-0"), sink));
  const std::string manifest = ManifestToJson(SampleManifest());
  EXPECT_STATUS(Unavailable, listener->AcceptManifest(manifest, {}));
  ASSERT_OK(listener->Start());
  EXPECT_STATUS(FailedPrecondition, listener->Start());
  listener->Stop();
  EXPECT_STATUS(Unavailable, listener->AcceptManifest(manifest, {}));
  EXPECT_EQ(sink.delivered, 0);
}

TEST_F(S3LayoutTest, ListenerRefusesKeysNotDerivedFromIdsBeforeAnyRequest) {
  ASSERT_OK_AND_ASSIGN(auto transport, MakeTransport(Uri("refit-test-bucket/fleet")));
  ASSERT_OK_AND_ASSIGN(S3TransportConfig config, Parse(Uri("refit-test-bucket/fleet")));
  CountingSink sink;
  ASSERT_OK_AND_ASSIGN(auto listener, transport->MakeListener(ListenerAt("receiver-0"), sink));
  ASSERT_OK(listener->Start());

  PayloadManifest manifest = SampleManifest();
  const TransferId id = manifest.transfer_id;
  TransferId other_id = id;
  other_id.bytes[0] ^= 1;
  const std::string live_key =
      PayloadObjectKey(config, false, id, manifest.producer_id, manifest.payload_id);
  // The endpoint is a closed port: a manifest that reached S3 would fail with Unavailable, so
  // InvalidArgument proves the key was refused before any request.
  for (const std::string& key :
       {std::string("fleet/chain/index.json"),
        PayloadObjectKey(config, false, other_id, manifest.producer_id, manifest.payload_id),
        PayloadObjectKey(config, false, id, manifest.producer_id + 1, manifest.payload_id),
        PayloadObjectKey(config, false, id, manifest.producer_id, manifest.payload_id + 1),
        "other/" + live_key, "/" + live_key, live_key + "/../../secret", std::string("")}) {
    SCOPED_TRACE(key);
    manifest.key = key;
    EXPECT_STATUS(InvalidArgument, listener->AcceptManifest(ManifestToJson(manifest), {}));
  }
  EXPECT_STATUS(InvalidArgument, listener->AcceptManifest("{\"not\": \"a manifest\"}", {}));
  EXPECT_EQ(sink.delivered, 0);
  const ListenerStats refused = listener->stats();
  EXPECT_EQ(refused.failures, 9u);
  EXPECT_EQ(refused.last_error.code(), StatusCode::kInvalidArgument);

  // The derived keys (live and chain) pass the check and reach the (closed) endpoint.
  for (bool chain : {false, true}) {
    SCOPED_TRACE(chain);
    manifest.key = PayloadObjectKey(config, chain, id, manifest.producer_id, manifest.payload_id);
    manifest.size = 64;
    EXPECT_STATUS(Unavailable, listener->AcceptManifest(ManifestToJson(manifest), {}));
  }
  EXPECT_EQ(sink.delivered, 0);
  listener->Stop();
}

TEST(S3TransportTest, ListenersOfOtherTransportsTakeNoManifests) {
  ASSERT_OK_AND_ASSIGN(auto transport, MakeTransport("inproc://s3-layout-test-hub"));
  EXPECT_FALSE(transport->capabilities().needs_manifest);
  CountingSink sink;
  ASSERT_OK_AND_ASSIGN(auto listener, transport->MakeListener(ListenerAt("receiver-0"), sink));
  ASSERT_OK(listener->Start());
  EXPECT_STATUS(FailedPrecondition, listener->AcceptManifest(ManifestToJson(SampleManifest()), {}));
  EXPECT_EQ(sink.delivered, 0);
  listener->Stop();
}

}  // namespace
}  // namespace refit::internal
