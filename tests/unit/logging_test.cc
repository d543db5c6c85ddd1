#include "refit/logging.h"

#include <gtest/gtest.h>

#include <string_view>

#include "test_util.h"
#include "util/logging.h"

namespace refit {
namespace {

TEST(LoggingTest, SetLogLevelAcceptsEveryLevelCaseInsensitively) {
  for (std::string_view level : {"trace", "debug", "info", "warn", "error", "critical", "off"}) {
    ASSERT_OK(SetLogLevel(level));
    EXPECT_EQ(CurrentLogLevel(), level);
  }
  ASSERT_OK(SetLogLevel("DeBuG"));
  EXPECT_EQ(CurrentLogLevel(), "debug");
  EXPECT_EQ(internal::Logger().level(), spdlog::level::debug);
  ASSERT_OK(SetLogLevel("info"));
}

TEST(LoggingTest, SetLogLevelRejectsUnknownNamesAndKeepsTheLevel) {
  ASSERT_OK(SetLogLevel("warn"));
  EXPECT_STATUS_MSG(
      InvalidArgument,
      "log level 'verbose' is not one of trace, debug, info, warn, error, critical, off",
      SetLogLevel("verbose"));
  EXPECT_STATUS(InvalidArgument, SetLogLevel(""));
  EXPECT_EQ(CurrentLogLevel(), "warn");
  ASSERT_OK(SetLogLevel("info"));
}

TEST(LoggingTest, DisabledLevelsDoNotEvaluateArguments) {
  ASSERT_OK(SetLogLevel("error"));
  int evaluated = 0;
  auto count = [&] { return ++evaluated; };
  REFIT_LOG_TRACE("trace {}", count());
  REFIT_LOG_DEBUG("debug {}", count());
  REFIT_LOG_INFO("info {}", count());
  REFIT_LOG_WARN("warn {}", count());
  EXPECT_EQ(evaluated, 0);
  // Enabled: evaluated exactly once (the line goes to stderr).
  REFIT_LOG_ERROR("logging test: an enabled line evaluates its arguments once ({})", count());
  EXPECT_EQ(evaluated, 1);
  ASSERT_OK(SetLogLevel("info"));
}

}  // namespace
}  // namespace refit
