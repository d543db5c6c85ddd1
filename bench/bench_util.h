// What the end-to-end benchmarks (e2e_bench, s3_bench) share: flag parsing, pre-flight checks of
// disk and memory, a monotonic clock, progress reporting and medians. The child processes they
// start (daemons, producer ranks) and their memory figures are refit_testing's (src/testing).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "progress.h"
#include "refit/status.h"

namespace refit::bench {

/// Seconds on the steady clock.
double Now();

/// `text` as a non-negative decimal integer. Errors: InvalidArgument naming `flag`.
Result<uint64_t> ParseUnsigned(std::string_view flag, std::string_view text);

/// `text` as a changed fraction in (0, 1], or (0, 1) when `allow_one` is false (a simulator
/// calibrated to a density cannot change every element). Errors: InvalidArgument naming `flag`.
Result<double> ParseDensity(std::string_view flag, std::string_view text, bool allow_one);

/// The comma-separated parts of `text` (an empty part for each empty field).
std::vector<std::string_view> SplitCommas(std::string_view text);

/// MemAvailable from /proc/meminfo, in bytes. Errors: NotFound without that line.
Result<uint64_t> AvailableMemoryBytes();

/// Check that `dir` can take `disk_bytes` more and that `memory_bytes` are available.
/// `memory_use` says what the memory is for and `how_to_shrink` which flags make the run
/// smaller; both go into the ResourceExhausted error.
Status CheckRoom(const std::string& dir, uint64_t disk_bytes, uint64_t memory_bytes,
                 std::string_view memory_use, std::string_view how_to_shrink);

/// A progress reporter (quiet when not on a TTY), or null when one cannot be made.
std::unique_ptr<ProgressReporter> Progress(const std::string& label, uint64_t total,
                                           const std::string& unit);

/// The median of `values` (the mean of the middle two for an even count; 0 for none).
double Median(std::vector<double> values);

}  // namespace refit::bench
