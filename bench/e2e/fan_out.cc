// The fan-out section (sections.h): one producer refits 1, 2, 4, 8 daemons through the relay tree;
// its wire bytes must not grow with the fleet, and every daemon is checked bit for bit.
#include "e2e/sections.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "bench_util.h"
#include "e2e/harness.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "table.h"

namespace refit::bench::e2e {

Result<nlohmann::json> RunFanOut(const Args& args, const std::string& work_dir) {
  nlohmann::json out;
  out["density"] = args.fanout_density;
  out["rows"] = nlohmann::json::array();
  const std::string model_path = work_dir + "/fanout-model.safetensors";
  std::unique_ptr<ProgressReporter> progress = Progress("fan-out", args.fanout.size(), "fleets");
  for (size_t receivers : args.fanout) {
    // The same model and the same step for every fleet size: the producer's payloads are a
    // function of its inputs, so its wire bytes must come out identical.
    REFIT_ASSIGN_OR_RETURN(
        SyntheticModel model,
        SyntheticModel::Make(args.fanout_model_bytes, args.seed, args.threads, nullptr));
    out["model_bytes"] = model.bytes();
    out["tensors"] = model.views().size();
    REFIT_RETURN_NOT_OK(
        WriteSafetensors(model_path, model.views(), {{kWeightVersionMetadataKey, "0"}}));
    REFIT_ASSIGN_OR_RETURN(BenchFleet fleet,
                           StartFleet(args, work_dir, model_path, receivers, model.views()));
    std::filesystem::remove(model_path);
    // Delta first, FULL second, for the reason RunEndToEnd gives.
    REFIT_ASSIGN_OR_RETURN(const uint64_t changed, model.Step(/*step=*/1, args.fanout_density));
    REFIT_ASSIGN_OR_RETURN(RefitRow delta, MeasureRefit(fleet, /*full=*/false));
    if (delta.report.changed_elements != changed) {
      return DataLoss("fan-out x{}: the step changed {} elements but the tracker found {}",
                      receivers, changed, delta.report.changed_elements);
    }
    REFIT_ASSIGN_OR_RETURN(RefitRow full, MeasureRefit(fleet, /*full=*/true));
    const double t0 = Now();
    REFIT_RETURN_NOT_OK(VerifyFleet(*fleet.coordinator, model.views()));
    const double verify_s = Now() - t0;
    REFIT_RETURN_NOT_OK(fleet.daemons->Stop());
    out["rows"].push_back(
        {{"receivers", receivers},
         {"daemon_start_s", fleet.start_s},
         {"full_wire_bytes", full.report.wire_bytes},
         {"full_payloads", full.report.payloads},
         {"full_time_s", full.report.total_s},
         {"full_flush_s", full.report.flush_s},
         {"delta_density", Density(delta.report)},
         {"delta_changed", delta.report.changed_elements},
         {"delta_payloads", delta.report.payloads},
         {"delta_wire_bytes", delta.report.wire_bytes},
         {"delta_time_s", delta.report.total_s},
         {"delta_stream_s", delta.report.stream_s},
         {"delta_flush_s", delta.report.flush_s},
         {"delta_commit_s", delta.report.commit_s},
         {"delta_speedup_vs_full", full.report.total_s / std::max(delta.report.total_s, 1e-9)},
         {"receiver_peak_rss_full", full.rss.receiver_peak},
         {"receiver_peak_rss_delta", delta.rss.receiver_peak},
         {"verify_s", verify_s},
         {"verified_bit_identical", true}});
    if (progress) progress->Advance(1);
  }
  if (progress) progress->Finish();
  // Bytes out of the producer must not depend on the fleet size.
  bool constant = true;
  for (const nlohmann::json& row : out["rows"]) {
    constant = constant && row["full_wire_bytes"] == out["rows"][0]["full_wire_bytes"] &&
               row["delta_wire_bytes"] == out["rows"][0]["delta_wire_bytes"];
  }
  out["producer_wire_constant_in_receivers"] = constant;
  return out;
}

void PrintFanOut(const nlohmann::json& fanout) {
  std::cout << fmt::format(
      "== fan-out: bf16 model {} ({} tensors), 1 producer -> N daemons through the zmq:// "
      "relay tree, one {:.0f}% delta and a FULL\n",
      FormatBytes(fanout["model_bytes"]), fanout["tensors"].get<size_t>(),
      100 * fanout["density"].get<double>());
  Table table({"receivers", "full wire", "full time", "density", "delta wire", "delta time",
               "flush", "speedup", "delta vs N=1", "recv peak", "verified"});
  const double first_delta_s = fanout["rows"][0]["delta_time_s"];
  for (const nlohmann::json& row : fanout["rows"]) {
    table.AddRow({std::to_string(row["receivers"].get<size_t>()),
                  FormatBytes(row["full_wire_bytes"]), FormatDuration(row["full_time_s"]),
                  fmt::format("{:.3f}%", 100 * row["delta_density"].get<double>()),
                  FormatBytes(row["delta_wire_bytes"]), FormatDuration(row["delta_time_s"]),
                  FormatDuration(row["delta_flush_s"]),
                  fmt::format("{:.1f}x", row["delta_speedup_vs_full"].get<double>()),
                  fmt::format("{:.2f}x", row["delta_time_s"].get<double>() / first_delta_s),
                  FormatBytes(row["receiver_peak_rss_delta"]),
                  fmt::format("ok x{}", row["receivers"].get<size_t>())});
  }
  table.Print(std::cout);
  std::cout << fmt::format(
      "producer wire bytes constant in N (each payload sent once, to the root relay): {}\n"
      "verified: every tensor downloaded from every daemon equals the producer's bytes, and "
      "every daemon's state fingerprint equals the producer's\n\n",
      fanout["producer_wire_constant_in_receivers"].get<bool>() ? "yes" : "NO");
}

}  // namespace refit::bench::e2e
