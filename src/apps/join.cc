// refit join: make a receiver join (or, with --leave, leave) a publisher's fleet with one call —
// the receiver's own POST /v1/join, which announces it to the publisher's membership endpoint
// with the fleet's key (docs/protocol.md "Admission").
#include <iostream>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "cli_common.h"
#include "refit/control_client.h"
#include "refit/membership.h"
#include "refit/status_format.h"

namespace refit::cli {
namespace {

struct JoinArgs {
  std::string receiver;
  std::string publisher;
  std::string advertise_control;
  std::string advertise_data;
  std::string api_key_env;
  bool leave = false;
};

void PrintMembership(const FleetMembership& membership) {
  std::cout << fmt::format("fleet version {}, {} member(s)",
                           membership.fleet_version.has_value()
                               ? std::to_string(*membership.fleet_version)
                               : std::string("unknown"),
                           membership.members.size())
            << std::endl;
  for (const MemberStanding& member : membership.members) {
    std::cout << "  " << member.endpoint.control_url << "  " << member.endpoint.data_endpoint
              << std::endl;
  }
}

Status RunJoin(const JoinArgs& args) {
  const std::string command = args.leave ? "join --leave" : "join";
  Result<ControlClientOptions> options = ControlClientOptionsFor(args.receiver, args.api_key_env);
  if (!options.ok()) return options.status().WithContext(command);
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client, ControlClient::Make(*options));
  Result<FleetMembership> membership =
      args.leave ? client->LeaveFleet()
                 : client->JoinFleet(args.publisher,
                                     MemberEndpoint{args.advertise_control, args.advertise_data});
  if (!membership.ok()) {
    return ExplainReceiverError(membership.status(), command, args.receiver, args.api_key_env);
  }
  std::cout << fmt::format("{} {} {}", args.receiver, args.leave ? "left the fleet of" : "joined",
                           args.leave ? std::string("its publisher") : args.publisher)
            << std::endl;
  PrintMembership(*membership);
  return Status::OK();
}

}  // namespace

void RegisterJoin(CLI::App& app, Status* result) {
  auto args = std::make_shared<JoinArgs>();
  CLI::App* cmd = app.add_subcommand(
      "join",
      "Make a receiver join a publisher's fleet (or leave it with --leave): it takes part from "
      "the next sync, caught up on its own");
  cmd->add_option("--receiver", args->receiver,
                  "The receiver's control URL, e.g. http://127.0.0.1:8470")
      ->required();
  CLI::Option* publisher =
      cmd->add_option("--publisher", args->publisher,
                      "The publisher's membership URL (rank 0's; Publisher.membership_url), e.g. "
                      "http://10.0.0.2:8480");
  cmd->add_option("--advertise-control", args->advertise_control,
                  "The control URL the publisher reaches the receiver at, if not its own");
  cmd->add_option("--advertise-data", args->advertise_data,
                  "The data endpoint the publisher sends to, if not the receiver's own");
  cmd->add_option("--api-key-env", args->api_key_env,
                  "Environment variable holding the fleet's api key (the receiver presents its "
                  "own to the publisher)");
  CLI::Option* leave = cmd->add_flag("--leave", args->leave, "Leave the fleet joined last");
  publisher->excludes(leave);
  cmd->callback([args, result] {
    if (!args->leave && args->publisher.empty()) {
      *result = InvalidArgument("join: --publisher URL is required (or --leave)");
      return;
    }
    *result = RunJoin(*args);
  });
}

}  // namespace refit::cli
