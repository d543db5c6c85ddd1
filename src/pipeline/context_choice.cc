#include "pipeline/context_choice.h"

#include <algorithm>

#include "refit/status_format.h"
#include "refit/stream_options.h"

namespace refit::internal {
namespace {

/// Rates assumed for links nothing was measured on. An object store's single-stream PUT + GET
/// through the s3 transport runs at a few hundred MB/s on a LAN test server and well under that
/// across regions (docs/benchmark-results.md, s3_bench); a shared filesystem drop is written and
/// read back. Both are far below a fabric's, which is counted as fast (0).
constexpr double kObjectStoreBytesPerSecond = 200e6;
constexpr double kSharedFilesystemBytesPerSecond = 500e6;

}  // namespace

Result<ContextCodingMode> ParseContextCodingMode(std::string_view text) {
  if (text == "auto") return ContextCodingMode::kAuto;
  if (text == "force") return ContextCodingMode::kForce;
  if (text == "forbid") return ContextCodingMode::kForbid;
  return InvalidArgument("context coding mode '{}': expected auto, force or forbid", text);
}

bool ContextCodingPays(const ContextChoiceInputs& inputs) {
  const auto today = static_cast<double>(inputs.today_bytes);
  const auto context = static_cast<double>(inputs.context_bytes);
  if (context > (1 - kContextMinSaving) * today) return false;
  if (inputs.bytes_priced) return true;
  if (inputs.decode_bytes_per_s <= 0 || inputs.link_bytes_per_s <= 0) return false;
  const double decode_seconds =
      static_cast<double>(inputs.span_bytes) /
      (inputs.decode_bytes_per_s * std::max<uint32_t>(inputs.decode_threads, 1));
  return std::max(context / inputs.link_bytes_per_s, decode_seconds) <
         today / inputs.link_bytes_per_s;
}

bool ChooseContextCoding(ContextCodingMode mode, bool supported,
                         const ContextChoiceInputs& inputs) {
  if (!supported) return false;
  switch (mode) {
    case ContextCodingMode::kForce:
      return true;
    case ContextCodingMode::kForbid:
      return false;
    case ContextCodingMode::kAuto:
      break;
  }
  return ContextCodingPays(inputs);
}

LinkHint LinkHintForTransport(std::string_view transport_uri) {
  constexpr std::string_view kFault = "fault+";
  if (transport_uri.starts_with(kFault)) transport_uri.remove_prefix(kFault.size());
  if (transport_uri.starts_with("s3://")) return {kObjectStoreBytesPerSecond, true};
  if (transport_uri.starts_with("file://")) return {kSharedFilesystemBytesPerSecond, false};
  return {};
}

}  // namespace refit::internal

namespace refit {

std::string_view ItemCodingName(ItemCoding coding) {
  switch (coding) {
    case ItemCoding::kAuto:
      return "auto";
    case ItemCoding::kContext:
      return "context";
    case ItemCoding::kPlain:
      return "plain";
  }
  return "unknown";
}

Result<ItemCoding> ParseItemCoding(std::string_view name) {
  for (ItemCoding coding : {ItemCoding::kAuto, ItemCoding::kContext, ItemCoding::kPlain}) {
    if (ItemCodingName(coding) == name) return coding;
  }
  return InvalidArgument("item_coding '{}' is not one of auto, context, plain", name);
}

}  // namespace refit
