// refit raw-copy-sink: the receiving process of the raw-copy yardstick (src/apps/raw_copy.h) that
// `refit demo` and the benchmarks start, one per receiver. Not meant to be run by hand, so not
// listed in --help.
#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "cli_common.h"
#include "raw_copy.h"

namespace refit::cli {

void RegisterRawCopySink(CLI::App& app, Status* result) {
  struct SinkArgs {
    std::string endpoint;
    uint64_t bytes = 0;
    std::string ready_file;
    std::string result_file;
  };
  auto args = std::make_shared<SinkArgs>();
  CLI::App* cmd =
      app.add_subcommand("raw-copy-sink",
                         "Receive the raw-copy yardstick's bytes (started by refit demo and the "
                         "benchmarks)");
  // An empty group hides the subcommand from --help.
  cmd->group("");
  cmd->add_option("--endpoint", args->endpoint, "tcp://host:port to bind")->required();
  cmd->add_option("--bytes", args->bytes, "Bytes to receive")->required();
  cmd->add_option("--ready-file", args->ready_file, "Written once bound")->required();
  cmd->add_option("--result-file", args->result_file, "What arrived, as JSON")->required();
  cmd->callback([args, result] {
    *result =
        RunRawCopySinkCommand(args->endpoint, args->bytes, args->ready_file, args->result_file);
  });
}

}  // namespace refit::cli
