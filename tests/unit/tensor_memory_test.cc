// The device boundary (refit/tensor_memory.h): its checks and counters, and the applier through
// it — O(changes) traffic per delta, and a backend that fails at any call leaves the device
// tensors bit-identical to the base after the rollback.
#include "refit/tensor_memory.h"

#include <gtest/gtest.h>

#include <vector>

#include "codec/tracker.h"
#include "receiver/apply.h"
#include "refit/weight_store.h"
#include "store_snapshot.h"
#include "test_data.h"
#include "test_util.h"
#include "trainer_step.h"

namespace refit {
namespace {

using testing::EncodeTrainerStep;
using testing::RandomTensor;
using testing::StoreSnapshot;
using testing::TakeSnapshot;
using testing::TrainerStep;

std::vector<std::byte> Bytes(std::initializer_list<int> values) {
  std::vector<std::byte> out;
  for (int v : values) out.push_back(static_cast<std::byte>(v));
  return out;
}

TEST(TensorMemoryTest, UpdateGathersModifiesAndScattersOnceAndCountsEachWay) {
  auto memory = OpaqueTensorMemory::Make(Bytes({0, 1, 2, 3, 4, 5, 6, 7}));
  const std::vector<uint64_t> positions = {1, 3};
  std::vector<std::byte> bits(4);
  ASSERT_OK(memory->Update(positions, 2, bits, [](std::span<std::byte> old) {
    EXPECT_EQ(std::vector<std::byte>(old.begin(), old.end()), Bytes({2, 3, 6, 7}));
    for (std::byte& b : old) b ^= std::byte{0xff};
  }));
  EXPECT_EQ(memory->Snapshot(), Bytes({0, 1, 0xfd, 0xfc, 4, 5, 0xf9, 0xf8}));
  // Two positions of 4 bytes (a tensor under 2^31 elements) go once; 4 bytes of bits each way.
  const BoundaryTraffic traffic = memory->traffic();
  EXPECT_EQ(traffic.to_device_bytes, 2 * 4 + 4u);
  EXPECT_EQ(traffic.from_device_bytes, 4u);
  EXPECT_EQ(traffic.calls, 2u);
}

TEST(TensorMemoryTest, OutOfRangeCallsAreRefusedNamingThePositionAndTouchNothing) {
  auto memory = OpaqueTensorMemory::Make(Bytes({0, 1, 2, 3}));
  const std::vector<uint64_t> past = {0, 2};
  std::vector<std::byte> bits(4);
  bool modified = false;
  EXPECT_STATUS_MSG(InvalidArgument, "position 2 is past its 2 elements",
                    memory->Update(past, 2, bits, [&](std::span<std::byte>) { modified = true; }));
  EXPECT_FALSE(modified);
  EXPECT_STATUS_MSG(InvalidArgument, "6 bytes of bits for 2 positions",
                    memory->Scatter(std::vector<uint64_t>{0, 1}, 2, Bytes({1, 2, 3, 4, 5, 6})));
  std::vector<std::byte> out(3);
  EXPECT_STATUS_MSG(InvalidArgument, "bytes [2, 5) are past its 4 bytes", memory->Read(2, out));
  EXPECT_STATUS_MSG(InvalidArgument, "width 3 does not divide",
                    memory->Scatter(std::vector<uint64_t>{0}, 3, Bytes({1, 2, 3})));
  EXPECT_EQ(memory->Snapshot(), Bytes({0, 1, 2, 3}));
  EXPECT_EQ(memory->traffic().calls, 0u);
}

TEST(TensorMemoryTest, AStoreRefusesADeviceTensorOfTheWrongSizeOrNoMemory) {
  auto store = WeightStore::Make();
  EXPECT_STATUS_MSG(
      InvalidArgument, "'w': bfloat16 [4] is 8 bytes but its memory",
      store->AddDevice("w", DType::kBFloat16, {4}, OpaqueTensorMemory::Make(Bytes({1, 2}))));
  EXPECT_STATUS_MSG(InvalidArgument, "its memory is null",
                    store->AddDevice("w", DType::kBFloat16, {4}, nullptr));
  EXPECT_EQ(store->size(), 0u);
}

/// A device store and a host store of the same model, and a trainer.
class DeviceApplyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TrackerOptions options;
    options.op = Op::kOverwrite;
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make(options));
    model_ = {RandomTensor("model.embed.weight", DType::kBFloat16, {512, 64}, 1),
              RandomTensor("model.layers.0.mlp.weight", DType::kBFloat16, {256, 128}, 2),
              RandomTensor("model.norm.weight", DType::kFloat32, {64}, 3)};
    device_ = WeightStore::Make();
    host_ = WeightStore::Make();
    for (const OwnedTensor& t : model_) {
      ASSERT_OK(tracker_->AdoptBaseline(t.view()));
      auto memory = OpaqueTensorMemory::Make(t.bytes);
      memories_.push_back(memory);
      ASSERT_OK(device_->AddDevice(t.name, t.dtype, t.shape, memory));
      ASSERT_OK(host_->AddCopy(t.view()));
    }
    model_bytes_ = 0;
    for (const OwnedTensor& t : model_) model_bytes_ += t.bytes.size();
  }

  uint64_t ModelElements() const {
    uint64_t total = 0;
    for (const OwnedTensor& t : model_) total += t.view().numel();
    return total;
  }

  std::unique_ptr<internal::DeltaTracker> tracker_;
  std::vector<OwnedTensor> model_;
  std::vector<std::shared_ptr<OpaqueTensorMemory>> memories_;
  std::unique_ptr<WeightStore> device_;
  std::unique_ptr<WeightStore> host_;
  uint64_t model_bytes_ = 0;
};

// Registering reads each tensor once (its digest); a 3 % delta then costs the position once and
// the old and new bits: 4 + 2 + 2 bytes per changed bf16 element, nothing model-sized.
TEST_F(DeviceApplyTest, ADeltaCrossesTheBoundaryInOChangesAndMatchesTheHostStore) {
  EXPECT_EQ(device_->device_traffic().from_device_bytes, model_bytes_);
  EXPECT_EQ(device_->Digests(), host_->Digests());
  std::vector<OwnedTensor> current = model_;
  for (int step = 0; step < 3; ++step) {
    const TrainerStep encoded = EncodeTrainerStep(*tracker_, current, 40 + step, 0.03, 2, 3);
    const BoundaryTraffic before = device_->device_traffic();
    internal::UndoLog device_undo;
    internal::UndoLog host_undo;
    for (const auto& bytes : encoded.payloads) {
      ASSERT_OK_AND_ASSIGN(DecodedPayload payload, DecodePayload(bytes));
      ASSERT_OK(internal::ApplyPayload(payload, *device_, &device_undo, nullptr, /*threads=*/2));
      ASSERT_OK(internal::ApplyPayload(payload, *host_, &host_undo));
    }
    BoundaryTraffic used = device_->device_traffic();
    used.to_device_bytes -= before.to_device_bytes;
    used.from_device_bytes -= before.from_device_bytes;
    ASSERT_GT(encoded.changed_elements, 0u);
    uint64_t changed_bytes = 0;  // Old bits of every changed element (= new bits).
    for (const auto& items : encoded.items) {
      for (const Item& item : items) changed_bytes += item.count * DTypeSize(item.dtype);
    }
    EXPECT_EQ(used.from_device_bytes, changed_bytes);
    EXPECT_EQ(used.to_device_bytes, changed_bytes + 4 * encoded.changed_elements);
    EXPECT_LT(used.to_device_bytes + used.from_device_bytes, model_bytes_ / 5);
    EXPECT_EQ(TakeSnapshot(*device_), TakeSnapshot(*host_));
    EXPECT_EQ(device_->Digests(), tracker_->PendingDigests());
    EXPECT_EQ(device_->Digests(), device_->RecomputeDigests());
    ASSERT_OK(tracker_->Commit(encoded.id));
    current = encoded.next;
  }
}

// A backend that fails at its k-th call, for every k a delta and an anchor reach: the payload
// fails with the backend's error and the device holds the base again, bytes and digests.
TEST_F(DeviceApplyTest, ABackendFailingAtAnyCallLeavesTheBaseBitIdentical) {
  for (const bool anchor : {false, true}) {
    for (const AnchorUndo policy : {AnchorUndo::kMemory, AnchorUndo::kFile}) {
      const TrainerStep encoded = EncodeTrainerStep(*tracker_, model_, 7, 0.05, 1, 2, anchor);
      const StoreSnapshot base = TakeSnapshot(*device_);
      bool failed_once = false;
      // One tensor's backend fails at a time (the rollback after it must reach the others).
      for (size_t m = 0; m < memories_.size(); ++m) {
        for (uint64_t k = 0;; ++k) {
          SCOPED_TRACE(::testing::Message()
                       << (anchor ? "anchor" : "delta") << ", " << AnchorUndoName(policy)
                       << ", tensor " << m << " fails at call " << k);
          memories_[m]->FailAfter(k, 1);
          internal::UndoLog undo(internal::UndoLogOptions{.anchor_undo = policy});
          Status applied = Status::OK();
          for (const auto& bytes : encoded.payloads) {
            ASSERT_OK_AND_ASSIGN(DecodedPayload payload, DecodePayload(bytes));
            applied = internal::ApplyPayload(payload, *device_, &undo, nullptr, /*threads=*/1);
            if (!applied.ok()) break;
          }
          memories_[m]->FailAfter(0, 0);
          ASSERT_OK(undo.Rollback(*device_));
          EXPECT_EQ(TakeSnapshot(*device_), base);
          EXPECT_EQ(device_->Digests(), device_->RecomputeDigests());
          // Every call succeeded: k is past the calls the transfer makes on this tensor.
          if (applied.ok()) break;
          failed_once = true;
          EXPECT_EQ(applied.code(), StatusCode::kIoError) << applied.ToString();
          EXPECT_NE(applied.message().find("injected failure"), std::string::npos);
        }
      }
      EXPECT_TRUE(failed_once);
      ASSERT_OK(tracker_->Abort(encoded.id));
    }
  }
}

// A store saved to a file reads its device tensors through the boundary.
TEST_F(DeviceApplyTest, SaveAndReadBytesReachDeviceTensors) {
  std::vector<std::byte> out(8);
  ASSERT_OK(device_->ReadBytes("model.norm.weight", 8, out));
  EXPECT_EQ(out, std::vector<std::byte>(model_[2].bytes.begin() + 8, model_[2].bytes.begin() + 16));
  EXPECT_STATUS_MSG(InvalidArgument, "past its 256 bytes",
                    device_->ReadBytes("model.norm.weight", 252, out));
  ASSERT_OK(device_->SynchronizeDevices());
}

}  // namespace
}  // namespace refit
