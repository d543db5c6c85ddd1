// The tp section (sections.h): one replica unsharded, then as TP = 2, 4 shard groups of
// `refit serve --loader --replica` daemons over a Llama-layout model; time per refit against the
// unsharded one, the bytes each shard receives, and each shard's memory against its slice.
#include "e2e/sections.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bench_util.h"
#include "e2e/harness.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "table.h"

namespace refit::bench::e2e {
namespace {

// The TP target: a TP = 4 replica's refit time within this factor of an unsharded one's (the
// issue's figure), and the TP degree it is stated at.
constexpr double kTargetTpSlowdown = 1.3;
constexpr uint32_t kTargetTp = 4;
// The routing target: the bytes a TP = 4 shard receives, within this fraction of what an
// unsharded receiver receives for the same delta.
constexpr double kTargetTpReceived = 0.3;
// The replica name of the tp section's shard group.
constexpr const char* kTpReplica = "replica-0";
// Attention head width the tp section's loader assumes (Llama's 128 at full size; the bench's
// small models use 64, halved until the heads divide among every TP degree asked for).
constexpr uint64_t kHeadDim = 64;
// Vocabulary padding multiple per TP rank of the vocabulary-parallel rule (Megatron / vLLM).
constexpr uint64_t kVocabPadTo = 64;

std::vector<TensorView> ViewsOf(const std::vector<OwnedTensor>& tensors) {
  std::vector<TensorView> views;
  for (const OwnedTensor& tensor : tensors) views.push_back(tensor.view());
  return views;
}

uint64_t BytesOf(const std::vector<TensorView>& tensors) {
  uint64_t bytes = 0;
  for (const TensorView& tensor : tensors) bytes += tensor.bytes.size();
  return bytes;
}

// Per daemon: reset its peak RSS and read its RSS (before a refit), or read its peak (after).
// Without a reset (no clear_refs) a peak is the peak since the daemon started.
struct DaemonMemory {
  bool reset = true;
  std::vector<uint64_t> before;
  std::vector<uint64_t> peak;
};

Result<DaemonMemory> OpenDaemonMemory(const testkit::LocalFleet& group) {
  DaemonMemory memory;
  for (const testkit::LocalReceiver& daemon : group.receivers()) {
    const std::string pid = std::to_string(daemon.pid);
    if (Status reset = testkit::ResetPeakRss(pid); !reset.ok() && memory.reset) {
      memory.reset = false;
      std::cerr << "warning: " << reset.message()
                << "; peak RSS figures are peaks since the daemon started\n";
    }
    REFIT_ASSIGN_OR_RETURN(uint64_t rss, testkit::ProcessMemoryBytes(pid, "VmRSS"));
    memory.before.push_back(rss);
  }
  return memory;
}

Status CloseDaemonMemory(const testkit::LocalFleet& group, DaemonMemory* memory) {
  for (const testkit::LocalReceiver& daemon : group.receivers()) {
    REFIT_ASSIGN_OR_RETURN(uint64_t peak,
                           testkit::ProcessMemoryBytes(std::to_string(daemon.pid), "VmHWM"));
    memory->peak.push_back(peak);
  }
  return Status::OK();
}

// The dimensions of a MakeTransformerSpec model, read from its tensors, and the attention heads
// the tp section's loader assumes (MakeTransformerSpec's k and v are [hidden, hidden]: as many
// kv heads as heads).
struct LlamaLayout {
  uint64_t hidden = 0;
  uint64_t intermediate = 0;
  uint64_t vocab = 0;
  uint64_t layers = 0;
  uint64_t heads = 0;
};

Result<LlamaLayout> DescribeLlama(const std::vector<TensorView>& model,
                                  const std::vector<uint32_t>& degrees) {
  LlamaLayout layout;
  for (const TensorView& tensor : model) {
    if (tensor.name == "model.embed_tokens.weight" && tensor.shape.size() == 2) {
      layout.vocab = static_cast<uint64_t>(tensor.shape[0]);
      layout.hidden = static_cast<uint64_t>(tensor.shape[1]);
    } else if (tensor.name.ends_with(".mlp.gate_proj.weight") && tensor.shape.size() == 2) {
      layout.intermediate = static_cast<uint64_t>(tensor.shape[0]);
    } else if (tensor.name.ends_with(".input_layernorm.weight")) {
      ++layout.layers;
    }
  }
  if (layout.hidden == 0 || layout.intermediate == 0 || layout.layers == 0) {
    return InvalidArgument("tp: the model has no Llama layout (embedding, layers, MLP)");
  }
  const auto divides_all = [&](uint64_t heads) {
    return std::all_of(degrees.begin(), degrees.end(),
                       [heads](uint32_t tp) { return heads % tp == 0; });
  };
  layout.heads = std::max<uint64_t>(1, layout.hidden / kHeadDim);
  while (!divides_all(layout.heads) && layout.hidden % (2 * layout.heads) == 0) layout.heads *= 2;
  for (uint32_t tp : degrees) {
    if (layout.heads % tp != 0 || layout.intermediate % tp != 0 || layout.hidden % tp != 0) {
      return InvalidArgument(
          "--tp {}: the model's {} heads (hidden {}) and MLP width {} do not divide among {} "
          "shards; use other degrees or --tp-model-mib",
          tp, layout.heads, layout.hidden, layout.intermediate, tp);
    }
  }
  return layout;
}

// The vocabulary rows of each shard's embedding and lm_head: V rounded up to kVocabPadTo × TP.
uint64_t PaddedVocabulary(const LlamaLayout& layout, uint32_t tp) {
  const uint64_t multiple = kVocabPadTo * tp;
  return (layout.vocab + multiple - 1) / multiple * multiple;
}

// The loader spec of shard `rank` of `tp` (include/refit/loader.h): fused qkv and gate_up (row
// blocks), o_proj and down_proj split by columns, vocabulary-parallel embedding and lm_head; the
// norms are replicated in every shard (the identity fallback).
std::string LoaderYaml(const LlamaLayout& layout, uint32_t rank, uint32_t tp) {
  return fmt::format(R"(tp_rank: {}
tp_size: {}
rules:
  - kind: qkv
    q: 'model\.layers\.(\d+)\.self_attn\.q_proj\.weight'
    k: 'model\.layers\.(\d+)\.self_attn\.k_proj\.weight'
    v: 'model\.layers\.(\d+)\.self_attn\.v_proj\.weight'
    to: 'model.layers.$1.self_attn.qkv_proj.weight'
    num_heads: {}
    num_kv_heads: {}
  - kind: gate_up
    gate: 'model\.layers\.(\d+)\.mlp\.gate_proj\.weight'
    up: 'model\.layers\.(\d+)\.mlp\.up_proj\.weight'
    to: 'model.layers.$1.mlp.gate_up_proj.weight'
  - {{kind: column, match: 'model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight'}}
  - {{kind: vocab, match: 'model\.embed_tokens\.weight|lm_head\.weight', vocab_size: {}, pad_to: {}}}
)",
                     rank, tp, layout.heads, layout.heads, layout.vocab, kVocabPadTo);
}

// Shard `rank` of `tp` of the canonical `model` in the layout LoaderYaml describes, computed here
// from the layout's definition (as vLLM lays out its weights), not through the loader: the
// daemons' flush then checks the loader against it, by the replica's piece digests, and the
// final download byte for byte.
std::vector<OwnedTensor> ShardModel(const std::vector<TensorView>& model, const LlamaLayout& layout,
                                    uint32_t rank, uint32_t tp) {
  std::map<std::string, const TensorView*, std::less<>> by_name;
  for (const TensorView& tensor : model) by_name[tensor.name] = &tensor;
  // Append rows [begin, begin + count) of `tensor`, seen as 2-D [shape[0], rest], to `out`.
  const auto append_rows = [](const TensorView& tensor, uint64_t begin, uint64_t count,
                              std::vector<std::byte>* out) {
    const uint64_t row_bytes = tensor.bytes.size() / static_cast<uint64_t>(tensor.shape[0]);
    out->insert(out->end(), tensor.bytes.begin() + begin * row_bytes,
                tensor.bytes.begin() + (begin + count) * row_bytes);
  };
  const auto prefix_of = [](const std::string& name, std::string_view suffix) {
    return name.substr(0, name.size() - suffix.size());
  };
  std::vector<OwnedTensor> shard;
  for (const TensorView& tensor : model) {
    const std::string& name = tensor.name;
    const uint64_t rows = static_cast<uint64_t>(tensor.shape[0]);
    OwnedTensor local{name, tensor.dtype, tensor.shape, {}};
    if (name.ends_with(".self_attn.q_proj.weight")) {
      // [q rows of the rank's heads | k rows of its kv heads | v rows of its kv heads].
      const std::string prefix = prefix_of(name, "q_proj.weight");
      const uint64_t block = rows / tp;
      local.name = prefix + "qkv_proj.weight";
      local.shape = {static_cast<int64_t>(3 * block), tensor.shape[1]};
      for (std::string_view part : {"q_proj.weight", "k_proj.weight", "v_proj.weight"}) {
        append_rows(*by_name.at(prefix + std::string(part)), rank * block, block, &local.bytes);
      }
    } else if (name.ends_with(".self_attn.k_proj.weight") ||
               name.ends_with(".self_attn.v_proj.weight") ||
               name.ends_with(".mlp.up_proj.weight")) {
      continue;  // Fused into qkv_proj or gate_up_proj above.
    } else if (name.ends_with(".mlp.gate_proj.weight")) {
      // [gate rows block r | up rows block r].
      const std::string prefix = prefix_of(name, "gate_proj.weight");
      const uint64_t block = rows / tp;
      local.name = prefix + "gate_up_proj.weight";
      local.shape = {static_cast<int64_t>(2 * block), tensor.shape[1]};
      append_rows(tensor, rank * block, block, &local.bytes);
      append_rows(*by_name.at(prefix + "up_proj.weight"), rank * block, block, &local.bytes);
    } else if (name.ends_with(".self_attn.o_proj.weight") ||
               name.ends_with(".mlp.down_proj.weight")) {
      // Column block r of every row.
      const uint64_t cols = static_cast<uint64_t>(tensor.shape[1]);
      const uint64_t block = cols / tp;
      const uint64_t width = tensor.bytes.size() / (rows * cols);
      local.shape = {tensor.shape[0], static_cast<int64_t>(block)};
      local.bytes.reserve(rows * block * width);
      for (uint64_t row = 0; row < rows; ++row) {
        const auto begin = tensor.bytes.begin() + (row * cols + rank * block) * width;
        local.bytes.insert(local.bytes.end(), begin, begin + block * width);
      }
    } else if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
      // Padded rows [r·Vp/TP, (r+1)·Vp/TP); rows past the vocabulary are zero padding.
      const uint64_t block = PaddedVocabulary(layout, tp) / tp;
      const uint64_t begin = rank * block;
      const uint64_t held = begin < rows ? std::min(block, rows - begin) : 0;
      local.shape = {static_cast<int64_t>(block), tensor.shape[1]};
      append_rows(tensor, begin, held, &local.bytes);
      local.bytes.resize(block * (tensor.bytes.size() / rows), std::byte{0});
    } else {
      local.bytes.assign(tensor.bytes.begin(), tensor.bytes.end());  // Replicated (norms).
    }
    shard.push_back(std::move(local));
  }
  return shard;
}

// Elements (2-byte) that differ between two versions of one shard.
uint64_t CountChanged(const std::vector<OwnedTensor>& before,
                      const std::vector<OwnedTensor>& after) {
  uint64_t changed = 0;
  for (size_t t = 0; t < before.size(); ++t) {
    const size_t n = before[t].bytes.size() / sizeof(uint16_t);
    const auto* old_bits = reinterpret_cast<const uint16_t*>(before[t].bytes.data());
    const auto* new_bits = reinterpret_cast<const uint16_t*>(after[t].bytes.data());
    for (size_t i = 0; i < n; ++i) changed += old_bits[i] != new_bits[i];
  }
  return changed;
}

}  // namespace

Result<nlohmann::json> RunTensorParallel(const Args& args, const std::string& work_dir) {
  nlohmann::json out;
  const uint64_t chunk_bytes = SectionChunkBytes(args.tp_model_bytes);
  REFIT_ASSIGN_OR_RETURN(SyntheticModel model, SyntheticModel::Make(args.tp_model_bytes, args.seed,
                                                                    args.threads, nullptr));
  REFIT_ASSIGN_OR_RETURN(const LlamaLayout layout, DescribeLlama(model.views(), args.tp));
  out["model_bytes"] = model.bytes();
  out["tensors"] = model.views().size();
  out["layout"] = {{"hidden", layout.hidden},
                   {"intermediate", layout.intermediate},
                   {"vocab", layout.vocab},
                   {"layers", layout.layers},
                   {"heads", layout.heads},
                   {"kv_heads", layout.heads},
                   {"head_dim", layout.hidden / layout.heads},
                   {"vocab_pad_to", kVocabPadTo}};
  out["chunk_bytes"] = chunk_bytes;
  out["steps"] = args.steps;
  out["step_density"] = args.step_density;
  REFIT_ASSIGN_OR_RETURN(const std::string config_path,
                         WriteRefitConfig(args, work_dir, "tp", chunk_bytes));

  std::vector<uint32_t> degrees = {1};
  degrees.insert(degrees.end(), args.tp.begin(), args.tp.end());
  std::unique_ptr<ProgressReporter> progress = Progress("tp", degrees.size(), "layouts");
  out["rows"] = nlohmann::json::array();
  for (size_t c = 0; c < degrees.size(); ++c) {
    const uint32_t tp = degrees[c];
    // The same initial model and the same steps for every layout: identical deltas.
    if (c > 0) {
      REFIT_ASSIGN_OR_RETURN(
          model, SyntheticModel::Make(args.tp_model_bytes, args.seed, args.threads, nullptr));
    }
    const std::string label = fmt::format("tp{}", tp);
    std::vector<std::vector<OwnedTensor>> shards;
    std::vector<testkit::LocalReceiverSpec> specs;
    std::vector<uint64_t> slice_bytes;
    if (tp == 1) {
      specs.push_back({fmt::format("{}/{}-model.safetensors", work_dir, label), "", ""});
      REFIT_RETURN_NOT_OK(
          WriteSafetensors(specs[0].model_path, model.views(), {{kWeightVersionMetadataKey, "0"}}));
      slice_bytes.push_back(model.bytes());
    } else {
      for (uint32_t rank = 0; rank < tp; ++rank) {
        shards.push_back(ShardModel(model.views(), layout, rank, tp));
        testkit::LocalReceiverSpec spec{
            fmt::format("{}/{}-shard-{}.safetensors", work_dir, label, rank),
            fmt::format("{}/{}-loader-{}.yaml", work_dir, label, rank), kTpReplica};
        REFIT_RETURN_NOT_OK(WriteSafetensors(spec.model_path, ViewsOf(shards.back()),
                                             {{kWeightVersionMetadataKey, "0"}}));
        REFIT_RETURN_NOT_OK(
            testkit::WriteTextFileAtomically(spec.loader_path, LoaderYaml(layout, rank, tp)));
        slice_bytes.push_back(BytesOf(ViewsOf(shards.back())));
        specs.push_back(std::move(spec));
      }
    }
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<testkit::LocalFleet> daemons,
                           StartDaemons(args, work_dir, label, specs));
    for (const testkit::LocalReceiverSpec& spec : specs) std::filesystem::remove(spec.model_path);
    std::vector<uint64_t> loaded_rss;
    for (const testkit::LocalReceiver& daemon : daemons->receivers()) {
      REFIT_ASSIGN_OR_RETURN(uint64_t rss,
                             testkit::ProcessMemoryBytes(std::to_string(daemon.pid), "VmRSS"));
      loaded_rss.push_back(rss);
    }
    REFIT_ASSIGN_OR_RETURN(const PublisherOptions options,
                           PublisherOptionsFromConfig(config_path, PublisherReceivers(*daemons)));
    REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Publisher>> ranks,
                           MakeThreadRanks(1, options));
    REFIT_RETURN_NOT_OK(AdoptBaseline(ranks, model.views()));
    // Warm-up, not measured: one delta (step 0, the same for every layout), so that no measured
    // step pays the daemons' first transfer (first-touch pages of the apply path, connections).
    REFIT_RETURN_NOT_OK(model.Step(/*step=*/0, args.step_density).status());
    REFIT_RETURN_NOT_OK(SyncDelta(ranks, model.views()).status().WithContext("warm-up"));
    for (uint32_t rank = 0; rank < shards.size(); ++rank) {
      shards[rank] = ShardModel(model.views(), layout, rank, tp);
    }

    std::vector<SyncStep> steps;
    nlohmann::json step_rows = nlohmann::json::array();
    // Per shard, over the steps: the largest peak and growth, the changes to its slice, and its
    // growth per own change.
    std::vector<uint64_t> max_peak(tp, 0), max_growth(tp, 0), own_changed(tp, 0);
    std::vector<std::vector<double>> growth_per_own(tp), growth_per_changed(tp);
    std::vector<double> received_per_step(tp, 0);
    bool rss_reset = true;
    for (uint64_t s = 1; s <= args.steps; ++s) {
      REFIT_ASSIGN_OR_RETURN(DaemonMemory memory, OpenDaemonMemory(*daemons));
      rss_reset = rss_reset && memory.reset;
      REFIT_ASSIGN_OR_RETURN(const uint64_t changed, model.Step(s, args.step_density));
      const double t0 = Now();
      REFIT_ASSIGN_OR_RETURN(RefitReport report, SyncDelta(ranks, model.views()));
      const double wall = Now() - t0;
      REFIT_RETURN_NOT_OK(CloseDaemonMemory(*daemons, &memory));
      if (report.changed_elements != changed) {
        return DataLoss("tp {}: step {} changed {} elements but the producer found {}", tp, s,
                        changed, report.changed_elements);
      }
      std::vector<uint64_t> own(tp, changed);
      if (tp > 1) {
        for (uint32_t rank = 0; rank < tp; ++rank) {
          std::vector<OwnedTensor> next = ShardModel(model.views(), layout, rank, tp);
          own[rank] = CountChanged(shards[rank], next);
          shards[rank] = std::move(next);
        }
      }
      steps.push_back(StepFromReport(report, changed, wall));
      nlohmann::json step = StepJson(steps.back());
      step["shards"] = nlohmann::json::array();
      for (uint32_t rank = 0; rank < tp; ++rank) {
        const int64_t growth =
            static_cast<int64_t>(memory.peak[rank]) - static_cast<int64_t>(memory.before[rank]);
        step["shards"].push_back({{"shard", rank},
                                  {"rss_before", memory.before[rank]},
                                  {"peak_rss", memory.peak[rank]},
                                  {"growth_bytes", growth},
                                  {"own_changed", own[rank]}});
        max_peak[rank] = std::max(max_peak[rank], memory.peak[rank]);
        max_growth[rank] = std::max<uint64_t>(max_growth[rank], std::max<int64_t>(growth, 0));
        own_changed[rank] += own[rank];
        if (own[rank] > 0) {
          growth_per_own[rank].push_back(static_cast<double>(growth) / own[rank]);
        }
        if (changed > 0) {
          growth_per_changed[rank].push_back(static_cast<double>(growth) / changed);
        }
      }
      step_rows.push_back(std::move(step));
    }
    // Every shard holds exactly its slice of the last model.
    for (size_t d = 0; d < daemons->receivers().size(); ++d) {
      REFIT_RETURN_NOT_OK(CheckReceiverHolds(daemons->receivers()[d].control_url,
                                             tp == 1 ? model.views() : ViewsOf(shards[d])));
    }
    REFIT_RETURN_NOT_OK(daemons->Stop());

    nlohmann::json row = {{"tp", tp},
                          {"layout", tp == 1 ? "unsharded" : fmt::format("TP={}", tp)},
                          {"shards", tp},
                          {"time_s", Spread(steps, &SyncStep::time_s)},
                          {"wall_s", Spread(steps, &SyncStep::wall_s)},
                          {"rss_reset_per_refit", rss_reset},
                          {"verified_bit_identical", true},
                          {"steps", step_rows},
                          {"per_shard", nlohmann::json::array()}};
    uint64_t wire = 0, payloads = 0;
    for (const SyncStep& step : steps) {
      wire += step.wire_bytes;
      payloads += step.payloads;
    }
    row["wire_bytes_per_step"] = static_cast<double>(wire) / steps.size();
    row["payloads_per_step"] = static_cast<double>(payloads) / steps.size();
    row["routes"] = steps.back().routes;
    for (uint32_t rank = 0; rank < tp; ++rank) {
      uint64_t received = 0;
      for (const SyncStep& step : steps) {
        if (rank < step.received_bytes.size()) received += step.received_bytes[rank];
      }
      received_per_step[rank] = static_cast<double>(received) / steps.size();
    }
    for (uint32_t rank = 0; rank < tp; ++rank) {
      const double own_per_step = static_cast<double>(own_changed[rank]) / steps.size();
      const double changed_per_step = row["steps"][0]["changed"].get<double>();
      const int64_t over_loaded =
          static_cast<int64_t>(max_peak[rank]) - static_cast<int64_t>(loaded_rss[rank]);
      row["per_shard"].push_back(
          {{"shard", rank},
           {"slice_bytes", slice_bytes[rank]},
           {"rss_loaded", loaded_rss[rank]},
           {"loaded_over_slice_bytes",
            static_cast<int64_t>(loaded_rss[rank]) - static_cast<int64_t>(slice_bytes[rank])},
           {"max_peak_rss", max_peak[rank]},
           {"peak_over_loaded_bytes", over_loaded},
           {"peak_over_loaded_per_own_changed",
            own_per_step > 0 ? over_loaded / own_per_step : 0.0},
           {"peak_over_loaded_per_changed",
            changed_per_step > 0 ? over_loaded / changed_per_step : 0.0},
           {"peak_over_slice_bytes",
            static_cast<int64_t>(max_peak[rank]) - static_cast<int64_t>(slice_bytes[rank])},
           {"peak_over_slice_ratio",
            static_cast<double>(max_peak[rank]) / static_cast<double>(slice_bytes[rank])},
           {"max_growth_bytes", max_growth[rank]},
           {"own_changed_per_step", own_per_step},
           {"received_bytes_per_step", received_per_step[rank]},
           {"growth_per_own_changed_median", Median(growth_per_own[rank])},
           {"growth_per_changed_median", Median(growth_per_changed[rank])}});
    }
    out["rows"].push_back(std::move(row));
    if (progress) progress->Advance(1);
  }
  if (progress) progress->Finish();

  // Against the unsharded replica: time ratios, and the bytes each shard receives (the same
  // deltas to any layout; routed by holdings, a shard receives only its cut).
  const double unsharded_s = out["rows"][0]["time_s"]["median"];
  const double unsharded_received =
      out["rows"][0]["per_shard"][0]["received_bytes_per_step"].get<double>();
  bool changed_identical = true;
  for (nlohmann::json& row : out["rows"]) {
    row["time_over_unsharded"] =
        row["time_s"]["median"].get<double>() / std::max(unsharded_s, 1e-9);
    double received = 0;
    for (const nlohmann::json& shard : row["per_shard"]) {
      received = std::max(received, shard["received_bytes_per_step"].get<double>());
    }
    row["received_over_unsharded"] = received / std::max(unsharded_received, 1.0);
    for (size_t s = 0; s < row["steps"].size(); ++s) {
      changed_identical =
          changed_identical && row["steps"][s]["changed"] == out["rows"][0]["steps"][s]["changed"];
    }
  }
  out["changed_identical_across_layouts"] = changed_identical;
  out["target"] = {{"tp", kTargetTp},
                   {"max_time_over_unsharded", kTargetTpSlowdown},
                   {"max_received_over_unsharded", kTargetTpReceived}};
  out["target"]["met"] = nullptr;
  out["target"]["received_met"] = nullptr;
  for (const nlohmann::json& row : out["rows"]) {
    if (row["tp"] == kTargetTp) {
      const double ratio = row["time_over_unsharded"];
      out["target"]["time_over_unsharded"] = ratio;
      out["target"]["met"] = ratio <= kTargetTpSlowdown;
      const double received = row["received_over_unsharded"];
      out["target"]["received_over_unsharded"] = received;
      out["target"]["received_met"] = received <= kTargetTpReceived;
    }
  }
  return out;
}

void PrintTensorParallel(const nlohmann::json& section) {
  const nlohmann::json& layout = section["layout"];
  std::cout << fmt::format(
      "== tp shard groups: Llama-layout bf16 model {} ({} tensors: hidden {}, {} layers, {} heads "
      "of {}, MLP {}, vocabulary {}), 1 producer -> one replica, unsharded or as a TP group of "
      "`refit serve --loader --replica` shard daemons (fused qkv and gate_up, column-split o/down, "
      "vocabulary-parallel embedding and lm_head padded to {} x TP); {} delta steps at {:.0f}%, "
      "the same deltas for every layout\n",
      FormatBytes(section["model_bytes"]), section["tensors"].get<size_t>(),
      layout["hidden"].get<uint64_t>(), layout["layers"].get<uint64_t>(),
      layout["heads"].get<uint64_t>(), layout["head_dim"].get<uint64_t>(),
      layout["intermediate"].get<uint64_t>(), layout["vocab"].get<uint64_t>(),
      layout["vocab_pad_to"].get<uint64_t>(), section["steps"].get<uint64_t>(),
      100 * section["step_density"].get<double>());
  Table table({"layout", "shards", "slice/shard", "payloads", "wire/step", "recv/shard",
               "recv vs unsharded", "time", "min", "max", "vs unsharded", "own changes",
               "loaded-slice", "shard peak", "peak/slice", "peak-loaded", "per own", "per change"});
  for (const nlohmann::json& row : section["rows"]) {
    // The largest shard figures of the row (shard 0's for the unsharded replica).
    uint64_t slice = 0, peak = 0;
    int64_t fixed = 0, over = 0;
    double ratio = 0, own = 0, per_own = 0, per_changed = 0, received = 0;
    for (const nlohmann::json& shard : row["per_shard"]) {
      received = std::max(received, shard["received_bytes_per_step"].get<double>());
      slice = std::max(slice, shard["slice_bytes"].get<uint64_t>());
      peak = std::max(peak, shard["max_peak_rss"].get<uint64_t>());
      fixed = std::max(fixed, shard["loaded_over_slice_bytes"].get<int64_t>());
      over = std::max(over, shard["peak_over_loaded_bytes"].get<int64_t>());
      ratio = std::max(ratio, shard["peak_over_slice_ratio"].get<double>());
      own = std::max(own, shard["own_changed_per_step"].get<double>());
      per_own = std::max(per_own, shard["peak_over_loaded_per_own_changed"].get<double>());
      per_changed = std::max(per_changed, shard["peak_over_loaded_per_changed"].get<double>());
    }
    table.AddRow({row["layout"].get<std::string>(), std::to_string(row["shards"].get<uint32_t>()),
                  FormatBytes(slice), fmt::format("{:.1f}", row["payloads_per_step"].get<double>()),
                  FormatBytes(static_cast<uint64_t>(row["wire_bytes_per_step"].get<double>())),
                  FormatBytes(static_cast<uint64_t>(received)),
                  fmt::format("{:.2f}", row["received_over_unsharded"].get<double>()),
                  FormatDuration(row["time_s"]["median"]), FormatDuration(row["time_s"]["min"]),
                  FormatDuration(row["time_s"]["max"]),
                  fmt::format("{:.2f}x", row["time_over_unsharded"].get<double>()),
                  fmt::format("{:.0f}", own), SignedBytes(fixed), FormatBytes(peak),
                  fmt::format("{:.2f}", ratio), SignedBytes(over), fmt::format("{:.1f} B", per_own),
                  fmt::format("{:.1f} B", per_changed)});
  }
  table.Print(std::cout);
  const nlohmann::json& target = section["target"];
  if (target["met"].is_null()) {
    std::cout << fmt::format(
        "target: a TP={} replica's refit time within {:.1f}x of an unsharded one: not measured "
        "(no {} in --tp)\n",
        kTargetTp, kTargetTpSlowdown, kTargetTp);
  } else {
    std::cout << fmt::format(
        "target: a TP={} replica's refit time within {:.1f}x of an unsharded one: {:.2f}x "
        "measured -> {}\n",
        kTargetTp, kTargetTpSlowdown, target["time_over_unsharded"].get<double>(),
        target["met"].get<bool>() ? "met" : "NOT MET");
    std::cout << fmt::format(
        "target: the bytes a TP={} shard receives within {:.2f}x of an unsharded receiver's: "
        "{:.2f}x measured -> {}\n",
        kTargetTp, kTargetTpReceived, target["received_over_unsharded"].get<double>(),
        target["received_met"].get<bool>() ? "met" : "NOT MET");
  }
  std::cout << fmt::format(
      "time = median over the steps of the Publisher's Coordinator::Refit (Begin to the end of "
      "commit), every shard's flush verified as one replica by its canonical piece digests. "
      "Shard figures are the largest over the shards (and steps), each shard a daemon process of "
      "its own: slice = the bytes of its own tensors; own changes = elements of its slice a step "
      "changed; loaded-slice = its RSS once loaded minus the slice (libraries, digests); shard "
      "peak = its peak RSS during a delta (VmHWM reset before each); peak-loaded = that peak "
      "minus its RSS once loaded: the refits' memory; per own, per change = peak-loaded per own "
      "change, per change of the whole model (per step); recv/shard = the wire bytes the largest "
      "shard was sent per step (payloads are routed by holdings: each class of shards gets only "
      "its cut)\n"
      "changed elements identical for every layout: {}; every shard's tensors downloaded and "
      "equal to its slice computed independently of the loader\n\n",
      section["changed_identical_across_layouts"].get<bool>() ? "yes" : "NO");
}

}  // namespace refit::bench::e2e
