// Micro-benchmarks of the bitwise compare kernels (src/codec/compare.h).
//
// Comparing is memory bound: every element of both tensors is read once. Throughput is therefore
// reported over both streams (2 × array bytes, printed as GB/s) and as the user counter
// "ratio_vs_read": that throughput divided by the throughput of a plain two-stream SIMD read of
// the same arrays (docs/benchmarking.md: speed claims are ratios measured side by side). The read
// runs in the same process right after every timed iteration, with the benchmark's timer paused, so
// both see the same machine load: on the shared 2-core machine a build next door can halve memory
// bandwidth for minutes, which moves absolute GB/s but not this ratio. BM_TwoStreamRead's own
// ratio (read against read, ideally 1.0) shows how much noise is left.
//
// Product target: ratio_vs_read ≥ 0.7 with one thread, width 2 (bf16), at 1–5 % density.
// BM_FindChangedLocations with 2 threads is compared against the same one-thread read, so its
// ratio shows what the second thread adds.
//
// Run: compare_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
// Array size: REFIT_COMPARE_BENCH_MIB (MiB per array; default 256, larger than any cache).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "codec/compare.h"
#include "codec/compare_kernels.h"

namespace refit {
namespace {

// Bytes per array unless REFIT_COMPARE_BENCH_MIB says otherwise: 256 MiB per array is far larger
// than the last-level cache, so both streams come from DRAM as for a real model shard.
constexpr uint64_t kDefaultArrayMiB = 256;
constexpr uint64_t kBytesPerMiB = uint64_t{1} << 20;
// Densities are given in basis points (1/10000) because benchmark arguments are integers.
constexpr double kBasisPointsPerUnit = 10000.0;
// A changed element gets one of its lowest kFlippedLowBits bits flipped: the 1-ulp-style change
// an Adam step leaves in a bf16 weight (docs/architecture.md).
constexpr int kFlippedLowBits = 2;
constexpr uint64_t kSeed = 20240917;
// The workload BM_TwoStreamRead reads (its content does not matter, only its size).
constexpr uint32_t kReadWidth = 2;
constexpr int64_t kReadDensityBp = 100;

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
  if (workload.width == width && workload.density_bp == density_bp) {
    return workload;
  }
  workload.width = width;
  workload.density_bp = density_bp;
  workload.new_bytes = workload.old_bytes;
  workload.changed = 0;
  // Distinct seeds per workload, so widths do not share change positions.
  std::mt19937_64 random(kSeed ^ (uint64_t{width} << 32) ^ static_cast<uint64_t>(density_bp));
  // Gaps between changed elements of a Bernoulli(p) process are geometric.
  std::geometric_distribution<uint64_t> gap(static_cast<double>(density_bp) / kBasisPointsPerUnit);
  std::uniform_int_distribution<int> low_bit(0, kFlippedLowBits - 1);
  const uint64_t numel = workload.numel();
  for (uint64_t index = gap(random); index < numel; index += 1 + gap(random)) {
    // Little-endian: the lowest mantissa bits live in the element's first byte.
    workload.new_bytes[index * width] ^= std::byte{static_cast<uint8_t>(1u << low_bit(random))};
    ++workload.changed;
  }
  return workload;
}

template <typename Operation>
double SecondsOf(Operation&& operation) {
  const auto start = std::chrono::steady_clock::now();
  operation();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Run `operation` (which returns a Status) once per benchmark iteration, each followed by
// one untimed two-stream read of the workload's arrays; report GB/s over both streams and
// ratio_vs_read, the read's time over the operation's.
template <typename Operation>
void RunSideBySideWithRead(benchmark::State& state, const Workload& workload,
                           Operation&& operation) {
  double operation_seconds = 0;
  double read_seconds = 0;
  for (auto _ : state) {
    Status status;
    operation_seconds += SecondsOf([&] { status = operation(); });
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      break;
    }
    state.PauseTiming();
    read_seconds += SecondsOf([&] {
      benchmark::DoNotOptimize(internal::XorReduceTwoStreams(
          workload.old_bytes.data(), workload.new_bytes.data(), workload.old_bytes.size()));
    });
    state.ResumeTiming();
  }
  const double bytes = 2.0 * static_cast<double>(workload.old_bytes.size()) *
                       static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.counters["ratio_vs_read"] = operation_seconds > 0 ? read_seconds / operation_seconds : 0;
  state.counters["changed"] = static_cast<double>(workload.changed);
}

// Return whether `found` (locations from one run) has the workload's number of changes, and
// report the mismatch on `state` if not.
bool CheckFound(benchmark::State& state, const Workload& workload, size_t found) {
  if (found == workload.changed) {
    return true;
  }
  state.SkipWithError(
      fmt::format("found {} changed elements, expected {}", found, workload.changed).c_str());
  return false;
}

void BM_TwoStreamRead(benchmark::State& state) {
  const Workload& workload = GetWorkload(kReadWidth, kReadDensityBp);
  RunSideBySideWithRead(state, workload, [&] {
    benchmark::DoNotOptimize(internal::XorReduceTwoStreams(
        workload.old_bytes.data(), workload.new_bytes.data(), workload.old_bytes.size()));
    return Status::OK();
  });
}
BENCHMARK(BM_TwoStreamRead)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_AppendChangedLocations(benchmark::State& state, CompareKernel kernel) {
  const Workload& workload = GetWorkload(static_cast<uint32_t>(state.range(0)), state.range(1));
  std::vector<uint64_t> locations;
  // A tracker reuses its location buffer across chunks: time the compare, not vector growth.
  locations.reserve(workload.changed);
  RunSideBySideWithRead(state, workload, [&] {
    locations.clear();
    AppendChangedLocations(workload.old_bytes, workload.new_bytes, workload.width, 0,
                           workload.numel(), &locations, kernel);
    benchmark::DoNotOptimize(locations.data());
    return Status::OK();
  });
  CheckFound(state, workload, locations.size());
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
  const Workload& workload = GetWorkload(static_cast<uint32_t>(state.range(0)), state.range(1));
  CompareOptions options;
  options.threads = static_cast<int>(state.range(2));
  size_t found = 0;
  RunSideBySideWithRead(state, workload, [&] {
    Result<std::vector<uint64_t>> locations = FindChangedLocations(
        workload.old_bytes, workload.new_bytes, workload.width, 0, workload.numel(), options);
    if (!locations.ok()) {
      return locations.status();
    }
    found = locations->size();
    benchmark::DoNotOptimize(locations->data());
    return Status::OK();
  });
  CheckFound(state, workload, found);
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
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
    return 1;
  }
  benchmark::AddCustomContext("compare_target", std::string(refit::BestCompareTarget()));
  benchmark::AddCustomContext("array_bytes", std::to_string(refit::ArrayBytes()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
