// Exact conversions between IEEE binary16 / bfloat16 bit patterns and float / double, with
// round-to-nearest-even in the narrowing direction. Bit-level and portable: no reliance on
// compiler _Float16 / __bf16 support, so results are identical on every build.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace refit {

/// Widen bfloat16 bits to float (exact).
inline float BFloat16ToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

/// Widen binary16 bits to float (exact, including subnormals, infinities and NaN payloads).
inline float HalfToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1Fu;
  uint32_t mantissa = bits & 0x3FFu;
  if (exponent == 0x1F) {  // Inf / NaN: keep the payload in the top mantissa bits.
    return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));
  }
  if (exponent == 0) {
    if (mantissa == 0) return std::bit_cast<float>(sign);
    // Subnormal: value = mantissa · 2^-24, exactly representable in float.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

/// Narrow a double to bfloat16 bits with round-to-nearest-even. NaN stays a (quiet) NaN with
/// the sign kept; overflow rounds to ±Inf as IEEE prescribes.
inline uint16_t DoubleToBFloat16(double value) {
  if (std::isnan(value)) {
    return static_cast<uint16_t>((std::signbit(value) ? 0x8000u : 0u) | 0x7FC0u);
  }
  // double → float can round once; a second RNE to bfloat16 could then double-round. Avoid it by
  // rounding the double directly: bfloat16 keeps 8 significant bits, so work on the double's
  // bits, whose 52-bit mantissa holds any bfloat16 neighbourhood exactly.
  const float as_float = static_cast<float>(value);  // Exact when the double came from float.
  if (static_cast<double>(as_float) == value) {
    const uint32_t f = std::bit_cast<uint32_t>(as_float);
    if ((f & 0x7F800000u) == 0x7F800000u) return static_cast<uint16_t>(f >> 16);  // ±Inf
    const uint32_t rounding_bias = 0x7FFFu + ((f >> 16) & 1u);
    return static_cast<uint16_t>((f + rounding_bias) >> 16);
  }
  // General case: find the two bfloat16 neighbours by truncating toward zero through float
  // (round-toward-zero cannot double-round), then pick by exact comparison in double.
  const double magnitude = std::fabs(value);
  const bool negative = std::signbit(value);
  if (magnitude >= 0x1.FFp127) {  // ≥ halfway between max bfloat16 and 2^128: ties to even = Inf.
    return negative ? 0xFF80u : 0x7F80u;
  }
  float truncated = static_cast<float>(magnitude);
  if (static_cast<double>(truncated) > magnitude) {
    truncated = std::nextafter(truncated, 0.0f);
  }
  const uint16_t low = static_cast<uint16_t>(std::bit_cast<uint32_t>(truncated) >> 16);
  const uint16_t high = static_cast<uint16_t>(low + 1);
  const double low_value = static_cast<double>(BFloat16ToFloat(low));
  const double high_value = static_cast<double>(BFloat16ToFloat(high));
  uint16_t chosen;
  const double to_low = magnitude - low_value;
  const double to_high = high_value - magnitude;
  if (to_low < to_high) {
    chosen = low;
  } else if (to_high < to_low) {
    chosen = high;
  } else {
    chosen = (low & 1u) ? high : low;
  }
  return static_cast<uint16_t>(chosen | (negative ? 0x8000u : 0u));
}

/// Narrow a float to bfloat16 bits with round-to-nearest-even.
inline uint16_t FloatToBFloat16(float value) {
  return DoubleToBFloat16(static_cast<double>(value));
}

/// Narrow a double to binary16 bits with round-to-nearest-even (subnormals and overflow to ±Inf
/// handled as IEEE 754 prescribes; NaN becomes a quiet NaN with the sign kept).
inline uint16_t DoubleToHalf(double value) {
  const uint16_t sign = std::signbit(value) ? 0x8000u : 0u;
  if (std::isnan(value)) return static_cast<uint16_t>(sign | 0x7E00u);
  const double magnitude = std::fabs(value);
  // 65520 = halfway between max half (65504) and 2^16: at or above it rounds to infinity.
  if (magnitude >= 65520.0) return static_cast<uint16_t>(sign | 0x7C00u);
  if (magnitude == 0.0) return sign;
  // Scale so the half's unit in the last place becomes 1, round to an integer with RNE (exact in
  // double: the scaled value is < 2^11 · 2 and carries ≤ 53 significant bits), rebuild the bits.
  int exponent;
  std::frexp(magnitude, &exponent);  // magnitude = m · 2^exponent, m ∈ [0.5, 1)
  // Half normals have exponents e ∈ [-14, 15] with value in [2^e, 2^(e+1)); ulp = 2^(e-10).
  int unbiased = exponent - 1;
  if (unbiased < -14) unbiased = -14;  // Subnormal range shares the minimum normal's ulp.
  const double ulp = std::ldexp(1.0, unbiased - 10);
  const double scaled = magnitude / ulp;    // Exact: division by a power of two.
  double rounded = std::nearbyint(scaled);  // Default rounding mode: nearest-even.
  uint32_t units = static_cast<uint32_t>(rounded);
  // units ∈ [0, 2048]; 2048 means the value rounded up into the next binade.
  uint32_t biased_exponent;
  uint32_t mantissa;
  if (unbiased == -14 && units < 1024) {
    biased_exponent = 0;  // Subnormal (or zero).
    mantissa = units;
  } else {
    if (units == 2048) {
      units = 1024;
      ++unbiased;
    }
    if (unbiased > 15) return static_cast<uint16_t>(sign | 0x7C00u);
    biased_exponent = static_cast<uint32_t>(unbiased + 15);
    mantissa = units - 1024;
  }
  return static_cast<uint16_t>(sign | (biased_exponent << 10) | mantissa);
}

/// Narrow a float to binary16 bits with round-to-nearest-even.
inline uint16_t FloatToHalf(float value) { return DoubleToHalf(static_cast<double>(value)); }

}  // namespace refit
