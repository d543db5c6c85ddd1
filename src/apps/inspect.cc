// refit inspect FILE.rfp: headers, items and sizes of a payload file.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <iostream>

#include "cli_common.h"
#include "progress.h"
#include "table.h"

namespace refit::cli {
namespace {

struct InspectArgs {
  std::string path;
  bool json = false;
};

std::string ChecksumHex(const std::array<uint8_t, 16>& checksum) {
  std::string out;
  for (uint8_t b : checksum) out += fmt::format("{:02x}", b);
  return out;
}

Status RunInspect(const InspectArgs& args) {
  REFIT_ASSIGN_OR_RETURN(std::vector<std::byte> file, ReadFile(args.path));
  REFIT_ASSIGN_OR_RETURN(auto payloads, SplitPayloadFile(file, PayloadLimits{}));
  nlohmann::json report = nlohmann::json::array();
  for (size_t p = 0; p < payloads.size(); ++p) {
    REFIT_ASSIGN_OR_RETURN(DecodedPayload decoded, DecodePayload(payloads[p]));
    const PayloadHeader& h = decoded.header();
    nlohmann::json entry = {{"format_version", h.format_version},
                            {"flags", h.flags},
                            {"transfer_id", h.ids.transfer_id.ToHex()},
                            {"producer_id", h.ids.producer_id},
                            {"payload_id", h.ids.payload_id},
                            {"base_version", h.ids.base_version},
                            {"target_version", h.ids.target_version},
                            {"item_count", h.item_count},
                            {"body_bytes", h.body_bytes},
                            {"compressed_bytes", h.compressed_bytes},
                            {"checksum_xxh3_128", ChecksumHex(h.checksum)},
                            {"items", nlohmann::json::array()}};
    Table table({"#", "tensor", "dtype", "shape", "op", "span", "count", "encoding", "locations",
                 "values"});
    for (size_t i = 0; i < decoded.items().size(); ++i) {
      const ItemView& item = decoded.items()[i];
      entry["items"].push_back({{"name", item.name},
                                {"dtype", DTypeName(item.dtype)},
                                {"shape", item.shape},
                                {"op", OpName(item.op)},
                                {"value_dtype", DTypeName(item.value_dtype)},
                                {"span", {item.span_begin, item.span_end}},
                                {"count", item.count},
                                {"location_encoding", LocationEncodingName(item.location_encoding)},
                                {"location_bytes", item.locations.size()},
                                {"value_bytes", item.values.size()},
                                {"digest", fmt::format("{:016x}", item.digest)}});
      table.AddRow({std::to_string(i), std::string(item.name), std::string(DTypeName(item.dtype)),
                    ShapeToString(item.shape), std::string(OpName(item.op)),
                    fmt::format("[{}, {})", item.span_begin, item.span_end),
                    std::to_string(item.count),
                    std::string(LocationEncodingName(item.location_encoding)),
                    FormatBytes(item.locations.size()), FormatBytes(item.values.size())});
    }
    if (!args.json) {
      std::cout << fmt::format(
          "payload {} of producer {} (format v{}, flags {:#x})\n  transfer {}  version {} -> {}\n"
          "  {} items, body {} -> {} compressed ({:.2f}x), checksum {}\n",
          h.ids.payload_id, h.ids.producer_id, h.format_version, h.flags, h.ids.transfer_id.ToHex(),
          h.ids.base_version, h.ids.target_version, h.item_count, FormatBytes(h.body_bytes),
          FormatBytes(h.compressed_bytes),
          h.compressed_bytes
              ? static_cast<double>(h.body_bytes) / static_cast<double>(h.compressed_bytes)
              : 0.0,
          ChecksumHex(h.checksum));
      table.Print(std::cout);
      if (decoded.has_context_items()) {
        std::cout << "  context: the item's locations and values coded given the old values "
                     "(format v2); it decodes only against the payload's base\n";
      }
      std::cout << "\n";
    }
    report.push_back(std::move(entry));
  }
  if (args.json) std::cout << report.dump(2) << "\n";
  return Status::OK();
}

}  // namespace

void RegisterInspect(CLI::App& app, Status* result) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* cmd = app.add_subcommand("inspect", "Show the headers and items of a payload file");
  cmd->add_option("FILE", args->path, "Payload file (.rfp)")->required();
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, result] { *result = RunInspect(*args); });
}

}  // namespace refit::cli
