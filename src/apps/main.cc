// refit — the command-line front end. One file per subcommand; public API only.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "cli_common.h"
#include "refit/logging.h"
#include "refit/version.h"

int main(int argc, char** argv) {
  CLI::App app{
      "refit: keep inference workers bit-identical to an RL trainer by sending only the "
      "weights that changed"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "refit " + std::string(refit::VersionString()));
  // Without the flag the level is the library's: REFIT_LOG_LEVEL, else "warn" (as in Python).
  std::string log_level;
  CLI::Option* log_level_flag = app.add_option(
      "--log-level", log_level,
      "trace, debug, info, warn, error, critical or off (default: $REFIT_LOG_LEVEL, else warn)");
  app.parse_complete_callback([&] {
    if (log_level_flag->count() == 0) return;
    refit::Status st = refit::SetLogLevel(log_level);
    if (!st.ok()) throw CLI::ValidationError("--log-level", st.message());
  });

  refit::Status result;
  refit::cli::RegisterDemo(app, &result);
  refit::cli::RegisterServe(app, &result);
  refit::cli::RegisterPush(app, &result);
  refit::cli::RegisterStatus(app, &result);
  refit::cli::RegisterJoin(app, &result);
  refit::cli::RegisterAbort(app, &result);
  refit::cli::RegisterKeygen(app, &result);
  refit::cli::RegisterDiff(app, &result);
  refit::cli::RegisterEncode(app, &result);
  refit::cli::RegisterApply(app, &result);
  refit::cli::RegisterInspect(app, &result);
  refit::cli::RegisterSimulate(app, &result);
  refit::cli::RegisterEstimate(app, &result);
  refit::cli::RegisterRawCopySink(app, &result);

  CLI11_PARSE(app, argc, argv);
  if (!result.ok()) {
    std::fprintf(stderr, "refit: %s\n", result.ToString().c_str());
    return 1;
  }
  return 0;
}
