#include "control/protocol.h"

#include <algorithm>

#include <array>
#include <charconv>
#include <limits>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "refit/status_format.h"

namespace refit::internal {
namespace {

// HTTP status codes used by the control plane (RFC 9110).
constexpr int kHttpOk = 200;
constexpr int kHttpBadRequest = 400;
constexpr int kHttpUnauthorized = 401;
constexpr int kHttpForbidden = 403;
constexpr int kHttpNotFound = 404;
constexpr int kHttpConflict = 409;
constexpr int kHttpPayloadTooLarge = 413;
constexpr int kHttpUnprocessable = 422;
constexpr int kHttpTooManyRequests = 429;
constexpr int kHttpInternalError = 500;
constexpr int kHttpBadGateway = 502;
constexpr int kHttpServiceUnavailable = 503;
constexpr int kHttpGatewayTimeout = 504;

// Hex digits of a 64-bit digest.
constexpr size_t kDigestHexDigits = 16;

std::string_view JsonTypeName(const Json& value) { return value.type_name(); }

Result<ReceiverState> ParseReceiverState(std::string_view name) {
  for (ReceiverState state :
       {ReceiverState::kIdle, ReceiverState::kReceiving, ReceiverState::kPrepared}) {
    if (ReceiverStateName(state) == name) return state;
  }
  return InvalidArgument("status field 'state': unknown receiver state '{}'", name);
}

Result<uint32_t> ParseProducerId(std::string_view key, std::string_view where) {
  uint32_t id = 0;
  const auto [end, error] = std::from_chars(key.data(), key.data() + key.size(), id);
  if (key.empty() || error != std::errc() || end != key.data() + key.size()) {
    return InvalidArgument("{}: producer id '{}' is not a decimal integer in [0, {}]", where, key,
                           std::numeric_limits<uint32_t>::max());
  }
  return id;
}

}  // namespace

int HttpStatusFor(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return kHttpOk;
    case StatusCode::kInvalidArgument:
      return kHttpBadRequest;
    case StatusCode::kPermissionDenied:
      return kHttpForbidden;
    case StatusCode::kNotFound:
      return kHttpNotFound;
    case StatusCode::kFailedPrecondition:
    case StatusCode::kAlreadyExists:
      return kHttpConflict;
    case StatusCode::kDataLoss:
      return kHttpUnprocessable;
    // Every ResourceExhausted the control plane can return is a size or count limit of the
    // request itself (the session's Stage blocks rather than report a full queue), so 413.
    case StatusCode::kResourceExhausted:
      return kHttpPayloadTooLarge;
    case StatusCode::kDeadlineExceeded:
      return kHttpGatewayTimeout;
    case StatusCode::kUnavailable:
      return kHttpServiceUnavailable;
    case StatusCode::kCancelled:
    case StatusCode::kIoError:
    case StatusCode::kInternal:
      return kHttpInternalError;
  }
  return kHttpInternalError;
}

StatusCode StatusCodeForHttp(int http_status) {
  switch (http_status) {
    case kHttpBadRequest:
      return StatusCode::kInvalidArgument;
    case kHttpUnauthorized:
    case kHttpForbidden:
      return StatusCode::kPermissionDenied;
    case kHttpNotFound:
      return StatusCode::kNotFound;
    case kHttpConflict:
      return StatusCode::kFailedPrecondition;
    case kHttpPayloadTooLarge:
    case kHttpTooManyRequests:
      return StatusCode::kResourceExhausted;
    case kHttpUnprocessable:
      return StatusCode::kDataLoss;
    case kHttpBadGateway:
    case kHttpServiceUnavailable:
      return StatusCode::kUnavailable;
    case kHttpGatewayTimeout:
      return StatusCode::kDeadlineExceeded;
    default:
      return http_status >= kHttpBadRequest && http_status < kHttpInternalError
                 ? StatusCode::kInvalidArgument
                 : StatusCode::kInternal;
  }
}

std::string DumpJson(const Json& value) {
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

namespace {

// Return the deepest nesting of arrays and objects in `text` (strings skipped), stopping once it
// passes `limit`: one pass, no allocation. nlohmann's parser allocates a value per level, so a
// body of a million '[' would cost hundreds of megabytes (kept by the allocator) before it is
// found invalid.
size_t NestingDepth(std::string_view text, size_t limit) {
  size_t depth = 0;
  size_t deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size() && deepest <= limit; ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

}  // namespace

Result<Json> ParseJson(std::string_view text, std::string_view what) {
  if (const size_t depth = NestingDepth(text, kMaxJsonDepth); depth > kMaxJsonDepth) {
    return InvalidArgument("{} nests arrays and objects deeper than {} levels ({} bytes)", what,
                           kMaxJsonDepth, text.size());
  }
  Json value = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) {
    // The non-throwing parser does not report where it failed; say what was given instead.
    return InvalidArgument("{} is not valid JSON ({} bytes)", what, text.size());
  }
  return value;
}

Json ErrorBody(const Status& status) {
  return Json{{"ok", false},
              {"code", std::string(StatusCodeName(status.code()))},
              {"message", status.message()}};
}

std::string DigestToHex(uint64_t digest) { return fmt::format("{:016x}", digest); }

Result<uint64_t> DigestFromHex(std::string_view hex, std::string_view what) {
  uint64_t digest = 0;
  const auto [end, error] = std::from_chars(hex.data(), hex.data() + hex.size(), digest, 16);
  if (hex.size() != kDigestHexDigits || error != std::errc() || end != hex.data() + hex.size()) {
    return InvalidArgument("{}: digest '{}' is not {} hex digits", what, hex, kDigestHexDigits);
  }
  return digest;
}

std::string JsonFields::Name(std::string_view field) const {
  return fmt::format("{}.{}", where_, field);
}

Status JsonFields::CheckObject(std::span<const std::string_view> known) const {
  if (!object_.is_object()) {
    return InvalidArgument("{} must be a JSON object, got {}", where_, JsonTypeName(object_));
  }
  for (const auto& [key, value] : object_.items()) {
    bool is_known = false;
    for (std::string_view name : known) is_known = is_known || name == key;
    if (!is_known) return InvalidArgument("{}: unknown field '{}'", where_, key);
  }
  return Status::OK();
}

bool JsonFields::Has(std::string_view field) const { return Find(field) != nullptr; }

const Json* JsonFields::Find(std::string_view field) const {
  if (!object_.is_object()) return nullptr;
  const auto it = object_.find(field);
  return it == object_.end() || it->is_null() ? nullptr : &*it;
}

Result<const Json*> JsonFields::Require(std::string_view field) const {
  const Json* value = Find(field);
  if (value == nullptr) return InvalidArgument("{} is missing", Name(field));
  return value;
}

Result<std::string> JsonFields::String(std::string_view field) const {
  REFIT_ASSIGN_OR_RETURN(const Json* value, Require(field));
  if (!value->is_string()) {
    return InvalidArgument("{} must be a string, got {}", Name(field), JsonTypeName(*value));
  }
  return value->get<std::string>();
}

Result<uint64_t> JsonFields::Uint(std::string_view field) const {
  REFIT_ASSIGN_OR_RETURN(const Json* value, Require(field));
  if (!value->is_number_unsigned()) {
    return InvalidArgument("{} must be a non-negative integer, got {} {}", Name(field),
                           JsonTypeName(*value), DumpJson(*value));
  }
  return value->get<uint64_t>();
}

Result<std::optional<uint64_t>> JsonFields::OptionalUint(std::string_view field) const {
  if (!Has(field)) return std::optional<uint64_t>();
  REFIT_ASSIGN_OR_RETURN(uint64_t value, Uint(field));
  return std::optional<uint64_t>(value);
}

Result<bool> JsonFields::Bool(std::string_view field) const {
  REFIT_ASSIGN_OR_RETURN(const Json* value, Require(field));
  if (!value->is_boolean()) {
    return InvalidArgument("{} must be true or false, got {}", Name(field), JsonTypeName(*value));
  }
  return value->get<bool>();
}

Result<TransferId> JsonFields::Transfer(std::string_view field) const {
  REFIT_ASSIGN_OR_RETURN(std::string hex, String(field));
  Result<TransferId> id = TransferId::FromHex(hex);
  if (!id.ok()) return id.status().WithContext(Name(field));
  return id;
}

Result<std::optional<TransferId>> JsonFields::OptionalTransfer(std::string_view field) const {
  if (!Has(field)) return std::optional<TransferId>();
  REFIT_ASSIGN_OR_RETURN(TransferId id, Transfer(field));
  return std::optional<TransferId>(id);
}

Result<std::map<std::string, uint64_t>> JsonFields::Digests(std::string_view field) const {
  std::map<std::string, uint64_t> digests;
  const Json* value = Find(field);
  if (value == nullptr) return digests;
  if (!value->is_object()) {
    return InvalidArgument("{} must be an object of tensor name to hex digest, got {}", Name(field),
                           JsonTypeName(*value));
  }
  for (const auto& [name, hex] : value->items()) {
    const std::string where = fmt::format("{}['{}']", Name(field), name);
    if (!hex.is_string()) {
      return InvalidArgument("{} must be a hex string, got {}", where, JsonTypeName(hex));
    }
    REFIT_ASSIGN_OR_RETURN(digests[name], DigestFromHex(hex.get<std::string>(), where));
  }
  return digests;
}

void PutExpectation(const TransferExpectation& expected, Json& body) {
  Json counts = Json::object();
  if (!expected.payloads_per_producer.empty()) {
    Json producers = Json::object();
    for (const auto& [producer, count] : expected.payloads_per_producer) {
      producers[std::to_string(producer)] = count;
    }
    counts["producers"] = std::move(producers);
  }
  if (expected.total_payloads.has_value()) counts["total"] = *expected.total_payloads;
  if (!counts.empty()) body["expected"] = std::move(counts);
  if (!expected.digests.empty()) {
    Json digests = Json::object();
    for (const auto& [name, digest] : expected.digests) digests[name] = DigestToHex(digest);
    body["expected_digests"] = std::move(digests);
  }
}

void PutRelayTree(const RelayTree& tree, Json& body) {
  body["relay_tree"] = Json{{"endpoints", tree.endpoints}, {"position", tree.position}};
}

void PutLineage(const TransferLineage& lineage, Json& body) {
  if (lineage.run_id.empty() && lineage.base_fingerprint == 0) return;
  body["lineage"] = Json{{"run_id", lineage.run_id},
                         {"epoch", lineage.epoch},
                         {"base_fingerprint", DigestToHex(lineage.base_fingerprint)}};
}

Result<TransferLineage> GetLineage(const JsonFields& body) {
  TransferLineage lineage;
  const Json* value = body.Find("lineage");
  if (value == nullptr) return lineage;
  const JsonFields fields(*value, body.Name("lineage"));
  constexpr std::array<std::string_view, 3> kLineageFields = {"run_id", "epoch",
                                                              "base_fingerprint"};
  REFIT_RETURN_NOT_OK(fields.CheckObject(kLineageFields));
  REFIT_ASSIGN_OR_RETURN(lineage.run_id, fields.String("run_id"));
  if (lineage.run_id.size() > kMaxRunIdBytes) {
    return InvalidArgument("{} is {} bytes long, more than {}", fields.Name("run_id"),
                           lineage.run_id.size(), kMaxRunIdBytes);
  }
  REFIT_ASSIGN_OR_RETURN(lineage.epoch, fields.Uint("epoch"));
  REFIT_ASSIGN_OR_RETURN(const std::string hex, fields.String("base_fingerprint"));
  REFIT_ASSIGN_OR_RETURN(lineage.base_fingerprint,
                         DigestFromHex(hex, fields.Name("base_fingerprint")));
  return lineage;
}

Result<std::optional<RelayTree>> GetRelayTree(const JsonFields& body) {
  const Json* value = body.Find("relay_tree");
  if (value == nullptr) return std::optional<RelayTree>();
  const JsonFields fields(*value, body.Name("relay_tree"));
  constexpr std::array<std::string_view, 2> kTreeFields = {"endpoints", "position"};
  REFIT_RETURN_NOT_OK(fields.CheckObject(kTreeFields));
  const Json* endpoints = fields.Find("endpoints");
  const std::string where = fields.Name("endpoints");
  if (endpoints == nullptr) return InvalidArgument("{} is missing", where);
  if (!endpoints->is_array() || endpoints->empty() || endpoints->size() > kMaxRelayTreeEndpoints) {
    return InvalidArgument("{} must be a list of 1 to {} data endpoints, got {}{}", where,
                           kMaxRelayTreeEndpoints, JsonTypeName(*endpoints),
                           endpoints->is_array() ? fmt::format(" of {}", endpoints->size()) : "");
  }
  RelayTree tree;
  std::set<std::string_view> seen;
  for (size_t i = 0; i < endpoints->size(); ++i) {
    const Json& endpoint = (*endpoints)[i];
    if (!endpoint.is_string() || endpoint.get_ref<const std::string&>().empty()) {
      return InvalidArgument("{}[{}] must be a non-empty data endpoint, got {}", where, i,
                             DumpJson(endpoint));
    }
    const std::string& text = endpoint.get_ref<const std::string&>();
    if (!seen.insert(text).second) {
      return InvalidArgument("{} names '{}' twice: a relay would forward to it twice", where, text);
    }
    tree.endpoints.push_back(text);
  }
  REFIT_ASSIGN_OR_RETURN(const uint64_t position, fields.Uint("position"));
  if (position >= tree.endpoints.size()) {
    return InvalidArgument("{} is {}, not a position among its {} endpoints",
                           fields.Name("position"), position, tree.endpoints.size());
  }
  tree.position = static_cast<uint32_t>(position);
  return std::optional<RelayTree>(std::move(tree));
}

Result<std::vector<std::string>> GetRegionTensors(const JsonFields& body) {
  REFIT_ASSIGN_OR_RETURN(const Json* tensors, body.Require("tensors"));
  const std::string where = body.Name("tensors");
  if (!tensors->is_array() || tensors->size() > kMaxRegionTensors) {
    return InvalidArgument("{} must be a list of at most {} tensor names, got {}{}", where,
                           kMaxRegionTensors, JsonTypeName(*tensors),
                           tensors->is_array() ? fmt::format(" of {}", tensors->size()) : "");
  }
  std::vector<std::string> names;
  names.reserve(tensors->size());
  for (size_t i = 0; i < tensors->size(); ++i) {
    const Json& name = (*tensors)[i];
    if (!name.is_string() || name.get_ref<const std::string&>().empty()) {
      return InvalidArgument("{}[{}] must be a non-empty tensor name, got {}", where, i,
                             DumpJson(name));
    }
    names.push_back(name.get_ref<const std::string&>());
  }
  return names;
}

Json RegionsToJson(const HeldRegions& regions) {
  Json out = Json::object();
  for (const auto& [name, region] : regions) {
    Json rects = Json::array();
    for (const HeldRect& rect : region.rects) {
      rects.push_back(Json::array({rect.row_begin, rect.row_end, rect.col_begin, rect.col_end}));
    }
    out[name] = Json{{"skipped", region.skipped}, {"cols", region.cols}, {"rects", rects}};
  }
  return Json{{"regions", std::move(out)}};
}

Result<HeldRegions> RegionsFromJson(const Json& body) {
  const JsonFields reply(body, "regions reply");
  REFIT_ASSIGN_OR_RETURN(const Json* regions, reply.Require("regions"));
  if (!regions->is_object() || regions->size() > kMaxRegionTensors) {
    return InvalidArgument("{} must be an object of at most {} tensors, got {}",
                           reply.Name("regions"), kMaxRegionTensors, JsonTypeName(*regions));
  }
  HeldRegions out;
  for (const auto& [name, value] : regions->items()) {
    const JsonFields fields(value, fmt::format("{}.{}", reply.Name("regions"), name));
    constexpr std::array<std::string_view, 3> kRegionFields = {"skipped", "cols", "rects"};
    REFIT_RETURN_NOT_OK(fields.CheckObject(kRegionFields));
    HeldRegion region;
    REFIT_ASSIGN_OR_RETURN(region.skipped, fields.Bool("skipped"));
    REFIT_ASSIGN_OR_RETURN(region.cols, fields.Uint("cols"));
    REFIT_ASSIGN_OR_RETURN(const Json* rects, fields.Require("rects"));
    if (!rects->is_array() || rects->size() > kMaxRegionRects) {
      return InvalidArgument("{} must be a list of at most {} rectangles, got {}",
                             fields.Name("rects"), kMaxRegionRects, JsonTypeName(*rects));
    }
    for (size_t i = 0; i < rects->size(); ++i) {
      const Json& rect = (*rects)[i];
      const bool valid = rect.is_array() && rect.size() == 4 &&
                         std::all_of(rect.begin(), rect.end(),
                                     [](const Json& v) { return v.is_number_unsigned(); });
      if (!valid) {
        return InvalidArgument("{}[{}] must be [row_begin, row_end, col_begin, col_end], got {}",
                               fields.Name("rects"), i, DumpJson(rect));
      }
      region.rects.push_back({rect[0].get<uint64_t>(), rect[1].get<uint64_t>(),
                              rect[2].get<uint64_t>(), rect[3].get<uint64_t>()});
    }
    out.emplace(name, std::move(region));
  }
  return out;
}

Result<TransferExpectation> GetExpectation(const JsonFields& body) {
  TransferExpectation expected;
  if (const Json* counts = body.Find("expected"); counts != nullptr) {
    const JsonFields fields(*counts, body.Name("expected"));
    constexpr std::array<std::string_view, 2> kCountFields = {"producers", "total"};
    REFIT_RETURN_NOT_OK(fields.CheckObject(kCountFields));
    REFIT_ASSIGN_OR_RETURN(expected.total_payloads, fields.OptionalUint("total"));
    if (const Json* producers = fields.Find("producers"); producers != nullptr) {
      const std::string where = fields.Name("producers");
      if (!producers->is_object()) {
        return InvalidArgument("{} must be an object of producer id to payload count, got {}",
                               where, JsonTypeName(*producers));
      }
      for (const auto& [key, count] : producers->items()) {
        REFIT_ASSIGN_OR_RETURN(const uint32_t producer, ParseProducerId(key, where));
        if (!count.is_number_unsigned() ||
            count.get<uint64_t>() > std::numeric_limits<uint32_t>::max()) {
          return InvalidArgument("{}['{}'] must be a payload count in [0, {}], got {}", where, key,
                                 std::numeric_limits<uint32_t>::max(), DumpJson(count));
        }
        expected.payloads_per_producer[producer] = count.get<uint32_t>();
      }
    }
  }
  REFIT_ASSIGN_OR_RETURN(expected.digests, body.Digests("expected_digests"));
  return expected;
}

Json FlushReportToJson(const FlushReport& report) {
  Json digests = Json::object();
  for (const auto& [name, digest] : report.digests) digests[name] = DigestToHex(digest);
  Json body{{"ok", true},
            {"transfer_id", report.transfer_id.ToHex()},
            {"target_version", report.target_version},
            {"payloads", report.payloads},
            {"items", report.items},
            {"changed_elements", report.changed_elements},
            {"duplicates", report.duplicates},
            {"digests", std::move(digests)}};
  if (!report.holdings.empty()) {
    Json holdings = Json::object();
    for (const auto& [name, holding] : report.holdings) {
      Json pieces = Json::object();
      for (const auto& [piece, digest] : holding.pieces) pieces[piece] = DigestToHex(digest);
      holdings[name] = Json{{"skipped", holding.skipped}, {"pieces", std::move(pieces)}};
    }
    body["holdings"] = std::move(holdings);
  }
  return body;
}

Result<FlushReport> FlushReportFromJson(const Json& body) {
  const JsonFields fields(body, "flush response");
  FlushReport report;
  REFIT_ASSIGN_OR_RETURN(report.transfer_id, fields.Transfer("transfer_id"));
  REFIT_ASSIGN_OR_RETURN(report.target_version, fields.Uint("target_version"));
  REFIT_ASSIGN_OR_RETURN(report.payloads, fields.Uint("payloads"));
  REFIT_ASSIGN_OR_RETURN(report.items, fields.Uint("items"));
  REFIT_ASSIGN_OR_RETURN(report.changed_elements, fields.Uint("changed_elements"));
  REFIT_ASSIGN_OR_RETURN(report.duplicates, fields.Uint("duplicates"));
  REFIT_ASSIGN_OR_RETURN(report.digests, fields.Digests("digests"));
  if (const Json* holdings = fields.Find("holdings"); holdings != nullptr) {
    if (!holdings->is_object()) {
      return InvalidArgument("{}: expected an object", fields.Name("holdings"));
    }
    for (const auto& [name, holding] : holdings->items()) {
      const JsonFields holding_fields(holding, fields.Name("holdings") + "." + name);
      CanonicalHolding& held = report.holdings[name];
      REFIT_ASSIGN_OR_RETURN(held.skipped, holding_fields.Bool("skipped"));
      REFIT_ASSIGN_OR_RETURN(held.pieces, holding_fields.Digests("pieces"));
    }
  }
  return report;
}

Json StatusToJson(const ControlStatusFields& status) {
  const ReceiverStatus& receiver = status.receiver;
  Json body{{"ok", true},
            {"state", std::string(ReceiverStateName(receiver.state))},
            {"version", receiver.version},
            {"transfer_id", nullptr},
            {"base_version", receiver.base_version},
            {"target_version", receiver.target_version},
            {"sealed", receiver.sealed},
            {"staged_payloads", receiver.staged_payloads},
            {"applied_payloads", receiver.applied_payloads},
            {"queued_payloads", receiver.queued_payloads},
            {"duplicate_payloads", receiver.duplicate_payloads},
            {"undo_bytes", receiver.undo_bytes},
            {"undo_file_bytes", receiver.undo_file_bytes},
            {"needs_anchor", receiver.needs_anchor},
            {"needs_anchor_reason", nullptr},
            {"lease_remaining_ms", nullptr},
            {"expired_leases", receiver.expired_leases},
            {"received_payloads", receiver.received_payloads},
            {"received_bytes", receiver.received_bytes},
            {"device_to_bytes", receiver.device_to_bytes},
            {"device_from_bytes", receiver.device_from_bytes},
            {"accepts_target_version", receiver.accepts_target_version},
            {"lineage", nullptr},
            {"last_error", nullptr},
            {"tensors", status.tensors},
            {"state_fingerprint", nullptr},
            {"replica", status.place.replica},
            {"shard", status.place.shard},
            {"shards", status.place.shards}};
  if (receiver.transfer_id.has_value()) body["transfer_id"] = receiver.transfer_id->ToHex();
  if (receiver.lease_remaining_ms.has_value()) {
    body["lease_remaining_ms"] = *receiver.lease_remaining_ms;
  }
  if (receiver.needs_anchor) body["needs_anchor_reason"] = receiver.needs_anchor_reason;
  if (!receiver.last_error.ok()) {
    body["last_error"] = Json{{"code", std::string(StatusCodeName(receiver.last_error.code()))},
                              {"message", receiver.last_error.message()}};
  }
  if (status.state_fingerprint.has_value()) {
    body["state_fingerprint"] = DigestToHex(*status.state_fingerprint);
  }
  if (!receiver.lineage.run_id.empty() || receiver.lineage.fingerprint != 0) {
    body["lineage"] = Json{{"run_id", receiver.lineage.run_id},
                           {"epoch", receiver.lineage.epoch},
                           {"fingerprint", DigestToHex(receiver.lineage.fingerprint)}};
  }
  if (status.relay.has_value()) {
    body["relay_index"] = status.relay->index;
    body["relays"] = status.relay->relays;
  }
  if (status.readiness.has_value()) PutReadiness(*status.readiness, body);
  return body;
}

Result<ControlStatusFields> StatusFromJson(const Json& body) {
  const JsonFields fields(body, "status response");
  ControlStatusFields status;
  ReceiverStatus& receiver = status.receiver;
  REFIT_ASSIGN_OR_RETURN(const std::string state, fields.String("state"));
  REFIT_ASSIGN_OR_RETURN(receiver.state, ParseReceiverState(state));
  REFIT_ASSIGN_OR_RETURN(receiver.version, fields.Uint("version"));
  REFIT_ASSIGN_OR_RETURN(receiver.transfer_id, fields.OptionalTransfer("transfer_id"));
  REFIT_ASSIGN_OR_RETURN(receiver.base_version, fields.Uint("base_version"));
  REFIT_ASSIGN_OR_RETURN(receiver.target_version, fields.Uint("target_version"));
  REFIT_ASSIGN_OR_RETURN(receiver.sealed, fields.Bool("sealed"));
  REFIT_ASSIGN_OR_RETURN(receiver.staged_payloads, fields.Uint("staged_payloads"));
  REFIT_ASSIGN_OR_RETURN(receiver.applied_payloads, fields.Uint("applied_payloads"));
  REFIT_ASSIGN_OR_RETURN(receiver.queued_payloads, fields.Uint("queued_payloads"));
  REFIT_ASSIGN_OR_RETURN(receiver.duplicate_payloads, fields.Uint("duplicate_payloads"));
  REFIT_ASSIGN_OR_RETURN(receiver.undo_bytes, fields.Uint("undo_bytes"));
  // Both absent from receivers older than transfer leases.
  REFIT_ASSIGN_OR_RETURN(receiver.lease_remaining_ms, fields.OptionalUint("lease_remaining_ms"));
  if (fields.Has("expired_leases")) {
    REFIT_ASSIGN_OR_RETURN(receiver.expired_leases, fields.Uint("expired_leases"));
  }
  // Both absent from receivers older than routing by holdings.
  if (fields.Has("received_payloads")) {
    REFIT_ASSIGN_OR_RETURN(receiver.received_payloads, fields.Uint("received_payloads"));
    REFIT_ASSIGN_OR_RETURN(receiver.received_bytes, fields.Uint("received_bytes"));
  }
  // Both absent from receivers older than device tensors.
  if (fields.Has("device_to_bytes")) {
    REFIT_ASSIGN_OR_RETURN(receiver.device_to_bytes, fields.Uint("device_to_bytes"));
    REFIT_ASSIGN_OR_RETURN(receiver.device_from_bytes, fields.Uint("device_from_bytes"));
  }
  // Absent from receivers older than per-receiver plans, which prepare to base + 1 only.
  if (fields.Has("accepts_target_version")) {
    REFIT_ASSIGN_OR_RETURN(receiver.accepts_target_version, fields.Bool("accepts_target_version"));
  }
  // Absent from receivers older than the anchor_undo policy, which always undo an anchor.
  if (fields.Has("needs_anchor")) {
    REFIT_ASSIGN_OR_RETURN(receiver.needs_anchor, fields.Bool("needs_anchor"));
    REFIT_ASSIGN_OR_RETURN(receiver.undo_file_bytes, fields.Uint("undo_file_bytes"));
    if (receiver.needs_anchor) {
      REFIT_ASSIGN_OR_RETURN(receiver.needs_anchor_reason, fields.String("needs_anchor_reason"));
    }
  }
  // Absent from receivers older than lineages, and null from one that holds none.
  if (const Json* lineage = fields.Find("lineage"); lineage != nullptr) {
    const JsonFields lineage_fields(*lineage, fields.Name("lineage"));
    REFIT_ASSIGN_OR_RETURN(receiver.lineage.run_id, lineage_fields.String("run_id"));
    REFIT_ASSIGN_OR_RETURN(receiver.lineage.epoch, lineage_fields.Uint("epoch"));
    REFIT_ASSIGN_OR_RETURN(const std::string hex, lineage_fields.String("fingerprint"));
    REFIT_ASSIGN_OR_RETURN(receiver.lineage.fingerprint,
                           DigestFromHex(hex, lineage_fields.Name("fingerprint")));
  }
  if (const Json* error = fields.Find("last_error"); error != nullptr) {
    const JsonFields error_fields(*error, fields.Name("last_error"));
    REFIT_ASSIGN_OR_RETURN(const std::string code_name, error_fields.String("code"));
    REFIT_ASSIGN_OR_RETURN(std::string message, error_fields.String("message"));
    const std::optional<StatusCode> code = StatusCodeFromName(code_name);
    if (!code.has_value() || *code == StatusCode::kOk) {
      return InvalidArgument("{}: unknown status code '{}'", error_fields.Name("code"), code_name);
    }
    receiver.last_error = Status(*code, std::move(message));
  }
  REFIT_ASSIGN_OR_RETURN(status.tensors, fields.Uint("tensors"));
  // A receiver older than replica places is a replica of its own.
  if (fields.Has("replica")) {
    REFIT_ASSIGN_OR_RETURN(status.place.replica, fields.String("replica"));
    REFIT_ASSIGN_OR_RETURN(const uint64_t shard, fields.Uint("shard"));
    REFIT_ASSIGN_OR_RETURN(const uint64_t shards, fields.Uint("shards"));
    if (shards == 0 || shards > UINT32_MAX || shard >= shards) {
      return InvalidArgument("{}: shard {} of {}", fields.Name("shard"), shard, shards);
    }
    status.place.shard = static_cast<uint32_t>(shard);
    status.place.shards = static_cast<uint32_t>(shards);
  }
  if (fields.Has("state_fingerprint")) {
    REFIT_ASSIGN_OR_RETURN(const std::string hex, fields.String("state_fingerprint"));
    REFIT_ASSIGN_OR_RETURN(status.state_fingerprint,
                           DigestFromHex(hex, fields.Name("state_fingerprint")));
  }
  // Absent from a data plane without relays, and from receivers older than relay places.
  if (fields.Has("relays")) {
    REFIT_ASSIGN_OR_RETURN(const uint64_t relays, fields.Uint("relays"));
    REFIT_ASSIGN_OR_RETURN(const uint64_t index, fields.Uint("relay_index"));
    if (relays == 0 || relays > UINT32_MAX || index >= relays) {
      return InvalidArgument("{}: relay {} of {}", fields.Name("relay_index"), index, relays);
    }
    status.relay = RelayPlace{static_cast<uint32_t>(index), static_cast<uint32_t>(relays)};
  }
  // Absent from receivers older than readiness.
  if (fields.Has("ready")) {
    REFIT_ASSIGN_OR_RETURN(status.readiness, ReadinessFromJson(fields));
  }
  return status;
}

Json TensorListingToJson(const TensorListing& listing) {
  Json tensors = Json::array();
  for (const HeldTensor& tensor : listing.tensors) {
    Json shape = Json::array();
    for (const int64_t extent : tensor.shape) shape.push_back(extent);
    tensors.push_back(Json{{"name", tensor.name},
                           {"dtype", std::string(DTypeName(tensor.dtype))},
                           {"shape", std::move(shape)},
                           {"digest", DigestToHex(tensor.digest)}});
  }
  return Json{{"ok", true}, {"version", listing.version}, {"tensors", std::move(tensors)}};
}

Result<TensorListing> TensorListingFromJson(const Json& body) {
  const JsonFields fields(body, "tensor listing");
  TensorListing listing;
  REFIT_ASSIGN_OR_RETURN(listing.version, fields.Uint("version"));
  REFIT_ASSIGN_OR_RETURN(const Json* tensors, fields.Require("tensors"));
  if (!tensors->is_array()) {
    return InvalidArgument("{} must be an array, got {}", fields.Name("tensors"),
                           JsonTypeName(*tensors));
  }
  listing.tensors.reserve(tensors->size());
  for (size_t t = 0; t < tensors->size(); ++t) {
    const JsonFields entry((*tensors)[t], fmt::format("{}[{}]", fields.Name("tensors"), t));
    HeldTensor tensor;
    REFIT_ASSIGN_OR_RETURN(tensor.name, entry.String("name"));
    REFIT_ASSIGN_OR_RETURN(const std::string dtype, entry.String("dtype"));
    Result<DType> parsed = ParseDType(dtype);
    if (!parsed.ok())
      return InvalidArgument("{}: {}", entry.Name("dtype"), parsed.status().message());
    tensor.dtype = *parsed;
    REFIT_ASSIGN_OR_RETURN(const Json* shape, entry.Require("shape"));
    if (!shape->is_array()) {
      return InvalidArgument("{} must be an array, got {}", entry.Name("shape"),
                             JsonTypeName(*shape));
    }
    for (const Json& extent : *shape) {
      if (!extent.is_number_unsigned() || extent.get<uint64_t>() > INT64_MAX) {
        return InvalidArgument("{} has an extent that is not a non-negative integer: {}",
                               entry.Name("shape"), DumpJson(*shape));
      }
      tensor.shape.push_back(static_cast<int64_t>(extent.get<uint64_t>()));
    }
    REFIT_ASSIGN_OR_RETURN(const std::string digest, entry.String("digest"));
    REFIT_ASSIGN_OR_RETURN(tensor.digest, DigestFromHex(digest, entry.Name("digest")));
    listing.tensors.push_back(std::move(tensor));
  }
  return listing;
}

std::string PercentEncode(std::string_view text) {
  static constexpr char kHexDigits[] = "0123456789ABCDEF";
  std::string encoded;
  encoded.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    const bool unreserved = (byte >= 'A' && byte <= 'Z') || (byte >= 'a' && byte <= 'z') ||
                            (byte >= '0' && byte <= '9') || byte == '-' || byte == '.' ||
                            byte == '_' || byte == '~';
    if (unreserved) {
      encoded.push_back(c);
    } else {
      encoded.push_back('%');
      encoded.push_back(kHexDigits[byte >> 4]);
      encoded.push_back(kHexDigits[byte & 0xF]);
    }
  }
  return encoded;
}

namespace {

Result<CatchUp> CatchUpFromName(std::string_view name, const std::string& field) {
  for (CatchUp how :
       {CatchUp::kDelta, CatchUp::kFolded, CatchUp::kPeer, CatchUp::kChain, CatchUp::kAnchor}) {
    if (CatchUpName(how) == name) return how;
  }
  return InvalidArgument("{}: unknown catch-up '{}' (delta, folded, peer, chain or anchor)", field,
                         name);
}

Result<ReadinessReason> ReadinessReasonFromName(std::string_view name, const std::string& field) {
  for (ReadinessReason reason :
       {ReadinessReason::kReady, ReadinessReason::kFleetVersionUnknown,
        ReadinessReason::kTransferOpen, ReadinessReason::kBehind, ReadinessReason::kAhead,
        ReadinessReason::kNeedsAnchor, ReadinessReason::kFenced, ReadinessReason::kLeft}) {
    if (ReadinessReasonName(reason) == name) return reason;
  }
  return InvalidArgument("{}: unknown readiness reason '{}'", field, name);
}

Json OptionalNumber(const std::optional<uint64_t>& value) {
  return value.has_value() ? Json(*value) : Json(nullptr);
}

}  // namespace

void PutReadiness(const Readiness& readiness, Json& body) {
  body["ready"] = readiness.ready;
  body["ready_reason"] = std::string(ReadinessReasonName(readiness.reason));
  body["ready_detail"] = readiness.detail;
  body["fleet_version"] = OptionalNumber(readiness.fleet_version);
  body["last_catch_up"] = readiness.last_catch_up.has_value()
                              ? Json(std::string(CatchUpName(*readiness.last_catch_up)))
                              : Json(nullptr);
  body["publisher_url"] = readiness.publisher_url;
}

Result<Readiness> ReadinessFromJson(const JsonFields& fields) {
  Readiness readiness;
  REFIT_ASSIGN_OR_RETURN(readiness.ready, fields.Bool("ready"));
  REFIT_ASSIGN_OR_RETURN(const std::string reason, fields.String("ready_reason"));
  REFIT_ASSIGN_OR_RETURN(readiness.reason,
                         ReadinessReasonFromName(reason, fields.Name("ready_reason")));
  REFIT_ASSIGN_OR_RETURN(readiness.detail, fields.String("ready_detail"));
  REFIT_ASSIGN_OR_RETURN(readiness.version, fields.Uint("version"));
  REFIT_ASSIGN_OR_RETURN(readiness.fleet_version, fields.OptionalUint("fleet_version"));
  if (fields.Has("last_catch_up")) {
    REFIT_ASSIGN_OR_RETURN(const std::string how, fields.String("last_catch_up"));
    REFIT_ASSIGN_OR_RETURN(readiness.last_catch_up,
                           CatchUpFromName(how, fields.Name("last_catch_up")));
  }
  REFIT_ASSIGN_OR_RETURN(readiness.publisher_url, fields.String("publisher_url"));
  return readiness;
}

Json MemberEndpointToJson(const MemberEndpoint& member) {
  return Json{{"control_url", member.control_url}, {"data_endpoint", member.data_endpoint}};
}

Result<MemberEndpoint> MemberEndpointFromJson(const JsonFields& fields, bool need_data) {
  MemberEndpoint member;
  REFIT_ASSIGN_OR_RETURN(member.control_url, fields.String("control_url"));
  if (!member.control_url.starts_with("http://") && !member.control_url.starts_with("https://")) {
    return InvalidArgument("{} '{}' is not an http:// or https:// URL", fields.Name("control_url"),
                           member.control_url);
  }
  if (need_data || fields.Has("data_endpoint")) {
    REFIT_ASSIGN_OR_RETURN(member.data_endpoint, fields.String("data_endpoint"));
  }
  return member;
}

Json MembershipToJson(const FleetMembership& membership) {
  Json members = Json::array();
  for (const MemberStanding& member : membership.members) {
    Json one = MemberEndpointToJson(member.endpoint);
    one["joined"] = member.joined;
    one["missed_syncs"] = member.missed_syncs;
    one["version"] = OptionalNumber(member.version);
    one["held_version"] = member.held_version;
    one["lag"] = member.lag;
    one["caught_up_by"] = member.caught_up_by.has_value()
                              ? Json(std::string(CatchUpName(*member.caught_up_by)))
                              : Json(nullptr);
    one["wire_bytes"] = member.wire_bytes;
    one["fenced"] = member.fenced;
    members.push_back(std::move(one));
  }
  return Json{{"ok", true},
              {"fleet_version", OptionalNumber(membership.fleet_version)},
              {"members", std::move(members)}};
}

Result<FleetMembership> MembershipFromJson(const Json& body) {
  const JsonFields fields(body, "membership");
  FleetMembership membership;
  REFIT_ASSIGN_OR_RETURN(membership.fleet_version, fields.OptionalUint("fleet_version"));
  REFIT_ASSIGN_OR_RETURN(const Json* members, fields.Require("members"));
  if (!members->is_array()) {
    return InvalidArgument("{} must be a list, got {}", fields.Name("members"),
                           JsonTypeName(*members));
  }
  for (size_t i = 0; i < members->size(); ++i) {
    const JsonFields one((*members)[i], fmt::format("{}[{}]", fields.Name("members"), i));
    MemberStanding member;
    REFIT_ASSIGN_OR_RETURN(member.endpoint, MemberEndpointFromJson(one, /*need_data=*/false));
    REFIT_ASSIGN_OR_RETURN(member.joined, one.Bool("joined"));
    REFIT_ASSIGN_OR_RETURN(const uint64_t missed, one.Uint("missed_syncs"));
    member.missed_syncs = static_cast<uint32_t>(std::min<uint64_t>(missed, UINT32_MAX));
    REFIT_ASSIGN_OR_RETURN(member.version, one.OptionalUint("version"));
    REFIT_ASSIGN_OR_RETURN(member.held_version, one.Uint("held_version"));
    REFIT_ASSIGN_OR_RETURN(member.lag, one.Uint("lag"));
    if (one.Has("caught_up_by")) {
      REFIT_ASSIGN_OR_RETURN(const std::string how, one.String("caught_up_by"));
      REFIT_ASSIGN_OR_RETURN(member.caught_up_by, CatchUpFromName(how, one.Name("caught_up_by")));
    }
    REFIT_ASSIGN_OR_RETURN(member.wire_bytes, one.Uint("wire_bytes"));
    REFIT_ASSIGN_OR_RETURN(member.fenced, one.Bool("fenced"));
    membership.members.push_back(std::move(member));
  }
  return membership;
}

}  // namespace refit::internal
