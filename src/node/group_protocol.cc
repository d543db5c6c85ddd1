#include "node/group_protocol.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include <fmt/format.h>
#include <xxhash.h>

#include "control/protocol.h"
#include "refit/status_format.h"

namespace refit::internal {
namespace {

// The type each field of a group message has when present. Json::value() throws on a present
// field of another type, which would end the rank; a message is checked once, here.
Status CheckFieldTypes(const Json& body, std::string_view where) {
  using Check = bool (*)(const Json&);
  const auto is_uint = [](const Json& v) { return v.is_number_unsigned(); };
  const auto is_bool = [](const Json& v) { return v.is_boolean(); };
  const auto is_string = [](const Json& v) { return v.is_string(); };
  const auto is_object = [](const Json& v) { return v.is_object(); };
  const auto is_array = [](const Json& v) { return v.is_array(); };
  const auto is_uints = [](const Json& v) {
    return v.is_array() &&
           std::all_of(v.begin(), v.end(), [](const Json& e) { return e.is_number_unsigned(); });
  };
  const auto is_strings = [](const Json& v) {
    return v.is_array() &&
           std::all_of(v.begin(), v.end(), [](const Json& e) { return e.is_string(); });
  };
  static const std::map<std::string_view, std::pair<Check, std::string_view>> kTop = {
      {"protocol", {is_uint, "an unsigned integer"}},
      {"op", {is_string, "a string"}},
      {"ok", {is_bool, "a boolean"}},
      {"code", {is_string, "a string"}},
      {"message", {is_string, "a string"}},
      {"version", {is_uint, "an unsigned integer"}},
      {"version_known", {is_bool, "a boolean"}},
      {"wants_anchor", {is_bool, "a boolean"}},
      {"open", {is_bool, "a boolean"}},
      {"endpoints", {is_strings, "a list of strings"}},
      {"transfer_id", {is_string, "a string"}},
      {"anchor", {is_bool, "a boolean"}},
      {"base_version", {is_uint, "an unsigned integer"}},
      {"target_version", {is_uint, "an unsigned integer"}},
      {"report", {is_object, "an object"}},
      {"digests", {is_object, "an object"}},
      {"sharded", {is_bool, "a boolean"}},
      {"layout_digest", {is_string, "a string"}},
      {"layout", {is_array, "a list"}},
      {"layouts_known", {is_strings, "a list of strings"}},
      {"roles", {is_strings, "a list of strings"}},
      {"full_ranks", {is_uints, "a list of unsigned integers"}},
      {"boxes", {is_array, "a list"}},
      {"routes", {is_array, "a list"}}};
  for (const auto& [key, value] : body.items()) {
    auto it = kTop.find(key);
    if (it != kTop.end() && !it->second.first(value)) {
      return InvalidArgument("{}: field '{}' of a producer-group message is {}, not {}", where, key,
                             value.type_name(), it->second.second);
    }
  }
  if (auto report = body.find("report"); report != body.end()) {
    for (const auto& [key, value] : report->items()) {
      if (key == "routes") {
        const bool valid =
            value.is_array() && std::all_of(value.begin(), value.end(), [&](const Json& r) {
              return r.is_array() && r.size() == 4 && is_uints(r);
            });
        if (!valid) {
          return InvalidArgument(
              "{}: field 'report.routes' of a producer-group message is not a list of [payloads, "
              "items, item_bytes, wire_bytes]",
              where);
        }
        continue;
      }
      const bool seconds = key.size() > 2 && key.ends_with("_s");
      if (seconds ? !value.is_number() : !value.is_number_unsigned()) {
        return InvalidArgument("{}: field 'report.{}' of a producer-group message is {}, not {}",
                               where, key, value.type_name(),
                               seconds ? "a number" : "an unsigned integer");
      }
    }
  }
  return Status::OK();
}

Result<std::vector<int64_t>> IntegersFromJson(const Json& value, std::string_view what) {
  if (!value.is_array()) return InvalidArgument("{} is {}, not a list", what, value.type_name());
  std::vector<int64_t> out;
  for (const Json& e : value) {
    if (!e.is_number_integer()) {
      return InvalidArgument("{} holds {}, not only integers", what, e.type_name());
    }
    out.push_back(e.get<int64_t>());
  }
  return out;
}

}  // namespace

Json GroupMessage(std::string_view op) {
  return Json{{"protocol", kGroupProtocolVersion}, {"op", std::string(op)}};
}

Result<Json> ParseGroupMessage(const std::string& text, std::string_view where) {
  Result<Json> parsed = internal::ParseJson(text, "a producer-group message");
  if (!parsed.ok() || !parsed->is_object()) {
    return InvalidArgument("{}: not a producer-group message ({} bytes){}", where, text.size(),
                           parsed.ok() ? "" : ": " + std::string(parsed.status().message()));
  }
  Json body = std::move(*parsed);
  REFIT_RETURN_NOT_OK(CheckFieldTypes(body, where));
  if (body.value("protocol", 0) != kGroupProtocolVersion) {
    return FailedPrecondition(
        "{}: speaks producer-group protocol {}, this rank {}: every rank must run the same "
        "refit build",
        where, body.value("protocol", 0), kGroupProtocolVersion);
  }
  return body;
}

Json StatusToJson(const Status& status) {
  if (status.ok()) return Json{{"ok", true}};
  return Json{{"ok", false},
              {"code", std::string(StatusCodeName(status.code()))},
              {"message", status.message()}};
}

Status StatusFromJson(const Json& body, std::string_view where) {
  if (!body.is_object()) return InvalidArgument("{}: a malformed reply", where);
  if (body.value("ok", false)) return Status::OK();
  const std::optional<StatusCode> code = StatusCodeFromName(body.value("code", std::string()));
  const std::string message = body.value("message", std::string("(no message)"));
  return Status(code.value_or(StatusCode::kInternal), fmt::format("{}: {}", where, message));
}

std::string DigestHex(uint64_t digest) { return fmt::format("{:016x}", digest); }

Result<uint64_t> DigestFromHex(const Json& hex, std::string_view what) {
  if (!hex.is_string() || hex.get<std::string>().size() != 16) {
    return InvalidArgument("{} is not 16 hex digits", what);
  }
  const std::string text = hex.get<std::string>();
  char* end = nullptr;
  const uint64_t digest = std::strtoull(text.c_str(), &end, 16);
  if (end != text.c_str() + text.size()) return InvalidArgument("{} is not hex", what);
  return digest;
}

Json DigestsToJson(const std::map<std::string, uint64_t>& digests) {
  Json out = Json::object();
  for (const auto& [name, digest] : digests) out[name] = DigestHex(digest);
  return out;
}

Result<std::map<std::string, uint64_t>> DigestsFromJson(const Json& body, std::string_view where) {
  std::map<std::string, uint64_t> digests;
  if (!body.is_object()) return InvalidArgument("{}: digests are not an object", where);
  for (const auto& [name, hex] : body.items()) {
    REFIT_ASSIGN_OR_RETURN(digests[name],
                           DigestFromHex(hex, fmt::format("{}: digest of '{}'", where, name)));
  }
  return digests;
}

namespace {

// [[payloads, items, item_bytes, wire_bytes], ...], one per route.
Json RouteReportsToJson(const std::vector<RouteReport>& routes) {
  Json out = Json::array();
  for (const RouteReport& route : routes) {
    out.push_back(Json::array({route.payloads, route.items, route.item_bytes, route.wire_bytes}));
  }
  return out;
}

}  // namespace

Json StreamReportToJson(const StreamReport& report) {
  return Json{{"chunks", report.chunks},
              {"owned_chunks", report.owned_chunks},
              {"payloads", report.payloads},
              {"items", report.items},
              {"changed_elements", report.changed_elements},
              {"total_elements", report.total_elements},
              {"item_bytes", report.item_bytes},
              {"wire_bytes", report.wire_bytes},
              {"source_s", report.timings.source_s},
              {"encode_s", report.timings.encode_s},
              {"serialize_s", report.timings.serialize_s},
              {"send_s", report.timings.send_s},
              {"wall_s", report.timings.wall_s},
              {"routes", RouteReportsToJson(report.routes)}};
}

StreamReport StreamReportFromJson(const Json& body) {
  StreamReport report;
  report.chunks = body.value("chunks", uint64_t{0});
  report.owned_chunks = body.value("owned_chunks", uint64_t{0});
  report.payloads = body.value("payloads", uint64_t{0});
  report.items = body.value("items", uint64_t{0});
  report.changed_elements = body.value("changed_elements", uint64_t{0});
  report.total_elements = body.value("total_elements", uint64_t{0});
  report.item_bytes = body.value("item_bytes", uint64_t{0});
  report.wire_bytes = body.value("wire_bytes", uint64_t{0});
  report.timings.source_s = body.value("source_s", 0.0);
  report.timings.encode_s = body.value("encode_s", 0.0);
  report.timings.serialize_s = body.value("serialize_s", 0.0);
  report.timings.send_s = body.value("send_s", 0.0);
  report.timings.wall_s = body.value("wall_s", 0.0);
  // Malformed: no routes, which the coordinator refuses naming the rank.
  if (const auto routes = body.find("routes"); routes != body.end() && routes->is_array()) {
    for (const Json& route : *routes) {
      if (!route.is_array() || route.size() != 4 ||
          !std::all_of(route.begin(), route.end(),
                       [](const Json& v) { return v.is_number_unsigned(); })) {
        report.routes.clear();
        break;
      }
      report.routes.push_back({route[0].get<uint64_t>(), route[1].get<uint64_t>(),
                               route[2].get<uint64_t>(), route[3].get<uint64_t>()});
    }
  }
  return report;
}

Json RoutesToJson(std::span<const TransferRoute> routes) {
  Json out = Json::array();
  for (const TransferRoute& route : routes) {
    Json one{
        {"endpoints", route.endpoints},
        {"regions", route.items == nullptr ? Json(nullptr)
                                           : RegionsToJson(route.items->regions())["regions"]}};
    // Absent for the fleet's delta, so a rank of an older build reads the routes it knows.
    if (route.content != CatchUp::kDelta) {
      one["content"] = std::string(CatchUpName(route.content));
      one["from_version"] = route.from_version;
    }
    out.push_back(std::move(one));
  }
  return out;
}

Result<std::vector<TransferRoute>> RoutesFromJson(const Json& body, std::string_view where) {
  if (!body.is_array()) return InvalidArgument("{}: routes must be a list", where);
  std::vector<TransferRoute> routes;
  for (size_t k = 0; k < body.size(); ++k) {
    const std::string route_where = fmt::format("{}: route {}", where, k);
    const Json& route = body[k];
    const auto endpoints = route.find("endpoints");
    const auto regions = route.find("regions");
    if (!route.is_object() || endpoints == route.end() || !endpoints->is_array() ||
        !std::all_of(endpoints->begin(), endpoints->end(),
                     [](const Json& e) { return e.is_string(); }) ||
        regions == route.end()) {
      return InvalidArgument("{} is not {{\"endpoints\": [...], \"regions\": ...}}", route_where);
    }
    TransferRoute parsed;
    parsed.endpoints = endpoints->get<std::vector<std::string>>();
    if (!regions->is_null()) {
      Result<HeldRegions> held = RegionsFromJson(Json{{"regions", *regions}});
      if (!held.ok()) return held.status().WithContext(route_where);
      Result<ItemRoute> items = ItemRoute::Make(*held);
      if (!items.ok()) return items.status().WithContext(route_where);
      parsed.items = std::make_shared<const ItemRoute>(*std::move(items));
    }
    if (const auto content = route.find("content"); content != route.end()) {
      const std::string name = content->is_string() ? content->get<std::string>() : "";
      if (name == CatchUpName(CatchUp::kAnchor)) {
        parsed.content = CatchUp::kAnchor;
      } else if (name == CatchUpName(CatchUp::kFolded)) {
        parsed.content = CatchUp::kFolded;
      } else {
        return InvalidArgument("{}: content '{}' is neither 'anchor' nor 'folded'", route_where,
                               content->dump());
      }
      const auto from = route.find("from_version");
      if (from == route.end() || !from->is_number_unsigned()) {
        return InvalidArgument("{}: content '{}' without an unsigned from_version", route_where,
                               name);
      }
      parsed.from_version = from->get<uint64_t>();
    }
    routes.push_back(std::move(parsed));
  }
  return routes;
}

Result<TransferPlan> PlanFromJson(const Json& body) {
  TransferPlan plan;
  REFIT_ASSIGN_OR_RETURN(plan.transfer_id,
                         TransferId::FromHex(body.value("transfer_id", std::string())));
  plan.anchor = body.value("anchor", false);
  plan.base_version = body.value("base_version", uint64_t{0});
  plan.target_version = body.value("target_version", uint64_t{0});
  return plan;
}

Json LayoutToJson(const ProducerLayout& layout) {
  Json out = Json::array();
  for (const LayoutPiece& piece : layout.pieces) {
    out.push_back(
        Json::array({piece.tensor, std::string(DTypeName(piece.dtype)), piece.shape, piece.offset,
                     piece.extent, piece.local, piece.local_shape, piece.local_offset}));
  }
  return out;
}

Result<ProducerLayout> LayoutFromJson(const Json& body, std::string_view where) {
  if (!body.is_array()) return InvalidArgument("{}: the layout is not a list", where);
  ProducerLayout layout;
  for (size_t i = 0; i < body.size(); ++i) {
    const Json& fields = body[i];
    const std::string what = fmt::format("{}: layout piece {}", where, i);
    if (!fields.is_array() || fields.size() != 8 || !fields[0].is_string() ||
        !fields[1].is_string() || !fields[5].is_string()) {
      return InvalidArgument(
          "{} is not [tensor, dtype, shape, offset, extent, local, local_shape, local_offset]",
          what);
    }
    LayoutPiece piece;
    piece.tensor = fields[0].get<std::string>();
    REFIT_ASSIGN_OR_RETURN(piece.dtype, ParseDType(fields[1].get<std::string>()));
    REFIT_ASSIGN_OR_RETURN(piece.shape, IntegersFromJson(fields[2], what + " shape"));
    REFIT_ASSIGN_OR_RETURN(piece.offset, IntegersFromJson(fields[3], what + " offset"));
    REFIT_ASSIGN_OR_RETURN(piece.extent, IntegersFromJson(fields[4], what + " extent"));
    piece.local = fields[5].get<std::string>();
    REFIT_ASSIGN_OR_RETURN(piece.local_shape, IntegersFromJson(fields[6], what + " local_shape"));
    REFIT_ASSIGN_OR_RETURN(piece.local_offset, IntegersFromJson(fields[7], what + " local_offset"));
    layout.pieces.push_back(std::move(piece));
  }
  return layout;
}

uint64_t LayoutDigest(const ProducerLayout& layout) {
  const std::string text = LayoutToJson(layout).dump();
  return XXH3_64bits(text.data(), text.size());
}

std::string RolesToString(std::span<const PieceRole> roles) {
  std::string out;
  out.reserve(roles.size());
  for (PieceRole role : roles) {
    out += role == PieceRole::kSend ? 's' : role == PieceRole::kCopy ? 'c' : 'e';
  }
  return out;
}

Result<std::vector<PieceRole>> RolesFromString(std::string_view text, size_t pieces,
                                               std::string_view where) {
  if (text.size() != pieces) {
    return FailedPrecondition(
        "{}: rank 0 planned {} pieces for this rank, which holds {}: the layout changed during "
        "the sync",
        where, text.size(), pieces);
  }
  std::vector<PieceRole> roles;
  roles.reserve(text.size());
  for (char c : text) {
    if (c != 's' && c != 'c' && c != 'e') {
      return InvalidArgument("{}: piece role '{}' is not one of s, c, e", where, c);
    }
    roles.push_back(c == 's' ? PieceRole::kSend : c == 'c' ? PieceRole::kCopy : PieceRole::kEmpty);
  }
  return roles;
}

Json BoxDigestsToJson(std::span<const BoxDigest> boxes) {
  Json out = Json::array();
  for (const BoxDigest& box : boxes) {
    out.push_back(Json::array({box.tensor, box.offset, DigestHex(box.digest)}));
  }
  return out;
}

Result<std::vector<BoxDigest>> BoxDigestsFromJson(const Json& body, uint32_t rank,
                                                  std::string_view where) {
  if (!body.is_array()) return InvalidArgument("{}: box digests are not a list", where);
  std::vector<BoxDigest> boxes;
  for (size_t i = 0; i < body.size(); ++i) {
    const Json& fields = body[i];
    const std::string what = fmt::format("{}: box digest {}", where, i);
    if (!fields.is_array() || fields.size() != 3 || !fields[0].is_string()) {
      return InvalidArgument("{} is not [tensor, offset, digest]", what);
    }
    BoxDigest box;
    box.tensor = fields[0].get<std::string>();
    REFIT_ASSIGN_OR_RETURN(box.offset, IntegersFromJson(fields[1], what + " offset"));
    REFIT_ASSIGN_OR_RETURN(box.digest, DigestFromHex(fields[2], what + " digest"));
    box.rank = rank;
    boxes.push_back(std::move(box));
  }
  return boxes;
}

}  // namespace refit::internal
