#include "pipeline/bucketing.h"
#include "pipeline/producer_stream.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "codec/tracker.h"
#include "core/digest.h"
#include "pipeline/anchor_compression.h"
#include "receiver/apply.h"
#include "refit/status_format.h"
#include "refit/weight_store.h"
#include "test_data.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::Perturb;
using testing::RandomTensor;

// ---------------------------------------------------------------------------------------------
// Chunking and ownership

std::vector<ChunkRange> Plan(const std::vector<uint64_t>& sizes, uint64_t target) {
  return PlanChunks(sizes, target);
}

TEST(ChunkingTest, EmptyListGivesNoChunks) {
  EXPECT_TRUE(PlanChunks(std::span<const uint64_t>(), 100).empty());
}

TEST(ChunkingTest, AppendsWhileTheTotalStaysWithinTheTarget) {
  EXPECT_EQ(Plan({30, 30, 30, 30}, 100), (std::vector<ChunkRange>{{0, 3, 90}, {3, 4, 30}}));
  EXPECT_EQ(Plan({5}, 100), (std::vector<ChunkRange>{{0, 1, 5}}));
}

TEST(ChunkingTest, ReachingTheTargetExactlyClosesTheChunk) {
  EXPECT_EQ(Plan({60, 40, 10}, 100), (std::vector<ChunkRange>{{0, 2, 100}, {2, 3, 10}}));
  // Once closed, even an empty tensor starts the next chunk.
  EXPECT_EQ(Plan({100, 0}, 100), (std::vector<ChunkRange>{{0, 1, 100}, {1, 2, 0}}));
  // Empty tensors join an open chunk.
  EXPECT_EQ(Plan({0, 100, 0}, 100), (std::vector<ChunkRange>{{0, 2, 100}, {2, 3, 0}}));
}

TEST(ChunkingTest, ATensorThatWouldOverflowStartsTheNextChunk) {
  EXPECT_EQ(Plan({70, 31}, 100), (std::vector<ChunkRange>{{0, 1, 70}, {1, 2, 31}}));
  EXPECT_EQ(Plan({70, 30, 1}, 100), (std::vector<ChunkRange>{{0, 2, 100}, {2, 3, 1}}));
}

TEST(ChunkingTest, ATensorLargerThanTheTargetFormsItsOwnChunk) {
  EXPECT_EQ(Plan({10, 250, 20}, 100),
            (std::vector<ChunkRange>{{0, 1, 10}, {1, 2, 250}, {2, 3, 20}}));
  EXPECT_EQ(Plan({250}, 100), (std::vector<ChunkRange>{{0, 1, 250}}));
  EXPECT_EQ(Plan({250, 250}, 100), (std::vector<ChunkRange>{{0, 1, 250}, {1, 2, 250}}));
}

TEST(ChunkingTest, ZeroTargetGivesOneChunkPerTensor) {
  EXPECT_EQ(Plan({0, 7, 0}, 0), (std::vector<ChunkRange>{{0, 1, 0}, {1, 2, 7}, {2, 3, 0}}));
}

TEST(ChunkingTest, SizesNearTwoToThe64DoNotWrap) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  // A wrapping running sum would see kMax - 10 + 20 = 9 <= target and append the second tensor.
  EXPECT_EQ(Plan({kMax - 10, 20}, kMax - 1),
            (std::vector<ChunkRange>{{0, 1, kMax - 10}, {1, 2, 20}}));
}

TEST(ChunkingTest, RandomSizesObeyTheRule) {
  constexpr uint64_t kTarget = 1000;
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::vector<uint64_t> sizes(rng() % 40);
    for (uint64_t& size : sizes) size = rng() % 3 == 0 ? rng() % 2500 : rng() % 400;
    const std::vector<ChunkRange> plan = Plan(sizes, kTarget);
    size_t next = 0;
    for (size_t c = 0; c < plan.size(); ++c) {
      const ChunkRange& chunk = plan[c];
      ASSERT_EQ(chunk.begin, next);
      ASSERT_LT(chunk.begin, chunk.end);
      next = chunk.end;
      uint64_t total = 0;
      for (size_t i = chunk.begin; i < chunk.end; ++i) {
        // Every tensor but the last found the chunk still open (below the target).
        if (i + 1 < chunk.end) {
          EXPECT_LT(total + sizes[i], kTarget);
        }
        total += sizes[i];
      }
      EXPECT_EQ(chunk.bytes, total);
      EXPECT_TRUE(total <= kTarget || chunk.end - chunk.begin == 1) << "round " << round;
      // A chunk ends at the target, at a tensor that would overflow it, or at the list's end.
      if (c + 1 < plan.size()) {
        EXPECT_TRUE(total >= kTarget || total + sizes[chunk.end] > kTarget) << "round " << round;
      }
    }
    EXPECT_EQ(next, sizes.size());
    Chunker chunker(kTarget);
    for (uint64_t size : sizes) chunker.Add(size);
    EXPECT_EQ(chunker.chunks(), plan.size());
  }
}

TEST(OwnershipTest, EveryChunkHasExactlyOneOwner) {
  for (uint32_t producers = 1; producers <= 4; ++producers) {
    for (uint64_t chunk = 0; chunk < 20; ++chunk) {
      int owners = 0;
      for (uint32_t p = 0; p < producers; ++p) {
        if (OwnsChunk(chunk, p, producers)) {
          ++owners;
          EXPECT_EQ(p, chunk % producers);
        }
      }
      EXPECT_EQ(owners, 1) << "chunk " << chunk << " of " << producers << " producers";
    }
  }
}

TEST(TensorListSourceTest, YieldsThePlannedChunksThenEnds) {
  const std::vector<OwnedTensor> tensors = {
      RandomTensor("a", DType::kFloat32, {20}, 1), RandomTensor("b", DType::kFloat32, {5}, 2),
      RandomTensor("c", DType::kFloat32, {30}, 3), RandomTensor("d", DType::kUInt8, {3}, 4)};
  std::vector<TensorView> views;
  for (const OwnedTensor& t : tensors) views.push_back(t.view());
  // Sizes 80, 20, 120, 3 with target 100: {a, b} closes at 100, c is too large, d alone.
  ChunkSource source = TensorListSource(views, 100);
  std::vector<std::vector<std::string>> names;
  while (true) {
    ASSERT_OK_AND_ASSIGN(std::optional<ExportChunk> chunk, source(ChunkPull{}));
    if (!chunk) break;
    names.emplace_back();
    for (const TensorView& t : chunk->tensors) names.back().push_back(t.name);
  }
  EXPECT_EQ(names, (std::vector<std::vector<std::string>>{{"a", "b"}, {"c"}, {"d"}}));
  ASSERT_OK_AND_ASSIGN(std::optional<ExportChunk> after_end, source(ChunkPull{}));
  EXPECT_FALSE(after_end.has_value());
}

// ---------------------------------------------------------------------------------------------
// Stream fixtures

/// The chunk target of the stream tests: the model below then has chunks of one to four tensors,
/// and the embedding exceeds it.
constexpr uint64_t kChunkBytes = 4096;
/// Small enough that a transfer makes several payloads and anchor items exceed it.
constexpr uint64_t kBucketBytes = 1024;

/// A small model with the dtypes of a real checkpoint (bf16, fp16, fp32, FP8 scales, int64).
std::vector<OwnedTensor> MakeModel(uint64_t seed) {
  std::vector<OwnedTensor> model;
  model.push_back(RandomTensor("model.embed_tokens.weight", DType::kBFloat16, {96, 32}, seed));
  for (int layer = 0; layer < 3; ++layer) {
    const std::string prefix = fmt::format("model.layers.{}.", layer);
    const uint64_t s = seed + 10 * static_cast<uint64_t>(layer + 1);
    model.push_back(
        RandomTensor(prefix + "self_attn.q_proj.weight", DType::kBFloat16, {32, 32}, s + 1));
    model.push_back(
        RandomTensor(prefix + "self_attn.k_proj.weight", DType::kFloat16, {16, 32}, s + 2));
    model.push_back(RandomTensor(prefix + "mlp.up_proj.weight", DType::kFloat32, {32, 24}, s + 3));
    model.push_back(
        RandomTensor(prefix + "mlp.up_proj.weight_scale", DType::kFloat8E4M3FN, {40}, s + 4));
    model.push_back(RandomTensor(prefix + "input_layernorm.weight", DType::kFloat32, {32}, s + 5));
  }
  model.push_back(RandomTensor("model.step_counter", DType::kInt64, {2}, seed + 98));
  model.push_back(RandomTensor("lm_head.weight", DType::kBFloat16, {64, 32}, seed + 99));
  return model;
}

std::vector<OwnedTensor> PerturbModel(const std::vector<OwnedTensor>& model, double density,
                                      uint64_t seed) {
  std::vector<OwnedTensor> next;
  for (size_t i = 0; i < model.size(); ++i) next.push_back(Perturb(model[i], density, seed + i));
  return next;
}

std::vector<TensorView> Views(const std::vector<OwnedTensor>& model) {
  std::vector<TensorView> views;
  for (const OwnedTensor& t : model) views.push_back(t.view());
  return views;
}

std::vector<uint64_t> Sizes(const std::vector<OwnedTensor>& model) {
  std::vector<uint64_t> sizes;
  for (const OwnedTensor& t : model) sizes.push_back(t.bytes.size());
  return sizes;
}

/// Elements whose bits differ between two versions of a model.
uint64_t ChangedElements(const std::vector<OwnedTensor>& a, const std::vector<OwnedTensor>& b) {
  uint64_t changed = 0;
  for (size_t t = 0; t < a.size(); ++t) {
    const uint32_t width = DTypeSize(a[t].dtype);
    for (size_t i = 0; i < a[t].bytes.size(); i += width) {
      changed += std::memcmp(&a[t].bytes[i], &b[t].bytes[i], width) != 0;
    }
  }
  return changed;
}

uint64_t TotalElements(const std::vector<OwnedTensor>& model) {
  uint64_t total = 0;
  for (const OwnedTensor& t : model) total += t.view().numel();
  return total;
}

ProducerStreamOptions SmallOptions(uint32_t producer_id = 0, uint32_t num_producers = 1) {
  ProducerStreamOptions options;
  options.producer_id = producer_id;
  options.num_producers = num_producers;
  options.chunk_bytes = kChunkBytes;
  options.bucket_bytes = kBucketBytes;
  options.encode_threads = 3;
  options.serialize_threads = 2;
  options.send_threads = 2;
  options.max_payloads_in_flight = 3;
  return options;
}

using PayloadMap = std::map<uint32_t, std::vector<std::byte>>;

/// Collects the payloads a stream sends, keyed by id; a repeated id is an error.
class PayloadCollector {
 public:
  PayloadSender Sender() {
    return [this](uint32_t payload_id, std::span<const std::byte> payload) -> Status {
      std::lock_guard lock(mutex_);
      if (!payloads_.emplace(payload_id, std::vector<std::byte>(payload.begin(), payload.end()))
               .second) {
        return Internal("payload {} sent twice", payload_id);
      }
      return Status::OK();
    };
  }
  /// Read after the stream returned.
  const PayloadMap& payloads() const { return payloads_; }

 private:
  std::mutex mutex_;
  PayloadMap payloads_;
};

/// Counts cleanup calls and the threads they ran on.
class CleanupRecorder {
 public:
  SenderCleanup Cleanup() {
    return [this] {
      std::lock_guard lock(mutex_);
      threads_.push_back(std::this_thread::get_id());
    };
  }
  std::vector<std::thread::id> threads() {
    std::lock_guard lock(mutex_);
    return threads_;
  }

 private:
  std::mutex mutex_;
  std::vector<std::thread::id> threads_;
};

/// Decode and apply one producer's payloads; check that their ids are 0..n-1 and that each
/// header names the transfer, the producer and the version step.
void ApplyPayloads(const PayloadMap& payloads, const TransferPlan& plan, uint32_t producer_id,
                   WeightStore& store, internal::UndoLog& undo) {
  uint32_t expected_id = 0;
  for (const auto& [payload_id, bytes] : payloads) {
    EXPECT_EQ(payload_id, expected_id++);
    ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(bytes));
    const PayloadIds& ids = decoded.header().ids;
    EXPECT_EQ(ids.payload_id, payload_id);
    EXPECT_EQ(ids.producer_id, producer_id);
    EXPECT_EQ(ids.transfer_id, plan.transfer_id);
    EXPECT_EQ(ids.base_version, plan.base_version);
    EXPECT_EQ(ids.target_version, plan.target_version);
    ASSERT_OK(internal::ApplyPayload(decoded, store, &undo));
  }
}

/// Expect `store` to hold exactly `model`, with digests kept current.
void ExpectStoreHolds(const WeightStore& store, const std::vector<OwnedTensor>& model) {
  ASSERT_EQ(store.size(), model.size());
  for (const OwnedTensor& t : model) {
    ASSERT_OK_AND_ASSIGN(TensorView got, store.Find(t.name));
    EXPECT_TRUE(std::equal(got.bytes.begin(), got.bytes.end(), t.bytes.begin(), t.bytes.end()))
        << t.name;
  }
  EXPECT_EQ(store.Digests(), store.RecomputeDigests());
}

/// A store whose tensors have the model's names and shapes but zero bits, as a receiver that
/// has allocated its weights and waits for the first (anchor) transfer.
std::unique_ptr<WeightStore> ZeroStore(const std::vector<OwnedTensor>& model) {
  auto store = WeightStore::Make();
  for (OwnedTensor t : model) {
    std::fill(t.bytes.begin(), t.bytes.end(), std::byte{0});
    EXPECT_OK(store->AddCopy(t.view()));
  }
  return store;
}

std::unique_ptr<WeightStore> StoreOf(const std::vector<OwnedTensor>& model) {
  auto store = WeightStore::Make();
  for (const OwnedTensor& t : model) EXPECT_OK(store->AddCopy(t.view()));
  return store;
}

/// A tracker whose baseline is `model` (as after an anchor), at version 0.
std::unique_ptr<internal::DeltaTracker> TrackerAt(const std::vector<OwnedTensor>& model) {
  auto tracker = internal::DeltaTracker::Make({});
  EXPECT_TRUE(tracker.ok()) << tracker.status().ToString();
  for (const OwnedTensor& t : model) EXPECT_OK((*tracker)->AdoptBaseline(t.view()));
  return std::move(tracker).ValueOrDie();
}

// ---------------------------------------------------------------------------------------------
// End to end: W producers, one receiver

class StreamFleetTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(StreamFleetTest, AnchorThenDeltaReproduceTheTrainerBitExactly) {
  const uint32_t producers = GetParam();
  const std::vector<OwnedTensor> v0 = MakeModel(1);
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.05, 100);
  const std::vector<ChunkRange> plan = PlanChunks(Sizes(v0), kChunkBytes);
  ASSERT_GT(plan.size(), producers);

  std::vector<std::unique_ptr<internal::DeltaTracker>> trackers;
  for (uint32_t p = 0; p < producers; ++p) {
    ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));
    trackers.push_back(std::move(tracker));
  }
  std::unique_ptr<WeightStore> store = ZeroStore(v0);

  for (const auto* model : {&v0, &v1}) {
    const bool anchor = model == &v0;
    SCOPED_TRACE(anchor ? "anchor" : "delta");
    const TransferId id = TransferId::Random();
    internal::UndoLog undo;
    uint64_t changed = 0;
    uint64_t total = 0;
    std::multiset<std::string> sent_tensors;
    std::map<std::string, uint64_t> pending_digests;
    for (uint32_t p = 0; p < producers; ++p) {
      ASSERT_OK_AND_ASSIGN(TransferPlan transfer, trackers[p]->Begin(id));
      EXPECT_EQ(transfer.anchor, anchor);
      ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(SmallOptions(p, producers)));
      PayloadCollector collector;
      CleanupRecorder cleanup;
      ASSERT_OK_AND_ASSIGN(StreamReport report,
                           stream->Run(*trackers[p], TensorListSource(Views(*model), kChunkBytes),
                                       collector.Sender(), cleanup.Cleanup()));
      // Every producer walks every chunk and encodes exactly the ones it owns.
      EXPECT_EQ(report.chunks, plan.size());
      uint64_t owned = 0;
      std::set<std::string> owned_tensors;
      for (size_t k = 0; k < plan.size(); ++k) {
        if (!OwnsChunk(k, p, producers)) continue;
        ++owned;
        for (size_t t = plan[k].begin; t < plan[k].end; ++t) owned_tensors.insert(v0[t].name);
      }
      EXPECT_EQ(report.owned_chunks, owned);
      EXPECT_EQ(report.payloads, collector.payloads().size());
      EXPECT_EQ(cleanup.threads().size(), 2u);
      changed += report.changed_elements;
      total += report.total_elements;

      uint64_t items = 0;
      uint64_t wire_bytes = 0;
      for (const auto& [payload_id, bytes] : collector.payloads()) {
        ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(bytes));
        wire_bytes += bytes.size();
        for (const ItemView& item : decoded.items()) {
          ++items;
          EXPECT_TRUE(owned_tensors.contains(std::string(item.name)))
              << "producer " << p << " sent unowned tensor " << item.name;
          if (anchor) sent_tensors.insert(std::string(item.name));
        }
      }
      EXPECT_EQ(report.items, items);
      EXPECT_EQ(report.wire_bytes, wire_bytes);
      ASSERT_NO_FATAL_FAILURE(ApplyPayloads(collector.payloads(), transfer, p, *store, undo));
      for (const auto& [name, digest] : trackers[p]->PendingDigests()) {
        pending_digests[name] = digest;
      }
    }
    if (anchor) {
      // The union of all producers covers every tensor exactly once.
      std::multiset<std::string> all;
      for (const OwnedTensor& t : v0) all.insert(t.name);
      EXPECT_EQ(sent_tensors, all);
      EXPECT_EQ(changed, TotalElements(v0));
    } else {
      EXPECT_EQ(changed, ChangedElements(v0, v1));
    }
    EXPECT_EQ(total, TotalElements(v0));
    ExpectStoreHolds(*store, *model);
    EXPECT_EQ(store->Digests(), pending_digests);
    for (auto& tracker : trackers) ASSERT_OK(tracker->Commit(id));
    undo.Clear();
  }
}

INSTANTIATE_TEST_SUITE_P(Producers, StreamFleetTest, ::testing::Values(1u, 2u, 3u, 4u),
                         [](const auto& param_info) {
                           return fmt::format("W{}", param_info.param);
                         });

TEST(ProducerStreamTest, UnchangedChunksSendNothingButCountInTheTotals) {
  const std::vector<OwnedTensor> v0 = MakeModel(2);
  std::vector<OwnedTensor> v1 = v0;
  v1.back() = Perturb(v1.back(), 0.05, 5);  // Only lm_head.weight, in the last chunk, changes.
  auto tracker = TrackerAt(v0);
  ProducerStreamOptions options = SmallOptions();
  options.bucket_bytes = uint64_t{1} << 20;
  ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(options));

  const TransferId id = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(id));
  PayloadCollector collector;
  ASSERT_OK_AND_ASSIGN(
      StreamReport report,
      stream->Run(*tracker, TensorListSource(Views(v1), kChunkBytes), collector.Sender()));
  EXPECT_EQ(report.payloads, 1u);
  EXPECT_EQ(report.items, 1u);
  EXPECT_EQ(report.owned_chunks, PlanChunks(Sizes(v0), kChunkBytes).size());
  EXPECT_EQ(report.total_elements, TotalElements(v0));
  EXPECT_EQ(report.changed_elements, ChangedElements(v0, v1));
  auto store = StoreOf(v0);
  internal::UndoLog undo;
  ASSERT_NO_FATAL_FAILURE(ApplyPayloads(collector.payloads(), plan, 0, *store, undo));
  ExpectStoreHolds(*store, v1);
  ASSERT_OK(tracker->Commit(id));

  // Nothing changed at all: no payload, no send, yet every element was compared.
  ASSERT_OK(tracker->Begin(TransferId::Random()).status());
  std::atomic<int> sends = 0;
  ASSERT_OK_AND_ASSIGN(report, stream->Run(*tracker, TensorListSource(Views(v1), kChunkBytes),
                                           [&](uint32_t, std::span<const std::byte>) {
                                             ++sends;
                                             return Status::OK();
                                           }));
  EXPECT_EQ(report.payloads, 0u);
  EXPECT_EQ(sends.load(), 0);
  EXPECT_EQ(report.changed_elements, 0u);
  EXPECT_EQ(report.total_elements, TotalElements(v0));
}

/// Whether a payload's body is a frame of raw zstd blocks (the descriptor PayloadEncodeOptions::
/// compress = false writes) rather than compressed.
// Whether an anchor payload went raw: its body stored as it is (the header's compression byte, at
// offset 52, is 0: docs/format/payload.md).
bool IsStoredBody(const std::vector<std::byte>& payload) {
  return payload.size() > kPayloadHeaderSize && payload[52] == std::byte{0};
}

// kNone sends an anchor raw (stored bodies), kZstd compressed; deltas are compressed either way,
// and the receiver reproduces both exactly.
TEST(ProducerStreamTest, AnAnchorIsSentRawOrCompressedAsAnchorCompressionSays) {
  const std::vector<OwnedTensor> v0 = MakeModel(3);
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.05, 31);
  for (AnchorCompression mode : {AnchorCompression::kNone, AnchorCompression::kZstd}) {
    SCOPED_TRACE(AnchorCompressionName(mode));
    ProducerStreamOptions options = SmallOptions();
    options.anchor_compression = mode;
    ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(options));
    ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));
    std::unique_ptr<WeightStore> store = ZeroStore(v0);
    for (const auto* model : {&v0, &v1}) {
      const bool anchor = model == &v0;
      const TransferId id = TransferId::Random();
      ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(id));
      ASSERT_EQ(plan.anchor, anchor);
      PayloadCollector collector;
      ASSERT_OK_AND_ASSIGN(
          StreamReport report,
          stream->Run(*tracker, TensorListSource(Views(*model), kChunkBytes), collector.Sender()));
      ASSERT_GT(report.payloads, 1u);
      const bool raw = anchor && mode == AnchorCompression::kNone;
      EXPECT_EQ(report.anchor_compression.anchor, anchor);
      EXPECT_EQ(report.anchor_compression.raw_payloads, raw ? report.payloads : 0u);
      EXPECT_EQ(report.anchor_compression.compressed_payloads, raw ? 0u : report.payloads);
      EXPECT_FALSE(report.anchor_compression.measured);
      for (const auto& [payload_id, bytes] : collector.payloads()) {
        EXPECT_EQ(IsStoredBody(bytes), raw) << "payload " << payload_id;
      }
      internal::UndoLog undo;
      ASSERT_NO_FATAL_FAILURE(ApplyPayloads(collector.payloads(), plan, 0, *store, undo));
      ExpectStoreHolds(*store, *model);
      ASSERT_OK(tracker->Commit(id));
    }
  }
}

// The payloads of each kind (compressed, raw) an auto anchor sends before it decides, with
// SmallOptions' threads.
constexpr uint64_t kAutoProbePayloads =
    std::max<uint64_t>(internal::AnchorCompressionChooser::kMinProbePayloads, 2 + 2);

// kAuto measures the anchor's first payloads, alternately compressed and raw: with a link far
// slower than the compressor (its time proportional to the bytes) and weights that compress, it
// keeps compressing; with a link that costs nothing (a memory copy) it sends the rest raw. Either
// way the anchor arrives exactly.
TEST(ProducerStreamTest, AutoAnchorCompressionFollowsTheMeasuredRates) {
  // Two copies of the small model, under other names: payloads enough after the probe for the
  // decision to show in the counts.
  const auto twice = [](uint64_t seed) {
    std::vector<OwnedTensor> model = MakeModel(seed);
    for (OwnedTensor& t : MakeModel(seed + 100)) {
      t.name = "copy." + t.name;
      model.push_back(std::move(t));
    }
    return model;
  };
  std::vector<OwnedTensor> compressible = twice(4);
  for (OwnedTensor& t : compressible) std::fill(t.bytes.begin(), t.bytes.end(), std::byte{0x11});
  for (const bool slow_link : {true, false}) {
    SCOPED_TRACE(slow_link ? "slow link, compressible weights" : "free link");
    const std::vector<OwnedTensor> model = slow_link ? compressible : twice(5);
    ProducerStreamOptions options = SmallOptions();
    options.anchor_compression = AnchorCompression::kAuto;
    ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(options));
    ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));
    const TransferId id = TransferId::Random();
    ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(id));
    PayloadCollector collector;
    PayloadSender collect = collector.Sender();
    const PayloadSender send = [&](uint32_t payload_id, std::span<const std::byte> bytes) {
      // 10 us per byte (10 ms for a raw payload of ~1 KiB): about 0.2 MB/s over two senders.
      if (slow_link) std::this_thread::sleep_for(std::chrono::microseconds(10 * bytes.size()));
      return collect(payload_id, bytes);
    };
    ASSERT_OK_AND_ASSIGN(StreamReport report,
                         stream->Run(*tracker, TensorListSource(Views(model), kChunkBytes), send));
    const AnchorCompressionReport& decided = report.anchor_compression;
    // Enough payloads after the probe that the decision shows in the counts.
    ASSERT_GT(report.payloads, 4 * kAutoProbePayloads);
    EXPECT_TRUE(decided.measured);
    EXPECT_GT(decided.compress_bytes_per_s, 0);
    EXPECT_GT(decided.link_bytes_per_s, 0);
    EXPECT_EQ(decided.compressed_payloads + decided.raw_payloads, report.payloads);
    // The probe sent at least kAutoProbePayloads of each kind (and a few more of each while it
    // finished); the decision sends all the rest one way.
    EXPECT_GE(decided.raw_payloads, kAutoProbePayloads);
    EXPECT_GE(decided.compressed_payloads, kAutoProbePayloads);
    if (slow_link) {
      EXPECT_LT(decided.ratio, 0.5);
      EXPECT_GT(decided.compressed_payloads, decided.raw_payloads + kAutoProbePayloads);
    } else {
      EXPECT_GT(decided.raw_payloads, decided.compressed_payloads + kAutoProbePayloads);
    }

    std::unique_ptr<WeightStore> store = ZeroStore(model);
    internal::UndoLog undo;
    ASSERT_NO_FATAL_FAILURE(ApplyPayloads(collector.payloads(), plan, 0, *store, undo));
    ExpectStoreHolds(*store, model);
    ASSERT_OK(tracker->Commit(id));
  }
}

/// Expect the payloads (ids 0..n-1) to follow the bucket rule exactly and to carry the items in
/// canonical tensor order.
void ExpectBucketRule(const PayloadMap& payloads, uint64_t bucket_bytes,
                      const std::vector<OwnedTensor>& model) {
  std::map<std::string, size_t> position;
  for (size_t i = 0; i < model.size(); ++i) position[model[i].name] = i;
  std::vector<std::vector<uint64_t>> item_bytes;  // Per payload, per item.
  size_t last_position = 0;
  for (const auto& [payload_id, bytes] : payloads) {
    ASSERT_EQ(payload_id, item_bytes.size());
    ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(bytes));
    item_bytes.emplace_back();
    for (const ItemView& item : decoded.items()) {
      item_bytes.back().push_back(item.locations.size() + item.values.size());
      const size_t at = position.at(std::string(item.name));
      EXPECT_GE(at, last_position) << "item " << item.name << " out of canonical order";
      last_position = at;
    }
  }
  for (size_t p = 0; p < item_bytes.size(); ++p) {
    const std::vector<uint64_t>& items = item_bytes[p];
    ASSERT_FALSE(items.empty()) << "payload " << p;
    uint64_t total = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      // A bucket below the cap stays open for the next item that fits.
      if (i > 0) {
        EXPECT_LT(total, bucket_bytes) << "payload " << p << " item " << i;
      }
      total += items[i];
    }
    EXPECT_TRUE(total <= bucket_bytes || items.size() == 1)
        << "payload " << p << " holds " << total << " bytes in " << items.size() << " items";
    if (p + 1 < item_bytes.size()) {
      EXPECT_TRUE(total >= bucket_bytes || total + item_bytes[p + 1].front() > bucket_bytes)
          << "payload " << p << " closed at " << total << " bytes";
    }
  }
}

TEST(ProducerStreamTest, PayloadsFollowTheBucketRuleInCanonicalOrder) {
  const std::vector<OwnedTensor> v0 = MakeModel(3);
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.08, 200);
  ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));
  ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(SmallOptions()));
  for (const auto* model : {&v0, &v1}) {
    SCOPED_TRACE(model == &v0 ? "anchor: FULL items, several larger than a bucket" : "delta");
    const TransferId id = TransferId::Random();
    ASSERT_OK(tracker->Begin(id).status());
    PayloadCollector collector;
    ASSERT_OK_AND_ASSIGN(
        StreamReport report,
        stream->Run(*tracker, TensorListSource(Views(*model), kChunkBytes), collector.Sender()));
    EXPECT_GT(report.payloads, 3u);
    uint64_t item_bytes = 0;
    for (const auto& [payload_id, bytes] : collector.payloads()) {
      ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(bytes));
      for (const ItemView& item : decoded.items()) {
        item_bytes += item.locations.size() + item.values.size();
      }
    }
    EXPECT_EQ(report.item_bytes, item_bytes);
    ExpectBucketRule(collector.payloads(), kBucketBytes, *model);
    ASSERT_OK(tracker->Commit(id));
  }
}

// An anchor's FULL items are cut at the bucket size (FullPieceElements), so that no anchor
// payload is larger than a bucket, and the receiver still ends up with every bit.
TEST(ProducerStreamTest, AnAnchorsFullItemsAreCutAtTheBucketSize) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  const std::vector<OwnedTensor> model = {
      RandomTensor("a.small", DType::kFloat32, {100}, 1),
      RandomTensor("b.3mib", DType::kBFloat16, {3 * 1024 + 7, 512}, 2),  // 3 MiB and 7 KiB.
      RandomTensor("c.exactly_one_bucket", DType::kFloat32, {256, 1024}, 3),
      RandomTensor("d.empty", DType::kFloat32, {0}, 4),
  };
  ProducerStreamOptions options = SmallOptions();
  options.chunk_bytes = 8 * kMiB;
  options.bucket_bytes = kMiB;
  options.anchor_compression = AnchorCompression::kNone;
  ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(options));
  ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));
  const TransferId id = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(id));
  ASSERT_TRUE(plan.anchor);
  PayloadCollector collector;
  ASSERT_OK(
      stream->Run(*tracker, TensorListSource(Views(model), options.chunk_bytes), collector.Sender())
          .status());
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> spans;
  for (const auto& [payload_id, bytes] : collector.payloads()) {
    ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(bytes));
    uint64_t payload_bytes = 0;
    for (const ItemView& item : decoded.items()) {
      EXPECT_EQ(item.op, Op::kFull);
      payload_bytes += BucketedBytes(item);
      spans[std::string(item.name)].emplace_back(item.span_begin, item.span_end);
    }
    EXPECT_LE(payload_bytes, kMiB) << "payload " << payload_id;
  }
  // The 3 MiB tensor in four pieces (three of a bucket, the rest), each the next span.
  const uint64_t b_numel = model[1].view().numel();
  const uint64_t piece = kMiB / 2;  // bf16 elements in a bucket.
  EXPECT_EQ(FullPieceElements(kMiB, DType::kBFloat16), piece);
  EXPECT_EQ(spans["b.3mib"],
            (std::vector<std::pair<uint64_t, uint64_t>>{
                {0, piece}, {piece, 2 * piece}, {2 * piece, 3 * piece}, {3 * piece, b_numel}}));
  EXPECT_EQ(spans["c.exactly_one_bucket"].size(), 1u);
  EXPECT_EQ(spans["d.empty"], (std::vector<std::pair<uint64_t, uint64_t>>{{0, 0}}));
  // Tiny buckets cut at kMinFullPieceBytes, not at an element.
  EXPECT_EQ(FullPieceElements(1, DType::kFloat32), kMinFullPieceBytes / 4);
  using Spans = std::vector<std::pair<uint64_t, uint64_t>>;
  EXPECT_EQ(CutSpans(5, 2), (Spans{{0, 2}, {2, 4}, {4, 5}}));
  EXPECT_EQ(CutSpans(4, 4), (Spans{{0, 4}}));
  EXPECT_EQ(CutSpans(0, 3), (Spans{{0, 0}}));

  std::unique_ptr<WeightStore> store = ZeroStore(model);
  internal::UndoLog undo;
  ASSERT_NO_FATAL_FAILURE(ApplyPayloads(collector.payloads(), plan, 0, *store, undo));
  ExpectStoreHolds(*store, model);
  ASSERT_OK(tracker->Commit(id));
}

TEST(PayloadBucketerTest, FollowsTheChunkingRuleOverItemBytes) {
  PayloadBucketer bucketer(100);
  EXPECT_TRUE(bucketer.Add(60));  // The first item opens the first bucket.
  EXPECT_FALSE(bucketer.full());
  EXPECT_FALSE(bucketer.Add(40));  // Fits exactly: the bucket is now full…
  EXPECT_TRUE(bucketer.full());
  EXPECT_TRUE(bucketer.Add(0));  // …so even an empty item starts the next one.
  EXPECT_FALSE(bucketer.Add(70));
  EXPECT_TRUE(bucketer.Add(31));   // Would overflow 70: starts the next bucket.
  EXPECT_TRUE(bucketer.Add(250));  // Larger than a bucket: travels alone.
  EXPECT_TRUE(bucketer.full());
  EXPECT_TRUE(bucketer.Add(1));
  PayloadBucketer every_item(0);
  EXPECT_TRUE(every_item.Add(0));
  EXPECT_TRUE(every_item.full());
  EXPECT_TRUE(every_item.Add(5));
}

// `refit encode` (src/apps/encode.cc) encodes every tensor of NEW with a tracker whose baseline
// is OLD and packs the items with PackPayloads; `refit push` streams the same tensors through a
// Publisher's ProducerStream. For the same checkpoints, transfer and options both must give the
// same payload bytes, so that a .rfp file is what push would have sent.
TEST(PackPayloadsTest, EncodeWritesThePayloadsPushSends) {
  std::vector<OwnedTensor> v0 = MakeModel(5);
  // An empty tensor: its FULL item has no bytes, the corner where the two rules once differed.
  v0.insert(v0.begin() + 2, RandomTensor("model.empty_buffer", DType::kFloat32, {0}, 7));
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.1, 400);
  for (const uint64_t bucket_bytes :
       {uint64_t{1}, kBucketBytes / 3, kBucketBytes, uint64_t{32} << 20}) {
    for (const bool anchor : {true, false}) {
      SCOPED_TRACE(fmt::format("bucket {} bytes, {}", bucket_bytes, anchor ? "anchor" : "delta"));
      const TransferId id = TransferId::Random();
      ProducerStreamOptions options = SmallOptions();
      options.bucket_bytes = bucket_bytes;
      options.payload.zstd_level = 3;
      // `refit encode` compresses anchors; auto would pick raw blocks for an in-memory sender.
      options.anchor_compression = AnchorCompression::kZstd;

      auto push_tracker = TrackerAt(v0);
      ASSERT_OK(push_tracker->Begin(id, anchor).status());
      ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(options));
      PayloadCollector collector;
      ASSERT_OK(
          stream->Run(*push_tracker, TensorListSource(Views(v1), kChunkBytes), collector.Sender())
              .status());

      auto encode_tracker = TrackerAt(v0);
      ASSERT_OK_AND_ASSIGN(const TransferPlan plan, encode_tracker->Begin(id, anchor));
      std::vector<Item> items;
      for (const OwnedTensor& tensor : v1) {
        ASSERT_OK_AND_ASSIGN(internal::EncodeResult encoded,
                             encode_tracker->Encode(id, tensor.view()));
        for (Item& item : encoded.items) items.push_back(std::move(item));
      }
      const PayloadIds ids{id, 0, 0, plan.base_version, plan.target_version};
      ASSERT_OK_AND_ASSIGN(const std::vector<std::vector<std::byte>> encoded,
                           PackPayloads(ids, items, bucket_bytes, options.payload));

      ASSERT_EQ(encoded.size(), collector.payloads().size());
      // Small buckets make many payloads, so that the boundaries are what is compared.
      if (bucket_bytes < kBucketBytes) {
        EXPECT_GT(encoded.size(), 3u);
      }
      for (const auto& [payload_id, bytes] : collector.payloads()) {
        EXPECT_EQ(bytes, encoded.at(payload_id)) << "payload " << payload_id;
      }
      ASSERT_OK(push_tracker->Abort(id));
      ASSERT_OK(encode_tracker->Abort(id));
    }
  }
}

TEST(ProducerStreamTest, PayloadsAreIdenticalWhateverTheThreadCountsAndTiming) {
  const std::vector<OwnedTensor> v0 = MakeModel(4);
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.1, 300);
  auto tracker = TrackerAt(v0);
  const TransferId id = TransferId::Random();

  ProducerStreamOptions serial = SmallOptions();
  serial.bucket_bytes = kBucketBytes / 2;  // More payloads: more room for a timing dependence.
  serial.encode_threads = 1;
  serial.serialize_threads = 1;
  serial.send_threads = 1;
  serial.max_payloads_in_flight = 1;
  ProducerStreamOptions parallel = serial;
  parallel.encode_threads = 4;
  parallel.serialize_threads = 3;
  parallel.send_threads = 3;
  parallel.max_payloads_in_flight = 5;
  parallel.max_chunks_in_flight = 7;

  std::vector<PayloadMap> runs;
  for (const ProducerStreamOptions& options : {serial, parallel, parallel}) {
    ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(options));
    ASSERT_OK(tracker->Begin(id).status());
    PayloadCollector collector;
    PayloadSender collect = collector.Sender();
    // Jitter the senders of the parallel runs so that completion order varies between runs.
    std::mutex rng_mutex;
    std::mt19937_64 rng(runs.size());
    PayloadSender jittery = [&](uint32_t payload_id, std::span<const std::byte> payload) {
      std::chrono::microseconds delay;
      {
        std::lock_guard lock(rng_mutex);
        delay = std::chrono::microseconds(rng() % 500);
      }
      std::this_thread::sleep_for(delay);
      return collect(payload_id, payload);
    };
    ASSERT_OK(stream->Run(*tracker, TensorListSource(Views(v1), kChunkBytes), jittery));
    runs.push_back(collector.payloads());
    // Abort and replay the same transfer: the tracker re-emits the same changes.
    ASSERT_OK(tracker->Abort(id));
  }
  ASSERT_GT(runs[0].size(), 3u);
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_EQ(runs[0], runs[2]);
}

// ---------------------------------------------------------------------------------------------
// Failures

/// A source over a model's chunks that counts its calls, can fail once at a given call, and
/// records whether it was drained to its end.
class CountingSource {
 public:
  CountingSource(std::vector<TensorView> tensors, uint64_t chunk_bytes,
                 std::optional<int> fail_at_call = std::nullopt)
      : inner_(TensorListSource(std::move(tensors), chunk_bytes)), fail_at_call_(fail_at_call) {}

  ChunkSource Source() {
    return [this](const ChunkPull& pull) -> Result<std::optional<ExportChunk>> {
      const int call = calls_++;
      if (fail_at_call_ && call == *fail_at_call_) {
        return Unavailable("injected source failure at call {}", call);
      }
      Result<std::optional<ExportChunk>> next = inner_(pull);
      if (next.ok() && !next->has_value()) ended_ = true;
      return next;
    };
  }
  int calls() const { return calls_; }
  bool ended() const { return ended_; }

 private:
  ChunkSource inner_;
  std::optional<int> fail_at_call_;
  int calls_ = 0;
  bool ended_ = false;
};

enum class FailureSite { kSource, kEncode, kSend };

std::string FailureSiteName(FailureSite site) {
  switch (site) {
    case FailureSite::kSource:
      return "Source";
    case FailureSite::kEncode:
      return "Encode";
    case FailureSite::kSend:
      return "Send";
  }
  return "Unknown";
}

void PrintTo(FailureSite site, std::ostream* os) { *os << FailureSiteName(site); }

class StreamFailureTest : public ::testing::TestWithParam<FailureSite> {};

TEST_P(StreamFailureTest, FirstErrorIsReturnedAfterDrainingAndCleanupThenARetrySucceeds) {
  const FailureSite site = GetParam();
  const std::vector<OwnedTensor> v0 = MakeModel(5);
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.05, 400);
  auto tracker = TrackerAt(v0);
  ProducerStreamOptions options = SmallOptions();
  options.send_threads = 3;
  ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(options));

  std::vector<TensorView> tensors = Views(v1);
  // A tensor without baseline in a delta transfer fails its encode; chunks follow it.
  const OwnedTensor ghost = RandomTensor("model.ghost.weight", DType::kBFloat16, {8}, 9);
  if (site == FailureSite::kEncode) tensors.insert(tensors.begin() + 4, ghost.view());
  std::vector<uint64_t> sizes;
  for (const TensorView& t : tensors) sizes.push_back(t.bytes.size());
  const size_t chunks = PlanChunks(sizes, kChunkBytes).size();
  CountingSource source(tensors, kChunkBytes,
                        site == FailureSite::kSource ? std::optional<int>(2) : std::nullopt);

  std::mutex mutex;
  std::set<std::thread::id> sender_threads;
  PayloadSender send = [&](uint32_t payload_id, std::span<const std::byte>) -> Status {
    {
      std::lock_guard lock(mutex);
      sender_threads.insert(std::this_thread::get_id());
    }
    if (site == FailureSite::kSend && payload_id == 1) {
      return Unavailable("injected send failure");
    }
    return Status::OK();
  };
  CleanupRecorder cleanup;

  const TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id).status());
  const Status status = stream->Run(*tracker, source.Source(), send, cleanup.Cleanup()).status();
  switch (site) {
    case FailureSite::kSource:
      EXPECT_STATUS_MSG(Unavailable, "injected source failure", status);
      break;
    case FailureSite::kEncode:
      EXPECT_STATUS_MSG(FailedPrecondition, "model.ghost.weight", status);
      break;
    case FailureSite::kSend:
      EXPECT_STATUS_MSG(Unavailable, "injected send failure", status);
      EXPECT_NE(status.message().find("payload 1"), std::string::npos) << status.ToString();
      break;
  }
  EXPECT_NE(status.message().find("producer 0"), std::string::npos) << status.ToString();

  // The source was walked to its end, so a trainer's collectives would not hang.
  EXPECT_TRUE(source.ended());
  const int failed_calls = site == FailureSite::kSource ? 1 : 0;
  EXPECT_EQ(source.calls(), static_cast<int>(chunks) + failed_calls + 1);
  // Cleanup ran exactly once on each of the sender threads, none of them the caller's.
  const std::vector<std::thread::id> cleaned = cleanup.threads();
  EXPECT_EQ(cleaned.size(), 3u);
  const std::set<std::thread::id> distinct(cleaned.begin(), cleaned.end());
  EXPECT_EQ(distinct.size(), 3u);
  EXPECT_FALSE(distinct.contains(std::this_thread::get_id()));
  for (const std::thread::id& thread : sender_threads) EXPECT_TRUE(distinct.contains(thread));

  // Abort, then a new transfer of the same step succeeds and reproduces the trainer.
  ASSERT_OK(tracker->Abort(id));
  const TransferId retry = TransferId::Random();
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(retry));
  PayloadCollector collector;
  ASSERT_OK(stream->Run(*tracker, TensorListSource(Views(v1), kChunkBytes), collector.Sender()));
  auto store = StoreOf(v0);
  internal::UndoLog undo;
  ASSERT_NO_FATAL_FAILURE(ApplyPayloads(collector.payloads(), plan, 0, *store, undo));
  ExpectStoreHolds(*store, v1);
  ASSERT_OK(tracker->Commit(retry));
}

INSTANTIATE_TEST_SUITE_P(Sites, StreamFailureTest,
                         ::testing::Values(FailureSite::kSource, FailureSite::kEncode,
                                           FailureSite::kSend),
                         [](const auto& param_info) { return FailureSiteName(param_info.param); });

/// A source that yields the given chunks of `model` (index lists), then ends.
class ListedChunkSource {
 public:
  ListedChunkSource(const std::vector<OwnedTensor>& model, std::vector<std::vector<size_t>> chunks)
      : views_(Views(model)), chunks_(std::move(chunks)) {}
  ChunkSource Source() {
    return [this](const ChunkPull&) -> Result<std::optional<ExportChunk>> {
      if (next_ == chunks_.size()) {
        ended_ = true;
        return std::optional<ExportChunk>();
      }
      ExportChunk chunk;
      for (size_t t : chunks_[next_++]) chunk.tensors.push_back(views_[t]);
      return std::optional<ExportChunk>(std::move(chunk));
    };
  }
  bool ended() const { return ended_; }

 private:
  std::vector<TensorView> views_;
  std::vector<std::vector<size_t>> chunks_;
  size_t next_ = 0;
  bool ended_ = false;
};

TEST(ProducerStreamTest, RejectsChunksThatBreakTheChunkingRuleAndStillDrains) {
  const std::vector<OwnedTensor> v0 = MakeModel(6);
  const std::vector<ChunkRange> plan = PlanChunks(Sizes(v0), kChunkBytes);
  ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(SmallOptions()));

  std::vector<std::vector<size_t>> one_per_tensor;
  for (size_t t = 0; t < v0.size(); ++t) one_per_tensor.push_back({t});
  std::vector<std::vector<size_t>> all_in_one(1);
  for (size_t t = 0; t < v0.size(); ++t) all_in_one[0].push_back(t);
  std::vector<std::vector<size_t>> planned_with_empty;
  for (const ChunkRange& range : plan) {
    planned_with_empty.emplace_back();
    for (size_t t = range.begin; t < range.end; ++t) planned_with_empty.back().push_back(t);
  }
  std::vector<std::vector<size_t>> planned_with_repeat = planned_with_empty;
  planned_with_repeat.push_back({0});  // model.embed_tokens.weight again, in a chunk of its own.
  planned_with_empty.insert(planned_with_empty.begin() + 2, std::vector<size_t>{});

  struct Case {
    std::string name;
    std::vector<std::vector<size_t>> chunks;
    std::string message;
  };
  for (const Case& c :
       {Case{"too small", one_per_tensor, "appends it to chunk 1"},
        Case{"too large", all_in_one, "starts a new chunk with it"},
        Case{"empty", planned_with_empty, "chunk 2 holds no tensor"},
        Case{"repeat", planned_with_repeat, "appears in source chunk 0 and again"}}) {
    SCOPED_TRACE(c.name);
    auto tracker = TrackerAt(v0);
    ASSERT_OK(tracker->Begin(TransferId::Random()).status());
    ListedChunkSource source(v0, c.chunks);
    EXPECT_STATUS_MSG(
        InvalidArgument, c.message,
        stream->Run(*tracker, source.Source(), [](uint32_t, auto) { return Status::OK(); }));
    EXPECT_TRUE(source.ended());
  }
}

TEST(ProducerStreamTest, WithoutAnOpenTransferFailsButDrainsTheSource) {
  const std::vector<OwnedTensor> v0 = MakeModel(7);
  auto tracker = TrackerAt(v0);
  ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(SmallOptions()));
  CountingSource source(Views(v0), kChunkBytes);
  CleanupRecorder cleanup;
  std::atomic<int> sends = 0;
  EXPECT_STATUS_MSG(FailedPrecondition, "no open transfer",
                    stream->Run(
                        *tracker, source.Source(),
                        [&](uint32_t, std::span<const std::byte>) {
                          ++sends;
                          return Status::OK();
                        },
                        cleanup.Cleanup()));
  EXPECT_TRUE(source.ended());
  EXPECT_EQ(sends.load(), 0);
  EXPECT_TRUE(cleanup.threads().empty());  // No sender thread was started.
}

TEST(ProducerStreamTest, MakeRejectsInconsistentOptions) {
  auto with = [](auto change) {
    ProducerStreamOptions options = SmallOptions();
    change(options);
    return ProducerStream::Make(options).status();
  };
  EXPECT_STATUS(InvalidArgument, with([](auto& o) { o.num_producers = 0; }));
  EXPECT_STATUS_MSG(InvalidArgument, "producer_id 3", with([](auto& o) {
                      o.producer_id = 3;
                      o.num_producers = 3;
                    }));
  EXPECT_STATUS_MSG(InvalidArgument, "chunk_bytes", with([](auto& o) { o.chunk_bytes = 0; }));
  EXPECT_STATUS_MSG(InvalidArgument, "bucket_bytes", with([](auto& o) { o.bucket_bytes = 0; }));
  EXPECT_STATUS_MSG(InvalidArgument, "encode_threads 0",
                    with([](auto& o) { o.encode_threads = 0; }));
  EXPECT_STATUS_MSG(InvalidArgument, "serialize_threads -1",
                    with([](auto& o) { o.serialize_threads = -1; }));
  EXPECT_STATUS_MSG(InvalidArgument, "send_threads 5000",
                    with([](auto& o) { o.send_threads = 5000; }));
  EXPECT_STATUS_MSG(InvalidArgument, "max_payloads_in_flight",
                    with([](auto& o) { o.max_payloads_in_flight = 0; }));

  ProducerStreamOptions options = SmallOptions();
  options.max_chunks_in_flight = 0;
  ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(options));
  EXPECT_EQ(stream->options().max_chunks_in_flight,
            2u * static_cast<size_t>(options.encode_threads));
}

// ---------------------------------------------------------------------------------------------
// Back-pressure

/// Atomically raise `peak` to `value` if it is lower.
void RaiseToAtLeast(std::atomic<int>& peak, int value) {
  int seen = peak.load();
  while (value > seen && !peak.compare_exchange_weak(seen, value)) {
  }
}

TEST(ProducerStreamTest, InFlightChunksAndPayloadsNeverExceedTheirBounds) {
  const std::vector<OwnedTensor> v0 = MakeModel(8);
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.08, 500);
  for (const size_t bound : {size_t{1}, size_t{2}}) {
    SCOPED_TRACE(fmt::format("bound {}", bound));
    auto tracker = TrackerAt(v0);
    ProducerStreamOptions options = SmallOptions();
    options.max_payloads_in_flight = bound;
    options.max_chunks_in_flight = bound;
    options.encode_threads = 3;
    options.send_threads = 4;
    ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(options));

    // Every chunk carries a token; the stream holds it until the chunk is encoded.
    struct AliveToken {
      explicit AliveToken(std::atomic<int>& alive) : alive_(alive) {}
      ~AliveToken() { --alive_; }
      std::atomic<int>& alive_;
    };
    std::atomic<int> chunks_alive = 0;
    std::atomic<int> max_chunks_alive = 0;
    ChunkSource inner = TensorListSource(Views(v1), kChunkBytes);
    ChunkSource source = [&](const ChunkPull& pull) -> Result<std::optional<ExportChunk>> {
      Result<std::optional<ExportChunk>> next = inner(pull);
      if (next.ok() && next->has_value()) {
        RaiseToAtLeast(max_chunks_alive, ++chunks_alive);
        (*next)->keepalive = std::make_shared<AliveToken>(chunks_alive);
      }
      return next;
    };
    // A slow sender: with more sender threads than the bound, only the bound limits how many
    // payloads are being sent at once.
    std::atomic<int> sending = 0;
    std::atomic<int> max_sending = 0;
    PayloadSender send = [&](uint32_t, std::span<const std::byte>) {
      RaiseToAtLeast(max_sending, ++sending);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      --sending;
      return Status::OK();
    };

    ASSERT_OK(tracker->Begin(TransferId::Random()).status());
    ASSERT_OK_AND_ASSIGN(StreamReport report, stream->Run(*tracker, source, send));
    EXPECT_GT(report.payloads, 3u);
    EXPECT_LE(max_sending.load(), static_cast<int>(bound));
    EXPECT_LE(max_chunks_alive.load(), static_cast<int>(bound));
    EXPECT_EQ(chunks_alive.load(), 0);
    EXPECT_GE(report.peak_payloads_in_flight, 1u);
    EXPECT_LE(report.peak_payloads_in_flight, bound);
    EXPECT_LE(report.peak_chunks_in_flight, bound);
  }
}

}  // namespace
}  // namespace refit
