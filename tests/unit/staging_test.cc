// Staging a trainer's device tensors to the host: the bounded pool of reusable buffers, and the
// whole-model and pieces sources that read only the chunks a producer sends, through it.
#include "pipeline/staging_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "codec/tracker.h"
#include "pipeline/piece_source.h"
#include "pipeline/producer_stream.h"
#include "pipeline/staged_source.h"
#include "refit/chunk_source.h"
#include "refit/status_format.h"
#include "refit/tensor_memory.h"
#include "test_data.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::Perturb;
using testing::RandomTensor;

// ---------------------------------------------------------------------------------------------
// The pool

TEST(StagingPoolTest, ReusesAReleasedBufferThatFits) {
  StagingPool pool(1 << 20);
  std::byte* first = nullptr;
  {
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<StagingPool::Buffer> buffer, pool.Acquire(1000));
    EXPECT_EQ(buffer->bytes().size(), 1000u);
    first = buffer->bytes().data();
  }
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<StagingPool::Buffer> again, pool.Acquire(900));
  EXPECT_EQ(again->bytes().data(), first);
  EXPECT_EQ(again->bytes().size(), 900u);
  const StagingPoolStats stats = pool.stats();
  EXPECT_EQ(stats.allocations, 1u);
  EXPECT_EQ(stats.reuses, 1u);
  EXPECT_LE(stats.peak_held_bytes, pool.budget_bytes());
}

TEST(StagingPoolTest, RefusesSizesOutsideTheBudget) {
  StagingPool pool(4096);
  EXPECT_STATUS_MSG(InvalidArgument, "4097 bytes", pool.Acquire(4097).status());
  EXPECT_STATUS(InvalidArgument, pool.Acquire(0).status());
}

TEST(StagingPoolTest, FreesKeptBuffersThatDoNotFitToMakeRoom) {
  // 1 MiB budget: a kept 256 KiB buffer does not fit a 900 KiB request, and both do not fit the
  // budget together, so the kept one is freed.
  StagingPool pool(1 << 20);
  { ASSERT_OK(pool.Acquire(256 << 10).status()); }
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<StagingPool::Buffer> large, pool.Acquire(900 << 10));
  EXPECT_EQ(pool.stats().allocations, 2u);
  EXPECT_LE(pool.stats().held_bytes, pool.budget_bytes());
  EXPECT_LE(pool.stats().peak_held_bytes, pool.budget_bytes());
}

TEST(StagingPoolTest, WaitsForABufferToComeBack) {
  StagingPool pool(1 << 20);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<StagingPool::Buffer> held, pool.Acquire(800 << 10));
  std::atomic<bool> acquired = false;
  std::thread waiter([&] {
    Result<std::shared_ptr<StagingPool::Buffer>> second = pool.Acquire(700 << 10);
    EXPECT_TRUE(second.ok()) << second.status().ToString();
    acquired = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(acquired.load());  // The budget is lent out.
  held.reset();
  waiter.join();
  EXPECT_TRUE(acquired.load());
  EXPECT_LE(pool.stats().peak_held_bytes, pool.budget_bytes());
}

TEST(StagingPoolTest, AStopEndsTheWaitWithCancelled) {
  StagingPool pool(1 << 20);
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<StagingPool::Buffer> held, pool.Acquire(1 << 20));
  std::stop_source stop;
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    stop.request_stop();
  });
  EXPECT_STATUS(Cancelled, pool.Acquire(1, stop.get_token()).status());
  stopper.join();
}

// ---------------------------------------------------------------------------------------------
// The whole-model source through a stream

constexpr uint64_t kChunkBytes = 4096;

std::vector<OwnedTensor> MakeModel(uint64_t seed) {
  std::vector<OwnedTensor> model;
  model.push_back(RandomTensor("embed", DType::kBFloat16, {64, 32}, seed));
  for (int layer = 0; layer < 6; ++layer) {
    const uint64_t s = seed + 10 * static_cast<uint64_t>(layer + 1);
    model.push_back(
        RandomTensor(fmt::format("layers.{}.w", layer), DType::kBFloat16, {32, 40}, s + 1));
    model.push_back(
        RandomTensor(fmt::format("layers.{}.norm", layer), DType::kFloat32, {32}, s + 2));
  }
  model.push_back(RandomTensor("head", DType::kBFloat16, {48, 32}, seed + 99));
  return model;
}

std::vector<OwnedTensor> PerturbModel(const std::vector<OwnedTensor>& model, double density,
                                      uint64_t seed) {
  std::vector<OwnedTensor> next;
  for (size_t i = 0; i < model.size(); ++i) next.push_back(Perturb(model[i], density, seed + i));
  return next;
}

/// The model in "device memory": every tensor behind the test backend, whose bytes the core
/// cannot address.
struct DeviceModel {
  std::vector<std::shared_ptr<OpaqueTensorMemory>> memories;
  std::vector<ExportTensor> tensors;

  explicit DeviceModel(const std::vector<OwnedTensor>& model) {
    for (const OwnedTensor& t : model) {
      memories.push_back(OpaqueTensorMemory::Make(t.bytes));
      tensors.push_back(ExportTensor{t.name, t.dtype, t.shape, {}, memories.back().get()});
    }
  }
  uint64_t read_bytes() const {
    uint64_t bytes = 0;
    for (const auto& memory : memories) bytes += memory->traffic().from_device_bytes;
    return bytes;
  }
};

std::vector<TensorView> Views(const std::vector<OwnedTensor>& model) {
  std::vector<TensorView> views;
  for (const OwnedTensor& t : model) views.push_back(t.view());
  return views;
}

ProducerStreamOptions Options(uint32_t producer_id, uint32_t producers) {
  ProducerStreamOptions options;
  options.producer_id = producer_id;
  options.num_producers = producers;
  options.chunk_bytes = kChunkBytes;
  options.bucket_bytes = 1024;
  options.encode_threads = 3;
  options.serialize_threads = 2;
  options.send_threads = 2;
  options.max_chunks_in_flight = 4;
  return options;
}

using PayloadMap = std::map<uint32_t, std::vector<std::byte>>;

/// The transfer every RunDelta runs, so that the payloads of two runs compare byte for byte.
const TransferId& TestTransfer() {
  static const TransferId id = TransferId::Random();
  return id;
}

/// Run one delta transfer over a tracker at `v0` with `source` and collect its payloads.
Result<PayloadMap> RunDelta(const std::vector<OwnedTensor>& v0, const ChunkSource& source,
                            uint32_t producer_id, uint32_t producers) {
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<internal::DeltaTracker> tracker,
                         internal::DeltaTracker::Make({}));
  REFIT_RETURN_NOT_OK(AdoptOwnedBaseline(*tracker, Views(v0), kChunkBytes, producer_id, producers));
  REFIT_RETURN_NOT_OK(tracker->Rebase(3));
  REFIT_ASSIGN_OR_RETURN(auto stream, ProducerStream::Make(Options(producer_id, producers)));
  REFIT_RETURN_NOT_OK(tracker->Begin(TestTransfer()).status());
  std::mutex mutex;
  PayloadMap payloads;
  const PayloadSender send = [&](uint32_t payload_id, std::span<const std::byte> payload) {
    std::lock_guard lock(mutex);
    payloads.emplace(payload_id, std::vector<std::byte>(payload.begin(), payload.end()));
    return Status::OK();
  };
  REFIT_RETURN_NOT_OK(stream->Run(*tracker, source, send).status());
  return payloads;
}

class StagedSourceTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(StagedSourceTest, SendsWhatTheHostPathSendsReadingOnlyOwnedChunksWithinTheBudget) {
  const uint32_t producers = GetParam();
  const std::vector<OwnedTensor> v0 = MakeModel(1);
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.05, 100);
  std::vector<uint64_t> sizes;
  for (const OwnedTensor& t : v1) sizes.push_back(t.bytes.size());
  const std::vector<ChunkRange> chunks = PlanChunks(sizes, kChunkBytes);
  ASSERT_GT(chunks.size(), 4u);
  uint64_t model_bytes = 0;
  for (uint64_t size : sizes) model_bytes += size;

  for (uint32_t p = 0; p < producers; ++p) {
    SCOPED_TRACE(fmt::format("producer {} of {}", p, producers));
    ASSERT_OK_AND_ASSIGN(PayloadMap host,
                         RunDelta(v0, TensorListSource(Views(v1), kChunkBytes), p, producers));
    DeviceModel device(v1);
    // A budget of two chunks: far below the model.
    const uint64_t budget = 2 * LargestStagedChunkBytes(device.tensors, kChunkBytes);
    ASSERT_LT(budget, model_bytes / 2);
    auto pool = std::make_shared<StagingPool>(budget);
    ASSERT_OK_AND_ASSIGN(
        PayloadMap staged,
        RunDelta(v0, StagedTensorSource(device.tensors, kChunkBytes, pool), p, producers));
    EXPECT_EQ(staged, host);  // Payload for payload, byte for byte.
    uint64_t owned_bytes = 0;
    for (size_t k = 0; k < chunks.size(); ++k) {
      if (OwnsChunk(k, p, producers)) owned_bytes += chunks[k].bytes;
    }
    EXPECT_EQ(device.read_bytes(), owned_bytes);  // Chunks of other producers are never read.
    EXPECT_LE(pool->stats().peak_held_bytes, budget);
    EXPECT_EQ(pool->stats().held_bytes, pool->stats().peak_held_bytes);  // Kept for reuse.
  }
}

INSTANTIATE_TEST_SUITE_P(Producers, StagedSourceTest, ::testing::Values(1u, 3u));

TEST(StagedSourceTest, MixesHostAndDeviceTensors) {
  const std::vector<OwnedTensor> v0 = MakeModel(2);
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.1, 200);
  DeviceModel device(v1);
  std::vector<ExportTensor> mixed;
  for (size_t t = 0; t < v1.size(); ++t) {
    mixed.push_back(t % 2 == 0 ? ExportTensor::Host(v1[t].view()) : device.tensors[t]);
  }
  auto pool = std::make_shared<StagingPool>(2 * LargestStagedChunkBytes(mixed, kChunkBytes));
  ASSERT_OK_AND_ASSIGN(PayloadMap host,
                       RunDelta(v0, TensorListSource(Views(v1), kChunkBytes), 0, 1));
  ASSERT_OK_AND_ASSIGN(PayloadMap staged,
                       RunDelta(v0, StagedTensorSource(mixed, kChunkBytes, pool), 0, 1));
  EXPECT_EQ(staged, host);
  uint64_t device_bytes = 0;
  for (size_t t = 1; t < v1.size(); t += 2) device_bytes += v1[t].bytes.size();
  EXPECT_EQ(device.read_bytes(), device_bytes);  // Host tensors are read in place.
}

TEST(StagedSourceTest, EmptyDeviceTensorsStageNothingAloneOrBesideOthers) {
  // A chunk of one empty device tensor (it stages no bytes at all) and one where an empty tensor
  // sits beside a full one.
  std::vector<OwnedTensor> v0 = MakeModel(8);
  v0.insert(v0.begin(), RandomTensor("empty_first", DType::kBFloat16, {0, 32}, 1));
  v0.insert(v0.begin() + 3, RandomTensor("empty_inside", DType::kFloat32, {0}, 2));
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.05, 800);
  DeviceModel device(v1);
  auto pool = std::make_shared<StagingPool>(2 * LargestStagedChunkBytes(device.tensors, 4096));
  const ChunkSource alone = StagedTensorSource({device.tensors[0]}, kChunkBytes, pool);
  ASSERT_OK_AND_ASSIGN(std::optional<ExportChunk> chunk, alone(ChunkPull{}));
  ASSERT_TRUE(chunk.has_value());
  EXPECT_FALSE(chunk.value().unread);
  EXPECT_TRUE(chunk.value().tensors.at(0).bytes.empty());
  ASSERT_OK_AND_ASSIGN(PayloadMap host,
                       RunDelta(v0, TensorListSource(Views(v1), kChunkBytes), 0, 1));
  ASSERT_OK_AND_ASSIGN(PayloadMap staged,
                       RunDelta(v0, StagedTensorSource(device.tensors, kChunkBytes, pool), 0, 1));
  EXPECT_EQ(staged, host);
}

TEST(StagedSourceTest, AChunkLargerThanTheBudgetFailsNamingItsFirstTensor) {
  const std::vector<OwnedTensor> v0 = MakeModel(3);
  DeviceModel device(v0);
  auto pool = std::make_shared<StagingPool>(1024);
  const Result<PayloadMap> run =
      RunDelta(v0, StagedTensorSource(device.tensors, kChunkBytes, pool), 0, 1);
  EXPECT_STATUS_MSG(InvalidArgument, "tensor 'embed'", run.status());
  EXPECT_STATUS_MSG(InvalidArgument, "staging budget of 1024 bytes", run.status());
}

TEST(StagedSourceTest, ADeviceReadErrorFailsTheStreamNamingTheTensor) {
  const std::vector<OwnedTensor> v0 = MakeModel(4);
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.05, 400);
  DeviceModel device(v1);
  device.memories[5]->FailAfter(0);
  auto pool = std::make_shared<StagingPool>(2 * LargestStagedChunkBytes(device.tensors, 4096));
  const Result<PayloadMap> run =
      RunDelta(v0, StagedTensorSource(device.tensors, kChunkBytes, pool), 0, 1);
  EXPECT_STATUS_MSG(IoError, fmt::format("tensor '{}'", v1[5].name), run.status());
  // Every buffer came back: the pool can lend its whole budget again.
  EXPECT_OK(pool->Acquire(pool->budget_bytes()).status());
}

TEST(StagedSourceTest, AStreamThatStopsWhileTheSourceWaitsForTheBudgetEnds) {
  // The sender fails at once while the encode workers hold the budget: the pull waiting for a
  // buffer must give up rather than wait for chunks nobody will encode.
  const std::vector<OwnedTensor> v0 = MakeModel(5);
  const std::vector<OwnedTensor> v1 = PerturbModel(v0, 0.5, 500);
  DeviceModel device(v1);
  auto pool = std::make_shared<StagingPool>(LargestStagedChunkBytes(device.tensors, kChunkBytes));
  ASSERT_OK_AND_ASSIGN(auto tracker, internal::DeltaTracker::Make({}));
  ASSERT_OK(AdoptOwnedBaseline(*tracker, Views(v0), kChunkBytes, 0, 1));
  ASSERT_OK_AND_ASSIGN(auto stream, ProducerStream::Make(Options(0, 1)));
  const TransferId id = TransferId::Random();
  ASSERT_OK(tracker->Begin(id).status());
  const PayloadSender fail = [](uint32_t payload_id, std::span<const std::byte>) {
    return Unavailable("receiver gone at payload {}", payload_id);
  };
  EXPECT_STATUS(
      Unavailable,
      stream->Run(*tracker, StagedTensorSource(device.tensors, kChunkBytes, pool), fail).status());
  EXPECT_OK(tracker->Abort(id));
}

TEST(StagedSourceTest, AnUnreadChunkTheStreamReadsIsRefused) {
  const std::vector<OwnedTensor> v0 = MakeModel(6);
  ChunkSource inner = TensorListSource(Views(v0), kChunkBytes);
  const ChunkSource lazy = [&](const ChunkPull& pull) -> Result<std::optional<ExportChunk>> {
    Result<std::optional<ExportChunk>> next = inner(pull);
    if (next.ok() && next->has_value()) {
      (*next)->unread = true;
      for (TensorView& t : (*next)->tensors) t.bytes = {};
    }
    return next;
  };
  const Result<PayloadMap> run = RunDelta(v0, lazy, 0, 1);
  EXPECT_STATUS_MSG(InvalidArgument, "came unread", run.status());
}

TEST(StagedSourceTest, AdoptsADeviceBaselineOneTensorAtATime) {
  const std::vector<OwnedTensor> v0 = MakeModel(7);
  DeviceModel device(v0);
  ASSERT_OK_AND_ASSIGN(auto from_device, internal::DeltaTracker::Make({}));
  ASSERT_OK_AND_ASSIGN(auto from_host, internal::DeltaTracker::Make({}));
  StagingPool pool(4096);
  ASSERT_OK(AdoptOwnedBaseline(*from_device, std::span<const ExportTensor>(device.tensors),
                               kChunkBytes, 1, 2, &pool));
  ASSERT_OK(AdoptOwnedBaseline(*from_host, Views(v0), kChunkBytes, 1, 2));
  EXPECT_EQ(from_device->baseline_bytes(), from_host->baseline_bytes());
  EXPECT_GT(from_device->baseline_bytes(), 0u);
  EXPECT_EQ(device.read_bytes(), from_host->baseline_bytes());
  EXPECT_LE(pool.stats().peak_held_bytes, pool.budget_bytes());
  // A tensor larger than the budget is refused by name.
  ASSERT_OK_AND_ASSIGN(auto small, internal::DeltaTracker::Make({}));
  StagingPool tiny(16);
  EXPECT_STATUS_MSG(InvalidArgument, "tensor 'embed'",
                    AdoptOwnedBaseline(*small, std::span<const ExportTensor>(device.tensors),
                                       kChunkBytes, 0, 1, &tiny));
}

// ---------------------------------------------------------------------------------------------
// Pieces in device memory

TEST(StagedPiecesTest, AnEmptyDevicePieceStagesNothing) {
  // More ranks than rows: this rank's box of `a` is empty, its local tensor too.
  auto memory = OpaqueTensorMemory::Make({});
  ProducerLayout layout;
  layout.pieces.push_back(
      LayoutPiece{"a", DType::kBFloat16, {3, 4}, {3, 0}, {0, 4}, "a_local", {0, 4}, {0, 0}});
  const std::vector<PieceRole> roles = {PieceRole::kSend};
  const std::vector<ExportTensor> locals = {
      ExportTensor{"a_local", DType::kBFloat16, {0, 4}, {}, memory.get()}};
  ASSERT_OK_AND_ASSIGN(auto by_name, LocalsOf(layout, locals));
  EXPECT_EQ(StagingBytesNeeded(layout, roles, by_name, 1 << 20), 0u);
  ChunkSource source = SentPiecesSource(layout, roles, by_name, 1 << 20, nullptr);
  ASSERT_OK_AND_ASSIGN(std::optional<ExportChunk> chunk, source(ChunkPull{}));
  ASSERT_TRUE(chunk.has_value());
  EXPECT_TRUE(chunk.value().tensors.at(0).bytes.empty());
  EXPECT_EQ(memory->traffic().calls, 0u);
}

TEST(StagedPiecesTest, DevicePiecesYieldTheHostPiecesBytesAndDigests) {
  // One rank holding rows 2..6 of a [8, 10] tensor (contiguous in its local) and columns 3..7 of
  // another (not contiguous: one read per row).
  const OwnedTensor rows = RandomTensor("rows_local", DType::kBFloat16, {4, 10}, 1);
  const OwnedTensor cols = RandomTensor("cols_local", DType::kFloat32, {6, 8}, 2);
  ProducerLayout layout;
  layout.pieces.push_back(
      LayoutPiece{"a", DType::kBFloat16, {8, 10}, {2, 0}, {4, 10}, "rows_local", {4, 10}, {0, 0}});
  layout.pieces.push_back(
      LayoutPiece{"b", DType::kFloat32, {6, 12}, {0, 3}, {6, 4}, "cols_local", {6, 8}, {0, 2}});
  const std::vector<PieceRole> roles = {PieceRole::kSend, PieceRole::kSend};
  auto rows_memory = OpaqueTensorMemory::Make(rows.bytes);
  auto cols_memory = OpaqueTensorMemory::Make(cols.bytes);
  const std::vector<ExportTensor> host_locals = {ExportTensor::Host(rows.view()),
                                                 ExportTensor::Host(cols.view())};
  const std::vector<ExportTensor> device_locals = {
      ExportTensor{"rows_local", DType::kBFloat16, {4, 10}, {}, rows_memory.get()},
      ExportTensor{"cols_local", DType::kFloat32, {6, 8}, {}, cols_memory.get()}};
  ASSERT_OK_AND_ASSIGN(auto host_by_name, LocalsOf(layout, host_locals));
  ASSERT_OK_AND_ASSIGN(auto device_by_name, LocalsOf(layout, device_locals));
  const uint64_t needed = StagingBytesNeeded(layout, roles, device_by_name, 1 << 20);
  EXPECT_EQ(needed, 4 * 10 * 2 + 6 * 4 * 4u);
  auto pool = std::make_shared<StagingPool>(needed);
  ChunkSource host = SentPiecesSource(layout, roles, host_by_name, 1 << 20);
  ChunkSource device = SentPiecesSource(layout, roles, device_by_name, 1 << 20, pool);
  ASSERT_OK_AND_ASSIGN(std::optional<ExportChunk> host_chunk, host(ChunkPull{}));
  ASSERT_OK_AND_ASSIGN(std::optional<ExportChunk> device_chunk, device(ChunkPull{}));
  ASSERT_TRUE(host_chunk.has_value() && device_chunk.has_value());
  ASSERT_EQ(host_chunk->tensors.size(), 2u);
  ASSERT_EQ(device_chunk->tensors.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const TensorView& h = host_chunk->tensors[i];
    const TensorView& d = device_chunk->tensors[i];
    EXPECT_EQ(h.name, d.name);
    EXPECT_TRUE(std::equal(h.bytes.begin(), h.bytes.end(), d.bytes.begin(), d.bytes.end()))
        << h.name;
  }
  EXPECT_EQ(rows_memory->traffic().calls, 1u);  // One range.
  EXPECT_EQ(cols_memory->traffic().calls, 6u);  // One run per row.
  // An unread pull reads nothing.
  ChunkSource unread = SentPiecesSource(layout, roles, device_by_name, 1 << 20, pool);
  ASSERT_OK_AND_ASSIGN(std::optional<ExportChunk> skipped, unread(ChunkPull{0, false, {}}));
  ASSERT_TRUE(skipped.has_value());
  EXPECT_TRUE(skipped.value().unread);
  EXPECT_EQ(rows_memory->traffic().calls, 1u);
  // Copies: the canonical digest read through the pool equals the host one.
  device_chunk.reset();
  for (const LayoutPiece& piece : layout.pieces) {
    ASSERT_OK_AND_ASSIGN(uint64_t device_digest,
                         CopyDigest(piece, device_by_name.at(piece.local), pool.get()));
    const ExportTensor& local = host_by_name.at(piece.local);
    EXPECT_EQ(device_digest,
              PieceDigest(piece, TensorView{local.name, local.dtype, local.shape, local.host}))
        << piece.ToString();
  }
  EXPECT_LE(pool->stats().peak_held_bytes, pool->budget_bytes());
}

}  // namespace
}  // namespace refit
