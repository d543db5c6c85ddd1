// Human-facing output: a terminal progress bar, and formatting of byte counts, rates and
// durations. Used by the `refit` CLI and the benchmarks; not part of the library's API.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "refit/status.h"
#include "util/mutex.h"

namespace refit {

/// Return `bytes` in binary units with three significant digits: "512 B", "1.50 KiB",
/// "12.3 MiB", "310 GiB".
std::string FormatBytes(uint64_t bytes);

/// Return a byte rate like FormatBytes plus "/s": "310 MiB/s". Negative or non-finite rates
/// (e.g. bytes over a zero interval) give "? B/s".
std::string FormatRate(double bytes_per_second);

/// Return a duration in the unit that suits it: "850 ns", "4.5 us", "45 ms", "1.23 s", "12.3 s",
/// "2 min 05 s", "1 h 02 min". Negative durations get a leading '-'; non-finite ones give "?".
std::string FormatDuration(double seconds);

/// When a ProgressReporter draws anything.
enum class ProgressMode : uint8_t {
  /// Draw the bar only when the stream is std::cerr, stderr is a terminal and the environment
  /// variable CI is unset (CI logs keep carriage returns as garbage); otherwise stay quiet
  /// except for the optional periodic status lines.
  kAuto,
  /// Always draw the bar (carriage-return redraws), whatever the stream is.
  kAlways,
  /// Never print anything.
  kNever,
};

/// Reports the progress of one long operation (bytes compared, steps simulated).
///
/// On a terminal, a single line is redrawn in place at most kRedrawInterval apart:
///   `label [#############.................] 45% 1.20 GiB/2.60 GiB 310 MiB/s ETA 4s`
/// and Finish() replaces it with a final line ending in the elapsed time. Elsewhere the reporter
/// is quiet unless Options::status_interval_s asks for a plain status line every so often.
/// Redraws happen inside Advance(), so there is no background thread; the rate is the average
/// since Make().
///
/// Thread-safety: Advance() may be called concurrently from any number of threads (an atomic
/// counter; one caller at a time draws, the others skip). Finish() may race with Advance().
class ProgressReporter {
 public:
  /// Options of Make.
  struct Options {
    /// Printed first on every line; may be empty.
    std::string label;
    /// Units of the whole operation; 0 means unknown (no bar, percentage or ETA).
    uint64_t total = 0;
    /// "B" formats amounts and rates as bytes (KiB, MiB, …); any other unit is printed as a
    /// plain count after the numbers, e.g. "9/20 steps".
    std::string unit = "B";
    ProgressMode mode = ProgressMode::kAuto;
    /// When the bar is not drawn and the mode is not kNever: print a status line every this many
    /// seconds (and a final line in Finish()). 0 disables status lines.
    double status_interval_s = 0;
    /// Where to print; null means std::cerr. Not owned; must outlive the reporter.
    std::ostream* stream = nullptr;
  };

  /// Minimum time between two redraws of the bar: ~10 redraws per second look live to a human
  /// and cost nothing next to the work being reported.
  static constexpr std::chrono::milliseconds kRedrawInterval{100};
  /// Width of the bar in characters, between the brackets.
  static constexpr int kBarWidth = 30;

  /// Create a reporter and start its clock. Errors: InvalidArgument for an empty unit or a
  /// negative or non-finite status interval.
  static Result<std::unique_ptr<ProgressReporter>> Make(Options options);

  /// Finish() if not done yet, so a terminal line always gets its newline.
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  /// Add `units` done; redraw if the last draw is old enough. Thread-safe, lock-free unless it
  /// draws.
  void Advance(uint64_t units);

  /// Print the final line (bar or status mode) and stop drawing. Idempotent; later Advance()
  /// calls still count but print nothing.
  void Finish();

  /// Return the units done so far.
  uint64_t done() const { return done_.load(std::memory_order_relaxed); }

 private:
  enum class Style : uint8_t { kQuiet, kBar, kStatusLines };
  using Clock = std::chrono::steady_clock;

  ProgressReporter(Options options, Style style);
  // Return the line for `done` units after `elapsed_s` seconds; `final` shows the elapsed time
  // instead of an ETA.
  std::string RenderLine(uint64_t done, double elapsed_s, bool final) const;
  // Print the current state.
  void DrawLocked(bool final) REFIT_REQUIRES(draw_mutex_);

  const Options options_;
  const Style style_;
  const Clock::time_point start_;
  const int64_t draw_interval_ns_;
  std::atomic<uint64_t> done_{0};
  // Clock::time_point of the next allowed draw, in ns since start_; whoever advances it draws.
  std::atomic<int64_t> next_draw_ns_{0};
  internal::Mutex draw_mutex_;
  bool finished_ REFIT_GUARDED_BY(draw_mutex_) = false;
  // Blanks a longer previous bar.
  size_t last_line_bytes_ REFIT_GUARDED_BY(draw_mutex_) = 0;
};

}  // namespace refit
