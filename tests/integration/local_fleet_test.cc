// refit_testing's LocalFleet against the real `refit serve`: daemons of one model, and the shards
// of a tensor-parallel replica (a model, loader and replica per daemon), refit by a Publisher
// over zmq:// and HTTP; a daemon that cannot start is named with the end of its log, and the
// others are stopped.
#include "local_fleet.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "process.h"
#include "refit/producer_group.h"
#include "refit/publisher.h"
#include "refit/safetensors.h"
#include "test_data.h"
#include "test_util.h"

#ifndef REFIT_BINARY
#error "REFIT_BINARY must name the refit executable (set by tests/integration/CMakeLists.txt)"
#endif

namespace refit::testkit {
namespace {

class LocalFleetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(work_dir_, MakeTemporaryDirectory("refit-local-fleet-test"));
  }
  void TearDown() override { std::filesystem::remove_all(work_dir_); }

  LocalFleetOptions Options(std::vector<LocalReceiverSpec> receivers) const {
    LocalFleetOptions options;
    options.refit_binary = REFIT_BINARY;
    options.receivers = std::move(receivers);
    options.work_dir = work_dir_;
    options.start_timeout = std::chrono::seconds(60);
    return options;
  }

  std::string WriteModel(const std::string& stem, const std::vector<OwnedTensor>& tensors) const {
    const std::string path = work_dir_ + "/" + stem + ".safetensors";
    std::vector<TensorView> views;
    for (const OwnedTensor& tensor : tensors) views.push_back(tensor.view());
    EXPECT_OK(WriteSafetensors(path, views, {{kWeightVersionMetadataKey, "0"}}));
    return path;
  }

  static std::unique_ptr<Publisher> PublisherOf(const LocalFleet& fleet) {
    PublisherOptions options;
    for (const LocalReceiver& receiver : fleet.receivers()) {
      options.receivers.push_back({receiver.control_url, receiver.data_endpoint});
    }
    Result<std::vector<std::unique_ptr<ProducerGroup>>> groups = MakeInProcessGroup(1);
    EXPECT_OK(groups.status());
    Result<std::unique_ptr<Publisher>> publisher =
        Publisher::Make(options, std::move((*groups)[0]));
    EXPECT_OK(publisher.status());
    return std::move(publisher).ValueOrDie();
  }

  std::string work_dir_;
};

TEST_F(LocalFleetTest, DaemonsOfOneModelStartTakeASyncAndStopCleanly) {
  const std::vector<OwnedTensor> model = {
      testing::RandomTensor("layers.0.w", DType::kBFloat16, {64, 32}, 1),
      testing::RandomTensor("layers.1.w", DType::kFloat32, {17}, 2)};
  ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<LocalFleet> fleet,
      LocalFleet::Start(Options(LocalFleetOptions::Replicas(WriteModel("model", model), 2))));
  ASSERT_EQ(fleet->receivers().size(), 2u);
  EXPECT_NE(fleet->receivers()[0].data_endpoint, fleet->receivers()[1].data_endpoint);
  EXPECT_EQ(fleet->data_endpoints()[1], fleet->receivers()[1].data_endpoint);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_GT(fleet->receivers()[i].pid, 0);
    EXPECT_TRUE(std::filesystem::exists(work_dir_ + "/receiver-" + std::to_string(i) + ".log"));
    ASSERT_OK_AND_ASSIGN(const uint64_t peak, fleet->PeakRssBytes(i));
    EXPECT_GT(peak, 0u);
  }

  std::unique_ptr<Publisher> publisher = PublisherOf(*fleet);
  std::vector<TensorView> base;
  for (const OwnedTensor& tensor : model) base.push_back(tensor.view());
  ASSERT_OK(publisher->AdoptBaseline(base, uint64_t{0}));
  const std::vector<OwnedTensor> next = {testing::Perturb(model[0], 0.05, 3),
                                         testing::Perturb(model[1], 0.5, 4)};
  std::vector<TensorView> views;
  for (const OwnedTensor& tensor : next) views.push_back(tensor.view());
  ASSERT_OK_AND_ASSIGN(const SyncReport report, publisher->Sync(views));
  EXPECT_FALSE(report.transfer.plan.anchor);
  EXPECT_EQ(publisher->version(), 1u);
  publisher.reset();
  EXPECT_OK(fleet->Stop());
  EXPECT_STATUS(NotFound, fleet->PeakRssBytes(0));
}

TEST_F(LocalFleetTest, EachDaemonMayHoldItsOwnShardOfOneReplica) {
  // Canonical w [4, 6]; two row shards of [2, 6], each daemon with its own file and loader.
  const OwnedTensor w = testing::RandomTensor("w", DType::kFloat32, {4, 6}, 5);
  std::vector<LocalReceiverSpec> specs;
  for (int rank = 0; rank < 2; ++rank) {
    OwnedTensor shard{"w", DType::kFloat32, {2, 6}, {}};
    const size_t half = w.bytes.size() / 2;
    shard.bytes.assign(w.bytes.begin() + rank * half, w.bytes.begin() + (rank + 1) * half);
    const std::string loader = work_dir_ + "/loader-" + std::to_string(rank) + ".yaml";
    std::ofstream(loader) << "tp_rank: " << rank << "\ntp_size: 2\nrules:\n"
                          << "  - {kind: row, match: w}\n";
    specs.push_back({WriteModel("shard-" + std::to_string(rank), {shard}), loader, "r0"});
  }
  LocalFleetOptions options = Options(specs);
  options.label = "tp";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<LocalFleet> fleet, LocalFleet::Start(options));
  EXPECT_TRUE(std::filesystem::exists(work_dir_ + "/tp-1.log"));
  std::unique_ptr<Publisher> publisher = PublisherOf(*fleet);
  ASSERT_OK(publisher->AdoptBaseline(std::vector<TensorView>{w.view()}, uint64_t{0}));
  const OwnedTensor changed = testing::Perturb(w, 0.5, 6);
  // The flush verifies the replica's two shards together against the canonical digest.
  ASSERT_OK_AND_ASSIGN(const SyncReport report,
                       publisher->Sync(std::vector<TensorView>{changed.view()}));
  EXPECT_EQ(report.transfer.plan.target_version, 1u);
  publisher.reset();
  EXPECT_OK(fleet->Stop());
}

TEST_F(LocalFleetTest, ADaemonThatCannotStartIsNamedWithTheEndOfItsLog) {
  const std::vector<OwnedTensor> model = {testing::RandomTensor("w", DType::kFloat32, {8}, 7)};
  std::vector<LocalReceiverSpec> specs = LocalFleetOptions::Replicas(WriteModel("good", model), 2);
  specs[1].model_path = work_dir_ + "/missing.safetensors";
  Result<std::unique_ptr<LocalFleet>> fleet = LocalFleet::Start(Options(specs));
  EXPECT_STATUS_MSG(Unavailable, "local fleet: receiver 1", fleet);
  EXPECT_STATUS_MSG(Unavailable, "missing.safetensors", fleet);
  EXPECT_STATUS_MSG(InvalidArgument, "no receivers", LocalFleet::Start(Options({})));
}

}  // namespace
}  // namespace refit::testkit
