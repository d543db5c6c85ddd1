// refit apply BASE DELTA.rfp -o OUT: apply a payload file to a checkpoint, all or nothing.
#include <cstdio>

#include <fmt/format.h>

#include "cli_common.h"
#include "receiver/apply.h"
#include "refit/status_format.h"
#include "refit/weight_store.h"

namespace refit::cli {
namespace {

struct ApplyArgs {
  std::string base_path;
  std::string payload_path;
  std::string output;
  bool mmap = false;
};

Status RunApply(const ApplyArgs& args) {
  REFIT_ASSIGN_OR_RETURN(auto base_file, SafetensorsFile::Open(args.base_path));
  const uint64_t base_version = WeightVersionOf(*base_file);
  base_file.reset();
  REFIT_ASSIGN_OR_RETURN(
      auto store,
      WeightStore::Open(args.base_path, args.mmap ? StoreMode::kMmap : StoreMode::kMemory));
  store->set_version(base_version);
  REFIT_ASSIGN_OR_RETURN(std::vector<std::byte> file, ReadFile(args.payload_path));
  REFIT_ASSIGN_OR_RETURN(auto payloads, SplitPayloadFile(file, PayloadLimits{}));
  if (payloads.empty()) return InvalidArgument("'{}' holds no payload", args.payload_path);

  internal::UndoLog undo;
  uint64_t target_version = 0;
  size_t items = 0;
  for (size_t i = 0; i < payloads.size(); ++i) {
    auto decoded = DecodePayload(payloads[i]);
    Status status = decoded.status();
    if (status.ok()) {
      const PayloadIds& ids = decoded->header().ids;
      if (ids.base_version != base_version) {
        status = FailedPrecondition("payload {} is based on version {} but '{}' is version {}",
                                    ids.payload_id, ids.base_version, args.base_path, base_version);
      } else if (i > 0 && ids.target_version != target_version) {
        status = InvalidArgument("payload {} targets version {}, the first payload {}",
                                 ids.payload_id, ids.target_version, target_version);
      } else {
        target_version = ids.target_version;
        status = internal::ApplyPayload(*decoded, *store, &undo);
        items += decoded->items().size();
      }
    }
    if (!status.ok()) {
      // Nothing is written, so nothing needs undoing on disk; roll back to keep the contract.
      REFIT_RETURN_NOT_OK(undo.Rollback(*store));
      return status.WithContext(fmt::format("'{}' payload #{}", args.payload_path, i));
    }
  }
  store->set_version(target_version);
  std::vector<TensorView> tensors = store->tensors();
  REFIT_RETURN_NOT_OK(WriteSafetensors(
      args.output, tensors, {{kWeightVersionMetadataKey, std::to_string(target_version)}}));
  std::printf("%s: applied %zu payloads (%zu items), version %llu -> %llu, digests verified\n",
              args.output.c_str(), payloads.size(), items,
              static_cast<unsigned long long>(base_version),
              static_cast<unsigned long long>(target_version));
  return Status::OK();
}

}  // namespace

void RegisterApply(CLI::App& app, Status* result) {
  auto args = std::make_shared<ApplyArgs>();
  CLI::App* cmd =
      app.add_subcommand("apply", "Apply a payload file to BASE and write the result to OUT");
  cmd->add_option("BASE", args->base_path, "Base checkpoint (safetensors)")->required();
  cmd->add_option("DELTA", args->payload_path, "Payload file (.rfp)")->required();
  cmd->add_option("-o,--output", args->output, "Output checkpoint")->required();
  cmd->add_flag("--mmap", args->mmap, "Map BASE copy-on-write instead of reading it");
  cmd->callback([args, result] { *result = RunApply(*args); });
}

}  // namespace refit::cli
