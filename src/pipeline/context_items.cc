#include "pipeline/context_items.h"

#include <utility>

#include <fmt/format.h>

#include "codec/locations.h"
#include "refit/status_format.h"

namespace refit::internal {

Result<Item> ContextCodeItem(const ItemView& plain, std::span<const std::byte> old_span,
                             const ContextCodingOptions& options) {
  if (plain.op != Op::kXor || plain.location_encoding == LocationEncoding::kContext) {
    return InvalidArgument(
        "tensor '{}': only a plain xor item can be context-coded, not op {} "
        "with location encoding {}",
        plain.name, OpName(plain.op), LocationEncodingName(plain.location_encoding));
  }
  const uint32_t width = DTypeSize(plain.dtype);
  if (old_span.size() != (plain.span_end - plain.span_begin) * width) {
    return InvalidArgument("tensor '{}': old span of {} bytes for span [{}, {}) of {}", plain.name,
                           old_span.size(), plain.span_begin, plain.span_end,
                           DTypeName(plain.dtype));
  }
  REFIT_ASSIGN_OR_RETURN(std::vector<uint64_t> locations, DecodeAllLocations(plain));
  for (uint64_t& location : locations) location -= plain.span_begin;
  Item coded;
  REFIT_ASSIGN_OR_RETURN(
      coded.locations, EncodeContextCoded(plain.dtype, old_span, locations, plain.values, options));
  coded.name = std::string(plain.name);
  coded.dtype = plain.dtype;
  coded.shape = plain.shape;
  coded.op = Op::kXor;
  coded.value_dtype = plain.value_dtype;
  coded.span_begin = plain.span_begin;
  coded.span_end = plain.span_end;
  coded.count = plain.count;
  coded.location_encoding = LocationEncoding::kContext;
  coded.digest = plain.digest;
  return coded;
}

Result<uint64_t> ItemWireBytes(const ItemView& item, const PayloadEncodeOptions& options) {
  // Ids only need target > base; they do not change the size.
  const PayloadIds ids{TransferId{}, 0, 0, 0, 1};
  REFIT_ASSIGN_OR_RETURN(std::vector<std::byte> payload,
                         EncodePayload(ids, std::span<const ItemView>(&item, 1), options));
  return payload.size() - kPayloadHeaderSize;
}

Result<ItemCodingReport> ChooseItemCoding(std::vector<Item>& items, ItemCoding coding,
                                          std::string_view link_uri,
                                          const PayloadEncodeOptions& payload_options,
                                          const BaselineSpanReader& read_old,
                                          uint32_t decode_threads) {
  ItemCodingReport report;
  if (coding == ItemCoding::kPlain) return report;
  const LinkHint link = LinkHintForTransport(link_uri);
  // On a fast, unpriced link kAuto never context-codes: nothing to measure.
  if (coding == ItemCoding::kAuto && link.bytes_per_s <= 0 && !link.bytes_priced) return report;
  const ContextCodingMode mode =
      coding == ItemCoding::kContext ? ContextCodingMode::kForce : ContextCodingMode::kAuto;
  for (Item& item : items) {
    if (item.op != Op::kXor || item.location_encoding == LocationEncoding::kContext ||
        item.count == 0 || !ContextCodingSupported(item.dtype)) {
      continue;
    }
    const auto context = [&] { return fmt::format("context coding of tensor '{}'", item.name); };
    std::span<const std::byte> old_span;
    Result<bool> held = read_old(item.view(), &old_span);
    if (!held.ok()) return held.status().WithContext(context());
    if (!*held) continue;
    ++report.candidates;
    Result<Item> coded = ContextCodeItem(item.view(), old_span);
    if (!coded.ok()) return coded.status().WithContext(context());
    ContextChoiceInputs inputs;
    inputs.span_bytes = old_span.size();
    inputs.decode_bytes_per_s = kAssumedContextDecodeBytesPerS;
    inputs.decode_threads = decode_threads;
    inputs.link_bytes_per_s = link.bytes_per_s;
    inputs.bytes_priced = link.bytes_priced;
    REFIT_ASSIGN_OR_RETURN(inputs.today_bytes, ItemWireBytes(item.view(), payload_options));
    REFIT_ASSIGN_OR_RETURN(inputs.context_bytes, ItemWireBytes(coded->view(), payload_options));
    report.plain_bytes += inputs.today_bytes;
    if (ChooseContextCoding(mode, /*supported=*/true, inputs)) {
      item = *std::move(coded);
      ++report.context_coded;
      report.sent_bytes += inputs.context_bytes;
    } else {
      report.sent_bytes += inputs.today_bytes;
    }
  }
  return report;
}

}  // namespace refit::internal
