// refit status URL: ask a receiver's control plane (GET /v1/status) where it stands — with
// whether it may serve (readiness) — as a table or as JSON; with --members, ask a publisher's
// membership endpoint (GET /v1/members) for the fleet: each member's version, lag, how it last
// caught up and its bytes.
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "cli_common.h"
#include "progress.h"
#include "refit/control_client.h"
#include "refit/membership.h"
#include "refit/readiness.h"
#include "refit/status_format.h"
#include "table.h"

namespace refit::cli {
namespace {

struct StatusArgs {
  std::string url;
  std::string api_key_env;
  bool json = false;
  bool members = false;
};

// What a table cell shows for a value that does not apply (no open transfer, no error).
constexpr const char* kNone = "-";

std::string FingerprintHex(uint64_t fingerprint) { return fmt::format("{:016x}", fingerprint); }

Table StatusTable(const std::string& url, const ControlStatus& status) {
  const ReceiverStatus& receiver = status.receiver;
  Table table({"receiver", url});
  std::string state(ReceiverStateName(receiver.state));
  if (receiver.sealed) state += " (sealed)";
  table.AddRow({"state", state});
  table.AddRow({"version", std::to_string(receiver.version)});
  table.AddRow({"transfer", receiver.transfer_id.has_value()
                                ? fmt::format("{} ({} -> {})", receiver.transfer_id->ToHex(),
                                              receiver.base_version, receiver.target_version)
                                : kNone});
  table.AddRow({"staged", std::to_string(receiver.staged_payloads)});
  table.AddRow({"applied", std::to_string(receiver.applied_payloads)});
  table.AddRow({"queued", std::to_string(receiver.queued_payloads)});
  table.AddRow({"duplicates", std::to_string(receiver.duplicate_payloads)});
  table.AddRow({"undo log", FormatBytes(receiver.undo_bytes)});
  table.AddRow({"received", fmt::format("{} payloads, {}", receiver.received_payloads,
                                        FormatBytes(receiver.received_bytes))});
  // Tensors behind the device boundary: what crossed it, each way (docs/architecture.md).
  if (receiver.device_to_bytes > 0 || receiver.device_from_bytes > 0) {
    table.AddRow(
        {"device traffic", fmt::format("{} to, {} from", FormatBytes(receiver.device_to_bytes),
                                       FormatBytes(receiver.device_from_bytes))});
  }
  if (status.readiness.has_value()) {
    const Readiness& readiness = *status.readiness;
    table.AddRow({"ready", readiness.ready
                               ? std::string("yes")
                               : fmt::format("no ({}): {}", ReadinessReasonName(readiness.reason),
                                             readiness.detail)});
    table.AddRow({"fleet version", readiness.fleet_version.has_value()
                                       ? std::to_string(*readiness.fleet_version)
                                       : std::string("- (not heard yet)")});
    table.AddRow({"last catch-up", readiness.last_catch_up.has_value()
                                       ? std::string(CatchUpName(*readiness.last_catch_up))
                                       : kNone});
    table.AddRow({"member of", readiness.publisher_url.empty() ? kNone : readiness.publisher_url});
  }
  table.AddRow({"last error", receiver.last_error.ok() ? kNone : receiver.last_error.ToString()});
  table.AddRow({"replica", status.place.replica.empty()
                               ? std::string("- (a replica of its own)")
                               : fmt::format("'{}', shard {} of {}", status.place.replica,
                                             status.place.shard, status.place.shards)});
  table.AddRow({"tensors", std::to_string(status.tensors)});
  table.AddRow({"state fingerprint", status.state_fingerprint.has_value()
                                         ? FingerprintHex(*status.state_fingerprint)
                                         : "- (unavailable while receiving)"});
  return table;
}

// The fleet as a publisher's membership endpoint lists it, one row per member.
Table MembersTable(const FleetMembership& membership) {
  Table table(
      {"member", "data endpoint", "version", "lag", "caught up by", "bytes", "missed", "fenced"});
  for (const MemberStanding& member : membership.members) {
    table.AddRow(
        {member.endpoint.control_url, member.endpoint.data_endpoint,
         member.version.has_value() ? std::to_string(*member.version) : kNone,
         member.version.has_value() ? std::to_string(member.lag) : kNone,
         member.caught_up_by.has_value() ? std::string(CatchUpName(*member.caught_up_by)) : kNone,
         member.version.has_value() ? FormatBytes(member.wire_bytes) : kNone,
         std::to_string(member.missed_syncs), member.fenced ? "yes" : "no"});
  }
  return table;
}

Status RunMembers(const StatusArgs& args, ControlClient& client) {
  Result<FleetMembership> membership = client.GetMembership();
  if (!membership.ok()) {
    return ExplainReceiverError(membership.status(), "status --members", args.url,
                                args.api_key_env);
  }
  if (args.json) {
    std::cout << ControlMembershipToJson(*membership) << std::endl;
    return Status::OK();
  }
  std::cout << fmt::format("fleet of {}: version {}, {} member(s)", client.base_url(),
                           membership->fleet_version.has_value()
                               ? std::to_string(*membership->fleet_version)
                               : std::string("unknown"),
                           membership->members.size())
            << std::endl;
  MembersTable(*membership).Print(std::cout);
  return Status::OK();
}

Status RunStatus(const StatusArgs& args) {
  Result<ControlClientOptions> options = ControlClientOptionsFor(args.url, args.api_key_env);
  if (!options.ok()) return options.status().WithContext("status");
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client, ControlClient::Make(*options));
  if (args.members) return RunMembers(args, *client);
  Result<ControlStatus> status = client->GetStatus();
  if (!status.ok()) {
    return ExplainReceiverError(status.status(), "status", args.url, args.api_key_env);
  }
  if (args.json) {
    std::cout << ControlStatusToJson(*status) << std::endl;
  } else {
    StatusTable(client->base_url(), *status).Print(std::cout);
  }
  return Status::OK();
}

}  // namespace

void RegisterStatus(CLI::App& app, Status* result) {
  auto args = std::make_shared<StatusArgs>();
  CLI::App* cmd =
      app.add_subcommand("status",
                         "Show a receiver's state, version, readiness, transfer and fingerprint, "
                         "or (--members) a publisher's fleet");
  cmd->add_option("URL", args->url, "The receiver's control URL, e.g. http://127.0.0.1:8470")
      ->required();
  cmd->add_option("--api-key-env", args->api_key_env,
                  "Environment variable holding the receiver's api key");
  cmd->add_flag("--json", args->json, "Print the status as one JSON object");
  cmd->add_flag("--members", args->members,
                "URL is a publisher's membership endpoint: list the fleet's members, each "
                "one's version, lag, how it last caught up and its bytes");
  cmd->callback([args, result] { *result = RunStatus(*args); });
}

}  // namespace refit::cli
