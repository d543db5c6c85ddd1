// Micro-benchmarks of the bitwise compare kernels (refit/compare.h).
//
// Comparing is memory bound: every element of both tensors is read once. Throughput is therefore
// reported over both streams (2 × array bytes, printed as GB/s) and as the user counter
// "ratio_vs_read": that throughput divided by the throughput of a plain two-stream SIMD read of
// the same arrays, measured once in the same process at start-up (DESIGN.md: speed claims are
// ratios measured side by side). Product target: ratio_vs_read ≥ 0.7 with one thread, width 2
// (bf16), at 1–5 % density.
//
// Run: compare_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
// Array size: REFIT_COMPARE_BENCH_MIB (MiB per array; default 256, larger than any cache).

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "codec/compare_kernels.h"
#include "refit/compare.h"

namespace refit {
namespace {

// Bytes per array unless REFIT_COMPARE_BENCH_MIB says otherwise: 256 MiB per array is far larger
// than the last-level cache, so both streams come from DRAM as for a real model shard.
constexpr uint64_t kDefaultArrayMiB = 256;
constexpr uint64_t kBytesPerMiB = uint64_t{1} << 20;
// Densities are given in basis points (1/10000) because benchmark arguments are integers.
constexpr double kBasisPointsPerUnit = 10000.0;
// A changed element gets one of its lowest kFlippedLowBits bits flipped: the 1-ulp-style change
// an Adam step leaves in a bf16 weight (DESIGN.md, background).
constexpr int kFlippedLowBits = 2;
// Passes of the two-stream read timed at start-up; their median is the baseline.
constexpr int kBaselinePasses = 7;
constexpr uint64_t kSeed = 20240917;
// The workload the two-stream read runs on (its content does not matter, only its size).
constexpr uint32_t kBaselineWidth = 2;
constexpr int64_t kBaselineDensityBp = 100;

uint64_t ArrayBytes() {
  const char* mib = std::getenv("REFIT_COMPARE_BENCH_MIB");
  const uint64_t parsed = mib == nullptr ? 0 : std::strtoull(mib, nullptr, 10);
  return (parsed == 0 ? kDefaultArrayMiB : parsed) * kBytesPerMiB;
}

// An old array of random bytes and a new array that differs in `changed` elements of `width`
// bytes, placed uniformly at random at `density_bp`.
struct Workload {
  uint32_t width = 0;
  int64_t density_bp = -1;
  std::vector<std::byte> old_bytes;
  std::vector<std::byte> new_bytes;
  uint64_t changed = 0;

  uint64_t numel() const { return old_bytes.size() / width; }
};

// Return the workload for (width, density_bp). The old array is built once; the new array is
// rebuilt only when the parameters change, so the process holds two arrays at a time and the
// repetitions of one benchmark share them.
const Workload& GetWorkload(uint32_t width, int64_t density_bp) {
  static Workload workload;
  if (workload.old_bytes.empty()) {
    workload.old_bytes.resize(ArrayBytes());
    std::mt19937_64 random(kSeed);
    for (size_t offset = 0; offset + sizeof(uint64_t) <= workload.old_bytes.size();
         offset += sizeof(uint64_t)) {
      const uint64_t word = random();
      std::memcpy(workload.old_bytes.data() + offset, &word, sizeof(word));
    }
  }
  if (workload.width == width && workload.density_bp == density_bp) return workload;
  workload.width = width;
  workload.density_bp = density_bp;
  workload.new_bytes = workload.old_bytes;
  workload.changed = 0;
  // Distinct seeds per workload, so widths do not share change positions.
  std::mt19937_64 random(kSeed ^ (uint64_t{width} << 32) ^ static_cast<uint64_t>(density_bp));
  // Gaps between changed elements of a Bernoulli(p) process are geometric.
  std::geometric_distribution<uint64_t> gap(static_cast<double>(density_bp) /
                                            kBasisPointsPerUnit);
  std::uniform_int_distribution<int> low_bit(0, kFlippedLowBits - 1);
  const uint64_t numel = workload.numel();
  for (uint64_t index = gap(random); index < numel; index += 1 + gap(random)) {
    // Little-endian: the lowest mantissa bits live in the element's first byte.
    workload.new_bytes[index * width] ^= std::byte{static_cast<uint8_t>(1u << low_bit(random))};
    ++workload.changed;
  }
  return workload;
}

// Bytes per second of the two-stream read over the baseline workload; set in main().
double g_read_bytes_per_second = 0;

double MeasureTwoStreamRead() {
  const Workload& workload = GetWorkload(kBaselineWidth, kBaselineDensityBp);
  const double bytes = 2.0 * static_cast<double>(workload.old_bytes.size());
  std::vector<double> rates;
  for (int pass = 0; pass < kBaselinePasses; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(internal::XorReduceTwoStreams(
        workload.old_bytes.data(), workload.new_bytes.data(), workload.old_bytes.size()));
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    rates.push_back(bytes / elapsed.count());
  }
  std::nth_element(rates.begin(), rates.begin() + rates.size() / 2, rates.end());
  return rates[rates.size() / 2];
}

// Report GB/s over both streams and the ratio to the start-up two-stream read.
void ReportThroughput(benchmark::State& state, const Workload& workload) {
  const double bytes = 2.0 * static_cast<double>(workload.old_bytes.size()) *
                       static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  // A rate counter is divided by the elapsed time, so bytes / baseline-rate becomes the ratio.
  state.counters["ratio_vs_read"] =
      benchmark::Counter(bytes / g_read_bytes_per_second, benchmark::Counter::kIsRate);
  state.counters["changed"] = static_cast<double>(workload.changed);
}

void BM_TwoStreamRead(benchmark::State& state) {
  const Workload& workload = GetWorkload(kBaselineWidth, kBaselineDensityBp);
  for (auto _ : state) {
    benchmark::DoNotOptimize(internal::XorReduceTwoStreams(
        workload.old_bytes.data(), workload.new_bytes.data(), workload.old_bytes.size()));
  }
  ReportThroughput(state, workload);
}
BENCHMARK(BM_TwoStreamRead)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_AppendChangedLocations(benchmark::State& state, CompareKernel kernel) {
  const Workload& workload =
      GetWorkload(static_cast<uint32_t>(state.range(0)), state.range(1));
  std::vector<uint64_t> locations;
  // A tracker reuses its location buffer across chunks: time the compare, not vector growth.
  locations.reserve(workload.changed);
  for (auto _ : state) {
    locations.clear();
    AppendChangedLocations(workload.old_bytes, workload.new_bytes, workload.width, 0,
                           workload.numel(), &locations, kernel);
    benchmark::DoNotOptimize(locations.data());
    benchmark::ClobberMemory();
  }
  if (locations.size() != workload.changed) {
    state.SkipWithError(fmt::format("found {} changed elements, expected {}", locations.size(),
                                    workload.changed)
                            .c_str());
    return;
  }
  ReportThroughput(state, workload);
}
BENCHMARK_CAPTURE(BM_AppendChangedLocations, best, CompareKernel::kBest)
    ->ArgNames({"width", "density_bp"})
    ->ArgsProduct({{1, 2, 4}, {10, 100, 300, 500}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_AppendChangedLocations, scalar, CompareKernel::kScalar)
    ->ArgNames({"width", "density_bp"})
    ->Args({2, 100})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_FindChangedLocations(benchmark::State& state) {
  const Workload& workload =
      GetWorkload(static_cast<uint32_t>(state.range(0)), state.range(1));
  CompareOptions options;
  options.threads = static_cast<int>(state.range(2));
  size_t found = 0;
  for (auto _ : state) {
    Result<std::vector<uint64_t>> locations = FindChangedLocations(
        workload.old_bytes, workload.new_bytes, workload.width, 0, workload.numel(), options);
    if (!locations.ok()) {
      state.SkipWithError(locations.status().ToString().c_str());
      return;
    }
    found = locations->size();
    benchmark::DoNotOptimize(locations->data());
  }
  if (found != workload.changed) {
    state.SkipWithError(
        fmt::format("found {} changed elements, expected {}", found, workload.changed).c_str());
    return;
  }
  ReportThroughput(state, workload);
}
BENCHMARK(BM_FindChangedLocations)
    ->ArgNames({"width", "density_bp", "threads"})
    ->Args({2, 100, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  refit::g_read_bytes_per_second = refit::MeasureTwoStreamRead();
  benchmark::AddCustomContext("compare_target", std::string(refit::BestCompareTarget()));
  benchmark::AddCustomContext("array_bytes", std::to_string(refit::ArrayBytes()));
  benchmark::AddCustomContext(
      "two_stream_read_GBps",
      fmt::format("{:.2f}", refit::g_read_bytes_per_second / 1e9));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
