#include "progress.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string_view>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "util/mutex.h"

namespace refit {
namespace {

constexpr double kBytesPerUnit = 1024.0;
// Switch to the next unit once a value would print as 1024 or more after rounding to whole
// units, so "1024 KiB" reads "1.00 MiB".
constexpr double kNextUnitThreshold = kBytesPerUnit - 0.5;
constexpr std::array<std::string_view, 7> kByteUnits = {"B",   "KiB", "MiB", "GiB",
                                                        "TiB", "PiB", "EiB"};
constexpr double kSecondsPerMinute = 60.0;
constexpr double kSecondsPerHour = 3600.0;
constexpr uint64_t kWholeSecondsPerMinute = 60;
constexpr uint64_t kWholeSecondsPerHour = 3600;
// An ETA beyond this many seconds (~30 years) means "no meaningful estimate".
constexpr double kMaxEtaSeconds = 1e9;
constexpr double kPercent = 100.0;

// Three significant digits for values in [0, 1024): "1.50", "12.3", "310". The thresholds sit
// where rounding would add a digit (9.995 prints as "10.00").
std::string FormatSignificant(double value) {
  if (value < 9.995) return fmt::format("{:.2f}", value);
  if (value < 99.95) return fmt::format("{:.1f}", value);
  return fmt::format("{:.0f}", value);
}

// `bytes` (non-negative, finite) in the largest binary unit that keeps it below 1024.
std::string FormatScaledBytes(double bytes) {
  size_t unit = 0;
  while (bytes >= kNextUnitThreshold && unit + 1 < kByteUnits.size()) {
    bytes /= kBytesPerUnit;
    ++unit;
  }
  // Whole bytes have no fractional digits.
  if (unit == 0) return fmt::format("{:.0f} B", bytes);
  return fmt::format("{} {}", FormatSignificant(bytes), kByteUnits[unit]);
}

// A sub-second amount of `unit`: one decimal below 10 ("4.5 ms"), whole numbers above ("45 ms").
std::string FormatSubSecond(double value, std::string_view unit) {
  if (value < 9.95) return fmt::format("{:.1f} {}", value, unit);
  return fmt::format("{:.0f} {}", value, unit);
}

// A compact ETA in whole seconds, rounded up: "4s", "2m05s", "1h02m".
std::string FormatEta(double seconds) {
  if (!std::isfinite(seconds) || seconds > kMaxEtaSeconds) return "?";
  const auto total = static_cast<uint64_t>(std::ceil(std::max(seconds, 0.0)));
  if (total < kWholeSecondsPerMinute) return fmt::format("{}s", total);
  if (total < kWholeSecondsPerHour) {
    return fmt::format("{}m{:02}s", total / kWholeSecondsPerMinute, total % kWholeSecondsPerMinute);
  }
  return fmt::format("{}h{:02}m", total / kWholeSecondsPerHour,
                     total % kWholeSecondsPerHour / kWholeSecondsPerMinute);
}

}  // namespace

std::string FormatBytes(uint64_t bytes) { return FormatScaledBytes(static_cast<double>(bytes)); }

std::string FormatRate(double bytes_per_second) {
  if (!std::isfinite(bytes_per_second) || bytes_per_second < 0) return "? B/s";
  return FormatScaledBytes(bytes_per_second) + "/s";
}

std::string FormatDuration(double seconds) {
  if (!std::isfinite(seconds)) return "?";
  // fmt rather than "-" + string: GCC 12 -O3 warns falsely (-Wrestrict) on the latter.
  if (seconds < 0) return fmt::format("-{}", FormatDuration(-seconds));
  if (seconds == 0) return "0 s";
  // Each threshold is where the smaller unit would round to 1000.
  if (seconds < 999.5e-9) return FormatSubSecond(seconds * 1e9, "ns");
  if (seconds < 999.5e-6) return FormatSubSecond(seconds * 1e6, "us");
  if (seconds < 0.9995) return FormatSubSecond(seconds * 1e3, "ms");
  if (seconds < 9.995) return fmt::format("{:.2f} s", seconds);
  if (seconds < kSecondsPerMinute - 0.05) return fmt::format("{:.1f} s", seconds);
  if (seconds < kSecondsPerHour - 0.5) {
    const double whole = std::round(seconds);
    const double minutes = std::floor(whole / kSecondsPerMinute);
    return fmt::format("{:.0f} min {:02.0f} s", minutes, whole - minutes * kSecondsPerMinute);
  }
  const double whole_minutes = std::round(seconds / kSecondsPerMinute);
  const double hours = std::floor(whole_minutes / kSecondsPerMinute);
  return fmt::format("{:.0f} h {:02.0f} min", hours, whole_minutes - hours * kSecondsPerMinute);
}

Result<std::unique_ptr<ProgressReporter>> ProgressReporter::Make(Options options) {
  if (options.unit.empty()) return InvalidArgument("progress '{}': unit is empty", options.label);
  if (!std::isfinite(options.status_interval_s) || options.status_interval_s < 0) {
    return InvalidArgument("progress '{}': status_interval_s {} is not a finite value >= 0",
                           options.label, options.status_interval_s);
  }
  if (options.stream == nullptr) options.stream = &std::cerr;
  Style style = Style::kQuiet;
  switch (options.mode) {
    case ProgressMode::kNever:
      style = Style::kQuiet;
      break;
    case ProgressMode::kAlways:
      style = Style::kBar;
      break;
    case ProgressMode::kAuto: {
      const bool terminal = options.stream == &std::cerr && isatty(STDERR_FILENO) == 1 &&
                            std::getenv("CI") == nullptr;
      if (terminal) {
        style = Style::kBar;
      } else if (options.status_interval_s > 0) {
        style = Style::kStatusLines;
      }
      break;
    }
  }
  // Not make_unique: the constructor is private.
  return std::unique_ptr<ProgressReporter>(new ProgressReporter(std::move(options), style));
}

ProgressReporter::ProgressReporter(Options options, Style style)
    : options_(std::move(options)),
      style_(style),
      start_(Clock::now()),
      draw_interval_ns_(style == Style::kStatusLines
                            ? static_cast<int64_t>(options_.status_interval_s * 1e9)
                            : std::chrono::nanoseconds(kRedrawInterval).count()) {
  // The bar appears at the first Advance(); status lines only once an interval has passed.
  if (style_ == Style::kStatusLines) next_draw_ns_.store(draw_interval_ns_);
}

ProgressReporter::~ProgressReporter() { Finish(); }

void ProgressReporter::Advance(uint64_t units) {
  done_.fetch_add(units, std::memory_order_relaxed);
  if (style_ == Style::kQuiet) return;
  const int64_t now_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start_).count();
  int64_t next_ns = next_draw_ns_.load(std::memory_order_relaxed);
  if (now_ns < next_ns) return;
  // Only the caller that moves the deadline draws; concurrent callers skip instead of queueing
  // on the mutex.
  if (!next_draw_ns_.compare_exchange_strong(next_ns, now_ns + draw_interval_ns_,
                                             std::memory_order_relaxed)) {
    return;
  }
  internal::MutexLock lock(draw_mutex_);
  if (!finished_) DrawLocked(/*final=*/false);
}

void ProgressReporter::Finish() {
  internal::MutexLock lock(draw_mutex_);
  if (finished_) return;
  finished_ = true;
  if (style_ != Style::kQuiet) DrawLocked(/*final=*/true);
}

void ProgressReporter::DrawLocked(bool final) {
  const double elapsed_s = std::chrono::duration<double>(Clock::now() - start_).count();
  const std::string line = RenderLine(done(), elapsed_s, final);
  std::ostream& out = *options_.stream;
  if (style_ == Style::kBar) {
    out << '\r' << line;
    if (line.size() < last_line_bytes_) out << std::string(last_line_bytes_ - line.size(), ' ');
    last_line_bytes_ = line.size();
    if (final) out << '\n';
  } else {
    out << line << '\n';
  }
  out.flush();
}

std::string ProgressReporter::RenderLine(uint64_t done, double elapsed_s, bool final) const {
  const bool bytes = options_.unit == "B";
  const uint64_t total = options_.total;
  std::string line;
  if (!options_.label.empty()) line = options_.label + " ";
  if (total > 0) {
    const double fraction = std::min(1.0, static_cast<double>(done) / static_cast<double>(total));
    const int filled = static_cast<int>(fraction * kBarWidth);
    line +=
        fmt::format("[{}{}] {}% ", std::string(filled, '#'), std::string(kBarWidth - filled, '.'),
                    static_cast<int>(fraction * kPercent));
    line += bytes ? fmt::format("{}/{}", FormatBytes(done), FormatBytes(total))
                  : fmt::format("{}/{} {}", done, total, options_.unit);
  } else {
    line += bytes ? FormatBytes(done) : fmt::format("{} {}", done, options_.unit);
  }
  const double rate = elapsed_s > 0 ? static_cast<double>(done) / elapsed_s : NAN;
  if (bytes) {
    line += " " + FormatRate(rate);
  } else {
    line += std::isfinite(rate) ? fmt::format(" {} {}/s", FormatSignificant(rate), options_.unit)
                                : fmt::format(" ? {}/s", options_.unit);
  }
  if (final) {
    line += " in " + FormatDuration(elapsed_s);
  } else if (total > done && rate > 0) {
    line += " ETA " + FormatEta(static_cast<double>(total - done) / rate);
  }
  return line;
}

}  // namespace refit
