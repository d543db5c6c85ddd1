#include "codec/tracker.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <unordered_map>

#include <fmt/format.h>

#include "codec/canonical_box.h"
#include "codec/compare.h"
#include "codec/locations.h"
#include "codec/values.h"
#include "core/digest.h"
#include "core/mapped_file.h"
#include "refit/status_format.h"
#include "util/background_job.h"
#include "util/check.h"
#include "util/mutex.h"
#include "util/thread_pool.h"

namespace refit::internal {
namespace {

/// The bytes of one tensor's baseline: anonymous memory or an unlinked mmapped temp file.
class BaselineBuffer {
 public:
  static Result<std::unique_ptr<BaselineBuffer>> Make(const TrackerOptions& options, size_t size) {
    auto buffer = std::unique_ptr<BaselineBuffer>(new BaselineBuffer());
    if (options.baseline_storage == BaselineStorage::kFile && size > 0) {
      REFIT_ASSIGN_OR_RETURN(buffer->file_,
                             internal::MappedFile::CreateTemporary(options.baseline_dir, size));
      buffer->bytes_ = buffer->file_->bytes();
    } else {
      buffer->memory_ = std::make_unique_for_overwrite<std::byte[]>(size);
      buffer->bytes_ = {buffer->memory_.get(), size};
    }
    return buffer;
  }
  std::span<std::byte> bytes() { return bytes_; }

 private:
  BaselineBuffer() = default;
  std::unique_ptr<std::byte[]> memory_;
  std::unique_ptr<internal::MappedFile> file_;
  std::span<std::byte> bytes_;
};

/// The changed locations of one span (one Encode call), kept until Commit in the smallest of the
/// payload format's location encodings (about 2 bytes each at the usual densities) rather than
/// as 8-byte indices: the producer's memory per changed element is this plus the new bits.
struct PendingRun {
  LocationEncoding encoding = LocationEncoding::kGap64;
  std::vector<uint8_t> bytes;
  uint64_t count = 0;
  uint64_t span_begin = 0;
  uint64_t span_end = 0;
};

/// The run of `locations` in the encoding a payload would use for them (ChooseLocationEncoding:
/// gap16 at the usual densities, a bitmask or ranges when dense).
Result<PendingRun> MakePendingRun(std::span<const uint64_t> locations, uint64_t span_begin,
                                  uint64_t span_end) {
  PendingRun run;
  run.count = locations.size();
  run.span_begin = span_begin;
  run.span_end = span_end;
  REFIT_ASSIGN_OR_RETURN(run.encoding, ChooseAndEncodeLocations(locations, span_begin, span_end,
                                                                std::nullopt, &run.bytes));
  return run;
}

/// The run of an item that carries every changed location of its span (XOR, OVERWRITE): a copy
/// of the locations the item already encoded, rather than encoding them a second time.
PendingRun PendingRunOf(const Item& item) {
  return PendingRun{item.location_encoding, item.locations, item.count, item.span_begin,
                    item.span_end};
}

/// Changes of one tensor recorded by Encode and applied by Commit.
struct PendingChanges {
  /// Changed locations of an existing baseline, span by span, and their new bits in the same
  /// order.
  std::vector<PendingRun> runs;
  std::vector<std::byte> new_bits;
  /// A tensor introduced or reshaped at an anchor: its complete new baseline.
  std::unique_ptr<BaselineBuffer> replacement;
  DType replacement_dtype = DType::kUInt8;
  Shape replacement_shape;
  uint64_t replacement_covered = 0;
  /// Σ h(i, new) − h(i, old) over the changes (mod 2^64); for a replacement, its full digest.
  uint64_t digest_delta = 0;
  uint64_t changed = 0;
  /// Elements of the tensor encoded (compared or sent) by the open transfer, over all spans.
  uint64_t encoded = 0;
};

struct BaselineEntry {
  DType dtype = DType::kUInt8;
  Shape shape;
  uint64_t numel = 0;
  std::unique_ptr<BaselineBuffer> buffer;
  uint64_t digest = 0;
  /// Guards `pending` against concurrent Encode calls on disjoint spans of this tensor.
  internal::Mutex pending_mutex;
  PendingChanges pending;
};

/// The index a digest hashes for element `i` of a tracked tensor: `i` itself, or its canonical
/// index when the tensor is a box of a canonical tensor (DeltaTracker::Place).
uint64_t DigestIndex(const BoxIndexMap* box, uint64_t i) { return box ? box->Map(i) : i; }

uint64_t DigestDelta(std::span<const std::byte> old_tensor, std::span<const std::byte> new_tensor,
                     uint32_t width, std::span<const uint64_t> locations, const BoxIndexMap* box) {
  return DigestChange(
      locations.size(), [&](size_t k) { return DigestIndex(box, locations[k]); },
      [&](size_t k) { return LoadBits(new_tensor, width, locations[k]); },
      [&](size_t k) { return LoadBits(old_tensor, width, locations[k]); });
}

template <typename Word, bool kBoxed>
uint64_t GatherChangesOfWidth(const std::byte* old_tensor, const std::byte* new_tensor,
                              std::span<const uint64_t> locations, std::byte* xor_out,
                              std::byte* new_out, const BoxIndexMap* box) {
  for (size_t k = 0; k < locations.size(); ++k) {
    const uint64_t i = locations[k];
    Word old_word, new_word;
    std::memcpy(&old_word, old_tensor + i * sizeof(Word), sizeof(Word));
    std::memcpy(&new_word, new_tensor + i * sizeof(Word), sizeof(Word));
    std::memcpy(new_out + k * sizeof(Word), &new_word, sizeof(Word));
    if (xor_out != nullptr) {
      const Word x = static_cast<Word>(old_word ^ new_word);
      std::memcpy(xor_out + k * sizeof(Word), &x, sizeof(Word));
    }
  }
  // The digest in a pass of its own over the gathered bits, vectorized (DigestChange); the
  // locations are one compare block's (kFusedBlockBytes), so the old bits are still cached.
  const auto load = [](const std::byte* from, uint64_t at) {
    Word word;
    std::memcpy(&word, from + at * sizeof(Word), sizeof(Word));
    return static_cast<uint64_t>(word);
  };
  return DigestChange(
      locations.size(), [&](size_t k) { return kBoxed ? box->Map(locations[k]) : locations[k]; },
      [&](size_t k) { return load(new_out, k); },
      [&](size_t k) { return load(old_tensor, locations[k]); });
}

template <typename Word>
uint64_t GatherChangesOfWord(const std::byte* old_tensor, const std::byte* new_tensor,
                             std::span<const uint64_t> locations, std::byte* xor_out,
                             std::byte* new_out, const BoxIndexMap* box) {
  return box == nullptr ? GatherChangesOfWidth<Word, false>(old_tensor, new_tensor, locations,
                                                            xor_out, new_out, nullptr)
                        : GatherChangesOfWidth<Word, true>(old_tensor, new_tensor, locations,
                                                           xor_out, new_out, box);
}

/// Copy the new bits at `locations` to `new_out`, their XOR with the old bits to `xor_out` (if
/// non-null), and return the digest change Σ h(i, new) − h(i, old) (i: DigestIndex).
uint64_t GatherChanges(std::span<const std::byte> old_tensor, std::span<const std::byte> new_tensor,
                       uint32_t width, std::span<const uint64_t> locations, std::byte* xor_out,
                       std::byte* new_out, const BoxIndexMap* box) {
  switch (width) {
    case 1:
      return GatherChangesOfWord<uint8_t>(old_tensor.data(), new_tensor.data(), locations, xor_out,
                                          new_out, box);
    case 2:
      return GatherChangesOfWord<uint16_t>(old_tensor.data(), new_tensor.data(), locations, xor_out,
                                           new_out, box);
    case 4:
      return GatherChangesOfWord<uint32_t>(old_tensor.data(), new_tensor.data(), locations, xor_out,
                                           new_out, box);
    default:
      return GatherChangesOfWord<uint64_t>(old_tensor.data(), new_tensor.data(), locations, xor_out,
                                           new_out, box);
  }
}

/// Elements the fused delta pass compares and then gathers at a time: 64 KiB of each tensor,
/// still in L2 when the gather reads the changed elements again.
constexpr uint64_t kFusedBlockBytes = uint64_t{64} << 10;
/// Head-room over the density of the first block when sizing the outputs, so that most spans
/// need no second allocation (growing by doubling copies millions of locations several times).
constexpr double kFusedReserveHeadroom = 1.25;

/// The changes of one span: their locations, new bits, XOR values (when asked for) and digest
/// change Σ h(i, new) − h(i, old).
struct GatheredChanges {
  std::vector<uint64_t> locations;
  std::vector<std::byte> new_bits;
  std::vector<std::byte> xor_values;
  uint64_t digest_delta = 0;
};

/// Compare [begin, end) block by block and gather each block's changes (GatherChanges) right
/// after its compare, while the block is in cache: the two tensors are read from memory once,
/// where a compare of the whole span followed by a gather reads them twice (at 3 % of bf16
/// elements changed, 62 % of the cache lines hold a change).
void CompareAndGather(std::span<const std::byte> old_bytes, std::span<const std::byte> new_bytes,
                      uint32_t width, uint64_t begin, uint64_t end, bool with_xor,
                      CompareKernel kernel, const BoxIndexMap* box, GatheredChanges& out) {
  const uint64_t block = std::max<uint64_t>(1, kFusedBlockBytes / width);
  for (uint64_t b = begin; b < end;) {
    const uint64_t e = b + std::min(block, end - b);
    const size_t first = out.locations.size();
    AppendChangedLocations(old_bytes, new_bytes, width, b, e, &out.locations, kernel);
    const size_t n = out.locations.size() - first;
    if (b == begin && e < end && n > 0) {
      const double density = static_cast<double>(n) / static_cast<double>(e - b);
      const size_t expected =
          n + static_cast<size_t>(density * kFusedReserveHeadroom * static_cast<double>(end - e));
      out.locations.reserve(expected);
      out.new_bits.reserve(expected * width);
      if (with_xor) out.xor_values.reserve(expected * width);
    }
    if (n > 0) {
      out.new_bits.resize((first + n) * width);
      if (with_xor) out.xor_values.resize((first + n) * width);
      out.digest_delta += GatherChanges(old_bytes, new_bytes, width,
                                        std::span<const uint64_t>(out.locations).subspan(first, n),
                                        with_xor ? out.xor_values.data() + first * width : nullptr,
                                        out.new_bits.data() + first * width, box);
    }
    b = e;
  }
}

/// CompareAndGather on `options.threads` threads over chunks of `options.chunk_elements`, the
/// chunks' changes concatenated in order.
Result<GatheredChanges> FindAndGatherChanges(std::span<const std::byte> old_bytes,
                                             std::span<const std::byte> new_bytes, uint32_t width,
                                             uint64_t begin, uint64_t end, bool with_xor,
                                             const CompareOptions& options,
                                             const BoxIndexMap* box) {
  const uint64_t count = end - begin;
  const uint64_t chunk = std::max<uint64_t>(options.chunk_elements, 1);
  const uint64_t chunks = count == 0 ? 0 : (count - 1) / chunk + 1;
  if (options.threads <= 1 || chunks <= 1) {
    GatheredChanges out;
    CompareAndGather(old_bytes, new_bytes, width, begin, end, with_xor, options.kernel, box, out);
    return out;
  }
  std::vector<GatheredChanges> parts(chunks);
  REFIT_RETURN_NOT_OK(
      internal::ParallelFor(options.threads, chunks, [&](uint64_t first, uint64_t last) -> Status {
        for (uint64_t c = first; c < last; ++c) {
          const uint64_t b = begin + c * chunk;
          CompareAndGather(old_bytes, new_bytes, width, b, b + std::min(chunk, end - b), with_xor,
                           options.kernel, box, parts[c]);
        }
        return Status::OK();
      }));
  GatheredChanges out;
  size_t total = 0;
  for (const GatheredChanges& part : parts) total += part.locations.size();
  out.locations.reserve(total);
  out.new_bits.reserve(total * width);
  if (with_xor) out.xor_values.reserve(total * width);
  for (GatheredChanges& part : parts) {
    out.locations.insert(out.locations.end(), part.locations.begin(), part.locations.end());
    out.new_bits.insert(out.new_bits.end(), part.new_bits.begin(), part.new_bits.end());
    out.xor_values.insert(out.xor_values.end(), part.xor_values.begin(), part.xor_values.end());
    out.digest_delta += part.digest_delta;
    part = GatheredChanges{};
  }
  return out;
}

/// Scatter new bits into the baseline. A contiguous run of locations is one memcpy.
void ScatterBits(std::span<std::byte> baseline, uint32_t width, std::span<const uint64_t> locations,
                 std::span<const std::byte> bits) {
  size_t k = 0;
  while (k < locations.size()) {
    size_t run = 1;
    while (k + run < locations.size() && locations[k + run] == locations[k] + run) ++run;
    std::memcpy(baseline.data() + locations[k] * width, bits.data() + k * width, run * width);
    k += run;
  }
}

/// Scatter `bits` (the runs' new bits, in order) into `baseline` at the runs' locations.
/// Errors: DataLoss if a run does not decode — bytes the tracker encoded itself, so only a bug
/// gets there, and Commit then reports it rather than guess.
/// Rewrite `items`, encoded over a box in its own numbering, in the canonical tensor's: its name
/// and shape, canonical spans and locations (digests are canonical already). A FULL item of a box
/// of several runs becomes one FULL item per run, since a FULL span is every element in it; a
/// delta item keeps its locations, remapped over the canonical range its span covers. Items of an
/// empty span are dropped: an empty box has nothing to say.
Result<std::vector<Item>> ToCanonical(std::vector<Item> items, const BoxIndexMap& box,
                                      std::optional<LocationEncoding> force) {
  std::vector<Item> out;
  out.reserve(items.size());
  for (Item& item : items) {
    if (item.span_begin == item.span_end) continue;
    item.name = box.box().tensor;
    item.shape = box.box().shape;
    if (box.contiguous()) {  // A shift: relative locations stay as they are.
      item.span_begin += box.start();
      item.span_end += box.start();
      out.push_back(std::move(item));
      continue;
    }
    if (item.op == Op::kFull) {
      const uint32_t width = DTypeSize(item.value_dtype);
      const uint64_t run_elements = box.run_elements();
      for (uint64_t position = item.span_begin; position < item.span_end;) {
        const uint64_t within = position % run_elements;
        const uint64_t count = std::min(run_elements - within, item.span_end - position);
        const uint64_t first = position - item.span_begin;
        Item part;
        part.name = item.name;
        part.dtype = item.dtype;
        part.shape = item.shape;
        part.op = Op::kFull;
        part.value_dtype = item.value_dtype;
        part.span_begin = box.RunStart(position / run_elements) + within;
        part.span_end = part.span_begin + count;
        part.count = count;
        part.location_encoding = LocationEncoding::kAll;
        part.values.assign(
            item.values.begin() + static_cast<std::ptrdiff_t>(first * width),
            item.values.begin() + static_cast<std::ptrdiff_t>((first + count) * width));
        part.digest = RemappedDigestRange(item.values, width, first, part.span_begin, count);
        out.push_back(std::move(part));
        position += count;
      }
      continue;
    }
    std::vector<uint64_t> locations(item.count);
    REFIT_ASSIGN_OR_RETURN(LocationDecoder decoder,
                           LocationDecoder::Make(item.location_encoding, item.locations, item.count,
                                                 item.span_begin, item.span_end));
    for (size_t decoded = 0; decoded < locations.size();) {
      REFIT_ASSIGN_OR_RETURN(const size_t n,
                             decoder.Next(std::span<uint64_t>(locations).subspan(decoded)));
      if (n == 0) return Internal("tensor '{}': an item's locations ended early", item.name);
      decoded += n;
    }
    box.MapSorted(locations);
    const uint64_t begin = box.Map(item.span_begin);
    const uint64_t end = box.Map(item.span_end - 1) + 1;
    item.locations.clear();
    REFIT_ASSIGN_OR_RETURN(item.location_encoding,
                           ChooseAndEncodeLocations(locations, begin, end, force, &item.locations));
    item.span_begin = begin;
    item.span_end = end;
    out.push_back(std::move(item));
  }
  return out;
}

Status ScatterRuns(std::span<std::byte> baseline, uint32_t width, std::span<const PendingRun> runs,
                   std::span<const std::byte> bits) {
  constexpr size_t kBatch = 4096;
  std::array<uint64_t, kBatch> batch;
  size_t done = 0;
  for (const PendingRun& run : runs) {
    REFIT_ASSIGN_OR_RETURN(
        LocationDecoder decoder,
        LocationDecoder::Make(run.encoding, run.bytes, run.count, run.span_begin, run.span_end));
    while (true) {
      REFIT_ASSIGN_OR_RETURN(const size_t n, decoder.Next(batch));
      if (n == 0) break;
      ScatterBits(baseline, width, std::span<const uint64_t>(batch.data(), n),
                  bits.subspan(done * width, n * width));
      done += n;
    }
  }
  return Status::OK();
}

/// One tensor's share of a baseline fold: its committed changes, moved out of its pending state
/// at Commit, and the bytes they are scattered into.
struct FoldWork {
  std::string name;
  std::span<std::byte> baseline;
  uint32_t width = 0;
  std::vector<PendingRun> runs;
  std::vector<std::byte> new_bits;
};

}  // namespace

struct DeltaTracker::State {
  TrackerOptions options;
  std::set<std::string, std::less<>> overwrite_names;
  uint64_t version = 0;
  uint64_t committed_transfers = 0;
  uint64_t changed_since_anchor = 0;
  std::optional<TransferPlan> open;
  /// Guards the map's shape (insertions at anchors); entries themselves are stable.
  mutable std::shared_mutex entries_mutex;
  std::unordered_map<std::string, std::unique_ptr<BaselineEntry>> entries;
  /// The tensors that are boxes of canonical tensors (Place). Changed only while no transfer is
  /// open, so Encode reads it without a lock.
  std::unordered_map<std::string, BoxIndexMap> boxes;
  /// The tensors the last fold scatters into (dropped if it fails), its changed elements, and the
  /// tests' hook (SetFoldHookForTesting). Changed only by Commit and WaitBaseline, after a wait.
  std::vector<std::string> folding;
  uint64_t fold_elements = 0;
  std::function<Status()> fold_hook;
  /// The fold's worker. Declared last: destroyed first, it waits for a running fold before the
  /// baselines that fold writes into go.
  internal::BackgroundJob fold{"refit-fold"};

  const BoxIndexMap* BoxOf(const std::string& name) const {
    auto it = boxes.find(name);
    return it == boxes.end() ? nullptr : &it->second;
  }

  uint64_t TotalElements() const {
    uint64_t total = 0;
    for (const auto& [name, entry] : entries) total += entry->numel;
    return total;
  }

  Status CheckOpen(const TransferId& id, std::string_view action) const {
    if (!open) {
      return FailedPrecondition("{} for transfer {}: no transfer is open", action, id.ToHex());
    }
    if (!(open->transfer_id == id)) {
      return FailedPrecondition("{} for transfer {}: the open transfer is {}", action, id.ToHex(),
                                open->transfer_id.ToHex());
    }
    return Status::OK();
  }

  BaselineEntry* FindOrCreateEntry(const std::string& name) {
    {
      std::shared_lock lock(entries_mutex);
      auto it = entries.find(name);
      if (it != entries.end()) return it->second.get();
    }
    std::unique_lock lock(entries_mutex);
    auto& slot = entries[name];
    if (!slot) slot = std::make_unique<BaselineEntry>();
    return slot.get();
  }

  BaselineEntry* FindEntry(const std::string& name) const {
    std::shared_lock lock(entries_mutex);
    auto it = entries.find(name);
    return it == entries.end() ? nullptr : it->second.get();
  }

  Status CheckBoxExtent(const BoxIndexMap& box, const TensorView& tensor) const {
    if (tensor.shape != box.extent()) {
      return InvalidArgument(
          "tensor '{}' has shape {} but holds a box of extent {} of canonical tensor '{}' "
          "(DeltaTracker::Place)",
          tensor.name, ShapeToString(tensor.shape), ShapeToString(box.extent()), box.box().tensor);
    }
    return Status::OK();
  }

  /// Check what Encode and EncodeFull both take: `id` is the open transfer, `current` a tensor
  /// of a valid size, [span_begin, span_end) within it (span_end UINT64_MAX: its end, resolved
  /// in place), and a placed box's shape its extent. Returns the tensor's box, or null.
  Result<const BoxIndexMap*> CheckEncodeSpan(const TransferId& id, std::string_view action,
                                             const TensorView& current, uint64_t& span_begin,
                                             uint64_t& span_end) const {
    REFIT_RETURN_NOT_OK(CheckOpen(id, action));
    REFIT_RETURN_NOT_OK(CheckTensorSize(current));
    const uint64_t numel = current.numel();
    if (span_end == UINT64_MAX) span_end = numel;
    if (span_begin > span_end || span_end > numel) {
      return InvalidArgument("tensor '{}': span [{}, {}) is outside its {} elements", current.name,
                             span_begin, span_end, numel);
    }
    const BoxIndexMap* box = BoxOf(current.name);
    if (box != nullptr) REFIT_RETURN_NOT_OK(CheckBoxExtent(*box, current));
    return box;
  }

  /// Encode in the tensor's own numbering (canonical digests for a box).
  Result<EncodeResult> EncodeSpan(const TensorView& current, uint64_t span_begin,
                                  uint64_t span_end);
  Result<EncodeResult> EncodeAnchor(const TensorView& current, uint64_t begin, uint64_t end);
  Result<EncodeResult> EncodeDelta(BaselineEntry& entry, const TensorView& current, uint64_t begin,
                                   uint64_t end);
  Result<Item> MakeItem(const TensorView& current, Op op, DType value_dtype, uint64_t begin,
                        uint64_t end, std::span<const uint64_t> locations,
                        std::vector<std::byte> values, uint64_t digest) const;
};

DeltaTracker::DeltaTracker(std::unique_ptr<State> state) : state_(std::move(state)) {}
DeltaTracker::~DeltaTracker() {
  // A fold's error has nobody left to tell: the baselines go with the tracker.
  if (state_) state_->fold.Wait().IgnoreError();
}

Result<std::unique_ptr<DeltaTracker>> DeltaTracker::Make(const TrackerOptions& options) {
  if (options.op == Op::kFull) {
    return InvalidArgument("tracker op must be xor, overwrite or add, not full");
  }
  if (options.op == Op::kAdd && !AddSupported(DType::kFloat32, options.add_delta_dtype)) {
    return InvalidArgument("add_delta_dtype {} is not a float16/bfloat16/float32/float64 type",
                           DTypeName(options.add_delta_dtype));
  }
  if (options.max_drift_fraction < 0.0 || options.max_drift_fraction > 1.0) {
    return InvalidArgument("max_drift_fraction {} is outside [0, 1]", options.max_drift_fraction);
  }
  if (options.compare.threads < 1) {
    return InvalidArgument("compare threads {} must be >= 1", options.compare.threads);
  }
  if (options.commit_threads < 1 || options.commit_threads > TrackerOptions::kMaxCommitThreads) {
    return InvalidArgument("commit_threads {} is outside [1, {}]", options.commit_threads,
                           TrackerOptions::kMaxCommitThreads);
  }
  auto state = std::make_unique<State>();
  state->options = options;
  state->overwrite_names.insert(options.overwrite_names.begin(), options.overwrite_names.end());
  state->version = options.initial_version;
  return std::unique_ptr<DeltaTracker>(new DeltaTracker(std::move(state)));
}

Result<TransferPlan> DeltaTracker::Begin(const TransferId& id, bool force_anchor) {
  State& s = *state_;
  if (s.open) {
    return FailedPrecondition("cannot begin transfer {}: transfer {} is still open", id.ToHex(),
                              s.open->transfer_id.ToHex());
  }
  // The transfer's compare reads the baseline: the last commit's fold must be in it.
  REFIT_RETURN_NOT_OK(WaitBaseline().WithContext(fmt::format("begin transfer {}", id.ToHex())));
  s.open = TransferPlan{id, force_anchor || NextIsAnchor(), s.version, s.version + 1};
  return *s.open;
}

Result<TransferPlan> DeltaTracker::BeginPlanned(const TransferPlan& plan) {
  State& s = *state_;
  if (s.open) {
    return FailedPrecondition("cannot begin transfer {}: transfer {} is still open",
                              plan.transfer_id.ToHex(), s.open->transfer_id.ToHex());
  }
  REFIT_RETURN_NOT_OK(
      WaitBaseline().WithContext(fmt::format("begin transfer {}", plan.transfer_id.ToHex())));
  if (plan.target_version != plan.base_version + 1) {
    return InvalidArgument("transfer {}: target version {} is not base version {} + 1",
                           plan.transfer_id.ToHex(), plan.target_version, plan.base_version);
  }
  if (!plan.anchor && plan.base_version != s.version) {
    return FailedPrecondition(
        "transfer {} is a delta from version {} but this tracker is at version {}: only an "
        "anchor can move it",
        plan.transfer_id.ToHex(), plan.base_version, s.version);
  }
  s.open = plan;
  return *s.open;
}

bool DeltaTracker::NextIsAnchor() const {
  const State& s = *state_;
  const TrackerOptions& o = s.options;
  if (s.committed_transfers == 0) return true;
  if (o.full_sync_interval > 0 && s.committed_transfers % o.full_sync_interval == 0) return true;
  if (o.max_drift_fraction > 0.0) {
    const uint64_t total = s.TotalElements();
    if (total > 0 && static_cast<double>(s.changed_since_anchor) >
                         o.max_drift_fraction * static_cast<double>(total)) {
      return true;
    }
  }
  return false;
}

Result<Item> DeltaTracker::State::MakeItem(const TensorView& current, Op op, DType value_dtype,
                                           uint64_t begin, uint64_t end,
                                           std::span<const uint64_t> locations,
                                           std::vector<std::byte> values, uint64_t digest) const {
  Item item;
  item.name = current.name;
  item.dtype = current.dtype;
  item.shape = current.shape;
  item.op = op;
  item.value_dtype = value_dtype;
  item.span_begin = begin;
  item.span_end = end;
  item.digest = digest;
  item.values = std::move(values);
  if (op == Op::kFull) {
    item.count = end - begin;
    item.location_encoding = LocationEncoding::kAll;
    return item;
  }
  item.count = locations.size();
  REFIT_ASSIGN_OR_RETURN(
      item.location_encoding,
      ChooseAndEncodeLocations(locations, begin, end, options.force_location_encoding,
                               &item.locations));
  return item;
}

Result<EncodeResult> DeltaTracker::State::EncodeAnchor(const TensorView& current, uint64_t begin,
                                                       uint64_t end) {
  const uint32_t width = DTypeSize(current.dtype);
  BaselineEntry* entry = FindOrCreateEntry(current.name);
  EncodeResult result;
  result.total_elements = end - begin;
  const auto span_bytes = current.bytes.subspan(begin * width, (end - begin) * width);
  const BoxIndexMap* box = BoxOf(current.name);
  const uint64_t span_digest = box ? box->Digest(current.bytes, width, begin, end)
                                   : DigestRange(current.bytes, width, begin, end);

  internal::MutexLock lock(entry->pending_mutex);
  PendingChanges& pending = entry->pending;
  pending.encoded += end - begin;
  const bool same_layout =
      entry->buffer && entry->dtype == current.dtype && entry->shape == current.shape;
  if (same_layout && !pending.replacement) {
    // Keep the pending state O(changes) even though the payload carries every element.
    const auto baseline = entry->buffer->bytes();
    REFIT_ASSIGN_OR_RETURN(GatheredChanges gathered,
                           FindAndGatherChanges(baseline, current.bytes, width, begin, end,
                                                /*with_xor=*/false, options.compare, box));
    const std::vector<uint64_t>& changed = gathered.locations;
    pending.digest_delta += gathered.digest_delta;
    pending.new_bits.insert(pending.new_bits.end(), gathered.new_bits.begin(),
                            gathered.new_bits.end());
    if (!changed.empty()) {
      REFIT_ASSIGN_OR_RETURN(PendingRun run, MakePendingRun(changed, begin, end));
      pending.runs.push_back(std::move(run));
    }
    pending.changed += changed.size();
    result.changed_elements = changed.size();
  } else {
    // New or reshaped tensor: its baseline is built here and installed at commit.
    if (!pending.replacement) {
      REFIT_ASSIGN_OR_RETURN(pending.replacement,
                             BaselineBuffer::Make(options, current.bytes.size()));
      pending.replacement_dtype = current.dtype;
      pending.replacement_shape = current.shape;
      pending.digest_delta = 0;
    } else if (pending.replacement_dtype != current.dtype ||
               pending.replacement_shape != current.shape) {
      return InvalidArgument(
          "tensor '{}': span [{}, {}) has dtype {} shape {}, earlier spans {} {}", current.name,
          begin, end, DTypeName(current.dtype), ShapeToString(current.shape),
          DTypeName(pending.replacement_dtype), ShapeToString(pending.replacement_shape));
    }
    if (!span_bytes.empty()) {  // An empty tensor (an empty shard's box) has no bytes to copy.
      std::memcpy(pending.replacement->bytes().data() + begin * width, span_bytes.data(),
                  span_bytes.size());
    }
    pending.replacement_covered += end - begin;
    pending.digest_delta += span_digest;
    pending.changed += end - begin;
    result.changed_elements = end - begin;
  }
  std::vector<std::byte> values(span_bytes.begin(), span_bytes.end());
  REFIT_ASSIGN_OR_RETURN(Item item, MakeItem(current, Op::kFull, current.dtype, begin, end, {},
                                             std::move(values), span_digest));
  result.items.push_back(std::move(item));
  return result;
}

Result<EncodeResult> DeltaTracker::State::EncodeDelta(BaselineEntry& entry,
                                                      const TensorView& current, uint64_t begin,
                                                      uint64_t end) {
  const uint32_t width = DTypeSize(current.dtype);
  const auto baseline = entry.buffer->bytes();
  EncodeResult result;
  result.total_elements = end - begin;

  const BoxIndexMap* box = BoxOf(current.name);
  Op op = options.op;
  if (overwrite_names.contains(box ? box->box().tensor : current.name)) op = Op::kOverwrite;
  DType value_dtype = current.dtype;
  if (op == Op::kAdd) {
    if (AddSupported(current.dtype, options.add_delta_dtype)) {
      value_dtype = options.add_delta_dtype;
    } else {
      op = Op::kOverwrite;  // Integers and FP8 have no exact additive form; documented.
    }
  }

  // One pass over the span finds the changes and gathers, block by block while in cache, the
  // exact new bits (what commit installs, whatever op travels), the XOR values when XOR travels,
  // and the digest change.
  REFIT_ASSIGN_OR_RETURN(GatheredChanges gathered,
                         FindAndGatherChanges(baseline, current.bytes, width, begin, end,
                                              op == Op::kXor, options.compare, box));
  std::vector<uint64_t>& changed = gathered.locations;
  std::vector<std::byte>& new_bits = gathered.new_bits;
  std::vector<std::byte>& xor_values = gathered.xor_values;
  const uint64_t digest_total = gathered.digest_delta;
  result.changed_elements = changed.size();
  if (changed.empty()) {
    internal::MutexLock lock(entry.pending_mutex);
    entry.pending.encoded += end - begin;
    return result;
  }
  // What Commit scatters the new bits to. Encoded outside the lock: other spans of the tensor
  // may be encoding concurrently.
  std::optional<PendingRun> run;
  if (op == Op::kXor) {
    REFIT_ASSIGN_OR_RETURN(Item item, MakeItem(current, op, value_dtype, begin, end, changed,
                                               std::move(xor_values), digest_total));
    if (!changed.empty()) run = PendingRunOf(item);
    result.items.push_back(std::move(item));
  } else if (op == Op::kOverwrite) {
    REFIT_ASSIGN_OR_RETURN(
        Item item, MakeItem(current, op, value_dtype, begin, end, changed, new_bits, digest_total));
    if (!changed.empty()) run = PendingRunOf(item);
    result.items.push_back(std::move(item));
  } else {
    REFIT_ASSIGN_OR_RETURN(OpValues values, MakeOpValues(op, current.dtype, value_dtype, baseline,
                                                         current.bytes, changed));
    if (!values.locations.empty()) {
      const uint64_t digest = DigestDelta(baseline, current.bytes, width, values.locations, box);
      REFIT_ASSIGN_OR_RETURN(Item item,
                             MakeItem(current, op, value_dtype, begin, end, values.locations,
                                      std::move(values.values), digest));
      result.items.push_back(std::move(item));
    }
    if (!values.demoted_locations.empty()) {
      const uint64_t digest =
          DigestDelta(baseline, current.bytes, width, values.demoted_locations, box);
      REFIT_ASSIGN_OR_RETURN(
          Item item, MakeItem(current, Op::kOverwrite, current.dtype, begin, end,
                              values.demoted_locations, std::move(values.demoted_values), digest));
      result.items.push_back(std::move(item));
    }
  }

  // ADD splits the changes between an ADD and an OVERWRITE item: the run covers them all.
  if (!run.has_value() && !changed.empty()) {
    REFIT_ASSIGN_OR_RETURN(run, MakePendingRun(changed, begin, end));
  }
  internal::MutexLock lock(entry.pending_mutex);
  PendingChanges& pending = entry.pending;
  pending.encoded += end - begin;
  if (run.has_value()) pending.runs.push_back(*std::move(run));
  if (pending.new_bits.empty()) {  // The common case, one span per tensor: no copy.
    pending.new_bits = std::move(new_bits);
  } else {
    pending.new_bits.insert(pending.new_bits.end(), new_bits.begin(), new_bits.end());
  }
  pending.changed += result.changed_elements;
  pending.digest_delta += digest_total;
  return result;
}

Result<EncodeResult> DeltaTracker::Encode(const TransferId& id, const TensorView& current,
                                          uint64_t span_begin, uint64_t span_end) {
  State& s = *state_;
  REFIT_ASSIGN_OR_RETURN(const BoxIndexMap* box,
                         s.CheckEncodeSpan(id, "encode", current, span_begin, span_end));
  REFIT_ASSIGN_OR_RETURN(EncodeResult result, s.EncodeSpan(current, span_begin, span_end));
  if (box != nullptr) {
    REFIT_ASSIGN_OR_RETURN(result.items, ToCanonical(std::move(result.items), *box,
                                                     s.options.force_location_encoding));
  }
  return result;
}

Result<std::vector<Item>> DeltaTracker::EncodeFull(const TransferId& id, const TensorView& current,
                                                   uint64_t span_begin, uint64_t span_end) const {
  const State& s = *state_;
  REFIT_ASSIGN_OR_RETURN(const BoxIndexMap* box,
                         s.CheckEncodeSpan(id, "encode full", current, span_begin, span_end));
  const uint32_t width = DTypeSize(current.dtype);
  const auto span_bytes =
      current.bytes.subspan(span_begin * width, (span_end - span_begin) * width);
  const uint64_t digest = box ? box->Digest(current.bytes, width, span_begin, span_end)
                              : DigestRange(current.bytes, width, span_begin, span_end);
  std::vector<Item> items;
  REFIT_ASSIGN_OR_RETURN(
      Item item, s.MakeItem(current, Op::kFull, current.dtype, span_begin, span_end, {},
                            std::vector<std::byte>(span_bytes.begin(), span_bytes.end()), digest));
  items.push_back(std::move(item));
  if (box != nullptr) {
    return ToCanonical(std::move(items), *box, s.options.force_location_encoding);
  }
  return items;
}

Result<EncodeResult> DeltaTracker::State::EncodeSpan(const TensorView& current, uint64_t span_begin,
                                                     uint64_t span_end) {
  if (open->anchor) return EncodeAnchor(current, span_begin, span_end);

  BaselineEntry* entry = FindEntry(current.name);
  if (entry == nullptr || !entry->buffer) {
    return FailedPrecondition(
        "tensor '{}' has no baseline; only an anchor (FULL) transfer may introduce a tensor",
        current.name);
  }
  if (entry->dtype != current.dtype || entry->shape != current.shape) {
    return FailedPrecondition(
        "tensor '{}' is {} {} but its baseline is {} {}; only an anchor may reshape a tensor",
        current.name, DTypeName(current.dtype), ShapeToString(current.shape),
        DTypeName(entry->dtype), ShapeToString(entry->shape));
  }
  return EncodeDelta(*entry, current, span_begin, span_end);
}

Status DeltaTracker::AdoptBaseline(const TensorView& tensor) {
  State& s = *state_;
  if (s.open) {
    return FailedPrecondition("cannot adopt a baseline for '{}' while transfer {} is open",
                              tensor.name, s.open->transfer_id.ToHex());
  }
  REFIT_RETURN_NOT_OK(CheckTensorSize(tensor));
  const BoxIndexMap* box = s.BoxOf(tensor.name);
  if (box != nullptr) REFIT_RETURN_NOT_OK(s.CheckBoxExtent(*box, tensor));
  // The fold may be writing into the buffer this replaces.
  REFIT_RETURN_NOT_OK(WaitBaseline());
  REFIT_ASSIGN_OR_RETURN(auto buffer, BaselineBuffer::Make(s.options, tensor.bytes.size()));
  if (!tensor.bytes.empty()) {
    std::memcpy(buffer->bytes().data(), tensor.bytes.data(), tensor.bytes.size());
  }
  BaselineEntry* entry = s.FindOrCreateEntry(tensor.name);
  entry->buffer = std::move(buffer);
  entry->dtype = tensor.dtype;
  entry->shape = tensor.shape;
  entry->numel = tensor.numel();
  entry->digest = box ? box->Digest(tensor.bytes, DTypeSize(tensor.dtype), 0, tensor.numel())
                      : TensorDigest(tensor);
  return MarkBaselineAdopted();
}

Status DeltaTracker::Place(const std::string& name, const CanonicalBox& box, const Shape& extent) {
  State& s = *state_;
  if (s.open) {
    return FailedPrecondition("cannot place tensor '{}' while transfer {} is open", name,
                              s.open->transfer_id.ToHex());
  }
  Result<BoxIndexMap> map = BoxIndexMap::Make(box, extent);
  if (!map.ok()) return map.status().WithContext(fmt::format("tensor '{}'", name));
  REFIT_RETURN_NOT_OK(WaitBaseline());  // Placing may drop the baseline the fold writes into.
  const BoxIndexMap* placed = s.BoxOf(name);
  if (placed != nullptr && placed->box() == box && placed->extent() == extent) return Status::OK();
  // A baseline of other canonical elements (or of none: the tensor was tracked whole) cannot
  // serve the new box: drop it, and make the next transfer an anchor that rebuilds it.
  if (s.entries.erase(name) > 0) s.committed_transfers = 0;
  s.boxes.insert_or_assign(name, *std::move(map));
  return Status::OK();
}

Status DeltaTracker::Forget(const std::string& name) {
  State& s = *state_;
  if (s.open) {
    return FailedPrecondition("cannot forget tensor '{}' while transfer {} is open", name,
                              s.open->transfer_id.ToHex());
  }
  REFIT_RETURN_NOT_OK(WaitBaseline());  // The fold may be writing into this baseline.
  s.entries.erase(name);
  s.boxes.erase(name);
  return Status::OK();
}

std::optional<CanonicalBox> DeltaTracker::PlacementOf(const std::string& name) const {
  const BoxIndexMap* box = state_->BoxOf(name);
  if (box == nullptr) return std::nullopt;
  return box->box();
}

Status DeltaTracker::Rebase(uint64_t version) {
  State& s = *state_;
  if (s.open) {
    return FailedPrecondition("cannot rebase to version {} while transfer {} is open", version,
                              s.open->transfer_id.ToHex());
  }
  s.version = version;
  return Status::OK();
}

Status DeltaTracker::MarkBaselineAdopted() {
  State& s = *state_;
  if (s.open) {
    return FailedPrecondition("cannot adopt a baseline while transfer {} is open",
                              s.open->transfer_id.ToHex());
  }
  // A failed fold drops its tensors and asks for an anchor: the adopted state must not hide it.
  REFIT_RETURN_NOT_OK(WaitBaseline());
  // The adopted state plays the role of a committed anchor.
  s.committed_transfers = std::max<uint64_t>(s.committed_transfers, 1);
  s.changed_since_anchor = 0;
  return Status::OK();
}

Status DeltaTracker::CheckModelCovered(const TransferId& id) const {
  const State& s = *state_;
  REFIT_RETURN_NOT_OK(s.CheckOpen(id, "check"));
  if (s.open->anchor) return Status::OK();
  std::shared_lock lock(s.entries_mutex);
  for (const auto& [name, entry] : s.entries) {
    if (entry->buffer && entry->pending.encoded != entry->numel) {
      return FailedPrecondition(
          "transfer {}: tensor '{}' has a baseline but this sync's model gave {} of its {} "
          "elements; a delta must cover the whole model it was adopted or anchored with (to "
          "drop or add tensors, force an anchor)",
          id.ToHex(), name, entry->pending.encoded, entry->numel);
    }
  }
  return Status::OK();
}

Status DeltaTracker::Commit(const TransferId& id) {
  State& s = *state_;
  REFIT_RETURN_NOT_OK(s.CheckOpen(id, "commit"));
  // Check everything before changing anything, so a failed commit leaves the tracker intact.
  for (const auto& [name, entry] : s.entries) {
    const PendingChanges& p = entry->pending;
    if (!p.replacement) continue;
    REFIT_ASSIGN_OR_RETURN(uint64_t numel, NumElements(p.replacement_shape));
    if (p.replacement_covered != numel) {
      return FailedPrecondition("commit of transfer {}: tensor '{}' covered {} of {} elements",
                                id.ToHex(), name, p.replacement_covered, numel);
    }
  }
  uint64_t changed = 0;
  // The tensors whose changes are scattered into their baselines: moved out of their pending
  // state here and folded in the background (the job started below), each baseline by one thread.
  std::vector<FoldWork> folds;
  uint64_t fold_elements = 0;
  for (auto& [name, entry] : s.entries) {
    PendingChanges& p = entry->pending;
    changed += p.changed;
    // A tensor an anchor did not send is no longer part of the model.
    if (s.open->anchor && p.encoded == 0) entry->buffer.reset();
    if (p.replacement) {
      entry->buffer = std::move(p.replacement);
      entry->dtype = p.replacement_dtype;
      entry->shape = p.replacement_shape;
      entry->numel = entry->buffer->bytes().size() / DTypeSize(entry->dtype);
      entry->digest = p.digest_delta;
    } else if (!p.runs.empty()) {
      // The digest is known now: Digests() need not wait for the bytes.
      entry->digest += p.digest_delta;
      fold_elements += p.changed;
      folds.push_back(FoldWork{name, entry->buffer->bytes(), DTypeSize(entry->dtype),
                               std::move(p.runs), std::move(p.new_bits)});
    }
  }
  for (auto& [name, entry] : s.entries) entry->pending = PendingChanges{};
  // Entries without data (created by an anchor Encode that never received any, or not sent by
  // an anchor) stay out of the baseline. None of them is folded (a fold needs a buffer).
  std::erase_if(s.entries, [](const auto& kv) { return !kv.second->buffer; });
  s.changed_since_anchor = s.open->anchor ? 0 : s.changed_since_anchor + changed;
  s.version = s.open->target_version;
  ++s.committed_transfers;
  s.open.reset();
  s.folding.clear();
  for (const FoldWork& work : folds) s.folding.push_back(work.name);
  s.fold_elements = fold_elements;
  if (folds.empty()) return Status::OK();
  // Begin waited for the previous fold, so the job is idle: Start does not block.
  s.fold.Start([folds = std::move(folds), threads = s.options.commit_threads,
                hook = s.fold_hook]() mutable -> Status {
    if (hook) REFIT_RETURN_NOT_OK(hook());
    return internal::ParallelFor(
        std::clamp<int>(static_cast<int>(folds.size()), 1, threads), folds.size(),
        [&](uint64_t begin, uint64_t end) -> Status {
          for (uint64_t k = begin; k < end; ++k) {
            FoldWork& work = folds[k];
            REFIT_RETURN_NOT_OK(ScatterRuns(work.baseline, work.width, work.runs, work.new_bits)
                                    .WithContext(fmt::format("commit of tensor '{}'", work.name)));
            // Free each tensor's changes as soon as they are in: the fold's memory falls as it
            // goes.
            work.runs = {};
            work.new_bits = {};
          }
          return Status::OK();
        });
  });
  return Status::OK();
}

Status DeltaTracker::WaitBaseline() {
  State& s = *state_;
  Status folded = s.fold.Wait();
  if (folded.ok()) {
    s.folding.clear();
    return Status::OK();
  }
  // Some of these baselines may hold part of the committed changes and part of the old bits: none
  // of them can serve a compare. Drop them, and make the next transfer the anchor that rebuilds
  // them (the receivers hold the committed version: only the tracker lost it).
  const size_t dropped = s.folding.size();
  for (const std::string& name : s.folding) s.entries.erase(name);
  s.folding.clear();
  s.committed_transfers = 0;
  return folded.WithContext(fmt::format(
      "the background fold of version {}'s changes into the baseline failed; its {} tensors were "
      "dropped from the baseline and the next transfer is an anchor",
      s.version, dropped));
}

BaselineFoldReport DeltaTracker::last_fold() const {
  const State& s = *state_;
  // A commit with nothing to scatter (a delta that changed nothing, an anchor of new tensors)
  // started no fold: the job's seconds are an earlier fold's.
  const bool folded = s.fold_elements > 0;
  return BaselineFoldReport{s.fold_elements, folded ? s.fold.last_job_seconds() : 0.0,
                            folded && !s.fold.idle(), s.fold.waited_seconds()};
}

void DeltaTracker::SetFoldHookForTesting(std::function<Status()> hook) {
  state_->fold_hook = std::move(hook);
}

Status DeltaTracker::Abort(const TransferId& id) {
  State& s = *state_;
  REFIT_RETURN_NOT_OK(s.CheckOpen(id, "abort"));
  for (auto& [name, entry] : s.entries) entry->pending = PendingChanges{};
  std::erase_if(s.entries, [](const auto& kv) { return !kv.second->buffer; });
  s.open.reset();
  return Status::OK();
}

uint64_t DeltaTracker::version() const { return state_->version; }

std::optional<TransferPlan> DeltaTracker::open_transfer() const { return state_->open; }

std::map<std::string, uint64_t> DeltaTracker::Digests() const {
  std::map<std::string, uint64_t> out;
  for (const auto& [name, entry] : state_->entries) {
    if (entry->buffer) out[name] = entry->digest;
  }
  return out;
}

std::map<std::string, uint64_t> DeltaTracker::PendingDigests() const {
  std::map<std::string, uint64_t> out;
  for (const auto& [name, entry] : state_->entries) {
    const PendingChanges& p = entry->pending;
    if (p.replacement) {
      out[name] = p.digest_delta;
    } else if (entry->buffer) {
      out[name] = entry->digest + p.digest_delta;
    }
  }
  return out;
}

uint64_t DeltaTracker::baseline_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, entry] : state_->entries) {
    if (entry->buffer) total += entry->buffer->bytes().size();
  }
  return total;
}

uint64_t DeltaTracker::pending_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, entry] : state_->entries) {
    const PendingChanges& p = entry->pending;
    total += p.new_bits.size();
    for (const PendingRun& run : p.runs) total += run.bytes.size() + sizeof(PendingRun);
    if (p.replacement) total += p.replacement->bytes().size();
  }
  return total;
}

Result<TensorView> DeltaTracker::Baseline(const std::string& name) const {
  const State& s = *state_;
  if (Status folded = s.fold.WaitIdle();
      !folded.ok() && std::ranges::find(s.folding, name) != s.folding.end()) {
    return folded.WithContext(
        fmt::format("baseline of tensor '{}': the background fold into it failed", name));
  }
  const BaselineEntry* entry = s.FindEntry(name);
  if (entry == nullptr || !entry->buffer) return NotFound("no baseline for tensor '{}'", name);
  return TensorView{name, entry->dtype, entry->shape, entry->buffer->bytes()};
}

}  // namespace refit::internal
