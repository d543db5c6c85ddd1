// refit encode OLD NEW -o DELTA.rfp: the changes from OLD to NEW as a payload file.
#include <algorithm>
#include <cstdio>

#include "cli_common.h"
#include "codec/tracker.h"
#include "config_file.h"
#include "pipeline/bucketing.h"
#include "pipeline/context_items.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "refit/stream_options.h"

namespace refit::cli {
namespace {

struct EncodeArgs {
  std::string old_path;
  std::string new_path;
  std::string output;
  std::string op = "xor";
  std::string add_dtype = "bfloat16";
  std::string force_encoding;
  // ProducerStreamOptions' default, which `refit push` also uses (sparse_bucket_size_bytes), so
  // that encode writes the payloads push sends for the same checkpoints and settings.
  std::string bucket = "8MiB";
  int level = 1;
  bool no_byte_planes = false;
  bool full = false;
  int threads = 1;
  std::string item_coding = "auto";
  // A payload file is stored bytes, kept and shipped later: priced, as an object store's.
  std::string link = "s3://";
};

Status RunEncode(const EncodeArgs& args) {
  REFIT_ASSIGN_OR_RETURN(auto old_file, SafetensorsFile::Open(args.old_path));
  REFIT_ASSIGN_OR_RETURN(auto new_file, SafetensorsFile::Open(args.new_path));
  TrackerOptions options;
  REFIT_ASSIGN_OR_RETURN(options.op, ParseOp(args.op));
  REFIT_ASSIGN_OR_RETURN(options.add_delta_dtype, ParseDType(args.add_dtype));
  if (!args.force_encoding.empty()) {
    REFIT_ASSIGN_OR_RETURN(options.force_location_encoding,
                           ParseLocationEncoding(args.force_encoding));
  }
  options.compare.threads = args.threads;
  options.initial_version = WeightVersionOf(*old_file);
  REFIT_ASSIGN_OR_RETURN(uint64_t bucket_bytes, config::ParseByteSize(args.bucket));
  REFIT_ASSIGN_OR_RETURN(auto tracker, internal::DeltaTracker::Make(options));

  for (const TensorView& tensor : old_file->tensors()) {
    if (!new_file->Find(tensor.name).ok()) {
      return InvalidArgument("tensor '{}' is in {} but not in {}", tensor.name, args.old_path,
                             args.new_path);
    }
  }
  // Receivers hold OLD: it becomes the committed baseline, unless --full.
  if (!args.full) {
    for (const TensorView& tensor : old_file->tensors()) {
      REFIT_RETURN_NOT_OK(tracker->AdoptBaseline(tensor));
    }
  }

  const TransferId id = TransferId::Random();
  REFIT_ASSIGN_OR_RETURN(TransferPlan plan, tracker->Begin(id, args.full));
  std::vector<Item> items;
  uint64_t changed = 0, total = 0;
  for (const TensorView& tensor : new_file->tensors()) {
    // As push's stream does: an anchor's FULL items in pieces of a bucket.
    const uint64_t numel = tensor.numel();
    const uint64_t piece =
        plan.anchor ? FullPieceElements(bucket_bytes, tensor.dtype) : std::max<uint64_t>(numel, 1);
    for (const auto& [begin, end] : CutSpans(numel, piece)) {
      REFIT_ASSIGN_OR_RETURN(internal::EncodeResult r, tracker->Encode(id, tensor, begin, end));
      changed += r.changed_elements;
      total += r.total_elements;
      for (Item& item : r.items) items.push_back(std::move(item));
    }
  }
  PayloadEncodeOptions encode_options;
  encode_options.zstd_level = args.level;
  encode_options.byte_planes = !args.no_byte_planes;
  REFIT_ASSIGN_OR_RETURN(const ItemCoding item_coding, ParseItemCoding(args.item_coding));
  internal::ItemCodingReport coding;
  if (!plan.anchor) {
    // As push's stream does: each XOR item coded given OLD (the baseline) where it pays.
    REFIT_ASSIGN_OR_RETURN(
        coding,
        internal::ChooseItemCoding(
            items, item_coding, args.link, encode_options,
            [&](const ItemView& item, std::span<const std::byte>* old_span) -> Result<bool> {
              REFIT_ASSIGN_OR_RETURN(TensorView old, tracker->Baseline(std::string(item.name)));
              const uint32_t width = DTypeSize(item.dtype);
              *old_span = old.bytes.subspan(item.span_begin * width,
                                            (item.span_end - item.span_begin) * width);
              return true;
            }));
  }
  const PayloadIds ids{id, 0, 0, plan.base_version, plan.target_version};
  // As push's stream does: a delta's payloads are cut at its smaller bucket.
  const uint64_t payload_bucket =
      plan.anchor ? bucket_bytes : std::min(bucket_bytes, kDefaultDeltaBucketBytes);
  REFIT_ASSIGN_OR_RETURN(auto payloads, PackPayloads(ids, items, payload_bucket, encode_options));
  REFIT_RETURN_NOT_OK(WriteFileAtomically(args.output, payloads));
  uint64_t wire = 0;
  for (const auto& p : payloads) wire += p.size();
  std::printf(
      "%s: %s transfer %s v%llu -> v%llu, %llu of %llu elements changed (%.4f%%), "
      "%zu items in %zu payloads, %llu bytes\n",
      args.output.c_str(), plan.anchor ? "FULL" : "delta", id.ToHex().c_str(),
      static_cast<unsigned long long>(plan.base_version),
      static_cast<unsigned long long>(plan.target_version),
      static_cast<unsigned long long>(changed), static_cast<unsigned long long>(total),
      total ? 100.0 * static_cast<double>(changed) / static_cast<double>(total) : 0.0, items.size(),
      payloads.size(), static_cast<unsigned long long>(wire));
  if (coding.candidates > 0) {
    std::printf(
        "  context coding (--item-coding %s, link %s): %llu of %llu items, %llu -> %llu "
        "item bytes\n",
        args.item_coding.c_str(), args.link.c_str(),
        static_cast<unsigned long long>(coding.context_coded),
        static_cast<unsigned long long>(coding.candidates),
        static_cast<unsigned long long>(coding.plain_bytes),
        static_cast<unsigned long long>(coding.sent_bytes));
  }
  return Status::OK();
}

}  // namespace

void RegisterEncode(CLI::App& app, Status* result) {
  auto args = std::make_shared<EncodeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "encode", "Write the changes from OLD to NEW (safetensors) as a payload file");
  cmd->add_option("OLD", args->old_path, "Base checkpoint (what receivers hold)")->required();
  cmd->add_option("NEW", args->new_path, "New checkpoint")->required();
  cmd->add_option("-o,--output", args->output, "Output payload file (.rfp)")->required();
  cmd->add_option("--op", args->op, "Value op: xor, overwrite or add")->capture_default_str();
  cmd->add_option("--add-dtype", args->add_dtype, "Delta dtype of --op add")->capture_default_str();
  cmd->add_option("--force-encoding", args->force_encoding,
                  "Pin the location encoding: range, gap16, gap32, gap64, bitmask");
  cmd->add_option(
         "--bucket", args->bucket,
         "Item bytes per payload, bucketed as push buckets them (sparse_bucket_size_bytes)")
      ->capture_default_str();
  cmd->add_option("--level", args->level, "zstd level")->capture_default_str();
  cmd->add_flag("--no-byte-planes", args->no_byte_planes, "Do not split values into byte planes");
  cmd->add_flag("--full", args->full, "Write a FULL (anchor) transfer of NEW");
  cmd->add_option("--threads", args->threads, "Compare threads")->capture_default_str();
  cmd->add_option("--item-coding", args->item_coding,
                  "Context-code XOR items (payload format v2: each change coded given the old "
                  "value): auto (where smaller by 5 % and the link pays for it), context, plain")
      ->capture_default_str();
  cmd->add_option("--link", args->link,
                  "The transport the file will travel by, for --item-coding auto (s3://: stored "
                  "and billed bytes; zmq://: a fast fabric, never)")
      ->capture_default_str();
  cmd->callback([args, result] { *result = RunEncode(*args); });
}

}  // namespace refit::cli
