// The producers section (sections.h): W trainer ranks refit the same daemons with the same deltas
// as Publisher threads of this process, as persistent rank processes (this executable re-executed,
// RunProducerRank) and as `refit push --group` processes, side by side.
#include "e2e/sections.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bench_util.h"
#include "e2e/harness.h"
#include "refit/producer_group.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "table.h"

namespace refit::bench::e2e {
namespace {

// One delta as W `refit push` processes of one TCP producer group: `next_path` against
// `base_path` (what the fleet holds), with the options of `config_path`.
Result<SyncStep> PushAsProcesses(const Args& args, const std::string& work_dir, uint32_t world,
                                 const std::string& config_path, const std::string& base_path,
                                 const std::string& next_path,
                                 const std::vector<PublisherReceiver>& fleet) {
  REFIT_ASSIGN_OR_RETURN(std::vector<uint16_t> port, testkit::FreeLoopbackPorts(1));
  std::vector<std::string> common = {args.refit_binary,
                                     "push",
                                     next_path,
                                     "--base",
                                     base_path,
                                     "--config",
                                     config_path,
                                     "--group",
                                     fmt::format("tcp://127.0.0.1:{}", port[0]),
                                     "--world-size",
                                     std::to_string(world),
                                     "--timeout",
                                     std::to_string(std::chrono::seconds(kPushTimeout).count()),
                                     "--json"};
  for (const PublisherReceiver& receiver : fleet) {
    common.insert(common.end(), {"--receiver", fmt::format("{}={}", receiver.control_url,
                                                           receiver.data_endpoint)});
  }
  std::vector<testkit::ChildSpec> ranks;
  for (uint32_t rank = 0; rank < world; ++rank) {
    testkit::ChildSpec& child = ranks.emplace_back();
    child.argv = common;
    child.argv.insert(child.argv.end(), {"--rank", std::to_string(rank)});
    child.stdout_path = fmt::format("{}/push-rank-{}.out", work_dir, rank);
    child.stderr_path = fmt::format("{}/push-rank-{}.log", work_dir, rank);
  }
  const double t0 = Now();
  REFIT_ASSIGN_OR_RETURN(const std::vector<pid_t> pids,
                         testkit::SpawnProcesses(ranks, kChildStopGrace));
  Result<std::vector<testkit::ChildExit>> exits = testkit::WaitProcesses(pids, kPushTimeout);
  std::vector<std::string> problems;
  SyncStep step;
  for (uint32_t rank = 0; rank < world; ++rank) {
    if (!exits.ok() || !(*exits)[rank].ok()) {
      problems.push_back(fmt::format(
          "`refit push` rank {} of {} {}; its log ends with:\n{}", rank, world,
          exits.ok() ? "exited with " + (*exits)[rank].Describe() : exits.status().ToString(),
          testkit::FileTail(ranks[rank].stderr_path)));
    } else {
      step.rank_peak_rss.push_back((*exits)[rank].peak_rss_bytes);
    }
  }
  step.wall_s = Now() - t0;
  if (!problems.empty()) return Internal("{}", fmt::join(problems, "\n"));
  // Rank 0 prints one JSON line for the whole transfer (push.cc PrintReport).
  std::ifstream printed(ranks[0].stdout_path);
  nlohmann::json line;
  for (std::string text; std::getline(printed, text);) {
    nlohmann::json parsed = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_object()) line = std::move(parsed);
  }
  if (!line.is_object() || !line.contains("time_s") || line.value("kind", "") != "delta") {
    return DataLoss("`refit push` rank 0 printed no delta report: '{}'",
                    testkit::FileTail(ranks[0].stdout_path));
  }
  step.changed = line.value("changed", uint64_t{0});
  step.payloads = line.value("payloads", uint64_t{0});
  step.wire_bytes = line.value("wire_bytes", uint64_t{0});
  step.time_s = line.value("time_s", 0.0);
  return step;
}

// The steps of one configuration as W persistent rank processes (RunProducerRank), from the
// model the fleet holds (the initial one) on.
Result<std::vector<SyncStep>> SyncAsRankProcesses(const Args& args, const std::string& work_dir,
                                                  uint32_t world, const std::string& config_path,
                                                  const std::vector<PublisherReceiver>& fleet) {
  REFIT_ASSIGN_OR_RETURN(const std::string self, testkit::SelfExecutable());
  REFIT_ASSIGN_OR_RETURN(const std::vector<uint16_t> ports, testkit::FreeLoopbackPorts(2));
  std::vector<std::string> entries;
  for (const PublisherReceiver& receiver : fleet) {
    entries.push_back(fmt::format("{}={}", receiver.control_url, receiver.data_endpoint));
  }
  const std::string result_path = fmt::format("{}/rank-processes.result", work_dir);
  std::filesystem::remove(result_path);
  const std::vector<std::string> common = {self,
                                           std::string(kProducerRankFlag),
                                           "--world-size",
                                           std::to_string(world),
                                           "--group",
                                           fmt::format("tcp://127.0.0.1:{}", ports[0]),
                                           "--barrier",
                                           fmt::format("tcp://127.0.0.1:{}", ports[1]),
                                           "--config",
                                           config_path,
                                           "--receivers",
                                           fmt::format("{}", fmt::join(entries, ",")),
                                           "--model-bytes",
                                           std::to_string(args.producers_model_bytes),
                                           "--seed",
                                           std::to_string(args.seed),
                                           "--threads",
                                           std::to_string(args.threads),
                                           "--steps",
                                           std::to_string(args.steps),
                                           "--density",
                                           fmt::format("{}", args.step_density),
                                           "--result-file",
                                           result_path};
  std::vector<testkit::ChildSpec> ranks;
  for (uint32_t rank = 0; rank < world; ++rank) {
    testkit::ChildSpec& child = ranks.emplace_back();
    child.argv = common;
    child.argv.insert(child.argv.end(), {"--rank", std::to_string(rank)});
    child.stdout_path = child.stderr_path = fmt::format("{}/rank-process-{}.log", work_dir, rank);
  }
  REFIT_ASSIGN_OR_RETURN(const std::vector<pid_t> pids,
                         testkit::SpawnProcesses(ranks, kChildStopGrace));
  Result<std::vector<testkit::ChildExit>> exits = testkit::WaitProcesses(pids, kPushTimeout);
  std::vector<std::string> problems;
  std::vector<uint64_t> rank_peaks;
  for (uint32_t rank = 0; rank < world; ++rank) {
    if (!exits.ok() || !(*exits)[rank].ok()) {
      problems.push_back(fmt::format(
          "rank process {} of {} {}; its log ends with:\n{}", rank, world,
          exits.ok() ? "exited with " + (*exits)[rank].Describe() : exits.status().ToString(),
          testkit::FileTail(ranks[rank].stderr_path)));
    } else {
      rank_peaks.push_back((*exits)[rank].peak_rss_bytes);
    }
  }
  if (!problems.empty()) return Internal("{}", fmt::join(problems, "\n"));
  std::ifstream result_file(result_path);
  const nlohmann::json result = nlohmann::json::parse(result_file, nullptr, false);
  if (!result.is_object() || !result.contains("steps") || result["steps"].size() != args.steps) {
    return DataLoss("rank process 0 wrote no report of its {} steps to {}", args.steps,
                    result_path);
  }
  std::vector<SyncStep> steps;
  for (const nlohmann::json& reported : result["steps"]) {
    SyncStep step;
    step.changed_by_step = reported["changed_by_step"];
    step.changed = reported["changed"];
    step.payloads = reported["payloads"];
    step.wire_bytes = reported["wire_bytes"];
    step.time_s = reported["time_s"];
    step.stream_s = reported["stream_s"];
    step.flush_s = reported["flush_s"];
    step.commit_s = reported["commit_s"];
    step.wall_s = reported["wall_s"];
    step.rank_peak_rss = rank_peaks;
    steps.push_back(step);
  }
  return steps;
}

}  // namespace

Status RunProducerRank(const ChildFlags& flags) {
  REFIT_ASSIGN_OR_RETURN(const uint64_t rank, flags.Number("--rank"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t world, flags.Number("--world-size"));
  REFIT_ASSIGN_OR_RETURN(const std::string group_address, flags.Text("--group"));
  REFIT_ASSIGN_OR_RETURN(const std::string barrier_address, flags.Text("--barrier"));
  REFIT_ASSIGN_OR_RETURN(const std::string config_path, flags.Text("--config"));
  REFIT_ASSIGN_OR_RETURN(const std::string fleet_text, flags.Text("--receivers"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t model_bytes, flags.Number("--model-bytes"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t seed, flags.Number("--seed"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t threads, flags.Number("--threads"));
  REFIT_ASSIGN_OR_RETURN(const uint64_t steps, flags.Number("--steps"));
  REFIT_ASSIGN_OR_RETURN(const std::string density_text, flags.Text("--density"));
  REFIT_ASSIGN_OR_RETURN(const double density,
                         ParseDensity("--density", density_text, /*allow_one=*/true));
  REFIT_ASSIGN_OR_RETURN(const std::string result_path, flags.Text("--result-file"));
  std::vector<PublisherReceiver> fleet;
  for (std::string_view entry : SplitCommas(fleet_text)) {
    const size_t equals = entry.find('=');
    if (equals == std::string_view::npos) {
      return InvalidArgument("{}: --receivers entry '{}' is not URL=ENDPOINT", kProducerRankFlag,
                             entry);
    }
    fleet.push_back({std::string(entry.substr(0, equals)), std::string(entry.substr(equals + 1))});
  }
  REFIT_ASSIGN_OR_RETURN(SyntheticModel model,
                         SyntheticModel::Make(model_bytes, seed,
                                              static_cast<int>(std::clamp<uint64_t>(
                                                  threads, 1, ProducerStreamOptions::kMaxThreads)),
                                              nullptr));
  const char* key = std::getenv(kApiKeyEnv);
  TcpGroupOptions group_options;
  group_options.rank = static_cast<uint32_t>(rank);
  group_options.world_size = static_cast<uint32_t>(world);
  group_options.api_key = key == nullptr ? "" : key;
  group_options.address = barrier_address;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ProducerGroup> barrier, MakeTcpGroup(group_options));
  group_options.address = group_address;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ProducerGroup> group, MakeTcpGroup(group_options));
  REFIT_ASSIGN_OR_RETURN(const PublisherOptions options,
                         PublisherOptionsFromConfig(config_path, fleet));
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Publisher> publisher,
                         Publisher::Make(options, std::move(group)));
  REFIT_RETURN_NOT_OK(publisher->AdoptBaseline(model.views()));
  nlohmann::json reports = nlohmann::json::array();
  for (uint64_t s = 1; s <= steps; ++s) {
    REFIT_ASSIGN_OR_RETURN(const uint64_t changed, model.Step(s, density));
    const GroupClock::time_point deadline = GroupClock::now() + kPushTimeout;
    REFIT_RETURN_NOT_OK(barrier->Gather({}, deadline).status().WithContext("barrier"));
    REFIT_RETURN_NOT_OK(barrier->Broadcast({}, deadline).status().WithContext("barrier"));
    const double t0 = Now();
    REFIT_ASSIGN_OR_RETURN(const SyncReport sync, publisher->Sync(model.views()));
    const double wall = Now() - t0;
    if (sync.transfer.plan.anchor) {
      return Internal("rank {}: step {} was a FULL anchor where a delta was expected", rank, s);
    }
    if (rank == 0) reports.push_back(StepJson(StepFromReport(sync.transfer, changed, wall)));
  }
  if (rank != 0) return Status::OK();
  return testkit::WriteTextFileAtomically(result_path,
                                          nlohmann::json{{"steps", reports}}.dump() + "\n");
}

Result<nlohmann::json> RunProducers(const Args& args, const std::string& work_dir) {
  nlohmann::json out;
  const uint64_t chunk_bytes = SectionChunkBytes(args.producers_model_bytes);
  REFIT_ASSIGN_OR_RETURN(
      SyntheticModel model,
      SyntheticModel::Make(args.producers_model_bytes, args.seed, args.threads, nullptr));
  std::vector<uint64_t> tensor_bytes;
  for (const TensorView& tensor : model.views()) tensor_bytes.push_back(tensor.bytes.size());
  out["model_bytes"] = model.bytes();
  out["tensors"] = model.views().size();
  out["chunk_bytes"] = chunk_bytes;
  out["chunks"] = PlanChunks(tensor_bytes, chunk_bytes).size();
  out["receivers"] = args.producers_receivers;
  out["steps"] = args.steps;
  out["step_density"] = args.step_density;
  out["threads_per_stage_per_rank"] = args.threads;

  const std::string initial_path = work_dir + "/producers-model.safetensors";
  REFIT_RETURN_NOT_OK(
      WriteSafetensors(initial_path, model.views(), {{kWeightVersionMetadataKey, "0"}}));
  const std::vector<testkit::LocalReceiverSpec> specs =
      testkit::LocalFleetOptions::Replicas(initial_path, args.producers_receivers);
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<testkit::LocalFleet> daemons,
                         StartDaemons(args, work_dir, "producers", specs));
  std::filesystem::remove(initial_path);
  REFIT_ASSIGN_OR_RETURN(const std::string config_path,
                         WriteRefitConfig(args, work_dir, "producers", chunk_bytes));
  REFIT_ASSIGN_OR_RETURN(const PublisherOptions options,
                         PublisherOptionsFromConfig(config_path, PublisherReceivers(*daemons)));
  const std::string base_path = work_dir + "/producers-base.safetensors";
  const std::string next_path = work_dir + "/producers-next.safetensors";

  // Per W: the ranks as threads of this process, as persistent processes, and as one `refit
  // push --group` process set per step (the CLI).
  constexpr std::array<std::string_view, 3> kModes = {"threads", "processes", "push"};
  std::unique_ptr<ProgressReporter> progress =
      Progress("producers", kModes.size() * args.producers.size(), "configurations");
  out["rows"] = nlohmann::json::array();
  double reset_s = 0;
  {
    // Warm-up, not measured: one delta (step 0, which no configuration repeats), so that the
    // first configuration does not pay the fleet's first transfer alone (first-touch pages of the
    // daemon's apply path, first connections); the first configuration's reset refits it back.
    REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Publisher>> warm,
                           MakeThreadRanks(1, options));
    REFIT_RETURN_NOT_OK(AdoptBaseline(warm, model.views()));
    REFIT_RETURN_NOT_OK(model.Step(/*step=*/0, args.step_density).status());
    REFIT_RETURN_NOT_OK(SyncDelta(warm, model.views()).status().WithContext("warm-up"));
  }
  bool fleet_at_initial = false;
  for (uint32_t world : args.producers) {
    for (const std::string_view mode : kModes) {
      if (!fleet_at_initial) {
        // Refit the daemons back to the initial model (not measured), so that every
        // configuration sends exactly the same deltas from exactly the same state.
        const double t0 = Now();
        REFIT_ASSIGN_OR_RETURN(
            SyntheticModel initial,
            SyntheticModel::Make(args.producers_model_bytes, args.seed, args.threads, nullptr));
        REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Publisher>> reset,
                               MakeThreadRanks(1, options));
        REFIT_RETURN_NOT_OK(AdoptBaseline(reset, model.views()));
        REFIT_RETURN_NOT_OK(SyncDelta(reset, initial.views())
                                .status()
                                .WithContext("refit back to the initial model"));
        model = std::move(initial);
        reset_s += Now() - t0;
      }
      fleet_at_initial = false;
      std::vector<SyncStep> steps;
      if (mode == "processes") {
        REFIT_ASSIGN_OR_RETURN(steps, SyncAsRankProcesses(args, work_dir, world, config_path,
                                                          PublisherReceivers(*daemons)));
        // This process's copy follows, for the next reset and the final check.
        for (uint64_t s = 1; s <= args.steps; ++s)
          REFIT_RETURN_NOT_OK(model.Step(s, args.step_density).status());
      } else if (mode == "threads") {
        REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Publisher>> ranks,
                               MakeThreadRanks(world, options));
        REFIT_RETURN_NOT_OK(AdoptBaseline(ranks, model.views()));
        for (uint64_t s = 1; s <= args.steps; ++s) {
          REFIT_ASSIGN_OR_RETURN(const uint64_t changed, model.Step(s, args.step_density));
          const double t0 = Now();
          REFIT_ASSIGN_OR_RETURN(RefitReport report, SyncDelta(ranks, model.views()));
          steps.push_back(StepFromReport(report, changed, Now() - t0));
        }
      } else {
        REFIT_RETURN_NOT_OK(WriteSafetensors(base_path, model.views()));
        for (uint64_t s = 1; s <= args.steps; ++s) {
          REFIT_ASSIGN_OR_RETURN(const uint64_t changed, model.Step(s, args.step_density));
          REFIT_RETURN_NOT_OK(WriteSafetensors(next_path, model.views()));
          REFIT_ASSIGN_OR_RETURN(SyncStep step,
                                 PushAsProcesses(args, work_dir, world, config_path, base_path,
                                                 next_path, PublisherReceivers(*daemons)));
          step.changed_by_step = changed;
          steps.push_back(step);
          std::filesystem::rename(next_path, base_path);
        }
        std::filesystem::remove(base_path);
      }
      nlohmann::json row = {{"mode", std::string(mode)},
                            {"producers", world},
                            {"time_s", Spread(steps, &SyncStep::time_s)},
                            {"wall_s", Spread(steps, &SyncStep::wall_s)},
                            {"steps", nlohmann::json::array()}};
      uint64_t wire = 0, payloads = 0, changed = 0, rank_peak = 0;
      for (const SyncStep& step : steps) {
        if (step.changed != step.changed_by_step) {
          return DataLoss(
              "producers W = {} ({}): a step changed {} elements but the producers "
              "found {}",
              world, row["mode"].get<std::string>(), step.changed_by_step, step.changed);
        }
        row["steps"].push_back(StepJson(step));
        wire += step.wire_bytes;
        payloads += step.payloads;
        changed += step.changed;
        for (uint64_t peak : step.rank_peak_rss) rank_peak = std::max(rank_peak, peak);
      }
      row["wire_bytes_per_step"] = static_cast<double>(wire) / steps.size();
      row["payloads_per_step"] = static_cast<double>(payloads) / steps.size();
      row["changed_per_step"] = static_cast<double>(changed) / steps.size();
      if (mode != "threads") row["rank_peak_rss"] = rank_peak;
      out["rows"].push_back(std::move(row));
      if (progress) progress->Advance(1);
    }
  }
  if (progress) progress->Finish();
  // Every daemon holds the last model bit for bit.
  for (const testkit::LocalReceiver& daemon : daemons->receivers()) {
    REFIT_RETURN_NOT_OK(CheckReceiverHolds(daemon.control_url, model.views()));
  }
  out["verified_bit_identical"] = true;
  out["reset_s"] = reset_s;
  REFIT_RETURN_NOT_OK(daemons->Stop());

  // Per row: its time and wall over the threads row of the same W, and whether it sent the same
  // bytes at every step.
  bool wire_identical = true;
  for (size_t r = 0; r < out["rows"].size(); ++r) {
    nlohmann::json& row = out["rows"][r];
    const nlohmann::json& threads = out["rows"][r - r % kModes.size()];
    bool same = true;
    for (size_t s = 0; s < threads["steps"].size(); ++s) {
      same = same && threads["steps"][s]["wire_bytes"] == row["steps"][s]["wire_bytes"];
    }
    wire_identical = wire_identical && same;
    row["wire_identical_to_threads"] = same;
    row["time_over_threads"] = row["time_s"]["median"].get<double>() /
                               std::max(threads["time_s"]["median"].get<double>(), 1e-9);
    row["wall_over_threads"] = row["wall_s"]["median"].get<double>() /
                               std::max(threads["wall_s"]["median"].get<double>(), 1e-9);
  }
  out["wire_identical_across_modes"] = wire_identical;
  return out;
}

void PrintProducers(const nlohmann::json& section) {
  std::cout << fmt::format(
      "== producers, threads vs processes: bf16 model {} ({} tensors, {} export chunks of <= {}), "
      "W ranks -> {} `refit serve` daemon(s) over zmq://; {} delta steps at {:.0f}%, the same "
      "deltas for every configuration; {} threads/stage per rank\n",
      FormatBytes(section["model_bytes"]), section["tensors"].get<size_t>(),
      section["chunks"].get<size_t>(), FormatBytes(section["chunk_bytes"]),
      section["receivers"].get<size_t>(), section["steps"].get<uint64_t>(),
      100 * section["step_density"].get<double>(),
      section["threads_per_stage_per_rank"].get<int>());
  Table table({"W", "ranks as", "changed/step", "payloads", "wire/step", "time", "min", "max",
               "vs threads", "wall", "wall vs threads", "rank peak"});
  for (const nlohmann::json& row : section["rows"]) {
    const std::string mode = row["mode"];
    const bool threads = mode == "threads";
    table.AddRow({std::to_string(row["producers"].get<uint32_t>()),
                  threads               ? "threads"
                  : mode == "processes" ? "processes"
                                        : "push CLI",
                  fmt::format("{:.0f}", row["changed_per_step"].get<double>()),
                  fmt::format("{:.1f}", row["payloads_per_step"].get<double>()),
                  FormatBytes(static_cast<uint64_t>(row["wire_bytes_per_step"].get<double>())),
                  FormatDuration(row["time_s"]["median"]), FormatDuration(row["time_s"]["min"]),
                  FormatDuration(row["time_s"]["max"]),
                  threads ? "-" : fmt::format("{:.2f}x", row["time_over_threads"].get<double>()),
                  FormatDuration(row["wall_s"]["median"]),
                  threads ? "-" : fmt::format("{:.2f}x", row["wall_over_threads"].get<double>()),
                  threads ? std::string("-") : FormatBytes(row["rank_peak_rss"])});
  }
  table.Print(std::cout);
  std::cout << fmt::format(
      "threads = W Publishers in this process (in-process group); processes = W persistent rank "
      "processes (TCP group), each with its own copy of the model, meeting at a barrier after each "
      "step; push CLI = W `refit push --group` processes per step (each maps the checkpoint and "
      "its base, adopts the baseline and joins the group, then syncs once)\n"
      "time = median over the steps of rank 0's Coordinator::Refit (Begin to the end of commit); "
      "wall = threads and processes: rank 0's Sync call; push CLI: first rank spawned to last "
      "exited; rank peak = the largest rank process's peak RSS (its VmHWM at the last 10 ms poll "
      "before it exited)\n"
      "wire bytes identical for every mode at every W and step: {}; every daemon bit-identical "
      "to the producers' last model\n\n",
      section["wire_identical_across_modes"].get<bool>() ? "yes" : "NO");
}

}  // namespace refit::bench::e2e
