// libFuzzer target for the control-plane replies ControlClient parses: a hostile or broken server
// must make the client fail with a Status, never crash or throw.
//
// FlushReportFromJson and StatusFromJson (control/protocol.h) are called as the client calls
// them. The client's envelope check (ParseSuccessBody, control_client.cc) and its reads of the
// prepare / commit / abort / payload replies live in an anonymous namespace or inline in
// ControlClient's methods, so this target replays those reads from the same JsonFields accessors;
// keep it in step with control_client.cc.
//
// Input layout: byte 0 selects the reply (value % 5: prepare, flush, commit/abort, payload,
// status); the rest is the reply body.
//
// Invariants: a parsed flush report or status re-serializes (the server's FlushReportToJson /
// StatusToJson) to a body that parses to the same value, and that serialization is canonical.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "control/protocol.h"
#include "refit/payload.h"
#include "refit/status_format.h"
#include "refit/transfer.h"

namespace {

using refit::internal::Json;
using refit::internal::JsonFields;

enum class Reply : uint8_t { kPrepare, kFlush, kVersion, kPayload, kStatus };

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "control_response_fuzz: %s\n", what);
  std::abort();
}

void Check(bool condition, const char* what) {
  if (!condition) Fail(what);
}

// ParseSuccessBody: valid JSON with "ok": true.
refit::Result<Json> ParseSuccess(std::string_view text) {
  REFIT_ASSIGN_OR_RETURN(Json body, refit::internal::ParseJson(text, "reply"));
  const JsonFields fields(body, "reply");
  REFIT_ASSIGN_OR_RETURN(const bool ok, fields.Bool("ok"));
  if (!ok) return refit::DataLoss("reply lacks \"ok\": true");
  return body;
}

void CheckFlushReport(const Json& body) {
  refit::Result<refit::FlushReport> report = refit::internal::FlushReportFromJson(body);
  if (!report.ok()) return;
  const std::string text = refit::internal::DumpJson(refit::internal::FlushReportToJson(*report));
  refit::Result<Json> again = refit::internal::ParseJson(text, "flush report");
  Check(again.ok(), "FlushReportToJson wrote invalid JSON");
  refit::Result<refit::FlushReport> reparsed = refit::internal::FlushReportFromJson(*again);
  Check(reparsed.ok(), "FlushReportToJson wrote a report FlushReportFromJson refuses");
  Check(*reparsed == *report, "a flush report does not survive serialize -> parse");
  Check(refit::internal::DumpJson(refit::internal::FlushReportToJson(*reparsed)) == text,
        "FlushReportToJson is not canonical");
}

bool SameStatus(const refit::internal::ControlStatusFields& a,
                const refit::internal::ControlStatusFields& b) {
  const refit::ReceiverStatus& x = a.receiver;
  const refit::ReceiverStatus& y = b.receiver;
  return x.state == y.state && x.version == y.version && x.transfer_id == y.transfer_id &&
         x.base_version == y.base_version && x.target_version == y.target_version &&
         x.sealed == y.sealed && x.staged_payloads == y.staged_payloads &&
         x.applied_payloads == y.applied_payloads && x.queued_payloads == y.queued_payloads &&
         x.duplicate_payloads == y.duplicate_payloads && x.undo_bytes == y.undo_bytes &&
         x.last_error.code() == y.last_error.code() &&
         x.last_error.message() == y.last_error.message() && a.tensors == b.tensors &&
         a.state_fingerprint == b.state_fingerprint && a.place == b.place;
}

void CheckStatus(const Json& body) {
  refit::Result<refit::internal::ControlStatusFields> status =
      refit::internal::StatusFromJson(body);
  if (!status.ok()) return;
  Check(status->place.shards > 0 && status->place.shard < status->place.shards,
        "StatusFromJson accepted a shard outside [0, shards)");
  const std::string text = refit::internal::DumpJson(refit::internal::StatusToJson(*status));
  refit::Result<Json> again = refit::internal::ParseJson(text, "status");
  Check(again.ok(), "StatusToJson wrote invalid JSON");
  refit::Result<refit::internal::ControlStatusFields> reparsed =
      refit::internal::StatusFromJson(*again);
  Check(reparsed.ok(), "StatusToJson wrote a status StatusFromJson refuses");
  Check(SameStatus(*reparsed, *status), "a status does not survive serialize -> parse");
  Check(refit::internal::DumpJson(refit::internal::StatusToJson(*reparsed)) == text,
        "StatusToJson is not canonical");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const auto reply = static_cast<Reply>(data[0] % 5);
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  refit::Result<Json> body = ParseSuccess(text);
  if (!body.ok()) return 0;
  const JsonFields fields(*body, "reply");
  switch (reply) {
    case Reply::kPrepare: {
      // ControlClient::Prepare.
      if (!fields.Bool("repeated").ok()) return 0;
      (void)fields.OptionalTransfer("implied_commit");
      break;
    }
    case Reply::kFlush:
      CheckFlushReport(*body);
      break;
    case Reply::kVersion:
      // Commit and Abort only check the envelope; the version is for logs.
      (void)fields.OptionalUint("version");
      break;
    case Reply::kPayload: {
      // ControlClient::SendPayload.
      refit::Result<std::string> result = fields.String("result");
      if (result.ok()) (void)(*result == "accepted" || *result == "duplicate");
      break;
    }
    case Reply::kStatus:
      CheckStatus(*body);
      break;
  }
  return 0;
}
