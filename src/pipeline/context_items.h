// The producer's side of context-coded items (payload format v2): an XOR item coded given the
// old span the producer's baseline holds, and the per-item choice between that and the plain
// item (context_choice.h) as ProducerStreamOptions::item_coding asks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "codec/context_coding.h"
#include "pipeline/context_choice.h"
#include "refit/item.h"
#include "refit/payload.h"
#include "refit/status.h"
#include "refit/stream_options.h"

namespace refit::internal {

/// The receiver's context decode rate assumed by kAuto, in bytes of old span per second on one
/// core: the decode of bench/context_bench.cc on the real bf16 AdamW pairs was 0.7–1.1 GB/s on
/// the development machine (shared; docs/benchmark-results.md). A low estimate errs towards plain
/// items.
inline constexpr double kAssumedContextDecodeBytesPerS = 0.7e9;

/// Return `plain` (an XOR item, any location encoding but `context`, values present) coded as a
/// context item against `old_span` (the span's old elements): same tensor, span, count and
/// digest, LocationEncoding::kContext, no values. Errors: InvalidArgument for another op, an
/// unsupported dtype, or an old span of another length.
Result<Item> ContextCodeItem(const ItemView& plain, std::span<const std::byte> old_span,
                             const ContextCodingOptions& options = {});

/// Return the bytes `item` adds to a payload on the wire: one item's payload encoded with
/// `options`, less the fixed header (the table entry, locations and values after zstd).
Result<uint64_t> ItemWireBytes(const ItemView& item, const PayloadEncodeOptions& options);

/// What ChooseItemCoding decided for one batch of items.
struct ItemCodingReport {
  /// Items looked at (XOR items of a supported dtype with a known old span), and of those the
  /// ones sent context-coded.
  uint64_t candidates = 0;
  uint64_t context_coded = 0;
  /// Estimated wire bytes of the candidates plain, and as sent.
  uint64_t plain_bytes = 0;
  uint64_t sent_bytes = 0;
};

/// Reads an item's old span into `out`; false: the producer does not hold it (stays plain).
using BaselineSpanReader =
    std::function<Result<bool>(const ItemView& item, std::span<const std::byte>* old_span)>;

/// Replace, in place, the XOR items of `items` that `coding` says to context-code: kPlain none;
/// kContext every candidate; kAuto those ContextCodingPays chooses, with the link hint of
/// `link_uri`, kAssumedContextDecodeBytesPerS and `decode_threads`, and both encodings' wire bytes
/// measured (ItemWireBytes; skipped altogether on a fast, unpriced link). Errors: the reader's and
/// the coder's (InvalidArgument), naming the item.
Result<ItemCodingReport> ChooseItemCoding(std::vector<Item>& items, ItemCoding coding,
                                          std::string_view link_uri,
                                          const PayloadEncodeOptions& payload_options,
                                          const BaselineSpanReader& read_old,
                                          uint32_t decode_threads = 1);

}  // namespace refit::internal
