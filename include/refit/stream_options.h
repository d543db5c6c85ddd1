// A producer rank's stream: its options (chunking, bucketing, threads, in-flight bounds, anchor
// compression) and what one stream reports (stage times, bytes, routes). PublisherOptions::stream
// and SyncReport carry them; the stream itself is internal (src/pipeline/producer_stream.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "refit/payload.h"
#include "refit/status.h"

namespace refit {

/// The default bucket size of producers (ProducerStreamOptions::bucket_bytes), which receivers
/// also size their default payload limit by (ReceiverNodeOptions::producer_bucket_bytes).
inline constexpr uint64_t kDefaultBucketBytes = uint64_t{8} << 20;
/// The default bucket size of a delta's payloads (ProducerStreamOptions::delta_bucket_bytes).
inline constexpr uint64_t kDefaultDeltaBucketBytes = uint64_t{4} << 20;

/// How an anchor's payloads are compressed (ProducerStreamOptions::anchor_compression). An anchor
/// sends every element, so its time is set by whichever is slower, the compressor or the link:
/// zstd shrinks bf16 weights by only about a quarter, at a few hundred MB/s per thread, which is
/// slower than a fast link and pays only on a slow one.
enum class AnchorCompression : uint8_t {
  /// Measure, then decide per anchor: its first payloads go alternately compressed and raw while
  /// the serializers' compression rate, the ratio and each kind's send rate (the link and the
  /// receivers behind it) are measured; from then on the anchor is compressed only if that
  /// carries its body faster than raw payloads do (min(compressor, compressed sends ÷ ratio)
  /// beats the raw sends by 10 %).
  kAuto,
  /// Always zstd at PayloadEncodeOptions::zstd_level, as deltas.
  kZstd,
  /// Never: stored bodies, no byte planes (PayloadEncodeOptions::compress = false).
  kNone,
};

/// Return "auto", "zstd" or "none".
std::string_view AnchorCompressionName(AnchorCompression mode);
/// Parse AnchorCompressionName's spelling. Errors: InvalidArgument naming the value.
Result<AnchorCompression> ParseAnchorCompression(std::string_view name);

/// How a delta's XOR items are coded (ProducerStreamOptions::item_coding). Context coding
/// (payload format v2, docs/format/context-coding.md) codes each change given the old value both
/// sides hold: about a quarter fewer bytes on weights trained with Adam, for a receiver pass over
/// every old element of the item's span (O(span), where plain items cost O(changes)).
enum class ItemCoding : uint8_t {
  /// Context-code an item when it is smaller by a margin and the stream's link is slow enough
  /// (ProducerStreamOptions::link_uri: s3:// and file:// are, fabrics are not).
  kAuto,
  /// Context-code every item whose dtype allows it (bf16, fp16, fp32, fp8) and whose old span
  /// the producer holds.
  kContext,
  /// Never: every payload stays format v1.
  kPlain,
};

/// Return "auto", "context" or "plain".
std::string_view ItemCodingName(ItemCoding coding);
/// Parse ItemCodingName's spelling. Errors: InvalidArgument naming the value.
Result<ItemCoding> ParseItemCoding(std::string_view name);

struct ProducerStreamOptions {
  /// This producer's rank p and the number of producers W; p owns chunk k iff k % W == p.
  uint32_t producer_id = 0;
  uint32_t num_producers = 1;
  /// The source yields only this producer's own chunks (a sharded trainer rank's pieces,
  /// src/pipeline/piece_source.h): every chunk is owned, whatever k % W says. producer_id still
  /// names the payloads.
  bool owns_every_chunk = false;
  /// The chunk target of the Chunker rule. Every chunk the source yields is checked against the
  /// rule with this target, because a drifting rule silently moves tensors between producers.
  /// Default: the upstream ZeroMQ export chunk (256 MiB).
  uint64_t chunk_bytes = uint64_t{256} << 20;
  /// Most item bytes (location + value bytes, before compression) coalesced into one payload;
  /// a delta's item larger than this travels alone, an anchor's FULL items are cut at it (so an
  /// anchor's payloads are at most a bucket). Default 8 MiB: a receiver holds a few payloads at
  /// a time while it receives an anchor (being received, queued, applied), on top of the model;
  /// at 32 MiB they were 0.15 × a 1 GiB model, at 8 MiB 0.07–0.09, and the anchor no slower
  /// (docs/benchmark-results.md, issue 43). Measuring sparse bytes bounds payloads at any
  /// density (upstream caps a bucket at 512 MiB of *dense* tensor bytes).
  uint64_t bucket_bytes = kDefaultBucketBytes;
  /// The same for the payloads of a delta or folded route (not an anchor's), at most
  /// bucket_bytes; 0: bucket_bytes. Smaller than an anchor's, so that the receivers decode and
  /// apply a delta's first payloads while its later ones are serialized and sent: a 3 % delta of
  /// 256 MiB is one 16 MB payload at 32 MiB, four at 4 MiB (docs/benchmark-results.md, issue 43).
  uint64_t delta_bucket_bytes = kDefaultDeltaBucketBytes;
  /// Threads calling DeltaTracker::Encode on owned chunks (upstream `encode_workers`).
  int encode_threads = 8;
  /// Threads running EncodePayload (serialize, compress, checksum): upstream uses
  /// min(4, encode_workers).
  int serialize_threads = 4;
  /// Threads calling the PayloadSender (upstream ZeroMQ `transfer_workers`).
  int send_threads = 4;
  /// Owned chunks pulled from the source and not yet consumed by the bucketer (being encoded or
  /// waiting for an earlier chunk). The source is not asked for an owned chunk while this many
  /// are in flight. 0 means 2 × encode_threads, upstream's bound on in-flight encodes.
  size_t max_chunks_in_flight = 0;
  /// Payloads alive at once, from the moment the bucketer closes one until its send returns
  /// (waiting for serialization, serialized, or being sent). Bounds the memory downstream of the
  /// bucketer to about this many × (bucket_bytes of items + the compressed payload). Default:
  /// 2 × the default send_threads, so each sender finds its next payload ready.
  size_t max_payloads_in_flight = 8;
  /// How payloads are compressed.
  PayloadEncodeOptions payload;
  /// How an anchor's payloads are compressed: `payload` as it is (kZstd), raw (kNone), or as
  /// measured (kAuto). Deltas always use `payload`.
  AnchorCompression anchor_compression = AnchorCompression::kAuto;
  /// Whether a delta's XOR items are context-coded (format v2). Only the stream's own deltas to
  /// receivers at its base are: anchors, folded catch-ups and items of placed (boxed) tensors stay
  /// plain.
  ItemCoding item_coding = ItemCoding::kAuto;
  /// The transport the stream's payloads go through, as a URI: what kAuto reads the link's speed
  /// and price from (LinkHintForTransport). Empty: a fast link (never context-coded by kAuto).
  /// The publisher sets it from PublisherOptions::transport_uri.
  std::string link_uri;

  /// Upper bound on each thread count: far above any core count, low enough that a mistyped
  /// value is reported instead of exhausting the process (as ThreadPool's bound).
  static constexpr int kMaxThreads = 4096;
};

/// What a stream decided about an anchor's compression, and the rates it decided from.
struct AnchorCompressionReport {
  /// The transfer was an anchor.
  bool anchor = false;
  /// Payloads sent compressed (zstd) and raw.
  uint64_t compressed_payloads = 0;
  uint64_t raw_payloads = 0;
  /// kAuto: whether the probe finished (enough payloads were sent to measure), and what it
  /// measured: the serializers' compression rate over their threads (body bytes per second),
  /// the compressed ÷ body ratio, and the senders' rate of raw payloads over their threads
  /// (bytes/s: the link, and the receivers behind its acknowledgements).
  bool measured = false;
  double compress_bytes_per_s = 0;
  double ratio = 0;
  double link_bytes_per_s = 0;
};

/// Summed busy time of each stage, in seconds. Stages run concurrently, so the sum of stage
/// times may exceed the wall time (as upstream's `REFIT_*_TIMING`).
struct StageTimings {
  /// Inside the source callback (the trainer's export pull).
  double source_s = 0;
  /// The source thread waiting for a chunk slot (encode or bucketing is the bottleneck).
  double dispatch_wait_s = 0;
  /// Inside DeltaTracker::Encode, summed over encode threads.
  double encode_s = 0;
  /// Inside EncodePayload, summed over serialize threads.
  double serialize_s = 0;
  /// Inside the sender callback, summed over sender threads.
  double send_s = 0;
  /// From the start of Run to its return.
  double wall_s = 0;
};

/// What one route of a stream sent (StreamReport::routes).
struct RouteReport {
  /// Payloads sent to this route, with ids 0 … payloads − 1 (each route numbers its own).
  uint64_t payloads = 0;
  uint64_t items = 0;
  uint64_t item_bytes = 0;
  uint64_t wire_bytes = 0;

  friend bool operator==(const RouteReport&, const RouteReport&) = default;
};

/// What one successful ProducerStream::Run did.
struct StreamReport {
  /// Chunks the source yielded (every producer walks all of them), and those this one owns.
  uint64_t chunks = 0;
  uint64_t owned_chunks = 0;
  /// Payloads sent over all routes (with one route: ids 0 … payloads − 1).
  uint64_t payloads = 0;
  /// Items in those payloads.
  uint64_t items = 0;
  /// Elements changed, and elements compared, over the owned chunks (unchanged chunks count
  /// here but produce no payload).
  uint64_t changed_elements = 0;
  uint64_t total_elements = 0;
  /// Location + value bytes of all items, before compression (what bucket_bytes measures).
  uint64_t item_bytes = 0;
  /// Bytes handed to the sender (headers + compressed bodies).
  uint64_t wire_bytes = 0;
  /// The most owned chunks and payloads that were in flight at once (≤ the options' bounds).
  uint64_t peak_chunks_in_flight = 0;
  uint64_t peak_payloads_in_flight = 0;
  StageTimings timings;
  AnchorCompressionReport anchor_compression{};
  /// Per route, in the order Run was given them (one entry for a Run with one sender).
  std::vector<RouteReport> routes = {};
};

}  // namespace refit
