// Verbosity of the library's diagnostic log.
//
// The library logs to stderr through one named logger ("refit"). Its level starts from the
// environment variable REFIT_LOG_LEVEL (read once, at the first log call) and defaults to "warn"
// — the same for the `refit` CLI, a C++ program and the Python package, so that a receiver or a
// trainer is as quiet in a training job as on the command line. SetLogLevel changes it (the
// CLI's `--log-level`, Python's refit.set_log_level).
#pragma once

#include <string_view>

#include "refit/status.h"

namespace refit {

/// Set the level of the library logger: one of "trace", "debug", "info", "warn", "error",
/// "critical", "off" (case-insensitive). Thread-safe; takes effect for every later message.
/// Errors: InvalidArgument naming the value and listing the levels.
Status SetLogLevel(std::string_view level);

/// Return the name of the library logger's current level, e.g. "info". Thread-safe.
std::string_view CurrentLogLevel();

}  // namespace refit
