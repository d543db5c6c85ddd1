#include "bench_util.h"

#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "refit/status_format.h"

namespace refit::bench {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Result<uint64_t> ParseUnsigned(std::string_view flag, std::string_view text) {
  uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) {
    return InvalidArgument("{}: '{}' is not a non-negative integer", flag, text);
  }
  return value;
}

Result<double> ParseDensity(std::string_view flag, std::string_view text, bool allow_one) {
  double value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  const bool in_range = value > 0 && (allow_one ? value <= 1 : value < 1);
  if (error != std::errc() || end != text.data() + text.size() || !in_range) {
    return InvalidArgument("{}: '{}' is not a changed fraction in (0, 1{}", flag, text,
                           allow_one ? "]" : ")");
  }
  return value;
}

std::vector<std::string_view> SplitCommas(std::string_view text) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    parts.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return parts;
}

Result<uint64_t> AvailableMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return NotFound("/proc/meminfo has no MemAvailable line");
}

Status CheckRoom(const std::string& dir, uint64_t disk_bytes, uint64_t memory_bytes,
                 std::string_view memory_use, std::string_view how_to_shrink) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) return IoErrorFromErrno(errno, "statvfs " + dir);
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (free_bytes < disk_bytes) {
    return ResourceExhausted(
        "work dir {} has {} free but the model files need {}: pass --work-dir on a bigger "
        "filesystem or {}",
        dir, FormatBytes(free_bytes), FormatBytes(disk_bytes), how_to_shrink);
  }
  REFIT_ASSIGN_OR_RETURN(uint64_t available, AvailableMemoryBytes());
  if (available < memory_bytes) {
    return ResourceExhausted("the run needs about {} of memory ({}) but MemAvailable is {}: {}",
                             FormatBytes(memory_bytes), memory_use, FormatBytes(available),
                             how_to_shrink);
  }
  return Status::OK();
}

std::unique_ptr<ProgressReporter> Progress(const std::string& label, uint64_t total,
                                           const std::string& unit) {
  ProgressReporter::Options options;
  options.label = label;
  options.total = total;
  options.unit = unit;
  Result<std::unique_ptr<ProgressReporter>> made = ProgressReporter::Make(options);
  return made.ok() ? std::move(made).ValueOrDie() : nullptr;
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const size_t middle = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + middle, values.end());
  if (values.size() % 2 == 1) return values[middle];
  const double upper = values[middle];
  return 0.5 * (upper + *std::max_element(values.begin(), values.begin() + middle));
}

}  // namespace refit::bench
