// The producer-group protocol: the messages rank 0 and the other trainer ranks exchange during
// one Publisher::Sync (refit/publisher.h), as JSON over the group's Broadcast and Gather.
//
//   rank 0 broadcasts                       every rank answers (Gather)
//   propose {layouts_known}                 {version, version_known, wants_anchor, open,
//                                            sharded, layout_digest, layout (when not known)}
//   begin {transfer_id, anchor, versions,   {ok} once its tracker opened the plan
//          endpoints, roles and full_ranks
//          (sharded)}
//   stream                                  {report, digests | boxes (sharded)}
//   commit | abort {transfer_id}            {ok}
//
// Every message carries "protocol": ranks of different builds refuse each other instead of
// misreading. Digests are 16 hex digits (a uint64 does not survive every JSON number). Parsing
// never throws: each field's type is checked once, in ParseMessage, and every error names the
// rank and the field.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "pipeline/coordinator.h"
#include "pipeline/producer_stream.h"
#include "refit/producer_layout.h"
#include "refit/status.h"
#include "refit/transfer.h"

namespace refit::internal {

using Json = nlohmann::json;

inline constexpr std::string_view kOpPropose = "propose";
inline constexpr std::string_view kOpBegin = "begin";
inline constexpr std::string_view kOpStream = "stream";
inline constexpr std::string_view kOpCommit = "commit";
inline constexpr std::string_view kOpAbort = "abort";
/// The version of this exchange. 2: sharded syncs (layouts, roles, box digests). 3: routes
/// (routing by holdings: each stream message names the routes, each report counts per route).
inline constexpr int kGroupProtocolVersion = 3;

/// A message of `op`, with the protocol version.
Json GroupMessage(std::string_view op);
/// Parse a message from `where` (e.g. "rank 3"): an object, every known field of its type, the
/// same protocol version. Errors: InvalidArgument naming the field; FailedPrecondition for
/// another protocol version.
Result<Json> ParseGroupMessage(const std::string& text, std::string_view where);

/// {"ok": true} or {"ok": false, "code", "message"}, and back (naming `where`).
Json StatusToJson(const Status& status);
Status StatusFromJson(const Json& body, std::string_view where);

std::string DigestHex(uint64_t digest);
Result<uint64_t> DigestFromHex(const Json& hex, std::string_view what);
Json DigestsToJson(const std::map<std::string, uint64_t>& digests);
Result<std::map<std::string, uint64_t>> DigestsFromJson(const Json& body, std::string_view where);

Json StreamReportToJson(const StreamReport& report);
StreamReport StreamReportFromJson(const Json& body);
/// The routes of a stream message: [{"endpoints": [...], "regions": {...} | null}, ...] (what each
/// rank needs of a TransferRoute: where to send and what to cut; not the receiver indices).
Json RoutesToJson(std::span<const TransferRoute> routes);
/// Parse RoutesToJson's list. Errors: InvalidArgument naming `where` and the route (a malformed
/// route or held region, rectangles ItemRoute refuses).
Result<std::vector<TransferRoute>> RoutesFromJson(const Json& body, std::string_view where);
Result<TransferPlan> PlanFromJson(const Json& body);

/// A rank's layout: one array per piece, [tensor, dtype, shape, offset, extent, local,
/// local_shape, local_offset].
Json LayoutToJson(const ProducerLayout& layout);
Result<ProducerLayout> LayoutFromJson(const Json& body, std::string_view where);
/// The digest that names a layout in the propose exchange (rank 0 keeps the layouts it has).
uint64_t LayoutDigest(const ProducerLayout& layout);

/// A rank's roles, one character per piece of its layout: 's' send, 'c' copy, 'e' empty.
std::string RolesToString(std::span<const PieceRole> roles);
Result<std::vector<PieceRole>> RolesFromString(std::string_view text, size_t pieces,
                                               std::string_view where);

/// The box digests a rank reports after its stream: [[tensor, offset, digest hex], …].
Json BoxDigestsToJson(std::span<const BoxDigest> boxes);
Result<std::vector<BoxDigest>> BoxDigestsFromJson(const Json& body, uint32_t rank,
                                                  std::string_view where);

}  // namespace refit::internal
