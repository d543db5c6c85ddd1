// refit diff OLD NEW: what changed between two checkpoints and what each encoding would cost.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <array>
#include <iostream>

#include "cli_common.h"
#include "codec/locations.h"
#include "codec/tracker.h"
#include "pipeline/bucketing.h"
#include "progress.h"
#include "refit/safetensors.h"
#include "table.h"

namespace refit::cli {
namespace {

struct DiffArgs {
  std::string old_path;
  std::string new_path;
  bool json = false;
  int threads = 1;
};

constexpr std::array<LocationEncoding, 5> kSparseEncodings = {
    LocationEncoding::kRange, LocationEncoding::kGap16, LocationEncoding::kGap32,
    LocationEncoding::kGap64, LocationEncoding::kBitmask};

Status RunDiff(const DiffArgs& args) {
  REFIT_ASSIGN_OR_RETURN(auto old_file, SafetensorsFile::Open(args.old_path));
  REFIT_ASSIGN_OR_RETURN(auto new_file, SafetensorsFile::Open(args.new_path));
  TrackerOptions options;
  options.compare.threads = args.threads;
  REFIT_ASSIGN_OR_RETURN(auto tracker, internal::DeltaTracker::Make(options));
  for (const TensorView& tensor : old_file->tensors()) {
    REFIT_RETURN_NOT_OK(tracker->AdoptBaseline(tensor));
  }

  const TransferId id = TransferId::Random();
  REFIT_ASSIGN_OR_RETURN(TransferPlan plan, tracker->Begin(id));
  nlohmann::json report;
  report["old"] = args.old_path;
  report["new"] = args.new_path;
  report["tensors"] = nlohmann::json::array();
  std::map<std::string, uint64_t> by_encoding;
  uint64_t changed = 0, total = 0, value_bytes = 0, chosen_location_bytes = 0;
  std::vector<Item> items;
  Table table(
      {"tensor", "dtype", "elements", "changed", "density", "encoding", "locations", "values"});
  for (const TensorView& tensor : new_file->tensors()) {
    REFIT_ASSIGN_OR_RETURN(internal::EncodeResult r, tracker->Encode(id, tensor));
    changed += r.changed_elements;
    total += r.total_elements;
    nlohmann::json row = {{"name", tensor.name},
                          {"dtype", DTypeName(tensor.dtype)},
                          {"elements", r.total_elements},
                          {"changed", r.changed_elements},
                          {"density", r.total_elements ? static_cast<double>(r.changed_elements) /
                                                             static_cast<double>(r.total_elements)
                                                       : 0.0}};
    std::string encoding = "-";
    uint64_t location_bytes = 0, item_value_bytes = 0;
    for (const Item& item : r.items) {
      REFIT_ASSIGN_OR_RETURN(std::vector<uint64_t> locations, DecodeAllLocations(item.view()));
      for (LocationEncoding e : kSparseEncodings) {
        const uint64_t estimate =
            EstimateLocationBytes(e, locations, item.span_begin, item.span_end);
        if (estimate != UINT64_MAX) by_encoding[std::string(LocationEncodingName(e))] += estimate;
      }
      encoding = std::string(LocationEncodingName(item.location_encoding));
      location_bytes += item.locations.size();
      item_value_bytes += item.values.size();
    }
    chosen_location_bytes += location_bytes;
    value_bytes += item_value_bytes;
    row["encoding"] = encoding;
    row["location_bytes"] = location_bytes;
    row["value_bytes"] = item_value_bytes;
    table.AddRow({tensor.name, std::string(DTypeName(tensor.dtype)),
                  std::to_string(r.total_elements), std::to_string(r.changed_elements),
                  fmt::format("{:.4f}%", 100.0 * row["density"].get<double>()), encoding,
                  FormatBytes(location_bytes), FormatBytes(item_value_bytes)});
    report["tensors"].push_back(std::move(row));
    for (Item& item : r.items) items.push_back(std::move(item));
  }
  const PayloadIds ids{id, 0, 0, plan.base_version, plan.target_version};
  REFIT_ASSIGN_OR_RETURN(auto payloads,
                         PackPayloads(ids, items, uint64_t{1} << 40, PayloadEncodeOptions{}));
  uint64_t payload_bytes = 0;
  for (const auto& p : payloads) payload_bytes += p.size();
  uint64_t full_bytes = 0;
  for (const TensorView& tensor : new_file->tensors()) full_bytes += tensor.bytes.size();

  report["total"] = {
      {"elements", total},
      {"changed", changed},
      {"density", total ? static_cast<double>(changed) / static_cast<double>(total) : 0.0},
      {"location_bytes", chosen_location_bytes},
      {"value_bytes", value_bytes},
      {"payload_bytes", payload_bytes},
      {"full_bytes", full_bytes},
      {"bytes_per_changed_element",
       changed ? static_cast<double>(payload_bytes) / static_cast<double>(changed) : 0.0}};
  report["location_bytes_by_encoding"] = by_encoding;
  report["location_bytes_by_encoding"]["chosen"] = chosen_location_bytes;
  if (args.json) {
    std::cout << report.dump(2) << "\n";
    return Status::OK();
  }
  table.AddRow({"TOTAL", "", std::to_string(total), std::to_string(changed),
                fmt::format("{:.4f}%", 100.0 * report["total"]["density"].get<double>()), "",
                FormatBytes(chosen_location_bytes), FormatBytes(value_bytes)});
  table.Print(std::cout);
  std::cout << "\nlocation bytes by encoding (before compression):\n";
  Table encodings({"encoding", "bytes"});
  for (const auto& [name, bytes] : by_encoding) encodings.AddRow({name, FormatBytes(bytes)});
  encodings.AddRow({"chosen per item", FormatBytes(chosen_location_bytes)});
  encodings.Print(std::cout);
  std::cout << fmt::format(
      "\npayload (zstd, byte planes): {} = {:.3f} bytes per changed element; full model {} "
      "({:.1f}x smaller)\n",
      FormatBytes(payload_bytes),
      changed ? static_cast<double>(payload_bytes) / static_cast<double>(changed) : 0.0,
      FormatBytes(full_bytes),
      payload_bytes ? static_cast<double>(full_bytes) / static_cast<double>(payload_bytes) : 0.0);
  return Status::OK();
}

}  // namespace

void RegisterDiff(CLI::App& app, Status* result) {
  auto args = std::make_shared<DiffArgs>();
  CLI::App* cmd = app.add_subcommand(
      "diff", "Per-tensor changed counts and density between two checkpoints, and sizes");
  cmd->add_option("OLD", args->old_path, "Base checkpoint (safetensors)")->required();
  cmd->add_option("NEW", args->new_path, "New checkpoint (safetensors)")->required();
  cmd->add_flag("--json", args->json, "Print JSON instead of tables");
  cmd->add_option("--threads", args->threads, "Compare threads")->capture_default_str();
  cmd->callback([args, result] { *result = RunDiff(*args); });
}

}  // namespace refit::cli
