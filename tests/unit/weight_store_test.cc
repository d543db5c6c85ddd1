#include "refit/weight_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/digest.h"
#include "test_data.h"
#include "test_util.h"

namespace refit {
namespace {

class WeightStoreTest : public ::testing::TestWithParam<StoreMode> {
 protected:
  void SetUp() override {
    path_ = (std::filesystem::temp_directory_path() /
             ("refit_store_test_" + std::to_string(getpid()) + ".safetensors"))
                .string();
    a_ = testing::RandomTensor("a", DType::kBFloat16, {64, 8}, 1);
    b_ = testing::RandomTensor("b", DType::kFloat32, {3}, 2);
    ASSERT_OK(WriteSafetensors(path_, {a_.view(), b_.view()}));
  }
  void TearDown() override { std::filesystem::remove(path_); }

  std::string path_;
  OwnedTensor a_, b_;
};

TEST_P(WeightStoreTest, LoadsTensorsAndDigests) {
  ASSERT_OK_AND_ASSIGN(auto store, WeightStore::Open(path_, GetParam()));
  EXPECT_EQ(store->size(), 2u);
  ASSERT_OK_AND_ASSIGN(TensorView a, std::as_const(*store).Find("a"));
  EXPECT_EQ(a.shape, (Shape{64, 8}));
  EXPECT_TRUE(std::equal(a.bytes.begin(), a.bytes.end(), a_.bytes.begin()));
  EXPECT_EQ(*store->Digest("a"), TensorDigest(a_.view()));
  EXPECT_EQ(store->Digests(), store->RecomputeDigests());
  EXPECT_STATUS_MSG(NotFound, "'missing'", store->Find("missing"));
}

TEST_P(WeightStoreTest, WritesNeverReachTheSourceFile) {
  std::vector<char> original;
  {
    std::ifstream in(path_, std::ios::binary);
    original.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_OK_AND_ASSIGN(auto store, WeightStore::Open(path_, GetParam()));
  ASSERT_OK_AND_ASSIGN(MutableTensorView a, store->Find("a"));
  for (auto& byte : a.bytes) byte = std::byte{0x5A};
  std::ifstream in(path_, std::ios::binary);
  std::vector<char> after(std::istreambuf_iterator<char>(in), {});
  EXPECT_EQ(after, original);
}

TEST_P(WeightStoreTest, SaveRoundTrips) {
  ASSERT_OK_AND_ASSIGN(auto store, WeightStore::Open(path_, GetParam()));
  const std::string copy = path_ + ".copy";
  ASSERT_OK(store->Save(copy));
  ASSERT_OK_AND_ASSIGN(auto reloaded, WeightStore::Open(copy, StoreMode::kMemory));
  EXPECT_EQ(reloaded->Digests(), store->Digests());
  std::filesystem::remove(copy);
}

INSTANTIATE_TEST_SUITE_P(Modes, WeightStoreTest,
                         ::testing::Values(StoreMode::kMemory, StoreMode::kMmap),
                         [](const auto& param_info) {
                           return param_info.param == StoreMode::kMemory ? "Memory" : "Mmap";
                         });

TEST(WeightStoreApiTest, AddCopyAndExternal) {
  auto store = WeightStore::Make();
  OwnedTensor t = testing::RandomTensor("t", DType::kInt8, {10}, 3);
  ASSERT_OK(store->AddCopy(t.view()));
  EXPECT_STATUS(AlreadyExists, store->AddCopy(t.view()));
  OwnedTensor bad = t;
  bad.name = "bad";
  bad.shape = {11};
  EXPECT_STATUS(InvalidArgument, store->AddCopy(bad.view()));

  OwnedTensor external = testing::RandomTensor("ext", DType::kFloat16, {4}, 4);
  ASSERT_OK(store->AddExternal(external.mutable_view()));
  ASSERT_OK_AND_ASSIGN(MutableTensorView view, store->Find("ext"));
  EXPECT_EQ(view.bytes.data(), external.bytes.data());  // zero-copy registration
  ASSERT_OK(store->AdjustDigest("ext", 5));
  EXPECT_EQ(*store->Digest("ext"), TensorDigest(external.view()) + 5);
  EXPECT_STATUS(NotFound, store->AdjustDigest("nope", 1));
}

}  // namespace
}  // namespace refit
