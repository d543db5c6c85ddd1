// refit simulate: write consecutive checkpoints of a simulated RL run (fp32 master + Adam,
// exported to bf16/fp16), so deltas have the density and bit patterns of real training.
#include <filesystem>
#include <iostream>

#include <fmt/format.h>

#include "cli_common.h"
#include "codec/compare.h"
#include "config_file.h"
#include "progress.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "table.h"
#include "workload/simulator.h"

namespace refit::cli {
namespace {

struct SimulateArgs {
  std::string out_dir;
  std::string model_bytes = "64MiB";
  std::string dtype = "bfloat16";
  std::string init_from;
  int checkpoints = 3;
  double learning_rate = 1e-6;
  double density = 0.0;
  uint64_t seed = 42;
  int threads = 1;
};

Status RunSimulate(const SimulateArgs& args) {
  if (args.checkpoints < 1)
    return InvalidArgument("--checkpoints {} must be >= 1", args.checkpoints);
  SimulatorOptions options;
  REFIT_ASSIGN_OR_RETURN(options.export_dtype, ParseDType(args.dtype));
  REFIT_ASSIGN_OR_RETURN(uint64_t model_bytes, config::ParseByteSize(args.model_bytes));
  if (args.init_from.empty()) {
    options.tensors = MakeTransformerSpec(model_bytes, options.export_dtype);
  } else {
    options.init_from = args.init_from;
  }
  options.learning_rate = args.learning_rate;
  options.seed = args.seed;
  options.threads = args.threads;
  REFIT_ASSIGN_OR_RETURN(auto simulator, TrainingSimulator::Make(options));
  std::error_code ec;
  std::filesystem::create_directories(args.out_dir, ec);
  if (ec) return IoError("create directory '{}': {}", args.out_dir, ec.message());

  ProgressReporter::Options progress_options;
  progress_options.label = "simulate";
  progress_options.total = static_cast<uint64_t>(args.checkpoints);
  progress_options.unit = "checkpoints";
  REFIT_ASSIGN_OR_RETURN(auto progress, ProgressReporter::Make(progress_options));

  Table table({"checkpoint", "file", "lr", "changed", "density"});
  std::vector<std::vector<std::byte>> previous;
  for (int k = 0; k < args.checkpoints; ++k) {
    if (k > 0) {
      if (args.density > 0) REFIT_RETURN_NOT_OK(simulator->CalibrateLearningRate(args.density));
      REFIT_RETURN_NOT_OK(simulator->Step());
    }
    const std::vector<TensorView> tensors = simulator->Exported();
    uint64_t changed = 0, total = 0;
    for (size_t t = 0; t < tensors.size(); ++t) {
      const uint32_t width = DTypeSize(tensors[t].dtype);
      total += tensors[t].numel();
      if (k > 0) {
        REFIT_ASSIGN_OR_RETURN(auto locations, FindChangedLocations(previous[t], tensors[t].bytes,
                                                                    width, 0, tensors[t].numel()));
        changed += locations.size();
      }
    }
    previous.clear();
    for (const TensorView& t : tensors) previous.emplace_back(t.bytes.begin(), t.bytes.end());
    const std::string path = fmt::format("{}/step_{:04d}.safetensors", args.out_dir, k);
    REFIT_RETURN_NOT_OK(
        WriteSafetensors(path, tensors, {{kWeightVersionMetadataKey, std::to_string(k)}}));
    table.AddRow({std::to_string(k), path, fmt::format("{:.3g}", simulator->learning_rate()),
                  k > 0 ? std::to_string(changed) : "-",
                  k > 0 ? fmt::format("{:.4f}%", 100.0 * static_cast<double>(changed) /
                                                     static_cast<double>(total))
                        : "-"});
    progress->Advance(1);
  }
  progress->Finish();
  table.Print(std::cout);
  return Status::OK();
}

}  // namespace

void RegisterSimulate(CLI::App& app, Status* result) {
  auto args = std::make_shared<SimulateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "simulate", "Write consecutive checkpoints of a simulated RL run (Adam, bf16 export)");
  cmd->add_option("-o,--out", args->out_dir, "Output directory")->required();
  cmd->add_option("--checkpoints", args->checkpoints,
                  "Checkpoints to write (the first is the "
                  "initial model)")
      ->capture_default_str();
  cmd->add_option("--model-bytes", args->model_bytes, "Size of the synthetic model")
      ->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "Export dtype: bfloat16, float16 or float32")
      ->capture_default_str();
  cmd->add_option("--init-from", args->init_from, "Start from this safetensors file instead");
  cmd->add_option("--lr", args->learning_rate, "Adam learning rate")->capture_default_str();
  cmd->add_option("--density", args->density,
                  "Calibrate the learning rate before each step to change this fraction (0..1)");
  cmd->add_option("--seed", args->seed, "Random seed")->capture_default_str();
  cmd->add_option("--threads", args->threads, "Worker threads")->capture_default_str();
  cmd->callback([args, result] { *result = RunSimulate(*args); });
}

}  // namespace refit::cli
