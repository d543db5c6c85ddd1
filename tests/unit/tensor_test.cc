// Tests of tensor shapes and views (src/core/tensor.cc) and of the dtype registry
// (src/core/dtype.cc).
#include "refit/tensor.h"

#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "refit/dtype.h"
#include "test_util.h"

namespace refit {
namespace {

// ---------------------------------------------------------------------------------------------
// Shapes.

TEST(TensorTest, NumElementsMultipliesExtents) {
  ASSERT_OK_AND_ASSIGN(uint64_t scalar, NumElements({}));
  EXPECT_EQ(scalar, 1u);
  ASSERT_OK_AND_ASSIGN(uint64_t matrix, NumElements({3, 4}));
  EXPECT_EQ(matrix, 12u);
  ASSERT_OK_AND_ASSIGN(uint64_t empty, NumElements({5, 0, 7}));
  EXPECT_EQ(empty, 0u);
  ASSERT_OK_AND_ASSIGN(uint64_t big, NumElements({1 << 20, 1 << 20, 1 << 20}));
  EXPECT_EQ(big, uint64_t{1} << 60);
}

TEST(TensorTest, NumElementsAcceptsExactlyTwoToThe63) {
  ASSERT_OK_AND_ASSIGN(uint64_t count, NumElements({int64_t{1} << 31, int64_t{1} << 32}));
  EXPECT_EQ(count, uint64_t{1} << 63);
}

TEST(TensorTest, NumElementsRejectsOverflow) {
  EXPECT_STATUS_MSG(InvalidArgument, "more than 2^63 elements",
                    NumElements({int64_t{1} << 32, int64_t{1} << 32}));
  EXPECT_STATUS_MSG(InvalidArgument, "[3, 4611686018427387904]",
                    NumElements({3, int64_t{1} << 62}));
  EXPECT_STATUS(InvalidArgument, NumElements({std::numeric_limits<int64_t>::max(), 2}));
}

TEST(TensorTest, TensorBytesIsElementsTimesWidthAndRejectsOverflow) {
  ASSERT_OK_AND_ASSIGN(uint64_t bytes, TensorBytes({3, 4}, DType::kBFloat16));
  EXPECT_EQ(bytes, 24u);
  ASSERT_OK_AND_ASSIGN(uint64_t empty, TensorBytes({0, 4}, DType::kFloat64));
  EXPECT_EQ(empty, 0u);
  // 2^62 elements fit NumElements; 8 bytes each do not fit 2^64.
  EXPECT_STATUS_MSG(InvalidArgument, "more than 2^64 bytes",
                    TensorBytes({int64_t{1} << 62}, DType::kFloat64));
  EXPECT_STATUS(InvalidArgument, TensorBytes({4, -2}, DType::kUInt8));
}

TEST(TensorTest, NumElementsRejectsNegativeExtents) {
  EXPECT_STATUS_MSG(InvalidArgument, "negative extent -2 in shape [4, -2]", NumElements({4, -2}));
  EXPECT_STATUS(InvalidArgument, NumElements({-1}));
  EXPECT_STATUS(InvalidArgument, NumElements({0, -1}));
}

TEST(TensorTest, ShapeToString) {
  EXPECT_EQ(ShapeToString({}), "[]");
  EXPECT_EQ(ShapeToString({7}), "[7]");
  EXPECT_EQ(ShapeToString({2, 3, 4}), "[2, 3, 4]");
}

TEST(TensorTest, CheckTensorSizeAcceptsMatchingBytes) {
  const std::vector<std::byte> bytes(24);
  EXPECT_OK(CheckTensorSize(TensorView{"w", DType::kFloat32, {2, 3}, bytes}));
  EXPECT_OK(CheckTensorSize(TensorView{"w", DType::kBFloat16, {12}, bytes}));
  EXPECT_OK(CheckTensorSize(TensorView{"w", DType::kFloat64, {3}, bytes}));
  EXPECT_OK(CheckTensorSize(TensorView{"empty", DType::kFloat32, {0, 5}, {}}));
  const std::vector<std::byte> one(4);
  EXPECT_OK(CheckTensorSize(TensorView{"scalar", DType::kInt32, {}, one}));
}

TEST(TensorTest, CheckTensorSizeNamesTensorShapeAndSizes) {
  const std::vector<std::byte> bytes(20);
  EXPECT_STATUS_MSG(InvalidArgument,
                    "tensor 'layer.0.weight': shape [2, 3] of float32 needs 24 "
                    "bytes, got 20",
                    CheckTensorSize(TensorView{"layer.0.weight", DType::kFloat32, {2, 3}, bytes}));
  EXPECT_STATUS(InvalidArgument, CheckTensorSize(TensorView{"w", DType::kUInt8, {21}, bytes}));
  EXPECT_STATUS(InvalidArgument, CheckTensorSize(TensorView{"w", DType::kUInt8, {-20}, bytes}));
}

TEST(TensorTest, CheckTensorSizeRejectsByteCountOverflow) {
  // 2^62 float64 elements are 2^65 bytes: the byte count overflows even though numel does not.
  const std::vector<std::byte> bytes(8);
  EXPECT_STATUS(InvalidArgument,
                CheckTensorSize(TensorView{"huge", DType::kFloat64, {int64_t{1} << 62}, bytes}));
  // 2^61 × 8 = 2^64 wraps to 0 in 64 bits: an empty byte span must still be rejected.
  EXPECT_STATUS(InvalidArgument,
                CheckTensorSize(TensorView{"wrap", DType::kFloat64, {int64_t{1} << 61}, {}}));
}

TEST(TensorTest, ViewsReportElementCounts) {
  OwnedTensor tensor{"t", DType::kBFloat16, {2, 5}, std::vector<std::byte>(20)};
  EXPECT_EQ(tensor.view().numel(), 10u);
  EXPECT_EQ(tensor.mutable_view().numel(), 10u);
  EXPECT_EQ(tensor.mutable_view().AsConst().bytes.data(), tensor.bytes.data());
  EXPECT_OK(CheckTensorSize(tensor.view()));
}

// ---------------------------------------------------------------------------------------------
// DTypes.

TEST(DTypeTest, RegistryIsInWireCodeOrderWithConsistentFacts) {
  const auto all = AllDTypes();
  ASSERT_EQ(all.size(), 14u);
  std::set<std::string_view> names;
  std::set<std::string_view> codes;
  for (size_t i = 0; i < all.size(); ++i) {
    const DTypeInfo& info = all[i];
    EXPECT_EQ(static_cast<size_t>(info.dtype), i + 1);
    EXPECT_EQ(&GetDTypeInfo(info.dtype), &info);
    EXPECT_TRUE(info.size == 1 || info.size == 2 || info.size == 4 || info.size == 8);
    EXPECT_EQ(DTypeName(info.dtype), info.name);
    EXPECT_EQ(DTypeSize(info.dtype), info.size);
    EXPECT_EQ(IsFloating(info.dtype), info.is_floating);
    names.insert(info.name);
    codes.insert(info.safetensors_code);
  }
  EXPECT_EQ(names.size(), all.size());
  EXPECT_EQ(codes.size(), all.size());
}

TEST(DTypeTest, KnownFacts) {
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFloat8E4M3FN), 1u);
  EXPECT_EQ(DTypeSize(DType::kInt64), 8u);
  EXPECT_TRUE(IsFloating(DType::kFloat8E5M2));
  EXPECT_FALSE(IsFloating(DType::kBool));
  EXPECT_EQ(GetDTypeInfo(DType::kBFloat16).safetensors_code, "BF16");
  EXPECT_EQ(GetDTypeInfo(DType::kFloat8E4M3FN).safetensors_code, "F8_E4M3");
}

TEST(DTypeTest, EveryCanonicalNameAndSafetensorsCodeParses) {
  for (const DTypeInfo& info : AllDTypes()) {
    ASSERT_OK_AND_ASSIGN(DType by_name, ParseDType(info.name));
    EXPECT_EQ(by_name, info.dtype) << info.name;
    ASSERT_OK_AND_ASSIGN(DType by_torch_name, ParseDType("torch." + std::string(info.name)));
    EXPECT_EQ(by_torch_name, info.dtype) << info.name;
    ASSERT_OK_AND_ASSIGN(DType by_code, ParseDType(info.safetensors_code));
    EXPECT_EQ(by_code, info.dtype) << info.safetensors_code;
  }
}

TEST(DTypeTest, EveryAliasParses) {
  const std::pair<std::string_view, DType> aliases[] = {
      {"bf16", DType::kBFloat16},
      {"fp16", DType::kFloat16},
      {"half", DType::kFloat16},
      {"f16", DType::kFloat16},
      {"fp32", DType::kFloat32},
      {"float", DType::kFloat32},
      {"f32", DType::kFloat32},
      {"fp64", DType::kFloat64},
      {"double", DType::kFloat64},
      {"f64", DType::kFloat64},
      {"u8", DType::kUInt8},
      {"fp8_e4m3", DType::kFloat8E4M3FN},
      {"fp8_e5m2", DType::kFloat8E5M2},
      {"long", DType::kInt64},
      {"torch.half", DType::kFloat16},
      {"torch.float", DType::kFloat32},
  };
  for (const auto& [text, dtype] : aliases) {
    ASSERT_OK_AND_ASSIGN(DType parsed, ParseDType(text));
    EXPECT_EQ(parsed, dtype) << text;
  }
}

TEST(DTypeTest, UnknownNamesListTheAcceptedOnes) {
  EXPECT_STATUS_MSG(InvalidArgument, "unknown dtype 'float128'", ParseDType("float128"));
  EXPECT_STATUS_MSG(InvalidArgument, "bfloat16 (BF16)", ParseDType("float128"));
  EXPECT_STATUS_MSG(InvalidArgument, "aliases: bf16", ParseDType("float128"));
  EXPECT_STATUS(InvalidArgument, ParseDType(""));
  EXPECT_STATUS(InvalidArgument, ParseDType("torch."));
  // Safetensors codes are case-sensitive; aliases are lower case only.
  EXPECT_STATUS(InvalidArgument, ParseDType("bf16 "));
  EXPECT_STATUS(InvalidArgument, ParseDType("f8_e4m3"));
  EXPECT_STATUS(InvalidArgument, ParseDType("BFLOAT16"));
  // The torch. prefix belongs to names, not to safetensors codes.
  EXPECT_STATUS(InvalidArgument, ParseDType("torch.BF16"));
}

TEST(DTypeTest, WireCodes) {
  for (const DTypeInfo& info : AllDTypes()) {
    ASSERT_OK_AND_ASSIGN(DType dtype, DTypeFromCode(static_cast<uint8_t>(info.dtype)));
    EXPECT_EQ(dtype, info.dtype);
  }
  EXPECT_EQ(static_cast<int>(DType::kBool), 1);
  EXPECT_EQ(static_cast<int>(DType::kBFloat16), 8);
  EXPECT_EQ(static_cast<int>(DType::kFloat8E5M2FNUZ), 14);
  EXPECT_STATUS_MSG(InvalidArgument, "unknown dtype code 0 (valid: 1..14)", DTypeFromCode(0));
  EXPECT_STATUS_MSG(InvalidArgument, "unknown dtype code 15", DTypeFromCode(15));
  EXPECT_STATUS(InvalidArgument, DTypeFromCode(255));
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST(NumElementsRegressionTest, ZeroExtentWinsOverHugeExtents) {
  ASSERT_OK_AND_ASSIGN(uint64_t n, NumElements({int64_t{1} << 40, int64_t{1} << 40, 0}));
  EXPECT_EQ(n, 0u);
  EXPECT_STATUS(InvalidArgument, NumElements({int64_t{1} << 40, int64_t{1} << 40, 1}));
}

}  // namespace
}  // namespace refit
