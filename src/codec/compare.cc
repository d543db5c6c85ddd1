// Bitwise comparison front end: argument checks and multi-threaded chunking around the kernels
// of compare_kernels.cc.

#include "codec/compare.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

#include "codec/compare_kernels.h"
#include "refit/status_format.h"
#include "util/check.h"

namespace refit {
namespace {

bool IsSupportedWidth(uint32_t width) {
  return width == 1 || width == 2 || width == 4 || width == 8;
}

Status CheckCompareArguments(std::span<const std::byte> old_bytes,
                             std::span<const std::byte> new_bytes, uint32_t width, uint64_t begin,
                             uint64_t end, const CompareOptions& options) {
  if (!IsSupportedWidth(width)) {
    return InvalidArgument("compare: element width {} is not 1, 2, 4 or 8", width);
  }
  if (old_bytes.size() != new_bytes.size()) {
    return InvalidArgument("compare: old tensor has {} bytes but new tensor has {} bytes",
                           old_bytes.size(), new_bytes.size());
  }
  if (old_bytes.size() % width != 0) {
    return InvalidArgument("compare: tensor size {} bytes is not a multiple of element width {}",
                           old_bytes.size(), width);
  }
  const uint64_t numel = old_bytes.size() / width;
  if (begin > end || end > numel) {
    return InvalidArgument("compare: range [{}, {}) is not inside the tensor's {} elements", begin,
                           end, numel);
  }
  if (options.threads < 1) {
    return InvalidArgument("compare: threads {} is less than 1", options.threads);
  }
  if (options.chunk_elements == 0) {
    return InvalidArgument("compare: chunk_elements is 0");
  }
  return Status::OK();
}

}  // namespace

std::string_view BestCompareTarget() { return internal::DispatchedCompareTarget(); }

void AppendChangedLocations(std::span<const std::byte> old_bytes,
                            std::span<const std::byte> new_bytes, uint32_t width, uint64_t begin,
                            uint64_t end, std::vector<uint64_t>* out, CompareKernel kernel) {
  REFIT_DCHECK(IsSupportedWidth(width), "AppendChangedLocations: width not in {1, 2, 4, 8}");
  REFIT_DCHECK(out != nullptr, "AppendChangedLocations: null output vector");
  REFIT_DCHECK(begin <= end && end <= old_bytes.size() / width && end <= new_bytes.size() / width,
               "AppendChangedLocations: range outside the tensors");
  if (kernel == CompareKernel::kScalar) {
    internal::AppendChangedScalar(old_bytes.data(), new_bytes.data(), width, begin, end, out);
  } else {
    internal::AppendChangedSimd(old_bytes.data(), new_bytes.data(), width, begin, end, out);
  }
}

namespace {

/// Elements compared before sizing the output: enough to estimate densities down to ~0.01 %.
constexpr uint64_t kReserveSampleElements = uint64_t{1} << 16;
/// Head-room over the sampled density, so that most tensors need no second allocation.
constexpr double kReserveHeadroom = 1.25;

/// AppendChangedLocations, but sized once: growing a vector of millions of locations by doubling
/// copies it and faults in fresh pages several times over, which costs as much as the compare.
/// A prefix sample predicts the final size well in practice (changes are spread evenly).
void AppendChangedLocationsReserved(std::span<const std::byte> old_bytes,
                                    std::span<const std::byte> new_bytes, uint32_t width,
                                    uint64_t begin, uint64_t end, std::vector<uint64_t>* out,
                                    CompareKernel kernel) {
  const size_t before = out->size();
  const uint64_t sample_end = begin + std::min(end - begin, kReserveSampleElements);
  AppendChangedLocations(old_bytes, new_bytes, width, begin, sample_end, out, kernel);
  if (sample_end == end) return;
  const double density =
      static_cast<double>(out->size() - before) / static_cast<double>(sample_end - begin);
  out->reserve(out->size() + static_cast<size_t>(density * kReserveHeadroom *
                                                 static_cast<double>(end - sample_end)));
  AppendChangedLocations(old_bytes, new_bytes, width, sample_end, end, out, kernel);
}

}  // namespace

Result<std::vector<uint64_t>> FindChangedLocations(std::span<const std::byte> old_bytes,
                                                   std::span<const std::byte> new_bytes,
                                                   uint32_t width, uint64_t begin, uint64_t end,
                                                   const CompareOptions& options) {
  REFIT_RETURN_NOT_OK(CheckCompareArguments(old_bytes, new_bytes, width, begin, end, options));
  std::vector<uint64_t> locations;
  const uint64_t count = end - begin;
  const uint64_t num_chunks = count == 0 ? 0 : (count - 1) / options.chunk_elements + 1;
  const uint64_t num_workers =
      std::min<uint64_t>(static_cast<uint64_t>(options.threads), num_chunks);
  if (num_workers <= 1) {
    AppendChangedLocationsReserved(old_bytes, new_bytes, width, begin, end, &locations,
                                   options.kernel);
    return locations;
  }

  // Workers pull chunk numbers in increasing order, but finish them in any order: each chunk gets
  // its own output so the concatenation below restores ascending order without sorting.
  std::vector<std::vector<uint64_t>> chunk_locations(num_chunks);
  std::atomic<uint64_t> next_chunk{0};
  const auto compare_chunks = [&] {
    for (uint64_t chunk = next_chunk.fetch_add(1, std::memory_order_relaxed); chunk < num_chunks;
         chunk = next_chunk.fetch_add(1, std::memory_order_relaxed)) {
      const uint64_t chunk_begin = begin + chunk * options.chunk_elements;
      // Subtract before comparing: chunk_begin + chunk_elements may overflow.
      const uint64_t chunk_end = chunk_begin + std::min(options.chunk_elements, end - chunk_begin);
      AppendChangedLocationsReserved(old_bytes, new_bytes, width, chunk_begin, chunk_end,
                                     &chunk_locations[chunk], options.kernel);
    }
  };
  {
    // The calling thread is one of the workers; the jthreads join when this scope ends.
    std::vector<std::jthread> helpers;
    helpers.reserve(num_workers - 1);
    for (uint64_t helper = 1; helper < num_workers; ++helper) {
      helpers.emplace_back(compare_chunks);
    }
    compare_chunks();
  }

  size_t total = 0;
  for (const auto& chunk : chunk_locations) {
    total += chunk.size();
  }
  locations.reserve(total);
  for (const auto& chunk : chunk_locations) {
    locations.insert(locations.end(), chunk.begin(), chunk.end());
  }
  return locations;
}

}  // namespace refit
