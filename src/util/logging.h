// The library logger: a thin spdlog wrapper. Library code logs with REFIT_LOG_INFO(...) etc.,
// which take fmt-style format strings checked at compile time and do not evaluate their
// arguments when the level is disabled.
#pragma once

#include <string_view>

#include <spdlog/logger.h>

#include "refit/logging.h"
#include "refit/status.h"

namespace refit::internal {

/// Return the library logger, creating it on first use: it writes to stderr (coloured only on a
/// TTY) with time, level and thread id, at the level named by the environment variable
/// REFIT_LOG_LEVEL (default "warn"; an unknown name falls back to "warn" with a warning). It is not
/// registered in spdlog's global registry, so an application's own "refit" logger cannot clash with
/// it.
///
/// Thread-safety: the logger is thread-safe (a mutex-protected sink); creation is a
/// function-local static, so concurrent first calls are safe.
spdlog::logger& Logger();

/// Return the spdlog level named `name` (case-insensitive). Errors: InvalidArgument naming the
/// value and listing the accepted names.
Result<spdlog::level::level_enum> ParseLogLevel(std::string_view name);

}  // namespace refit::internal

#define REFIT_LOG_AT_LEVEL(level, ...)                                          \
  do {                                                                          \
    ::spdlog::logger& _refit_logger = ::refit::internal::Logger();              \
    if (_refit_logger.should_log(level)) _refit_logger.log(level, __VA_ARGS__); \
  } while (false)

#define REFIT_LOG_TRACE(...) REFIT_LOG_AT_LEVEL(::spdlog::level::trace, __VA_ARGS__)
#define REFIT_LOG_DEBUG(...) REFIT_LOG_AT_LEVEL(::spdlog::level::debug, __VA_ARGS__)
#define REFIT_LOG_INFO(...) REFIT_LOG_AT_LEVEL(::spdlog::level::info, __VA_ARGS__)
#define REFIT_LOG_WARN(...) REFIT_LOG_AT_LEVEL(::spdlog::level::warn, __VA_ARGS__)
#define REFIT_LOG_ERROR(...) REFIT_LOG_AT_LEVEL(::spdlog::level::err, __VA_ARGS__)
