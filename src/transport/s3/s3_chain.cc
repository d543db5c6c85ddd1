#include "transport/s3/s3_chain.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/digest.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "transport/s3/s3_chain_internal.h"
#include "transport/s3/s3_client.h"
#include "transport/s3/s3_layout.h"
#include "transport/transport_internal.h"
#include "util/logging.h"

namespace refit {
namespace {

using Json = nlohmann::json;
using internal::Printable;

constexpr std::string_view kChainFormat = "refit-chain/1";
// An index lists a few hundred bytes per payload; even a long chain of a large model stays far
// below this, and a larger object is not an index this library wrote.
constexpr uint64_t kMaxIndexBytes = uint64_t{256} << 20;

std::string DigestHex(uint64_t digest) { return fmt::format("{:016x}", digest); }

Json VersionToJson(const ChainVersion& version) {
  Json payloads = Json::array();
  for (const ChainPayload& p : version.payloads) {
    Json entry{{"key", p.key},
               {"producer_id", p.producer_id},
               {"payload_id", p.payload_id},
               {"size", p.size},
               {"checksum", internal::ChecksumToHex(p.checksum)}};
    if (!p.mac.empty()) entry["mac"] = p.mac;
    payloads.push_back(std::move(entry));
  }
  return Json{{"version", version.version},
              {"base_version", version.base_version},
              {"anchor", version.anchor},
              {"transfer_id", version.transfer_id.ToHex()},
              {"state_fingerprint", DigestHex(version.state_fingerprint)},
              {"payloads", std::move(payloads)}};
}

// Typed access to an untrusted JSON object; every error is DataLoss naming the object.
class Fields {
 public:
  Fields(const Json& json, std::string where) : json_(json), where_(std::move(where)) {}

  Result<const Json*> Get(const char* name) const {
    if (!json_.is_object()) return DataLoss("{} is not a JSON object", where_);
    auto it = json_.find(name);
    if (it == json_.end()) return DataLoss("{} lacks '{}'", where_, name);
    return &*it;
  }
  Result<uint64_t> Uint(const char* name, uint64_t max = UINT64_MAX) const {
    REFIT_ASSIGN_OR_RETURN(const Json* value, Get(name));
    if (!value->is_number_unsigned() || value->get<uint64_t>() > max) {
      return DataLoss("{} '{}' is not an integer in [0, {}]", where_, name, max);
    }
    return value->get<uint64_t>();
  }
  Result<std::string> String(const char* name) const {
    REFIT_ASSIGN_OR_RETURN(const Json* value, Get(name));
    if (!value->is_string()) return DataLoss("{} '{}' is not a string", where_, name);
    return value->get<std::string>();
  }
  Result<bool> Bool(const char* name) const {
    REFIT_ASSIGN_OR_RETURN(const Json* value, Get(name));
    if (!value->is_boolean()) return DataLoss("{} '{}' is not a boolean", where_, name);
    return value->get<bool>();
  }
  const std::string& where() const { return where_; }

 private:
  const Json& json_;
  std::string where_;
};

// Parse a hex field; a malformed one is DataLoss (the index is corrupt), not a caller's error.
template <typename T>
Result<T> AsDataLoss(Result<T> parsed, std::string_view where) {
  if (parsed.ok()) return parsed;
  return DataLoss("{}: {}", where, parsed.status().message());
}

Result<ChainVersion> VersionFromJson(const Json& json, const std::string& where) {
  const Fields fields(json, where);
  ChainVersion version;
  REFIT_ASSIGN_OR_RETURN(version.version, fields.Uint("version"));
  REFIT_ASSIGN_OR_RETURN(version.base_version, fields.Uint("base_version"));
  REFIT_ASSIGN_OR_RETURN(version.anchor, fields.Bool("anchor"));
  REFIT_ASSIGN_OR_RETURN(const std::string transfer, fields.String("transfer_id"));
  REFIT_ASSIGN_OR_RETURN(version.transfer_id, AsDataLoss(TransferId::FromHex(transfer), where));
  REFIT_ASSIGN_OR_RETURN(const std::string fingerprint, fields.String("state_fingerprint"));
  if (fingerprint.size() != 16 ||
      fingerprint.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return DataLoss("{} state_fingerprint '{}' is not 16 hex digits", where,
                    Printable(fingerprint));
  }
  version.state_fingerprint = std::stoull(fingerprint, nullptr, 16);
  REFIT_ASSIGN_OR_RETURN(const Json* payloads, fields.Get("payloads"));
  if (!payloads->is_array()) return DataLoss("{} 'payloads' is not an array", where);
  for (size_t i = 0; i < payloads->size(); ++i) {
    const Fields entry((*payloads)[i], fmt::format("{} payload {}", where, i));
    ChainPayload payload;
    REFIT_ASSIGN_OR_RETURN(payload.key, entry.String("key"));
    REFIT_ASSIGN_OR_RETURN(const uint64_t producer, entry.Uint("producer_id", UINT32_MAX));
    REFIT_ASSIGN_OR_RETURN(const uint64_t id, entry.Uint("payload_id", UINT32_MAX));
    payload.producer_id = static_cast<uint32_t>(producer);
    payload.payload_id = static_cast<uint32_t>(id);
    REFIT_ASSIGN_OR_RETURN(payload.size, entry.Uint("size"));
    REFIT_ASSIGN_OR_RETURN(const std::string checksum, entry.String("checksum"));
    REFIT_ASSIGN_OR_RETURN(
        payload.checksum,
        AsDataLoss(internal::ChecksumFromHex(checksum, "checksum"), entry.where()));
    if ((*payloads)[i].contains("mac")) {
      REFIT_ASSIGN_OR_RETURN(payload.mac, entry.String("mac"));
    }
    // One entry per payload, in (producer, payload) order: a repeated entry would make a replay
    // wait for a payload that never comes.
    if (!version.payloads.empty() &&
        std::pair(version.payloads.back().producer_id, version.payloads.back().payload_id) >=
            std::pair(payload.producer_id, payload.payload_id)) {
      return DataLoss("{}: payloads are not in (producer, payload) order or repeat one", where);
    }
    version.payloads.push_back(std::move(payload));
  }
  return version;
}

// The payload counts per producer a version declares, checked to be ids 0 … n − 1.
Result<std::pair<internal::S3TransportConfig, std::unique_ptr<S3Client>>> OpenChain(
    std::string_view s3_uri) {
  REFIT_ASSIGN_OR_RETURN(const TransportUri uri, TransportUri::Parse(s3_uri));
  if (uri.scheme != "s3") {
    return InvalidArgument("'{}' is not an s3:// URI", Printable(s3_uri));
  }
  REFIT_ASSIGN_OR_RETURN(internal::S3TransportConfig config, internal::ParseS3TransportUri(uri));
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<S3Client> client, S3Client::Make(config.client));
  return std::pair(std::move(config), std::move(client));
}

Result<ChainIndex> ReadIndex(const internal::S3TransportConfig& config, S3Client& client) {
  const std::string key = internal::ChainIndexKey(config);
  Result<std::vector<std::byte>> text = client.GetObject(key, kMaxIndexBytes);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) {
      return NotFound(
          "no chain at s3://{}/{}: its index {} does not exist (is the trainer "
          "running with chain=1?)",
          config.client.bucket, config.prefix, key);
    }
    return text.status();
  }
  return ParseChainIndex(
      std::string_view(reinterpret_cast<const char*>(text->data()), text->size()), config.mac_key,
      fmt::format("chain index s3://{}/{}", config.client.bucket, key));
}

}  // namespace

namespace internal {

Result<OpenedChain> OpenAndReadChain(std::string_view s3_uri) {
  REFIT_ASSIGN_OR_RETURN(auto chain, OpenChain(s3_uri));
  REFIT_ASSIGN_OR_RETURN(ChainIndex index, ReadIndex(chain.first, *chain.second));
  return OpenedChain{std::move(chain.first), std::move(chain.second), std::move(index)};
}

}  // namespace internal

size_t ChainIndex::ActiveAnchor() const {
  for (size_t i = versions.size(); i > 0; --i) {
    if (versions[i - 1].anchor) return i - 1;
  }
  return versions.size();
}

std::string SerializeChainIndex(const ChainIndex& index, std::string_view mac_key) {
  Json versions = Json::array();
  for (const ChainVersion& version : index.versions) versions.push_back(VersionToJson(version));
  Json body{{"format", kChainFormat}, {"versions", std::move(versions)}};
  if (!mac_key.empty()) {
    const std::string signed_text = body.dump();
    body["mac"] = internal::MacHex(
        mac_key,
        std::span(reinterpret_cast<const std::byte*>(signed_text.data()), signed_text.size()));
  }
  return body.dump();
}

Result<ChainIndex> ParseChainIndex(std::string_view text, std::string_view mac_key,
                                   std::string_view where) {
  Json body = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    return DataLoss("{} is not a JSON object", where);
  }
  if (!mac_key.empty()) {
    std::string mac;
    if (auto it = body.find("mac"); it != body.end() && it->is_string()) {
      mac = it->get<std::string>();
      body.erase("mac");
    }
    const std::string signed_text = body.dump();
    REFIT_RETURN_NOT_OK(internal::VerifyMac(
        mac_key,
        std::span(reinterpret_cast<const std::byte*>(signed_text.data()), signed_text.size()), mac,
        where));
  }
  const Fields fields(body, std::string(where));
  REFIT_ASSIGN_OR_RETURN(const std::string format, fields.String("format"));
  if (format != kChainFormat) {
    return DataLoss("{} has format '{}', not '{}'", where, Printable(format), kChainFormat);
  }
  REFIT_ASSIGN_OR_RETURN(const Json* versions, fields.Get("versions"));
  if (!versions->is_array()) return DataLoss("{} 'versions' is not an array", where);
  ChainIndex index;
  for (size_t i = 0; i < versions->size(); ++i) {
    REFIT_ASSIGN_OR_RETURN(ChainVersion version,
                           VersionFromJson((*versions)[i], fmt::format("{} version {}", where, i)));
    Status appended = AppendChainVersion(index, std::move(version));
    if (!appended.ok()) return DataLoss("{} version {}: {}", where, i, appended.message());
  }
  return index;
}

Status AppendChainVersion(ChainIndex& index, ChainVersion version) {
  if (version.version != version.base_version + 1) {
    return FailedPrecondition("chain: version {} with base {}: a transfer advances one version",
                              version.version, version.base_version);
  }
  if (!version.anchor) {
    if (index.versions.empty()) {
      return FailedPrecondition("chain: delta version {} has no anchor before it", version.version);
    }
    if (version.base_version != index.versions.back().version) {
      return FailedPrecondition(
          "chain: delta version {} is based on {}, but the chain's newest version is {}",
          version.version, version.base_version, index.versions.back().version);
    }
  } else if (!index.versions.empty() && version.version <= index.versions.back().version) {
    return FailedPrecondition("chain: anchor version {} is not newer than the chain's {}",
                              version.version, index.versions.back().version);
  }
  index.versions.push_back(std::move(version));
  return Status::OK();
}

std::vector<ChainVersion> PruneChain(ChainIndex& index, uint64_t retain_versions) {
  const size_t n = index.versions.size();
  size_t cut = index.ActiveAnchor();
  if (cut == n) return {};
  if (retain_versions > 0) {
    // The oldest version retention wants, then back to the anchor it depends on.
    const size_t oldest = retain_versions >= n ? 0 : n - retain_versions;
    size_t anchor = oldest;
    while (anchor > 0 && !index.versions[anchor].anchor) --anchor;
    cut = std::min(cut, anchor);
  }
  std::vector<ChainVersion> pruned(std::make_move_iterator(index.versions.begin()),
                                   std::make_move_iterator(index.versions.begin() + cut));
  index.versions.erase(index.versions.begin(), index.versions.begin() + cut);
  return pruned;
}

Result<ChainIndex> ReadChainIndex(std::string_view s3_uri) {
  REFIT_ASSIGN_OR_RETURN(internal::OpenedChain chain, internal::OpenAndReadChain(s3_uri));
  return std::move(chain.index);
}

}  // namespace refit
