// libFuzzer target for the control plane's request bodies (POST /v1/prepare, /v1/flush,
// /v1/commit, /v1/abort): hostile bytes must come back as a Status, never a crash or an exception.
//
// The route handlers (ControlServer::Impl::Prepare/Flush/Commit/Abort) interleave field reads
// with session calls, so they cannot be called alone. This target replays exactly the parsing they
// do, from the shared wire contract (control/protocol.h): ParseJson, CheckObject against the
// route's field list, then the route's field reads in the handler's order. Keep it in step with
// control_server.cc.
//
// Input layout: byte 0 selects the route (value % 4: prepare, flush, commit, abort); the rest is
// the request body.
//
// Invariants: a body that parses re-serializes (the way ControlClient builds it) to a body that
// passes the same checks and parses to the same request; every error body the server would send
// (ErrorBody + DumpJson) is itself valid JSON.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "control/protocol.h"
#include "refit/payload.h"
#include "refit/transfer.h"

namespace {

using refit::internal::Json;
using refit::internal::JsonFields;

enum class Route : uint8_t { kPrepare, kFlush, kCommit, kAbort };

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "control_request_fuzz: %s\n", what);
  std::abort();
}

void Check(bool condition, const char* what) {
  if (!condition) Fail(what);
}

// What a request parses to; fields a route does not read stay at their defaults.
struct Request {
  refit::TransferId transfer_id;
  uint64_t base_version = 0;
  bool anchor = false;
  std::optional<uint64_t> timeout_ms;
  refit::TransferExpectation expected;

  friend bool operator==(const Request&, const Request&) = default;
};

std::span<const std::string_view> FieldsOf(Route route) {
  switch (route) {
    case Route::kPrepare:
      return refit::internal::kPrepareFields;
    case Route::kFlush:
      return refit::internal::kFlushFields;
    default:
      return refit::internal::kTransferOnlyFields;
  }
}

// ControlServer::Impl::PostJson, then the route handler's field reads.
refit::Result<Request> ParseRequest(Route route, std::string_view text) {
  REFIT_ASSIGN_OR_RETURN(const Json body, refit::internal::ParseJson(text, "request body"));
  const JsonFields fields(body, "request body");
  REFIT_RETURN_NOT_OK(fields.CheckObject(FieldsOf(route)));
  Request request;
  REFIT_ASSIGN_OR_RETURN(request.transfer_id, fields.Transfer("transfer_id"));
  if (route == Route::kPrepare) {
    REFIT_ASSIGN_OR_RETURN(request.base_version, fields.Uint("base_version"));
    if (fields.Has("anchor")) {
      REFIT_ASSIGN_OR_RETURN(request.anchor, fields.Bool("anchor"));
    }
    REFIT_ASSIGN_OR_RETURN(request.expected, refit::internal::GetExpectation(fields));
  } else if (route == Route::kFlush) {
    REFIT_ASSIGN_OR_RETURN(request.timeout_ms, fields.OptionalUint("timeout_ms"));
    REFIT_ASSIGN_OR_RETURN(request.expected, refit::internal::GetExpectation(fields));
  }
  return request;
}

// The body ControlClient sends for `request`.
std::string SerializeRequest(Route route, const Request& request) {
  Json body{{"transfer_id", request.transfer_id.ToHex()}};
  if (route == Route::kPrepare) {
    body["base_version"] = request.base_version;
    if (request.anchor) body["anchor"] = true;
    refit::internal::PutExpectation(request.expected, body);
  } else if (route == Route::kFlush) {
    if (request.timeout_ms.has_value()) body["timeout_ms"] = *request.timeout_ms;
    refit::internal::PutExpectation(request.expected, body);
  }
  return refit::internal::DumpJson(body);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const auto route = static_cast<Route>(data[0] % 4);
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  refit::Result<Request> parsed = ParseRequest(route, text);
  if (!parsed.ok()) {
    Check(parsed.status().code() == refit::StatusCode::kInvalidArgument,
          "a request error that is not InvalidArgument");
    // The reply the server sends: the message echoes hostile field names and values.
    const std::string reply =
        refit::internal::DumpJson(refit::internal::ErrorBody(parsed.status()));
    Check(refit::internal::ParseJson(reply, "error body").ok(), "an error body that is not JSON");
    return 0;
  }
  const std::string again = SerializeRequest(route, *parsed);
  refit::Result<Request> reparsed = ParseRequest(route, again);
  if (!reparsed.ok()) {
    std::fprintf(stderr, "control_request_fuzz: %s\n  %s\n", again.c_str(),
                 reparsed.status().ToString().c_str());
    Fail("the client's body for a parsed request does not parse");
  }
  Check(*reparsed == *parsed, "a request does not survive serialize -> parse");
  Check(SerializeRequest(route, *reparsed) == again, "serialization is not canonical");
  return 0;
}
