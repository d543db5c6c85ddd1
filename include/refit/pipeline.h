// The producer streaming pipeline: export chunking, chunk ownership, payload bucketing, and
// ProducerStream, which runs one transfer for one producer from a source of export chunks to a
// caller-supplied sender.
//
//   source (caller's thread) ─▶ encode workers ─▶ bucketer ─▶ serialize+compress ─▶ senders
//     every chunk is pulled;     DeltaTracker::     items in       EncodePayload      N threads,
//     owned ones (k % W == p)    Encode, N threads  chunk order,                      cleanup once
//     are dispatched                                ≤ bucket_bytes                    per thread
//
// Every stage is bounded and overlaps the next. Unlike the upstream design, which coalesces
// encode results in completion order, payload contents and payload ids here depend only on the
// inputs: encode results are consumed in chunk order, whatever the thread timing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "refit/item.h"
#include "refit/payload.h"
#include "refit/status.h"
#include "refit/tensor.h"
#include "refit/tracker.h"
#include "refit/transfer.h"

namespace refit {

/// The place of one export chunk in the canonical tensor list: tensors [begin, end), holding
/// `bytes` bytes in total.
struct ChunkRange {
  size_t begin = 0;
  size_t end = 0;
  uint64_t bytes = 0;

  friend bool operator==(const ChunkRange&, const ChunkRange&) = default;
};

/// The export chunking rule (upstream `iter_sparse_weight_chunks`), applied one tensor at a time
/// so that a trainer can form chunks while its export is still producing tensors:
///   - tensors are appended while the chunk's running byte total stays ≤ the target;
///   - a tensor that would push a non-empty chunk over the target starts the next chunk;
///   - once the total reaches or passes the target after an append, the chunk closes;
///   - so a tensor larger than the target forms a chunk of its own.
/// Ownership (`chunk_index % W`) is only stable while every producer and every transfer uses
/// this same rule with the same target, the same canonical order and the same shapes.
///
/// Thread-safety: none; a value type, one per tensor walk.
class Chunker {
 public:
  /// A target of 0 closes every chunk after its first tensor.
  explicit Chunker(uint64_t target_bytes) : target_bytes_(target_bytes) {}

  /// Place the next tensor, of `tensor_bytes` bytes. Return true when it starts a new chunk,
  /// i.e. the previous chunk (if any) is complete without it. O(1).
  bool Add(uint64_t tensor_bytes);

  /// Number of chunks started so far; the chunk of the last added tensor is `chunks() - 1`.
  uint64_t chunks() const { return chunks_; }
  /// Bytes in the chunk of the last added tensor.
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint64_t target_bytes() const { return target_bytes_; }

 private:
  uint64_t target_bytes_;
  uint64_t chunks_ = 0;
  uint64_t chunk_bytes_ = 0;
  // True while the current chunk may still take tensors (started and below the target).
  bool open_ = false;
};

/// Split tensors of the given sizes, in canonical order, into chunks by the Chunker rule.
/// An empty list gives no chunks. O(number of tensors).
std::vector<ChunkRange> PlanChunks(std::span<const uint64_t> tensor_bytes, uint64_t target_bytes);

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

/// Encode `items` into payloads bucketed by PayloadBucketer, with payload ids ids.payload_id,
/// ids.payload_id + 1, …: the payloads ProducerStream sends for the same items, ids and options.
/// Holds every payload in memory; a producer streams them instead (ProducerStream).
/// Errors: as EncodePayload (InvalidArgument, naming the payload and the item).
Result<std::vector<std::vector<std::byte>>> PackPayloads(const PayloadIds& ids,
                                                         std::span<const Item> items,
                                                         uint64_t bucket_bytes,
                                                         const PayloadEncodeOptions& options = {});

/// Return whether producer `producer_id` of `num_producers` owns chunk `chunk_index`: the
/// upstream rule `chunk_index % num_producers == producer_id`, recomputed on every walk, never
/// stored. Precondition: num_producers > 0.
constexpr bool OwnsChunk(uint64_t chunk_index, uint32_t producer_id, uint32_t num_producers) {
  return chunk_index % num_producers == producer_id;
}

/// Adopt as `tracker`'s committed baseline the tensors of `model` (canonical order) that producer
/// `producer_id` of `num_producers` owns under PlanChunks(…, chunk_bytes): what a producer does
/// when its receivers already hold `model` (they loaded that checkpoint), so that its first
/// transfer is a delta. Errors: as DeltaTracker::AdoptBaseline.
Status AdoptOwnedBaseline(DeltaTracker& tracker, std::span<const TensorView> model,
                          uint64_t chunk_bytes, uint32_t producer_id, uint32_t num_producers);

/// One export chunk as a source yields it: consecutive canonical tensors.
struct ExportChunk {
  /// Borrowed views; the bytes must stay valid until the stream releases the chunk (it drops
  /// `keepalive` and its copy of the views once the chunk is encoded, or at once when the chunk
  /// is not owned or the stream has failed), and in any case until Run returns.
  std::vector<TensorView> tensors;
  /// Optional owner of the bytes (e.g. the host copy of gathered tensors), released with the
  /// chunk so that the source's memory is bounded by ProducerStreamOptions::max_chunks_in_flight.
  std::shared_ptr<const void> keepalive;
};

/// Yield the next export chunk in canonical order, or nullopt at the end. Called on the thread
/// that called ProducerStream::Run, one call at a time, for every chunk of the model (owned or
/// not: in a real trainer each pull may take part in collectives that all ranks must join).
/// After the first failure anywhere (its own included) the stream keeps calling it and drops
/// what it yields, until it returns nullopt or fails again: a source that cannot go on after a
/// failure returns nullopt or an error on the next call.
using ChunkSource = std::function<Result<std::optional<ExportChunk>>()>;

/// Return a source that yields `tensors` (borrowed) in the chunks PlanChunks makes of them.
/// Thread-safety: the source is a sequential iterator, like every ChunkSource.
ChunkSource TensorListSource(std::vector<TensorView> tensors, uint64_t chunk_bytes);

/// Options of ProducerStream::Make.
/// How an anchor's payloads are compressed (ProducerStreamOptions::anchor_compression). An anchor
/// sends every element, so its time is set by whichever is slower, the compressor or the link:
/// zstd shrinks bf16 weights by only about a quarter, at a few hundred MB/s per thread, which is
/// slower than a fast link and pays only on a slow one.
enum class AnchorCompression : uint8_t {
  /// Measure, then decide per anchor: its first payloads are compressed while the serializers'
  /// compression rate, the ratio and the senders' wire rate are measured; from then on the
  /// anchor is compressed only if that makes its payloads flow faster than raw ones would
  /// (the compressed rate, min(compressor, link ÷ ratio), beats the link by 10 %).
  kAuto,
  /// Always zstd at PayloadEncodeOptions::zstd_level, as deltas.
  kZstd,
  /// Never: raw zstd blocks, no byte planes (PayloadEncodeOptions::compress = false).
  kNone,
};

/// Return "auto", "zstd" or "none".
std::string_view AnchorCompressionName(AnchorCompression mode);
/// Parse AnchorCompressionName's spelling. Errors: InvalidArgument naming the value.
Result<AnchorCompression> ParseAnchorCompression(std::string_view name);

struct ProducerStreamOptions {
  /// This producer's rank p and the number of producers W; p owns chunk k iff k % W == p.
  uint32_t producer_id = 0;
  uint32_t num_producers = 1;
  /// The source yields only this producer's own chunks (a sharded trainer rank's pieces,
  /// refit/piece_source.h): every chunk is owned, whatever k % W says. producer_id still names
  /// the payloads.
  bool owns_every_chunk = false;
  /// The chunk target of the Chunker rule. Every chunk the source yields is checked against the
  /// rule with this target, because a drifting rule silently moves tensors between producers.
  /// Default: the upstream ZeroMQ export chunk (256 MiB).
  uint64_t chunk_bytes = uint64_t{256} << 20;
  /// Most item bytes (location + value bytes, before compression) coalesced into one payload;
  /// an item larger than this travels alone. Default 32 MiB: upstream caps a bucket at 512 MiB
  /// of *dense* tensor bytes, which at the typical 1–5 % changed bf16 elements and ~1.5 location
  /// bytes per change is of this order; measuring sparse bytes bounds payloads at any density.
  uint64_t bucket_bytes = uint64_t{32} << 20;
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
  /// the compressed ÷ body ratio, and the senders' wire rate over their threads (bytes/s).
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

/// What one successful ProducerStream::Run did.
struct StreamReport {
  /// Chunks the source yielded (every producer walks all of them), and those this one owns.
  uint64_t chunks = 0;
  uint64_t owned_chunks = 0;
  /// Payloads sent, with ids 0 … payloads − 1.
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
};

/// Runs transfers for one producer: pulls every export chunk, encodes the owned ones with a
/// DeltaTracker, coalesces their items into payloads of at most bucket_bytes (in chunk order,
/// then tensor order, then item order), serializes and compresses them, and hands them to a
/// sender. Payload ids and payload bytes are a function of the inputs only, except the bytes of
/// an anchor under AnchorCompression::kAuto, whose compression follows the measured rates.
///
/// Memory is bounded by the options, never by the model: about max_chunks_in_flight chunks
/// (source bytes plus encoded items) + one partly filled bucket + max_payloads_in_flight payloads.
///
/// Thread-safety: immutable after Make; Run may be called concurrently for distinct trackers.
/// Each Run starts its own threads and joins them all before returning.
class ProducerStream {
 public:
  /// Errors: InvalidArgument for inconsistent options (no producers, producer_id ≥
  /// num_producers, a zero chunk or bucket size, thread counts outside
  /// [1, kMaxThreads], zero max_payloads_in_flight).
  static Result<std::unique_ptr<ProducerStream>> Make(const ProducerStreamOptions& options);

  /// Upper bound on each thread count: far above any core count, low enough that a mistyped
  /// value is reported instead of exhausting the process (as ThreadPool's bound).
  static constexpr int kMaxThreads = 4096;

  /// Stream the transfer open in `tracker` (DeltaTracker::Begin was called; its plan gives the
  /// transfer id and versions of every payload): pull every chunk of `source`, encode the owned
  /// ones, and call `send` for each payload. `cleanup` (optional) runs once on each sender
  /// thread at its end. Commit or abort the tracker afterwards, as the coordinator decides.
  ///
  /// The first error anywhere (source, chunk rule, encode, serialize, send) cancels every stage
  /// and is returned with the producer and chunk or payload named; the source is still drained
  /// (see ChunkSource), every started thread runs its cleanup and is joined. The tracker then
  /// holds a partial transfer: Abort it.
  ///
  /// Errors: FailedPrecondition (no open transfer in `tracker`, or an encode precondition such
  /// as a tensor without baseline in a delta), InvalidArgument (a chunk that breaks the chunking
  /// rule, is empty, or repeats a tensor name; a bad tensor), ResourceExhausted (a thread could
  /// not start; more than 2^32 payloads), and whatever the source or sender return.
  Result<StreamReport> Run(DeltaTracker& tracker, const ChunkSource& source,
                           const PayloadSender& send, const SenderCleanup& cleanup = nullptr) const;

  const ProducerStreamOptions& options() const { return options_; }

 private:
  explicit ProducerStream(const ProducerStreamOptions& options) : options_(options) {}
  ProducerStreamOptions options_;
};

}  // namespace refit
