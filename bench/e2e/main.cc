// e2e_bench: networked refit end to end on loopback, measured side by side in one run, in five
// sections (sections.h: end-to-end, fan-out, producers, tp, embedded) over one harness
// (harness.h). This file runs the sections and prints their report, and dispatches the child
// processes the executable re-executes itself as.
//
// The model is not trained by the Adam simulator (14 bytes per element: a 4 GiB bf16 model would
// need 30 GiB); it is drawn cheaply with a realistic value distribution and stepped by 1-ulp
// moves, see SyntheticModel. Prints a table per section, or with --json one JSON document with
// every figure. See docs/benchmarking.md.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "codec/compare.h"
#include "core/digest_kernels.h"
#include "e2e/harness.h"
#include "e2e/sections.h"
#include "flags.h"
#include "refit/status_format.h"

namespace refit::bench::e2e {
namespace {

// Room the work directory needs beyond the model file: safetensors header, daemon logs.
constexpr uint64_t kDiskMarginBytes = 64 * kMiB;
// Memory this process and the daemons need beyond the model copies they hold: libraries and the
// pipelines' bounded buffers (chunks, payloads and staged payloads in flight).
constexpr uint64_t kMemoryMarginBytes = 512 * kMiB;

// The 1, 5 and 15 minute load averages (/proc/loadavg): other work on the machine moves every
// figure, so the report says how busy it was.
std::vector<double> LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::vector<double> load(3, 0.0);
  in >> load[0] >> load[1] >> load[2];
  return load;
}

Status Run(const Args& args) {
  // One model file at a time is on disk. Memory, at the FULL refit: this process holds the model
  // and the tracker's baseline; each daemon its copy (read into memory, or every page written
  // copy-on-write by the FULL) and the FULL's undo log, the old bits of every element until
  // commit.
  const uint64_t e2e_bytes = args.skip_end_to_end ? 0 : args.model_bytes;
  const uint64_t largest_fanout =
      args.fanout.empty() ? 0 : *std::max_element(args.fanout.begin(), args.fanout.end());
  const uint64_t fanout_bytes = args.skip_fanout ? 0 : args.fanout_model_bytes;
  // The new sections, one at a time: producers — this process's model and baseline (the reset's
  // second model briefly), each daemon's model, each persistent rank process's copy of the model
  // (the baselines of all ranks add up to one), and two checkpoint files; tp — this process's
  // model, baseline and two copies of the shards, the shards' daemons (one model in all), and the
  // shard files; embedded — this process's model and baseline and the receiver process's model.
  const uint64_t producers_bytes = args.skip_producers ? 0 : args.producers_model_bytes;
  const uint64_t largest_world =
      args.producers.empty() ? 0 : *std::max_element(args.producers.begin(), args.producers.end());
  const uint64_t tp_bytes = args.skip_tp ? 0 : args.tp_model_bytes;
  const uint64_t embedded_bytes = args.skip_embedded ? 0 : args.embedded_model_bytes;
  const uint64_t memory =
      kMemoryMarginBytes +
      std::max({(2 + 2 * kEndToEndReceivers) * e2e_bytes, (2 + 2 * largest_fanout) * fanout_bytes,
                (4 + args.producers_receivers + largest_world) * producers_bytes, 5 * tp_bytes,
                3 * embedded_bytes});
  const uint64_t disk =
      std::max({e2e_bytes, fanout_bytes, 2 * producers_bytes, tp_bytes}) + kDiskMarginBytes;
  const std::string temp_dir = std::filesystem::temp_directory_path().string();
  if (!args.work_dir.empty()) {
    std::error_code made;
    std::filesystem::create_directories(args.work_dir, made);
    if (made) return IoError("--work-dir {}: cannot create it: {}", args.work_dir, made.message());
  }
  REFIT_RETURN_NOT_OK(CheckRoom(args.work_dir.empty() ? temp_dir : args.work_dir, disk, memory,
                                "the model and the tracker's baseline in this process; per daemon "
                                "its model and, during the FULL, an undo log as large",
                                "use a smaller --model-mib, --fanout-model-mib, "
                                "--producers-model-mib, --tp-model-mib or --embedded-model-mib"));
  std::string work_dir = args.work_dir;
  bool scratch = false;
  if (work_dir.empty()) {
    REFIT_ASSIGN_OR_RETURN(work_dir, testkit::MakeTemporaryDirectory("refit-e2e-bench"));
    scratch = true;
  }
  ::setenv(kApiKeyEnv, testkit::GenerateApiKey().c_str(), /*overwrite=*/1);

  nlohmann::json report;
  report["machine"] = {{"hardware_threads", std::thread::hardware_concurrency()},
                       {"compare_simd_target", std::string(BestCompareTarget())},
                       {"digest_simd_target", std::string(internal::DigestTargetName())},
                       {"load_average_start", LoadAverage()}};
  if (!args.json) {
    std::cout << fmt::format(
        "e2e_bench: compare kernel {} (Highway), digest kernel {}, both chosen at run time; {} "
        "hardware threads\n\n",
        BestCompareTarget(), internal::DigestTargetName(), std::thread::hardware_concurrency());
  }
  report["config"] = {{"quick", args.quick},
                      {"chunk_bytes", args.chunk_bytes},
                      {"bucket_bytes", args.bucket_bytes},
                      {"delta_bucket_bytes", args.delta_bucket_bytes},
                      {"threads_per_stage", args.threads},
                      {"receiver_mode", args.receiver_mmap ? "mmap" : "ram"},
                      {"transport", "zmq:// (loopback) + HTTP control"},
                      {"steps", args.steps},
                      {"step_density", args.step_density},
                      {"seed", args.seed}};
  if (!args.skip_end_to_end) {
    Result<nlohmann::json> e2e = RunEndToEnd(args, work_dir);
    if (!e2e.ok()) return e2e.status().WithContext("end to end (work dir " + work_dir + ")");
    report["end_to_end"] = *e2e;
    if (!args.json) PrintEndToEnd(*e2e, args);
  }
  if (!args.skip_fanout && !args.fanout.empty()) {
    Result<nlohmann::json> fanout = RunFanOut(args, work_dir);
    if (!fanout.ok()) return fanout.status().WithContext("fan-out (work dir " + work_dir + ")");
    report["fan_out"] = *fanout;
    if (!args.json) PrintFanOut(*fanout);
  }
  if (!args.skip_producers && !args.producers.empty()) {
    Result<nlohmann::json> producers = RunProducers(args, work_dir);
    if (!producers.ok()) {
      return producers.status().WithContext("producers (work dir " + work_dir + ")");
    }
    report["producers"] = *producers;
    if (!args.json) PrintProducers(*producers);
  }
  if (!args.skip_tp) {
    Result<nlohmann::json> tp = RunTensorParallel(args, work_dir);
    if (!tp.ok()) return tp.status().WithContext("tp (work dir " + work_dir + ")");
    report["tp"] = *tp;
    if (!args.json) PrintTensorParallel(*tp);
  }
  if (!args.skip_embedded) {
    Result<nlohmann::json> embedded = RunEmbedded(args, work_dir);
    if (!embedded.ok())
      return embedded.status().WithContext("embedded (work dir " + work_dir + ")");
    report["embedded"] = *embedded;
    if (!args.json) PrintEmbedded(*embedded);
  }
  if (!args.skip_elastic) {
    Result<nlohmann::json> elastic = RunElastic(args, work_dir);
    if (!elastic.ok()) return elastic.status().WithContext("elastic (work dir " + work_dir + ")");
    report["elastic"] = *elastic;
    if (!args.json) PrintElastic(*elastic);
  }
  report["machine"]["load_average_end"] = LoadAverage();
  if (args.json) std::cout << report.dump(2) << "\n";
  if (!args.json_out.empty()) {
    std::ofstream file(args.json_out);
    file << report.dump(2) << "\n";
    if (!file) return IoError("cannot write the JSON report to {}", args.json_out);
  }
  if (scratch) std::filesystem::remove_all(work_dir);
  return Status::OK();
}

int Main(int argc, char** argv) {
  if (argc >= 2 && (std::string_view(argv[1]) == kEmbeddedChildFlag ||
                    std::string_view(argv[1]) == kProducerRankFlag)) {
    Status status;
    if (std::string_view(argv[1]) == kEmbeddedChildFlag) {
      Result<EmbeddedChildArgs> child = ParseEmbeddedChildArgs(argc, argv);
      status = child.ok() ? RunEmbeddedChild(*child) : child.status();
    } else {
      Result<ChildFlags> flags = ChildFlags::Parse(argc, argv, kProducerRankFlag);
      status = flags.ok() ? RunProducerRank(*flags) : flags.status();
    }
    if (!status.ok()) {
      std::cerr << "e2e_bench " << argv[1] << ": " << status.ToString() << "\n";
      return 1;
    }
    return 0;
  }
  return RunBenchmark("e2e_bench", ParseArgs(argc, argv), Usage(), Run);
}

}  // namespace
}  // namespace refit::bench::e2e

int main(int argc, char** argv) { return refit::bench::e2e::Main(argc, argv); }
