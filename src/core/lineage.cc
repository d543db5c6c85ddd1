#include "refit/lineage.h"

#include <charconv>
#include <optional>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include "refit/status_format.h"

namespace refit {
namespace {

// Parse all of `text` as an unsigned integer in `base`; nullopt for anything else.
std::optional<uint64_t> ParseWhole(std::string_view text, int base) {
  uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value, base);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) {
    return std::nullopt;
  }
  return value;
}

}  // namespace

std::map<std::string, std::string> LineageMetadata(const HeldLineage& lineage) {
  std::map<std::string, std::string> metadata;
  if (!lineage.run_id.empty()) {
    metadata[kLineageRunMetadataKey] = lineage.run_id;
    metadata[kLineageEpochMetadataKey] = std::to_string(lineage.epoch);
  }
  if (lineage.fingerprint != 0) {
    metadata[kLineageFingerprintMetadataKey] = fmt::format("{:016x}", lineage.fingerprint);
  }
  return metadata;
}

Result<HeldLineage> LineageFromMetadata(const std::map<std::string, std::string>& metadata) {
  HeldLineage lineage;
  if (auto run = metadata.find(kLineageRunMetadataKey); run != metadata.end()) {
    lineage.run_id = run->second;
  }
  if (auto epoch = metadata.find(kLineageEpochMetadataKey); epoch != metadata.end()) {
    std::optional<uint64_t> parsed = ParseWhole(epoch->second, 10);
    if (!parsed.has_value()) {
      return InvalidArgument("metadata '{}': '{}' is not an epoch (a decimal integer)",
                             kLineageEpochMetadataKey, epoch->second);
    }
    lineage.epoch = *parsed;
  }
  if (auto fingerprint = metadata.find(kLineageFingerprintMetadataKey);
      fingerprint != metadata.end()) {
    std::optional<uint64_t> parsed = ParseWhole(fingerprint->second, 16);
    if (!parsed.has_value()) {
      return InvalidArgument("metadata '{}': '{}' is not a fingerprint (hexadecimal)",
                             kLineageFingerprintMetadataKey, fingerprint->second);
    }
    lineage.fingerprint = *parsed;
  }
  return lineage;
}

std::string DescribeLineage(const HeldLineage& lineage) {
  if (lineage.run_id.empty()) return "no lineage";
  return fmt::format("run '{}' epoch {}", lineage.run_id, lineage.epoch);
}

}  // namespace refit
