#include "mpi_demo.h"

#include <stdlib.h>
#include <unistd.h>

#include <xxhash.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "process.h"
#include "progress.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "step_json.h"
#include "table.h"
#include "workload/simulator.h"

#if REFIT_HAVE_MPI
#include <mpi.h>

#include "refit/mpi.h"
#include "refit/mpi_producer_group.h"
#include "refit/publisher.h"
#include "refit/receiver_node.h"
#endif

namespace refit::cli {
namespace {

#if REFIT_HAVE_MPI

// Set by mpirun (Open MPI) or a PMI launcher in every rank it starts.
bool InsideMpiJob() {
  return ::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || ::getenv("PMI_SIZE") != nullptr ||
         ::getenv("PMIX_RANK") != nullptr;
}

// This process's command line, to run it again under mpirun.
Result<std::vector<std::string>> OwnCommandLine() {
  std::ifstream file("/proc/self/cmdline", std::ios::binary);
  if (!file) return IoError("demo: cannot read /proc/self/cmdline");
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  size_t start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\0') continue;
    args.push_back(text.substr(start, i - start));
    start = i + 1;
  }
  return args;
}

Status Relaunch(const MpiDemoSettings& settings) {
  REFIT_ASSIGN_OR_RETURN(std::vector<std::string> args, OwnCommandLine());
  REFIT_ASSIGN_OR_RETURN(args[0], testkit::SelfExecutable());
  std::vector<std::string> command = {"mpirun"};
  // Open MPI refuses root (containers, CI) and more ranks than cores without these.
  if (::geteuid() == 0) command.push_back("--allow-run-as-root");
  command.push_back("--oversubscribe");
  command.push_back("-np");
  command.push_back(std::to_string(settings.producers + settings.receivers));
  command.insert(command.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : command) argv.push_back(arg.data());
  argv.push_back(nullptr);
  if (!settings.json) {
    std::cerr << fmt::format("refit demo: starting {} ranks under mpirun\n",
                             settings.producers + settings.receivers);
  }
  ::execvp("mpirun", argv.data());
  return Unavailable(
      "demo: cannot run mpirun ({}): --transport mpi:// needs Open MPI's launcher on PATH "
      "(Debian: openmpi-bin)",
      std::strerror(errno));
}

uint64_t HashOf(const std::vector<TensorView>& tensors) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (const TensorView& tensor : tensors) {
    XXH3_64bits_update(state, tensor.bytes.data(), tensor.bytes.size());
  }
  const uint64_t hash = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return hash;
}

struct StepRow {
  int step = 0;
  RefitReport report;
};

// The MPI demo's line: the shared figures, and the transport.
nlohmann::json MpiStepJson(const StepRow& row, const RefitReport& full, double raw_copy_s) {
  nlohmann::json json = StepJson(row.step, row.report, full, raw_copy_s);
  json["transport"] = "mpi";
  return json;
}

// This rank's part of the job.
Status RunRank(const MpiDemoSettings& settings) {
  SimulatorOptions sim_options;
  REFIT_ASSIGN_OR_RETURN(sim_options.export_dtype, ParseDType(settings.dtype));
  sim_options.tensors = MakeTransformerSpec(settings.model_bytes, sim_options.export_dtype);
  sim_options.seed = settings.seed;
  sim_options.threads = settings.threads;
  // Every rank joins with the demo's layout, whatever the URI says about producers.
  REFIT_ASSIGN_OR_RETURN(TransportUri uri, TransportUri::Parse(settings.transport));
  std::erase_if(uri.params, [](const auto& param) { return param.first == "producers"; });
  uri.params.emplace_back("producers", std::to_string(settings.producers));
  MpiJobOptions job_options;
  job_options.producers = settings.producers;
  REFIT_ASSIGN_OR_RETURN(const MpiJobInfo info, JoinMpiJob(job_options));
  if (info.world_size != settings.producers + settings.receivers) {
    return InvalidArgument(
        "demo: the MPI job has {} ranks, the demo wants {} producers + {} "
        "receivers",
        info.world_size, settings.producers, settings.receivers);
  }
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<TrainingSimulator> simulator,
                         TrainingSimulator::Make(sim_options));
  const std::vector<TensorView> model = simulator->Exported();
  uint64_t model_bytes = 0;
  for (const TensorView& tensor : model) model_bytes += tensor.bytes.size();

  std::unique_ptr<Publisher> publisher;
  std::unique_ptr<ReceiverNode> node;
  std::vector<OwnedTensor> held;
  if (info.producer) {
    MpiGroupOptions group_options;
    group_options.communicator = info.producer_communicator;
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ProducerGroup> group, MakeMpiGroup(group_options));
    PublisherOptions options;
    options.transport_uri = uri.ToString();
    REFIT_ASSIGN_OR_RETURN(options.tracker.op, ParseOp(settings.op));
    options.tracker.compare.threads = settings.threads;
    options.stream.encode_threads = settings.threads;
    options.stream.serialize_threads = settings.threads;
    options.stream.send_threads = settings.threads;
    options.stream.chunk_bytes = std::min<uint64_t>(
        options.stream.chunk_bytes, std::max<uint64_t>(settings.model_bytes / 16, 1 << 20));
    REFIT_ASSIGN_OR_RETURN(publisher, Publisher::Make(options, std::move(group)));
  } else {
    // The receivers load the trainer's initial export, as a fleet loads the run's checkpoint.
    for (const TensorView& tensor : model) {
      held.push_back(OwnedTensor{tensor.name, tensor.dtype, tensor.shape,
                                 std::vector<std::byte>(tensor.bytes.begin(), tensor.bytes.end())});
    }
    simulator.reset();  // a receiver does not train
    ReceiverNodeOptions options;
    options.transport_uri = uri.ToString();
    options.version = 0;
    REFIT_ASSIGN_OR_RETURN(node, ReceiverNode::Make(options));
    for (OwnedTensor& tensor : held)
      REFIT_RETURN_NOT_OK(node->RegisterTensor(tensor.mutable_view()));
    REFIT_RETURN_NOT_OK(node->Start());
  }
  MPI_Barrier(MPI_COMM_WORLD);

  const bool leader = info.producer && info.index == 0;
  std::unique_ptr<ProgressReporter> progress;
  if (leader && !settings.json) {
    ProgressReporter::Options progress_options;
    progress_options.label = "demo";
    progress_options.total = static_cast<uint64_t>(settings.steps) + 1;
    progress_options.unit = "steps";
    REFIT_ASSIGN_OR_RETURN(progress, ProgressReporter::Make(progress_options));
  }
  if (leader && !settings.json) {
    std::cout << fmt::format(
        "refit demo: simulated {} model ({}, {} tensors), {} producer rank(s) -> {} receiver "
        "rank(s) over mpi:// (payloads and control on one MPI communicator), {} steps\n\n",
        FormatBytes(model_bytes), settings.dtype, model.size(), settings.producers,
        settings.receivers, settings.steps);
  }
  // Step 0: a FULL; then the yardstick: the model's bytes broadcast plainly to every rank.
  std::vector<StepRow> rows;
  Status failed;
  RefitReport full;
  if (info.producer) {
    Result<SyncReport> synced = publisher->Sync(model, /*force_anchor=*/true);
    if (synced.ok()) {
      full = synced->transfer;
      rows.push_back({0, full});
    } else {
      failed = synced.status();
    }
    if (progress) progress->Advance(1);
  }
  std::vector<std::byte> raw(model_bytes);
  if (leader) {
    size_t offset = 0;
    for (const TensorView& tensor : model) {
      std::memcpy(raw.data() + offset, tensor.bytes.data(), tensor.bytes.size());
      offset += tensor.bytes.size();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const auto raw_start = std::chrono::steady_clock::now();
  for (uint64_t offset = 0; offset < model_bytes; offset += uint64_t{1} << 30) {
    const int count = static_cast<int>(std::min<uint64_t>(uint64_t{1} << 30, model_bytes - offset));
    MPI_Bcast(raw.data() + offset, count, MPI_BYTE, 0, MPI_COMM_WORLD);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const double raw_copy_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - raw_start).count();
  raw = {};
  if (leader && settings.json)
    std::cout << MpiStepJson(rows.back(), full, raw_copy_s).dump() << std::endl;

  if (info.producer) {
    for (int step = 1; step <= settings.steps && failed.ok(); ++step) {
      if (!settings.densities.empty()) {
        const double target = settings.densities[(step - 1) % settings.densities.size()];
        REFIT_RETURN_NOT_OK(simulator->CalibrateLearningRate(target).status());
      }
      REFIT_RETURN_NOT_OK(simulator->Step());
      Result<SyncReport> synced = publisher->Sync(model);
      if (!synced.ok()) {
        failed = synced.status();
        break;
      }
      rows.push_back({step, synced->transfer});
      if (progress) progress->Advance(1);
      if (leader && settings.json) {
        std::cout << MpiStepJson(rows.back(), full, raw_copy_s).dump() << std::endl;
      }
    }
    if (progress) progress->Finish();
    publisher.reset();
    const Status closed = CloseMpiJob();
    if (failed.ok()) failed = closed;
  } else {
    REFIT_RETURN_NOT_OK(WaitForMpiJobEnd({}));
    node->Stop();
    node.reset();
  }

  // Every receiver's bytes against the trainer's: a hash of each rank's whole model.
  std::vector<TensorView> mine = model;
  if (!info.producer) {
    mine.clear();
    for (const OwnedTensor& tensor : held) mine.push_back(tensor.view());
  }
  const uint64_t hash = HashOf(mine);
  std::vector<uint64_t> hashes(info.world_size);
  MPI_Gather(&hash, 1, MPI_UINT64_T, hashes.data(), 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  FinalizeMpi();
  REFIT_RETURN_NOT_OK(failed);
  if (!leader) return Status::OK();
  for (uint32_t r = info.producers; r < info.world_size; ++r) {
    if (hashes[r] != hash) {
      return DataLoss("demo: receiver rank {} holds other bytes than the trainer", r);
    }
  }
  if (settings.json) return Status::OK();
  Table table({"step", "kind", "version", "density", "changed", "payloads", "wire", "saved", "time",
               "prepare", "stream", "flush", "commit", "vs raw copy", "vs FULL"});
  for (const StepRow& row : rows) {
    const nlohmann::json j = MpiStepJson(row, full, raw_copy_s);
    const RefitReport& r = row.report;
    table.AddRow({std::to_string(row.step), r.plan.anchor ? "FULL" : "delta",
                  std::to_string(r.plan.target_version),
                  fmt::format("{:.3f}%", 100 * j["density"].get<double>()),
                  std::to_string(r.changed_elements), std::to_string(r.payloads),
                  FormatBytes(r.wire_bytes),
                  fmt::format("{:.1f}%", 100.0 * (1.0 - static_cast<double>(r.wire_bytes) /
                                                            std::max<double>(full.wire_bytes, 1))),
                  FormatDuration(r.total_s), FormatDuration(r.prepare_s),
                  FormatDuration(r.stream_s), FormatDuration(r.flush_s), FormatDuration(r.commit_s),
                  fmt::format("{:.2f}x", j["time_over_raw_copy"].get<double>()),
                  fmt::format("{:.1f}x faster", j["speedup_vs_full"].get<double>())});
  }
  table.Print(std::cout);
  std::cout << fmt::format(
      "\nraw copy: MPI_Bcast of the model's {} to all {} ranks took {}; 'vs raw copy' is each "
      "step's time over that.\nevery step committed on all {} receivers with state digests equal "
      "to the producers'; every receiver's bytes equal the trainer's\n",
      FormatBytes(model_bytes), info.world_size, FormatDuration(raw_copy_s), settings.receivers);
  return Status::OK();
}

#endif  // REFIT_HAVE_MPI

}  // namespace

Status RunMpiDemo(const MpiDemoSettings& settings) {
#if REFIT_HAVE_MPI
  if (!InsideMpiJob()) return Relaunch(settings);
  return RunRank(settings);
#else
  (void)settings;
  return FailedPrecondition("demo: this refit was built without MPI: mpi:// is not available");
#endif
}

}  // namespace refit::cli
