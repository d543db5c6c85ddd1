#include "refit/dtype.h"

#include <array>

#include <fmt/format.h>

#include "refit/status_format.h"

namespace refit {
namespace {

// Ordered by wire code (code - 1 == index), which GetDTypeInfo relies on.
constexpr std::array<DTypeInfo, 14> kDTypes = {{
    {DType::kBool, "bool", "BOOL", 1, false},
    {DType::kUInt8, "uint8", "U8", 1, false},
    {DType::kInt8, "int8", "I8", 1, false},
    {DType::kInt16, "int16", "I16", 2, false},
    {DType::kInt32, "int32", "I32", 4, false},
    {DType::kInt64, "int64", "I64", 8, false},
    {DType::kFloat16, "float16", "F16", 2, true},
    {DType::kBFloat16, "bfloat16", "BF16", 2, true},
    {DType::kFloat32, "float32", "F32", 4, true},
    {DType::kFloat64, "float64", "F64", 8, true},
    {DType::kFloat8E4M3FN, "float8_e4m3fn", "F8_E4M3", 1, true},
    {DType::kFloat8E5M2, "float8_e5m2", "F8_E5M2", 1, true},
    {DType::kFloat8E4M3FNUZ, "float8_e4m3fnuz", "F8_E4M3FNUZ", 1, true},
    {DType::kFloat8E5M2FNUZ, "float8_e5m2fnuz", "F8_E5M2FNUZ", 1, true},
}};

struct Alias {
  std::string_view text;
  DType dtype;
};

constexpr std::array<Alias, 14> kAliases = {{
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
}};

std::string AcceptedNames() {
  std::string out;
  for (const DTypeInfo& info : kDTypes) {
    if (!out.empty()) out += ", ";
    out += fmt::format("{} ({})", info.name, info.safetensors_code);
  }
  out += "; aliases:";
  for (const Alias& alias : kAliases) out += fmt::format(" {}", alias.text);
  return out;
}

}  // namespace

const DTypeInfo& GetDTypeInfo(DType dtype) { return kDTypes[static_cast<size_t>(dtype) - 1]; }

std::span<const DTypeInfo> AllDTypes() { return kDTypes; }

Result<DType> ParseDType(std::string_view text) {
  std::string_view bare = text;
  if (bare.starts_with("torch.")) bare.remove_prefix(6);
  for (const DTypeInfo& info : kDTypes) {
    if (bare == info.name || text == info.safetensors_code) return info.dtype;
  }
  for (const Alias& alias : kAliases) {
    if (bare == alias.text) return alias.dtype;
  }
  return InvalidArgument("unknown dtype '{}'; accepted: {}", text, AcceptedNames());
}

Result<DType> DTypeFromCode(uint8_t code) {
  if (code == 0 || code > kDTypes.size()) {
    return InvalidArgument("unknown dtype code {} (valid: 1..{})", code, kDTypes.size());
  }
  return kDTypes[code - 1].dtype;
}

}  // namespace refit
