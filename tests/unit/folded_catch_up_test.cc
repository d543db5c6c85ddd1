// Folded catch-up through the coordinator: W = 2 producers with retained histories, and
// reference receivers (in this test) that prepare to the target their PrepareRequest names — the
// receiver side per-receiver plans ask for (ReceiverStatus::accepts_target_version). A receiver
// 3 versions behind is caught up in the fleet's transfer by folded payloads whose bytes are at
// most those of the deltas it missed; one beyond the retained history gets an anchor alone; the
// members get the delta; every state digest is verified by the coordinator at flush.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "codec/delta_history.h"
#include "codec/locations.h"
#include "codec/tracker.h"
#include "core/digest.h"
#include "pipeline/coordinator.h"
#include "refit/chunk_source.h"
#include "refit/payload.h"
#include "refit/status_format.h"
#include "test_util.h"

namespace refit {
namespace {

constexpr uint64_t kElements = 2048;
constexpr int kTensors = 4;
constexpr uint64_t kChunkBytes = kElements * 2;  // One tensor per chunk.

using Model = std::vector<std::vector<uint16_t>>;

std::vector<TensorView> Views(const Model& model) {
  std::vector<TensorView> views;
  for (size_t t = 0; t < model.size(); ++t) {
    views.push_back(TensorView{"t" + std::to_string(t),
                               DType::kBFloat16,
                               {static_cast<int64_t>(kElements)},
                               std::as_bytes(std::span<const uint16_t>(model[t]))});
  }
  return views;
}

// A receiver that applies XOR and FULL items to its model and prepares to a named target.
class TargetReceiver final : public ReceiverControl {
 public:
  TargetReceiver(Model model, uint64_t version) : model_(std::move(model)), version_(version) {}

  Result<PrepareResult> Prepare(const PrepareRequest& request) override {
    std::lock_guard lock(mutex_);
    if (!request.anchor && request.base_version != version_) {
      return FailedPrecondition("based on version {}, the receiver is at {}", request.base_version,
                                version_);
    }
    open_ = request.transfer_id;
    base_ = request.base_version;
    target_ = request.target_version != 0 ? request.target_version : request.base_version + 1;
    staged_.clear();
    return PrepareResult{};
  }
  void Stage(std::span<const std::byte> payload) {
    std::lock_guard lock(mutex_);
    staged_.emplace_back(payload.begin(), payload.end());
    received_bytes_ += payload.size();
  }
  Result<FlushReport> Flush(const TransferId& id, const FlushOptions&) override {
    std::lock_guard lock(mutex_);
    if (id != open_) return FailedPrecondition("not the open transfer");
    Model next = model_;
    for (const std::vector<std::byte>& bytes : staged_) {
      REFIT_ASSIGN_OR_RETURN(DecodedPayload decoded, DecodePayload(bytes));
      if (decoded.header().ids.base_version != base_ ||
          decoded.header().ids.target_version != target_) {
        return FailedPrecondition("a payload moves {} -> {}, the transfer {} -> {}",
                                  decoded.header().ids.base_version,
                                  decoded.header().ids.target_version, base_, target_);
      }
      for (const ItemView& item : decoded.items()) {
        std::vector<uint16_t>& tensor = next.at(std::stoul(std::string(item.name.substr(1))));
        if (item.op == Op::kFull) {
          std::memcpy(tensor.data() + item.span_begin, item.values.data(), item.values.size());
          continue;
        }
        if (item.op != Op::kXor) return InvalidArgument("op {}", OpName(item.op));
        REFIT_ASSIGN_OR_RETURN(std::vector<uint64_t> locations, DecodeAllLocations(item));
        for (size_t k = 0; k < locations.size(); ++k) {
          uint16_t v = 0;
          std::memcpy(&v, item.values.data() + k * 2, 2);
          tensor[locations[k]] ^= v;
        }
      }
    }
    pending_ = std::move(next);
    FlushReport report;
    report.transfer_id = id;
    report.target_version = target_;
    report.payloads = staged_.size();
    for (const TensorView& view : Views(pending_)) report.digests[view.name] = TensorDigest(view);
    return report;
  }
  Status Commit(const TransferId& id) override {
    std::lock_guard lock(mutex_);
    if (id != open_) return FailedPrecondition("not the open transfer");
    model_ = std::move(pending_);
    version_ = target_;
    open_ = TransferId{};
    return Status::OK();
  }
  Status Abort(const TransferId&) override {
    std::lock_guard lock(mutex_);
    open_ = TransferId{};
    return Status::OK();
  }
  Result<HeldRegions> Regions(const std::vector<std::string>&) override { return HeldRegions{}; }

  ReceiverStanding standing() const {
    std::lock_guard lock(mutex_);
    return ReceiverStanding{version_, false, /*accepts_target=*/true};
  }
  Model model() const {
    std::lock_guard lock(mutex_);
    return model_;
  }
  uint64_t received_bytes() const {
    std::lock_guard lock(mutex_);
    return received_bytes_;
  }

 private:
  mutable std::mutex mutex_;
  Model model_;
  Model pending_;
  uint64_t version_;
  TransferId open_;
  uint64_t base_ = 0;
  uint64_t target_ = 0;
  std::vector<std::vector<std::byte>> staged_;
  uint64_t received_bytes_ = 0;
};

// Delivers each payload to the receivers of its route, by endpoint name.
class RouteChannel final : public PayloadChannel {
 public:
  explicit RouteChannel(std::vector<TargetReceiver*> to) : to_(std::move(to)) {}
  Status Send(uint32_t, std::span<const std::byte> payload) override {
    for (TargetReceiver* receiver : to_) receiver->Stage(payload);
    return Status::OK();
  }
  Status Finish(uint64_t) override { return Status::OK(); }

 private:
  std::vector<TargetReceiver*> to_;
};

TEST(FoldedCatchUpTest, ALaggardIsFoldedAndOneBeyondTheHistoryAnchoredWhileMembersGetTheDelta) {
  std::mt19937_64 rng(7);
  Model model(kTensors, std::vector<uint16_t>(kElements));
  for (auto& tensor : model) {
    for (uint16_t& b : tensor) b = static_cast<uint16_t>(0x3c80 + rng() % 0x100);
  }
  const Model step0 = model;
  std::bernoulli_distribution changes(0.03);
  const auto step = [&] {
    for (auto& tensor : model) {
      for (uint16_t& b : tensor) {
        if (changes(rng)) b = static_cast<uint16_t>(b ^ (1 + rng() % 3));
      }
    }
  };
  // Two producers, each keeping 4 deltas of the chunks it owns.
  std::vector<std::unique_ptr<internal::DeltaTracker>> trackers;
  std::vector<std::unique_ptr<DeltaHistory>> histories;
  for (int p = 0; p < 2; ++p) {
    trackers.push_back(internal::DeltaTracker::Make(TrackerOptions{}).ValueOrDie());
    for (const TensorView& view : Views(model)) {
      // Producer p owns the tensors of chunks k % 2 == p.
      if (std::stoul(view.name.substr(1)) % 2 == static_cast<uint64_t>(p)) {
        ASSERT_OK(trackers.back()->AdoptBaseline(view));
      }
    }
    histories.push_back(DeltaHistory::Make(DeltaHistoryOptions{.max_versions = 4}).ValueOrDie());
  }
  std::map<std::string, std::unique_ptr<TargetReceiver>> fleet;
  for (const char* name : {"a", "b", "c", "laggard"}) {
    fleet[name] = std::make_unique<TargetReceiver>(step0, 0);
  }
  // One transfer to the receivers named, each standing where it says it does.
  const auto refit = [&](const std::vector<std::string>& names) -> Result<RefitReport> {
    std::vector<internal::CoordinatedProducer> producers;
    for (int p = 0; p < 2; ++p) {
      producers.push_back(
          internal::CoordinatedProducer{trackers[p].get(),
                                        [&](const TransferPlan&) -> Result<ChunkSource> {
                                          return TensorListSource(Views(model), kChunkBytes);
                                        },
                                        histories[p].get()});
    }
    std::vector<internal::CoordinatedReceiver> receivers;
    for (const std::string& name : names) {
      TargetReceiver* receiver = fleet.at(name).get();
      receivers.push_back({name, receiver, {}, name, receiver->standing()});
    }
    internal::CoordinatorOptions options;
    options.stream.chunk_bytes = kChunkBytes;
    options.relay_trees = true;
    options.per_receiver_plans = true;
    const internal::ChannelFactory channels =
        [&](const internal::ChannelRequest& request) -> Result<std::unique_ptr<PayloadChannel>> {
      std::vector<TargetReceiver*> to;
      for (const std::string& endpoint : request.endpoints) to.push_back(fleet.at(endpoint).get());
      return std::unique_ptr<PayloadChannel>(new RouteChannel(std::move(to)));
    };
    REFIT_ASSIGN_OR_RETURN(
        std::unique_ptr<internal::Coordinator> coordinator,
        internal::Coordinator::Make(options, std::move(producers), std::move(receivers), channels));
    return coordinator->Refit();
  };

  // Versions 1 and 2 with everyone, 3 to 5 without the laggard.
  for (int s = 0; s < 2; ++s) {
    step();
    ASSERT_OK(refit({"a", "b", "c", "laggard"}).status());
  }
  uint64_t missed = 0;
  for (int s = 0; s < 3; ++s) {
    step();
    ASSERT_OK_AND_ASSIGN(RefitReport report, refit({"a", "b", "c"}));
    missed += report.wire_bytes;
  }
  // The laggard (at 2) and a newcomer with the step-0 weights (at 0: beyond the 4 retained
  // deltas, which reach back to version 1) join.
  fleet["newcomer"] = std::make_unique<TargetReceiver>(step0, 0);
  step();
  ASSERT_OK_AND_ASSIGN(RefitReport joined, refit({"a", "b", "c", "laggard", "newcomer"}));
  EXPECT_FALSE(joined.plan.anchor);
  EXPECT_EQ(joined.plan.base_version, 5u);
  const std::vector<CatchUp> want = {CatchUp::kDelta, CatchUp::kDelta, CatchUp::kDelta,
                                     CatchUp::kFolded, CatchUp::kAnchor};
  for (size_t r = 0; r < want.size(); ++r) {
    const ReceiverOutcome& outcome = joined.receivers[r];
    EXPECT_EQ(outcome.caught_up_by, want[r]) << outcome.name;
    EXPECT_EQ(fleet.at(outcome.name)->model(), model) << outcome.name << " is not at the target";
    EXPECT_EQ(outcome.flush.target_version, 6u) << outcome.name;
  }
  const ReceiverOutcome& laggard = joined.receivers[3];
  EXPECT_EQ(laggard.held_version, 2u);
  EXPECT_EQ(laggard.lag, 3u);
  const uint64_t delta = joined.receivers[0].wire_bytes;
  // The fold of 2→…→6 is at most the three deltas it missed and this one.
  EXPECT_LE(laggard.wire_bytes, missed + delta);
  EXPECT_GT(laggard.wire_bytes, 0u);
  EXPECT_LT(laggard.wire_bytes, joined.receivers[4].wire_bytes) << "a fold larger than an anchor";
  EXPECT_EQ(joined.receivers[4].lag, 5u);
}

}  // namespace
}  // namespace refit
