#include "progress.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

namespace refit {
namespace {

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

TEST(FormatBytesTest, PicksTheUnitAndThreeSignificantDigits) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1), "1 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(kKiB), "1.00 KiB");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(kGiB + kGiB / 2), "1.50 GiB");
  EXPECT_EQ(FormatBytes(12 * kMiB + 3 * kMiB / 10), "12.3 MiB");
  EXPECT_EQ(FormatBytes(310 * kMiB), "310 MiB");
  // Rounding that would print "1024 KiB" moves to the next unit instead.
  EXPECT_EQ(FormatBytes(kMiB - 1), "1.00 MiB");
  EXPECT_EQ(FormatBytes(std::numeric_limits<uint64_t>::max()), "16.0 EiB");
}

TEST(FormatRateTest, AppendsPerSecond) {
  EXPECT_EQ(FormatRate(310.0 * kMiB), "310 MiB/s");
  EXPECT_EQ(FormatRate(512), "512 B/s");
  EXPECT_EQ(FormatRate(0), "0 B/s");
  EXPECT_EQ(FormatRate(-1), "? B/s");
  EXPECT_EQ(FormatRate(std::numeric_limits<double>::infinity()), "? B/s");
}

TEST(FormatDurationTest, PicksTheUnit) {
  EXPECT_EQ(FormatDuration(0), "0 s");
  EXPECT_EQ(FormatDuration(850e-9), "850 ns");
  EXPECT_EQ(FormatDuration(4.5e-6), "4.5 us");
  EXPECT_EQ(FormatDuration(0.045), "45 ms");
  EXPECT_EQ(FormatDuration(0.0045), "4.5 ms");
  EXPECT_EQ(FormatDuration(1.234), "1.23 s");
  EXPECT_EQ(FormatDuration(12.34), "12.3 s");
  EXPECT_EQ(FormatDuration(125), "2 min 05 s");
  EXPECT_EQ(FormatDuration(3720), "1 h 02 min");
  // Values that would round up to 1000 of a unit use the next unit.
  EXPECT_EQ(FormatDuration(0.9999), "1.00 s");
  EXPECT_EQ(FormatDuration(59.99), "1 min 00 s");
  EXPECT_EQ(FormatDuration(-0.045), "-45 ms");
  EXPECT_EQ(FormatDuration(std::numeric_limits<double>::quiet_NaN()), "?");
}

ProgressReporter::Options CapturedOptions(std::ostringstream* out, ProgressMode mode) {
  ProgressReporter::Options options;
  options.label = "compare";
  options.total = 2 * kKiB;
  options.mode = mode;
  options.stream = out;
  return options;
}

TEST(ProgressReporterTest, NeverPrintsNothing) {
  std::ostringstream out;
  ProgressReporter::Options options = CapturedOptions(&out, ProgressMode::kNever);
  options.status_interval_s = 1e-9;
  {
    ASSERT_OK_AND_ASSIGN(auto progress, ProgressReporter::Make(options));
    for (int i = 0; i < 100; ++i) progress->Advance(10);
    progress->Finish();
    EXPECT_EQ(progress->done(), 1000u);
  }
  EXPECT_EQ(out.str(), "");
}

TEST(ProgressReporterTest, AutoIsQuietOffATerminal) {
  std::ostringstream out;
  {
    ASSERT_OK_AND_ASSIGN(auto progress,
                         ProgressReporter::Make(CapturedOptions(&out, ProgressMode::kAuto)));
    progress->Advance(kKiB);
  }
  EXPECT_EQ(out.str(), "");
}

TEST(ProgressReporterTest, AlwaysDrawsABarAndAFinalLine) {
  std::ostringstream out;
  ASSERT_OK_AND_ASSIGN(auto progress,
                       ProgressReporter::Make(CapturedOptions(&out, ProgressMode::kAlways)));
  progress->Advance(kKiB);  // the first Advance draws at once
  progress->Advance(kKiB);
  progress->Finish();
  progress->Finish();  // idempotent
  const std::string text = out.str();
  EXPECT_EQ(text.front(), '\r');
  EXPECT_EQ(text.back(), '\n');
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1) << text;
  const int half = ProgressReporter::kBarWidth / 2;
  const std::string half_bar = "compare [" + std::string(half, '#') +
                               std::string(ProgressReporter::kBarWidth - half, '.') + "] 50% ";
  EXPECT_NE(text.find(half_bar + "1.00 KiB/2.00 KiB "), std::string::npos) << text;
  const std::string final_line = text.substr(text.rfind('\r') + 1);
  EXPECT_EQ(final_line.rfind("compare [" + std::string(ProgressReporter::kBarWidth, '#') +
                                 "] 100% 2.00 KiB/2.00 KiB ",
                             0),
            0u)
      << final_line;
  EXPECT_NE(final_line.find(" in "), std::string::npos) << final_line;
}

TEST(ProgressReporterTest, StatusLinesCountSteps) {
  std::ostringstream out;
  ProgressReporter::Options options;
  options.label = "simulate";
  options.total = 20;
  options.unit = "steps";
  options.status_interval_s = 1e-9;  // a line at every Advance
  options.stream = &out;
  {
    ASSERT_OK_AND_ASSIGN(auto progress, ProgressReporter::Make(options));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    progress->Advance(9);
  }  // the destructor finishes
  const std::string text = out.str();
  EXPECT_EQ(text.find('\r'), std::string::npos) << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2) << text;
  // 45 % of the bar, rounded down.
  const int filled = ProgressReporter::kBarWidth * 45 / 100;
  const std::string bar = "simulate [" + std::string(filled, '#') +
                          std::string(ProgressReporter::kBarWidth - filled, '.') + "] 45% ";
  EXPECT_EQ(text.rfind(bar + "9/20 steps ", 0), 0u) << text;
  EXPECT_NE(text.find("steps/s ETA "), std::string::npos) << text;
}

TEST(ProgressReporterTest, UnknownTotalShowsNoBar) {
  std::ostringstream out;
  ProgressReporter::Options options = CapturedOptions(&out, ProgressMode::kAlways);
  options.total = 0;
  options.label = "";
  ASSERT_OK_AND_ASSIGN(auto progress, ProgressReporter::Make(options));
  progress->Advance(3 * kMiB);
  progress->Finish();
  EXPECT_EQ(out.str().rfind("\r3.00 MiB ", 0), 0u) << out.str();
  EXPECT_EQ(out.str().find('['), std::string::npos) << out.str();
}

TEST(ProgressReporterTest, AdvanceFromManyThreadsSums) {
  constexpr int kThreads = 4;
  constexpr uint64_t kAdvances = 10000;
  std::ostringstream out;
  ProgressReporter::Options options = CapturedOptions(&out, ProgressMode::kAlways);
  options.total = kThreads * kAdvances * 3;
  ASSERT_OK_AND_ASSIGN(auto progress, ProgressReporter::Make(options));
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&] {
        for (uint64_t i = 0; i < kAdvances; ++i) progress->Advance(3);
      });
    }
  }
  EXPECT_EQ(progress->done(), kThreads * kAdvances * 3);
  progress->Finish();
  EXPECT_NE(out.str().find("] 100% "), std::string::npos);
}

TEST(ProgressReporterTest, MakeRejectsBadOptions) {
  ProgressReporter::Options options;
  options.unit = "";
  EXPECT_STATUS(InvalidArgument, ProgressReporter::Make(options));
  options.unit = "B";
  options.status_interval_s = -1;
  EXPECT_STATUS_MSG(InvalidArgument, "status_interval_s -1", ProgressReporter::Make(options));
}

}  // namespace
}  // namespace refit
