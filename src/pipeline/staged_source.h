// The producer's own chunk sources over export tensors: device tensors staged to the host through
// a StagingPool as the stream pulls them, and the baseline of the chunks a producer owns.
// Publisher uses them; users hand it ExportTensors (refit/chunk_source.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <stop_token>
#include <string_view>
#include <vector>

#include "codec/tracker.h"
#include "pipeline/staging_pool.h"
#include "refit/chunk_source.h"
#include "refit/status.h"
#include "refit/tensor.h"

namespace refit {

/// Stage `bytes` of device memory for `what` ("the chunk starting with tensor 'w'"): wait for a
/// buffer of `pool` (until `stop`). Returns null if `stop` was requested while waiting (the
/// stream stopped: the chunk is yielded unread). Errors: InvalidArgument naming `what` when the
/// bytes exceed the budget (or there is no pool); ResourceExhausted if mapping a buffer fails.
Result<std::shared_ptr<StagingPool::Buffer>> AcquireStaging(StagingPool* pool, uint64_t bytes,
                                                            std::string_view what,
                                                            std::stop_token stop = {});

/// Return a source that yields `tensors` in the chunks PlanChunks makes of them. Host tensors are
/// yielded in place; a chunk with device tensors is read, when the pull reads it, into one
/// buffer of `pool` (released with the chunk; the pull waits while the pool's budget is lent to
/// chunks in flight), and is yielded unread otherwise. The copies are made on the pulling thread,
/// while the stream's encode workers compare the chunks before it. `pool` may be null when no
/// tensor is in device memory.
/// Errors of a pull: InvalidArgument when a chunk's device bytes exceed the pool's budget (naming
/// the chunk's first tensor and both sizes); the backend's error of a read, naming the tensor.
ChunkSource StagedTensorSource(std::vector<ExportTensor> tensors, uint64_t chunk_bytes,
                               std::shared_ptr<StagingPool> pool);

/// Adopt as `tracker`'s committed baseline the tensors of `model` (canonical order) that producer
/// `producer_id` of `num_producers` owns under PlanChunks(…, chunk_bytes): what a producer does
/// when its receivers already hold `model` (they loaded that checkpoint), so that its first
/// transfer is a delta. Errors: as DeltaTracker::AdoptBaseline.
Status AdoptOwnedBaseline(internal::DeltaTracker& tracker, std::span<const TensorView> model,
                          uint64_t chunk_bytes, uint32_t producer_id, uint32_t num_producers);

/// As above with tensors in host or device memory: a device tensor is read into a buffer of
/// `pool`, one tensor at a time, and copied into the baseline from there. Errors: as above;
/// InvalidArgument for a device tensor larger than the pool's budget (or no pool); the backend's
/// error of a read, naming the tensor.
Status AdoptOwnedBaseline(internal::DeltaTracker& tracker, std::span<const ExportTensor> model,
                          uint64_t chunk_bytes, uint32_t producer_id, uint32_t num_producers,
                          StagingPool* pool);

}  // namespace refit
