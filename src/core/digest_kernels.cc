// ElementHash (digest.h) is two rounds of a 64-bit multiply-xorshift mixer with no memory
// access, so the digest of a run is bound by arithmetic: about 3–5 ns per element in scalar code,
// which made hashing — not copying — the cost of an anchor (two passes over the model). The same
// mixer runs on 8 lanes with AVX-512DQ (vpmullq) and on 4 with AVX2 (each 64-bit multiply made of
// 32-bit ones by the compiler). A sum mod 2^64 does not depend on the order of its terms, so every
// kernel returns the scalar value bit for bit.
//
// The kernels are compiled per target with function target attributes (their helpers are
// inlined into them, so no vector crosses a call and no ABI depends on the target) and chosen once,
// at run time, by what the CPU reports.
#include "core/digest_kernels.h"

#include <cstdlib>
#include <cstring>
#include <optional>

#if defined(__x86_64__)
// GCC 12 reports the deliberately undefined pass-through operand of its AVX-512 conversion
// intrinsics (_mm512_undefined_epi32) as maybe uninitialized where they are inlined.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

#include "core/digest.h"

namespace refit::internal {
namespace {

constexpr uint64_t kIndexOffset = 0x9e3779b97f4a7c15ULL;
constexpr uint64_t kMix1 = 0xbf58476d1ce4e5b9ULL;
constexpr uint64_t kMix2 = 0x94d049bb133111ebULL;

template <typename Word>
uint64_t ScalarRun(const std::byte* data, uint64_t first_index, uint64_t count) {
  uint64_t sum = 0;
  for (uint64_t k = 0; k < count; ++k) {
    Word word;
    std::memcpy(&word, data + k * sizeof(Word), sizeof(Word));
    sum += ElementHash(first_index + k, static_cast<uint64_t>(word));
  }
  return sum;
}

uint64_t ScalarChange(const uint64_t* index, const uint64_t* now, const uint64_t* before,
                      uint64_t count) {
  uint64_t sum = 0;
  for (uint64_t k = 0; k < count; ++k) sum += ElementHashChange(index[k], before[k], now[k]);
  return sum;
}

#if defined(__x86_64__)
#define REFIT_AVX512 __attribute__((target("avx512f,avx512dq"), always_inline)) inline
#define REFIT_AVX2 __attribute__((target("avx2"), always_inline)) inline

// AVX-512: 8 elements zero-extended to 64-bit lanes, and the mixer (vpmullq).
template <typename Word>
REFIT_AVX512 __m512i LoadWords512(const std::byte* at) {
  if constexpr (sizeof(Word) == 1) {
    return _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
  } else if constexpr (sizeof(Word) == 2) {
    return _mm512_cvtepu16_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  } else if constexpr (sizeof(Word) == 4) {
    return _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
  } else {
    return _mm512_loadu_si512(at);
  }
}

REFIT_AVX512 __m512i Mix512(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 30));
  x = _mm512_mullo_epi64(x, _mm512_set1_epi64(static_cast<int64_t>(kMix1)));
  x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 27));
  x = _mm512_mullo_epi64(x, _mm512_set1_epi64(static_cast<int64_t>(kMix2)));
  return _mm512_xor_si512(x, _mm512_srli_epi64(x, 31));
}

// AVX2: 4 elements, and a 64-bit multiply by a constant made of three 32-bit ones (AVX2 has no
// 64-bit multiply): lo·lo + ((hi·lo + lo·hi) << 32) mod 2^64.
template <typename Word>
REFIT_AVX2 __m256i LoadWords256(const std::byte* at) {
  if constexpr (sizeof(Word) == 1) {
    int32_t word;
    std::memcpy(&word, at, sizeof(word));
    return _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(word));
  } else if constexpr (sizeof(Word) == 2) {
    return _mm256_cvtepu16_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
  } else if constexpr (sizeof(Word) == 4) {
    return _mm256_cvtepu32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  }
}

REFIT_AVX2 __m256i MulConst256(__m256i x, __m256i lo, __m256i hi) {
  const __m256i low = _mm256_mul_epu32(x, lo);
  const __m256i cross =
      _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), lo), _mm256_mul_epu32(x, hi));
  return _mm256_add_epi64(low, _mm256_slli_epi64(cross, 32));
}

REFIT_AVX2 __m256i Load256(const uint64_t* from) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
}

REFIT_AVX2 __m256i Mix256(__m256i x) {
  const __m256i lo1 = _mm256_set1_epi64x(static_cast<int64_t>(kMix1 & 0xffffffffULL));
  const __m256i hi1 = _mm256_set1_epi64x(static_cast<int64_t>(kMix1 >> 32));
  const __m256i lo2 = _mm256_set1_epi64x(static_cast<int64_t>(kMix2 & 0xffffffffULL));
  const __m256i hi2 = _mm256_set1_epi64x(static_cast<int64_t>(kMix2 >> 32));
  x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 30));
  x = MulConst256(x, lo1, hi1);
  x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 27));
  x = MulConst256(x, lo2, hi2);
  return _mm256_xor_si256(x, _mm256_srli_epi64(x, 31));
}

// Four vectors per iteration, each with its own indices and sum: independent chains keep the
// multipliers busy.
template <typename Word>
__attribute__((target("avx512f,avx512dq"))) uint64_t Avx512Run(const std::byte* data,
                                                               uint64_t first_index,
                                                               uint64_t count) {
  constexpr uint64_t kLanes = 8;
  constexpr uint64_t kStep = 4 * kLanes;
  const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i step = _mm512_set1_epi64(static_cast<int64_t>(kStep));
  __m512i index[4];
  __m512i sum[4];
  for (uint64_t u = 0; u < 4; ++u) {
    index[u] = _mm512_add_epi64(
        lane, _mm512_set1_epi64(static_cast<int64_t>(first_index + kIndexOffset + u * kLanes)));
    sum[u] = _mm512_setzero_si512();
  }
  uint64_t k = 0;
  for (; k + kStep <= count; k += kStep) {
    for (uint64_t u = 0; u < 4; ++u) {
      const __m512i bits = LoadWords512<Word>(data + (k + u * kLanes) * sizeof(Word));
      sum[u] = _mm512_add_epi64(sum[u], Mix512(_mm512_xor_si512(Mix512(index[u]), bits)));
      index[u] = _mm512_add_epi64(index[u], step);
    }
  }
  const __m512i total =
      _mm512_add_epi64(_mm512_add_epi64(sum[0], sum[1]), _mm512_add_epi64(sum[2], sum[3]));
  alignas(64) uint64_t lanes[kLanes];
  _mm512_store_si512(lanes, total);
  uint64_t reduced = 0;
  for (const uint64_t value : lanes) reduced += value;
  return reduced + ScalarRun<Word>(data + k * sizeof(Word), first_index + k, count - k);
}

template <typename Word>
__attribute__((target("avx2"))) uint64_t Avx2Run(const std::byte* data, uint64_t first_index,
                                                 uint64_t count) {
  constexpr uint64_t kLanes = 4;
  constexpr uint64_t kStep = 4 * kLanes;
  const __m256i lane = _mm256_set_epi64x(3, 2, 1, 0);
  const __m256i step = _mm256_set1_epi64x(static_cast<int64_t>(kStep));
  __m256i index[4];
  __m256i sum[4];
  for (uint64_t u = 0; u < 4; ++u) {
    index[u] = _mm256_add_epi64(
        lane, _mm256_set1_epi64x(static_cast<int64_t>(first_index + kIndexOffset + u * kLanes)));
    sum[u] = _mm256_setzero_si256();
  }
  uint64_t k = 0;
  for (; k + kStep <= count; k += kStep) {
    for (uint64_t u = 0; u < 4; ++u) {
      const __m256i bits = LoadWords256<Word>(data + (k + u * kLanes) * sizeof(Word));
      sum[u] = _mm256_add_epi64(sum[u], Mix256(_mm256_xor_si256(Mix256(index[u]), bits)));
      index[u] = _mm256_add_epi64(index[u], step);
    }
  }
  const __m256i total =
      _mm256_add_epi64(_mm256_add_epi64(sum[0], sum[1]), _mm256_add_epi64(sum[2], sum[3]));
  alignas(32) uint64_t lanes[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] +
         ScalarRun<Word>(data + k * sizeof(Word), first_index + k, count - k);
}

// The change of scattered elements: each index mixed once, then both bit patterns with it; two
// vectors per iteration keep two independent chains in flight.
__attribute__((target("avx512f,avx512dq"))) uint64_t Avx512Change(const uint64_t* index,
                                                                  const uint64_t* now,
                                                                  const uint64_t* before,
                                                                  uint64_t count) {
  constexpr uint64_t kLanes = 8;
  const __m512i offset = _mm512_set1_epi64(static_cast<int64_t>(kIndexOffset));
  __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  uint64_t k = 0;
  for (; k + 2 * kLanes <= count; k += 2 * kLanes) {
    for (uint64_t u = 0; u < 2; ++u) {
      const uint64_t at = k + u * kLanes;
      const __m512i mixed = Mix512(_mm512_add_epi64(_mm512_loadu_si512(index + at), offset));
      const __m512i after = Mix512(_mm512_xor_si512(mixed, _mm512_loadu_si512(now + at)));
      const __m512i prior = Mix512(_mm512_xor_si512(mixed, _mm512_loadu_si512(before + at)));
      sum[u] = _mm512_add_epi64(sum[u], _mm512_sub_epi64(after, prior));
    }
  }
  alignas(64) uint64_t lanes[kLanes];
  _mm512_store_si512(lanes, _mm512_add_epi64(sum[0], sum[1]));
  uint64_t reduced = 0;
  for (const uint64_t value : lanes) reduced += value;
  return reduced + ScalarChange(index + k, now + k, before + k, count - k);
}

__attribute__((target("avx2"))) uint64_t Avx2Change(const uint64_t* index, const uint64_t* now,
                                                    const uint64_t* before, uint64_t count) {
  constexpr uint64_t kLanes = 4;
  const __m256i offset = _mm256_set1_epi64x(static_cast<int64_t>(kIndexOffset));
  __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  uint64_t k = 0;
  for (; k + 2 * kLanes <= count; k += 2 * kLanes) {
    for (uint64_t u = 0; u < 2; ++u) {
      const uint64_t at = k + u * kLanes;
      const __m256i mixed = Mix256(_mm256_add_epi64(Load256(index + at), offset));
      const __m256i after = Mix256(_mm256_xor_si256(mixed, Load256(now + at)));
      const __m256i prior = Mix256(_mm256_xor_si256(mixed, Load256(before + at)));
      sum[u] = _mm256_add_epi64(sum[u], _mm256_sub_epi64(after, prior));
    }
  }
  alignas(32) uint64_t lanes[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(sum[0], sum[1]));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] +
         ScalarChange(index + k, now + k, before + k, count - k);
}

#undef REFIT_AVX512
#undef REFIT_AVX2
#endif  // __x86_64__

enum class Target { kScalar, kAvx2, kAvx512 };

Target BestTarget() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
    return Target::kAvx512;
  }
  if (__builtin_cpu_supports("avx2")) return Target::kAvx2;
#endif
  return Target::kScalar;
}

std::optional<Target> ParseTarget(std::string_view name) {
  if (name == "avx512") return Target::kAvx512;
  if (name == "avx2") return Target::kAvx2;
  if (name == "scalar") return Target::kScalar;
  return std::nullopt;
}

const Target kSupported = BestTarget();

// The CPU's best kernel, or a lesser one that REFIT_DIGEST_TARGET names (a benchmark's "before":
// the same binary with the scalar digest). A name the CPU cannot run, or no name, is ignored.
Target ChosenTarget() {
  const char* named = std::getenv("REFIT_DIGEST_TARGET");
  if (named == nullptr) return kSupported;
  const std::optional<Target> parsed = ParseTarget(named);
  return parsed.has_value() && *parsed <= kSupported ? *parsed : kSupported;
}

const Target kBest = ChosenTarget();

template <typename Word>
uint64_t RunOn(Target target, const std::byte* data, uint64_t first_index, uint64_t count) {
  switch (target) {
#if defined(__x86_64__)
    case Target::kAvx512:
      return Avx512Run<Word>(data, first_index, count);
    case Target::kAvx2:
      return Avx2Run<Word>(data, first_index, count);
#endif
    default:
      return ScalarRun<Word>(data, first_index, count);
  }
}

uint64_t Dispatch(Target target, const std::byte* data, uint32_t width, uint64_t first_index,
                  uint64_t count) {
  switch (width) {
    case 1:
      return RunOn<uint8_t>(target, data, first_index, count);
    case 2:
      return RunOn<uint16_t>(target, data, first_index, count);
    case 4:
      return RunOn<uint32_t>(target, data, first_index, count);
    default:
      return RunOn<uint64_t>(target, data, first_index, count);
  }
}

uint64_t DispatchChange(Target target, const uint64_t* index, const uint64_t* now,
                        const uint64_t* before, uint64_t count) {
  switch (target) {
#if defined(__x86_64__)
    case Target::kAvx512:
      return Avx512Change(index, now, before, count);
    case Target::kAvx2:
      return Avx2Change(index, now, before, count);
#endif
    default:
      return ScalarChange(index, now, before, count);
  }
}

}  // namespace

uint64_t DigestChangeRun(const uint64_t* index, const uint64_t* now, const uint64_t* before,
                         uint64_t count) {
  return DispatchChange(kBest, index, now, before, count);
}

uint64_t DigestRun(const std::byte* data, uint32_t width, uint64_t first_index, uint64_t count) {
  return Dispatch(kBest, data, width, first_index, count);
}

std::string_view DigestTargetName() {
  switch (kBest) {
    case Target::kAvx512:
      return "avx512";
    case Target::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

bool DigestTargetSupported(std::string_view target) {
  const std::optional<Target> parsed = ParseTarget(target);
  return parsed.has_value() && *parsed <= kSupported;
}

uint64_t DigestRunOn(std::string_view target, const std::byte* data, uint32_t width,
                     uint64_t first_index, uint64_t count) {
  return Dispatch(ParseTarget(target).value_or(Target::kScalar), data, width, first_index, count);
}

uint64_t DigestChangeRunOn(std::string_view target, const uint64_t* index, const uint64_t* now,
                           const uint64_t* before, uint64_t count) {
  return DispatchChange(ParseTarget(target).value_or(Target::kScalar), index, now, before, count);
}

}  // namespace refit::internal
