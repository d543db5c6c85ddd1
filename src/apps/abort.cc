// refit abort: roll a receiver's open transfer back to its base version, bit-exactly — for a
// receiver left receiving or prepared by a coordinator that died (a killed `refit push`). By
// default the open transfer is read from the receiver's status; --transfer names one.
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "cli_common.h"
#include "refit/control_client.h"

namespace refit::cli {
namespace {

struct AbortArgs {
  std::string url;
  std::string transfer;
  std::string api_key_env;
};

Status RunAbort(const AbortArgs& args) {
  Result<ControlClientOptions> options = ControlClientOptionsFor(args.url, args.api_key_env);
  if (!options.ok()) return options.status().WithContext("abort");
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client, ControlClient::Make(*options));
  TransferId id;
  if (!args.transfer.empty()) {
    Result<TransferId> given = TransferId::FromHex(args.transfer);
    if (!given.ok()) return given.status().WithContext("abort: --transfer");
    id = *given;
  } else {
    Result<ControlStatus> status = client->GetStatus();
    if (!status.ok()) {
      return ExplainReceiverError(status.status(), "abort", args.url, args.api_key_env);
    }
    if (!status->receiver.transfer_id.has_value()) {
      std::cout << fmt::format("{} is idle at version {}: nothing to abort\n", args.url,
                               status->receiver.version);
      return Status::OK();
    }
    id = *status->receiver.transfer_id;
  }
  if (const Status aborted = client->Abort(id); !aborted.ok()) {
    return ExplainReceiverError(aborted, "abort", args.url, args.api_key_env);
  }
  REFIT_ASSIGN_OR_RETURN(const ControlStatus after, client->GetStatus());
  std::cout << fmt::format("aborted transfer {} on {}: {} at version {}\n", id.ToHex(), args.url,
                           ReceiverStateName(after.receiver.state), after.receiver.version);
  return Status::OK();
}

}  // namespace

void RegisterAbort(CLI::App& app, Status* result) {
  auto args = std::make_shared<AbortArgs>();
  CLI::App* cmd = app.add_subcommand(
      "abort",
      "Roll a receiver's open transfer back to its base version (after its coordinator died)");
  cmd->add_option("URL", args->url, "The receiver's control URL, e.g. http://127.0.0.1:8081")
      ->required();
  cmd->add_option("--transfer", args->transfer,
                  "The transfer id (32 hex digits; default: the receiver's open transfer)");
  cmd->add_option("--api-key-env", args->api_key_env,
                  "Environment variable holding the receiver's api key");
  cmd->callback([args, result] { *result = RunAbort(*args); });
}

}  // namespace refit::cli
