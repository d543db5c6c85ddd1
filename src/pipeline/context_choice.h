// ContextCodingPays: whether a producer should send an item context-coded
// (src/codec/context_coding.h) rather than with today's encodings — smaller by a margin, and the
// link slow enough that the bytes saved outweigh the receiver's extra pass over the old span.
//
// Pure functions of their inputs: the producer supplies the sizes (both encodings of the item),
// the receiver's context decode rate (a calibration, e.g. bench/context_bench.cc's or
// `refit estimate`'s) and the link's rate, which a transport URI hints at (LinkHintForTransport)
// where nothing was measured. The producer stream and `refit encode` call it per item through
// ChooseItemCoding (context_items.h); payload format v2 carries the chosen items.
#pragma once

#include <cstdint>
#include <string_view>

#include "refit/status.h"

namespace refit::internal {

/// How the producer treats context coding (the value of a `delta_compression` setting).
enum class ContextCodingMode : uint8_t {
  /// Context-code an item when ContextCodingPays says so.
  kAuto = 0,
  /// Context-code every item whose dtype supports it (tests, measurements).
  kForce = 1,
  /// Never.
  kForbid = 2,
};

/// Parse "auto", "force" or "forbid". Errors: InvalidArgument naming the text and the choices.
Result<ContextCodingMode> ParseContextCodingMode(std::string_view text);

/// What one item's choice is made from.
struct ContextChoiceInputs {
  /// The item's expected wire bytes with today's encodings, and context-coded.
  uint64_t today_bytes = 0;
  uint64_t context_bytes = 0;
  /// Bytes of the old span the receiver's context decode passes over.
  uint64_t span_bytes = 0;
  /// The receiver's context decode rate, bytes of old span per second on one core; ≤ 0: unknown
  /// (the choice then never context-codes).
  double decode_bytes_per_s = 0;
  /// Receiver threads decoding payloads ahead of the apply (ReceiverSessionOptions'
  /// decode_threads, at least 1): the decode overlaps the download.
  uint32_t decode_threads = 1;
  /// The link's rate in bytes per second; ≤ 0: unknown or fast (never context-codes, unless
  /// bytes_priced).
  double link_bytes_per_s = 0;
  /// The bytes themselves cost (an object store bills what it stores and serves, and keeps a
  /// chain of payloads): then a saving over the margin pays whatever the decode time.
  bool bytes_priced = false;
};

/// The least fraction of the item's bytes context coding must save: below it, the estimate's
/// error (the encoder's table overheads vary by tens of bytes) could turn a saving into a loss.
inline constexpr double kContextMinSaving = 0.05;

/// Return true when context-coding the item pays: context_bytes ≤ (1 − kContextMinSaving) ·
/// today_bytes, and either the bytes are priced or the item arrives sooner — the receiver's decode
/// overlaps the download, so a context-coded item takes max(context / link, span / (decode rate ·
/// decode_threads)) against today / link (today's decode, O(changes), is counted as free). Each
/// receiver pays the decode, as each receiver's link carries the bytes, so fan-out does not change
/// the answer.
bool ContextCodingPays(const ContextChoiceInputs& inputs);

/// Return `mode`'s answer for an item: kForce and kForbid as they say (kForce only where
/// `supported`), kAuto as ContextCodingPays.
bool ChooseContextCoding(ContextCodingMode mode, bool supported, const ContextChoiceInputs& inputs);

/// What a transport URI suggests about its link, for a producer that has measured nothing yet.
struct LinkHint {
  /// Bytes per second; 0 = fast (a fabric) or unknown.
  double bytes_per_s = 0;
  /// The transport stores what it carries and bills it (ContextChoiceInputs::bytes_priced).
  bool bytes_priced = false;
};

/// Return the hint for `transport_uri`: `s3://` a priced object store of modest rate, `file://` a
/// shared filesystem drop of modest rate; the fabric transports (`zmq://`, `mpi://`, `nccl://`,
/// `inproc://`) and anything unknown are fast. A `fault+` prefix is looked through.
LinkHint LinkHintForTransport(std::string_view transport_uri);

}  // namespace refit::internal
