// Export chunk sources: what a producer pulls from the trainer, one export chunk at a time, and
// the whole-model helpers built on the chunking rule (a source over a tensor list, and the
// baseline of the chunks a producer owns). Sharded ranks use the pieces source instead
// (refit/piece_source.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "refit/chunking.h"
#include "refit/status.h"
#include "refit/tensor.h"
#include "refit/tracker.h"

namespace refit {

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

/// Adopt as `tracker`'s committed baseline the tensors of `model` (canonical order) that producer
/// `producer_id` of `num_producers` owns under PlanChunks(…, chunk_bytes): what a producer does
/// when its receivers already hold `model` (they loaded that checkpoint), so that its first
/// transfer is a delta. Errors: as DeltaTracker::AdoptBaseline.
Status AdoptOwnedBaseline(DeltaTracker& tracker, std::span<const TensorView> model,
                          uint64_t chunk_bytes, uint32_t producer_id, uint32_t num_producers);

}  // namespace refit
