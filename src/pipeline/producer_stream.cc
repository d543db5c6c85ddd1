// ProducerStream: one transfer of one producer, as a bounded pipeline of threads.
//
// Threads and hand-offs of one Run (every queue and limit is bounded by the options):
//
//   caller thread: PullSource ──(chunk credit)──▶ ordered_ (slots, chunk order)  ──▶ bucketer
//                              └──────────────▶ encode_queue_ ──▶ encode threads ──┘ (fill slot)
//   bucketer ──(payload credit)──▶ serialize_queue_ ──▶ serialize threads ──▶ send_queue_
//            ──▶ send threads (release the payload credit after each send; cleanup at the end)
//
// Determinism: the source pushes each owned chunk's result slot into `ordered_` in chunk order
// before handing the chunk to an encode thread, and the bucketer takes slots in that order,
// waiting for each to be filled. Bucket contents and payload ids therefore depend only on the
// inputs; thread timing changes only when things happen.
//
// Cancellation: the first error requests stop on `stop_`. Every blocking wait takes that token,
// so all stages wind down promptly, while the caller thread keeps draining the source.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "anchor_compression.h"
#include "pipeline/bucketing.h"
#include "pipeline/context_items.h"
#include "pipeline/producer_stream.h"
#include "refit/status_format.h"
#include "util/bounded_queue.h"
#include "util/logging.h"
#include "util/mutex.h"
#include "util/thread_name.h"

namespace refit {
namespace {

using Clock = std::chrono::steady_clock;
using internal::BoundedQueue;
using internal::NameCurrentThread;

// Owned chunks in flight per encode thread when max_chunks_in_flight is 0: one being encoded and
// one queued behind it, so a thread that finishes finds work at once (upstream bounds in-flight
// encodes at 2 × workers).
constexpr size_t kChunksInFlightPerEncodeThread = 2;

// Busy time of one stage, summed over the threads that add to it.
class StageTime {
 public:
  // Add the time since `since`, and return it in seconds (for a caller that also needs it).
  double Add(Clock::time_point since) {
    const auto elapsed = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since);
    nanoseconds_.fetch_add(static_cast<uint64_t>(elapsed.count()), std::memory_order_relaxed);
    return std::chrono::duration<double>(elapsed).count();
  }
  double seconds() const {
    return static_cast<double>(nanoseconds_.load(std::memory_order_relaxed)) * 1e-9;
  }

 private:
  std::atomic<uint64_t> nanoseconds_{0};
};

// A counting limit on things in flight between two stages, with the peak for the report.
//
// Thread-safety: every member may be called concurrently.
class InFlightLimit {
 public:
  explicit InFlightLimit(size_t limit) : limit_(limit) {}

  // Block until fewer than `limit` units are taken, then take one. Return false, taking nothing,
  // once `stop` is requested.
  bool Acquire(const std::stop_token& stop) {
    internal::MutexLock lock(mutex_);
    released_.wait(lock, stop, [this] { return in_use_ < limit_; });
    if (stop.stop_requested()) return false;
    ++in_use_;
    peak_ = std::max(peak_, in_use_);
    return true;
  }

  void Release() {
    internal::MutexLock lock(mutex_);
    --in_use_;
    released_.notify_one();
  }

  size_t peak() const {
    internal::MutexLock lock(mutex_);
    return peak_;
  }

 private:
  const size_t limit_;
  mutable internal::Mutex mutex_;
  // condition_variable_any: only it can wait on a stop_token.
  internal::CondVar released_;
  size_t in_use_ = 0;
  size_t peak_ = 0;
};

// The items of one encoded owned chunk.
struct EncodedChunk {
  uint64_t chunk_index = 0;
  // ChunkSignature of its tensors, when a history records them.
  uint64_t signature = 0;
  std::vector<Item> items;
  // FULL items of its bits, when a route carries an anchor inside a delta transfer.
  std::vector<Item> full_items;
  uint64_t changed_elements = 0;
  uint64_t total_elements = 0;
};

// Where an encode thread leaves one chunk's result for the bucketer, which waits for the slots
// in chunk order.
//
// Thread-safety: one Fulfil and one Take, from any threads.
class EncodedChunkSlot {
 public:
  void Fulfil(Result<EncodedChunk> result) {
    internal::MutexLock lock(mutex_);
    result_.emplace(std::move(result));
    ready_.notify_all();
  }

  // Wait for the result; nullopt once `stop` is requested first.
  std::optional<Result<EncodedChunk>> Take(const std::stop_token& stop) {
    internal::MutexLock lock(mutex_);
    ready_.wait(lock, stop, [this] { return result_.has_value(); });
    if (!result_) return std::nullopt;
    std::optional<Result<EncodedChunk>> result = std::move(result_);
    result_.reset();
    return result;
  }

 private:
  internal::Mutex mutex_;
  internal::CondVar ready_;
  std::optional<Result<EncodedChunk>> result_;
};

struct EncodeJob {
  uint64_t chunk_index = 0;
  ExportChunk chunk;
  std::shared_ptr<EncodedChunkSlot> slot;
};

// A closed bucket: the items of one payload of one route.
struct PayloadJob {
  size_t route = 0;
  uint32_t payload_id = 0;
  std::vector<Item> items;
  /// Their BucketedBytes: the body the payload encodes, before compression.
  uint64_t item_bytes = 0;
};

struct SerializedPayload {
  size_t route = 0;
  uint32_t payload_id = 0;
  std::vector<std::byte> bytes;
  /// Encoded with zstd (else raw blocks: AnchorCompression).
  bool compressed = true;
};

// The bucket being filled for one route, and what the route sent.
struct RouteState {
  explicit RouteState(uint64_t target_bytes) : bucketer(target_bytes) {}

  // Bucketer thread only.
  PayloadBucketer bucketer;
  std::vector<Item> bucket;
  uint64_t bucket_bytes = 0;
  uint64_t next_payload_id = 0;
  uint64_t items = 0;
  uint64_t item_bytes = 0;
  // Sender threads.
  std::atomic<uint64_t> wire_bytes{0};
};

// The state and threads of one ProducerStream::Run.
//
// Thread-safety: Run is called once, on the caller's thread; the loops run on the threads Run
// starts. Shared counters are atomics; the first error is guarded by a mutex.
class StreamRun {
 public:
  StreamRun(const ProducerStreamOptions& options, internal::DeltaTracker& tracker,
            std::span<const StreamRoute> routes, DeltaHistory* history)
      : options_(options),
        tracker_(tracker),
        routes_(routes),
        history_(history),
        context_(fmt::format("producer {}", options.producer_id)),
        chunker_(options.chunk_bytes),
        chunk_credits_(options.max_chunks_in_flight),
        payload_credits_(options.max_payloads_in_flight),
        ordered_(options.max_chunks_in_flight, "ordered chunk queue"),
        encode_queue_(options.max_chunks_in_flight, "encode queue"),
        serialize_queue_(options.max_payloads_in_flight, "serialize queue"),
        send_queue_(options.max_payloads_in_flight, "send queue") {
    for (size_t r = 0; r < routes.size(); ++r) {
      route_states_.push_back(std::make_unique<RouteState>(options.bucket_bytes));
      if (routes[r].content == CatchUp::kAnchor) full_routes_ = true;
    }
  }

  Result<StreamReport> Run(const ChunkSource& source);

 private:
  bool stopped() const { return stop_source_.stop_requested(); }
  // Record `status` if it is the first error, and cancel every stage.
  void Fail(const Status& status);

  void StartThreads();
  Status Spawn(std::string name, void (StreamRun::*loop)());

  void PullSource(const ChunkSource& source);
  Status CheckChunk(uint64_t chunk_index, const ExportChunk& chunk);
  bool Dispatch(uint64_t chunk_index, ExportChunk chunk);

  void EncodeLoop();
  Result<EncodedChunk> EncodeChunk(const EncodeJob& job);
  void BucketLoop();
  void BucketChunks();
  // Place one encoded chunk's items on every route: what the route carries (the chunk's items,
  // its FULL items, or their fold with the history), whole or cut to what the route holds.
  bool RouteChunk(EncodedChunk& chunk);
  bool AddToRoute(size_t route, std::vector<Item>& items);
  bool AddToBucket(size_t route, Item item);
  bool EmitBucket(size_t route);
  void SerializeLoop();
  void SendLoop();

  const ProducerStreamOptions& options_;
  internal::DeltaTracker& tracker_;
  const std::span<const StreamRoute> routes_;
  // Borrowed; null: nothing is recorded or folded.
  DeltaHistory* const history_;
  // Some route carries FULL items inside a delta transfer.
  bool full_routes_ = false;
  TransferPlan plan_;
  // Set once the plan is known, before the threads start.
  std::optional<internal::AnchorCompressionChooser> compression_;
  // "producer P of transfer T": the prefix of every error message.
  std::string context_;

  std::stop_source stop_source_;
  const std::stop_token stop_ = stop_source_.get_token();
  internal::Mutex error_mutex_;
  Status first_error_;

  // Caller thread only: the chunking rule replayed over the source's chunks, and the chunk of
  // every tensor name seen, to reject chunks that drift from the rule or repeat a tensor.
  Chunker chunker_;
  std::unordered_map<std::string, uint64_t> chunk_of_tensor_;
  uint64_t chunks_ = 0;
  uint64_t owned_chunks_ = 0;

  // One per route, in the routes' order.
  std::vector<std::unique_ptr<RouteState>> route_states_;
  // Bucketer thread only.
  std::vector<Item> cut_;
  uint64_t changed_elements_ = 0;
  uint64_t total_elements_ = 0;

  // Owned chunks pulled but not yet consumed by the bucketer; payloads closed but not yet sent.
  InFlightLimit chunk_credits_;
  InFlightLimit payload_credits_;
  BoundedQueue<std::shared_ptr<EncodedChunkSlot>> ordered_;
  BoundedQueue<EncodeJob> encode_queue_;
  BoundedQueue<PayloadJob> serialize_queue_;
  BoundedQueue<SerializedPayload> send_queue_;
  // The last serialize thread to finish closes the send queue.
  std::atomic<int> serializers_running_{0};

  StageTime source_time_;
  StageTime dispatch_wait_time_;
  StageTime encode_time_;
  StageTime serialize_time_;
  StageTime send_time_;

  // Last member: destroyed (joined) first, before anything its threads use.
  std::vector<std::jthread> threads_;
};

void StreamRun::Fail(const Status& status) {
  {
    internal::MutexLock lock(error_mutex_);
    if (first_error_.ok()) first_error_ = status;
  }
  stop_source_.request_stop();
}

Status StreamRun::Spawn(std::string name, void (StreamRun::*loop)()) {
  // std::thread reports an OS refusal (EAGAIN) only by throwing; turn it into a Status so no
  // exception leaves the library.
  try {
    threads_.emplace_back([this, name, loop] {
      NameCurrentThread(name);
      (this->*loop)();
    });
  } catch (const std::system_error& error) {
    return ResourceExhausted("{}: cannot start thread {}: {}", context_, name, error.what());
  }
  return Status::OK();
}

void StreamRun::StartThreads() {
  const int encode = options_.encode_threads;
  const int serialize = options_.serialize_threads;
  const int send = options_.send_threads;
  threads_.reserve(static_cast<size_t>(encode + serialize + send + 1));
  // Downstream first, so that a failed start leaves no upstream stage without its consumer; the
  // serialize queue cannot close before every serialize thread runs, because it closes only
  // after the source is drained.
  Status started;
  for (int i = 0; i < send && started.ok(); ++i) {
    started = Spawn(fmt::format("refit-send-{}", i), &StreamRun::SendLoop);
  }
  for (int i = 0; i < serialize && started.ok(); ++i) {
    serializers_running_.fetch_add(1);
    started = Spawn(fmt::format("refit-serial-{}", i), &StreamRun::SerializeLoop);
    if (!started.ok()) serializers_running_.fetch_sub(1);
  }
  if (started.ok()) started = Spawn("refit-bucket", &StreamRun::BucketLoop);
  for (int i = 0; i < encode && started.ok(); ++i) {
    started = Spawn(fmt::format("refit-encode-{}", i), &StreamRun::EncodeLoop);
  }
  if (!started.ok()) Fail(started);
}

Result<StreamReport> StreamRun::Run(const ChunkSource& source) {
  const Clock::time_point start = Clock::now();
  std::optional<TransferPlan> plan = tracker_.open_transfer();
  if (plan) {
    plan_ = *plan;
    compression_.emplace(options_, plan_.anchor);
    // A delta's payloads are smaller than an anchor's, so that the receivers start on them early
    // (ProducerStreamOptions::delta_bucket_bytes).
    for (size_t r = 0; r < routes_.size(); ++r) {
      if (plan_.anchor || routes_[r].content == CatchUp::kAnchor) continue;
      if (options_.delta_bucket_bytes == 0) continue;
      route_states_[r]->bucketer =
          PayloadBucketer(std::min(options_.bucket_bytes, options_.delta_bucket_bytes));
    }
    context_ =
        fmt::format("producer {} of transfer {}", options_.producer_id, plan_.transfer_id.ToHex());
    StartThreads();
  } else {
    // Still drain the source below: the other producers' collectives must not hang.
    Fail(FailedPrecondition("{}: the tracker has no open transfer (call DeltaTracker::Begin)",
                            context_));
  }
  PullSource(source);
  ordered_.Close();
  encode_queue_.Close();
  // Join: without an error each stage ends when the one before it closes its queue; after an
  // error every blocked wait returns on the stop token.
  threads_.clear();
  if (!first_error_.ok()) return first_error_;
  REFIT_RETURN_NOT_OK(tracker_.CheckModelCovered(plan_.transfer_id).WithContext(context_));

  StreamReport report;
  report.chunks = chunks_;
  report.owned_chunks = owned_chunks_;
  for (const std::unique_ptr<RouteState>& route : route_states_) {
    const RouteReport sent{route->next_payload_id, route->items, route->item_bytes,
                           route->wire_bytes.load()};
    report.payloads += sent.payloads;
    report.items += sent.items;
    report.item_bytes += sent.item_bytes;
    report.wire_bytes += sent.wire_bytes;
    report.routes.push_back(sent);
  }
  report.changed_elements = changed_elements_;
  report.total_elements = total_elements_;
  report.peak_chunks_in_flight = chunk_credits_.peak();
  report.peak_payloads_in_flight = payload_credits_.peak();
  report.timings.source_s = source_time_.seconds();
  report.timings.dispatch_wait_s = dispatch_wait_time_.seconds();
  report.timings.encode_s = encode_time_.seconds();
  report.timings.serialize_s = serialize_time_.seconds();
  report.timings.send_s = send_time_.seconds();
  report.timings.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  if (compression_) report.anchor_compression = compression_->report();
  REFIT_LOG_DEBUG(
      "{}: {} of {} chunks owned, {} payloads, {} items, {}/{} elements changed, {} wire bytes",
      context_, report.owned_chunks, report.chunks, report.payloads, report.items,
      report.changed_elements, report.total_elements, report.wire_bytes);
  return report;
}

void StreamRun::PullSource(const ChunkSource& source) {
  uint64_t chunk_index = 0;
  while (true) {
    const bool owned = (options_.owns_every_chunk ||
                        OwnsChunk(chunk_index, options_.producer_id, options_.num_producers)) &&
                       !stopped();
    // Take the owned chunk's credit before pulling it, so that the source's memory is bounded
    // too. A failed acquire means the stream stopped: the chunk is then pulled and dropped.
    bool credit = false;
    if (owned) {
      const Clock::time_point wait_start = Clock::now();
      credit = chunk_credits_.Acquire(stop_);
      dispatch_wait_time_.Add(wait_start);
    }
    const bool draining = stopped();
    const Clock::time_point pull_start = Clock::now();
    Result<std::optional<ExportChunk>> next =
        source(ChunkPull{chunk_index, credit && !draining, stop_});
    source_time_.Add(pull_start);
    if (!next.ok() || !next->has_value()) {
      if (credit) chunk_credits_.Release();
      if (next.ok()) break;  // The end of the export.
      Fail(next.status().WithContext(fmt::format("{}, source at chunk {}", context_, chunk_index)));
      // A source that fails again while being drained cannot go on.
      if (draining) break;
      ++chunk_index;
      continue;
    }
    ExportChunk chunk = std::move(**next);
    const uint64_t index = chunk_index++;
    ++chunks_;
    if (stopped()) {
      if (credit) chunk_credits_.Release();
      continue;  // Draining: the chunk is dropped here, releasing the source's bytes.
    }
    if (Status valid = CheckChunk(index, chunk); !valid.ok()) {
      if (credit) chunk_credits_.Release();
      Fail(valid);
      continue;
    }
    if (!credit) continue;  // Not ours: walked for the collectives, then dropped.
    if (chunk.unread) {
      chunk_credits_.Release();
      Fail(InvalidArgument("{}: source chunk {} came unread, but this producer reads it", context_,
                           index));
      continue;
    }
    ++owned_chunks_;
    // The credit now travels with the chunk; the bucketer releases it.
    if (!Dispatch(index, std::move(chunk))) continue;
  }
}

Status StreamRun::CheckChunk(uint64_t chunk_index, const ExportChunk& chunk) {
  if (chunk.tensors.empty()) {
    return InvalidArgument("{}: source chunk {} holds no tensor", context_, chunk_index);
  }
  for (size_t i = 0; i < chunk.tensors.size(); ++i) {
    const TensorView& tensor = chunk.tensors[i];
    uint64_t bytes = tensor.bytes.size();
    if (chunk.unread) {
      // An unread chunk's sizes are its shapes' (ExportChunk::unread).
      REFIT_ASSIGN_OR_RETURN(bytes, TensorBytes(tensor.shape, tensor.dtype));
    }
    const bool starts = chunker_.Add(bytes);
    if (i == 0 && !starts) {
      return InvalidArgument(
          "{}: source chunk {} starts with tensor '{}' ({} bytes), but the chunking rule with "
          "target {} bytes appends it to chunk {} ({} bytes before it)",
          context_, chunk_index, tensor.name, bytes, options_.chunk_bytes, chunk_index - 1,
          chunker_.chunk_bytes() - bytes);
    }
    if (i > 0 && starts) {
      return InvalidArgument(
          "{}: source chunk {} holds tensor '{}' ({} bytes) at position {}, but the chunking "
          "rule with target {} bytes starts a new chunk with it",
          context_, chunk_index, tensor.name, bytes, i, options_.chunk_bytes);
    }
    const auto [it, inserted] = chunk_of_tensor_.emplace(tensor.name, chunk_index);
    if (!inserted) {
      return InvalidArgument("{}: tensor '{}' appears in source chunk {} and again in chunk {}",
                             context_, tensor.name, it->second, chunk_index);
    }
  }
  return Status::OK();
}

bool StreamRun::Dispatch(uint64_t chunk_index, ExportChunk chunk) {
  auto slot = std::make_shared<EncodedChunkSlot>();
  // Both queues hold at most max_chunks_in_flight elements and the credit bounds the chunks in
  // flight to that, so these pushes wait only if the stream stopped (then they fail).
  if (!ordered_.Push(slot, stop_).ok()) return false;
  return encode_queue_.Push(EncodeJob{chunk_index, std::move(chunk), std::move(slot)}, stop_).ok();
}

void StreamRun::EncodeLoop() {
  while (std::optional<EncodeJob> job = encode_queue_.Pop(stop_)) {
    Result<EncodedChunk> encoded = EncodeChunk(*job);
    if (!encoded.ok()) Fail(encoded.status());
    std::shared_ptr<EncodedChunkSlot> slot = std::move(job->slot);
    // Release the source's bytes before the bucketer may ask the source for more.
    job.reset();
    slot->Fulfil(std::move(encoded));
  }
}

Result<EncodedChunk> StreamRun::EncodeChunk(const EncodeJob& job) {
  EncodedChunk out;
  out.chunk_index = job.chunk_index;
  if (history_ != nullptr) out.signature = ChunkSignature(job.chunk.tensors);
  for (const TensorView& tensor : job.chunk.tensors) {
    if (stopped()) {
      return Cancelled("{}, chunk {}: the stream stopped before tensor '{}'", context_,
                       job.chunk_index, tensor.name);
    }
    // A delta encodes each tensor whole (its items are the size of its changes); an anchor in
    // FULL items of at most a bucket (FullPieceElements), as do the FULL items of kAnchor routes.
    const uint64_t numel = tensor.numel();
    const uint64_t piece = FullPieceElements(options_.bucket_bytes, tensor.dtype);
    const uint64_t encode_span = plan_.anchor ? piece : std::max<uint64_t>(numel, 1);
    for (const auto& [begin, end] : CutSpans(numel, encode_span)) {
      const Clock::time_point start = Clock::now();
      Result<internal::EncodeResult> encoded =
          tracker_.Encode(plan_.transfer_id, tensor, begin, end);
      encode_time_.Add(start);
      if (!encoded.ok()) {
        return encoded.status().WithContext(fmt::format("{}, chunk {}", context_, job.chunk_index));
      }
      out.changed_elements += encoded->changed_elements;
      out.total_elements += encoded->total_elements;
      for (Item& item : encoded->items) out.items.push_back(std::move(item));
    }
    if (!full_routes_ || plan_.anchor) continue;
    for (const auto& [begin, end] : CutSpans(numel, piece)) {
      Result<std::vector<Item>> full = tracker_.EncodeFull(plan_.transfer_id, tensor, begin, end);
      if (!full.ok()) {
        return full.status().WithContext(fmt::format("{}, chunk {}", context_, job.chunk_index));
      }
      for (Item& item : *full) out.full_items.push_back(std::move(item));
    }
  }
  return out;
}

void StreamRun::BucketLoop() {
  BucketChunks();
  serialize_queue_.Close();
}

void StreamRun::BucketChunks() {
  while (std::optional<std::shared_ptr<EncodedChunkSlot>> slot = ordered_.Pop(stop_)) {
    std::optional<Result<EncodedChunk>> encoded = (*slot)->Take(stop_);
    if (!encoded) return;  // Stopped.
    if (!encoded->ok()) {
      Fail(encoded->status());
      return;
    }
    EncodedChunk chunk = std::move(*encoded).ValueOrDie();
    chunk_credits_.Release();
    changed_elements_ += chunk.changed_elements;
    total_elements_ += chunk.total_elements;
    if (history_ != nullptr && !plan_.anchor) {
      history_->Record(chunk.chunk_index, chunk.signature, chunk.items);
    }
    if (!RouteChunk(chunk)) return;
  }
  for (size_t r = 0; r < route_states_.size() && !stopped(); ++r) {
    if (!route_states_[r]->bucket.empty() && !EmitBucket(r)) return;
  }
}

bool StreamRun::RouteChunk(EncodedChunk& chunk) {
  if (routes_.size() == 1 && routes_[0].content == CatchUp::kDelta) {
    return AddToRoute(0, chunk.items);
  }
  for (size_t r = 0; r < routes_.size(); ++r) {
    std::vector<Item> items;
    switch (routes_[r].content) {
      case CatchUp::kAnchor:
        items = plan_.anchor ? chunk.items : chunk.full_items;
        break;
      case CatchUp::kFolded: {
        Result<std::vector<Item>> folded = history_->FoldChunk(
            routes_[r].from_version, chunk.chunk_index, chunk.signature, chunk.items);
        if (!folded.ok()) {
          Fail(folded.status().WithContext(fmt::format("{}, route {}", context_, r)));
          return false;
        }
        items = *std::move(folded);
        break;
      }
      default:
        items = chunk.items;
        break;
    }
    if (!AddToRoute(r, items)) return false;
  }
  return true;
}

bool StreamRun::AddToRoute(size_t route, std::vector<Item>& items) {
  for (Item& item : items) {
    if (routes_[route].items == nullptr) {
      if (!AddToBucket(route, std::move(item))) return false;
      continue;
    }
    cut_.clear();
    if (Status cut = routes_[route].items->Cut(item.view(), &cut_); !cut.ok()) {
      Fail(cut.WithContext(fmt::format("{}, route {}", context_, route)));
      return false;
    }
    for (Item& part : cut_) {
      if (!AddToBucket(route, std::move(part))) return false;
    }
  }
  return true;
}

bool StreamRun::AddToBucket(size_t route, Item item) {
  RouteState& state = *route_states_[route];
  const uint64_t bytes = BucketedBytes(item.view());
  // A full bucket was emitted at once (below), so a bucket is left here only by an item that does
  // not fit in it.
  if (state.bucketer.Add(bytes) && !state.bucket.empty() && !EmitBucket(route)) return false;
  state.bucket_bytes += bytes;
  state.bucket.push_back(std::move(item));
  return !state.bucketer.full() || EmitBucket(route);
}

bool StreamRun::EmitBucket(size_t route) {
  RouteState& state = *route_states_[route];
  if (state.next_payload_id > std::numeric_limits<uint32_t>::max()) {
    Fail(ResourceExhausted("{}: more than {} payloads in one transfer", context_,
                           uint64_t{std::numeric_limits<uint32_t>::max()} + 1));
    return false;
  }
  if (!payload_credits_.Acquire(stop_)) return false;
  PayloadJob job{route, static_cast<uint32_t>(state.next_payload_id), std::move(state.bucket),
                 state.bucket_bytes};
  state.items += job.items.size();
  state.item_bytes += state.bucket_bytes;
  state.bucket.clear();
  state.bucket_bytes = 0;
  if (!serialize_queue_.Push(std::move(job), stop_).ok()) return false;
  ++state.next_payload_id;
  return true;
}

void StreamRun::SerializeLoop() {
  while (std::optional<PayloadJob> job = serialize_queue_.Pop(stop_)) {
    // A catch-up route's payloads move its receivers from the base they were prepared from
    // (folded, or an anchor of their own from the version they hold).
    const StreamRoute& route_of_job = routes_[job->route];
    const uint64_t base =
        route_of_job.content != CatchUp::kDelta ? route_of_job.from_version : plan_.base_version;
    const bool own_delta = route_of_job.content == CatchUp::kDelta;
    const PayloadIds ids{plan_.transfer_id, options_.producer_id, job->payload_id, base,
                         plan_.target_version};
    const PayloadEncodeOptions encode = compression_->Next();
    const Clock::time_point start = Clock::now();
    // Context coding needs the old span its receivers hold: the tracker's baseline, which is the
    // base version's bits only for the stream's own deltas (not a fold from an older version, nor
    // an anchor of a receiver's own).
    // Here, after the history recorded the items and routes cut them, so that both see plain ones.
    if (!plan_.anchor && own_delta && options_.item_coding != ItemCoding::kPlain) {
      Result<internal::ItemCodingReport> coded = internal::ChooseItemCoding(
          job->items, options_.item_coding, options_.link_uri, encode,
          [this](const ItemView& item, std::span<const std::byte>* old_span) -> Result<bool> {
            Result<TensorView> baseline = tracker_.Baseline(std::string(item.name));
            // A canonical item of a placed (boxed) tensor has no baseline of its name and shape.
            if (!baseline.ok() || baseline->dtype != item.dtype || baseline->shape != item.shape) {
              return false;
            }
            const uint32_t width = DTypeSize(item.dtype);
            *old_span = baseline->bytes.subspan(item.span_begin * width,
                                                (item.span_end - item.span_begin) * width);
            return true;
          });
      if (!coded.ok()) {
        Fail(coded.status().WithContext(fmt::format("{}, payload {}", context_, job->payload_id)));
        break;
      }
    }
    std::vector<ItemView> views;
    views.reserve(job->items.size());
    for (const Item& item : job->items) views.push_back(item.view());
    Result<std::vector<std::byte>> bytes = EncodePayload(ids, views, encode);
    const double encode_s = serialize_time_.Add(start);
    if (bytes.ok()) compression_->RecordEncoded(encode, job->item_bytes, bytes->size(), encode_s);
    if (!bytes.ok()) {
      Fail(bytes.status().WithContext(fmt::format("{}, payload {}", context_, job->payload_id)));
      break;
    }
    const size_t route = job->route;
    const uint32_t payload_id = job->payload_id;
    // Free the items before waiting for room downstream.
    views.clear();
    job.reset();
    if (!send_queue_
             .Push(SerializedPayload{route, payload_id, std::move(*bytes), encode.compress}, stop_)
             .ok()) {
      break;
    }
  }
  if (serializers_running_.fetch_sub(1) == 1) send_queue_.Close();
}

void StreamRun::SendLoop() {
  while (std::optional<SerializedPayload> payload = send_queue_.Pop(stop_)) {
    const Clock::time_point start = Clock::now();
    Status sent = routes_[payload->route].send(payload->payload_id, payload->bytes);
    const double send_s = send_time_.Add(start);
    if (sent.ok()) compression_->RecordSent(payload->compressed, payload->bytes.size(), send_s);
    if (!sent.ok()) {
      const std::string where = routes_.size() == 1
                                    ? fmt::format("{}, payload {}", context_, payload->payload_id)
                                    : fmt::format("{}, route {} payload {}", context_,
                                                  payload->route, payload->payload_id);
      Fail(sent.WithContext(where));
      break;
    }
    route_states_[payload->route]->wire_bytes.fetch_add(payload->bytes.size(),
                                                        std::memory_order_relaxed);
    // Free the bytes before the credit lets the bucketer close another payload.
    payload.reset();
    payload_credits_.Release();
  }
  for (const StreamRoute& route : routes_) {
    if (route.cleanup) route.cleanup();
  }
}

}  // namespace

Result<std::unique_ptr<ProducerStream>> ProducerStream::Make(const ProducerStreamOptions& options) {
  if (options.num_producers == 0) return InvalidArgument("num_producers is 0");
  if (options.producer_id >= options.num_producers) {
    return InvalidArgument("producer_id {} is not below num_producers {}", options.producer_id,
                           options.num_producers);
  }
  if (options.chunk_bytes == 0) return InvalidArgument("chunk_bytes is 0");
  if (options.bucket_bytes == 0) return InvalidArgument("bucket_bytes is 0");
  for (const auto& [name, threads] : {std::pair{"encode_threads", options.encode_threads},
                                      std::pair{"serialize_threads", options.serialize_threads},
                                      std::pair{"send_threads", options.send_threads}}) {
    if (threads < 1 || threads > ProducerStreamOptions::kMaxThreads) {
      return InvalidArgument("{} {} is outside [1, {}]", name, threads,
                             ProducerStreamOptions::kMaxThreads);
    }
  }
  if (options.max_payloads_in_flight == 0) return InvalidArgument("max_payloads_in_flight is 0");
  ProducerStreamOptions resolved = options;
  if (resolved.max_chunks_in_flight == 0) {
    resolved.max_chunks_in_flight =
        kChunksInFlightPerEncodeThread * static_cast<size_t>(options.encode_threads);
  }
  return std::unique_ptr<ProducerStream>(new ProducerStream(resolved));
}

Result<StreamReport> ProducerStream::Run(internal::DeltaTracker& tracker, const ChunkSource& source,
                                         const PayloadSender& send,
                                         const SenderCleanup& cleanup) const {
  const StreamRoute route{nullptr, send, cleanup};
  return Run(tracker, source, std::span<const StreamRoute>(&route, 1));
}

Result<StreamReport> ProducerStream::Run(internal::DeltaTracker& tracker, const ChunkSource& source,
                                         std::span<const StreamRoute> routes) const {
  return Run(tracker, source, routes, nullptr);
}

Result<StreamReport> ProducerStream::Run(internal::DeltaTracker& tracker, const ChunkSource& source,
                                         std::span<const StreamRoute> routes,
                                         DeltaHistory* history) const {
  if (routes.empty())
    return InvalidArgument("producer {}: no routes to send to", options_.producer_id);
  for (size_t r = 0; r < routes.size(); ++r) {
    if (!routes[r].send) {
      return InvalidArgument("producer {}: route {} has no sender", options_.producer_id, r);
    }
    if (routes[r].content == CatchUp::kFolded) {
      const std::optional<TransferPlan> open = tracker.open_transfer();
      if (history == nullptr || (open.has_value() && open->anchor)) {
        return InvalidArgument(
            "producer {}: route {} carries folded deltas from version {}, but the stream has {}",
            options_.producer_id, r, routes[r].from_version,
            history == nullptr ? "no delta history" : "an anchor to send");
      }
    }
  }
  // The run's queues and counters live on the heap: they are large and shared with its threads.
  auto run = std::make_unique<StreamRun>(options_, tracker, routes, history);
  return run->Run(source);
}

}  // namespace refit
