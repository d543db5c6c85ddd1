// The payload bucketing rule: which consecutive items share a payload, and PackPayloads, which
// applies it to items held in memory (the same payload bytes ProducerStream sends).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "pipeline/chunking.h"
#include "refit/item.h"
#include "refit/payload.h"
#include "refit/status.h"
#include "refit/stream_options.h"

namespace refit {

/// Return the bytes of `item` that a payload bucket counts: its location and value bytes, before
/// compression (the entry table and headers are not counted).
uint64_t BucketedBytes(const ItemView& item);

/// The payload bucketing rule: which consecutive items (in chunk order, then tensor order, then
/// item order) share a payload. It is the Chunker rule over BucketedBytes with target
/// `bucket_bytes`: items are appended while the bucket stays ≤ bucket_bytes; an item that would
/// push a non-empty bucket over starts the next one; a bucket closes once it reaches bucket_bytes;
/// so an item larger than bucket_bytes travels alone. ProducerStream (every Publisher, `refit
/// push`) and PackPayloads (`refit encode`) both bucket by it, so the same items and options give
/// the same payload bytes.
///
/// Thread-safety: none; a value type, one per producer and transfer.
class PayloadBucketer {
 public:
  /// A bucket_bytes of 0 gives every item a payload of its own.
  explicit PayloadBucketer(uint64_t bucket_bytes) : rule_(bucket_bytes) {}

  /// Place the next item, of `item_bytes` bytes (BucketedBytes). Return true when it starts a
  /// new bucket, i.e. the previous bucket (if any) is complete without it. O(1).
  bool Add(uint64_t item_bytes) { return rule_.Add(item_bytes); }

  /// Return whether the bucket of the last added item is complete, so that the next Add starts a
  /// new one: a stream can send it now instead of waiting for the next item.
  bool full() const { return rule_.chunk_bytes() >= rule_.target_bytes(); }

 private:
  Chunker rule_;
};

/// An anchor's FULL items are cut at the bucket size, so that none of its payloads is larger
/// than a bucket: a receiver holds several payloads at a time while it receives an anchor, on
/// top of the model, and a tensor larger than a bucket would otherwise travel as a payload of its
/// own size (docs/benchmark-results.md, issue 43). Buckets below kMinFullPieceBytes cut at it, so
/// that tiny buckets do not make an item per element.
inline constexpr uint64_t kMinFullPieceBytes = uint64_t{1} << 20;

/// The most elements of a tensor of `dtype` in one FULL item under `bucket_bytes` (at least
/// one). ProducerStream and `refit encode` both cut so, and so send the same payloads.
uint64_t FullPieceElements(uint64_t bucket_bytes, DType dtype);

/// The consecutive spans [begin, end) of at most `span_elements` (≥ 1) that cover [0, numel):
/// one empty span for an empty tensor, whose item still says the tensor is sent.
std::vector<std::pair<uint64_t, uint64_t>> CutSpans(uint64_t numel, uint64_t span_elements);

/// Encode `items` into payloads bucketed by PayloadBucketer, with payload ids ids.payload_id,
/// ids.payload_id + 1, …: the payloads ProducerStream sends for the same items, ids and options.
/// Holds every payload in memory; a producer streams them instead (ProducerStream).
/// Errors: as EncodePayload (InvalidArgument, naming the payload and the item).
Result<std::vector<std::vector<std::byte>>> PackPayloads(const PayloadIds& ids,
                                                         std::span<const Item> items,
                                                         uint64_t bucket_bytes,
                                                         const PayloadEncodeOptions& options = {});

}  // namespace refit
