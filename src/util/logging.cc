#include "util/logging.h"

#include <array>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include "refit/status_format.h"

namespace refit {
namespace internal {
namespace {

// The accepted level names, in increasing severity, paired with spdlog's levels. spdlog's own
// from_str() maps every unknown name to "off", which would silence a typo instead of reporting it.
constexpr std::array<std::pair<std::string_view, spdlog::level::level_enum>, 7> kLevels = {{
    {"trace", spdlog::level::trace},
    {"debug", spdlog::level::debug},
    {"info", spdlog::level::info},
    {"warn", spdlog::level::warn},
    {"error", spdlog::level::err},
    {"critical", spdlog::level::critical},
    {"off", spdlog::level::off},
}};

// kLevels is indexed by spdlog's level value, so a level's name is a table lookup.
constexpr bool LevelsIndexedByValue() {
  for (size_t i = 0; i < kLevels.size(); ++i) {
    if (static_cast<size_t>(kLevels[i].second) != i) return false;
  }
  return kLevels.size() == spdlog::level::n_levels;
}
static_assert(LevelsIndexedByValue(), "kLevels must list every spdlog level in value order");

std::string_view LevelName(spdlog::level::level_enum level) {
  return kLevels[static_cast<size_t>(level)].first;
}

// "warn": progress that needs a user's attention (a rank group waiting long, a receiver that
// did not confirm a commit) is logged at warn; the per-transfer lines at info are for debugging.
constexpr spdlog::level::level_enum kDefaultLevel = spdlog::level::warn;
constexpr const char* kLevelEnvVar = "REFIT_LOG_LEVEL";
// Wall time to the millisecond, level (coloured on a TTY), logger name, thread id, message.
constexpr const char* kPattern = "[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] [%n] [tid %t] %v";

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

std::shared_ptr<spdlog::logger> CreateLogger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("refit", std::move(sink));
  logger->set_pattern(kPattern);
  logger->set_level(kDefaultLevel);
  if (const char* env = std::getenv(kLevelEnvVar); env != nullptr && *env != '\0') {
    Result<spdlog::level::level_enum> level = ParseLogLevel(env);
    if (level.ok()) {
      logger->set_level(*level);
    } else {
      logger->warn("{}: {}; using '{}'", kLevelEnvVar, level.status().message(),
                   LevelName(kDefaultLevel));
    }
  }
  return logger;
}

}  // namespace

spdlog::logger& Logger() {
  static const std::shared_ptr<spdlog::logger> logger = CreateLogger();
  return *logger;
}

Result<spdlog::level::level_enum> ParseLogLevel(std::string_view name) {
  for (const auto& [level_name, level] : kLevels) {
    if (EqualsIgnoreCase(name, level_name)) return level;
  }
  std::string names;
  for (const auto& entry : kLevels) {
    if (!names.empty()) names += ", ";
    names += entry.first;
  }
  return InvalidArgument("log level '{}' is not one of {}", name, names);
}

}  // namespace internal

Status SetLogLevel(std::string_view level) {
  REFIT_ASSIGN_OR_RETURN(spdlog::level::level_enum parsed, internal::ParseLogLevel(level));
  internal::Logger().set_level(parsed);
  return Status::OK();
}

std::string_view CurrentLogLevel() { return internal::LevelName(internal::Logger().level()); }

}  // namespace refit
