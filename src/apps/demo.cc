// refit demo: the main job on an embedded default. A simulated trainer (fp32 master + Adam,
// bf16 export) runs K steps; after each, its tracker encodes the changes into payloads, a
// receiver decodes and applies them, and both sides' state digests and bytes are compared.
#include <nlohmann/json.hpp>

#include <cstring>
#include <iostream>

#include "cli_common.h"
#include "refit/apply.h"
#include "refit/progress.h"
#include "refit/simulator.h"
#include "refit/weight_store.h"

namespace refit::cli {
namespace {

struct DemoArgs {
  std::string model_bytes = "64MiB";
  std::string dtype = "bfloat16";
  std::string op = "xor";
  int steps = 5;
  std::vector<double> densities = {0.01, 0.03, 0.05};
  uint64_t seed = 42;
  int threads = 2;
  bool json = false;
};

struct StepReport {
  int step = 0;
  bool anchor = false;
  double density = 0;
  uint64_t changed = 0;
  uint64_t full_bytes = 0;
  uint64_t wire_bytes = 0;
  size_t payloads = 0;
  double encode_s = 0;
  double apply_s = 0;
  bool verified = false;
};

/// One refit of `exported` into `store`: encode, decode, apply, verify, commit.
Result<StepReport> Refit(DeltaTracker& tracker, WeightStore& store,
                         const std::vector<TensorView>& exported, uint32_t producer_id) {
  StepReport report;
  const double t0 = NowSeconds();
  const TransferId id = TransferId::Random();
  REFIT_ASSIGN_OR_RETURN(TransferPlan plan, tracker.Begin(id));
  report.anchor = plan.anchor;
  std::vector<Item> items;
  uint64_t total = 0;
  for (const TensorView& tensor : exported) {
    REFIT_ASSIGN_OR_RETURN(EncodeResult r, tracker.Encode(id, tensor));
    report.changed += r.changed_elements;
    total += r.total_elements;
    report.full_bytes += tensor.bytes.size();
    for (Item& item : r.items) items.push_back(std::move(item));
  }
  const PayloadIds ids{id, producer_id, 0, plan.base_version, plan.target_version};
  constexpr uint64_t kBucketBytes = uint64_t{64} << 20;  // Bounded payloads, as on the wire.
  REFIT_ASSIGN_OR_RETURN(auto payloads, PackPayloads(ids, items, kBucketBytes, {}));
  const double t1 = NowSeconds();

  UndoLog undo;
  for (const auto& payload : payloads) {
    report.wire_bytes += payload.size();
    auto decoded = DecodePayload(payload);
    Status status = decoded.ok() ? ApplyPayload(*decoded, store, &undo) : decoded.status();
    if (!status.ok()) {
      REFIT_RETURN_NOT_OK(undo.Rollback(store));
      REFIT_RETURN_NOT_OK(tracker.Abort(id));
      return status;
    }
  }
  const double t2 = NowSeconds();
  report.payloads = payloads.size();
  report.density = total ? static_cast<double>(report.changed) / static_cast<double>(total) : 0;
  report.encode_s = t1 - t0;
  report.apply_s = t2 - t1;

  // Verify: digests kept in O(changes) on both sides agree, and so do the bytes themselves.
  bool same = store.Digests() == tracker.PendingDigests();
  for (const TensorView& tensor : exported) {
    auto held = std::as_const(store).Find(tensor.name);
    same = same && held.ok() &&
           std::memcmp(held->bytes.data(), tensor.bytes.data(), tensor.bytes.size()) == 0;
  }
  if (!same) {
    REFIT_RETURN_NOT_OK(undo.Rollback(store));
    REFIT_RETURN_NOT_OK(tracker.Abort(id));
    return DataLoss("step verification failed: receiver differs from trainer after transfer {}",
                    id.ToHex());
  }
  report.verified = true;
  REFIT_RETURN_NOT_OK(tracker.Commit(id));
  store.set_version(plan.target_version);
  return report;
}

Status RunDemo(const DemoArgs& args) {
  SimulatorOptions sim_options;
  REFIT_ASSIGN_OR_RETURN(sim_options.export_dtype, ParseDType(args.dtype));
  REFIT_ASSIGN_OR_RETURN(uint64_t model_bytes, ParseByteSize(args.model_bytes));
  sim_options.tensors = MakeTransformerSpec(model_bytes, sim_options.export_dtype);
  sim_options.seed = args.seed;
  sim_options.threads = args.threads;
  REFIT_ASSIGN_OR_RETURN(auto simulator, TrainingSimulator::Make(sim_options));

  TrackerOptions tracker_options;
  REFIT_ASSIGN_OR_RETURN(tracker_options.op, ParseOp(args.op));
  tracker_options.compare.threads = args.threads;
  REFIT_ASSIGN_OR_RETURN(auto tracker, DeltaTracker::Make(tracker_options));
  // The receiver starts empty-handed but holds the model's tensors (zeros) — the anchor fills it.
  auto store = WeightStore::Make();
  for (const TensorView& tensor : simulator->Exported()) {
    OwnedTensor zeros{tensor.name, tensor.dtype, tensor.shape,
                      std::vector<std::byte>(tensor.bytes.size())};
    REFIT_RETURN_NOT_OK(store->AddCopy(zeros.view()));
  }

  if (!args.json) {
    std::cout << fmt::format(
        "refit demo: simulated {} model ({}, {} tensors), {} steps, 1 producer -> 1 receiver\n\n",
        FormatBytes(simulator->exported_bytes()), DTypeName(sim_options.export_dtype),
        simulator->Exported().size(), args.steps);
  }
  ProgressReporter::Options progress_options;
  progress_options.label = "demo";
  progress_options.total = static_cast<uint64_t>(args.steps) + 1;
  progress_options.unit = "steps";
  REFIT_ASSIGN_OR_RETURN(auto progress, ProgressReporter::Make(progress_options));
  Table table({"step", "kind", "lr", "density", "changed", "full", "wire", "saved", "x smaller",
               "B/changed", "encode", "apply", "verified"});
  for (int step = 0; step <= args.steps; ++step) {
    if (step > 0) {
      if (!args.densities.empty()) {
        const double target = args.densities[(step - 1) % args.densities.size()];
        REFIT_RETURN_NOT_OK(simulator->CalibrateLearningRate(target));
      }
      REFIT_RETURN_NOT_OK(simulator->Step());
    }
    REFIT_ASSIGN_OR_RETURN(StepReport r, Refit(*tracker, *store, simulator->Exported(), 0));
    r.step = step;
    progress->Advance(1);
    const double ratio = r.wire_bytes ? static_cast<double>(r.full_bytes) / r.wire_bytes : 0;
    const double per_changed = r.changed ? static_cast<double>(r.wire_bytes) / r.changed : 0;
    if (args.json) {
      nlohmann::json line = {{"step", step},
                             {"kind", r.anchor ? "full" : "delta"},
                             {"learning_rate", simulator->learning_rate()},
                             {"density", r.density},
                             {"changed", r.changed},
                             {"full_bytes", r.full_bytes},
                             {"wire_bytes", r.wire_bytes},
                             {"payloads", r.payloads},
                             {"compression_ratio", ratio},
                             {"bytes_per_changed", per_changed},
                             {"encode_s", r.encode_s},
                             {"apply_s", r.apply_s},
                             {"verified", r.verified}};
      std::cout << line.dump() << std::endl;
      continue;
    }
    table.AddRow({std::to_string(step), r.anchor ? "FULL" : "delta",
                  step == 0 ? "-" : fmt::format("{:.3g}", simulator->learning_rate()),
                  fmt::format("{:.3f}%", 100 * r.density), std::to_string(r.changed),
                  FormatBytes(r.full_bytes), FormatBytes(r.wire_bytes),
                  fmt::format("{:.1f}%", 100.0 * (1.0 - 1.0 / std::max(ratio, 1e-9))),
                  fmt::format("{:.1f}", ratio), fmt::format("{:.3f}", per_changed),
                  FormatDuration(r.encode_s), FormatDuration(r.apply_s),
                  r.verified ? "yes" : "NO"});
  }
  progress->Finish();
  if (!args.json) {
    table.Print(std::cout);
    std::cout << "\nevery step verified: receiver bytes and state digests equal the trainer's\n";
  }
  return Status::OK();
}

}  // namespace

void RegisterDemo(CLI::App& app, Status* result) {
  auto args = std::make_shared<DemoArgs>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "Simulate an RL run and refit a receiver after every step, verifying each");
  cmd->add_option("--model-bytes", args->model_bytes, "Size of the simulated model")
      ->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "Export dtype: bfloat16 or float16")
      ->capture_default_str();
  cmd->add_option("--op", args->op, "Value op: xor, overwrite or add")->capture_default_str();
  cmd->add_option("--steps", args->steps, "Optimizer steps after the initial anchor")
      ->capture_default_str();
  cmd->add_option("--density", args->densities,
                  "Target changed fractions, cycled over the steps (empty: the natural density "
                  "of lr 1e-6)")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Random seed")->capture_default_str();
  cmd->add_option("--threads", args->threads, "Worker threads")->capture_default_str();
  cmd->add_flag("--json", args->json, "One JSON metrics line per step instead of the table");
  cmd->callback([args, result] { *result = RunDemo(*args); });
}

}  // namespace refit::cli
