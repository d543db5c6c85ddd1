// ProducerStream runs one transfer for one producer, from a source of export chunks
// (refit/chunk_source.h) to a caller-supplied sender, with the chunking and bucketing rules of
// src/pipeline/chunking.h and src/pipeline/bucketing.h.
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
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "codec/delta_history.h"
#include "codec/routing.h"
#include "codec/tracker.h"
#include "pipeline/bucketing.h"
#include "refit/chunk_source.h"
#include "refit/payload.h"
#include "refit/refit_report.h"
#include "refit/status.h"
#include "refit/stream_options.h"
#include "refit/transfer.h"

namespace refit {

/// One class of receivers a stream sends to (routing by holdings, src/codec/routing.h): the cut of
/// items its receivers hold, and the sender of its payloads.
struct StreamRoute {
  /// Borrowed for the Run; null: the class holds everything (no item is cut).
  const ItemRoute* items = nullptr;
  PayloadSender send;
  /// Optional: run once on each sender thread at its end.
  SenderCleanup cleanup;
  /// What the route carries (docs/protocol.md "Per-receiver plans"): the transfer's items
  /// (kDelta), FULL items of every owned element (kAnchor: receivers caught up by an anchor of
  /// their own inside a delta transfer), or the fold of the retained deltas from `from_version`
  /// with this transfer's (kFolded, one item per tensor of each chunk; needs a history). Its
  /// payloads' headers move from_version → target for kFolded and kAnchor (the base its
  /// receivers were prepared from: the version they hold when behind, else the transfer's base),
  /// base → target for kDelta.
  CatchUp content = CatchUp::kDelta;
  uint64_t from_version = 0;
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
  /// [1, ProducerStreamOptions::kMaxThreads], zero max_payloads_in_flight).
  static Result<std::unique_ptr<ProducerStream>> Make(const ProducerStreamOptions& options);

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
  Result<StreamReport> Run(internal::DeltaTracker& tracker, const ChunkSource& source,
                           const PayloadSender& send, const SenderCleanup& cleanup = nullptr) const;
  /// As above, sending each route what its receivers hold: every encoded item is cut for each
  /// route (ItemRoute::Cut) and bucketed into that route's own payloads, numbered from 0 per
  /// route and handed to that route's sender. Items are encoded once whatever the routes.
  /// Errors: as above; InvalidArgument for no routes or a route without a sender, and what
  /// ItemRoute::Cut returns (naming the route).
  Result<StreamReport> Run(internal::DeltaTracker& tracker, const ChunkSource& source,
                           std::span<const StreamRoute> routes) const;
  /// As above, recording what each owned chunk's items are into `history` (opened by the caller
  /// with DeltaHistory::Begin for this transfer; committed or aborted with the tracker), and
  /// folding from it for kFolded routes. `history` may be null when no route is kFolded.
  /// Errors: as above; InvalidArgument for a kFolded route without a history or in an anchor;
  /// what DeltaHistory::FoldChunk returns, naming the chunk.
  Result<StreamReport> Run(internal::DeltaTracker& tracker, const ChunkSource& source,
                           std::span<const StreamRoute> routes, DeltaHistory* history) const;

  const ProducerStreamOptions& options() const { return options_; }

 private:
  explicit ProducerStream(const ProducerStreamOptions& options) : options_(options) {}
  ProducerStreamOptions options_;
};

}  // namespace refit
