// The end-to-end section (sections.h): one producer refits one daemon at each density, then a FULL
// of the same model, against a raw copy of its bytes and a compare-only pass; the throughput
// targets are figures of this section.
#include "e2e/sections.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench_util.h"
#include "codec/compare.h"
#include "e2e/harness.h"
#include "raw_copy.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "table.h"
#include "util/thread_pool.h"

namespace refit::bench::e2e {
namespace {

// The density whose speedup the target is stated at, and the target itself (the figure).
constexpr double kTargetDensity = 0.03;
constexpr double kTargetSpeedup = 10.0;
// Targets of the throughput figures (the table), each printed MET or NOT MET.
constexpr double kTargetFullOverRaw = 1.3;
constexpr double kTargetDeltaOverRaw = 0.5;
constexpr double kTargetReceiverBytesPerChanged = 2.0;
constexpr double kTargetProducerBytesPerChanged = 12.0;
constexpr double kTargetFullPeakOverModel = 1.1;
constexpr double kTargetCommitShare = 0.05;
constexpr double kTargetDeltaOverCompare = 2.0;
// Elements the compare-only pass compares at a time: its locations go into one reused buffer of
// this many, so that the pass allocates nothing the refit's memory figures would then carry.
constexpr uint64_t kCompareOnlyBlock = uint64_t{1} << 20;

// The model's bytes, uncompressed, over ZeroMQ into another process on loopback, in messages of
// the bucket size from the same number of send threads as the refits: no codec, digest or apply.
Result<nlohmann::json> MeasureRawCopy(const Args& args, const std::string& work_dir,
                                      const std::vector<TensorView>& model) {
  cli::RawCopyOptions options;
  options.refit_binary = args.refit_binary;
  options.work_dir = work_dir;
  options.receivers = 1;
  options.message_bytes = args.bucket_bytes;
  options.threads = args.threads;
  REFIT_ASSIGN_OR_RETURN(const cli::RawCopyMeasurement copy,
                         cli::MeasureZmqRawCopy(model, options));
  return nlohmann::json{{"seconds", copy.seconds},
                        {"bytes", copy.bytes},
                        {"messages", copy.messages},
                        {"message_bytes", copy.message_bytes},
                        {"threads", copy.threads},
                        {"receivers", copy.receivers},
                        {"bytes_per_s", copy.bytes / std::max(copy.seconds, 1e-9)},
                        {"verified", true}};
}

// The compare alone: every tensor of `model` against the producer's baseline, bit by bit, with
// the changed indices extracted (AppendChangedLocations, what the tracker's compare does) on as
// many threads as the producer encodes with, one tensor at a time per thread — what a delta
// refit cannot do without. Only with one producer, whose tracker holds every tensor (zero
// otherwise: not measured).
Result<double> MeasureCompareOnly(const BenchFleet& fleet, const std::vector<TensorView>& model,
                                  int threads) {
  const auto& trackers = fleet.coordinator->trackers();
  if (trackers.size() != 1) return 0.0;
  const internal::DeltaTracker& tracker = *trackers.front();
  std::vector<TensorView> baselines;
  for (const TensorView& tensor : model) {
    REFIT_ASSIGN_OR_RETURN(TensorView baseline, tracker.Baseline(tensor.name));
    baselines.push_back(baseline);
  }
  std::atomic<uint64_t> changed{0};
  const double t0 = Now();
  REFIT_RETURN_NOT_OK(
      internal::ParallelFor(threads, model.size(), [&](uint64_t begin, uint64_t end) -> Status {
        std::vector<uint64_t> locations;
        locations.reserve(kCompareOnlyBlock);
        uint64_t found = 0;
        for (uint64_t t = begin; t < end; ++t) {
          const uint32_t width = DTypeSize(model[t].dtype);
          const uint64_t numel = model[t].bytes.size() / width;
          for (uint64_t b = 0; b < numel; b += kCompareOnlyBlock) {
            locations.clear();
            AppendChangedLocations(baselines[t].bytes, model[t].bytes, width, b,
                                   std::min(numel, b + kCompareOnlyBlock), &locations);
            found += locations.size();
          }
        }
        changed += found;
        return Status::OK();
      }));
  const double seconds = Now() - t0;
  // The compare must see the step's changes, or it measured nothing.
  if (changed.load() == 0) return Internal("the compare-only pass found no change");
  return seconds;
}

nlohmann::json RowJson(const RefitRow& row, const RefitRow& full, uint64_t model_bytes) {
  const RefitReport& r = row.report;
  const StreamReport& s = r.producers.front();
  const uint64_t producer_held = model_bytes + row.baseline_bytes;
  const auto over = [](uint64_t peak, uint64_t held) {
    return static_cast<int64_t>(peak) - static_cast<int64_t>(held);
  };
  nlohmann::json receivers = nlohmann::json::array();
  for (const ReceiverOutcome& outcome : r.receivers)
    receivers.push_back(ReceiverOutcomeJson(outcome));
  return {
      {"kind", row.full ? "full" : "delta"},
      {"transfer_id", r.plan.transfer_id.ToHex()},
      {"target_version", r.plan.target_version},
      {"target_density", row.target_density},
      {"density", Density(r)},
      {"changed", r.changed_elements},
      {"changed_by_step", row.changed_by_step},
      {"total_elements", r.total_elements},
      {"chunks", s.chunks},
      {"payloads", r.payloads},
      {"items", s.items},
      {"item_bytes", s.item_bytes},
      {"wire_bytes", r.wire_bytes},
      {"wire_over_full", static_cast<double>(r.wire_bytes) /
                             static_cast<double>(std::max<uint64_t>(full.report.wire_bytes, 1))},
      {"wire_bytes_per_changed",
       r.changed_elements ? static_cast<double>(r.wire_bytes) / r.changed_elements : 0.0},
      {"time_s", r.total_s},
      {"prepare_s", r.prepare_s},
      {"stream_s", r.stream_s},
      {"flush_s", r.flush_s},
      {"commit_s", r.commit_s},
      {"trainer_visible_s", r.total_s},
      {"baseline_fold_s", row.baseline_fold_s},
      {"speedup_vs_full", full.report.total_s / std::max(r.total_s, 1e-9)},
      {"compare_only_s", row.compare_only_s > 0 ? nlohmann::json(row.compare_only_s) : nullptr},
      {"time_over_compare_only",
       row.compare_only_s > 0 ? nlohmann::json(r.total_s / row.compare_only_s) : nullptr},
      {"producer_stages", ProducerStagesJson(s)},
      {"anchor_compression", AnchorCompressionJson(s.anchor_compression)},
      {"rss_reset_per_refit", row.rss.reset},
      {"producer_rss_before", row.rss.producer_before},
      {"producer_peak_rss", row.rss.producer_peak},
      {"producer_held_bytes", producer_held},
      {"producer_over_held_bytes", over(row.rss.producer_peak, producer_held)},
      {"producer_peak_over_before_bytes", over(row.rss.producer_peak, row.rss.producer_before)},
      {"tracker_baseline_bytes", row.baseline_bytes},
      {"receiver_rss_before", row.rss.receiver_before},
      {"receiver_peak_rss", row.rss.receiver_peak},
      {"receiver_over_model_bytes", over(row.rss.receiver_peak, model_bytes)},
      {"receiver_peak_over_before_bytes", over(row.rss.receiver_peak, row.rss.receiver_before)},
      {"receivers", receivers}};
}

// One figure against its target: {figure, value, target, met} (value null: not measured).
nlohmann::json TargetFigure(std::string figure, std::optional<double> value, double target,
                            std::string note = "") {
  return {{"figure", std::move(figure)},
          {"value", value ? nlohmann::json(*value) : nullptr},
          {"target", target},
          {"met", value ? nlohmann::json(*value <= target) : nullptr},
          {"note", std::move(note)}};
}

// The throughput targets that the end-to-end section measures, each a ratio or a slope
// of one run: every one printed MET or NOT MET, never adjusted.
nlohmann::json ThroughputTargets(const nlohmann::json& e2e, const nlohmann::json* target_row,
                                 uint64_t model_bytes) {
  const nlohmann::json* full = nullptr;
  for (const nlohmann::json& row : e2e["rows"]) {
    if (row["kind"] == "full") full = &row;
  }
  const auto ratio = [](const nlohmann::json* row, std::string_view key) {
    return row != nullptr && !(*row)[key].is_null() ? std::optional<double>((*row)[key])
                                                    : std::nullopt;
  };
  const auto slope = [&](std::string_view who) -> std::optional<double> {
    if (!e2e.contains("memory_fit") || !e2e["memory_fit"].contains(who)) return std::nullopt;
    return e2e["memory_fit"][who]["bytes_per_changed"].get<double>();
  };
  nlohmann::json targets = nlohmann::json::array();
  targets.push_back(TargetFigure("FULL time / raw-copy time", ratio(full, "time_over_raw_copy"),
                                 kTargetFullOverRaw));
  targets.push_back(TargetFigure("3% delta time / raw-copy time",
                                 ratio(target_row, "time_over_raw_copy"), kTargetDeltaOverRaw));
  targets.push_back(TargetFigure("3% delta time / compare-only time (same model, threads)",
                                 ratio(target_row, "time_over_compare_only"),
                                 kTargetDeltaOverCompare));
  targets.push_back(TargetFigure("receiver bytes per changed element (XOR deltas)",
                                 slope("receiver"), kTargetReceiverBytesPerChanged));
  targets.push_back(TargetFigure("producer bytes per changed element over model + baseline",
                                 slope("producer"), kTargetProducerBytesPerChanged));
  std::optional<double> full_peak;
  if (full != nullptr) {
    full_peak = (*full)["receiver_peak_rss"].get<double>() / static_cast<double>(model_bytes);
  }
  const std::string undo = e2e["anchor_undo"];
  targets.push_back(TargetFigure(
      "receiver peak during a FULL / model", full_peak, kTargetFullPeakOverModel,
      undo == "none" ? "anchor_undo none" : "anchor_undo " + undo + " (the target is for none)"));
  std::optional<double> commit_share;
  if (target_row != nullptr) {
    commit_share = (*target_row)["commit_s"].get<double>() / (*target_row)["time_s"].get<double>();
  }
  targets.push_back(
      TargetFigure("commit phase / delta time at 3%", commit_share, kTargetCommitShare));
  return targets;
}

void PrintTargets(const nlohmann::json& targets) {
  Table table({"figure", "measured", "target", "result"});
  for (const nlohmann::json& t : targets) {
    const bool measured = !t["value"].is_null();
    table.AddRow(
        {t["figure"].get<std::string>() + (t["note"].get<std::string>().empty()
                                               ? ""
                                               : " (" + t["note"].get<std::string>() + ")"),
         measured ? fmt::format("{:.3f}", t["value"].get<double>()) : "-",
         fmt::format("<= {:.2f}", t["target"].get<double>()),
         measured ? (t["met"].get<bool>() ? "MET" : "NOT MET") : "not measured"});
  }
  table.Print(std::cout);
}

}  // namespace

Result<nlohmann::json> RunEndToEnd(const Args& args, const std::string& work_dir) {
  nlohmann::json out;
  const std::string model_path = work_dir + "/e2e-model.safetensors";
  double t0 = Now();
  std::unique_ptr<ProgressReporter> progress =
      Progress("e2e: generate model", args.model_bytes, "B");
  REFIT_ASSIGN_OR_RETURN(SyntheticModel model, SyntheticModel::Make(args.model_bytes, args.seed,
                                                                    args.threads, progress.get()));
  if (progress) progress->Finish();
  out["model_bytes"] = model.bytes();
  out["tensors"] = model.views().size();
  out["generate_s"] = Now() - t0;
  t0 = Now();
  REFIT_RETURN_NOT_OK(
      WriteSafetensors(model_path, model.views(), {{kWeightVersionMetadataKey, "0"}}));
  out["write_s"] = Now() - t0;
  REFIT_ASSIGN_OR_RETURN(BenchFleet fleet,
                         StartFleet(args, work_dir, model_path, kEndToEndReceivers, model.views()));
  // Loaded (read into memory, or mapped: the open mapping keeps the file's pages): the path can
  // go, and with it the page cache a RAM-loading daemon no longer needs.
  std::filesystem::remove(model_path);
  out["daemon_start_s"] = fleet.start_s;
  out["receiver_mode"] = args.receiver_mmap ? "mmap" : "ram";

  progress = Progress("e2e: refits", 1 + args.densities.size(), "refits");
  // The deltas run first, in ascending density, and the FULL last: a FULL's undo log holds the
  // old bits of the whole model until commit, and the allocator keeps much of that memory after
  // freeing it, which would hide the deltas' O(changes) memory inside the peak RSS. Ascending
  // densities likewise keep each delta's memory above what the previous one left behind.
  std::vector<double> densities = args.densities;
  std::sort(densities.begin(), densities.end());
  std::vector<RefitRow> rows(1);
  for (size_t k = 0; k < densities.size(); ++k) {
    REFIT_ASSIGN_OR_RETURN(const uint64_t changed, model.Step(/*step=*/k + 1, densities[k]));
    REFIT_ASSIGN_OR_RETURN(const double compare_only_s,
                           MeasureCompareOnly(fleet, model.views(), args.threads));
    REFIT_ASSIGN_OR_RETURN(RefitRow row, MeasureRefit(fleet, /*full=*/false));
    row.compare_only_s = compare_only_s;
    row.target_density = densities[k];
    row.changed_by_step = changed;
    if (row.report.changed_elements != changed) {
      return DataLoss("step {} changed {} elements but the tracker found {}", k + 1, changed,
                      row.report.changed_elements);
    }
    rows.push_back(std::move(row));
    if (progress) progress->Advance(1);
  }
  // The yardstick: every element of the same model through the same fleet.
  REFIT_ASSIGN_OR_RETURN(rows.front(), MeasureRefit(fleet, /*full=*/true));
  const RefitRow& full = rows.front();
  if (progress) progress->Finish();
  if (args.verify_end_to_end) {
    t0 = Now();
    REFIT_RETURN_NOT_OK(VerifyFleet(*fleet.coordinator, model.views()));
    out["verify_s"] = Now() - t0;
  }
  out["verified_bit_identical"] = args.verify_end_to_end;
  REFIT_RETURN_NOT_OK(fleet.daemons->Stop());
  out["anchor_undo"] = std::string(AnchorUndoName(args.anchor_undo));
  out["receiver_apply_threads"] = args.apply_threads;
  out["anchor_compression"] = std::string(AnchorCompressionName(args.anchor_compression));
  // The yardstick, after the daemon is gone (its memory with it): the same bytes, the same
  // loopback and send threads, nothing but the copy.
  double raw_s = 0;
  if (args.raw_copy) {
    REFIT_ASSIGN_OR_RETURN(out["raw_copy"], MeasureRawCopy(args, work_dir, model.views()));
    raw_s = out["raw_copy"]["seconds"];
  }

  out["rows"] = nlohmann::json::array();
  for (const RefitRow& row : rows) {
    nlohmann::json json = RowJson(row, full, model.bytes());
    json["time_over_raw_copy"] = raw_s > 0 ? nlohmann::json(row.report.total_s / raw_s) : nullptr;
    out["rows"].push_back(std::move(json));
  }
  // The target row: the density closest to kTargetDensity, if one was measured close enough.
  const nlohmann::json* target_row = nullptr;
  for (const nlohmann::json& row : out["rows"]) {
    if (row["kind"] == "delta" &&
        std::fabs(row["target_density"].get<double>() - kTargetDensity) < 1e-9) {
      target_row = &row;
    }
  }
  // Memory beyond what each process must hold, against the changes of each delta.
  std::vector<std::pair<double, double>> producer_points, receiver_points;
  for (const nlohmann::json& row : out["rows"]) {
    if (row["kind"] != "delta") continue;
    const double changed = static_cast<double>(row["changed"].get<uint64_t>());
    producer_points.emplace_back(
        changed, static_cast<double>(row["producer_over_held_bytes"].get<int64_t>()));
    receiver_points.emplace_back(
        changed, static_cast<double>(row["receiver_over_model_bytes"].get<int64_t>()));
  }
  for (const auto& [name, points] :
       {std::pair{"producer", &producer_points}, std::pair{"receiver", &receiver_points}}) {
    if (std::optional<MemoryFit> fit = FitMemory(*points)) {
      out["memory_fit"][name] = {{"fixed_bytes", fit->fixed_bytes},
                                 {"bytes_per_changed", fit->bytes_per_changed}};
    }
  }
  out["target"] = {{"density", kTargetDensity}, {"min_speedup_vs_full", kTargetSpeedup}};
  if (target_row != nullptr) {
    const double speedup = (*target_row)["speedup_vs_full"];
    out["target"]["speedup_vs_full"] = speedup;
    out["target"]["met"] = speedup >= kTargetSpeedup;
  } else {
    out["target"]["met"] = nullptr;
  }
  out["targets"] = ThroughputTargets(out, target_row, model.bytes());
  return out;
}

void PrintEndToEnd(const nlohmann::json& e2e, const Args& args) {
  const uint64_t model_bytes = e2e["model_bytes"];
  std::cout << fmt::format(
      "== end to end: bf16 model {} ({} tensors), 1 producer -> {} `refit serve` daemon "
      "({} load) on loopback, zmq:// + HTTP control; chunks {}, buckets {} (a delta's {}), {} "
      "threads/stage\n",
      FormatBytes(model_bytes), e2e["tensors"].get<size_t>(), kEndToEndReceivers,
      e2e["receiver_mode"].get<std::string>(), FormatBytes(args.chunk_bytes),
      FormatBytes(args.bucket_bytes),
      FormatBytes(args.delta_bucket_bytes == 0
                      ? args.bucket_bytes
                      : std::min(args.bucket_bytes, args.delta_bucket_bytes)),
      args.threads);
  Table table({"kind", "density", "changed", "payloads", "wire", "wire/full", "time", "stream",
               "flush", "commit", "fold (bg)", "speedup", "vs raw", "prod peak", "prod over",
               "recv peak", "recv over"});
  for (const nlohmann::json& row : e2e["rows"]) {
    const bool full = row["kind"] == "full";
    table.AddRow(
        {full ? "FULL" : "delta",
         full ? "-" : fmt::format("{:.3f}%", 100 * row["density"].get<double>()),
         std::to_string(row["changed"].get<uint64_t>()),
         std::to_string(row["payloads"].get<uint64_t>()), FormatBytes(row["wire_bytes"]),
         fmt::format("{:.4f}", row["wire_over_full"].get<double>()), FormatDuration(row["time_s"]),
         FormatDuration(row["stream_s"]), FormatDuration(row["flush_s"]),
         FormatDuration(row["commit_s"]), FormatDuration(row["baseline_fold_s"]),
         fmt::format("{:.1f}x", row["speedup_vs_full"].get<double>()),
         row["time_over_raw_copy"].is_null()
             ? std::string("-")
             : fmt::format("{:.2f}", row["time_over_raw_copy"].get<double>()),
         FormatBytes(row["producer_peak_rss"]), SignedBytes(row["producer_over_held_bytes"]),
         FormatBytes(row["receiver_peak_rss"]), SignedBytes(row["receiver_over_model_bytes"])});
  }
  table.Print(std::cout);
  if (e2e.contains("raw_copy")) {
    const nlohmann::json& raw = e2e["raw_copy"];
    std::cout << fmt::format(
        "raw copy (the yardstick): {} over ZeroMQ/TCP loopback into a `refit raw-copy-sink` "
        "process in {} "
        "({:.0f} MB/s), {} messages of at most {} from {} threads, no codec, digest or apply; "
        "checksum "
        "verified. vs raw = refit time / raw-copy time\n",
        FormatBytes(raw["bytes"]), FormatDuration(raw["seconds"]),
        raw["bytes_per_s"].get<double>() / 1e6, raw["messages"].get<uint64_t>(),
        FormatBytes(raw["message_bytes"]), raw["threads"].get<int>());
  }
  for (const nlohmann::json& row : e2e["rows"]) {
    if (row["kind"] != "full") continue;
    const nlohmann::json& c = row["anchor_compression"];
    std::cout << fmt::format(
        "FULL: anchor_compression {} -> {} payloads zstd, {} raw{}; receivers' anchor_undo {}, "
        "{} apply thread(s)\n",
        e2e["anchor_compression"].get<std::string>(), c["compressed_payloads"].get<uint64_t>(),
        c["raw_payloads"].get<uint64_t>(),
        c["measured"].get<bool>()
            ? fmt::format(" (measured: zstd {:.0f} MB/s to {:.3f} of the body, link {:.0f} MB/s)",
                          c["compress_bytes_per_s"].get<double>() / 1e6, c["ratio"].get<double>(),
                          c["link_bytes_per_s"].get<double>() / 1e6)
            : "",
        e2e["anchor_undo"].get<std::string>(), e2e["receiver_apply_threads"].get<int>());
  }
  const nlohmann::json& target = e2e["target"];
  if (target["met"].is_null()) {
    std::cout << fmt::format(
        "target: delta at {:.0f}% >= {:.0f}x faster than FULL: not measured "
        "(no {:.0f}% row in --densities)\n",
        100 * kTargetDensity, kTargetSpeedup, 100 * kTargetDensity);
  } else {
    std::cout << fmt::format(
        "target: delta at {:.0f}% >= {:.0f}x faster than FULL: {:.1f}x measured -> {}\n",
        100 * kTargetDensity, kTargetSpeedup, target["speedup_vs_full"].get<double>(),
        target["met"].get<bool>() ? "MET" : "NOT MET");
  }
  std::cout << "time = what the trainer waits for (to the fleet's commit); fold (bg) = the "
               "tracker's baseline fold after it, in the background (the next sync waits for it "
               "only if it is not done)\n";
  std::cout << "prod over = producer peak RSS - (model + tracker baseline); recv over = receiver "
               "peak RSS - model. Peaks are per refit (VmHWM reset before each).\n";
  if (e2e.contains("memory_fit")) {
    // "+ 64.0 MiB" or "- 64.0 MiB": a term of the fitted line.
    const auto term = [](const nlohmann::json& fit) {
      const double fixed = fit["fixed_bytes"];
      return fmt::format("{} {} + {:.1f} B per changed element", fixed < 0 ? "-" : "+",
                         FormatBytes(static_cast<uint64_t>(std::fabs(fixed))),
                         fit["bytes_per_changed"].get<double>());
    };
    std::cout << fmt::format(
        "memory over the deltas (least squares): producer = model + baseline {}; receiver = "
        "model {}\n",
        term(e2e["memory_fit"]["producer"]), term(e2e["memory_fit"]["receiver"]));
  }
  std::cout << "throughput targets (one run; each figure a ratio or slope of this run):\n";
  PrintTargets(e2e["targets"]);
  std::cout << fmt::format(
      "model generated in {}, written in {}, daemon loaded it in {}{}\n\n",
      FormatDuration(e2e["generate_s"]), FormatDuration(e2e["write_s"]),
      FormatDuration(e2e["daemon_start_s"]),
      e2e.contains("verify_s")
          ? fmt::format("; every tensor downloaded and compared in {}: bit-identical",
                        FormatDuration(e2e["verify_s"]))
          : "");
}

}  // namespace refit::bench::e2e
