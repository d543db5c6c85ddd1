// The wire contract of the HTTP control plane, shared by ControlServer and ControlClient: route
// paths, header names, the JSON shape of every request and response, and the mapping between
// StatusCode and HTTP status codes. Keeping both ends on one definition means a field renamed on
// one side cannot silently go missing on the other.
//
// JSON conventions: transfer ids are 32 lower-case hex digits, state digests 16 (a uint64 does not
// survive JSON numbers in every client), counts are non-negative integers. Every success body has
// "ok": true; every error body is {"ok": false, "code": "<StatusCodeName>", "message": "…"}.
// Parsing never throws: nlohmann is used with exceptions off at every access, and every field
// error names the field.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "receiver/receiver_session.h"
#include "refit/control_client.h"
#include "refit/membership.h"
#include "refit/readiness.h"
#include "refit/status.h"

namespace refit::internal {

using Json = nlohmann::json;

inline constexpr std::string_view kPreparePath = "/v1/prepare";
inline constexpr std::string_view kFlushPath = "/v1/flush";
inline constexpr std::string_view kCommitPath = "/v1/commit";
inline constexpr std::string_view kAbortPath = "/v1/abort";
inline constexpr std::string_view kPayloadPath = "/v1/payload";
inline constexpr std::string_view kManifestPath = "/v1/manifest";
inline constexpr std::string_view kRegionsPath = "/v1/regions";
inline constexpr std::string_view kStatusPath = "/v1/status";
/// GET: the list of the store's tensors (ControlClient::ListTensors).
inline constexpr std::string_view kTensorsPath = "/v1/tensors";
/// Followed by the percent-encoded tensor name.
inline constexpr std::string_view kTensorsPathPrefix = "/v1/tensors/";
inline constexpr std::string_view kMetricsPath = "/metrics";
inline constexpr std::string_view kHealthPath = "/healthz";
/// Readiness (refit/readiness.h): 200 when the receiver may serve, 503 otherwise; no key needed.
inline constexpr std::string_view kReadyPath = "/ready";
/// A receiver's own join and leave (ReceiverNode::Join, Leave), and a publisher's membership
/// endpoint (refit/membership.h).
inline constexpr std::string_view kJoinPath = "/v1/join";
inline constexpr std::string_view kLeavePath = "/v1/leave";
inline constexpr std::string_view kMembersPath = "/v1/members";
inline constexpr std::string_view kMembersJoinPath = "/v1/members/join";
inline constexpr std::string_view kMembersLeavePath = "/v1/members/leave";

/// The alternative to "Authorization: Bearer <key>", for clients that cannot set Authorization.
inline constexpr std::string_view kApiKeyHeader = "X-Refit-Api-Key";
/// Tensor download headers: canonical dtype name, shape as a JSON array, state digest (hex).
inline constexpr std::string_view kDtypeHeader = "X-Refit-Dtype";
inline constexpr std::string_view kShapeHeader = "X-Refit-Shape";
inline constexpr std::string_view kDigestHeader = "X-Refit-Digest";
/// The committed version the downloaded tensor belongs to.
inline constexpr std::string_view kVersionHeader = "X-Refit-Version";

inline constexpr std::string_view kJsonContentType = "application/json";
inline constexpr std::string_view kOctetStreamContentType = "application/octet-stream";

/// Return the HTTP status that reports `code` (OK → 200).
int HttpStatusFor(StatusCode code);
/// Return the StatusCode for an HTTP error status whose body carries no code (e.g. from a proxy).
StatusCode StatusCodeForHttp(int http_status);

/// Serialize `value` compactly. Strings that are not valid UTF-8 (a hostile tensor name echoed in
/// an error message) are written with U+FFFD instead of throwing.
std::string DumpJson(const Json& value);
/// The deepest nesting of arrays and objects ParseJson accepts. refit's messages nest a few
/// levels; the bound refuses junk such as a body of '[' before the parser allocates for it.
inline constexpr size_t kMaxJsonDepth = 32;

/// Parse `text` as one JSON value without throwing. Errors: InvalidArgument naming `what` and the
/// size, for text that is not JSON or nests deeper than kMaxJsonDepth (checked first, without
/// allocating).
Result<Json> ParseJson(std::string_view text, std::string_view what);
/// Return {"ok": false, "code": …, "message": …}.
Json ErrorBody(const Status& status);

/// Return `digest` as 16 lower-case hex digits.
std::string DigestToHex(uint64_t digest);
/// Parse exactly 16 hex digits. Errors: InvalidArgument naming `what` and the text.
Result<uint64_t> DigestFromHex(std::string_view hex, std::string_view what);

/// Field access of a JSON object with errors that name the field as "<where>.<field>".
/// Every accessor returns InvalidArgument for a missing required field or a wrong JSON type.
class JsonFields {
 public:
  /// `where` names the object in messages, e.g. "request body" or "expected".
  JsonFields(const Json& object, std::string where) : object_(object), where_(std::move(where)) {}

  /// Check that the value is an object whose keys are all in `known` (a misspelt optional field
  /// would otherwise be ignored silently).
  Status CheckObject(std::span<const std::string_view> known) const;

  bool Has(std::string_view field) const;
  /// The value of a present field, or nullptr. Precondition: CheckObject passed.
  const Json* Find(std::string_view field) const;

  Result<std::string> String(std::string_view field) const;
  Result<uint64_t> Uint(std::string_view field) const;
  Result<std::optional<uint64_t>> OptionalUint(std::string_view field) const;
  Result<bool> Bool(std::string_view field) const;
  Result<TransferId> Transfer(std::string_view field) const;
  Result<std::optional<TransferId>> OptionalTransfer(std::string_view field) const;
  /// An object of name → 16-hex-digit digest; absent or null → empty.
  Result<std::map<std::string, uint64_t>> Digests(std::string_view field) const;
  /// The name of `field` in messages: "<where>.<field>".
  std::string Name(std::string_view field) const;

  /// The value of a field that must be present. Errors: InvalidArgument naming it.
  Result<const Json*> Require(std::string_view field) const;

 private:
  const Json& object_;
  std::string where_;
};

/// Write the payload counts of `expected` as "expected": {"producers": {"<id>": n}, "total": n}
/// and its digests as "expected_digests" into `body` (fields left empty are omitted).
void PutExpectation(const TransferExpectation& expected, Json& body);
/// Read what PutExpectation wrote. Errors: InvalidArgument naming the field.
Result<TransferExpectation> GetExpectation(const JsonFields& body);

/// Write `tree` as "relay_tree": {"endpoints": [...], "position": n} into `body`.
void PutRelayTree(const RelayTree& tree, Json& body);
/// Read what PutRelayTree wrote, if present: at most kMaxRelayTreeEndpoints endpoints, each a
/// non-empty string, none twice, and a position among them. Errors: InvalidArgument naming the
/// field.
Result<std::optional<RelayTree>> GetRelayTree(const JsonFields& body);
/// Write `lineage` as "lineage": {"run_id": s, "epoch": n, "base_fingerprint": "<hex>"} into
/// `body` (docs/protocol.md "Lineage and fencing"); nothing when it states none (no run id and no
/// fingerprint), which is also what a coordinator older than lineages sends.
void PutLineage(const TransferLineage& lineage, Json& body);
/// Read what PutLineage wrote; absent: none stated. Errors: InvalidArgument naming the field (a
/// run id over kMaxRunIdBytes bytes, an epoch or fingerprint of the wrong type).
Result<TransferLineage> GetLineage(const JsonFields& body);
/// The longest run id a lineage may carry: room for any UUID or job name, bounded so that a
/// prepare cannot make a receiver keep (and save) an arbitrarily long string.
inline constexpr size_t kMaxRunIdBytes = 256;
/// The most receivers one relay tree names: far more than a fleet has, few enough that a prepare
/// cannot make a relay hold an unbounded list.
inline constexpr size_t kMaxRelayTreeEndpoints = size_t{1} << 16;

/// The request fields of each route (what CheckObject accepts).
inline constexpr std::array<std::string_view, 8> kPrepareFields = {
    "transfer_id",      "base_version", "anchor",         "expected",
    "expected_digests", "relay_tree",   "target_version", "lineage"};
inline constexpr std::array<std::string_view, 4> kFlushFields = {"transfer_id", "timeout_ms",
                                                                 "expected", "expected_digests"};
inline constexpr std::array<std::string_view, 1> kTransferOnlyFields = {"transfer_id"};
/// An abort; with "fenced_at_version" a fence (ReceiverControl::Fence): the fleet holds that
/// version without this receiver.
inline constexpr std::array<std::string_view, 2> kAbortFields = {"transfer_id",
                                                                 "fenced_at_version"};
inline constexpr std::array<std::string_view, 1> kRegionsFields = {"tensors"};
/// The most rectangles one tensor's held region may list (a loader's layout has a few).
inline constexpr size_t kMaxRegionRects = 4096;

/// The canonical tensor names of a POST /v1/regions request ("tensors": [names]).
/// Errors: InvalidArgument naming the field (not a list of 0 to kMaxRegionTensors non-empty
/// strings).
Result<std::vector<std::string>> GetRegionTensors(const JsonFields& body);
/// Write `regions` as {"regions": {name: {"skipped": bool, "cols": n, "rects": [[r0, r1, c0, c1],
/// ...]}}}.
Json RegionsToJson(const HeldRegions& regions);
/// Parse RegionsToJson's reply. Errors: InvalidArgument naming the field.
Result<HeldRegions> RegionsFromJson(const Json& body);

Json FlushReportToJson(const FlushReport& report);
Result<FlushReport> FlushReportFromJson(const Json& body);

/// The receiver's status plus what the control plane adds: the tensor count and the state
/// fingerprint (absent while the store cannot be read).
struct ControlStatusFields {
  ReceiverStatus receiver;
  uint64_t tensors = 0;
  std::optional<uint64_t> state_fingerprint;
  ReplicaPlace place;
  std::optional<RelayPlace> relay = std::nullopt;
  /// Whether it may serve (absent from receivers older than readiness).
  std::optional<Readiness> readiness = std::nullopt;
};
Json StatusToJson(const ControlStatusFields& status);
Result<ControlStatusFields> StatusFromJson(const Json& body);

/// GET /v1/tensors's body, and its parse. Errors: InvalidArgument naming the field (a dtype the
/// build does not know, a negative extent, a malformed digest).
Json TensorListingToJson(const TensorListing& listing);
Result<TensorListing> TensorListingFromJson(const Json& body);

/// Percent-encode `text` for one URL path segment: every byte except the RFC 3986 unreserved
/// characters (A–Z a–z 0–9 - . _ ~) becomes %XX, so names with '/', '?', '#', '%' or spaces
/// survive the trip.
std::string PercentEncode(std::string_view text);

// ---- Readiness and membership (docs/protocol.md "Admission"). ---------------------------------

/// The fields of a readiness object: {"ready", "reason", "detail", "version", "fleet_version",
/// "last_catch_up", "publisher_url"}; StatusToJson writes them at the top level of the status too.
void PutReadiness(const Readiness& readiness, Json& body);
/// Parse what PutReadiness wrote. Errors: InvalidArgument naming the field.
Result<Readiness> ReadinessFromJson(const JsonFields& fields);

/// The body of POST /v1/members/join and /v1/members/leave: {"control_url", "data_endpoint"}
/// (leave needs only control_url).
inline constexpr std::array<std::string_view, 2> kMemberFields = {"control_url", "data_endpoint"};
/// The body of a receiver's POST /v1/join: the publisher's membership URL, and optionally the
/// addresses to advertise instead of the node's own.
inline constexpr std::array<std::string_view, 3> kJoinFields = {"publisher_url", "control_url",
                                                                "data_endpoint"};
Json MemberEndpointToJson(const MemberEndpoint& member);
/// Errors: InvalidArgument naming the field: a missing or empty control_url, one that is not
/// http(s)://; a data_endpoint that is not a string (`need_data`: it must be present).
Result<MemberEndpoint> MemberEndpointFromJson(const JsonFields& fields, bool need_data);
Json MembershipToJson(const FleetMembership& membership);
Result<FleetMembership> MembershipFromJson(const Json& body);

}  // namespace refit::internal
