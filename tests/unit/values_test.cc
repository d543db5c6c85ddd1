// Tests of the value operations (src/codec/values.cc) and of the exact half / bfloat16
// conversions they rest on (src/core/half_float.h).
#include "codec/values.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "core/half_float.h"
#include "refit/dtype.h"
#include "test_util.h"

namespace refit {
namespace {

constexpr DType kAddDTypes[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32,
                                DType::kFloat64};

// ---------------------------------------------------------------------------------------------
// References, written independently of half_float.h.

// Round a finite double to bfloat16 bits with round-to-nearest-even using integer arithmetic on
// the double's significand: value = sig · 2^e, bfloat16 = k · 2^q with q the target ulp.
uint16_t ReferenceBFloat16(double value) {
  const uint64_t bits = std::bit_cast<uint64_t>(value);
  const auto sign = static_cast<uint16_t>((bits >> 48) & 0x8000u);
  const int biased = static_cast<int>((bits >> 52) & 0x7FF);
  const uint64_t fraction = bits & ((uint64_t{1} << 52) - 1);
  if (biased == 0x7FF) return static_cast<uint16_t>(sign | 0x7F80u);  // ±Inf (no NaN here).
  if (biased == 0 && fraction == 0) return sign;
  const uint64_t sig = biased == 0 ? fraction : (fraction | (uint64_t{1} << 52));
  const int e = biased == 0 ? -1074 : biased - 1075;
  const int top = e + static_cast<int>(std::bit_width(sig)) - 1;  // floor(log2(value))
  int q = std::max(top - 7, -133);  // bfloat16: 8 significant bits, minimum ulp 2^-133.
  const int shift = q - e;
  uint64_t k;
  if (shift <= 0) {
    k = sig << -shift;
  } else if (shift >= 64) {
    k = 0;  // Below half the smallest subnormal: rounds to zero.
  } else {
    k = sig >> shift;
    const uint64_t remainder = sig & ((uint64_t{1} << shift) - 1);
    const uint64_t half = uint64_t{1} << (shift - 1);
    if (remainder > half || (remainder == half && (k & 1) != 0)) ++k;
  }
  if (q == -133 && k <= 128) return static_cast<uint16_t>(sign | k);  // Subnormal or min normal.
  if (k == 256) {
    k = 128;
    ++q;
  }
  const int exponent = q + 7 + 127;
  if (exponent >= 255) return static_cast<uint16_t>(sign | 0x7F80u);
  return static_cast<uint16_t>(sign | (exponent << 7) | (k - 128));
}

#ifdef __FLT16_MAX__
constexpr bool kHaveFloat16 = true;
uint16_t CompilerHalf(double value) {
  return std::bit_cast<uint16_t>(static_cast<_Float16>(value));
}
uint16_t CompilerHalf(float value) { return std::bit_cast<uint16_t>(static_cast<_Float16>(value)); }
float CompilerHalfToFloat(uint16_t bits) {
  return static_cast<float>(std::bit_cast<_Float16>(bits));
}
#else
constexpr bool kHaveFloat16 = false;
uint16_t CompilerHalf(double) { return 0; }
uint16_t CompilerHalf(float) { return 0; }
float CompilerHalfToFloat(uint16_t) { return 0; }
#endif

bool IsHalfNaN(uint16_t bits) { return (bits & 0x7C00u) == 0x7C00u && (bits & 0x3FFu) != 0; }
bool IsBFloat16NaN(uint16_t bits) { return (bits & 0x7F80u) == 0x7F80u && (bits & 0x7Fu) != 0; }

// Doubles that stress a narrowing to a format with `mantissa_bits` stored bits whose finite range
// is [2^min_exponent, 2^max_exponent): random magnitudes across and beyond the range, exact ties
// between neighbours and their double neighbours, and random bit patterns.
std::vector<double> StressDoubles(std::mt19937_64& rng, int min_exponent, int max_exponent,
                                  int mantissa_bits) {
  std::vector<double> values;
  std::uniform_real_distribution<double> unit(1.0, 2.0);
  for (int i = 0; i < 200000; ++i) {
    const int exponent =
        min_exponent - mantissa_bits - 12 +
        static_cast<int>(rng() %
                         static_cast<uint64_t>(max_exponent - min_exponent + mantissa_bits + 16));
    const double magnitude = std::ldexp(unit(rng), exponent);
    values.push_back(rng() % 2 == 0 ? magnitude : -magnitude);
  }
  for (int i = 0; i < 100000; ++i) {
    // A tie: an odd multiple of half an ulp at a random exponent, and its double neighbours.
    const int exponent =
        min_exponent - mantissa_bits +
        static_cast<int>(rng() %
                         static_cast<uint64_t>(max_exponent - min_exponent + mantissa_bits + 1));
    const uint64_t units = (rng() % (uint64_t{1} << (mantissa_bits + 2))) | 1;
    const double tie = std::ldexp(static_cast<double>(units), exponent - mantissa_bits - 1);
    values.push_back(tie);
    values.push_back(-tie);
    values.push_back(std::nextafter(tie, 0.0));
    values.push_back(std::nextafter(tie, INFINITY));
  }
  for (int i = 0; i < 100000; ++i) values.push_back(std::bit_cast<double>(rng()));
  const double specials[] = {0.0,
                             -0.0,
                             INFINITY,
                             -INFINITY,
                             std::numeric_limits<double>::min(),
                             std::numeric_limits<double>::denorm_min(),
                             std::numeric_limits<double>::max(),
                             65504.0,
                             65519.99,
                             65520.0,
                             65536.0,
                             0x1.FEp127,
                             0x1.FFp127,
                             0x1.FFFFFEp127,
                             0x1.FF0001p127,
                             0x1p-24,
                             0x1p-25,
                             0x1.8p-25,
                             0x1p-133,
                             0x1p-134,
                             0x1.8p-134};
  values.insert(values.end(), std::begin(specials), std::end(specials));
  return values;
}

// ---------------------------------------------------------------------------------------------
// half_float.h

TEST(HalfFloatTest, EveryBFloat16WidensAndNarrowsBackToItself) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto b = static_cast<uint16_t>(bits);
    const float wide = BFloat16ToFloat(b);
    EXPECT_EQ(std::bit_cast<uint32_t>(wide), bits << 16);
    if (IsBFloat16NaN(b)) {
      EXPECT_TRUE(IsBFloat16NaN(FloatToBFloat16(wide)));
      EXPECT_TRUE(IsBFloat16NaN(DoubleToBFloat16(wide)));
      EXPECT_EQ(FloatToBFloat16(wide) & 0x8000u, b & 0x8000u) << "NaN keeps its sign";
      continue;
    }
    ASSERT_EQ(FloatToBFloat16(wide), b) << std::hex << bits;
    ASSERT_EQ(DoubleToBFloat16(static_cast<double>(wide)), b) << std::hex << bits;
  }
}

TEST(HalfFloatTest, EveryHalfWidensAndNarrowsBackToItself) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    const float wide = HalfToFloat(h);
    if (IsHalfNaN(h)) {
      EXPECT_TRUE(std::isnan(wide));
      EXPECT_TRUE(IsHalfNaN(FloatToHalf(wide)));
      EXPECT_TRUE(IsHalfNaN(DoubleToHalf(wide)));
      EXPECT_EQ(DoubleToHalf(wide) & 0x8000u, h & 0x8000u) << "NaN keeps its sign";
      continue;
    }
    ASSERT_EQ(FloatToHalf(wide), h) << std::hex << bits;
    ASSERT_EQ(DoubleToHalf(static_cast<double>(wide)), h) << std::hex << bits;
    if (kHaveFloat16) {
      ASSERT_EQ(std::bit_cast<uint32_t>(wide), std::bit_cast<uint32_t>(CompilerHalfToFloat(h)))
          << std::hex << bits;
    }
  }
}

TEST(HalfFloatTest, KnownHalfValues) {
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // Smallest subnormal.
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(DoubleToHalf(65519.99), 0x7BFF);
  EXPECT_EQ(DoubleToHalf(65520.0), 0x7C00);  // The tie rounds to even: infinity.
  EXPECT_EQ(DoubleToHalf(-1e300), 0xFC00);
  EXPECT_EQ(DoubleToHalf(std::ldexp(1.0, -25)), 0x0000);  // Tie between 0 and 2^-24: even.
  EXPECT_EQ(DoubleToHalf(std::ldexp(1.5, -25)), 0x0001);
  EXPECT_EQ(DoubleToHalf(std::ldexp(3.0, -25)), 0x0002);        // Tie between 1 and 2 units: even.
  EXPECT_EQ(DoubleToHalf(1.0 + std::ldexp(1.0, -11)), 0x3C00);  // Tie: even.
  EXPECT_EQ(DoubleToHalf(1.0 + std::ldexp(3.0, -11)), 0x3C02);
  EXPECT_EQ(DoubleToHalf(-0.0), 0x8000);
}

TEST(HalfFloatTest, KnownBFloat16Values) {
  EXPECT_EQ(DoubleToBFloat16(1.0), 0x3F80);
  EXPECT_EQ(DoubleToBFloat16(1.0 + std::ldexp(1.0, -8)), 0x3F80);  // Tie: even.
  EXPECT_EQ(DoubleToBFloat16(1.0 + std::ldexp(3.0, -8)), 0x3F82);  // Tie: even (up).
  // Just above a tie, but not a float: a double-rounding trap (via float it would be a tie).
  EXPECT_EQ(DoubleToBFloat16(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40)), 0x3F81);
  EXPECT_EQ(DoubleToBFloat16(0x1.FEp127), 0x7F7F);
  EXPECT_EQ(DoubleToBFloat16(0x1.FFp127), 0x7F80);  // Tie above the maximum: infinity.
  EXPECT_EQ(DoubleToBFloat16(0x1.FEFFFFFFFFFFFp127), 0x7F7F);
  EXPECT_EQ(DoubleToBFloat16(-1e300), 0xFF80);
  EXPECT_EQ(DoubleToBFloat16(1e-300), 0x0000);
  EXPECT_EQ(DoubleToBFloat16(-1e-300), 0x8000);
  EXPECT_EQ(DoubleToBFloat16(std::ldexp(1.0, -133)), 0x0001);
  EXPECT_EQ(DoubleToBFloat16(std::ldexp(1.0, -134)), 0x0000);  // Tie: even.
  EXPECT_EQ(DoubleToBFloat16(std::ldexp(1.0, -134) + std::ldexp(1.0, -170)), 0x0001);
  EXPECT_TRUE(IsBFloat16NaN(DoubleToBFloat16(std::nan(""))));
}

TEST(HalfFloatTest, DoubleToHalfMatchesTheCompiler) {
  if (!kHaveFloat16) GTEST_SKIP() << "this compiler has no _Float16";
  std::mt19937_64 rng(2024);
  size_t compared = 0;
  for (const double value : StressDoubles(rng, -24, 16, 10)) {
    if (std::isnan(value)) continue;
    ASSERT_EQ(DoubleToHalf(value), CompilerHalf(value)) << std::hexfloat << value;
    ++compared;
  }
  EXPECT_GT(compared, 500000u);
}

TEST(HalfFloatTest, FloatToHalfMatchesTheCompiler) {
  if (!kHaveFloat16) GTEST_SKIP() << "this compiler has no _Float16";
  std::mt19937_64 rng(77);
  for (int i = 0; i < 1000000; ++i) {
    // Half the draws near the half range, half arbitrary float bit patterns.
    const float value = i % 2 == 0 ? std::ldexp(static_cast<float>(rng() % (1u << 24)) / (1u << 23),
                                                static_cast<int>(rng() % 50) - 30)
                                   : std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (std::isnan(value)) continue;
    ASSERT_EQ(FloatToHalf(value), CompilerHalf(value)) << std::hexfloat << value;
  }
}

TEST(HalfFloatTest, DoubleToBFloat16MatchesIntegerReference) {
  std::mt19937_64 rng(4242);
  size_t compared = 0;
  for (const double value : StressDoubles(rng, -133, 128, 7)) {
    if (std::isnan(value)) continue;
    ASSERT_EQ(DoubleToBFloat16(value), ReferenceBFloat16(value)) << std::hexfloat << value;
    ++compared;
  }
  EXPECT_GT(compared, 500000u);
  // Every float is a double too (the fast path).
  for (int i = 0; i < 1000000; ++i) {
    const float value = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (std::isnan(value)) continue;
    ASSERT_EQ(FloatToBFloat16(value), ReferenceBFloat16(value)) << std::hexfloat << value;
  }
}

// ---------------------------------------------------------------------------------------------
// LoadBits / StoreBits

TEST(ValuesTest, LoadAndStoreBitsAreLittleEndianForEveryWidth) {
  std::vector<std::byte> bytes(16);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(i + 1);
  EXPECT_EQ(LoadBits(bytes, 1, 3), 0x04u);
  EXPECT_EQ(LoadBits(bytes, 2, 1), 0x0403u);
  EXPECT_EQ(LoadBits(bytes, 4, 1), 0x08070605u);
  EXPECT_EQ(LoadBits(bytes, 8, 1), 0x100F0E0D0C0B0A09u);
  for (const uint32_t width : {1u, 2u, 4u, 8u}) {
    std::vector<std::byte> out(16, std::byte{0xEE});
    const uint64_t bits = 0x8877665544332211u;
    StoreBits(out, width, 1, bits);
    for (size_t i = 0; i < out.size(); ++i) {
      const bool inside = i >= width && i < 2 * width;
      const auto expected =
          inside ? static_cast<std::byte>(bits >> (8 * (i - width))) : std::byte{0xEE};
      EXPECT_EQ(out[i], expected) << "width " << width << " byte " << i;
    }
    EXPECT_EQ(LoadBits(out, width, 1),
              width == 8 ? bits : bits & ((uint64_t{1} << (8 * width)) - 1));
  }
}

// ---------------------------------------------------------------------------------------------
// XOR / OVERWRITE

struct Tensors {
  std::vector<std::byte> old_bytes;
  std::vector<std::byte> new_bytes;
  std::vector<uint64_t> changed;
};

// A tensor of `numel` random elements of `width` bytes and a copy where ~`fraction` of them
// changed (with NaN-like and sign-bit patterns thrown in: XOR and OVERWRITE must not care).
Tensors RandomTensors(std::mt19937_64& rng, uint32_t width, uint64_t numel, double fraction) {
  Tensors t;
  t.old_bytes.resize(numel * width);
  for (std::byte& b : t.old_bytes) b = static_cast<std::byte>(rng());
  t.new_bytes = t.old_bytes;
  std::bernoulli_distribution change(fraction);
  for (uint64_t i = 0; i < numel; ++i) {
    if (!change(rng)) continue;
    const uint64_t old_bits = LoadBits(t.old_bytes, width, i);
    uint64_t new_bits = old_bits;
    while (new_bits == old_bits) {
      switch (rng() % 3) {
        case 0:
          new_bits = old_bits ^ 1;
          break;  // 1-ulp style change.
        case 1:
          new_bits = old_bits ^ (uint64_t{1} << (8 * width - 1));
          break;  // Sign flip.
        default:
          new_bits = rng();
          break;
      }
      if (width < 8) new_bits &= (uint64_t{1} << (8 * width)) - 1;
    }
    StoreBits(t.new_bytes, width, i, new_bits);
    t.changed.push_back(i);
  }
  return t;
}

class BitwiseOpTest : public ::testing::TestWithParam<std::tuple<DType, Op>> {};

TEST_P(BitwiseOpTest, RoundTripsWithUndo) {
  const auto [dtype, op] = GetParam();
  const uint32_t width = DTypeSize(dtype);
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    std::mt19937_64 rng(seed);
    const uint64_t numel = 1 + rng() % 3000;
    Tensors t = RandomTensors(rng, width, numel, 0.2);
    ASSERT_OK_AND_ASSIGN(OpValues values,
                         MakeOpValues(op, dtype, dtype, t.old_bytes, t.new_bytes, t.changed));
    EXPECT_EQ(values.locations, t.changed);
    EXPECT_TRUE(values.demoted_locations.empty());
    ASSERT_EQ(values.values.size(), t.changed.size() * width);
    for (size_t i = 0; i < t.changed.size(); ++i) {
      const uint64_t expected = op == Op::kXor ? LoadBits(t.new_bytes, width, t.changed[i]) ^
                                                     LoadBits(t.old_bytes, width, t.changed[i])
                                               : LoadBits(t.new_bytes, width, t.changed[i]);
      ASSERT_EQ(LoadBits(values.values, width, i), expected);
    }

    std::vector<std::byte> tensor = t.old_bytes;
    std::vector<std::byte> undo = {std::byte{0x5A}};  // Appended to, not replaced.
    ApplyOpValues(op, dtype, dtype, tensor, values.locations, values.values, &undo);
    EXPECT_EQ(tensor, t.new_bytes);
    ASSERT_EQ(undo.size(), 1 + t.changed.size() * width);
    EXPECT_EQ(undo[0], std::byte{0x5A});
    const std::span<const std::byte> undo_bits = std::span<const std::byte>(undo).subspan(1);
    for (size_t i = 0; i < t.changed.size(); ++i) {
      ASSERT_EQ(LoadBits(undo_bits, width, i), LoadBits(t.old_bytes, width, t.changed[i]));
    }
    // Rolling back is an OVERWRITE with the undo bits.
    ApplyOpValues(Op::kOverwrite, dtype, dtype, tensor, values.locations, undo_bits, nullptr);
    EXPECT_EQ(tensor, t.old_bytes);
    // Without an undo log the result is the same.
    ApplyOpValues(op, dtype, dtype, tensor, values.locations, values.values, nullptr);
    EXPECT_EQ(tensor, t.new_bytes);
    if (op == Op::kXor) {  // XOR twice reverts; OVERWRITE twice is idempotent.
      ApplyOpValues(op, dtype, dtype, tensor, values.locations, values.values, nullptr);
      EXPECT_EQ(tensor, t.old_bytes);
    } else {
      ApplyOpValues(op, dtype, dtype, tensor, values.locations, values.values, nullptr);
      EXPECT_EQ(tensor, t.new_bytes);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryWidth, BitwiseOpTest,
                         ::testing::Combine(::testing::Values(DType::kUInt8, DType::kFloat8E4M3FN,
                                                              DType::kBFloat16, DType::kInt16,
                                                              DType::kFloat32, DType::kFloat64,
                                                              DType::kInt64),
                                            ::testing::Values(Op::kXor, Op::kOverwrite)),
                         [](const ::testing::TestParamInfo<std::tuple<DType, Op>>& param_info) {
                           return std::string(DTypeName(std::get<0>(param_info.param))) + "_" +
                                  std::string(OpName(std::get<1>(param_info.param)));
                         });

TEST(ValuesTest, FullOverwritesEveryListedElement) {
  std::vector<std::byte> tensor(8, std::byte{0});
  const std::vector<uint64_t> locations = {0, 1, 2, 3};
  const std::vector<std::byte> values = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4},
                                         std::byte{5}, std::byte{6}, std::byte{7}, std::byte{8}};
  std::vector<std::byte> undo;
  ApplyOpValues(Op::kFull, DType::kBFloat16, DType::kBFloat16, tensor, locations, values, &undo);
  EXPECT_EQ(tensor, values);
  EXPECT_EQ(undo, std::vector<std::byte>(8, std::byte{0}));
}

TEST(ValuesTest, XorKeepsNaNPayloadsAndNegativeZero) {
  // float32: +0 → -0, a signalling NaN → a different NaN payload, 1.0 → quiet NaN.
  const uint32_t old_bits[] = {0x00000000u, 0x7F800001u, 0x3F800000u};
  const uint32_t new_bits[] = {0x80000000u, 0x7FA00005u, 0x7FC00000u};
  std::vector<std::byte> old_bytes(sizeof(old_bits));
  std::vector<std::byte> new_bytes(sizeof(new_bits));
  std::memcpy(old_bytes.data(), old_bits, sizeof(old_bits));
  std::memcpy(new_bytes.data(), new_bits, sizeof(new_bits));
  ASSERT_OK_AND_ASSIGN(OpValues values, MakeOpValues(Op::kXor, DType::kFloat32, DType::kFloat32,
                                                     old_bytes, new_bytes, {0, 1, 2}));
  std::vector<std::byte> tensor = old_bytes;
  ApplyOpValues(Op::kXor, DType::kFloat32, DType::kFloat32, tensor, values.locations, values.values,
                nullptr);
  EXPECT_EQ(tensor, new_bytes);
}

TEST(ValuesTest, MakeOpValuesRejectsBadArguments) {
  const std::vector<std::byte> four(4);
  const std::vector<std::byte> six(6);
  EXPECT_STATUS_MSG(InvalidArgument, "full",
                    MakeOpValues(Op::kFull, DType::kInt16, DType::kInt16, four, four, {}));
  EXPECT_STATUS_MSG(InvalidArgument, "old has 4 bytes and new 6",
                    MakeOpValues(Op::kXor, DType::kInt16, DType::kInt16, four, six, {}));
  EXPECT_STATUS_MSG(InvalidArgument, "multiples of 4",
                    MakeOpValues(Op::kXor, DType::kFloat32, DType::kFloat32, six, six, {}));
  EXPECT_STATUS_MSG(InvalidArgument, "value dtype",
                    MakeOpValues(Op::kOverwrite, DType::kInt16, DType::kBFloat16, four, four, {}));
  EXPECT_STATUS_MSG(InvalidArgument, "location #1 = 2 >= numel 2",
                    MakeOpValues(Op::kXor, DType::kInt16, DType::kInt16, four, four, {0, 2}));
  EXPECT_STATUS_MSG(InvalidArgument, "add is not defined for a int16 tensor",
                    MakeOpValues(Op::kAdd, DType::kInt16, DType::kInt16, four, four, {}));
  EXPECT_STATUS_MSG(InvalidArgument, "with int8 deltas",
                    MakeOpValues(Op::kAdd, DType::kFloat32, DType::kInt8, four, four, {}));
  EXPECT_STATUS(InvalidArgument,
                MakeOpValues(static_cast<Op>(9), DType::kInt16, DType::kInt16, four, four, {}));
}

// ---------------------------------------------------------------------------------------------
// ADD

TEST(ValuesTest, AddSupportedOnlyForTheFourFloatFormats) {
  for (const DTypeInfo& a : AllDTypes()) {
    for (const DTypeInfo& b : AllDTypes()) {
      const bool expected =
          std::find(std::begin(kAddDTypes), std::end(kAddDTypes), a.dtype) !=
              std::end(kAddDTypes) &&
          std::find(std::begin(kAddDTypes), std::end(kAddDTypes), b.dtype) != std::end(kAddDTypes);
      EXPECT_EQ(AddSupported(a.dtype, b.dtype), expected) << a.name << " + " << b.name;
    }
  }
}

uint64_t Bf16(double value) { return DoubleToBFloat16(value); }
uint64_t F32(float value) { return std::bit_cast<uint32_t>(value); }

TEST(ValuesTest, AddExactKnownAnswers) {
  // 1 + 2^-8 is a bfloat16 tie between 1 and 1 + 2^-7: even → 1.
  EXPECT_EQ(AddExact(DType::kBFloat16, DType::kBFloat16, Bf16(1.0), Bf16(0x1p-8)), Bf16(1.0));
  EXPECT_EQ(AddExact(DType::kBFloat16, DType::kBFloat16, Bf16(1.0), Bf16(0x1p-7)),
            Bf16(1.0 + 0x1p-7));
  // A float32 delta on a bfloat16 tensor: 1 + 2^-8 + 2^-20 is above the tie → rounds up.
  EXPECT_EQ(AddExact(DType::kBFloat16, DType::kFloat32, Bf16(1.0), F32(0x1p-8f + 0x1p-20f)),
            Bf16(1.0 + 0x1p-7));
  // A bfloat16 delta on a float32 tensor is exact here.
  EXPECT_EQ(AddExact(DType::kFloat32, DType::kBFloat16, F32(1.0f), Bf16(0x1p-23)),
            F32(1.0f + 0x1p-23f));
  // float64: the sum rounds once.
  EXPECT_EQ(AddExact(DType::kFloat64, DType::kFloat64, std::bit_cast<uint64_t>(1.0),
                     std::bit_cast<uint64_t>(0x1p-53)),
            std::bit_cast<uint64_t>(1.0));
  // float16 overflow → +Inf.
  EXPECT_EQ(AddExact(DType::kFloat16, DType::kFloat16, 0x7BFF, 0x7BFF), 0x7C00u);
  EXPECT_EQ(AddDelta(DType::kBFloat16, DType::kBFloat16, Bf16(1.0), Bf16(1.0 + 0x1p-7)),
            Bf16(0x1p-7));
}

TEST(ValuesTest, AddExactMatchesReferenceRoundingForEveryBFloat16AndHalf) {
  // Every old value × a sample of deltas (including exact halves of ulps and specials), against
  // an independent narrowing of the float64 sum.
  std::mt19937_64 rng(5);
  std::vector<uint16_t> deltas = {0x0000, 0x8000, 0x0001, 0x8001, 0x7C00, 0xFC00, 0x3C00, 0x7F80};
  for (int i = 0; i < 120; ++i) deltas.push_back(static_cast<uint16_t>(rng()));
  for (uint32_t old_bits = 0; old_bits <= 0xFFFF; ++old_bits) {
    const auto old16 = static_cast<uint16_t>(old_bits);
    for (const uint16_t delta : deltas) {
      const double bf_sum =
          static_cast<double>(BFloat16ToFloat(old16)) + static_cast<double>(BFloat16ToFloat(delta));
      const auto bf =
          static_cast<uint16_t>(AddExact(DType::kBFloat16, DType::kBFloat16, old16, delta));
      if (std::isnan(bf_sum)) {
        ASSERT_TRUE(IsBFloat16NaN(bf));
      } else {
        ASSERT_EQ(bf, ReferenceBFloat16(bf_sum)) << std::hex << old_bits << " + " << delta;
      }
      if (!kHaveFloat16) continue;
      const double half_sum =
          static_cast<double>(HalfToFloat(old16)) + static_cast<double>(HalfToFloat(delta));
      const auto half =
          static_cast<uint16_t>(AddExact(DType::kFloat16, DType::kFloat16, old16, delta));
      if (std::isnan(half_sum)) {
        ASSERT_TRUE(IsHalfNaN(half));
      } else {
        ASSERT_EQ(half, CompilerHalf(half_sum)) << std::hex << old_bits << " + " << delta;
      }
    }
  }
}

// Store `bits` of the given widths into little-endian byte vectors.
template <typename T>
std::vector<std::byte> BytesOf(const std::vector<T>& elements) {
  std::vector<std::byte> bytes(elements.size() * sizeof(T));
  std::memcpy(bytes.data(), elements.data(), bytes.size());
  return bytes;
}

TEST(ValuesTest, AddDemotesWhereRoundingBreaksExactness) {
  const uint16_t one = 0x3F80;  // bfloat16 1.0
  const std::vector<uint16_t> old_bits = {one,    one,    0x0000, 0x8000, 0x3F80,
                                          0x7F80, 0x7F80, 0x3F80, 0x7FC0, 0x3F80};
  const std::vector<uint16_t> new_bits = {
      0x3F81,                                            // 1 → 1 + 2^-7: exact.
      static_cast<uint16_t>(DoubleToBFloat16(0x1p-10)),  // 1 → 2^-10: the delta rounds, demoted.
      0x8000,                                            // +0 → -0: +0 + -0 = +0, demoted.
      0x0000,                                            // -0 → +0: -0 + +0 = +0, exact.
      0x7F80,                                            // 1 → +Inf: delta +Inf, exact.
      0x7F80,                                            // +Inf → +Inf: Inf - Inf, demoted.
      0x3F80,                                            // +Inf → 1: Inf - Inf, demoted.
      0x7FC1,                                            // 1 → NaN: demoted.
      0x3F80,                                            // NaN → 1: demoted.
      0xBF80,                                            // 1 → -1: exact.
  };
  const std::vector<uint64_t> locations = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<std::byte> old_bytes = BytesOf(old_bits);
  const std::vector<std::byte> new_bytes = BytesOf(new_bits);
  ASSERT_OK_AND_ASSIGN(OpValues values, MakeOpValues(Op::kAdd, DType::kBFloat16, DType::kBFloat16,
                                                     old_bytes, new_bytes, locations));
  EXPECT_EQ(values.locations, (std::vector<uint64_t>{0, 3, 4, 9}));
  EXPECT_EQ(values.demoted_locations, (std::vector<uint64_t>{1, 2, 5, 6, 7, 8}));
  ASSERT_EQ(values.values.size(), 4 * sizeof(uint16_t));
  EXPECT_EQ(LoadBits(values.values, 2, 0), 0x3C00u);  // 2^-7 in bfloat16.
  ASSERT_EQ(values.demoted_values.size(), 6 * sizeof(uint16_t));
  for (size_t i = 0; i < values.demoted_locations.size(); ++i) {
    EXPECT_EQ(LoadBits(values.demoted_values, 2, i), new_bits[values.demoted_locations[i]]);
  }
  std::vector<std::byte> tensor = old_bytes;
  std::vector<std::byte> undo;
  ApplyOpValues(Op::kAdd, DType::kBFloat16, DType::kBFloat16, tensor, values.locations,
                values.values, &undo);
  ApplyOpValues(Op::kOverwrite, DType::kBFloat16, DType::kBFloat16, tensor,
                values.demoted_locations, values.demoted_values, &undo);
  EXPECT_EQ(tensor, new_bytes);
  ASSERT_EQ(undo.size(), 10 * sizeof(uint16_t));
  EXPECT_EQ(LoadBits(undo, 2, 0), old_bits[0]);
}

TEST(ValuesTest, AddWithANarrowerDeltaDemotesUnrepresentableDeltas) {
  // float32 tensor, bfloat16 deltas: a delta of 3 ulps fits in bfloat16, 257 ulps does not.
  const std::vector<float> old_values = {1.0f, 1.0f, 1.0f};
  const std::vector<float> new_values = {1.0f + 3 * 0x1p-23f, 1.0f + 257 * 0x1p-23f, 1.0f};
  ASSERT_OK_AND_ASSIGN(OpValues values,
                       MakeOpValues(Op::kAdd, DType::kFloat32, DType::kBFloat16,
                                    BytesOf(old_values), BytesOf(new_values), {0, 1, 2}));
  EXPECT_EQ(values.locations, (std::vector<uint64_t>{0, 2}));
  EXPECT_EQ(values.demoted_locations, (std::vector<uint64_t>{1}));
  EXPECT_EQ(values.values.size(), 2 * sizeof(uint16_t));   // bfloat16 deltas.
  EXPECT_EQ(values.demoted_values.size(), sizeof(float));  // float32 new bits.
  EXPECT_EQ(LoadBits(values.demoted_values, 4, 0), F32(new_values[1]));
}

// Random ADD round trips over every dtype pairing: old values, new = old + a small step in the
// tensor's format; ADD where exact plus OVERWRITE of the demoted must reproduce new bit for bit.
TEST(ValuesTest, AddRoundTripsOverEveryPairing) {
  for (const DType dtype : kAddDTypes) {
    for (const DType delta_dtype : kAddDTypes) {
      SCOPED_TRACE(fmt::format("{} + {}", DTypeName(dtype), DTypeName(delta_dtype)));
      const uint32_t width = DTypeSize(dtype);
      std::mt19937_64 rng(static_cast<uint64_t>(dtype) * 16 + static_cast<uint64_t>(delta_dtype));
      const uint64_t numel = 4000;
      std::vector<std::byte> old_bytes(numel * width);
      std::vector<std::byte> new_bytes(numel * width);
      std::vector<uint64_t> locations;
      std::normal_distribution<double> normal(0.0, 1.0);
      for (uint64_t i = 0; i < numel; ++i) {
        // Encode a double into the tensor format by narrowing via AddExact(0 + value).
        const double value = normal(rng) * std::ldexp(1.0, static_cast<int>(rng() % 8) - 4);
        const uint64_t zero = 0;
        const uint64_t wide = std::bit_cast<uint64_t>(value);
        const uint64_t old_bits = AddExact(dtype, DType::kFloat64, zero, wide);
        uint64_t new_bits = old_bits;
        if (rng() % 4 != 0) {
          // A step that the delta dtype can carry (narrowed through 0 + step), as an optimizer
          // update seen through the delta format would be.
          const double step = value * std::ldexp(1.0, -static_cast<int>(rng() % 30));
          const uint64_t step_bits =
              AddExact(delta_dtype, DType::kFloat64, zero, std::bit_cast<uint64_t>(step));
          new_bits = AddExact(dtype, delta_dtype, old_bits, step_bits);
          if (rng() % 50 == 0) new_bits = old_bits ^ 1;  // A raw 1-ulp flip.
        }
        StoreBits(old_bytes, width, i, old_bits);
        StoreBits(new_bytes, width, i, new_bits);
        if (new_bits != old_bits) locations.push_back(i);
      }
      ASSERT_OK_AND_ASSIGN(OpValues values, MakeOpValues(Op::kAdd, dtype, delta_dtype, old_bytes,
                                                         new_bytes, locations));
      EXPECT_EQ(values.locations.size() + values.demoted_locations.size(), locations.size());
      EXPECT_GT(values.locations.size(), locations.size() / 4) << "ADD should mostly apply";
      ASSERT_EQ(values.values.size(), values.locations.size() * DTypeSize(delta_dtype));
      for (size_t i = 0; i < values.locations.size(); ++i) {
        const uint64_t location = values.locations[i];
        ASSERT_EQ(AddExact(dtype, delta_dtype, LoadBits(old_bytes, width, location),
                           LoadBits(values.values, DTypeSize(delta_dtype), i)),
                  LoadBits(new_bytes, width, location));
      }
      std::vector<std::byte> tensor = old_bytes;
      std::vector<std::byte> undo;
      ApplyOpValues(Op::kAdd, dtype, delta_dtype, tensor, values.locations, values.values, &undo);
      ApplyOpValues(Op::kOverwrite, dtype, dtype, tensor, values.demoted_locations,
                    values.demoted_values, &undo);
      EXPECT_EQ(tensor, new_bytes);
      EXPECT_EQ(undo.size(), locations.size() * width);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Byte planes

TEST(ValuesTest, SplitBytePlanesLayout) {
  const std::vector<std::byte> values = {std::byte{0x11}, std::byte{0x12}, std::byte{0x21},
                                         std::byte{0x22}, std::byte{0x31}, std::byte{0x32}};
  std::vector<std::byte> planes = {std::byte{0xFF}};  // Appended to.
  SplitBytePlanes(values, 2, &planes);
  EXPECT_EQ(planes, (std::vector<std::byte>{std::byte{0xFF}, std::byte{0x11}, std::byte{0x21},
                                            std::byte{0x31}, std::byte{0x12}, std::byte{0x22},
                                            std::byte{0x32}}));
}

TEST(ValuesTest, BytePlanesRoundTripForEveryWidthAndLength) {
  std::mt19937_64 rng(3);
  for (const uint32_t width : {1u, 2u, 4u, 8u}) {
    for (const size_t count : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{63},
                               size_t{64}, size_t{65}, size_t{1000}, size_t{4099}}) {
      SCOPED_TRACE(fmt::format("width {} count {}", width, count));
      std::vector<std::byte> values(count * width);
      for (std::byte& b : values) b = static_cast<std::byte>(rng());
      std::vector<std::byte> planes;
      SplitBytePlanes(values, width, &planes);
      ASSERT_EQ(planes.size(), values.size());
      for (size_t i = 0; i < count; ++i) {
        for (uint32_t plane = 0; plane < width; ++plane) {
          ASSERT_EQ(planes[plane * count + i], values[i * width + plane]);
        }
      }
      std::vector<std::byte> joined(values.size());
      JoinBytePlanes(planes, width, joined);
      EXPECT_EQ(joined, values);
    }
  }
}

}  // namespace
}  // namespace refit
